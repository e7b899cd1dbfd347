"""Single-pass emulation time over an unpatched forward pass (builtin model, 2048 tokens), same process.

    .venv/bin/python bench/bench_emulate.py [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.data import load_tokens
from kveval.models import load_model
from kveval.patch import emulate
from kveval.policy import KVPolicy


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="int8,int4_g64,kivi2")
    args = ap.parse_args()
    model, tok = load_model("builtin:smollm2-135m")
    ids = load_tokens("builtin", tok)[: args.tokens][None]

    @torch.no_grad()
    def plain():
        model(ids)

    base = timed(plain, args.repeats)
    print(f"unpatched forward, {args.tokens} tokens: {base:.3f} s ({args.tokens / base:.0f} tok/s), {torch.get_num_threads()} threads")
    for name in args.policies.split(","):
        policy = KVPolicy.preset(name)

        @torch.no_grad()
        def patched(policy=policy):
            with emulate(model, policy):
                model(ids)

        t = timed(patched, args.repeats)
        print(f"emulate {name:10s}: {t:.3f} s  ratio {t / base:.3f}")


if __name__ == "__main__":
    main()
