"""Quantize / dequantize / fake-quantize K or V tensors x [batch, kv_heads, seq, head_dim] = [B, H, T, D].

Every format goes through the same code here; what differs is asked of the spec's format (`spec.fmt`, a
`kveval.quant.formats.QuantFormat`: parameters, codes, packing) and its granularity (`spec.gran`,
`kveval.quant.granularity`: statistics segments and scale shapes). Scale shapes (the zero point has the scale's
shape):
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
Scales and float zero points are rounded to `spec.scale_dtype` (x's own dtype for "model": `QuantSpec.resolved`),
clamped to its finite range, before they are used, so the reconstruction uses exactly the stored values: with
float16 scales s = 1/3 is used as 0.333251953125.
A zero scale (all-zero or constant group) divides by 1 instead: codes are 0 and x^ = 0 (symmetric) or x^ = m
(asymmetric, float zero point), never NaN. NaN/Inf in x raise ValueError, detected on the per-group statistics
(for static scales or given qparams, which have none, one min/max pass over x).

Whole-tensor formats (`QuantFormat.whole_tensor`: 'nuq', KVQuant's non-uniform codes with statistics across the
kv heads and threshold outliers) do all of the above themselves: `quantize` / `dequantize` / `packed_nbytes` hand
x to `spec.fmt.quantize_tensor` / `dequantize_tensor` / `tensor_nbytes`.

Codes (`spec.fmt.code_dtype`): symmetric int -> int8 (signed), asymmetric int -> uint8, fp8 ->
torch.float8_e4m3fn / float8_e5m2, ggml -> int8 for q8_0/q4_0/q5_0 (code = ggml's q - 8 / q - 16), uint8 for
q4_1/q5_1; always shaped [B, H, T, D]. Stored packed along head_dim (`spec.fmt.pack`): `packed_nbytes`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .formats.base import SCALE_TORCH_DTYPES, QParams, TensorParts, check_finite, minmax
from .granularity import Segment
from .packing import pack, unpack
from .spec import BLOCK_SCALE_DTYPES, QuantSpec

__all__ = [
    "QParams", "QuantizedTensor", "choose_qparams", "quantize", "dequantize", "fake_quantize", "pack", "unpack",
    "packed_nbytes", "qparams_from_range", "split_outliers",
]


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
    codebook: torch.Tensor | None = None  # a calibrated per-layer codebook ('nuq'), kept once, counted with scales

    def nbytes(self) -> dict[str, int]:
        """Bytes measured on the real tensors: codes packed row-wise along head_dim (`spec.fmt.pack`), scales +
        zero points (+ a calibrated codebook), outliers (values + indices).

        Equals `packed_nbytes(spec, shape)`; e.g. int4 g64 on [1, 8, 4096, 128]: codes 32768*64 = 2 MiB,
        scales + float16 mins 32768*2*(2+2) = 256 KiB.
        """
        spec = self.spec
        if spec.is_none:
            codes = self.codes.numel() * self.codes.element_size()
        else:
            packed = spec.fmt.pack(self.codes, spec)
            codes = packed.numel() * packed.element_size()
        scales = sum(t.numel() * t.element_size() for t in (self.scale, self.zero_point, self.codebook)
                     if t is not None)
        outliers = sum(t.numel() * t.element_size() for t in (self.outlier_values, self.outlier_index) if t is not None)
        return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}


# ------------------------------------------------------------------------------------------------ helpers
def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected x of shape [batch, kv_heads, seq, head_dim]; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor; got {x.dtype}")
    spec.check_head_dim(x.shape[-1])


def _resolve_block(spec: QuantSpec, seq: int, channel_block: int | None) -> int | None:
    """The token block of channel statistics (`channel_block`, default all `seq` tokens); None otherwise."""
    if spec.is_none:
        return None
    return spec.gran.block(seq, channel_block)


def _segments(t: torch.Tensor, spec: QuantSpec, cb: int | None) -> list[Segment]:
    """Views of t [B, H, T, D] whose statistics groups are reduced over `dims` (keepdim gives the scale shape);
    `scale_slice` selects the segment's part of the scale along dim 2 (channel granularity with a partial last
    block). See `kveval.quant.granularity`."""
    return spec.gran.segments(t, cb)


def _scale_shape(spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> tuple[int, ...]:
    return spec.gran.scale_shape(shape, cb)


def _cat(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    B, H, _, D = shape
    parts = [p.reshape(B, H, -1, D) for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _cat_qparams(parts: list[QParams]) -> QParams:
    """Parameters of consecutive segments (token blocks along dim 2) as one."""
    if len(parts) == 1:
        return parts[0]
    zps = [p.zero_point for p in parts if p.zero_point is not None]
    zp = torch.cat(zps, dim=2) if zps else None
    return QParams(torch.cat([p.scale for p in parts], dim=2), zp)


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
    if values is None or index is None:
        return xhat
    return xhat.scatter_(-1, index.long(), values.to(xhat.dtype))


# ------------------------------------------------------------------------------------------------ public API
def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams:
    """Fixed (calibrated) parameters for values in [lo, hi]; symmetric specs use absmax = max(-lo, hi).

    lo/hi: [] (tensor), [H] (head) or [H, D] (channel); the result has the static scale shape [1, 1, 1, 1],
    [1, H, 1, 1] or [1, H, 1, D] and is rounded to spec.scale_dtype (clip_ratio applies as for statistics).
    Worked (int8 symmetric, fp32 scale): lo = -2.54, hi = 1.0 -> s = 2.54 / 127 = 0.02.
    """
    if not spec.calibratable:
        raise ValueError(f"static parameters need granularity tensor, head or channel (not ggml); got {spec.describe()}")
    gran = spec.gran
    lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
    if lo.shape != hi.shape:
        raise ValueError(f"lo and hi must have the same shape; got {tuple(lo.shape)} and {tuple(hi.shape)}")
    spec = spec.resolved(lo.dtype if lo.is_floating_point() else torch.float32)
    if lo.dim() != gran.range_ndim:
        raise ValueError(f"{gran.name} ranges must have {gran.range_ndim} dimension(s); "
                         f"got shape {tuple(lo.shape)}")
    check_finite(lo, hi)
    if bool((lo > hi).any()):
        raise ValueError("static range has lo > hi; calibrate with a percentile of at least 50")
    spec = dataclasses.replace(spec, static_scale=None)  # the calibrated range replaces a fixed scale
    H = lo.shape[0] if lo.dim() >= 1 else 1
    D = lo.shape[1] if lo.dim() == 2 else 1
    shape = gran.static_scale_shape(H, D)
    cdt = torch.float64 if lo.dtype == torch.float64 else torch.float32
    return spec.fmt.range_qparams(lo.to(cdt).reshape(shape), hi.to(cdt).reshape(shape), spec)


def choose_qparams(x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None) -> QParams:
    """Scale (and zero point) of x [B, H, T, D] for `spec`, rounded to spec.scale_dtype; shapes in module doc.

    Worked (int4 symmetric token, float16 scales): x row [0.5, -1.0, 0.25, 0.75] -> absmax 1, s = 1/7 stored as
    0.142822265625. For ggml specs this returns the stored float16 d (and min).
    """
    _check_input(x, spec)
    if spec.is_none:
        raise ValueError("format 'none' has no quantization parameters")
    spec = spec.resolved(x.dtype)
    fmt = spec.fmt
    if fmt.whole_tensor:
        raise ValueError(f"format {fmt.name!r} quantizes the whole tensor; use quantize(x, spec).scale")
    cb = _resolve_block(spec, x.shape[2], channel_block)
    if x.numel() == 0:
        return _empty_qparams(spec, tuple(x.shape), cb)
    xc = x.to(fmt.compute_dtype(x.dtype))
    return _cat_qparams([fmt.group_qparams(xv, dims, spec) for xv, dims, _ in _segments(xc, spec, cb)])


def _empty_qparams(spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> QParams:
    ss = _scale_shape(spec, shape, cb)
    scale = torch.zeros(ss, dtype=SCALE_TORCH_DTYPES.get(spec.scale_dtype) or BLOCK_SCALE_DTYPES[spec.scale_dtype])
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
    spec = spec.resolved(x.dtype)
    if spec.fmt.whole_tensor:
        return _quantize_whole(x, spec, qparams)
    k = spec.outlier_count(shape[-1])
    if k and x.numel():
        dense, values, index = split_outliers(x, k)
        check_finite(values)
        qt = quantize(dense, dataclasses.replace(spec, outliers=0.0), qparams, channel_block=channel_block)
        return dataclasses.replace(qt, spec=spec, outlier_values=values, outlier_index=index)
    if qparams is not None and _is_static(spec, qparams):
        return _quantize_static(x, spec, qparams)
    fmt = spec.fmt
    cb = _resolve_block(spec, shape[2], channel_block)
    if x.numel() == 0:
        qp = _empty_qparams(spec, shape, cb)
        codes = torch.empty(shape, dtype=fmt.code_dtype(spec))
        return QuantizedTensor(codes, qp.scale, qp.zero_point, spec, x.shape, x.dtype, cb)
    xc = x.to(fmt.compute_dtype(x.dtype))
    if qparams is None:
        fits = [fmt.fit(xv, dims, spec) for xv, dims, _ in _segments(xc, spec, cb)]
        qparams = _cat_qparams([qp for _, qp in fits])
        codes = _cat([c for c, _ in fits], shape)
        return QuantizedTensor(codes, qparams.scale, qparams.zero_point, spec, x.shape, x.dtype, cb)
    _check_qparams(qparams, spec, shape, cb)
    check_finite(*minmax(xc, None))
    s_all = qparams.scale.to(device=xc.device, dtype=xc.dtype)
    zp_all = None if qparams.zero_point is None else qparams.zero_point.to(device=xc.device, dtype=xc.dtype)
    parts = []
    for xv, _, sl in _segments(xc, spec, cb):
        zp = None if zp_all is None else zp_all[:, :, sl]
        parts.append(fmt.encode(xv, s_all[:, :, sl], zp, spec))
    return QuantizedTensor(_cat(parts, shape), qparams.scale, qparams.zero_point, spec, x.shape, x.dtype, cb)


def _quantize_whole(x: torch.Tensor, spec: QuantSpec, qparams: QParams | None) -> QuantizedTensor:
    parts: TensorParts = spec.fmt.quantize_tensor(x, spec, qparams)
    return QuantizedTensor(parts.codes, parts.scale, parts.zero_point, spec, x.shape, x.dtype, None,
                           static=parts.static, outlier_values=parts.outlier_values,
                           outlier_index=parts.outlier_index, codebook=parts.codebook)


def _is_static(spec: QuantSpec, qp: QParams) -> bool:
    """Whether ``qp`` are broadcast (calibrated) parameters: a channel spec given a [1, H, 1, D] scale."""
    return spec.gran.token_blocks and qp.scale.dim() == 4 and qp.scale.shape[0] == 1 and qp.scale.shape[2] == 1


def _quantize_static(x: torch.Tensor, spec: QuantSpec, qp: QParams) -> QuantizedTensor:
    B, H, T, D = x.shape
    if qp.scale.shape[1] not in (1, H) or qp.scale.shape[3] != D:
        raise ValueError(f"static {spec.granularity} qparams have shape {tuple(qp.scale.shape)}; "
                         f"need [1, {H}, 1, {D}]")
    fmt = spec.fmt
    xc = x.to(fmt.compute_dtype(x.dtype))
    if xc.numel():
        check_finite(*minmax(xc, None))
    if (qp.zero_point is None) != (spec.mapping == "symmetric"):
        raise ValueError(f"qparams.zero_point must be {'None' if spec.mapping == 'symmetric' else 'given'} "
                         f"for mapping {spec.mapping!r}")
    zp = None if qp.zero_point is None else qp.zero_point.to(device=xc.device, dtype=xc.dtype)
    codes = fmt.encode(xc, qp.scale.to(device=xc.device, dtype=xc.dtype), zp, spec)
    return QuantizedTensor(codes, qp.scale, qp.zero_point, spec, x.shape, x.dtype, None, static=True)


def _check_qparams(qp: QParams, spec: QuantSpec, shape: tuple[int, ...], cb: int | None) -> None:
    want = _scale_shape(spec, shape, cb)
    if tuple(qp.scale.shape) != want:
        raise ValueError(f"qparams.scale has shape {tuple(qp.scale.shape)}; {spec.granularity} needs {want}")
    if (qp.zero_point is None) != (spec.mapping == "symmetric"):
        raise ValueError(f"qparams.zero_point must be {'None' if spec.mapping == 'symmetric' else 'given'} "
                         f"for mapping {spec.mapping!r}")
    check_finite(qp.scale if qp.zero_point is None else torch.cat([qp.scale.float(), qp.zero_point.float()]))


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
    if spec.fmt.whole_tensor:
        return spec.fmt.dequantize_tensor(qt)
    if qt.outlier_values is not None:
        dense = dataclasses.replace(qt, spec=dataclasses.replace(spec, outliers=0.0), outlier_values=None,
                                    outlier_index=None)
        return _restore_outliers(dequantize(dense), qt.outlier_values, qt.outlier_index)
    assert qt.scale is not None
    fmt = spec.fmt
    cdt = fmt.compute_dtype(qt.dtype)
    if qt.static:
        dev = qt.codes.device
        zp = None if qt.zero_point is None else qt.zero_point.to(device=dev, dtype=cdt)
        return fmt.decode(qt.codes, qt.scale.to(device=dev, dtype=cdt), zp, spec).to(qt.dtype)
    s_all = qt.scale.to(cdt)
    zp_all = None if qt.zero_point is None else qt.zero_point.to(cdt)
    parts = []
    for cv, _, sl in _segments(qt.codes, spec, qt.channel_block):
        zp = None if zp_all is None else zp_all[:, :, sl]
        parts.append(fmt.decode(cv, s_all[:, :, sl], zp, spec))
    return _cat(parts, shape).to(qt.dtype)


def fake_quantize(
    x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None, qparams: QParams | None = None
) -> torch.Tensor:
    """dequantize(quantize(x)) in one call, bit for bit, without materialising the stored codes: the hot path.

    x [B, H, T, D] -> x^ of the same shape and dtype; `none` returns x itself. Passes over x (float32, token int):
    one min/max reduction, then divide, round, clamp, multiply (in place on one temporary; `spec.fmt.fake`).
    `qparams`: fixed (calibrated) parameters, as for `quantize`; outliers (`spec.outliers`) go through
    `quantize`/`dequantize`.
    Worked (int4 symmetric, float16 scales): [0.5, -1.0, 0.25, 0.75] -> s = 0.142822265625,
    codes [4, -7, 2, 5] -> [0.5712890625, -0.999755859375, 0.28564453125, 0.714111328125].
    """
    if spec.is_none:
        return x
    _check_input(x, spec)
    spec = spec.resolved(x.dtype)
    if x.numel() == 0:
        return x.clone()
    if qparams is not None or spec.outliers or spec.fmt.whole_tensor:
        return dequantize(quantize(x, spec, qparams, channel_block=channel_block))
    shape = tuple(x.shape)
    fmt = spec.fmt
    cb = _resolve_block(spec, shape[2], channel_block)
    xc = x.to(fmt.compute_dtype(x.dtype))
    parts = [fmt.fake(xv, dims, spec) for xv, dims, _ in _segments(xc, spec, cb)]
    return _cat(parts, shape).to(x.dtype)


# ------------------------------------------------------------------------------------------------ bytes
def packed_nbytes(
    spec: QuantSpec, shape: tuple[int, ...] | torch.Size, *, channel_block: int | None = None,
    dtype: torch.dtype = torch.float16, static: bool = False,
) -> dict[str, int]:
    """Exact bytes of a QuantizedTensor of x shape [B, H, T, D]: codes `spec.fmt.row_nbytes(spec, D)` per row of
    head_dim (ceil(D*bits/8) for integer codes), scales and zero points in their dtypes (int zero points 1 byte,
    `spec.fmt.param_nbytes`); `dtype` is the element type for format 'none' and for outlier values (k per row,
    each with a 1-byte index, 2 bytes when D > 256), and the scale dtype of a ``model`` spec. `static`: calibrated parameters (a channel spec then has
    one scale per channel and head: [1, H, 1, D]; a 'nuq' spec adds its codebook). A whole-tensor format counts
    its own (`QuantFormat.tensor_nbytes`).

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
    spec = spec.resolved(dtype)
    spec.check_head_dim(D)
    fmt, gran = spec.fmt, spec.gran
    if fmt.whole_tensor:
        return fmt.tensor_nbytes(spec, (B, H, T, D), dtype, static)
    codes = B * H * T * fmt.row_nbytes(spec, D)
    if static and gran.calibratable:
        groups = math.prod(gran.static_scale_shape(H, D))
    else:
        groups = math.prod(gran.scale_shape(shape, _resolve_block(spec, T, channel_block)))
    k = spec.outlier_count(D)
    outliers = B * H * T * k * (torch.empty((), dtype=dtype).element_size() + (1 if D <= 256 else 2))
    scales = groups * fmt.param_nbytes(spec)
    return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}
