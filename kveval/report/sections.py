"""What a task adds to the report: its reporting plug-in (:class:`TaskReporting`), found by the task's name.

A task package may hold a ``reporting.py`` that defines ``REPORTING = TaskReporting(...)``: the per-policy
numbers its run adds to the summary (:class:`SummaryColumn`: metrics.json's ``policies.<name>.<key>``), the tables
it adds to a loaded run (``tables(run, metrics) -> {table: DataFrame}``: ``RunResults.tables[table]`` and
``tables/<table>.csv``), the sentences it adds to the report's reading, and its section (heading, tables, the
figures it draws into ``plots/``). The report names no task: it asks :func:`task_reporting` for every plug-in and
renders what they give, in the order of the task folder's names. A task without ``reporting.py`` adds nothing
(its metrics are in metrics.json all the same).

Plug-ins depend on the report, never the reverse: they are found like the tasks themselves
(:mod:`kveval.tasks`), by their folder's name, and imported when the report first asks (pandas and matplotlib are
imported only by the module that draws).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from kveval.plugins import TASKS_PACKAGE, task_modules  # TASKS_PACKAGE: a test points it elsewhere

if TYPE_CHECKING:
    import pandas as pd

    from kveval.report.blocks import Block
    from kveval.results import RunResults

#: the module of a task package that holds its reporting plug-in, and the plug-in's name there
REPORTING_MODULE, REPORTING_NAME = "reporting", "REPORTING"
TASK_FIGURE_DPI = 110


@dataclass(frozen=True)
class SummaryColumn:
    """One per-policy number a task adds to ``RunResults.summary``: metrics.json's ``policies.<policy>.<key>``
    (the baseline's under ``baseline.<key>``). ``table`` and ``console``: its (header, format) in the report's
    verdict table and in the closing console table of ``kveval run``, or None where it is not shown."""

    key: str
    table: tuple[str, str] | None = None
    console: tuple[str, str] | None = None


@dataclass(frozen=True)
class TaskReporting:
    """A task's part of the report (every field optional).

    * ``kind``: the task's name (its folder's, ``NAME`` of its params module).
    * ``summary_columns``: numbers per policy it adds to the summary, in order.
    * ``tables(run_name, metrics) -> {name: DataFrame}``: tables of a loaded run; every frame has a ``run``
      column first (frames of several runs concatenate); empty frames are kept (``RunResults.<name>`` then reads
      as empty) but written to no CSV.
    * ``reading(run) -> [sentence]``: what the report's "Reading" says of the task's numbers.
    * ``section(run, out, prefix, level) -> [Block]``: its section of the report, drawing its figures into
      ``out/plots/`` with file names starting with ``prefix`` (a run's slug in a report of several runs; the
      figures of a task whose ``plots`` parameter is false are not drawn); ``[]`` when the run has nothing of it.
    """

    kind: str
    summary_columns: tuple[SummaryColumn, ...] = ()
    tables: Callable[[str, dict], dict[str, pd.DataFrame]] | None = None
    reading: Callable[[RunResults], list[str]] | None = None
    section: Callable[[RunResults, Path, str, int], list[Block]] | None = None


@cache
def task_reporting() -> dict[str, TaskReporting]:
    """``{task name: its TaskReporting}`` for every task (:func:`kveval.plugins.task_modules`: the registry's rule)
    that has one: a package's ``reporting.py`` module, a single-module task's own module, each defining a
    :class:`TaskReporting` named ``REPORTING``; in name order. A plug-in of another kind is a TypeError (a bug in
    the plug-in, shown in full)."""
    out: dict[str, TaskReporting] = {}
    for task, is_package in task_modules(TASKS_PACKAGE).items():
        name = f"{TASKS_PACKAGE}.{task}" + (f".{REPORTING_MODULE}" if is_package else "")
        if importlib.util.find_spec(name) is None:
            continue
        plugin = getattr(importlib.import_module(name), REPORTING_NAME, None)
        if plugin is None and not is_package:
            continue  # a single-module task without a part of the report
        if not isinstance(plugin, TaskReporting) or plugin.kind != task:
            raise TypeError(f"{name}.{REPORTING_NAME} is not a TaskReporting of kind {task!r}")
        out[task] = plugin
    return out


def summary_columns() -> list[SummaryColumn]:
    """Every task's summary columns, in the plug-ins' order."""
    return [c for plugin in task_reporting().values() for c in plugin.summary_columns]


def summary_keys() -> list[str]:
    """The keys of every task's summary columns (``RunResults.summary``'s task columns), in order."""
    return [c.key for c in summary_columns()]


def task_tables(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """Every plug-in's tables of one run (``RunResults.tables``)."""
    out: dict[str, pd.DataFrame] = {}
    for plugin in task_reporting().values():
        if plugin.tables is not None:
            out.update(plugin.tables(run_name, metrics))
    return out


def figure_file(name: str) -> str:
    """``name`` (a policy's, a variant's) as part of a figure's file name: characters other than letters,
    digits, ``_.-`` replaced by ``_`` (a name never reaches outside ``plots/``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def save_figure(fig, path: Path) -> Path:
    """A task's figure as a PNG at ``path``, atomically (:func:`kveval.report.style.save`), at 110 dpi in
    matplotlib's own colours (the heatmaps' colour maps need more than the palette)."""
    from kveval.report.style import save

    return save(fig, path, dpi=TASK_FIGURE_DPI, palette=False)


def plots_enabled(res: RunResults, kind: str) -> bool:
    """Whether some ``kind`` task of the run's config draws its figures (its ``plots`` parameter, true unless
    set false)."""
    return any(p.get("plots", True) for p in res.task_params(kind))


__all__ = ["SummaryColumn", "TaskReporting", "figure_file", "plots_enabled", "save_figure", "summary_columns", "summary_keys", "task_reporting",
           "task_tables"]
