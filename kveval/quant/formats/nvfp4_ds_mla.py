"""NVFP4 as vLLM's ``nvfp4_ds_mla`` KV cache stores DeepSeek's MLA latent (``--kv-cache-dtype nvfp4_ds_mla``,
SM100): E2M1 in blocks of 16 with one E4M3 scale per block and no per-tensor scale.

Source: vllm-project/vllm @03b6016 ``csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu``
(``nvfp4_tile_scale``, ``nvfp4_pack16_e2m1_rn``, ``nvfp4_unpack16_e2m1``). Per block of 16 elements, float32 (the
kernel reads bf16 and converts):

    sf_f  = max(amax / 6, 2^-9)
    sf    = e4m3_satfinite_rne(sf_f), bumped to the next E4M3 value when it rounded below sf_f (and is not 448):
            amax / sf then never exceeds 6, so the block's largest values do not saturate
    codes = e2m1_rne(x * (1 / sf))          (cvt.rn.satfinite.e2m1x2.f32 of x * inv_sf)
    x^    = value(code) * sf                (the kernel multiplies in f16 and converts to bf16: both exact, a
                                             product of a 2-bit and a 4-bit significand)

Worked: amax 3 -> sf_f = 0.5 (E4M3 exact) -> x = 1.3 -> 2.6 -> 3 (E2M1) -> x^ = 1.5; amax 0.1 -> sf_f =
0.016666 -> E4M3 rounds to 0.015625 < sf_f -> bumped to 0.017578125.

A stored row of D elements is D/2 bytes of codes (even element in the low nibble) and D/16 E4M3 bytes. vLLM's
entry permutes the 32 scale bytes of the 512-wide latent (block s at byte ``8 * (s & 3) + (s >> 2)``, for FlashMLA's
reader) and puts the 64 RoPE values between codes and scales: a reordering of the same bytes, which
``tests/ds_mla_reference.py`` writes out; kveval stores the codes and the scales as two arrays.
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, check_finite
from .fp4 import E2M1_MAX, NVFP4_BLOCK, _FP4Format, e2m1_rne, e4m3_rne

SF_FLOOR = 2.0**-9  # the smallest E4M3 subnormal
E4M3_MAX_BYTE = 0x7E  # 448, the largest finite E4M3 value


def ds_mla_tile_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's ``nvfp4_tile_scale`` (module docstring): E4M3 block scales (torch.float8_e4m3fn, amax's shape) of
    blocks whose largest magnitude is ``amax`` (float32)."""
    sf_f = torch.clamp(amax / E2M1_MAX, min=SF_FLOOR)
    sf8 = e4m3_rne(sf_f)
    bits = sf8.view(torch.uint8)
    low = (sf8.to(torch.float32) < sf_f) & (bits < E4M3_MAX_BYTE)
    return torch.where(low, bits + 1, bits).view(torch.float8_e4m3fn)


class NVFP4DsMlaFormat(_FP4Format):
    """vLLM's ``nvfp4_ds_mla`` latent: E2M1 per 16 with a rounded-up E4M3 scale (module docstring)."""

    name = "nvfp4_ds_mla"
    block = NVFP4_BLOCK
    scale_dtypes = ("e4m3",)
    _scale_words = "E4M3"

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # the kernel converts the bf16 latent to float32

    def param_nbytes(self, spec: Spec) -> int:
        return 1  # one E4M3 byte per block

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """xv [..., 16] (float32): codes [..., 16], E4M3 scales [..., 1]."""
        amax = xv.abs().amax(-1, keepdim=True)
        check_finite(amax)
        sf = ds_mla_tile_scale(amax)
        inv = torch.reciprocal(sf.to(torch.float32))  # 1.0f / sf
        return e2m1_rne(xv * inv), QParams(sf)

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (E2M1, g16, rounded-up E4M3 scales, no global scale, vLLM)"


FORMATS = (NVFP4DsMlaFormat(),)
