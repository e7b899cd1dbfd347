"""Every preset's emulation cost: one emulated forward pass over one unpatched pass, same process, same tokens.

    .venv/bin/python bench/bench_presets.py [--model builtin:smollm2-135m] [--tokens 512,2048] [--repeats 3]
                                            [--presets all|policies|formats|NAME,spec:NAME,...] [--threads N]
                                            [--profile 1.3]

Presets: every policy preset (``kveval.policy.presets.POLICY_PRESETS``) and the first quantization preset of each
registered format (as a K/V policy), under ``emulate`` with prefill_len 0 (what ``kveval run``'s perplexity
task runs). Presets that need calibrated scales (``scales: auto``) or cannot act on the model are listed as
skipped with the reason.

Timing: the unpatched pass and the preset's pass alternate ``--repeats`` times after one warm-up of each (a load
change hits both alike); the ratio is median(emulated) / median(unpatched). Its resolution: the spread of the
unpatched passes (printed as ``noise``, (max - min) / median) — repeat until it is below the difference you need.

``--profile R``: for each preset whose ratio exceeds R at the largest length, a cProfile of one emulated pass:
the ten functions with the most own time (quantize, transforms, masks, attention over key versions...).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from kveval.data import load_tokens
from kveval.errors import KvevalError
from kveval.models import load_model
from kveval.patch import emulate
from kveval.policy import KVPolicy
from kveval.policy.presets import POLICY_PRESETS


def interleaved_ratio(plain: Callable[[], object], patched: Callable[[], object], repeats: int, *,
                      warm: bool = True) -> tuple[float, float]:
    """(median(patched) / median(plain), noise): after one warm-up of each (``warm``; else the caller's), the two
    alternate ``repeats`` times (a load change hits both alike); noise is the spread of the plain runs, (max - min)
    / median."""
    if warm:
        patched()
        plain()
    base, emu = [], []
    for _ in range(repeats):
        for fn, rec in ((plain, base), (patched, emu)):
            t = time.perf_counter()
            fn()
            rec.append(time.perf_counter() - t)
    return statistics.median(emu) / statistics.median(base), (max(base) - min(base)) / statistics.median(base)


def first_format_presets() -> list[str]:
    """The first quantization preset of every registered format (``none`` excluded)."""
    from kveval.quant import preset, preset_names

    first: dict[str, str] = {}
    for name in preset_names():
        spec = preset(name)
        first.setdefault(spec.ggml or spec.format, name)
    return [n for f, n in first.items() if f != "none"]


def policies(which: str) -> list[tuple[str, KVPolicy | str]]:
    """(label, policy or the reason it is skipped)."""
    names: list[tuple[str, dict | str]] = []
    if which in ("all", "policies"):
        names += [(n, n) for n in POLICY_PRESETS]
    if which in ("all", "formats"):
        names += [(f"spec:{n}", {"spec": n}) for n in first_format_presets() if n not in POLICY_PRESETS]
    if which not in ("all", "policies", "formats"):
        # a name as the table prints it: a policy preset, or spec:NAME for a quantization preset as a K/V policy
        names = [(n, {"spec": n.removeprefix("spec:")} if n.startswith("spec:") else n) for n in which.split(",")]
    out: list[tuple[str, KVPolicy | str]] = []
    for label, src in names:
        try:
            out.append((label, KVPolicy.preset(src) if isinstance(src, str) else KVPolicy.from_config(src, name=label)))
        except KvevalError as exc:
            out.append((label, str(exc)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--presets", default="all")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--profile", type=float, default=0.0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    lengths = [int(x) for x in args.tokens.split(",")]
    corpus = load_tokens("builtin", tok)[: max(lengths)][None]
    print(f"{args.model}, {torch.get_num_threads()} threads, median of {args.repeats}, emulated / unpatched")
    print(f"{'preset':30s} " + " ".join(f"{f'{n} tok':>9s} {'noise':>6s}" for n in lengths))
    slow: list[tuple[str, KVPolicy]] = []
    for label, policy in policies(args.presets):
        if isinstance(policy, str):
            print(f"{label:30s} skipped: {policy}")
            continue
        cells = []
        ratio = 0.0
        with torch.no_grad():
            for n in lengths:
                ids = corpus[:, :n]

                def plain(ids=ids):
                    model(ids)

                def patched(ids=ids, policy=policy):
                    with emulate(model, policy):
                        model(ids)

                try:
                    patched()
                except KvevalError as exc:
                    cells.append(f"skipped: {exc}")
                    break
                plain()
                ratio, noise = interleaved_ratio(plain, patched, args.repeats, warm=False)
                cells.append(f"{ratio:8.2f}x {noise:6.2f}")
        print(f"{label:30s} " + " ".join(cells), flush=True)
        if args.profile and ratio > args.profile:
            slow.append((label, policy))
    for label, policy in slow:
        ids = corpus[:, : lengths[-1]]
        prof = cProfile.Profile()
        with torch.no_grad(), emulate(model, policy):
            prof.enable()
            model(ids)
            prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
        print(f"\nprofile of {label} at {lengths[-1]} tokens (own time):")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-2000:])


if __name__ == "__main__":
    main()
