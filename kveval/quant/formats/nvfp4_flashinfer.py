"""NVFP4 as FlashInfer's ``nvfp4_kv_quantize`` writes it: SGLang's NVFP4 KV cache on SM100/SM120
(``--kv-cache-dtype nvfp4``, ``NVFP4KVQuantizeUtil.quantize`` in SGLang 0.5.23
``srt/layers/quantization/kvfp4_tensor.py`` L143-215, which calls ``flashinfer.nvfp4_kv_quantize(x,
global_scale)`` with the layer's global scale "directly (not inverted)").

Source: flashinfer-ai/flashinfer @0c33fb6 ``csrc/fp4_kv_quantization.cu``, ``quantize_fp16_to_e2m1_with_scaling``.
Per block of 16 elements of head_dim, float32, with the global scale s_t (the layer's k/v scale, the
dequantization multiplier)::

    SF  = e4m3_satfinite_rne(rcp(s_t) * (amax * rcp(6)))
    out = rcp(float(SF) * s_t)       (0 when amax = 0)
    codes = e2m1_rne(x * out)        (cvt.rn.satfinite.e2m1x2.f32)
    x^  = value(code) * float(SF) * s_t

The same two levels and layout as vLLM's ``nvfp4`` (``kveval/quant/formats/fp4.py``), whose store kernel
computes ``g = 1.0f / k_scale`` and ``out = rcp(float(SF) * rcp(g))``: the two encode multipliers differ in their
last bit when ``rcp(rcp(s_t)) != s_t``, which moves a code only where ``x * out`` lies on a rounding boundary; with
s_t = 1.0 (no checkpoint scales) they are identical. Not reproduced: a block whose max is not 0 but whose scale
rounds to E4M3 0 (amax < 6 * 2^-10 * s_t) gets ``rcp(0) = inf`` in FlashInfer (codes of +-6, NaN for zeros);
kveval codes it as zeros, as vLLM does. ``rcp.approx.ftz.f32`` is taken as the correctly rounded reciprocal.

Calibrated (a scales file) s_t is ``amax / 448``, what SGLang's SM100 kernels expect (it multiplies a
checkpoint's ``amax / (6 * 448)`` by 6: ``NVFP4KVCacheMethod.load_scales_from_model``); 1.0 without scales.
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, nonzero, store
from .fp4 import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, NVFP4Format, e2m1_rne, e4m3_rne

_RCP_6 = 1.0 / E2M1_MAX


def flashinfer_nvfp4_encode(x: torch.Tensor, s_t: torch.Tensor) -> torch.Tensor:
    """Codes (int16 ``[..., D]``, e2m1 | SF << 4, fp4.py's convention) of rows ``x [..., D]`` (float32) under the
    global scale ``s_t`` (float32, broadcastable to ``x[..., :1]``), as FlashInfer's kernel (module docstring)."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    g = s_t.to(torch.float32).unsqueeze(-1)
    amax = xb.abs().amax(-1, keepdim=True)
    sf = e4m3_rne(torch.reciprocal(g) * (amax * torch.tensor(_RCP_6, dtype=torch.float32)))
    sfv = sf.to(torch.float32)
    keep = (amax != 0) & (sfv != 0)
    out = torch.where(keep, torch.reciprocal(torch.where(keep, sfv * g, torch.ones_like(sfv))), torch.zeros_like(sfv))
    codes = e2m1_rne(xb * out).to(torch.int16) | (sf.view(torch.uint8).to(torch.int16) << 4)
    return codes.reshape(x.shape)


class FlashInferNVFP4Format(NVFP4Format):
    """FlashInfer's NVFP4 KV quantizer (SGLang SM100): vLLM's ``nvfp4`` layout and read path, FlashInfer's
    encode multiplier ``rcp(SF * s_t)`` (module docstring)."""

    name = "nvfp4_flashinfer"

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        """s_t = static_scale (1.0 without checkpoint scales), or clip_ratio * amax / 448 calibrated, float32."""
        if spec.static_scale is not None:
            return QParams(store(torch.full_like(mn, spec.static_scale), torch.float32))
        absmax = torch.maximum(-mn, mx) * spec.clip_ratio
        return QParams(store(absmax / E4M3_MAX, torch.float32))

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return flashinfer_nvfp4_encode(xv.to(torch.float32), nonzero(scale))

    def describe(self, spec: Spec) -> str:
        s = f"static s_t {spec.static_scale:g}" if spec.static_scale is not None else "calibrated s_t"
        per = "per-head" if spec.granularity == "head" else "per-tensor"
        return f"{self.name} (E2M1, g16 E4M3 scales, {per} fp32 {s}, FlashInfer)"


FORMATS = (FlashInferNVFP4Format(),)
