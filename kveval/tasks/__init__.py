"""Evaluators, one module (or one package with a ``task`` module) per task in this folder, found by name.

A task module defines ``NAME`` (the key used in configs, equal to the module or package name), ``Params`` (a
closed pydantic model of its parameters, based on ``kveval.schema.Strict``), ``run(ctx, params) -> metrics`` and
optionally ``check(ctx, params)``, which raises ``KvevalError`` for bad input before the results folder is
touched. Adding a task is adding a file (or a folder): see docs/extending.md.

Discovery is lazy: ``TASKS`` lists the names from the folder without importing anything, and ``TASKS[name]``
imports that one task. A task module keeps heavy imports (transformers, the patching code) inside its functions,
so that ``kveval validate`` imports no model code. Task presets (ready-made parameter sets, ``- ppl_quick`` in a
config) are YAML files in ``presets/``, shipped with the package.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


class _TaskRegistry(Mapping[str, ModuleType]):
    """name -> task module, importing a module only when it is looked up."""

    def __init__(self) -> None:
        self._paths = {
            info.name: f"{__name__}.{info.name}" + (".task" if info.ispkg else "")
            for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)
            if not info.name.startswith("_") and info.name != "presets"
        }
        self._loaded: dict[str, ModuleType] = {}

    def __getitem__(self, name: str) -> ModuleType:
        if name not in self._loaded:
            module = importlib.import_module(self._paths[name])
            if getattr(module, "NAME", None) != name or not (hasattr(module, "Params") and hasattr(module, "run")):
                raise TypeError(f"{module.__name__} is not a task module (NAME == {name!r}, Params and run)")
            self._loaded[name] = module
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


TASKS: Mapping[str, ModuleType] = _TaskRegistry()


def task_presets() -> dict[str, Path]:
    """Task presets shipped with kveval (``kveval/tasks/presets/*.yaml``): name -> file."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.yaml"))}
