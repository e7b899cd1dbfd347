"""The registry of quantizer formats: name -> format instance, filled with the built-in formats at import (every
module of this package that defines ``FORMATS``) and by plug-ins at run time (``register_format``).

``QuantSpec`` validation asks this registry, so a format registered from outside kveval is accepted as
``QuantSpec(format=its_name, ...)`` and is quantized, packed, stored by the real cache and billed like the others.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import TensorFormat

_REGISTRY: dict[str, TensorFormat] = {}
#: the original formats first, in their historical order (error messages list the names in registration order)
_FIRST = ("integer", "fp8", "none", "ggml")
#: modules of this package that hold no formats
_NOT_FORMATS = ("base", "segment", "registry")


def register_format(fmt: TensorFormat, *, replace: bool = False) -> TensorFormat:
    """Register `fmt` under `fmt.name` (an existing name is an error unless `replace`); returns `fmt`."""
    if not isinstance(fmt, TensorFormat):
        raise TypeError(f"register_format expects a QuantFormat (or TensorFormat) instance; got {fmt!r}")
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a format needs a non-empty string name; got {name!r}")
    if fmt.spec_field not in ("format", "ggml"):
        raise ValueError(f"format {name!r}: spec_field must be 'format' or 'ggml'; got {fmt.spec_field!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"quantizer format {name!r} is already registered")
    _REGISTRY[name] = fmt
    return fmt


def unregister_format(name: str) -> TensorFormat:
    """Remove the format registered as `name` and return it (specs naming it become invalid)."""
    if name not in _REGISTRY:
        raise ValueError(f"no quantizer format {name!r} is registered")
    return _REGISTRY.pop(name)


def get_format(name: str) -> TensorFormat:
    """The format registered as `name`; unknown names raise ValueError listing the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown quantizer format {name!r}; registered: {', '.join(format_names())}") from None


def format_names(field: str | None = None) -> tuple[str, ...]:
    """Registered names in registration order; `field` ('format' or 'ggml'): only the formats that QuantSpec
    field names."""
    return tuple(n for n, f in _REGISTRY.items() if field is None or f.spec_field == field)


def _register_builtins() -> None:
    package = __name__.rpartition(".")[0]
    path = importlib.import_module(package).__path__
    modules = [m.name for m in pkgutil.iter_modules(path) if m.name not in _NOT_FORMATS]
    for mod in [m for m in _FIRST if m in modules] + sorted(m for m in modules if m not in _FIRST):
        for fmt in importlib.import_module(f"{package}.{mod}").FORMATS:
            register_format(fmt)


_register_builtins()

__all__ = ["format_names", "get_format", "register_format", "unregister_format"]
