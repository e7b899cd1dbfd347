"""Format 'none': keys/values kept in full precision (the baseline); every other Spec field is ignored.

`kveval.quant.primitives` returns x itself for it (quantize keeps x as the "codes", in x's dtype); this class
exists so that the registry lists it and that questions such as `code_bits` (16, the FP16 baseline) have one
answer. It has no parameters and no codes.
"""

from __future__ import annotations

import torch

from .base import QParams, Spec
from .segment import QuantFormat

_NO_CODES = "format 'none' has no quantization parameters"


class NoneFormat(QuantFormat):
    """Full precision (see the module docstring)."""

    name = "none"
    supports_static = False

    def validate(self, spec: Spec) -> None:
        """Nothing to check: the other fields are ignored."""

    def code_bits(self, spec: Spec) -> int:
        return 16

    def bits_per_element(self, spec: Spec, head_dim: int) -> float:
        return 16.0

    def describe(self, spec: Spec) -> str:
        return "none (full precision)"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        raise ValueError(_NO_CODES)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError(_NO_CODES)

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError(_NO_CODES)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError(_NO_CODES)


FORMATS = (NoneFormat(),)
