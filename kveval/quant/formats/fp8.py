"""FP8 codes, formats 'fp8_e4m3' (torch.float8_e4m3fn, fmax 448) and 'fp8_e5m2' (torch.float8_e5m2, fmax 57344).

Symmetric only, bits 8: s = absmax/fmax (or `static_scale`; clip_ratio scales absmax), x^ = float(fp8(clamp(x/s,
-fmax, fmax))) * s: a saturating cast, rounding to nearest even. Worked: absmax 896 -> s = 2; x = 3.3 -> 1.65 ->
fp8 1.625 -> 3.25. Codes are the fp8 values themselves (one byte each, stored as they are).
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, nonzero, symmetric_qparams
from .segment import QuantFormat


def _fp8_to_float(codes: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """Exact fp8 -> float into `out`. e4m3fn: torch's cast is scalar on CPU (about 4x slower than this), so the
    byte is rebuilt as the float16 with bits (b & 0x80) << 8 | (b & 0x7F) << 7, which is the value / 256 (bias 15
    vs 7, subnormals included). e5m2 is the top byte of a float16: a plain copy."""
    if codes.dtype == torch.float8_e5m2:
        return out.copy_(codes)
    t = codes.view(torch.uint8).to(torch.int16)
    bits = (t & 0x80).bitwise_left_shift_(8).bitwise_or_(t.bitwise_and_(0x7F).bitwise_left_shift_(7))
    return out.copy_(bits.view(torch.float16)).mul_(256.0)


class FP8Format(QuantFormat):
    """A saturating cast to a torch float8 dtype after division by the scale (see the module docstring)."""

    mappings = ("symmetric",)

    def __init__(self, name: str, dtype: torch.dtype, fmax: float):
        self.name, self.dtype, self.fmax = name, dtype, fmax

    def validate(self, spec: Spec) -> None:
        if spec.bits != 8:
            raise ValueError(f"QuantSpec.bits must be 8 for format {self.name!r}; got {spec.bits}")
        super().validate(spec)

    def code_bits(self, spec: Spec) -> int:
        return 8

    def bits_label(self, spec: Spec) -> str:
        return "FP8"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return self.dtype

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        return symmetric_qparams(mn, mx, spec, self.fmax)

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return (xv / nonzero(scale)).clamp_(-self.fmax, self.fmax).to(self.dtype)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        out = torch.empty(codes.shape, dtype=scale.dtype, device=codes.device)
        return _fp8_to_float(codes, out=out).mul_(scale)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        """The fp8 round trip reuses the float buffer: one full-size allocation, not two."""
        s = self.group_qparams(xv, dims, spec).scale.to(xv.dtype)
        q = (xv / nonzero(s)).clamp_(-self.fmax, self.fmax)
        _fp8_to_float(q.to(self.dtype), out=q)
        return q.mul_(s)

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        """The fp8 bytes as they are: uint8 [..., D] (a view of the codes)."""
        return codes.view(torch.uint8)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != n:
            raise ValueError(f"expected uint8 [..., {n}] for {n} fp8 codes; got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        return packed.view(self.dtype)


FORMATS = (FP8Format("fp8_e4m3", torch.float8_e4m3fn, 448.0), FP8Format("fp8_e5m2", torch.float8_e5m2, 57344.0))
