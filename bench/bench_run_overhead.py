"""The harness's own overhead: whole-run time of a config against the time of its bare forward passes.

    .venv/bin/python bench/bench_run_overhead.py [configs/int4_g64.yaml]

Both in one process, after a warm-up: (1) ``run_experiment`` into a fresh temporary folder (model load from the
warm cache, tokens, windows, metrics, records, aggregation); (2) the same forward passes alone: per window, the
baseline forward and one emulated forward per policy. Overhead = (1) / (2) - 1.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from kveval.commands.run import run_experiment
from kveval.config import load_config
from kveval.data import load_tokens, token_windows
from kveval.models import load_model
from kveval.patch import emulate


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "configs/int4_g64.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(path, [f"output={tmp}/run"])
        params = cfg.tasks[0].params
        model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype)
        tokens = load_tokens(cfg.data.source, tok)
        windows = list(token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens))
        policies = cfg.policies()
        with torch.no_grad():
            model(windows[0].input_ids[None])  # warm-up

        t0 = time.perf_counter()
        run_experiment(cfg, quiet=True)
        whole = time.perf_counter() - t0

        t0 = time.perf_counter()
        with torch.no_grad():
            for w in windows:
                model(w.input_ids[None])
                for policy in policies.values():
                    with emulate(model, policy):
                        model(w.input_ids[None])
        bare = time.perf_counter() - t0
    n = len(windows) * (1 + len(policies))
    print(f"{path}: {len(windows)} windows x {1 + len(policies)} passes = {n} forward passes, {torch.get_num_threads()} threads")
    print(f"whole run {whole:.1f} s, bare forward passes {bare:.1f} s, harness overhead {100 * (whole / bare - 1):+.1f}%")


if __name__ == "__main__":
    main()
