"""The quantizer-format interface: what one code format (int, fp8, a ggml block type, ...) provides.

`kveval.quant.primitives` does everything that is the same for every format (statistics segments of the
granularity, outliers, calibrated parameters, checks, bookkeeping) and asks the spec's format (`spec.fmt`, a
`QuantFormat` from the registry in `kveval.quant.formats`) for the rest. A new format is one module: a subclass
of `QuantFormat` plus `register_format(...)` (and a preset entry to give it a name).

Vocabulary. A segment xv is a view of x [B, H, T, D] whose statistics groups are reduced over `dims`
(`kveval.quant.granularity`), e.g. xv [B, H, T, D] with dims (-1,) for token granularity, or [B, H, T, D//g, g]
for group granularity; xv is in the compute dtype (`compute_dtype`: float32, float64 for float64 inputs).
- parameters: `QParams(scale, zero_point)` of keepdim-reduced shape (e.g. [B, H, T, 1]), in their storage dtypes
  (the scale in `spec.scale_dtype`, rounded with `store`); the zero point None for symmetric mappings.
- codes: the stored form of xv, of xv's shape, in `code_dtype(spec)` (int8, uint8, a float8 dtype, ...).
- packed: codes as uint8 rows along head_dim, `row_nbytes(spec, D)` bytes per row of D codes; the real cache
  stores these, and `packed_nbytes` (hence the memory bill) counts them.

Methods a format must implement: `code_bits`, `code_dtype`, `range_qparams`, `encode`, `decode`; optional:
`validate`, `check_head_dim`, `fit` / `fake` (fused or faster paths, bit for bit with encode + decode), `pack` /
`unpack` / `row_nbytes` (default: the `kveval.quant.packing` bitstream of `code_bits`-bit integers),
`takes_calibration` (whether a scales file gives the spec parameters).
A whole-tensor format (``whole_tensor = True``: statistics over all kv heads of a token, outliers chosen by
thresholds, a calibrated codebook; 'nuq') instead implements `quantize_tensor` (x [B, H, T, D] -> `TensorParts`),
`dequantize_tensor` and `tensor_nbytes`; `primitives` hands it the tensor and wraps what it returns.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..packing import pack, unpack

if TYPE_CHECKING:
    from ..spec import QuantSpec

#: storage dtypes of scales (and float zero points), by QuantSpec.scale_dtype
SCALE_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                              "bfloat16": torch.bfloat16, "float64": torch.float64}
#: QuantSpec.scale_dtype "model": the scales take the dtype of the tensor quantized (the model's K/V dtype), as
#: optimum-quanto's MaxOptimizer does (its scale and shift are computed in the base tensor's dtype); resolved by
#: `kveval.quant.primitives` from the tensor (or, for byte counts, from the element dtype given)
MODEL_DTYPE = "model"
SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", MODEL_DTYPE: "model-dtype"}
NONFINITE = "non-finite values in input to quantize"


@dataclass
class QParams:
    """Scale (stored dtype, shape per granularity) and zero point: None (symmetric), the rounded group min in the
    scale dtype (zero_point='float') or uint8 z (zero_point='int'). ``codebook``: a calibrated per-layer codebook
    (float32 [2^bits], ascending) for the formats that take one (``nuq``), else None."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    codebook: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> QParams:
        """The same parameters on ``device`` (every tensor moved, dtypes kept)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return QParams(self.scale.to(device), move(self.zero_point), move(self.codebook))


@dataclass
class TensorParts:
    """What a whole-tensor format (``QuantFormat.whole_tensor``) stores for x [B, H, T, D]; `primitives.quantize`
    wraps it in a QuantizedTensor. ``codes`` [B, H, T, D] (``code_dtype``); ``scale`` / ``zero_point`` its
    parameters in their storage dtype (shapes are the format's); ``static``: the parameters are fixed (calibrated)
    and broadcast over the tokens (a cache keeps them once); ``outlier_values`` / ``outlier_index``: sparse
    entries with tokens on dim 2; ``codebook``: per-layer parameters kept once whatever the tokens."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    static: bool = False
    outlier_values: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None
    codebook: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ helpers
def minmax(xv: torch.Tensor, dims: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min and max with keepdim (NaN propagates). torch.aminmax is one pass but, along a dim, about 5x
    slower on CPU than amin + amax (torch 2.13), so it is used only for the full reduction."""
    if dims is None:
        mn, mx = torch.aminmax(xv)
        one = (1,) * xv.dim()
        return mn.reshape(one), mx.reshape(one)
    return xv.amin(dims, keepdim=True), xv.amax(dims, keepdim=True)


def check_finite(*stats: torch.Tensor) -> None:
    """Raise ValueError('non-finite values in input to quantize') when any of `stats` holds NaN or Inf."""
    for s in stats:
        if not bool(torch.isfinite(s).all()):
            raise ValueError(NONFINITE)


def store(t: torch.Tensor, sdt: torch.dtype) -> torch.Tensor:
    """Round to the storage dtype, clamped to its finite range (no Inf); -0.0 becomes +0.0."""
    fmax = torch.finfo(sdt).max
    return t.clamp(-fmax, fmax).to(sdt).add_(0.0)


def symmetric_qparams(mn: torch.Tensor, mx: torch.Tensor, spec: QuantSpec, top: float) -> QParams:
    """s = clip_ratio * max(-mn, mx) / top (the largest code), or spec.static_scale, rounded to the scale dtype.

    Worked: mn = -1, mx = 0.75, top = 7 (int4), float16 -> s = 1/7 stored as 0.142822265625."""
    sdt = SCALE_TORCH_DTYPES[spec.scale_dtype]
    if spec.static_scale is not None:
        return QParams(store(torch.full_like(mn, spec.static_scale), sdt))
    absmax = torch.maximum(-mn, mx)
    if spec.clip_ratio != 1.0:
        absmax = absmax * spec.clip_ratio
    return QParams(store(absmax / top, sdt))


def nonzero(s: torch.Tensor) -> torch.Tensor:
    """s with zeros replaced by 1 (a zero scale divides by 1: codes 0, never NaN)."""
    return torch.where(s == 0, 1.0, s)


# ------------------------------------------------------------------------------------------------ interface
class QuantFormat(ABC):
    """One code format. Instances are registered by `name` (`register_format`); they hold no per-tensor state.

    `spec_field`: the QuantSpec field that names the format: 'format' (e.g. format: int), or 'ggml' for the ggml
    block types, spelled format='int', ggml='q4_0' in configs (as before formats were plug-ins).
    `supports_static`: takes fixed parameters (calibrated `qparams`, `static_scale`); `mappings`: those it takes.
    """

    name: str
    spec_field: str = "format"
    supports_static: bool = True
    mappings: tuple[str, ...] = ("symmetric", "asymmetric")
    #: the format quantizes x [B, H, T, D] as a whole (statistics across heads, data-dependent outliers: ``nuq``):
    #: `primitives` then calls `quantize_tensor` / `dequantize_tensor` / `tensor_nbytes` instead of the
    #: per-segment methods
    whole_tensor: bool = False

    # ---- the spec -----------------------------------------------------------------------------------------
    def validate(self, spec: QuantSpec) -> None:
        """Raise ValueError (one line) for fields this format does not take. QuantSpec has checked the choice
        fields (mapping, granularity, scale_dtype, zero_point) and that bits is an integer; it checks group size,
        clip ratio, static scale and outliers afterwards."""
        if spec.mapping not in self.mappings:
            allowed = " or ".join(map(repr, self.mappings))
            raise ValueError(f"QuantSpec.mapping must be {allowed} for format {self.name!r}; got {spec.mapping!r}")

    def takes_calibration(self, spec: QuantSpec) -> bool:
        """Whether a policy's scales file gives this spec fixed parameters (``QuantSpec.calibratable``; default: a
        format that takes static parameters at granularity tensor, head or channel)."""
        return self.supports_static and spec.gran.calibratable

    def check_head_dim(self, spec: QuantSpec, head_dim: int) -> None:
        """Raise ValueError (one line) when this format cannot quantize rows of head_dim elements (default: any
        head_dim; `QuantSpec.check_head_dim` asks, so a policy refuses such a model before its first forward pass)."""
        return None

    @abstractmethod
    def code_bits(self, spec: QuantSpec) -> int:
        """Bits of one code (int4: 4, fp8: 8; 16 for 'none', the FP16 baseline)."""

    def bits_label(self, spec: QuantSpec) -> str:
        """Short bits label for reports ('4', 'FP8', '16')."""
        return str(self.code_bits(spec))

    def bits_per_element(self, spec: QuantSpec, head_dim: int) -> float:
        """Stored bits per element of a head_dim row: packed codes, plus the scales and zero points of the groups
        inside the row (token, group); per-channel, per-head and per-tensor parameters are amortised over the
        tokens and not counted. Worked: int4 g64 asym fp16, D = 128: (64 B + 2 groups * 4 B) * 8 / 128 = 4.5."""
        groups = spec.gran.groups_per_row(head_dim)
        return 8 * (self.row_nbytes(spec, head_dim) + self.param_nbytes(spec) * groups) / head_dim

    def short_name(self, spec: QuantSpec) -> str:
        """First word of `describe()`: the format name ('fp8_e4m3'), 'int4' for int."""
        return self.name

    def describe(self, spec: QuantSpec) -> str:
        """Short human string, e.g. 'int4 asym g64 (fp16 scales)'."""
        parts = [self.short_name(spec), "sym" if spec.mapping == "symmetric" else "asym", spec.gran.label()]
        if spec.mapping == "asymmetric" and spec.zero_point == "int":
            parts.append("int-zp")
        if spec.clip_ratio != 1.0:
            parts.append(f"clip {spec.clip_ratio:g}")
        if spec.static_scale is not None:
            parts.append(f"static scale {spec.static_scale:g}")
        if spec.outliers:
            parts.append(f"{100 * spec.outliers:g}% outliers")
        return " ".join(parts) + f" ({SHORT_DTYPE[spec.scale_dtype]} scales)"

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Arithmetic dtype for an input of `dtype`: float64 for float64, else float32."""
        return torch.float64 if dtype == torch.float64 else torch.float32

    # ---- parameters ---------------------------------------------------------------------------------------
    @abstractmethod
    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: QuantSpec) -> QParams:
        """Parameters for groups whose values lie in [mn, mx] (keepdim shapes, compute dtype), rounded to the
        storage dtype: from a segment's statistics (`group_qparams`) or from a calibrated range."""

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: QuantSpec) -> QParams:
        """Parameters from the statistics of segment xv: one min/max pass (NaN/Inf raise ValueError)."""
        mn, mx = minmax(xv, dims)
        check_finite(mn, mx)
        return self.range_qparams(mn, mx, spec)

    # ---- codes --------------------------------------------------------------------------------------------
    @abstractmethod
    def code_dtype(self, spec: QuantSpec) -> torch.dtype:
        """Storage dtype of the codes."""

    @abstractmethod
    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec) -> torch.Tensor:
        """Codes (xv's shape, `code_dtype`) of xv given parameters already in xv's dtype (broadcastable).
        Must not modify xv (it may be the caller's tensor)."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: QuantSpec) -> torch.Tensor:
        """x^ (codes' shape, in scale's dtype, the compute dtype) from codes and parameters in that dtype."""

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: QuantSpec) -> tuple[torch.Tensor, QParams]:
        """(codes, parameters) of segment xv from its own statistics; override when the two are fused (ggml)."""
        qp = self.group_qparams(xv, dims, spec)
        zp = None if qp.zero_point is None else qp.zero_point.to(xv.dtype)
        return self.encode(xv, qp.scale.to(xv.dtype), zp, spec), qp

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: QuantSpec) -> torch.Tensor:
        """decode(fit(xv)) (x^ of xv's shape and dtype), bit for bit; override with a faster path that skips the
        storage dtype (the emulation hot path: one min/max pass, in-place arithmetic)."""
        codes, qp = self.fit(xv, dims, spec)
        zp = None if qp.zero_point is None else qp.zero_point.to(xv.dtype)
        return self.decode(codes, qp.scale.to(xv.dtype), zp, spec)

    # ---- storage ------------------------------------------------------------------------------------------
    def pack(self, codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        """Codes [..., D] -> uint8 rows [..., row_nbytes(spec, D)] as stored (default: `packing.pack` of
        `code_bits`-bit integers, signed codes offset by 2^(bits-1))."""
        return pack(codes, self.code_bits(spec))

    def unpack(self, packed: torch.Tensor, spec: QuantSpec, n: int) -> torch.Tensor:
        """Inverse of `pack`: uint8 rows [..., row_nbytes(spec, n)] -> codes [..., n] in `code_dtype`."""
        return unpack(packed, self.code_bits(spec), n, signed=self.code_dtype(spec) == torch.int8)

    def row_nbytes(self, spec: QuantSpec, head_dim: int) -> int:
        """Packed bytes of one row of head_dim codes: ceil(head_dim * code_bits / 8)."""
        return math.ceil(head_dim * self.code_bits(spec) / 8)

    def param_nbytes(self, spec: QuantSpec) -> int:
        """Bytes of one statistics group's parameters: the scale, plus the zero point for asymmetric mappings
        (1 byte for an int zero point, else the scale's size). A ``model`` scale dtype not yet resolved
        (`QuantSpec.resolved`) counts 2 bytes, a 16-bit serving model's; `packed_nbytes` resolves it first."""
        sdt = torch.float16 if spec.scale_dtype == MODEL_DTYPE else SCALE_TORCH_DTYPES[spec.scale_dtype]
        n = torch.empty((), dtype=sdt).element_size()
        if spec.mapping == "asymmetric":
            n += 1 if spec.zero_point == "int" else n
        return n

    # ---- whole-tensor formats (``whole_tensor = True``) ----------------------------------------------------
    def quantize_tensor(self, x: torch.Tensor, spec: QuantSpec, qparams: QParams | None) -> TensorParts:
        """What is stored for x [B, H, T, D] (finite input checked by the format; ``spec`` resolved)."""
        raise NotImplementedError(f"format {self.name!r} is not a whole-tensor format")

    def dequantize_tensor(self, qt) -> torch.Tensor:
        """x^ [B, H, T, D] in ``qt.dtype`` from a `QuantizedTensor` this format's `quantize_tensor` produced."""
        raise NotImplementedError(f"format {self.name!r} is not a whole-tensor format")

    def tensor_nbytes(self, spec: QuantSpec, shape: tuple[int, int, int, int], dtype: torch.dtype,
                      static: bool) -> dict[str, int]:
        """Exact bytes of what `quantize_tensor` stores for x of ``shape`` and element ``dtype``
        (``{"codes", "scales", "outliers", "total"}``); ``static``: calibrated parameters were given."""
        raise NotImplementedError(f"format {self.name!r} is not a whole-tensor format")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
