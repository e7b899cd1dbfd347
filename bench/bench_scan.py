"""Sensitivity scan with prefix reuse against the naive scan (a full forward pass per cell), same process.

    .venv/bin/python bench/bench_scan.py [--tokens 256] [--spec int4_g64] [--layers all] [--threads N]

Both scans do the same work per window: one baseline pass, then per cell (layer x K/V) the logits under the cell's
policy and the KL divergence against the baseline. The cells are timed interleaved (naive cell, reused cell, next
cell ...) so that a load change on a shared machine hits both alike. Target: reuse / naive <= 0.65, identical
numbers (the same KLD and NLL sums to float rounding).
"""

from __future__ import annotations

import argparse
import time

import torch

from kveval.data import load_tokens
from kveval.models import load_model
from kveval.policy.selectors import layers_of
from kveval.tasks.sensitivity.scan import baseline_prefix, cell_policy, naive_logits, replay
from kveval.tasks.sensitivity.task import baseline_terms, compare


def scan_times(model_name: str, tokens: int, spec: str, layers: str) -> tuple[float, float, float]:
    """(naive seconds, reuse seconds, the largest relative gap of their KLD/NLL sums): every (layer, K or V) cell
    of ``layers`` under ``spec`` over one window of ``tokens`` builtin tokens, scored naively (a whole emulated
    pass per cell) and with the prefix reuse the scan runs; each side's baseline pass counted in its time."""
    model, tok = load_model(model_name)
    ids = load_tokens("builtin", tok)[:tokens][None]
    n = model.config.num_hidden_layers
    cells = [(i, t) for i in layers_of(layers, n) for t in ("key", "value")]
    targets = ids[0, 1:]

    def base_of(prefix):
        return baseline_terms(prefix.logits[0, :-1])

    baseline_prefix(model, ids, capture=False)  # warm-up
    t0 = time.perf_counter()
    naive_prefix = baseline_prefix(model, ids, capture=False)
    naive_base = base_of(naive_prefix)
    t_naive = time.perf_counter() - t0
    t0 = time.perf_counter()
    prefix = baseline_prefix(model, ids)
    base = base_of(prefix)
    t_reuse = time.perf_counter() - t0
    worst = 0.0
    for layer, tensor in cells:
        policy = cell_policy(layer, tensor, spec)
        t0 = time.perf_counter()
        a = compare(naive_base, naive_logits(model, ids, policy)[0, :-1], targets)
        t_naive += time.perf_counter() - t0
        t0 = time.perf_counter()
        b = compare(base, replay(model, prefix, layer, policy)[0, :-1], targets)
        t_reuse += time.perf_counter() - t0
        for k in a:
            worst = max(worst, abs(a[k] - b[k]) / max(abs(a[k]), 1e-30))
    return t_naive, t_reuse, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--spec", default="int4_g64")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_naive, t_reuse, worst = scan_times(args.model, args.tokens, args.spec, args.layers)
    ratio = t_reuse / t_naive
    print(f"{args.model}: layers {args.layers} x (key, value) ({args.spec}), 1 window of {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"  naive scan  {t_naive:8.2f} s")
    print(f"  reuse scan  {t_reuse:8.2f} s")
    print(f"  ratio reuse/naive = {ratio:.3f} (target <= 0.65); largest relative gap in KLD/NLL sums: {worst:.2e}")


if __name__ == "__main__":
    main()
