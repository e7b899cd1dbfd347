"""The quantizer-format interface: what one code format (int, fp8, a ggml block type, nuq, ...) provides.

Two levels, one protocol:

- :class:`TensorFormat`, the protocol every format implements: the spec checks (``validate``,
  ``check_head_dim``, ``takes_calibration``), names and sizes (``code_bits``, ``code_dtype``, ``describe``,
  ``bits_per_element``, ``pack`` / ``unpack`` / ``row_nbytes``) and the three tensor operations
  ``quantize_tensor`` (x [B, H, T, D] -> :class:`TensorParts`), ``dequantize_tensor`` and ``tensor_nbytes``.
  A format whose statistics span the kv heads, or whose outliers follow thresholds (KVQuant's ``nuq``),
  implements them itself.
- :class:`kveval.quant.formats.segment.QuantFormat`, the base of every other format: it implements the tensor
  operations once from per-segment maths (statistics groups of the granularity, outliers, calibrated parameters,
  channel blocks), so a format there only provides ``code_bits``, ``code_dtype``, ``range_qparams``, ``encode``
  and ``decode`` (and optionally a fused ``fit`` / ``fake``).

`kveval.quant.primitives` checks the input, resolves the spec and calls the spec's format (`spec.fmt`, from
`kveval.quant.formats.registry`). A format reads a spec through :class:`Spec`, the fields of
`kveval.quant.spec.QuantSpec` (which satisfies it): formats sit below the spec, which validates itself by asking
its format.

Vocabulary. A segment xv is a view of x [B, H, T, D] whose statistics groups are reduced over `dims`
(`kveval.quant.granularity`), e.g. xv [B, H, T, D] with dims (-1,) for token granularity, or [B, H, T, D//g, g]
for group granularity; xv is in the compute dtype (`compute_dtype`: float32, float64 for float64 inputs).
- parameters: `QParams(scale, zero_point)` of keepdim-reduced shape (e.g. [B, H, T, 1]), in their storage dtypes
  (the scale in `spec.scale_dtype`, rounded with `store`); the zero point None for symmetric mappings.
- codes: the stored form of xv, of xv's shape, in `code_dtype(spec)` (int8, uint8, a float8 dtype, ...).
- packed: codes as uint8 rows along head_dim, `row_nbytes(spec, D)` bytes per row of D codes; the real cache
  stores these, and `packed_nbytes` (hence the memory bill) counts them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..granularity import Granularity
from ..packing import pack, unpack

#: storage dtypes of scales (and float zero points), by QuantSpec.scale_dtype
SCALE_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                              "bfloat16": torch.bfloat16, "float64": torch.float64}
#: QuantSpec.scale_dtype "model": the scales take the dtype of the tensor quantized (the model's K/V dtype), as
#: optimum-quanto's MaxOptimizer does (its scale and shift are computed in the base tensor's dtype); resolved by
#: `kveval.quant.primitives` from the tensor (or, for byte counts, from the element dtype given)
MODEL_DTYPE = "model"
#: block-scale encodings taken only by the formats that list them in their ``scale_dtypes`` (-> torch dtype)
BLOCK_SCALE_DTYPES: dict[str, torch.dtype] = {"e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}
SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", MODEL_DTYPE: "model-dtype"}
NONFINITE = "non-finite values in input to quantize"


class Spec(Protocol):
    """What a format reads of a spec: the fields of `kveval.quant.spec.QuantSpec` (see its docstring), its
    granularity as a type (``gran``), the outliers it keeps per row, and a copy with fields changed."""

    @property
    def format(self) -> str: ...
    @property
    def bits(self) -> int: ...
    @property
    def mapping(self) -> str: ...
    @property
    def granularity(self) -> str: ...
    @property
    def group_size(self) -> int | None: ...
    @property
    def scale_dtype(self) -> str: ...
    @property
    def zero_point(self) -> str: ...
    @property
    def clip_ratio(self) -> float: ...
    @property
    def ggml(self) -> str | None: ...
    @property
    def static_scale(self) -> float | None: ...
    @property
    def outliers(self) -> float: ...
    @property
    def gran(self) -> Granularity: ...

    def outlier_count(self, head_dim: int) -> int: ...
    def replace(self, **changes: Any) -> Any: ...


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
    """What a format stores for x [B, H, T, D] (``TensorFormat.quantize_tensor``); `primitives.quantize` wraps it
    in a QuantizedTensor. ``codes`` [B, H, T, D] (``code_dtype``); ``scale`` / ``zero_point`` its
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
    channel_block: int | None = None  # the token block of per-channel statistics (segment formats)


# ------------------------------------------------------------------------------------------------ helpers
def minmax(xv: torch.Tensor, dims: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min and max with keepdim (NaN propagates). torch.aminmax is one pass but, along a dim, about 5x
    slower on CPU than amin + amax (torch 2.13), so it is used only for the full reduction."""
    if dims is None:
        mn, mx = torch.aminmax(xv)
        one = (1,) * xv.dim()
        return mn.reshape(one), mx.reshape(one)
    return xv.amin(dims, keepdim=True), xv.amax(dims, keepdim=True)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element of ``values`` is finite. A finite sum proves it (one NaN or infinity makes the sum NaN
    or infinite): one reduction and a scalar check, on CPU 1.5x cheaper than ``isfinite(values).all()`` for 3
    elements and 4-11x for 12k-65k (one thread, torch 2.13); only a sum that is not finite (NaN, infinity, or an
    overflow of finite values) takes the elementwise check."""
    if not values.is_floating_point():
        return True
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def count_reached(a: torch.Tensor, bounds: Sequence[float], inclusive: bool | Sequence[bool] = True) -> torch.Tensor:
    """How many of the ascending ``bounds`` each element of ``a`` reaches (``a >= b`` where ``inclusive``, else
    ``a > b``; one flag for all bounds or one per bound), uint8 of a's shape: the index of a rounding to the nearest
    of a sorted codebook whose midpoints are ``bounds``, each tie broken as its flag says. One comparison and one
    uint8 add per bound: on CPU 2.5x faster than ``bucketize`` for 7-15 bounds (bench: [1, 3, 2048, 64] float32,
    2 threads, torch 2.13). NaN reaches nothing (0). Worked: a = [0.2, 0.25, 0.3], bounds (0.25, 0.75) -> [0, 1, 1];
    inclusive False -> [0, 0, 1]."""
    flags = [inclusive] * len(bounds) if isinstance(inclusive, bool) else list(inclusive)
    m = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for b, up in zip(bounds, flags, strict=True):
        m += (a >= b) if up else (a > b)
    return m


def check_finite(*stats: torch.Tensor) -> None:
    """Raise ValueError('non-finite values in input to quantize') when any of `stats` holds NaN or Inf."""
    for s in stats:
        if not all_finite(s):
            raise ValueError(NONFINITE)


def store(t: torch.Tensor, sdt: torch.dtype) -> torch.Tensor:
    """Round to the storage dtype, clamped to its finite range (no Inf); -0.0 becomes +0.0."""
    fmax = torch.finfo(sdt).max
    return t.clamp(-fmax, fmax).to(sdt).add_(0.0)


def symmetric_qparams(mn: torch.Tensor, mx: torch.Tensor, spec: Spec, top: float) -> QParams:
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
class TensorFormat(ABC):
    """One code format, the protocol every format implements (module docstring). Instances are registered by
    `name` (`kveval.quant.formats.register_format`); they hold no per-tensor state.

    `spec_field`: the QuantSpec field that names the format: 'format' (e.g. format: int), or 'ggml' for the ggml
    block types, spelled format='int', ggml='q4_0' in configs (as before formats were plug-ins).
    `supports_static`: takes fixed parameters (calibrated `qparams`, `static_scale`); `mappings`: those it takes.
    `whole_tensor`: the statistics of a token span all its kv heads (``nuq``), so a cache quantizes one sequence
    at a time and never merges stored pieces; False for per-segment formats.
    """

    name: str
    spec_field: str = "format"
    supports_static: bool = True
    mappings: tuple[str, ...] = ("symmetric", "asymmetric")
    whole_tensor: bool = True

    # ---- the spec -----------------------------------------------------------------------------------------
    def validate(self, spec: Spec) -> None:
        """Raise ValueError (one line) for fields this format does not take. QuantSpec has checked the choice
        fields (mapping, granularity, scale_dtype, zero_point) and that bits is an integer; it checks group size,
        clip ratio, static scale and outliers afterwards."""
        if spec.mapping not in self.mappings:
            allowed = " or ".join(map(repr, self.mappings))
            raise ValueError(f"QuantSpec.mapping must be {allowed} for format {self.name!r}; got {spec.mapping!r}")

    def takes_calibration(self, spec: Spec) -> bool:
        """Whether a policy's scales file gives this spec fixed parameters (``QuantSpec.calibratable``; default: a
        format that takes static parameters at granularity tensor, head or channel)."""
        return self.supports_static and spec.gran.calibratable

    def check_head_dim(self, spec: Spec, head_dim: int) -> None:
        """Raise ValueError (one line) when this format cannot quantize rows of head_dim elements (default: any
        head_dim; `QuantSpec.check_head_dim` asks, so a policy refuses such a model before its first forward pass)."""
        return None

    @abstractmethod
    def code_bits(self, spec: Spec) -> int:
        """Bits of one code (int4: 4, fp8: 8; 16 for 'none', the FP16 baseline)."""

    @abstractmethod
    def code_dtype(self, spec: Spec) -> torch.dtype:
        """Storage dtype of the codes."""

    def bits_label(self, spec: Spec) -> str:
        """Short bits label for reports ('4', 'FP8', '16')."""
        return str(self.code_bits(spec))

    def bits_per_element(self, spec: Spec, head_dim: int) -> float:
        """Stored bits per element of a head_dim row (default: the packed codes only)."""
        return 8 * self.row_nbytes(spec, head_dim) / head_dim

    def short_name(self, spec: Spec) -> str:
        """First word of `describe()`: the format name ('fp8_e4m3'), 'int4' for int."""
        return self.name

    def describe(self, spec: Spec) -> str:
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

    # ---- storage ------------------------------------------------------------------------------------------
    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        """Codes [..., D] -> uint8 rows [..., row_nbytes(spec, D)] as stored (default: `packing.pack` of
        `code_bits`-bit integers, signed codes offset by 2^(bits-1))."""
        return pack(codes, self.code_bits(spec))

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        """Inverse of `pack`: uint8 rows [..., row_nbytes(spec, n)] -> codes [..., n] in `code_dtype`."""
        return unpack(packed, self.code_bits(spec), n, signed=self.code_dtype(spec) == torch.int8)

    def row_nbytes(self, spec: Spec, head_dim: int) -> int:
        """Packed bytes of one row of head_dim codes: ceil(head_dim * code_bits / 8)."""
        return math.ceil(head_dim * self.code_bits(spec) / 8)

    # ---- tensors --------------------------------------------------------------------------------------------
    @abstractmethod
    def quantize_tensor(self, x: torch.Tensor, spec: Spec, qparams: QParams | None,
                        channel_block: int | None = None) -> TensorParts:
        """What is stored for x [B, H, T, D] (``spec`` resolved to x's dtype; the input's shape, dtype and head
        dim checked by `primitives`; finite values checked by the format). ``qparams``: fixed (calibrated)
        parameters; ``channel_block``: the token block of per-channel statistics (None: all T tokens)."""

    @abstractmethod
    def dequantize_tensor(self, qt: Any) -> torch.Tensor:
        """x^ [B, H, T, D] in ``qt.dtype`` from a `QuantizedTensor` this format's `quantize_tensor` produced."""

    def dequantize_into(self, qt: Any, out: torch.Tensor) -> None:
        """Write `dequantize_tensor` of ``qt`` into ``out`` (``[B, H, T, D]`` of ``qt.dtype``; a view, strided
        along T as a slice of a read buffer is). Formats that can decode in place override it (`IntFormat`);
        this default copies."""
        out.copy_(self.dequantize_tensor(qt))

    def read_packed_into(self, qt: Any, packed: torch.Tensor, n_codes: int, out: torch.Tensor) -> None:
        """Write the values of ``qt``, whose codes are held as ``packed`` (this format's `pack` rows of ``n_codes``
        codes; ``qt``'s own codes are empty), into ``out`` (as `dequantize_into`): a stored chunk's read. This
        default unpacks, then `dequantize_into`; `IntFormat` reads the packed rows in one pass (`kveval.native`)."""
        self.dequantize_into(replace(qt, codes=self.unpack(packed, qt.spec, n_codes)), out)

    def quantize_packed(self, x: torch.Tensor, spec: Spec,
                        decode: bool) -> tuple[TensorParts, torch.Tensor, torch.Tensor | None] | None:
        """``quantize_tensor`` of x [B, H, T, D] from its own statistics (no calibrated parameters), its codes packed
        (``pack``) and, with ``decode``, read back (``dequantize_tensor``), in one fused pass and bit for bit with
        those three: (the parts with empty codes, the packed rows, the read-back values in x's dtype or None). None
        where the format has no such path (this default) or does not take x; the caller then goes the long way.
        The real cache's store of new tokens (`kveval.patch.cache.storage.StoredChunk.store`)."""
        return None

    @abstractmethod
    def tensor_nbytes(self, spec: Spec, shape: tuple[int, int, int, int], dtype: torch.dtype, static: bool,
                      channel_block: int | None = None) -> dict[str, int]:
        """Exact bytes of what `quantize_tensor` stores for x of ``shape`` and element ``dtype``
        (``{"codes", "scales", "outliers", "total"}``); ``static``: calibrated parameters were given."""

    def fake_tensor(self, x: torch.Tensor, spec: Spec, channel_block: int | None = None) -> torch.Tensor | None:
        """x^ of x by a fused path (the emulation hot path, bit for bit with quantize + dequantize), or None when
        the format has none (`primitives.fake_quantize` then quantizes and dequantizes)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
