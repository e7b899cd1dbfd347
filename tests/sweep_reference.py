"""The metrics of a sweep's run config run uninterrupted in this process, as Ray ran it: one thread (a task of one
CPU gets OMP_NUM_THREADS=1). Tests of resumed sweep runs compare their metrics.json with it."""

from __future__ import annotations

from pathlib import Path

import torch


def uninterrupted_metrics(config_file: Path, output: Path) -> dict:
    """``run_experiment`` of ``config_file`` with its output moved to ``output``, on one thread."""
    from kveval.commands.run import run_experiment
    from kveval.config import load_config

    config = load_config(config_file, [f"output={output}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_experiment(config, quiet=True)
    finally:
        torch.set_num_threads(threads)
