"""QuantSpec: what a K or V tensor [batch, kv_heads, seq, head_dim] is quantized to.

A spec is pure data (a frozen dataclass, validated on construction). The maths lives in the spec's format
(`spec.fmt`, from the registry in `kveval.quant.formats.registry`: 'int', 'fp8_e4m3', 'fp8_e5m2', 'none', the ggml block
types, or one registered from outside) and its granularity (`spec.gran`, `kveval.quant.granularity`);
`primitives.py` drives them. The formulas of each format are in its module's docstring; in short:
- int (1..8 bits): symmetric s = absmax / (2^(b-1)-1), q = clamp(round(x/s)), x^ = q*s; asymmetric s = (max-min) /
  (2^b-1) with a float (the rounded min) or int (uint8 z) zero point; bits=1 needs mapping='asymmetric'.
- fp8 (e4m3fn, fmax 448; e5m2, fmax 57344): s = absmax/fmax (or `static_scale`),
  x^ = float(fp8(clamp(x/s, -fmax, fmax))) * s. Worked: absmax 896 -> s = 2; x = 3.3 -> 1.65 -> fp8 1.625 -> 3.25.
- ggml q8_0/q4_0/q4_1/q5_0/q5_1: ggml's block quantizers, named by the `ggml` field with format 'int'; the other
  fields must then match `GGML_TYPES` (use `preset("q4_0")` rather than spelling them out).
- outliers = p (dense-and-sparse, KVQuant): in every head_dim vector the k = ceil(p * head_dim) largest magnitudes
  are kept exactly (value in the tensor's dtype + a uint8 index), set to 0 in the dense part, and the dense part is
  quantized as above. Worked: p = 0.01, head_dim 64 -> k = 1 outlier per token row and head. Format 'nuq'
  (KVQuant's non-uniform codes, `formats/nuq.py`) reads p its own way: KVQuant's threshold outliers.
- static scales: tensor, head and channel granularities can take fixed (calibrated) parameters instead of
  statistics (`qparams=` in `primitives`); a channel spec is then one scale per channel and head, for every token.
- scale_dtype: float16 (default), bfloat16, float32, float64, or "model": the dtype of the tensor quantized (the
  model's K/V dtype, as optimum-quanto stores transformers' QuantizedCache scales); `resolved(dtype)` turns it into
  that dtype's name (`primitives` does so from the tensor, the memory bill from its element dtype); "e8m0" (OCP
  E8M0, one byte 2^(e - 127)) only for the formats that own that block-scale encoding (mxfp4, fp4_mx_block16:
  their `scale_dtypes`), held as torch.float8_e8m0fnu.
- group_size: elements of head_dim per group (granularity 'group'), or tokens per group (granularity 'channel':
  KIVI's keys, per channel over G = 32 consecutive tokens).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from .formats.base import BLOCK_SCALE_DTYPES, MODEL_DTYPE, SCALE_TORCH_DTYPES, TensorFormat
from .formats.ggml import GGML_BLOCK, GGML_TYPES
from .formats.registry import format_names, get_format
from .granularity import GRANULARITIES, Granularity, granularity_of

MAPPINGS = ("symmetric", "asymmetric")
SCALE_DTYPES = (*SCALE_TORCH_DTYPES, MODEL_DTYPE, *BLOCK_SCALE_DTYPES)
ZERO_POINTS = ("float", "int")

__all__ = ["QuantSpec", "MAPPINGS", "GRANULARITIES", "SCALE_DTYPES", "ZERO_POINTS", "GGML_TYPES", "GGML_BLOCK"]


def _one_of(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"QuantSpec.{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class QuantSpec:
    """How one K or V tensor [batch, kv_heads, seq, head_dim] is quantized (see the module docstring)."""

    format: str = "int"
    bits: int = 8
    mapping: str = "symmetric"
    granularity: str = "token"
    group_size: int | None = None
    scale_dtype: str = "float16"
    zero_point: str = "float"
    clip_ratio: float = 1.0
    ggml: str | None = None
    static_scale: float | None = None
    outliers: float = 0.0

    def __post_init__(self) -> None:
        _one_of("format", self.format, format_names("format"))
        if self.is_none:
            return  # every other field is ignored
        _one_of("mapping", self.mapping, MAPPINGS)
        _one_of("granularity", self.granularity, GRANULARITIES)
        _one_of("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        _one_of("zero_point", self.zero_point, ZERO_POINTS)
        if not _is_int(self.bits):
            raise ValueError(f"QuantSpec.bits must be an integer; got {self.bits!r}")
        fmt = get_format(self.format)
        if self.scale_dtype in BLOCK_SCALE_DTYPES and self.scale_dtype not in getattr(fmt, "scale_dtypes", ()):
            raise ValueError(f"QuantSpec.scale_dtype {self.scale_dtype!r} is a block-scale encoding that format "
                             f"{self.format!r} does not take")
        fmt.validate(self)
        if self.granularity == "group":
            if not _is_int(self.group_size) or self.group_size <= 0:
                raise ValueError(f"QuantSpec.group_size must be a positive integer for granularity 'group'; got {self.group_size!r}")
        elif self.granularity == "channel" and self.group_size is not None:
            if not _is_int(self.group_size) or self.group_size <= 0:
                raise ValueError(f"QuantSpec.group_size (tokens per group) must be a positive integer for granularity "
                                 f"'channel'; got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"QuantSpec.group_size is only allowed with granularity 'group' (elements of head_dim) or "
                             f"'channel' (tokens); got {self.group_size!r} with {self.granularity!r}")
        if not _is_real(self.clip_ratio) or not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"QuantSpec.clip_ratio must be in (0, 1]; got {self.clip_ratio!r}")
        if self.static_scale is not None:
            if not _is_real(self.static_scale) or not (math.isfinite(self.static_scale) and self.static_scale > 0):
                raise ValueError(f"QuantSpec.static_scale must be a positive finite number or None; got {self.static_scale!r}")
            if not self.gran.static_only or self.mapping != "symmetric":
                raise ValueError("QuantSpec.static_scale needs granularity 'tensor' or 'head' and mapping 'symmetric'; "
                                 f"got {self.granularity!r}, {self.mapping!r}")
            if self.clip_ratio != 1.0:
                raise ValueError("QuantSpec.clip_ratio must be 1.0 with a static_scale (the scale is fixed)")
            if not fmt.supports_static:
                raise ValueError(f"QuantSpec.static_scale is not taken by format {self.format!r}")
        if not _is_real(self.outliers) or not 0.0 <= self.outliers < 0.5:
            raise ValueError(f"QuantSpec.outliers must be a fraction in [0, 0.5) of each head_dim vector; got {self.outliers!r}")
        if self.ggml is not None:
            _one_of("ggml", self.ggml, format_names("ggml"))
            get_format(self.ggml).validate(self)

    # ---- construction / serialisation -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        """Build from a plain dict (a config section); unknown keys are errors with a suggestion."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(names)}"
                raise ValueError(f"unknown QuantSpec key {key!r}{hint}")
        return cls(**d)

    def replace(self, **changes: Any) -> QuantSpec:
        """A copy with ``changes`` applied (validated like any spec): ``spec.replace(outliers=0.0)``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data; ``outliers`` only when set (so that configs resolved before it existed, and
        the run folders holding them, stay the same)."""
        d = dataclasses.asdict(self)
        if not d["outliers"]:
            del d["outliers"]
        return d

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def is_none(self) -> bool:
        """True for format 'none' (keys/values kept in full precision)."""
        return self.format == "none"

    @property
    def is_fp8(self) -> bool:
        """True for the fp8 formats (kept for callers; kveval itself asks `fmt` instead)."""
        return self.format in ("fp8_e4m3", "fp8_e5m2")

    @property
    def fmt(self) -> TensorFormat:
        """The registered format that does the maths: the ggml type when `ggml` is set, else `format`'s."""
        return get_format(self.ggml if self.ggml is not None and not self.is_none else self.format)

    @property
    def gran(self) -> Granularity:
        """The granularity as a type (scale shapes, statistics segments); not for format 'none'."""
        return granularity_of(self.granularity, self.group_size)

    @property
    def code_bits(self) -> int:
        """Bits of one code: 4 for int4 and q4_0, 8 for fp8, 16 for 'none' (the FP16 baseline)."""
        return self.fmt.code_bits(self)

    @property
    def bits_label(self) -> str:
        """Short bits label for reports: '4', 'FP8', '16' for 'none'."""
        return self.fmt.bits_label(self)

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per element of a head_dim row, scales and zero points of token/group granularities included
        (16 for 'none'); e.g. int4 g64 asym with fp16 scale + min, head_dim 128: 4.5."""
        return self.fmt.bits_per_element(self, head_dim)

    @property
    def calibratable(self) -> bool:
        """Whether static (calibrated) parameters apply: a format that takes them and granularity tensor, head or
        channel, or a format that says so itself (`QuantFormat.takes_calibration`: ``nuq``'s calibrated codebook)."""
        return not self.is_none and self.fmt.takes_calibration(self)

    def outlier_count(self, head_dim: int) -> int:
        """Outliers kept per head_dim vector: ``ceil(outliers * head_dim)`` (0 when ``outliers`` is 0)."""
        if self.is_none or not self.outliers:
            return 0
        return min(math.ceil(self.outliers * head_dim - 1e-9), head_dim)

    def resolved(self, dtype: torch.dtype) -> QuantSpec:
        """This spec with a ``model`` scale dtype replaced by ``dtype``'s name (the K/V tensor's dtype: float32 scales
        for a float32 model, float16 for a float16 one); itself otherwise. Worked:
        ``QuantSpec(bits=4, scale_dtype="model").resolved(torch.float32).scale_dtype == "float32"``."""
        if self.is_none or self.scale_dtype != MODEL_DTYPE:
            return self
        names = {v: k for k, v in SCALE_TORCH_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"scale_dtype 'model' needs a floating-point tensor dtype; got {dtype}")
        return dataclasses.replace(self, scale_dtype=names[dtype])

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless group_size divides head_dim, e.g. 'group_size 48 does not divide head_dim 64', or
        unless the format takes rows of head_dim elements (`QuantFormat.check_head_dim`)."""
        if not self.is_none:
            self.gran.check_head_dim(head_dim)
            self.fmt.check_head_dim(self, head_dim)

    def describe(self) -> str:
        """Short human string, e.g. 'int4 asym g64 (fp16 scales)', 'q4_0 (ggml, g32, fp16 scales)'."""
        return self.fmt.describe(self)
