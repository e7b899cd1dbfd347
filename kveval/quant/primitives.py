"""Quantize / dequantize / fake-quantize K or V tensors x [batch, kv_heads, seq, head_dim] = [B, H, T, D].

Statistics groups and scale shapes (the zero point has the scale's shape):
- token:   over D per token                          scale [B, H, T, 1]
- group:   x viewed [B, H, T, D//g, g], over g       scale [B, H, T, D//g, 1]
- channel: x viewed [B, H, nb, cb, D], over the cb tokens of each block, per channel
                                                      scale [B, H, nb, 1, D], nb = ceil(T / cb)
  cb = `channel_block` (default: all T tokens, one block). When cb does not divide T, the last, partial block
  is its own block with statistics over its own T % cb tokens only (tokens never see later tokens' blocks).
- head:    over B, T, D per kv head                  scale [1, H, 1, 1]
- tensor:  over everything                           scale [1, 1, 1, 1]
Static (calibrated) parameters, given as `qparams` (see `qparams_from_range`), are broadcast over the tokens:
tensor [1, 1, 1, 1], head [1, H, 1, 1], channel [1, H, 1, D] (one scale per channel and head for every token).
Outliers (`spec.outliers`): the k largest |x| of each head_dim row are taken out first (values [B, H, T, k] in x's
dtype, uint8 indices), the dense rest (outliers set to 0) is quantized, and they are written back on dequantize.

Arithmetic is float32 (float64 when x is float64; ggml types always float32, as gguf), the result has x's dtype.
Scales and float zero points are rounded to `spec.scale_dtype` (clamped to its finite range) before they are used,
so the reconstruction uses exactly the stored values: with float16 scales s = 1/3 is used as 0.333251953125.
A zero scale (all-zero or constant group) divides by 1 instead: codes are 0 and x^ = 0 (symmetric) or x^ = m
(asymmetric, float zero point), never NaN. NaN/Inf in x raise ValueError, detected on the per-group statistics
(for static scales or given qparams, which have none, one min/max pass over x).

Codes: symmetric int -> int8 (signed), asymmetric int -> uint8, fp8 -> torch.float8_e4m3fn / float8_e5m2,
ggml -> int8 for q8_0/q4_0/q5_0 (code = ggml's q - 8 / q - 16), uint8 for q4_1/q5_1; always shaped [B, H, T, D].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .ggml import ggml_dequantize_blocks, ggml_quantize_blocks
from .spec import QuantSpec

_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
_NONFINITE = "non-finite values in input to quantize"


@dataclass
class QParams:
    """Scale (stored dtype, shape per granularity) and zero point: None (symmetric), the rounded group min in the
    scale dtype (zero_point='float') or uint8 z (zero_point='int')."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None


@dataclass
class QuantizedTensor:
    """What a real cache stores for x [B, H, T, D]: codes [B, H, T, D] (see module doc for the dtype), scale and
    zero point in their storage dtypes, and what is needed to rebuild x (`shape`, `dtype`, `channel_block`)."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    spec: QuantSpec
    shape: torch.Size
    dtype: torch.dtype
    channel_block: int | None = None
    static: bool = False  # qparams were given (calibrated), broadcast over tokens
    outlier_values: torch.Tensor | None = None  # [B, H, T, k], x's dtype
    outlier_index: torch.Tensor | None = None  # [B, H, T, k], uint8 (int16 when head_dim > 256)

    def nbytes(self) -> dict[str, int]:
        """Bytes measured on the real tensors: codes packed row-wise along head_dim (`pack`), scales + zero points,
        outliers (values + indices).

        Equals `packed_nbytes(spec, shape)`; e.g. int4 g64 on [1, 8, 4096, 128]: codes 32768*64 = 2 MiB,
        scales + float16 mins 32768*2*(2+2) = 256 KiB.
        """
        spec = self.spec
        if spec.is_none:
            codes = self.codes.numel() * self.codes.element_size()
        elif spec.is_fp8:
            codes = self.codes.view(torch.uint8).numel()
        else:
            codes = pack(self.codes, spec.bits).numel()
        scales = sum(t.numel() * t.element_size() for t in (self.scale, self.zero_point) if t is not None)
        outliers = sum(t.numel() * t.element_size() for t in (self.outlier_values, self.outlier_index) if t is not None)
        return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}


# ------------------------------------------------------------------------------------------------ helpers
def _compute_dtype(dtype: torch.dtype, spec: QuantSpec) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 and spec.ggml is None else torch.float32


def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected x of shape [batch, kv_heads, seq, head_dim]; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor; got {x.dtype}")
    spec.check_head_dim(x.shape[-1])


def _resolve_block(spec: QuantSpec, seq: int, channel_block: int | None) -> int | None:
    if spec.granularity != "channel" or spec.is_none:
        return None
    if channel_block is None:
        return max(seq, 1)
    if isinstance(channel_block, bool) or not isinstance(channel_block, int) or channel_block <= 0:
        raise ValueError(f"channel_block must be a positive integer or None; got {channel_block!r}")
    return channel_block


def _scale_shape(spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> tuple[int, ...]:
    B, H, T, D = shape
    g = spec.granularity
    if g == "token":
        return (B, H, T, 1)
    if g == "group":
        return (B, H, T, D // spec.group_size, 1)
    if g == "channel":
        return (B, H, -(-T // cb), 1, D)
    if g == "head":
        return (1, H, 1, 1)
    return (1, 1, 1, 1)


def _segments(t: torch.Tensor, spec: QuantSpec, cb: int | None) -> list[tuple[torch.Tensor, tuple | None, slice]]:
    """Views of t [B, H, T, D] whose statistics groups are reduced over `dims` (keepdim gives the scale shape);
    `sl` selects the segment's part of the scale along dim 2 (channel granularity with a partial last block)."""
    B, H, T, D = t.shape
    g = spec.granularity
    everything = slice(None)
    if g == "token":
        return [(t, (-1,), everything)]
    if g == "group":
        return [(t.view(B, H, T, D // spec.group_size, spec.group_size), (-1,), everything)]
    if g == "head":
        return [(t, (0, 2, 3), everything)]
    if g == "tensor":
        return [(t, None, everything)]
    nf, r = divmod(T, cb)
    segs = []
    if nf:
        segs.append((t[:, :, : nf * cb].view(B, H, nf, cb, D), (3,), slice(0, nf)))
    if r:
        segs.append((t[:, :, nf * cb :].view(B, H, 1, r, D), (3,), slice(nf, nf + 1)))
    return segs


def _minmax(xv: torch.Tensor, dims: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min and max with keepdim (NaN propagates). torch.aminmax is one pass but, along a dim, about 5x
    slower on CPU than amin + amax (torch 2.13), so it is used only for the full reduction."""
    if dims is None:
        mn, mx = torch.aminmax(xv)
        one = (1,) * xv.dim()
        return mn.reshape(one), mx.reshape(one)
    return xv.amin(dims, keepdim=True), xv.amax(dims, keepdim=True)


def _check_finite(*stats: torch.Tensor) -> None:
    for s in stats:
        if not bool(torch.isfinite(s).all()):
            raise ValueError(_NONFINITE)


def _store(t: torch.Tensor, sdt: torch.dtype) -> torch.Tensor:
    """Round to the storage dtype, clamped to its finite range (no Inf); -0.0 becomes +0.0."""
    fmax = torch.finfo(sdt).max
    return t.clamp(-fmax, fmax).to(sdt).add_(0.0)


def _int_levels(spec: QuantSpec) -> tuple[int, int]:
    if spec.mapping == "symmetric":
        return -(2 ** (spec.bits - 1)), 2 ** (spec.bits - 1) - 1
    return 0, 2**spec.bits - 1


def _qparams(xv: torch.Tensor, dims: tuple | None, spec: QuantSpec) -> QParams:
    """Scale (and zero point) of each group of xv, already rounded to the storage dtype."""
    mn, mx = _minmax(xv, dims)
    _check_finite(mn, mx)
    return _range_qparams(mn, mx, spec)


def _range_qparams(mn: torch.Tensor, mx: torch.Tensor, spec: QuantSpec) -> QParams:
    """Scale (and zero point) for groups whose values lie in [mn, mx] (symmetric specs use max(-mn, mx))."""
    sdt = _SCALE_DTYPES[spec.scale_dtype]
    if spec.static_scale is not None:
        return QParams(_store(torch.full_like(mn, spec.static_scale), sdt))
    r = spec.clip_ratio
    if spec.mapping == "symmetric":
        absmax = torch.maximum(-mn, mx)
        if r != 1.0:
            absmax = absmax * r
        top = _FP8[spec.format][1] if spec.is_fp8 else _int_levels(spec)[1]
        return QParams(_store(absmax / top, sdt))
    if r != 1.0:
        mn, mx = mn * r, mx * r
    top = _int_levels(spec)[1]
    if spec.zero_point == "float":
        return QParams(_store((mx - mn) / top, sdt), _store(mn, sdt))
    mn, mx = mn.clamp(max=0.0), mx.clamp(min=0.0)
    s = _store((mx - mn) / top, sdt)
    sc = s.to(mn.dtype)
    z = (-mn / torch.where(sc == 0, 1.0, sc)).round_().clamp_(0, top).to(torch.uint8)
    return QParams(s, z)


def _codes(xv: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Codes of xv (compute dtype) given s, zp in the compute dtype: integer-valued floats, or fp8 codes."""
    safe = torch.where(s == 0, 1.0, s)
    if spec.is_fp8:
        fmax = _FP8[spec.format][1]
        return (xv / safe).clamp_(-fmax, fmax).to(_FP8[spec.format][0])
    lo, hi = _int_levels(spec)
    if spec.mapping == "symmetric":
        return (xv / safe).round_().clamp_(lo, hi)
    if spec.zero_point == "float":
        return (xv - zp).div_(safe).round_().clamp_(lo, hi)
    return (xv / safe).round_().add_(zp).clamp_(lo, hi)  # + z turns a -0.0 code into +0.0


def _recon(q: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """x^ from float codes q (modified in place). Shared by fake_quantize and dequantize, so both agree bit for bit."""
    if spec.is_fp8:
        return q.mul_(s)
    if spec.mapping == "symmetric":
        return torch.addcmul(q.new_zeros(()), q, s, out=q)  # q*s, with -0.0 (from round(-0.3)) -> +0.0
    if spec.zero_point == "float":
        return q.mul_(s).add_(zp)
    return q.sub_(zp).mul_(s)


def _fp8_to_float(codes: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """Exact fp8 -> float into `out`. e4m3fn: torch's cast is scalar on CPU (about 4x slower than this), so the
    byte is rebuilt as the float16 with bits (b & 0x80) << 8 | (b & 0x7F) << 7, which is the value / 256 (bias 15
    vs 7, subnormals included). e5m2 is the top byte of a float16: a plain copy."""
    if codes.dtype == torch.float8_e5m2:
        return out.copy_(codes)
    t = codes.view(torch.uint8).to(torch.int16)
    bits = (t & 0x80).bitwise_left_shift_(8).bitwise_or_(t.bitwise_and_(0x7F).bitwise_left_shift_(7))
    return out.copy_(bits.view(torch.float16)).mul_(256.0)


def _codes_dtype(spec: QuantSpec) -> torch.dtype:
    if spec.is_fp8:
        return _FP8[spec.format][0]
    return torch.int8 if spec.mapping == "symmetric" else torch.uint8


def _cat(parts: list[torch.Tensor], shape: tuple[int, int, int, int]) -> torch.Tensor:
    B, H, _, D = shape
    parts = [p.reshape(B, H, -1, D) for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


# ------------------------------------------------------------------------------------------------ outliers
def split_outliers(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense-and-sparse split of x [B, H, T, D]: the k largest |x| of each row (ties: the lower index first).

    Returns (dense [B, H, T, D] with those entries set to 0, values [B, H, T, k] in x's dtype, index [B, H, T, k]
    uint8, or int16 when D > 256). Worked: row [0.1, -3.0, 0.2, 2.0], k = 1 -> dense [0.1, 0, 0.2, 2.0],
    values [-3.0], index [1].
    """
    D = x.shape[-1]
    # a stable descending sort makes the choice among equal magnitudes deterministic (lowest index first)
    index = x.abs().sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    values = x.gather(-1, index)
    dense = x.scatter(-1, index, 0.0)
    return dense, values, index.to(torch.uint8 if D <= 256 else torch.int16)


def _restore_outliers(xhat: torch.Tensor, values: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor:
    if values is None:
        return xhat
    return xhat.scatter_(-1, index.long(), values.to(xhat.dtype))


# ------------------------------------------------------------------------------------------------ public API
def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams:
    """Fixed (calibrated) parameters for values in [lo, hi]; symmetric specs use absmax = max(-lo, hi).

    lo/hi: [] (tensor), [H] (head) or [H, D] (channel); the result has the static scale shape [1, 1, 1, 1],
    [1, H, 1, 1] or [1, H, 1, D] and is rounded to spec.scale_dtype (clip_ratio applies as for statistics).
    Worked (int8 symmetric, fp32 scale): lo = -2.54, hi = 1.0 -> s = 2.54 / 127 = 0.02.
    """
    if spec.is_none or spec.ggml is not None or spec.granularity not in ("tensor", "head", "channel"):
        raise ValueError(f"static parameters need granularity tensor, head or channel (not ggml); got {spec.describe()}")
    lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
    if lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have the same shape; got {tuple(lo.shape)} and {tuple(hi.shape)}")
    want = {"tensor": 0, "head": 1, "channel": 2}[spec.granularity]
    if lo.dim() != want:
        raise ValueError(f"{spec.granularity} ranges must have {want} dimension(s); got shape {tuple(lo.shape)}")
    _check_finite(lo, hi)
    if bool((lo > hi).any()):
        raise ValueError("static range has lo > hi; calibrate with a percentile of at least 50")
    spec = dataclasses.replace(spec, static_scale=None)  # the calibrated range replaces a fixed scale
    shape = {0: (1, 1, 1, 1), 1: (1, -1, 1, 1), 2: (1, lo.shape[0] if lo.dim() == 2 else 1, 1, -1)}[want]
    cdt = torch.float64 if lo.dtype == torch.float64 else torch.float32
    return _range_qparams(lo.to(cdt).reshape(shape), hi.to(cdt).reshape(shape), spec)


def choose_qparams(x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None) -> QParams:
    """Scale (and zero point) of x [B, H, T, D] for `spec`, rounded to spec.scale_dtype; shapes in module doc.

    Worked (int4 symmetric token, float16 scales): x row [0.5, -1.0, 0.25, 0.75] -> absmax 1, s = 1/7 stored as
    0.142822265625. For ggml specs this returns the stored float16 d (and min).
    """
    _check_input(x, spec)
    if spec.is_none:
        raise ValueError("format 'none' has no quantization parameters")
    cb = _resolve_block(spec, x.shape[2], channel_block)
    if x.numel() == 0:
        return _empty_qparams(spec, tuple(x.shape), cb)
    if spec.ggml is not None:
        qt = quantize(x, spec)
        return QParams(qt.scale, qt.zero_point)
    xc = x.to(_compute_dtype(x.dtype, spec))
    parts = [_qparams(xv, dims, spec) for xv, dims, _ in _segments(xc, spec, cb)]
    if len(parts) == 1:
        return parts[0]
    zp = None if parts[0].zero_point is None else torch.cat([p.zero_point for p in parts], dim=2)
    return QParams(torch.cat([p.scale for p in parts], dim=2), zp)


def _empty_qparams(spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> QParams:
    ss = _scale_shape(spec, shape, cb)
    scale = torch.zeros(ss, dtype=_SCALE_DTYPES[spec.scale_dtype])
    zp = None
    if spec.mapping == "asymmetric":
        zp = torch.zeros(ss, dtype=torch.uint8 if spec.zero_point == "int" else scale.dtype)
    return QParams(scale, zp)


def quantize(
    x: torch.Tensor, spec: QuantSpec, qparams: QParams | None = None, *, channel_block: int | None = None
) -> QuantizedTensor:
    """Quantize x [B, H, T, D] to codes [B, H, T, D] + scale (+ zero point); `qparams` gives fixed (e.g.
    calibrated) parameters of the granularity's scale shape instead of statistics (not for ggml types).

    Worked (int4 asymmetric token, float zero point): x row [-5, 0, 2.5, 10] -> m = -5, s = 15/15 = 1,
    codes round([0, 5, 7.5, 15]) = [0, 5, 8, 15] (uint8; 7.5 -> 8, half to even).
    """
    _check_input(x, spec)
    shape = tuple(x.shape)
    if spec.is_none:
        return QuantizedTensor(x, None, None, spec, x.shape, x.dtype)
    k = spec.outlier_count(shape[-1])
    if k and x.numel():
        dense, values, index = split_outliers(x, k)
        _check_finite(values)
        qt = quantize(dense, dataclasses.replace(spec, outliers=0.0), qparams, channel_block=channel_block)
        return dataclasses.replace(qt, spec=spec, outlier_values=values, outlier_index=index)
    if qparams is not None and _is_static(spec, qparams):
        return _quantize_static(x, spec, qparams)
    cb = _resolve_block(spec, shape[2], channel_block)
    cdt = _compute_dtype(x.dtype, spec)
    if x.numel() == 0:
        qp = _empty_qparams(spec, shape, cb)
        codes = torch.empty(shape, dtype=_codes_dtype(spec))
        return QuantizedTensor(codes, qp.scale, qp.zero_point, spec, x.shape, x.dtype, cb)
    xc = x.to(cdt)
    if spec.ggml is not None:
        if qparams is not None:
            raise ValueError("qparams cannot be given for ggml types (their codes use the unrounded block scale)")
        q, d, m = ggml_quantize_blocks(_segments(xc, spec, cb)[0][0], spec.ggml)
        codes = q.to(_codes_dtype(spec)).reshape(shape)
        return QuantizedTensor(codes, d, m, spec, x.shape, x.dtype, cb)
    if qparams is None:
        qparams = choose_qparams(x, spec, channel_block=channel_block)
    else:
        _check_qparams(qparams, spec, shape, cb)
        _check_finite(*_minmax(xc, None))
    s_all = qparams.scale.to(device=xc.device, dtype=cdt)
    zp_all = None if qparams.zero_point is None else qparams.zero_point.to(device=xc.device, dtype=cdt)
    parts = []
    for xv, _, sl in _segments(xc, spec, cb):
        zp = None if zp_all is None else zp_all[:, :, sl]
        q = _codes(xv, s_all[:, :, sl], zp, spec)
        parts.append(q if spec.is_fp8 else q.to(_codes_dtype(spec)))
    return QuantizedTensor(_cat(parts, shape), qparams.scale, qparams.zero_point, spec, x.shape, x.dtype, cb)


def _is_static(spec: QuantSpec, qp: QParams) -> bool:
    """Whether ``qp`` are broadcast (calibrated) parameters: a channel spec given a [1, H, 1, D] scale."""
    return spec.granularity == "channel" and qp.scale.dim() == 4 and qp.scale.shape[0] == 1 and qp.scale.shape[2] == 1


def _quantize_static(x: torch.Tensor, spec: QuantSpec, qp: QParams) -> QuantizedTensor:
    B, H, T, D = x.shape
    if qp.scale.shape[1] not in (1, H) or qp.scale.shape[3] != D:
        raise ValueError(f"static channel qparams have shape {tuple(qp.scale.shape)}; need [1, {H}, 1, {D}]")
    cdt = _compute_dtype(x.dtype, spec)
    xc = x.to(cdt)
    if xc.numel():
        _check_finite(*_minmax(xc, None))
    if (qp.zero_point is None) != (spec.mapping == "symmetric"):
        raise ValueError(f"qparams.zero_point must be {'None' if spec.mapping == 'symmetric' else 'given'} "
                         f"for mapping {spec.mapping!r}")
    zp = None if qp.zero_point is None else qp.zero_point.to(device=xc.device, dtype=cdt)
    q = _codes(xc, qp.scale.to(device=xc.device, dtype=cdt), zp, spec)
    codes = q if spec.is_fp8 else q.to(_codes_dtype(spec))
    return QuantizedTensor(codes, qp.scale, qp.zero_point, spec, x.shape, x.dtype, None, static=True)


def _check_qparams(qp: QParams, spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> None:
    want = _scale_shape(spec, shape, cb)
    if tuple(qp.scale.shape) != want:
        raise ValueError(f"qparams.scale has shape {tuple(qp.scale.shape)}; {spec.granularity} needs {want}")
    if (qp.zero_point is None) != (spec.mapping == "symmetric"):
        raise ValueError(f"qparams.zero_point must be {'None' if spec.mapping == 'symmetric' else 'given'} "
                         f"for mapping {spec.mapping!r}")
    _check_finite(qp.scale if qp.zero_point is None else torch.cat([qp.scale.float(), qp.zero_point.float()]))


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """x^ [B, H, T, D] in the original dtype: q*s (symmetric, fp8), q*s + m (float zero point), (q-z)*s (int).

    Worked: codes [0, 5, 8, 15], s = 1, m = -5 -> x^ = [-5, 0, 3, 10].
    """
    spec = qt.spec
    if spec.is_none:
        return qt.codes
    shape = tuple(qt.shape)
    if qt.codes.numel() == 0:
        return torch.empty(shape, dtype=qt.dtype)
    if qt.outlier_values is not None:
        dense = dataclasses.replace(qt, spec=dataclasses.replace(spec, outliers=0.0), outlier_values=None,
                                    outlier_index=None)
        return _restore_outliers(dequantize(dense), qt.outlier_values, qt.outlier_index)
    cdt = _compute_dtype(qt.dtype, spec)
    if qt.static:
        q = _fp8_to_float(qt.codes, out=torch.empty(shape, dtype=cdt)) if spec.is_fp8 else qt.codes.to(cdt)
        zp = None if qt.zero_point is None else qt.zero_point.to(device=q.device, dtype=cdt)
        return _recon(q, qt.scale.to(device=q.device, dtype=cdt), zp, spec).to(qt.dtype)
    if spec.ggml is not None:
        q = _segments(qt.codes, spec, None)[0][0].to(torch.float32)
        return ggml_dequantize_blocks(q, qt.scale, qt.zero_point).reshape(shape).to(qt.dtype)
    s_all = qt.scale.to(cdt)
    zp_all = None if qt.zero_point is None else qt.zero_point.to(cdt)
    parts = []
    for cv, _, sl in _segments(qt.codes, spec, qt.channel_block):
        zp = None if zp_all is None else zp_all[:, :, sl]
        q = _fp8_to_float(cv, out=torch.empty(cv.shape, dtype=cdt)) if spec.is_fp8 else cv.to(cdt)
        parts.append(_recon(q, s_all[:, :, sl], zp, spec))
    return _cat(parts, shape).to(qt.dtype)


def fake_quantize(
    x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None, qparams: QParams | None = None
) -> torch.Tensor:
    """dequantize(quantize(x)) in one call, bit for bit, without materialising integer codes: the hot path.

    x [B, H, T, D] -> x^ of the same shape and dtype; `none` returns x itself. Passes over x (float32, token int):
    one min/max reduction, then divide, round, clamp, multiply (in place on one temporary). `qparams`: fixed
    (calibrated) parameters, as for `quantize`; outliers (`spec.outliers`) go through `quantize`/`dequantize`.
    Worked (int4 symmetric, float16 scales): [0.5, -1.0, 0.25, 0.75] -> s = 0.142822265625,
    codes [4, -7, 2, 5] -> [0.5712890625, -0.999755859375, 0.28564453125, 0.714111328125].
    """
    if spec.is_none:
        return x
    _check_input(x, spec)
    if x.numel() == 0:
        return x.clone()
    if qparams is not None or spec.outliers:
        return dequantize(quantize(x, spec, qparams, channel_block=channel_block))
    shape = tuple(x.shape)
    cb = _resolve_block(spec, shape[2], channel_block)
    cdt = _compute_dtype(x.dtype, spec)
    xc = x.to(cdt)
    if spec.ggml is not None:
        q, d, m = ggml_quantize_blocks(_segments(xc, spec, cb)[0][0], spec.ggml)
        return ggml_dequantize_blocks(q, d, m).reshape(shape).to(x.dtype)
    parts = []
    for xv, dims, _ in _segments(xc, spec, cb):
        qp = _qparams(xv, dims, spec)
        s = qp.scale.to(cdt)
        zp = None if qp.zero_point is None else qp.zero_point.to(cdt)
        if spec.is_fp8:  # reuse the float buffer for the fp8 round trip: one full-size allocation, not two
            fp8, fmax = _FP8[spec.format]
            q = (xv / torch.where(s == 0, 1.0, s)).clamp_(-fmax, fmax)
            _fp8_to_float(q.to(fp8), out=q)
        else:
            q = _codes(xv, s, zp, spec)
        parts.append(_recon(q, s, zp, spec))
    return _cat(parts, shape).to(x.dtype)


# ------------------------------------------------------------------------------------------------ packing
def pack(codes: torch.Tensor, bits: int, *, signed: bool | None = None) -> torch.Tensor:
    """Pack integer codes [..., n] into uint8 [..., ceil(n*bits/8)] along the last dimension.

    Layout: a little-endian bitstream per row: code i occupies stream bits [i*bits, (i+1)*bits), least
    significant bit first, and stream bit j is bit (j % 8) of byte j // 8; the last byte is zero-padded. So INT8
    is one code per byte, INT4 two per byte (low nibble first), INT2 four per byte (bits 0-1 first), and INT3
    packs 8 codes into 3 bytes: [c0 | c1<<3 | (c2&3)<<6], [c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7], [c5>>1 | c6<<2 | c7<<5].
    `signed` (default: codes.dtype is int8) offsets codes by +2^(bits-1) first, e.g. INT4 -8..7 -> 0..15;
    pass the same `signed` to `unpack`. Codes outside the range raise ValueError.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8; got {bits}")
    if codes.is_floating_point():
        raise ValueError(f"pack expects integer codes; got {codes.dtype}")
    signed = codes.dtype == torch.int8 if signed is None else signed
    off = 2 ** (bits - 1) if signed else 0
    if codes.numel():
        lo, hi = torch.aminmax(codes)
        if int(lo) < -off or int(hi) > 2**bits - 1 - off:
            raise ValueError(f"codes in [{int(lo)}, {int(hi)}] do not fit {'signed' if signed else 'unsigned'} {bits}-bit")
    u = (codes.to(torch.int16) + off).to(torch.uint8) if off or codes.dtype != torch.uint8 else codes
    n = u.shape[-1]
    if bits == 8:
        return u.contiguous()
    per = 8 // bits
    if 8 % bits == 0 and n % per == 0:  # fast path: 1, 2, 4 bits
        g = u.reshape(*u.shape[:-1], n // per, per)
        out = g[..., 0].clone()
        for k in range(1, per):
            out |= g[..., k] << (k * bits)
        return out
    nbytes = math.ceil(n * bits / 8)
    stream = (u.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8)) & 1  # [..., n, bits]
    stream = stream.reshape(*u.shape[:-1], n * bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - n * bits))
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    return (stream.reshape(*u.shape[:-1], nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int, *, signed: bool = False) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., ceil(n*bits/8)] -> codes [..., n], int8 if `signed` else uint8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8; got {bits}")
    nbytes = math.ceil(n * bits / 8)
    if packed.dtype != torch.uint8 or packed.shape[-1] != nbytes:
        raise ValueError(f"expected uint8 [..., {nbytes}] for {n} {bits}-bit codes; got {packed.dtype} {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    per = 8 // bits
    if bits == 8:
        u = packed.clone()
    elif 8 % bits == 0 and n % per == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        u = ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(*lead, n)
    else:
        stream = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., nbytes, 8]
        stream = stream.reshape(*lead, nbytes * 8)[..., : n * bits].reshape(*lead, n, bits)
        weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.uint8)
        u = (stream * weights).sum(-1, dtype=torch.uint8)
    if not signed:
        return u
    return (u.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)


def packed_nbytes(
    spec: QuantSpec, shape: tuple[int, ...] | torch.Size, *, channel_block: int | None = None,
    dtype: torch.dtype = torch.float16, static: bool = False,
) -> dict[str, int]:
    """Exact bytes of a QuantizedTensor of x shape [B, H, T, D]: codes ceil(D*bits/8) per row of head_dim, scales
    and zero points in their dtypes (int zero points 1 byte); `dtype` is the element type for format 'none' and
    for outlier values (k per row, each with a 1-byte index, 2 bytes when D > 256). `static`: calibrated
    parameters (a channel spec then has one scale per channel and head: [1, H, 1, D]).

    Worked: int4 g64 asym, [1, 8, 4096, 128]: codes 32768 rows * 64 B = 2097152; scales: 32768*2 groups *
    (2 B fp16 scale + 2 B fp16 min) = 262144; total 2359296 (vs 8388608 in fp16: 3.56x smaller).
    """
    shape = tuple(int(v) for v in shape)
    if len(shape) != 4:
        raise ValueError(f"expected shape [batch, kv_heads, seq, head_dim]; got {shape}")
    B, H, T, D = shape
    if spec.is_none:
        n = B * H * T * D * torch.empty((), dtype=dtype).element_size()
        return {"codes": n, "scales": 0, "outliers": 0, "total": n}
    spec.check_head_dim(D)
    codes = B * H * T * math.ceil(D * spec.bits / 8)
    if static and spec.granularity == "channel":
        groups = H * D
    else:
        groups = math.prod(_scale_shape(spec, shape, _resolve_block(spec, T, channel_block)))
    per_group = torch.empty((), dtype=_SCALE_DTYPES[spec.scale_dtype]).element_size()
    if spec.mapping == "asymmetric":
        per_group += 1 if spec.zero_point == "int" else per_group
    k = spec.outlier_count(D)
    outliers = B * H * T * k * (torch.empty((), dtype=dtype).element_size() + (1 if D <= 256 else 2))
    scales = groups * per_group
    return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}
