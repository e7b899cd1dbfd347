"""Format 'none': keys/values kept in full precision (the baseline); every other QuantSpec field is ignored.

`kveval.quant.primitives` returns x itself for it (quantize keeps x as the "codes", in x's dtype); this class
exists so that the registry lists it and that questions such as `code_bits` (16, the FP16 baseline) have one
answer. It has no parameters and no codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import QParams, QuantFormat

if TYPE_CHECKING:
    from ..spec import QuantSpec

_NO_CODES = "format 'none' has no quantization parameters"


class NoneFormat(QuantFormat):
    """Full precision (see the module docstring)."""

    name = "none"
    supports_static = False

    def validate(self, spec: QuantSpec) -> None:
        """Nothing to check: the other fields are ignored."""

    def code_bits(self, spec: QuantSpec) -> int:
        return 16

    def bits_per_element(self, spec: QuantSpec, head_dim: int) -> float:
        return 16.0

    def describe(self, spec: QuantSpec) -> str:
        return "none (full precision)"

    def code_dtype(self, spec: QuantSpec) -> torch.dtype:
        raise ValueError(_NO_CODES)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: QuantSpec) -> QParams:
        raise ValueError(_NO_CODES)

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec) -> torch.Tensor:
        raise ValueError(_NO_CODES)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec) -> torch.Tensor:
        raise ValueError(_NO_CODES)


FORMATS = (NoneFormat(),)
