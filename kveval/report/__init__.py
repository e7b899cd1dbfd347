"""Reports: load a results folder into pandas, draw the figures, write Markdown + self-contained HTML.

    from kveval.report import load, plots
    from kveval.commands.report import report_command
    res = load("results/int4_g64")        # RunResults: summary, positions, layers, memory, the tasks' tables...
    plots.quality_vs_memory(res)          # a matplotlib Figure
    report_command(["results/int4_g64"])  # report.md, report.html, tables/*.csv, plots/*.png in the run folder

Run folders are read only through :mod:`kveval.results`; :func:`load` here adds what the tasks' reporting
plug-ins (:mod:`kveval.report.sections`) say of a run: their summary columns and their tables (``res.needle``,
``res.ruler``, ``res.sensitivity``...). The loader is imported eagerly (pandas, yaml); the plotting side lazily,
so that loading results does not import matplotlib. Each task's own figures are drawn by its plug-in
(``kveval/tasks/<task>/reporting.py``), when the report is written, never by the task while it runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from kveval.report.sections import summary_keys, task_tables
from kveval.results import RunResults, read_metrics
from kveval.results import load as load_generic


def load(run_dir: str | Path) -> RunResults:
    """``results/<run>/`` as a :class:`RunResults` with the tasks' summary columns and tables
    (:func:`kveval.results.load` reads the run's own frames; KvevalError, one line, for a missing or corrupt
    folder)."""
    return load_generic(run_dir, task_columns=summary_keys(), task_tables=task_tables)


_MODULES = ("plots", "tables", "render", "sections", "document", "reading", "style")

__all__ = ["RunResults", "load", "read_metrics", *_MODULES]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"kveval.report.{name}")
    raise AttributeError(f"module 'kveval.report' has no attribute {name!r}")
