"""The transform registry (name -> class) and the config form of a transform: ``"name"`` or
``{name: ..., param: ...}``; unknown names and parameters are one-line KvevalErrors with a "did you mean"."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from kveval.errors import KvevalError, did_you_mean
from kveval.transforms.base import KVTransform

_REGISTRY: dict[str, type[KVTransform]] = {}
T = TypeVar("T", bound=type[KVTransform])


def register(cls: T) -> T:
    """Class decorator: make ``cls`` available under ``cls.name`` (re-registering the same class is a no-op)."""
    name = cls.name
    if not name:
        raise ValueError(f"{cls.__name__}: a registered transform needs a name")
    old = _REGISTRY.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"transform '{name}' is already registered by {old.__module__}.{old.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def transform_names() -> list[str]:
    return sorted(_REGISTRY)


def make_transform(cfg: Any, where: str) -> KVTransform:
    """A transform from its config form: ``"name"``, ``{"name": name, **parameters}`` or an instance.
    Unknown names and parameters are one-line KvevalErrors naming ``where``."""
    if isinstance(cfg, KVTransform):
        return cfg
    if isinstance(cfg, str):
        name, params = cfg, {}
    elif isinstance(cfg, dict):
        if "name" not in cfg:
            raise KvevalError(f"{where}: a transform mapping needs 'name' (one of {', '.join(transform_names())})")
        name, params = cfg["name"], {k: v for k, v in cfg.items() if k != "name"}
    else:
        raise KvevalError(f"{where}: expected a transform name or a mapping with 'name', got {cfg!r}")
    cls = _REGISTRY.get(str(name))
    if cls is None:
        raise KvevalError(
            f"{where}: unknown transform '{name}'{did_you_mean(name, transform_names())} "
            f"(known: {', '.join(transform_names())})"
        )
    fields: list[str] = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    for key in params:
        if key not in fields:
            raise KvevalError(f"{where}: transform '{name}' has no parameter '{key}'{did_you_mean(key, fields)}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise KvevalError(f"{where}: transform '{name}': {exc}") from None


def parse_transforms(value: Any, where: str) -> tuple[KVTransform, ...]:
    """``transforms: [name | {name: ..., param: ...}, ...]`` -> the transforms, in order."""
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise KvevalError(f"{where}: expected a list of transform names or mappings, got {value!r}")
    return tuple(make_transform(item, f"{where}[{i}]") for i, item in enumerate(value))

