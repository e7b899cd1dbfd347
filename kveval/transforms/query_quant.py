"""The query rounded to the key cache's ``vec_dot`` type before the dot product (llama.cpp on the CPU).

ggml's CPU attention (flash attention: ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` in
src/ggml-cpu/ops.cpp; without it: ``ggml_compute_forward_mul_mat`` in src/ggml-cpu/ggml-cpu.c) converts each query
row with ``type_traits_cpu[vec_dot_type(K)].from_float`` before ``vec_dot``: the ``vec_dot_type`` of q8_0, q4_0,
q5_0 and iq4_nl keys is q8_0, that of q4_1 and q5_1 keys q8_1, that of f16 keys f16 (``type_traits_cpu`` in
ggml-cpu.c). ``vec_dot_query_type(cache_type)`` returns that type.

``query_quant`` (``type``: q8_0 | q8_1 | f16) does the same to q ``[batch, heads, T, head_dim]`` in the attention
domain (after ``gguf_order`` and ``hadamard``, which come before it):

- q8_0 / q8_1: blocks of 32 along head_dim, x86's ``quantize_row_q8_0`` / ``quantize_row_q8_1``
  (src/ggml-cpu/arch/x86/quants.c, AVX/AVX2 path, used by every x86 build with AVX): ``amax`` = max |x| of the
  block, ``d = fp16(amax/127)``, ``q = rint(x * (127/amax))`` (round half to EVEN; 0 for an all-zero block), all in
  float32; the query becomes ``q * d``. Worked: a block with amax 127/32 = 3.96875 has 127/amax = 32 and
  d = 1/32, so x = 1/64 -> 0.5 -> q = 0, x = 3/64 -> 1.5 -> q = 2, x = 5/64 -> 2.5 -> q = 2 (ties to even; the
  reference code gives 1, 2, 3).
  (The reference C code, ``quantize_row_q8_0_ref``, multiplies by 1/d and rounds half away from zero; ARM NEON
  multiplies by 1/d and rounds half to even: this transform follows x86.)
  q8_1 also stores ``s = fp16(d_f32 * sum(q))``, which ``vec_dot_q4_1_q8_1`` / ``vec_dot_q5_1_q8_1`` multiply by
  the key block's min; kveval's dot product uses sum(q * d) instead (a relative difference of about 2^-11 on that
  term, not reproduced: it cannot be expressed as a change of q).
- f16: q rounded to float16 (``ggml_cpu_fp32_to_fp16``, round to nearest even).

The codes and scales are computed in float32 whatever the input dtype (as ggml); the result has q's dtype. Only
the query hook acts: keys, values and outputs are untouched (this transform belongs to the K chain, after the
transforms that keep K in their domain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval.quant.formats.q8_0_x86 import q8_0_x86_blocks
from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register

QUERY_TYPES = ("q8_0", "q8_1", "f16")
BLOCK = 32

#: the K cache type -> the type llama.cpp converts the query to (``vec_dot_type`` in ggml-cpu.c); None: f32 keys
VEC_DOT_TYPE: dict[str, str | None] = {
    "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0",
    "q4_1": "q8_1", "q5_1": "q8_1",
    "f16": "f16", "f32": None,
}


def vec_dot_query_type(cache_type: str) -> str | None:
    """The type llama.cpp's CPU attention converts the query to for keys of ``cache_type`` (None: no change)."""
    if cache_type not in VEC_DOT_TYPE:
        raise ValueError(f"unknown llama.cpp K cache type {cache_type!r}; known: {', '.join(VEC_DOT_TYPE)}")
    return VEC_DOT_TYPE[cache_type]


def quantize_q8_0_x86(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x86 ``quantize_row_q8_0`` on rows ``x [..., D]`` (D a multiple of 32): (codes float32 ``[..., D/32, 32]`` with
    integer values in [-127, 127], d float16 ``[..., D/32, 1]``); ``kveval.quant.formats.q8_0_x86`` does the maths."""
    d_model = x.shape[-1]
    if d_model % BLOCK:
        raise ValueError(f"q8_0 query blocks need head_dim a multiple of {BLOCK}; got {d_model}")
    return q8_0_x86_blocks(x.float().reshape(*x.shape[:-1], d_model // BLOCK, BLOCK))


def fake_q8_0_x86(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> codes * fp16(d) in x's shape and dtype (the query as ``vec_dot_q8_0_q8_0`` sees it)."""
    codes, d = quantize_q8_0_x86(x)
    return codes.mul_(d.float()).reshape(x.shape).to(x.dtype)


@register
@dataclass(frozen=True)
class QueryQuant(KVTransform):
    """The query converted to llama.cpp's ``vec_dot`` type of the keys (``type``: q8_0, q8_1 or f16); see the
    module docstring. Query hook only: q ``[batch, heads, T, head_dim]`` -> same shape and dtype."""

    name: ClassVar[str] = "query_quant"
    type: str = "q8_0"

    def __post_init__(self) -> None:
        if self.type not in QUERY_TYPES:
            raise ValueError(f"'type' must be one of {', '.join(QUERY_TYPES)}; got {self.type!r}")

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        if self.type == "f16":
            return q.to(torch.float16).to(q.dtype)
        return fake_q8_0_x86(q)  # q8_1 has q8_0's codes and d (its extra sum is not used here)


__all__ = ["QueryQuant", "QUERY_TYPES", "VEC_DOT_TYPE", "vec_dot_query_type", "quantize_q8_0_x86", "fake_q8_0_x86"]
