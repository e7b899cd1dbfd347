"""Quantizer formats as plug-ins: one module per format, registered by name.

    from kveval.quant.formats import QuantFormat, register_format, get_format, format_names

Built in (in registration order): 'int' (`integer.py`), 'fp8_e4m3', 'fp8_e5m2' (`fp8.py`), 'none' (`none.py`),
the ggml block types 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1' (`ggml.py`, named by `QuantSpec.ggml`), then
llama.cpp's run-time cache writes 'iq4_nl' (`iq4_nl.py`) and 'q8_0_x86' (`q8_0_x86.py`), also named by `ggml`.
`QuantSpec` validation asks this registry, so a format registered from outside kveval is accepted as
``QuantSpec(format=its_name, ...)`` and is quantized, packed, stored by the real cache and billed like the others.

A new built-in format is one module here defining ``FORMATS = (MyFormat(),)`` (a `QuantFormat` subclass, see
`base.py`; every module of this package is imported and its FORMATS registered) plus a preset entry in
`kveval/quant/presets.py`. From outside kveval: `register_format(MyFormat())`.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import QParams, QuantFormat
from .fp8 import FP8Format
from .ggml import GGML_BLOCK, GGML_TYPES, GgmlFormat
from .integer import IntFormat
from .none import NoneFormat

_REGISTRY: dict[str, QuantFormat] = {}


def register_format(fmt: QuantFormat, *, replace: bool = False) -> QuantFormat:
    """Register `fmt` under `fmt.name` (an existing name is an error unless `replace`); returns `fmt`."""
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"register_format expects a QuantFormat instance; got {fmt!r}")
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a format needs a non-empty string name; got {name!r}")
    if fmt.spec_field not in ("format", "ggml"):
        raise ValueError(f"format {name!r}: spec_field must be 'format' or 'ggml'; got {fmt.spec_field!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"quantizer format {name!r} is already registered")
    _REGISTRY[name] = fmt
    return fmt


def unregister_format(name: str) -> QuantFormat:
    """Remove the format registered as `name` and return it (specs naming it become invalid)."""
    if name not in _REGISTRY:
        raise ValueError(f"no quantizer format {name!r} is registered")
    return _REGISTRY.pop(name)


def get_format(name: str) -> QuantFormat:
    """The format registered as `name`; unknown names raise ValueError listing the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown quantizer format {name!r}; registered: {', '.join(format_names())}") from None


def format_names(field: str | None = None) -> tuple[str, ...]:
    """Registered names in registration order; `field` ('format' or 'ggml'): only the formats that QuantSpec
    field names."""
    return tuple(n for n, f in _REGISTRY.items() if field is None or f.spec_field == field)


# the original formats first, in their historical order (error messages list the names in registration order)
_FIRST = ("integer", "fp8", "none", "ggml")


def _register_builtins() -> None:
    modules = [m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"]
    for mod in [m for m in _FIRST if m in modules] + sorted(m for m in modules if m not in _FIRST):
        for fmt in importlib.import_module(f"{__name__}.{mod}").FORMATS:
            register_format(fmt)


_register_builtins()

__all__ = [
    "QuantFormat", "QParams", "register_format", "unregister_format", "get_format", "format_names",
    "IntFormat", "FP8Format", "GgmlFormat", "NoneFormat", "GGML_TYPES", "GGML_BLOCK",
]
