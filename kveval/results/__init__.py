"""The results feature: the one place that writes and reads run folders (``results/<run>/``).

``store`` owns a run folder while a run writes it (resolved config, env.json, records.jsonl appended as work
completes, metrics.json written atomically); ``read`` loads a finished folder into pandas for reports and
notebooks::

    import kveval.results as r
    res = r.load("results/int4_g64")    # RunResults: summary, positions, layers, needle, sensitivity, memory
"""

from kveval.results.read import RunResults, load
from kveval.results.store import (
    CONFIG_FILE,
    ENV_FILE,
    METRICS_FILE,
    RECORDS_FILE,
    RunDir,
    atomic_write_json,
    atomic_write_text,
    environment,
    now,
    read_metrics,
    record_key,
)

__all__ = [
    "CONFIG_FILE", "ENV_FILE", "METRICS_FILE", "RECORDS_FILE", "RunDir", "RunResults", "atomic_write_json",
    "atomic_write_text", "environment", "load", "now", "read_metrics", "record_key",
]
