"""Quantize / dequantize / fake-quantize K or V tensors x [batch, kv_heads, seq, head_dim] = [B, H, T, D].

The public operations: the input is checked and the spec resolved here, and the work is the spec's format's
(`spec.fmt`, a `kveval.quant.formats.TensorFormat`: ``quantize_tensor``, ``dequantize_tensor``,
``tensor_nbytes``; the per-segment formats share `kveval.quant.formats.segment.QuantFormat`, which does the
statistics segments of the granularity, `spec.gran`). Scale shapes of the per-segment formats (the zero point has
the scale's shape):
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

Whole-tensor formats ('nuq', KVQuant's non-uniform codes with statistics across the kv heads and threshold
outliers: a `TensorFormat` that is not a `QuantFormat`) do all of the above their own way.

Codes (`spec.fmt.code_dtype`): symmetric int -> int8 (signed), asymmetric int -> uint8, fp8 ->
torch.float8_e4m3fn / float8_e5m2, ggml -> int8 for q8_0/q4_0/q5_0 (code = ggml's q - 8 / q - 16), uint8 for
q4_1/q5_1; always shaped [B, H, T, D]. Stored packed along head_dim (`spec.fmt.pack`): `packed_nbytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .formats.base import QParams, TensorParts, check_finite
from .formats.segment import QuantFormat, split_outliers
from .packing import pack, unpack
from .spec import QuantSpec

__all__ = [
    "QParams", "QuantizedTensor", "choose_qparams", "quantize", "dequantize", "dequantize_into", "fake_quantize", "pack", "unpack",
    "packed_nbytes", "qparams_from_range", "quantize_packed", "split_outliers",
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

    @classmethod
    def of(cls, parts: TensorParts, spec: QuantSpec, x: torch.Tensor) -> QuantizedTensor:
        """The stored form of ``x`` from what its format's ``quantize_tensor`` returned."""
        return cls(parts.codes, parts.scale, parts.zero_point, spec, x.shape, x.dtype, parts.channel_block,
                   static=parts.static, outlier_values=parts.outlier_values, outlier_index=parts.outlier_index,
                   codebook=parts.codebook)


# ------------------------------------------------------------------------------------------------ helpers
def _check_input(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected x of shape [batch, kv_heads, seq, head_dim]; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor; got {x.dtype}")
    spec.check_head_dim(x.shape[-1])


def _segment_format(spec: QuantSpec, what: str) -> QuantFormat:
    fmt = spec.fmt
    if not isinstance(fmt, QuantFormat):
        raise ValueError(f"format {fmt.name!r} quantizes the whole tensor; {what}")
    return fmt


# ------------------------------------------------------------------------------------------------ public API
def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams:
    """Fixed (calibrated) parameters for values in [lo, hi]; symmetric specs use absmax = max(-lo, hi).

    lo/hi: [] (tensor), [H] (head) or [H, D] (channel); the result has the static scale shape [1, 1, 1, 1],
    [1, H, 1, 1] or [1, H, 1, D] and is rounded to spec.scale_dtype (clip_ratio applies as for statistics).
    Worked (int8 symmetric, fp32 scale): lo = -2.54, hi = 1.0 -> s = 2.54 / 127 = 0.02.
    """
    if not spec.calibratable:
        raise ValueError(f"static parameters need granularity tensor, head or channel (not ggml); got {spec.describe()}")
    fmt = _segment_format(spec, "it takes its parameters from a scales file (kveval calibrate), not from a range")
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
    return fmt.static_qparams(lo, hi, spec, gran.static_scale_shape(H, D))


def choose_qparams(x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None) -> QParams:
    """Scale (and zero point) of x [B, H, T, D] for `spec`, rounded to spec.scale_dtype; shapes in module doc.

    Worked (int4 symmetric token, float16 scales): x row [0.5, -1.0, 0.25, 0.75] -> absmax 1, s = 1/7 stored as
    0.142822265625. For ggml specs this returns the stored float16 d (and min).
    """
    _check_input(x, spec)
    if spec.is_none:
        raise ValueError("format 'none' has no quantization parameters")
    spec = spec.resolved(x.dtype)
    fmt = _segment_format(spec, "use quantize(x, spec).scale")
    return fmt.choose_qparams(x, spec, channel_block)


def quantize(
    x: torch.Tensor, spec: QuantSpec, qparams: QParams | None = None, *, channel_block: int | None = None
) -> QuantizedTensor:
    """Quantize x [B, H, T, D] to codes [B, H, T, D] + scale (+ zero point); `qparams` gives fixed (e.g.
    calibrated) parameters of the granularity's scale shape instead of statistics (not for ggml types).

    Worked (int4 asymmetric token, float zero point): x row [-5, 0, 2.5, 10] -> m = -5, s = 15/15 = 1,
    codes round([0, 5, 7.5, 15]) = [0, 5, 8, 15] (uint8; 7.5 -> 8, half to even).
    """
    _check_input(x, spec)
    if spec.is_none:
        return QuantizedTensor(x, None, None, spec, x.shape, x.dtype)
    spec = spec.resolved(x.dtype)
    return QuantizedTensor.of(spec.fmt.quantize_tensor(x, spec, qparams, channel_block), spec, x)


def quantize_packed(x: torch.Tensor, spec: QuantSpec, *,
                    decode: bool = True) -> tuple[QuantizedTensor, torch.Tensor, torch.Tensor | None] | None:
    """``quantize(x, spec)`` from x's own statistics with its codes packed (``spec.fmt.pack``) and, with
    ``decode``, ``dequantize`` of it, by the format's fused path (`TensorFormat.quantize_packed`), bit for bit:
    (the QuantizedTensor, its codes empty since the packed rows ``[B, H, T, row_nbytes]`` hold them; the packed
    rows; the read-back values ``[B, H, T, D]`` or None). None where the format has no such path: the caller
    quantizes, packs and dequantizes."""
    _check_input(x, spec)
    if spec.is_none or not x.numel():
        return None
    spec = spec.resolved(x.dtype)
    got = spec.fmt.quantize_packed(x, spec, decode)
    if got is None:
        return None
    parts, packed, decoded = got
    return QuantizedTensor.of(parts, spec, x), packed, decoded


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """x^ [B, H, T, D] in the original dtype: q*s (symmetric, fp8), q*s + m (float zero point), (q-z)*s (int).

    Worked: codes [0, 5, 8, 15], s = 1, m = -5 -> x^ = [-5, 0, 3, 10].
    """
    if qt.spec.is_none:
        return qt.codes
    if qt.codes.numel() == 0:
        return torch.empty(tuple(qt.shape), dtype=qt.dtype)
    return qt.spec.fmt.dequantize_tensor(qt)


def dequantize_into(qt: QuantizedTensor, out: torch.Tensor) -> None:
    """``out[...] = dequantize(qt)`` (``out`` of ``qt``'s shape and dtype, a view of a larger buffer allowed), by the
    format's in-place path where it has one (`QuantFormat.dequantize_into`): bit for bit the same values."""
    if qt.spec.is_none:
        out.copy_(qt.codes)
    elif qt.codes.numel():
        qt.spec.fmt.dequantize_into(qt, out)


def fake_quantize(
    x: torch.Tensor, spec: QuantSpec, *, channel_block: int | None = None, qparams: QParams | None = None
) -> torch.Tensor:
    """dequantize(quantize(x)) in one call, bit for bit, without materialising the stored codes: the hot path.

    x [B, H, T, D] -> x^ of the same shape and dtype; `none` returns x itself. Passes over x (float32, token int):
    one min/max reduction, then divide, round, clamp, multiply (in place on one temporary; `spec.fmt.fake`).
    `qparams`: fixed (calibrated) parameters, as for `quantize`; outliers (`spec.outliers`) and formats without a
    fused path go through `quantize`/`dequantize`.
    Worked (int4 symmetric, float16 scales): [0.5, -1.0, 0.25, 0.75] -> s = 0.142822265625,
    codes [4, -7, 2, 5] -> [0.5712890625, -0.999755859375, 0.28564453125, 0.714111328125].
    """
    if spec.is_none:
        return x
    _check_input(x, spec)
    spec = spec.resolved(x.dtype)
    if x.numel() == 0:
        return x.clone()
    if qparams is None:
        fused = spec.fmt.fake_tensor(x, spec, channel_block)
        if fused is not None:
            return fused
    return dequantize(quantize(x, spec, qparams, channel_block=channel_block))


# ------------------------------------------------------------------------------------------------ bytes
def packed_nbytes(
    spec: QuantSpec, shape: tuple[int, ...] | torch.Size, *, channel_block: int | None = None,
    dtype: torch.dtype = torch.float16, static: bool = False,
) -> dict[str, int]:
    """Exact bytes of a QuantizedTensor of x shape [B, H, T, D]: codes `spec.fmt.row_nbytes(spec, D)` per row of
    head_dim (ceil(D*bits/8) for integer codes), scales and zero points in their dtypes (int zero points 1 byte,
    `spec.fmt.param_nbytes`); `dtype` is the element type for format 'none' and for outlier values (k per row,
    each with a 1-byte index, 2 bytes when D > 256), and the scale dtype of a ``model`` spec. `static`: calibrated parameters (a channel spec then has
    one scale per channel and head: [1, H, 1, D]; a 'nuq' spec adds its codebook). Each format counts what its
    `quantize_tensor` stores (`TensorFormat.tensor_nbytes`).

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
    return spec.fmt.tensor_nbytes(spec, (B, H, T, D), dtype, static, channel_block)
