"""The query cast to FP8 E4M3 with a static per-tensor scale before the dot product (vLLM's FP8 attention).

With ``--kv-cache-dtype fp8`` and an attention backend that takes an FP8 query (FlashAttention 3), vLLM quantizes
the query once per layer call with the layer's ``_q_scale``:

- vllm/attention/layer.py (``Attention.__init__``: ``self.query_quant = QuantFP8(static=True,
  group_shape=GroupShape.PER_TENSOR)`` when the cache dtype is fp8 and the backend ``supports_quant_query_input``;
  ``Attention.forward``: ``query, _ = self.query_quant(query, self._q_scale)``), read at vllm-project/vllm
  5704f34; before vllm-project/vllm#24914 (2025-09) the same call was ``ops.scaled_fp8_quant(query, layer._q_scale)``
  in ``FlashAttentionImpl.forward`` (vllm/v1/attention/backends/flash_attn.py, read at 0084b78): the same numbers.
- the arithmetic: ``QuantFP8.forward_native`` (vllm/model_executor/layers/quantization/input_quant_fp8.py) and the
  CUDA kernel ``scaled_fp8_quant_kernel_strided`` (csrc/quantization/w8a8/fp8/common.cu with
  ``scaled_fp8_conversion<true>`` in common.cuh) both compute, in float32, ``x * (1 / q_scale)`` (the reciprocal
  taken once), clamp to [-448, 448] and convert to e4m3 rounding to nearest even.
- ``_q_scale`` is 1.0 unless a checkpoint provides ``q_scale`` (``set_default_quant_scales`` in
  vllm/attention/layer.py; ``calculate_kv_scales``, off by default, would set it once to max|q| / 200).

FlashAttention 3 then multiplies the scores by ``q_descale = q_scale`` (with ``k_descale``): the query the dot
product sees is ``e4m3(q / q_scale) * q_scale``, which is what this hook returns, in q's dtype. Worked, scale 1:
0.3 -> 0.3125 (between 0.25 and 0.5 the e4m3 step is 1/32: 0.3 * 32 = 9.6 -> 10), 1000 -> 448 (saturated);
below 2^-6 the codes are subnormal, steps of 2^-9: 0.001 -> 2^-9 (0.512 steps -> 1), 2^-10 -> 0 (half a step,
rounded to the even code 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval.quant.formats.fp8 import _fp8_to_float
from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register

E4M3_MAX = 448.0


def fake_fp8_e4m3_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3(clamp(x * (1/scale), ±448)) * scale`` for x ``[...]``: the code computed in float32 (x rounded to
    float32 first, the reciprocal taken in float32, as vLLM's kernel), the product with the float32 scale in x's
    dtype (FA3 applies the descale to the float32 scores: no extra rounding of the query); x's shape and dtype."""
    scale32 = torch.tensor(scale, dtype=torch.float32, device=x.device)
    inverse = torch.tensor(1.0, dtype=torch.float32, device=x.device) / scale32
    scaled = (x.to(torch.float32) * inverse).clamp_(-E4M3_MAX, E4M3_MAX)
    out = torch.empty(scaled.shape, dtype=x.dtype, device=x.device)
    _fp8_to_float(scaled.to(torch.float8_e4m3fn), out=out)
    return out.mul_(scale32.to(x.dtype))


@register
@dataclass(frozen=True)
class QueryFp8(KVTransform):
    """The query as an E4M3 tensor with the static per-tensor ``scale`` (vLLM's ``q_scale``, default 1.0) sees it;
    see the module docstring. Query hook only: q ``[batch, heads, T, head_dim]`` -> same shape and dtype."""

    name: ClassVar[str] = "query_fp8"
    scale: float = 1.0

    def __post_init__(self) -> None:
        ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
        if not ok or not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"'scale' must be a positive finite number; got {self.scale!r}")

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return fake_fp8_e4m3_static(q, float(self.scale))


__all__ = ["QueryFp8", "E4M3_MAX", "fake_fp8_e4m3_static"]
