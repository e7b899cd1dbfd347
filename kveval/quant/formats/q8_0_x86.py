"""llama.cpp's q8_0 as the CPU writes it at run time on x86 (``q8_0_x86``, selected by ``QuantSpec.ggml``).

The KV cache write (``ggml_compute_forward_set_rows``, src/ggml-cpu/ops.cpp) and the conversion of a query for a
q8_0-family key (see ``kveval.transforms.query_quant``) call ``type_traits_cpu[Q8_0].from_float`` =
``quantize_row_q8_0`` of src/ggml-cpu/arch/x86/quants.c on any x86 build with AVX, not the reference
``quantize_row_q8_0_ref`` (src/ggml-quants.c) that the ``gguf`` package and kveval's ``q8_0`` reproduce. Per block
of 32 elements xb [..., 32] along head_dim, in float32:

    amax = max |x|;  d = amax / 127 (stored as float16);  q = rint(x * (127 / amax))  (round half to EVEN;
    127/amax computed once; 0 for an all-zero block);  x^ = q * fp16(d)

where the reference code multiplies by 1/d (d = amax/127 in float32) and rounds half AWAY from zero. The two differ
on ties and where 127/amax and 1/(amax/127) round to different floats (about one element in a few thousand on
Gaussian data). Codes int8 in [-127, 127], 34 bytes per block with the scale, as q8_0. Worked: amax = 3.96875
(127/32): 127/amax = 32, d = 1/32; x = 5/64 -> 2.5 -> q = 2 (``q8_0``: 3), x^ = 0.0625.
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, check_finite
from .ggml import GgmlFormat

NAME = "q8_0_x86"


def q8_0_x86_blocks(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks xb [..., 32] (float32) -> (codes float32 [..., 32] with integer values in [-127, 127], d float16
    [..., 1]). ValueError on NaN/Inf (detected on the block maxima)."""
    amax = xb.abs().amax(-1, keepdim=True)
    check_finite(amax)
    mul = torch.where(amax == 0, torch.zeros_like(amax), torch.full_like(amax, 127.0) / amax)
    codes = (xb * mul).round_().add_(0.0)  # torch.round: half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    return codes, (amax / 127.0).to(torch.float16)


class Q8_0X86Format(GgmlFormat):
    """q8_0 blocks written by x86's ``quantize_row_q8_0`` (see the module docstring)."""

    def __init__(self) -> None:
        self.name = NAME
        self.bits, self.mapping = 8, "symmetric"

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        q, d = q8_0_x86_blocks(xv.to(torch.float32))
        return q.to(torch.int8), QParams(d, None)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        q, d = q8_0_x86_blocks(xv.to(torch.float32))
        return q.mul_(d.to(torch.float32))


FORMATS = (Q8_0X86Format(),)
