"""Integer affine codes, format 'int' (1..8 bits): symmetric or asymmetric, float or int zero point, clip ratio,
static scale.

Formulas (b = bits, x one statistics group, s the scale after rounding to `scale_dtype`):
- symmetric:   codes int8 in [-2^(b-1), 2^(b-1)-1], s = absmax / (2^(b-1)-1), q = clamp(round(x/s)), x^ = q*s.
  Worked: x = [0.5, -1.0, 0.25, 0.75], b = 4: s = 1/7, stored in fp16 as 0.142822265625, x/s = [3.5009, -7.0017,
  1.7504, 5.2513], q = [4, -7, 2, 5], x^ = [0.5712890625, -0.999755859375, 0.28564453125, 0.714111328125].
- asymmetric:  codes uint8 in [0, 2^b-1], s = (max-min) / (2^b-1).
  zero_point="float": m = min (rounded to scale_dtype), q = clamp(round((x-m)/s)), x^ = q*s + m.
  Worked: x = [0, 1.5, 3], b = 2: s = 1, m = 0, q = [0, 2 (1.5 -> 2, half to even), 3], x^ = [0, 2, 3].
  zero_point="int": z = clamp(round(-min/s), 0, 2^b-1) stored as uint8, q = clamp(round(x/s) + z),
  x^ = (q-z)*s; here the range is first widened to include 0 (min<=0<=max, as GPTQ/PyTorch observers do),
  otherwise z would clamp to 0 for an all-positive group and its top half would saturate.
- clip_ratio r scales absmax (symmetric) or min and max (asymmetric) by r before the scale is computed.
- bits=1 symmetric has no non-zero level (2^0-1 = 0) and is rejected; use asymmetric 1-bit (codes {0,1}).
A zero scale divides by 1: codes 0, x^ = 0 (symmetric) or m (asymmetric, float zero point), never NaN. Rounding
is half to even (torch.round). Codes are packed as a bitstream of b-bit integers (`kveval.quant.packing`).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import native
from .base import NONFINITE, SCALE_TORCH_DTYPES, QParams, Spec, TensorParts, nonzero, store, symmetric_qparams
from .segment import QuantFormat


def int_levels(spec: Spec) -> tuple[int, int]:
    """(lowest, highest) code: [-2^(b-1), 2^(b-1)-1] symmetric, [0, 2^b-1] asymmetric."""
    if spec.mapping == "symmetric":
        return -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    return 0, 2**spec.bits - 1


class IntFormat(QuantFormat):
    """Integer affine codes (see the module docstring)."""

    name = "int"

    def validate(self, spec: Spec) -> None:
        if not 1 <= spec.bits <= 8:
            raise ValueError(f"QuantSpec.bits must be in 1..8 for format 'int'; got {spec.bits}")
        if spec.bits == 1 and spec.mapping == "symmetric":
            raise ValueError("QuantSpec.bits=1 requires mapping='asymmetric' (symmetric 1-bit has no non-zero level)")

    def code_bits(self, spec: Spec) -> int:
        return spec.bits

    def short_name(self, spec: Spec) -> str:
        return f"int{spec.bits}"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.int8 if spec.mapping == "symmetric" else torch.uint8

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        top = int_levels(spec)[1]
        if spec.mapping == "symmetric":
            return symmetric_qparams(mn, mx, spec, top)
        sdt = SCALE_TORCH_DTYPES[spec.scale_dtype]
        r = spec.clip_ratio
        if r != 1.0:
            mn, mx = mn * r, mx * r
        if spec.zero_point == "float":
            return QParams(store((mx - mn) / top, sdt), store(mn, sdt))
        mn, mx = mn.clamp(max=0.0), mx.clamp(min=0.0)
        s = store((mx - mn) / top, sdt)
        sc = s.to(mn.dtype)
        z = (-mn / nonzero(sc)).round_().clamp_(0, top).to(torch.uint8)
        return QParams(s, z)

    def round_codes(self, xv: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None,
                    spec: Spec) -> torch.Tensor:
        """Codes of xv as integer-valued floats in xv's dtype (a new tensor); s, zp in xv's dtype."""
        lo, hi = int_levels(spec)
        safe = nonzero(s)
        if spec.mapping == "symmetric":
            return (xv / safe).round_().clamp_(lo, hi)
        assert zp is not None
        if spec.zero_point == "float":
            return (xv - zp).div_(safe).round_().clamp_(lo, hi)
        return (xv / safe).round_().add_(zp).clamp_(lo, hi)  # + z turns a -0.0 code into +0.0

    def reconstruct_(self, q: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None,
                     spec: Spec) -> torch.Tensor:
        """x^ from float codes q, in place on q. Shared by `fake` and `decode`, so both agree bit for bit."""
        if spec.mapping == "symmetric":
            return torch.addcmul(q.new_zeros(()), q, s, out=q)  # q*s, with -0.0 (from round(-0.3)) -> +0.0
        assert zp is not None
        if spec.zero_point == "float":
            return q.mul_(s).add_(zp)
        return q.sub_(zp).mul_(s)

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return self.round_codes(xv, scale, zero_point, spec).to(self.code_dtype(spec))

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return self.reconstruct_(codes.to(scale.dtype), scale, zero_point, spec)

    def dequantize_into(self, qt: Any, out: torch.Tensor) -> None:
        """`dequantize_tensor` without a temporary: the codes converted into ``out``, then `reconstruct_` in place
        on each segment of ``out`` (views): the same operations on the same values, so the same bits. Outliers,
        static scales and an ``out`` dtype other than the compute dtype take the default path (a copy)."""
        if qt.outlier_values is not None or qt.static or not out.dtype == qt.dtype == self.compute_dtype(qt.dtype):
            return super().dequantize_into(qt, out)
        out.copy_(qt.codes)
        s_all = qt.scale.to(out.dtype)
        zp_all = None if qt.zero_point is None else qt.zero_point.to(out.dtype)
        for ov, _, sl in qt.spec.gran.segments(out, qt.channel_block):
            self.reconstruct_(ov, s_all[:, :, sl], None if zp_all is None else zp_all[:, :, sl], qt.spec)

    def read_packed_into(self, qt: Any, packed: torch.Tensor, n_codes: int, out: torch.Tensor) -> None:
        """The packed rows read in one pass by the native kernel (`kveval.native.dequantize_int`: unpack, convert,
        then `reconstruct_`'s arithmetic, the same bits) for float32 dynamic per-token, per-group and per-channel
        (token-block) statistics; the default (unpack, then `dequantize_into`) for everything else and where the
        kernel is not to be had."""
        spec = qt.spec
        if (qt.outlier_values is None and not qt.static and out.dtype == qt.dtype == torch.float32
                and spec.granularity in ("token", "group", "channel") and n_codes == out.shape[-1]):
            mode = "symmetric" if spec.mapping == "symmetric" else spec.zero_point
            offset = 2 ** (spec.bits - 1) if self.code_dtype(spec) == torch.int8 else 0
            zp = None if qt.zero_point is None else qt.zero_point.to(torch.float32)
            block = qt.channel_block if spec.granularity == "channel" else 1  # the blocks `segments` reads
            if block and native.dequantize_int(packed, qt.scale.to(torch.float32), zp, out, bits=spec.bits,
                                               offset=offset, mode=mode, token_block=block):
                return
        super().read_packed_into(qt, packed, n_codes, out)

    def quantize_packed(self, x: torch.Tensor, spec: Spec,
                        decode: bool) -> tuple[TensorParts, torch.Tensor, torch.Tensor | None] | None:
        """Statistics, codes, packing and read-back values of x [B, H, T, D] in one pass of the native kernel
        (`kveval.native.quantize_int`, the arithmetic of this class and of ``base.store``, the same bits) for
        dynamic per-token and per-group statistics of a float32, float16 or bfloat16 x (computed in float32, as
        eager); None for outliers, a fixed ``static_scale``, other granularities and where the kernel is not to
        be had."""
        sdt = SCALE_TORCH_DTYPES.get(spec.scale_dtype)
        if (spec.outliers or spec.static_scale is not None or spec.granularity not in ("token", "group")
                or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or sdt is None):
            return None
        groups = 1 if spec.granularity == "token" else x.shape[-1] // (spec.group_size or 1)
        mode = "symmetric" if spec.mapping == "symmetric" else spec.zero_point
        got = native.quantize_int(x.to(torch.float32), groups=groups, bits=spec.bits, mode=mode,
                                  clip=spec.clip_ratio, scale_dtype=sdt, decode=decode)
        if got is None:
            return None
        if not got.finite:
            raise ValueError(NONFINITE)
        shape = spec.gran.scale_shape(tuple(x.shape), None)
        zero = None if got.zero is None else got.zero.view(shape)
        decoded = None if got.decoded is None else got.decoded.to(x.dtype)
        return TensorParts(torch.empty(0, dtype=self.code_dtype(spec)), got.scale.view(shape), zero), got.packed, decoded

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        """One min/max pass, then divide, round, clamp, multiply in place on one temporary."""
        qp = self.group_qparams(xv, dims, spec)
        s = qp.scale.to(xv.dtype)
        zp = None if qp.zero_point is None else qp.zero_point.to(xv.dtype)
        return self.reconstruct_(self.round_codes(xv, s, zp, spec), s, zp, spec)


FORMATS = (IntFormat(),)
