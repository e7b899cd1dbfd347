"""Peak memory of one forward pass against its length: the unpatched model and ``emulate`` under a policy.

    .venv/bin/python bench/bench_memory.py [--model builtin:smollm2-135m] [--lengths 1024,2048,4096,8192]
                                           [--policy int4_g64] [--logits last|all] [--emulate-from FILE]

Each (length, mode) runs in a fresh subprocess (peak RSS is a high-water mark: ``resource.getrusage`` maxrss
cannot be reset, and tracemalloc does not see torch's allocations): load the model, run a 16-token forward (the
allocator and the model's buffers warm up), read maxrss (``base``), run the ``length``-token forward under
``torch.no_grad()`` (under ``emulate`` for the policy), read maxrss again (``peak``). ``extra = peak - base`` is
what the pass itself needed. ``--logits last`` computes only the last position's logits (``logits_to_keep=1``)
so that attention and its masks are not hidden behind the ``[T, vocab]`` logits (1.6 GB at 8k tokens in float32);
``all`` is what the perplexity task computes.

``--mask-elements N`` sets ``kveval.patch.emulate.MASK_ELEMENTS`` (the query-chunk budget) in the child.
``--emulate-from FILE`` measures another version of ``kveval/patch/emulate.py`` (e.g. ``git show
HEAD~1:kveval/patch/emulate.py > /tmp/emulate_old.py``): the child imports it in place of the installed one.

Printed per length: base and extra MB of each mode, the ratio of the extras (emulate / unpatched) and of the
times.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def child(args) -> None:
    import importlib.util

    import torch

    from kveval.data import load_tokens
    from kveval.models import load_model
    from kveval.policy import KVPolicy

    if args.emulate_from and args.mode == "emulate":
        spec = importlib.util.spec_from_file_location("kveval_bench_emulate", args.emulate_from)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        emulate = module.emulate
    else:
        from kveval.patch import emulate

        if args.mask_elements:
            importlib.import_module("kveval.patch.emulate").MASK_ELEMENTS = args.mask_elements
    model, tok = load_model(args.model, dtype=args.dtype)
    ids = load_tokens("builtin", tok)[: args.length][None]
    if ids.shape[1] < args.length:
        raise SystemExit(f"the builtin corpus has only {ids.shape[1]} tokens")
    kwargs = {"logits_to_keep": 1} if args.logits == "last" else {}
    policy = KVPolicy.preset(args.policy) if args.mode == "emulate" else None

    def forward(x):
        with torch.no_grad():
            if policy is None:
                return model(x, **kwargs).logits
            with emulate(model, policy):
                return model(x, **kwargs).logits

    forward(ids[:, :16])
    base = _maxrss_mb()
    t = time.perf_counter()
    out = forward(ids)
    seconds = time.perf_counter() - t
    peak = _maxrss_mb()
    print(json.dumps({"length": args.length, "mode": args.mode, "base_mb": base, "peak_mb": peak,
                      "extra_mb": peak - base, "seconds": seconds, "logits_shape": list(out.shape)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--policy", default="int4_g64")
    ap.add_argument("--modes", default="unpatched,emulate")
    ap.add_argument("--logits", default="last", choices=["last", "all"])
    ap.add_argument("--emulate-from", default=None)
    ap.add_argument("--mask-elements", type=int, default=None, help="kveval.patch.emulate.MASK_ELEMENTS to use")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.model} ({args.dtype}), policy {args.policy}, logits {args.logits}"
          + (f", emulate from {args.emulate_from}" if args.emulate_from else ""), flush=True)
    modes = args.modes.split(",")
    print(f"{'tokens':>6s} " + " ".join(f"{m + ' base MB':>17s} {m + ' extra MB':>18s} {m + ' s':>12s}" for m in modes)
          + f" {'extra ratio':>11s} {'time ratio':>10s}", flush=True)
    for length in (int(x) for x in args.lengths.split(",")):
        rows = {}
        for mode in modes:
            cmd = [sys.executable, __file__, "--child", "--length", str(length), "--mode", mode, "--model", args.model,
                   "--dtype", args.dtype, "--policy", args.policy, "--logits", args.logits]
            if args.emulate_from:
                cmd += ["--emulate-from", args.emulate_from]
            if args.mask_elements:
                cmd += ["--mask-elements", str(args.mask_elements)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                raise SystemExit(f"{mode} at {length} tokens failed:\n{res.stderr[-2000:]}")
            rows[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        line = f"{length:6d} " + " ".join(f"{rows[m]['base_mb']:17.0f} {rows[m]['extra_mb']:18.0f} {rows[m]['seconds']:12.1f}"
                                          for m in modes)
        if len(modes) == 2:
            a, b = rows[modes[0]], rows[modes[1]]
            line += f" {b['extra_mb'] / max(a['extra_mb'], 1.0):11.2f} {b['seconds'] / a['seconds']:10.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
