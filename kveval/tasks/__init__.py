"""Evaluators, one package per task in this folder, found by name.

A task is a package ``kveval/tasks/<name>/`` with a light ``params.py`` (``NAME``, the key used in configs, equal
to the folder's name, and ``Params``, a closed pydantic model of its parameters based on ``kveval.schema.Strict``)
and a ``task.py`` (``run(ctx, params) -> metrics`` and optionally ``check(ctx, params)``, which raises
``KvevalError`` for bad input before the results folder is touched; ``ctx`` is a
:class:`kveval.tasks.context.TaskContext`). A single module ``kveval/tasks/<name>.py`` defining all four is a task
too; every name in this folder is a task but ``common`` (what tasks share: the unit runner, decoding, teacher-
forced scoring, prompts, the finite checks), ``context`` and a name with a leading underscore
(:mod:`kveval.plugins`, the one rule the report follows too). Adding a task is adding a folder (or a file): see
docs/extending.md.

What the config (:mod:`kveval.config`) asks of a task, from its parameter module alone, all optional:

- ``check_inputs(params, *, allow_code: bool) -> None``, a function of the parameter module: what the parameters
  name on this machine (files, folders), checked without a model and before anything is written (``kveval
  validate`` and ``kveval run``, through :func:`kveval.config.check_inputs`, for each entry of that task);
  ``allow_code`` is the run's ``--allow-code``. It raises a one-line ``KvevalError``; the config puts the config
  file's name before it. Called through :meth:`_TaskRegistry.check_inputs`; a check that needs the evaluator's
  module reaches it through :data:`TASKS` when it runs, so that importing the parameters imports no evaluator.
- ``Params.OMITTED_AT_DEFAULT: ClassVar[dict[str, Any]]`` (default ``{}``): fields left out of the resolved config
  (``config.resolved.yaml``) while they hold this value, fields added after run folders were written, so that
  those folders still resume.
- ``Params.MEASURES_WEIGHT_VARIANTS: ClassVar[bool]`` (default False): the task evaluates every weight variant of
  ``model.weights``; a config with weight variants refuses a task without it (it would run on the checkpoint's
  weights alone).

Discovery is lazy: ``TASKS`` lists the names from the folder without importing anything, ``TASKS[name]`` imports
that one task, and ``task_params()`` imports only the parameter modules (what the config schema needs, so that
``kveval validate`` imports no evaluator). A task module keeps heavy imports (transformers, the patching code)
inside its functions. Task presets (ready-made parameter sets, ``- ppl_quick`` in a config) are YAML files in the
top-level ``tasks/presets/`` (:mod:`kveval.task_definitions`), shipped with the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

from kveval.plugins import task_modules
from kveval.task_definitions import PRESETS_DIR


class _TaskRegistry(Mapping[str, ModuleType]):
    """name -> task module, importing a module only when it is looked up; what is a task is
    :func:`kveval.plugins.task_modules`' rule (the report's too)."""

    def __init__(self) -> None:
        found = task_modules(__name__, list(__path__))
        self._paths = {n: f"{__name__}.{n}" + (".task" if pkg else "") for n, pkg in found.items()}
        self._params = {n: f"{__name__}.{n}" + (".params" if pkg else "") for n, pkg in found.items()}
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

    def params_module(self, name: str) -> ModuleType:
        """The parameter module of task ``name`` (``NAME``, ``Params``, optionally ``check_inputs``), importing
        no evaluator."""
        module = importlib.import_module(self._params[name])
        if getattr(module, "NAME", None) != name or not hasattr(module, "Params"):
            raise TypeError(f"{module.__name__} is not a task's parameter module (NAME == {name!r} and Params)")
        return module

    def params(self, name: str) -> type:
        """The ``Params`` class of task ``name``, importing only its parameter module."""
        return self.params_module(name).Params

    def check_inputs(self, name: str, params, *, allow_code: bool) -> None:
        """Task ``name``'s own input checks of ``params`` (its parameter module's ``check_inputs``, when it has
        one: see the module docstring); a one-line KvevalError."""
        check = getattr(self.params_module(name), "check_inputs", None)
        if check is not None:
            check(params, allow_code=allow_code)


TASKS = _TaskRegistry()


def task_params() -> dict[str, type]:
    """``{task name: its Params class}`` for every task, importing the parameter modules only."""
    return {name: TASKS.params(name) for name in TASKS}


def task_presets() -> dict[str, Path]:
    """Task presets shipped with kveval (``tasks/presets/*.yaml``, installed as ``kveval.task_definitions``):
    name -> file."""
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.yaml"))}
