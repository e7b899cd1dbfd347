"""Which modules of ``kveval/tasks/`` are tasks: the one rule that the task registry (:mod:`kveval.tasks`) and the
report's lookup of the tasks' reporting plug-ins (:mod:`kveval.report.sections`) both follow.

A task is a package ``kveval/tasks/<name>/`` or a single module ``kveval/tasks/<name>.py``; every name there is a
task except those of :data:`NOT_TASKS` (what every task shares, and the contexts a task gets) and a name with a
leading underscore (a private helper). Found by name on disk, without importing ``kveval.tasks``: the report sits
below the tasks and reads them only through this rule.
"""

from __future__ import annotations

import importlib.util
import pkgutil

#: the package the tasks live in
TASKS_PACKAGE = "kveval.tasks"

#: modules and packages of ``kveval/tasks/`` that are not tasks
NOT_TASKS = frozenset({"common", "context"})


def is_task_name(name: str) -> bool:
    """Whether a module or package named ``name`` in ``kveval/tasks/`` is a task."""
    return not name.startswith("_") and name not in NOT_TASKS


def task_modules(package: str = TASKS_PACKAGE, paths: list[str] | None = None) -> dict[str, bool]:
    """``{task name: whether it is a package}`` of the tasks of ``package`` (found on disk: ``paths``, its folders,
    when given; the package is not imported), in name order."""
    if paths is None:
        spec = importlib.util.find_spec(package)
        paths = list(spec.submodule_search_locations or []) if spec is not None else []
    infos = sorted(pkgutil.iter_modules(paths), key=lambda i: i.name)
    return {i.name: i.ispkg for i in infos if is_task_name(i.name)}


__all__ = ["NOT_TASKS", "TASKS_PACKAGE", "is_task_name", "task_modules"]
