"""The results feature: the one place that writes and reads run folders (``results/<run>/``).

``layout`` names a run folder's files and the baseline, says what each file holds and where a run's folder is
(``run_folder``: contained, ``~`` expanded); ``lock`` gives a folder one owner at a time; ``checks`` reads a folder
before a run opens it (whose it is, what it holds, its tokens); ``store`` owns a run folder
while a run writes it (resolved config, env.json, records.jsonl appended as work completes, metrics.json written
atomically); ``read`` loads a finished folder into pandas for reports, notebooks and ``kveval plan``::

    import kveval.results as r
    res = r.load("results/int4_g64")    # RunResults: summary, positions, layers, needle, sensitivity, memory

Every name below is importable from here; the modules load on first use, so that a task module importing
``kveval.results.layout`` does not import pandas. The atomic writes and the JSONL reader live in
:mod:`kveval.fileio` (data and model caches use them too) and are re-exported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kveval.fileio import atomic_write_json, atomic_write_text, read_jsonl
    from kveval.results.layout import (
        BASELINE,
        CONFIG_FILE,
        ENV_FILE,
        LOCK_FILE,
        MARKER_FILE,
        METRICS_FILE,
        PLOTS_DIR,
        RECORDS_FILE,
        SCALES_FILE,
        SCALES_USED_FILE,
        TABLES_DIR,
        TASK_ENTRIES,
        run_folder,
    )
    from kveval.results.lock import lock_folder
    from kveval.results.read import RunResults, load, read_config, read_env, read_metrics, read_records
    from kveval.results.store import RunDir, TaskRecords, environment, now, record_key

_HOMES = {
    "kveval.fileio": ("atomic_write_json", "atomic_write_text", "read_jsonl"),
    "kveval.results.layout": ("BASELINE", "CONFIG_FILE", "ENV_FILE", "LOCK_FILE", "MARKER_FILE", "METRICS_FILE",
                              "PLOTS_DIR", "RECORDS_FILE", "SCALES_FILE", "SCALES_USED_FILE", "TABLES_DIR",
                              "TASK_ENTRIES", "run_folder"),
    "kveval.results.lock": ("lock_folder",),
    "kveval.results.read": ("RunResults", "load", "read_config", "read_env", "read_metrics", "read_records"),
    "kveval.results.store": ("RunDir", "TaskRecords", "environment", "now", "record_key"),
}
_EXPORTS = {name: module for module, names in _HOMES.items() for name in names}

_MODULES = ("layout", "lock", "read", "store")

__all__ = [
    "BASELINE", "CONFIG_FILE", "ENV_FILE", "LOCK_FILE", "MARKER_FILE", "METRICS_FILE", "PLOTS_DIR", "RECORDS_FILE",
    "SCALES_FILE", "SCALES_USED_FILE", "TABLES_DIR", "TASK_ENTRIES", "RunDir", "RunResults", "TaskRecords",
    "atomic_write_json", "atomic_write_text", "environment", "load", "lock_folder", "now", "read_config", "read_env",
    "read_jsonl", "read_metrics", "read_records", "record_key", "run_folder",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"kveval.results.{name}")
    raise AttributeError(f"module 'kveval.results' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
