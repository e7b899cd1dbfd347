"""Evaluators, one per file in this package, found by name.

A task module defines ``NAME`` (the key used in configs), ``Params`` (a closed pydantic model of its parameters,
based on ``kveval.schema.Strict``), ``run(ctx, params) -> metrics`` and optionally ``check(ctx, params)``, which
raises ``KvevalError`` for bad input before the results folder is touched. Adding a task is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil


def _discover() -> dict:
    tasks = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "Params") and hasattr(module, "run"):
            tasks[module.NAME] = module
    return tasks


TASKS = _discover()
