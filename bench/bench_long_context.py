"""Long contexts in bounded memory: one emulated forward pass per preset at 4k-64k tokens against the bare pass.

    .venv/bin/python bench/bench_long_context.py [--lengths 4096,16384,32768] [--presets all|int4_g32,kivi2,...]
                                                 [--model tiny-llama] [--head-dim 64] [--skipped-only]

The memory is the pass's **live peak**: the most bytes of tensors alive at once, read from PyTorch's own
allocation records (``torch.profiler`` with ``profile_memory``: every allocation and free on the CPU, so the
peak of their running total), not the process's RSS, whose high-water mark also counts what the C allocator keeps
after a free (it fragments under chunks of growing size, and RSS then grows faster than what is alive). The time is
the same pass without the profiler. Printed per length and preset: live peak MiB of the bare and the emulated pass,
their ratio, and the ratio of the times; a path whose peak grows as ``T x T`` shows as a ratio that doubles with T.
With several lengths, ``growth`` is the memory ratio at the longest over the ratio at the shortest: 1.00 for a path
linear in T, the length ratio (4.00 from 4k to 16k) for a square one. ``--presets all``: every policy preset and
the first quantization preset of each format (as ``bench/bench_presets.py`` lists them); a preset that cannot act on
the model (a group wider than its heads, an MLA-only preset on per-head K/V) is listed as skipped with the reason;
``--head-dim 64`` (the tiny model with 64-wide heads) and ``--model tiny-deepseek-v3`` (MLA) measure those, and
``--skipped-only`` measures only the presets that tiny-llama's shape skips. A preset with ``scales: auto`` gets
scales calibrated on the builtin corpus (as ``kveval run`` calibrates them) before it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kveval.errors import KvevalError  # noqa: E402

MIB = 2**20
#: the main presets that fit a tiny model's head_dim 32 (int4_g32 for int4_g64, hf_quanto_int4 in groups of 32)
PRESETS = ["int4_g32", "kivi2", "vllm_fp8", "vllm_fp8_fa3", "llamacpp_q4_0", "vllm_nvfp4", "int8"]


def live_peak_bytes(fn) -> int:
    """The most bytes of CPU tensors alive at once while ``fn()`` runs (PyTorch's allocation records), counted from
    what was alive when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    finally:
        os.unlink(path)
    records = [e["args"] for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not records:
        return 0
    start = records[0]["Total Allocated"] - records[0]["Bytes"]  # alive before the first allocation
    return int(max(r["Total Allocated"] for r in records) - start)


def one_pass(model, ids, policy):
    """A closure: one no-grad forward over ``ids`` (last position's logits), emulated under ``policy`` (a KVPolicy
    or a preset's name) if given."""
    from kveval.patch import emulate
    from kveval.policy import KVPolicy

    def run():
        with torch.no_grad():
            if policy is None:
                model(ids, logits_to_keep=1)
            else:
                with emulate(model, KVPolicy.preset(policy) if isinstance(policy, str) else policy):
                    model(ids, logits_to_keep=1)
    return run


def tiny(name: str = "tiny-llama", head_dim: int | None = None):
    """The tiny random model ``name`` (float32), its context unbounded; ``head_dim``: its heads that wide."""
    from kveval.models.builtin import build_tiny_model

    model = build_tiny_model(name, **({} if head_dim is None else {"head_dim": head_dim}))
    model.config.max_position_embeddings = 1 << 20
    return model


def calibrated(model, label: str, policy, folder: Path):
    """``policy`` with the scales ``kveval run`` would calibrate for ``scales: auto`` (the builtin corpus' tail)."""
    from kveval.calibration.calibrate import calibrate
    from kveval.config import validate
    from kveval.data import load_tokens
    from kveval.models.builtin import byte_tokenizer
    from kveval.policy import KVPolicy

    cfg = validate({"name": "lc", "model": "builtin:tiny-llama", "data": "builtin", "kv": [policy.name],
                    "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256}}],
                    "calibration": {"tokens": 512, "seq_len": 256}})
    tok = byte_tokenizer()
    path = calibrate(model, tok, load_tokens("builtin", tok), cfg, folder / f"{policy.name}.safetensors")
    return KVPolicy.from_config({"preset": policy.name, "scales": str(path)}, name=label)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--skipped-only", action="store_true")
    args = ap.parse_args()
    model = tiny(args.model, args.head_dim)
    lengths = [int(x) for x in args.lengths.split(",")]
    presets = preset_list(args.presets)
    if args.skipped_only:
        presets = [(label, policy) for label, policy in presets if label in skipped_on(tiny("tiny-llama"), presets)]
    scratch = Path(tempfile.mkdtemp(prefix="kveval-lc-"))
    for i, (label, policy) in enumerate(presets):
        if not isinstance(policy, str) and policy.needs_scales_file():
            presets[i] = (label, calibrated(model, label, policy, scratch))
    shape = f", head_dim {args.head_dim}" if args.head_dim else ""
    print(f"{args.model}{shape} (float32, {torch.get_num_threads()} threads): live peak MiB of one pass, bare and "
          "emulated")
    print(f"{'tokens':>7} {'preset':<28} {'bare MiB':>9} {'emul MiB':>9} {'ratio':>6} {'time ratio':>10}")
    ratios: dict[str, list[float]] = {}
    for length in lengths:
        ids = torch.randint(4, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        bare = one_pass(model, ids, None)
        bare_peak = live_peak_bytes(bare)
        t0 = time.perf_counter()
        bare()
        bare_s = time.perf_counter() - t0
        for label, policy in presets:
            if isinstance(policy, str):
                if length == lengths[0]:
                    print(f"{length:>7} {label:<28} skipped: {policy}", flush=True)
                continue
            run = one_pass(model, ids, policy)
            try:
                peak = live_peak_bytes(run)
            except KvevalError as exc:  # cannot act on this model: said once, not measured again
                print(f"{length:>7} {label:<28} skipped: {exc}", flush=True)
                presets = [(n, str(exc) if n == label else p) for n, p in presets]
                continue
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
            ratios.setdefault(label, []).append(peak / bare_peak)
            print(f"{length:>7} {label:<28} {bare_peak / MIB:>9.1f} {peak / MIB:>9.1f} {peak / bare_peak:>6.2f} "
                  f"{seconds / bare_s:>10.2f}", flush=True)
    if len(lengths) > 1 and ratios:
        print(f"growth of the memory ratio from {lengths[0]} to {lengths[-1]} tokens (1.00: linear in T, "
              f"{lengths[-1] / lengths[0]:.2f}: T x T)")
        for label, values in sorted(ratios.items(), key=lambda kv: -kv[1][-1] / kv[1][0]):
            if len(values) == len(lengths):
                print(f"  {label:<28} {values[-1] / values[0]:>6.2f}")


def skipped_on(model, presets) -> set[str]:
    """The labels of ``presets`` that cannot act on ``model`` (a refused check) or need calibrated scales."""
    from kveval.patch import emulate

    ids = torch.zeros(1, 8, dtype=torch.long)
    out = set()
    for label, policy in presets:
        if isinstance(policy, str):
            out.add(label)
            continue
        if policy.needs_scales_file():
            out.add(label)
            continue
        try:
            with torch.no_grad(), emulate(model, policy):
                model(ids)
        except KvevalError:
            out.add(label)
    return out


def preset_list(which: str) -> list[tuple[str, object]]:
    """(label, KVPolicy or the reason it is skipped): ``all`` as bench/bench_presets.py lists every preset, else
    the names given (``spec:NAME`` for a quantization preset as a K/V policy)."""
    from bench.bench_presets import policies

    return policies(which)


if __name__ == "__main__":
    main()
