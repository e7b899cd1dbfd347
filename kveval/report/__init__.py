"""Reports: load a results folder into pandas, draw the figures, write Markdown + self-contained HTML.

    from kveval.report import load, plots, report_command
    res = load("results/int4_g64")        # RunResults: summary, positions, layers, needle, sensitivity, memory...
    plots.quality_vs_memory(res)          # a matplotlib Figure
    report_command(["results/int4_g64"])  # report.md, report.html, tables/*.csv, plots/*.png in the run folder

Run folders are read only through :mod:`kveval.results` (``load`` and ``read_metrics`` are its own, re-exported
here). The loader is imported eagerly (pandas, yaml); the plotting side lazily, so that loading results does not
import matplotlib. The needle and sensitivity tasks' own figures are drawn here too (``task_figures``), from their
metrics, never by the tasks.
"""

from __future__ import annotations

import importlib

from kveval.results import RunResults, load, read_metrics

_EXPORTS = {
    "report_command": "kveval.report.render",
    "write_run_report": "kveval.report.render",
}
_MODULES = ("plots", "tables", "render", "synthetic", "task_figures")

__all__ = ["RunResults", "load", "read_metrics", *_EXPORTS, *_MODULES]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"kveval.report.{name}")
    raise AttributeError(f"module 'kveval.report' has no attribute {name!r}")
