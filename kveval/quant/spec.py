"""QuantSpec: what a K or V tensor [batch, kv_heads, seq, head_dim] is quantized to.

A spec is pure data (a frozen dataclass, validated on construction); the maths lives in `primitives.py`.

Formulas (b = bits, x one statistics group, s the scale after rounding to `scale_dtype`):
- int symmetric:   codes in [-2^(b-1), 2^(b-1)-1], s = absmax / (2^(b-1)-1), q = clamp(round(x/s)), x^ = q*s.
  Worked: x = [0.5, -1.0, 0.25, 0.75], b = 4: s = 1/7, stored in fp16 as 0.142822265625, x/s = [3.5009, -7.0017,
  1.7504, 5.2513], q = [4, -7, 2, 5], x^ = [0.5712890625, -0.999755859375, 0.28564453125, 0.714111328125].
- int asymmetric:  codes in [0, 2^b-1], s = (max-min) / (2^b-1).
  zero_point="float": m = min (rounded to scale_dtype), q = clamp(round((x-m)/s)), x^ = q*s + m.
  Worked: x = [0, 1.5, 3], b = 2: s = 1, m = 0, q = [0, 2 (1.5 -> 2, half to even), 3], x^ = [0, 2, 3].
  zero_point="int": z = clamp(round(-min/s), 0, 2^b-1) stored as uint8, q = clamp(round(x/s) + z),
  x^ = (q-z)*s; here the range is first widened to include 0 (min<=0<=max, as GPTQ/PyTorch observers do),
  otherwise z would clamp to 0 for an all-positive group and its top half would saturate.
- fp8 (e4m3fn, fmax 448; e5m2, fmax 57344): s = absmax/fmax (or `static_scale`),
  x^ = float(fp8(clamp(x/s, -fmax, fmax))) * s. Worked: absmax 896 -> s = 2; x = 3.3 -> 1.65 -> fp8 1.625 -> 3.25.
- bits=1 symmetric has no non-zero level (2^0-1 = 0) and is rejected; use asymmetric 1-bit (codes {0,1}).
- ggml q8_0/q4_0/q4_1/q5_0/q5_1: ggml's block quantizers, see `ggml.py`; the other fields must then match
  `GGML_TYPES` (use `preset("q4_0")` rather than spelling them out).
- outliers = p (dense-and-sparse, KVQuant): in every head_dim vector the k = ceil(p * head_dim) largest magnitudes
  are kept exactly (value in the tensor's dtype + a uint8 index), set to 0 in the dense part, and the dense part is
  quantized as above. Worked: p = 0.01, head_dim 64 -> k = 1 outlier per token row and head.
- static scales: tensor, head and channel granularities can take fixed (calibrated) parameters instead of
  statistics (`qparams=` in `primitives`); a channel spec is then one scale per channel and head, for every token.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

FORMATS = ("int", "fp8_e4m3", "fp8_e5m2", "none")
MAPPINGS = ("symmetric", "asymmetric")
GRANULARITIES = ("token", "group", "channel", "head", "tensor")
SCALE_DTYPES = ("float32", "float16", "bfloat16")
ZERO_POINTS = ("float", "int")

# name -> (bits, mapping); all are group 32 along head_dim with float16 scale d (and float16 min m for *_1).
GGML_TYPES: dict[str, tuple[int, str]] = {
    "q8_0": (8, "symmetric"),
    "q4_0": (4, "symmetric"),
    "q4_1": (4, "asymmetric"),
    "q5_0": (5, "symmetric"),
    "q5_1": (5, "asymmetric"),
}
GGML_BLOCK = 32

_SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _one_of(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"QuantSpec.{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _is_int(v: Any) -> bool:
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
        _one_of("format", self.format, FORMATS)
        if self.format == "none":
            return  # every other field is ignored
        _one_of("mapping", self.mapping, MAPPINGS)
        _one_of("granularity", self.granularity, GRANULARITIES)
        _one_of("scale_dtype", self.scale_dtype, SCALE_DTYPES)
        _one_of("zero_point", self.zero_point, ZERO_POINTS)
        if not _is_int(self.bits):
            raise ValueError(f"QuantSpec.bits must be an integer; got {self.bits!r}")
        if self.format == "int":
            if not 1 <= self.bits <= 8:
                raise ValueError(f"QuantSpec.bits must be in 1..8 for format 'int'; got {self.bits}")
            if self.bits == 1 and self.mapping == "symmetric":
                raise ValueError("QuantSpec.bits=1 requires mapping='asymmetric' (symmetric 1-bit has no non-zero level)")
        else:  # fp8
            if self.bits != 8:
                raise ValueError(f"QuantSpec.bits must be 8 for format {self.format!r}; got {self.bits}")
            if self.mapping != "symmetric":
                raise ValueError(f"QuantSpec.mapping must be 'symmetric' for format {self.format!r}; got {self.mapping!r}")
        if self.granularity == "group":
            if not _is_int(self.group_size) or self.group_size <= 0:
                raise ValueError(f"QuantSpec.group_size must be a positive integer for granularity 'group'; got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"QuantSpec.group_size is only allowed with granularity 'group'; got {self.group_size!r} with {self.granularity!r}")
        if not _is_real(self.clip_ratio) or not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"QuantSpec.clip_ratio must be in (0, 1]; got {self.clip_ratio!r}")
        if self.static_scale is not None:
            if not _is_real(self.static_scale) or not (math.isfinite(self.static_scale) and self.static_scale > 0):
                raise ValueError(f"QuantSpec.static_scale must be a positive finite number or None; got {self.static_scale!r}")
            if self.granularity not in ("tensor", "head") or self.mapping != "symmetric":
                raise ValueError("QuantSpec.static_scale needs granularity 'tensor' or 'head' and mapping 'symmetric'; "
                                 f"got {self.granularity!r}, {self.mapping!r}")
            if self.clip_ratio != 1.0:
                raise ValueError("QuantSpec.clip_ratio must be 1.0 with a static_scale (the scale is fixed)")
        if not _is_real(self.outliers) or not 0.0 <= self.outliers < 0.5:
            raise ValueError(f"QuantSpec.outliers must be a fraction in [0, 0.5) of each head_dim vector; got {self.outliers!r}")
        if self.ggml is not None:
            _one_of("ggml", self.ggml, tuple(GGML_TYPES))
            bits, mapping = GGML_TYPES[self.ggml]
            want = dict(format="int", bits=bits, mapping=mapping, granularity="group", group_size=GGML_BLOCK,
                        scale_dtype="float16", zero_point="float", clip_ratio=1.0, static_scale=None,
                        outliers=0.0)
            bad = {k: getattr(self, k) for k, v in want.items() if getattr(self, k) != v}
            if bad:
                need = ", ".join(f"{k}={want[k]!r}" for k in bad)
                got = ", ".join(f"{k}={v!r}" for k, v in bad.items())
                raise ValueError(f"QuantSpec.ggml={self.ggml!r} requires {need} (got {got}); use preset({self.ggml!r})")

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
        return self.format in ("fp8_e4m3", "fp8_e5m2")

    def outlier_count(self, head_dim: int) -> int:
        """Outliers kept per head_dim vector: ``ceil(outliers * head_dim)`` (0 when ``outliers`` is 0)."""
        if self.is_none or not self.outliers:
            return 0
        return min(math.ceil(self.outliers * head_dim - 1e-9), head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless group_size divides head_dim, e.g. 'group_size 48 does not divide head_dim 64'."""
        if not self.is_none and self.granularity == "group" and head_dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide head_dim {head_dim}")

    def describe(self) -> str:
        """Short human string, e.g. 'int4 asym g64 (fp16 scales)'."""
        if self.is_none:
            return "none (full precision)"
        sd = _SHORT_DTYPE[self.scale_dtype]
        if self.ggml is not None:
            return f"{self.ggml} (ggml, g32, {sd} scales)"
        gran = f"g{self.group_size}" if self.granularity == "group" else self.granularity
        parts = [f"int{self.bits}" if self.format == "int" else self.format]
        parts.append("sym" if self.mapping == "symmetric" else "asym")
        parts.append(gran)
        if self.mapping == "asymmetric" and self.zero_point == "int":
            parts.append("int-zp")
        if self.clip_ratio != 1.0:
            parts.append(f"clip {self.clip_ratio:g}")
        if self.static_scale is not None:
            parts.append(f"static scale {self.static_scale:g}")
        if self.outliers:
            parts.append(f"{100 * self.outliers:g}% outliers")
        return " ".join(parts) + f" ({sd} scales)"
