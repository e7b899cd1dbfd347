"""ggml's q8_0, q4_0, q4_1, q5_0, q5_1 block quantizers in torch, bit for bit with `gguf.quants`: formats
registered under these names and selected by `QuantSpec.ggml` (spelled format='int', ggml='q4_0', with the other
fields fixed by the type: use `preset("q4_0")`).

Blocks are 32 consecutive elements of head_dim: xb [..., n_blocks, 32] (float32, as gguf converts its input).
Per block (all arithmetic in float32, each operation rounded separately, as numpy does):

- q8_0: d = absmax/127, q = roundf(x/d) with round-half-AWAY-from-zero (ggml's roundf), codes int8 in [-127, 127],
  x^ = fp16(d)*q.  Worked: absmax 2.54 -> d = 0.02; x = 0.03 -> 1.5 -> q = 2 -> x^ = fp16(0.02)*2 = 0.0400085.
- q4_0: m = the element of largest |x| WITH its sign (first one on ties), d = m/-8,
  q = min(trunc(x*(1/d) + 8.5), 15), code = q-8 in [-8, 7], x^ = fp16(d)*code. The signed max maps to code -8,
  so the block's extreme uses the extra negative level.  Worked: m = 1.6 -> d = -0.2; x = -0.5:
  x*(1/d) = 2.5, q = trunc(2.5 + 8.5) = 11, code 3, x^ = fp16(-0.2)*3 = -0.599853515625.
- q5_0: as q4_0 with d = m/-16, q = min(trunc(x/d + 16.5), 31), code = q-16 in [-16, 15].
- q4_1: d = (max-min)/15, q = min(trunc((x-min)*(1/d) + 0.5), 15) (round half up), codes uint8 in [0, 15],
  x^ = fp16(d)*q + fp16(min).  Worked: min -1, max 2 -> d = 0.2; x = 0.1 -> 5.5+0.5 -> q = 6 -> x^ = fp16(0.2)*6 - 1 = 0.19970703125.
- q5_1: as q4_1 with 31 and codes in [0, 31].

Note that the codes are computed with the UNROUNDED float32 d (and min) while the reconstruction uses their
float16 values: that is what ggml does. d == 0 (an all-zero block) uses 1/d := 0, so every code is the middle one
(0 for the signed types) and x^ = 0. Deviation: where |d| or |min| exceeds float16's max (65504) gguf stores Inf;
here it is clamped to 65504 so that no Inf appears (irrelevant for real K/V values).

Codes follow the package convention (signed int8 for the *_0 types, uint8 for *_1), so `pack(codes, bits)` of
one 32-block gives as many bytes as ggml's `qs` (+ `qh` for q5): ggml's byte layout differs (low nibbles hold
elements 0..15, high nibbles 16..31) but the byte count, 34/18/20/22/24 per block with the scales, is identical.
"""

from __future__ import annotations

import torch

from .base import SHORT_DTYPE, QParams, Spec, check_finite
from .segment import QuantFormat

# name -> (bits, mapping); all are group 32 along head_dim with float16 scale d (and float16 min m for *_1).
GGML_TYPES: dict[str, tuple[int, str]] = {
    "q8_0": (8, "symmetric"),
    "q4_0": (4, "symmetric"),
    "q4_1": (4, "asymmetric"),
    "q5_0": (5, "symmetric"),
    "q5_1": (5, "asymmetric"),
}
GGML_BLOCK = 32

_F16_MAX = 65504.0

# name -> (divisor applied to the signed max (symmetric) or to max-min (asymmetric), offset, top code)
_PARAMS: dict[str, tuple[float, float, int]] = {
    "q8_0": (127.0, 0.0, 127),
    "q4_0": (-8.0, 8.5, 15),
    "q5_0": (-16.0, 16.5, 31),
    "q4_1": (15.0, 0.5, 15),
    "q5_1": (31.0, 0.5, 31),
}


def _to_f16(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-_F16_MAX, _F16_MAX).to(torch.float16)


# 0.5 - 2^-25, the float32 just below 0.5: for 0 <= a < 2^22, trunc(fl(a + _HALF_DOWN)) == floor(a + 0.5) exactly
# (a tie a = n + 0.5 rounds the sum up to n + 1, anything below stays under n + 1), which is np_roundf's result.
_HALF_DOWN = 0.49999997019767761


def _roundf_(y: torch.Tensor) -> torch.Tensor:
    """ggml's roundf (half away from zero), bit for bit with gguf's np_roundf for |y| < 2^22 (q8_0 has
    |y| <= 127.0001); in place on y plus one temporary: sign(y) * trunc(|y| + (0.5 - 2^-25))."""
    sign = y.sign()
    y.abs_().add_(_HALF_DOWN).trunc_()
    return torch.addcmul(y.new_zeros(()), y, sign, out=y)  # y*sign + 0: the int8 code of -0.0 is 0


def _signed_absmax(xb: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """The element of largest |x| with its sign, the FIRST one on ties (numpy argmax), [..., 1]. Without a tie it is
    mx or mn; only blocks where max == -min != 0 (rare) need the argmax."""
    m = torch.where(mx >= -mn, mx, mn)
    tie = (mx == -mn) & (mx != 0)
    if bool(tie.any()):
        sel = tie.squeeze(-1)
        rows = xb[sel]
        m[sel] = torch.gather(rows, -1, rows.abs().argmax(-1, keepdim=True))
    return m


def ggml_quantize_blocks(xb: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize blocks xb [..., 32] (float32) the ggml way.

    Returns (codes_f, d16, m16): float32 codes with integer values in the package convention (signed for *_0,
    unsigned for *_1) [..., 32], the float16 scale d [..., 1] and, for *_1, the float16 block min m [..., 1]
    (else None). Raises ValueError on NaN/Inf, detected on the per-block statistics (no extra pass over xb).
    """
    div, offset, top = _PARAMS[kind]
    _, mapping = GGML_TYPES[kind]
    mn, mx = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
    if kind == "q8_0":
        d = torch.maximum(-mn, mx) / div
    elif mapping == "symmetric":  # q4_0, q5_0
        d = _signed_absmax(xb, mn, mx) / div
    else:
        d = (mx - mn) / div
    check_finite(d)
    check_finite(mn)
    inv = torch.where(d == 0, 0.0, torch.ones_like(d) / d)
    if kind == "q8_0":
        return _roundf_(xb * inv), _to_f16(d), None
    if mapping == "symmetric":
        q = (xb * inv).add_(offset).trunc_().clamp_(0, top)
        return q.sub_(offset - 0.5), _to_f16(d), None
    q = (xb - mn).mul_(inv).add_(offset).trunc_().clamp_(0, top)
    return q, _to_f16(d), _to_f16(mn).add_(0.0)  # +0.0: never store -0.0 (changes no reconstructed value)


def ggml_dequantize_blocks(codes_f: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x^ [..., 32] = d*code (+ m), in place on codes_f: float32, two separately rounded operations as in gguf."""
    out = codes_f.mul_(d.to(torch.float32))
    return out if m is None else out.add_(m.to(torch.float32))


class GgmlFormat(QuantFormat):
    """One ggml block type (`kind`: q8_0, q4_0, q4_1, q5_0, q5_1): blocks of 32 along head_dim, float16 scale d
    (and min m for *_1); the codes come from the unrounded block scale, so no fixed parameters can be given."""

    spec_field = "ggml"
    supports_static = False

    def __init__(self, kind: str):
        self.name = kind
        self.bits, self.mapping = GGML_TYPES[kind]

    def validate(self, spec: Spec) -> None:
        want = dict(format="int", bits=self.bits, mapping=self.mapping, granularity="group", group_size=GGML_BLOCK,
                    scale_dtype="float16", zero_point="float", clip_ratio=1.0, static_scale=None, outliers=0.0)
        bad = {k: getattr(spec, k) for k, v in want.items() if getattr(spec, k) != v}
        if bad:
            need = ", ".join(f"{k}={want[k]!r}" for k in bad)
            got = ", ".join(f"{k}={v!r}" for k, v in bad.items())
            raise ValueError(f"QuantSpec.ggml={self.name!r} requires {need} (got {got}); "
                             f"use preset({self.name!r})")

    def code_bits(self, spec: Spec) -> int:
        return self.bits

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (ggml, g32, {SHORT_DTYPE[spec.scale_dtype]} scales)"

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # as gguf, whatever the input

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.int8 if self.mapping == "symmetric" else torch.uint8

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError(f"{self.name} takes no parameters from a range (its codes use the unrounded block scale)")

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        """The stored float16 d (and min) of blocks xv [..., 32]."""
        return self.fit(xv, dims, spec)[1]

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        q, d, m = ggml_quantize_blocks(xv, self.name)
        return q.to(self.code_dtype(spec)), QParams(d, m)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        q, d, m = ggml_quantize_blocks(xv, self.name)
        return ggml_dequantize_blocks(q, d, m)

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError("qparams cannot be given for ggml types (their codes use the unrounded block scale)")

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return ggml_dequantize_blocks(codes.to(scale.dtype), scale, zero_point)


FORMATS = tuple(GgmlFormat(kind) for kind in GGML_TYPES)
