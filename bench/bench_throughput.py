"""Throughput of the perplexity task's forward passes: tokens/s and peak memory per policy, batch size and length.

    .venv/bin/python bench/bench_throughput.py [--model builtin:smollm2-135m] [--device cpu|cuda] [--dtype float32]
                                               [--policies fp,int4_g64,kivi2,llamacpp_q4_0] [--seq-len 512,2048]
                                               [--batch-size 1,4] [--windows 8] [--repeats 3] [--diagnostics]
                                               [--threads N] [--no-memory]

Per point (seq_len, batch_size, policy): ``--windows`` windows of the builtin corpus (``token_windows``, as the task
cuts them) in batches of ``batch_size``, each batch one forward pass that returns the metric logits the task
compares (``kveval.tasks.perplexity.scorer._logits``: every position, float32), under ``emulate`` for a policy (``fp``:
the unpatched model, the task's baseline pass). ``--diagnostics`` times the passes with the task's per-layer
error statistics on (its default; float64 work per layer).

Speed, in this process (the model loaded once): for each (seq_len, batch_size), one untimed batch per policy, then
``--repeats`` rounds that time every policy's windows in turn (interleaved, so that a change of load on a shared
machine hits the policies alike; on CUDA synchronised before and after). ``tok/s`` = tokens of the windows / median
seconds.

Peak memory of one batch's pass beyond the weights: on CUDA, ``torch.cuda.max_memory_allocated`` (statistics reset
first) minus the memory allocated before the pass, in this process; on CPU, for each point a fresh subprocess (as
bench_memory.py): load the model, run a 16-token forward, give the freed heap back (``malloc_trim``), read the RSS
(``base``), run one batch while a thread samples the RSS every millisecond (``peak``, or maxrss when the pass
raised it: loading leaves a high-water mark above what a short pass needs, so maxrss alone reads 0 for it):
``extra`` = peak - base.

Printed per point: tok/s, its ratio to ``fp`` at the same (seq_len, batch_size) (``x fp``) and to the same policy at
the first batch size (``x b1``: what batching buys), the extra memory in MB and its ratio to ``fp``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import torch

FP = "fp"


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def load(args):
    """(model, corpus token ids) on ``args.device`` in ``args.dtype``."""
    from kveval.data import load_tokens
    from kveval.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    return model, load_tokens("builtin", tok)


def batches(tokens: torch.Tensor, seq_len: int, batch_size: int, n: int, device) -> list[torch.Tensor]:
    """``n`` windows of ``seq_len`` tokens in batches ``[batch_size, seq_len]`` (the last one shorter when
    ``batch_size`` does not divide ``n``)."""
    from kveval.data import token_windows

    windows = [w.input_ids for w in token_windows(tokens, seq_len, max_tokens=1 + n * (seq_len - 1))][:n]
    if len(windows) < n or len(windows[-1]) < seq_len:
        raise SystemExit(f"the builtin corpus has fewer than {n} windows of {seq_len} tokens")
    return [torch.stack(windows[i:i + batch_size]).to(device) for i in range(0, n, batch_size)]


def passes(model, group: list[torch.Tensor], policy_name: str, diagnostics: bool) -> float:
    """Seconds of the forward passes over ``group`` (each ``[batch, T]``) as the task runs them."""
    from kveval.patch import emulate
    from kveval.policy import KVPolicy
    from kveval.tasks.perplexity.scorer import _logits

    cuda = model.device.type == "cuda"
    policy = None if policy_name == FP else KVPolicy.preset(policy_name)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in group:
        patch = nullcontext() if policy is None else emulate(model, policy, diagnostics=diagnostics)
        with torch.no_grad(), patch:
            out = _logits(model, ids)
        del out
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def cuda_extra_mb(model, ids: torch.Tensor, policy_name: str, diagnostics: bool) -> float:
    """Peak allocated memory of one pass over ``ids`` beyond what was allocated before it, in MB (CUDA)."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    passes(model, [ids], policy_name, diagnostics)
    return (torch.cuda.max_memory_allocated(model.device) - before) / 2**20


def _rss_mb() -> float:
    """The resident set size now (``/proc/self/statm``), in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class RssPeak(threading.Thread):
    """The largest resident set size seen while it runs, sampled every millisecond (torch's kernels release the
    GIL): loading a model leaves a high-water mark (a transient copy of the weights) that ``ru_maxrss`` cannot
    forget, and a pass that needs less than that would not show in it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = _rss_mb()
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.001)

    def stop(self) -> float:
        self.running = False
        self.join()
        return max(self.peak, _rss_mb())


def child(args) -> None:
    """One CPU point's peak RSS beyond the loaded model: one batch's pass in this fresh process, after a 16-token
    pass, with the freed heap given back first (``malloc_trim``) so that the base is what the process holds."""
    import ctypes
    import gc

    model, tokens = load(args)
    with torch.no_grad():
        model(tokens[:16][None])
    ids = batches(tokens, args.point_seq_len, args.point_batch_size, args.point_batch_size, model.device)[0]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base, maxrss = _rss_mb(), _maxrss_mb()
    sampler = RssPeak()
    sampler.start()
    passes(model, [ids], args.point_policy, args.diagnostics)
    peak = sampler.stop()
    if _maxrss_mb() > maxrss:  # the pass raised the high-water mark: it is exact, the samples may miss a spike
        peak = max(peak, _maxrss_mb())
    print(json.dumps({"base_mb": base, "peak_mb": peak, "extra_mb": peak - base}))


def cpu_extra_mb(args, seq_len: int, size: int, name: str) -> float:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
           "--threads", str(args.threads), "--point-seq-len", str(seq_len), "--point-batch-size", str(size),
           "--point-policy", name]
    if args.diagnostics:
        cmd.append("--diagnostics")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{name} at seq_len {seq_len}, batch {size} failed:\n{res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["extra_mb"])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--policies", default="fp,int4_g64,kivi2,llamacpp_q4_0",
                    help="comma-separated; 'fp' is the unpatched model (the task's baseline pass)")
    ap.add_argument("--seq-len", default="512")
    ap.add_argument("--batch-size", default="1,4")
    ap.add_argument("--windows", type=int, default=8, help="timed windows per point")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--diagnostics", action="store_true", help="per-layer error statistics on (the task's default)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--point-seq-len", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--point-batch-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--point-policy", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    policies = args.policies.split(",")
    if FP not in policies:
        policies.insert(0, FP)
    lengths, sizes = _ints(args.seq_len), _ints(args.batch_size)
    model, tokens = load(args)
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name(model.device)
    print(f"{args.model} ({args.dtype}, {args.device}, {where}), {args.windows} windows per point, median of "
          f"{args.repeats} interleaved rounds, diagnostics {'on' if args.diagnostics else 'off'}; peak memory of one "
          "batch's pass beyond the weights: "
          + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS of a fresh process per point"),
          flush=True)
    header = (f"| {'seq_len':>7s} | {'batch':>5s} | {'policy':<14s} | {'tok/s':>7s} | {'x fp':>5s} | {'x b1':>5s} "
              f"| {'extra MB':>8s} | {'x fp':>5s} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|", flush=True)
    speed: dict[tuple[int, int, str], float] = {}
    for seq_len in lengths:
        for size in sizes:
            group = batches(tokens, seq_len, size, args.windows, model.device)
            n_tokens = sum(ids.numel() for ids in group)
            for name in policies:  # warm-up: one batch each
                passes(model, group[:1], name, args.diagnostics)
            seconds: dict[str, list[float]] = {name: [] for name in policies}
            for _ in range(args.repeats):
                for name in policies:
                    seconds[name].append(passes(model, group, name, args.diagnostics))
            extra: dict[str, float] = {}
            for name in policies:
                speed[(seq_len, size, name)] = n_tokens / statistics.median(seconds[name])
                if args.no_memory:
                    extra[name] = float("nan")
                elif args.device == "cuda":
                    extra[name] = cuda_extra_mb(model, group[0], name, args.diagnostics)
                else:
                    extra[name] = cpu_extra_mb(args, seq_len, size, name)
            for name in policies:
                tps = speed[(seq_len, size, name)]
                print(f"| {seq_len:7d} | {size:5d} | {name:<14s} | {tps:7.1f} | {tps / speed[(seq_len, size, FP)]:5.2f} "
                      f"| {tps / speed[(seq_len, sizes[0], name)]:5.2f} | {extra[name]:8.0f} "
                      f"| {extra[name] / max(extra[FP], 1.0):5.2f} |", flush=True)


if __name__ == "__main__":
    main()
