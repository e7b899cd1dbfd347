"""The harness's own overhead: whole-run time of a config against the time of its bare forward passes, and where
the rest goes.

    .venv/bin/python bench/bench_run_overhead.py [configs/int4_g64.yaml] [-s KEY=VALUE ...]

Both in one process, after a warm-up: (1) ``run_experiment`` into a fresh temporary folder (model load from the
warm cache, tokens, calibration, windows, metrics, records, aggregation, the report); (2) the same forward passes
alone: per window, the baseline forward and one emulated forward per policy. Overhead = (1) / (2) - 1.

During (1) the stages are timed by wrapping the functions the run calls (looked up at call time, so the wrappers
see every call) and a forward hook on the model times every forward pass inside each stage: printed per stage,
its wall seconds and the seconds of forward passes in it (calibration runs forwards of its own), then what no
stage accounts for (records, checks, the summary tables).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

import kveval.calibration.calibrate as calibrate_module
import kveval.commands.report as report_module
import kveval.models as models_module
import kveval.tasks.perplexity.aggregate as perplexity_aggregate
import kveval.tasks.perplexity.scorer as perplexity_scorer
from kveval.commands.run import run_experiment
from kveval.config import load_config
from kveval.data import load_tokens, token_windows
from kveval.models import load_model
from kveval.patch import emulate
from kveval.policy import AUTO_SCALES
from kveval.results.layout import SCALES_FILE

#: (module, function, stage): what the run calls, timed as that stage
STAGES = (
    (models_module, "load_model", "model load"),
    (calibrate_module, "calibrate", "calibration"),
    (perplexity_scorer, "_compare", "metrics (NLL, KLD, top-1)"),
    (perplexity_aggregate, "_summarise", "aggregation (bootstrap)"),
    (report_module, "write_run_report", "report (tables, plots)"),
)


class StageClock:
    """Wall seconds per stage and forward-pass seconds per stage (``forward`` outside any stage: scoring)."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.forward: dict[str, float] = defaultdict(float)
        self.active: list[str] = []
        self._start: list[float] = []

    def wrap(self, module, name: str, stage: str):
        original = getattr(module, name)

        def timed(*args, **kwargs):
            self.active.append(stage)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall[stage] += time.perf_counter() - t0
                self.active.pop()

        setattr(module, name, timed)
        return original

    def before(self, *_):
        self._start.append(time.perf_counter())

    def after(self, *_):
        self.forward[self.active[-1] if self.active else "scoring"] += time.perf_counter() - self._start.pop()


@contextmanager
def timed_stages(clock: StageClock, model):
    """Wrap the STAGES functions and hook ``model``'s forward (also the copy the run loads: ``load_model`` is
    wrapped to hook what it returns)."""
    originals = [(m, n, clock.wrap(m, n, s)) for m, n, s in STAGES]
    hooks = []

    def hook(module):
        hooks.append(module.register_forward_pre_hook(clock.before))
        hooks.append(module.register_forward_hook(clock.after))

    loader = models_module.load_model

    def load_and_hook(*args, **kwargs):
        loaded = loader(*args, **kwargs)
        hook(loaded[0])
        return loaded

    models_module.load_model = load_and_hook
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for m, n, original in originals:
            setattr(m, n, original)


def overhead(path: str, overrides: list[str] | None = None, report: bool = False) -> tuple[float, float, StageClock]:
    """(whole-run seconds, bare forward-pass seconds, the stage clock) of the config at ``path`` with ``-s``
    ``overrides``; ``report``: print the stage table."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(path, [*(overrides or []), f"output={tmp}/run"])
        params = cfg.tasks[0].params
        model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype)
        tokens = load_tokens(cfg.data.source, tok)
        windows = list(token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens))
        policies = cfg.policies()
        with torch.no_grad():
            model(windows[0].input_ids[None])  # warm-up

        clock = StageClock()
        t0 = time.perf_counter()
        with timed_stages(clock, model):
            run_experiment(cfg, quiet=True)
        whole = time.perf_counter() - t0
        if report:
            print(f"{path}: whole run {whole:.1f} s, {torch.get_num_threads()} threads")
            print(f"{'stage':<28} {'wall s':>8} {'of it forwards s':>17}")
            scoring = clock.forward.get("scoring", 0.0)
            print(f"{'scoring forward passes':<28} {scoring:8.1f} {scoring:17.1f}")
            accounted = scoring
            for _, _, stage in STAGES:
                wall = clock.wall.get(stage, 0.0)
                accounted += wall
                print(f"{stage:<28} {wall:8.1f} {clock.forward.get(stage, 0.0):17.1f}")
            print(f"{'the rest (records, checks)':<28} {whole - accounted:8.1f}", flush=True)

        scales = Path(tmp) / "run" / SCALES_FILE  # what the run calibrated for its ``scales: auto`` policies
        policies = {n: replace(p, scales=str(scales)) if p.scales == AUTO_SCALES else p for n, p in policies.items()}
        t0 = time.perf_counter()
        with torch.no_grad():
            for w in windows:
                model(w.input_ids[None])
                for policy in policies.values():
                    with emulate(model, policy):
                        model(w.input_ids[None])
        bare = time.perf_counter() - t0
    if report:
        n = len(windows) * (1 + len(policies))
        print(f"{len(windows)} windows x {1 + len(policies)} passes = {n} forward passes: bare {bare:.1f} s, "
              f"harness overhead {100 * (whole / bare - 1):+.1f}% (whole run / bare forward passes - 1)")
    return whole, bare, clock


def main() -> None:
    args = sys.argv[1:]
    path = args[0] if args and not args[0].startswith("-") else "configs/int4_g64.yaml"
    sets = [args[i + 1] for i, a in enumerate(args) if a == "-s" and i + 1 < len(args)]
    overhead(path, sets, report=True)


if __name__ == "__main__":
    main()
