"""The speed table of issue #55 in one command: every ratio that guards kveval's speed and memory, measured now.

    .venv/bin/python -m bench.speed_table [--size full|tiny] [--rows presets,scan,...] [--json FILE]

Each row is a ratio inside one process (absolute times drift on a shared machine; ratios of runs interleaved in one
process do not), printed with its goal and the command that measures it alone in more detail:

* ``presets``: one emulated forward pass over an unpatched one (``vllm_fp8_fa3``, ``kivi2``, ``hf_hqq_int4``), the
  two alternating, median of the repeats (``bench/bench_presets.py``);
* ``scan``: the per-layer scan's cells with prefix reuse over the same cells run naively (``bench/bench_scan.py``);
* ``run``: a whole ``kveval run`` of ``configs/int4_g64.yaml`` over its forward passes alone
  (``bench/bench_run_overhead.py``);
* ``decode``: greedy decoding tokens/s through the real quantized cache (buffered read path, what the tasks use) over
  ``DynamicCache``'s, batch 1 (``bench/bench_decode.py``);
* ``long``: one emulated pass of tiny-llama at 32k tokens over a bare one (``bench/bench_long_context.py``);
* ``rss``: the process's RSS growth during that pass (the peak RSS of a fresh child process minus its RSS before
  the pass), over the bare pass's growth, and the growth from 16k to 32k tokens (2.00: linear in tokens);
* ``generation``: ``kveval run configs/generation.yaml``, seconds (not a ratio: the issue's goal is absolute; off
  by default, 14 minutes on 2 cores: ``--rows generation``).

``--size tiny`` runs every row at the smallest size that exercises its code (tens of tokens, one repeat, one layer): tests/test_bench.py runs it in CI to keep the table working; its numbers mean nothing. Timings are never
asserted. docs/scale.md keeps the measured tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Size:
    """The sizes one table is measured at."""

    model: str  # the model of the preset, scan and decode rows
    preset_tokens: int
    repeats: int
    scan_tokens: int
    scan_layers: str
    run_overrides: tuple[str, ...]  # ``-s`` overrides of configs/int4_g64.yaml for the run row
    decode_prompt: int
    decode_tokens: int
    long_tokens: tuple[int, int]  # (half, whole): the RSS growth is compared between them
    long_presets: tuple[str, ...]
    generation_overrides: tuple[str, ...]


SIZES = {
    "full": Size("builtin:smollm2-135m", 2048, 3, 256, "all", (), 512, 64, (16384, 32768), ("kivi2", "kivi4", "vllm_fp8_fa3", "llamacpp_q4_0"), ()),
    "tiny": Size("builtin:smollm2-135m", 48, 1, 24, "0",
                 ("tasks[0].perplexity.max_tokens=128", "tasks[0].perplexity.seq_len=64", "kv=[int4_g64]"),
                 16, 3, (64, 128), ("kivi2",),
                 ("kv=[int8]", "tasks[0].generation.tasks_per_kind=1", "tasks[0].generation.continuations=1",
                  "tasks[0].generation.max_new_tokens=4", "tasks[0].generation.samples=1")),
}
PRESETS = ("vllm_fp8_fa3", "kivi2", "hf_hqq_int4")
PRESET_GOALS = {"vllm_fp8_fa3": 1.2, "kivi2": 1.2, "hf_hqq_int4": 1.3}
DECODE_POLICIES = ("int8", "int2_g32")


@dataclass(frozen=True)
class Row:
    """One line of the table: ``value`` (a ratio, or seconds for ``generation``) against ``goal`` (``at_most``:
    the value must not exceed it; else not fall below it)."""

    what: str
    value: float
    goal: float
    command: str
    at_most: bool = True
    note: str = ""

    @property
    def met(self) -> bool:
        return self.value <= self.goal if self.at_most else self.value >= self.goal


def preset_rows(size: Size) -> list[Row]:
    from bench.bench_presets import interleaved_ratio
    from kveval.data import load_tokens
    from kveval.models import load_model
    from kveval.patch import emulate
    from kveval.policy import KVPolicy

    model, tok = load_model(size.model)
    ids = load_tokens("builtin", tok)[: size.preset_tokens][None]
    rows = []
    for name in PRESETS:
        policy = KVPolicy.preset(name)

        def plain():
            with torch.no_grad():
                model(ids)

        def patched(policy=policy):
            with torch.no_grad(), emulate(model, policy):
                model(ids)

        ratio, noise = interleaved_ratio(plain, patched, size.repeats)
        rows.append(Row(f"{name} emulated / bare at {size.preset_tokens} tokens", ratio, PRESET_GOALS[name],
                        f"python bench/bench_presets.py --model {size.model} --tokens {size.preset_tokens} "
                        f"--presets {name} --repeats {size.repeats}", note=f"noise {noise:.2f}"))
    return rows


def scan_rows(size: Size) -> list[Row]:
    from bench.bench_scan import scan_times

    t_naive, t_reuse, worst = scan_times(size.model, size.scan_tokens, "int4_g64", size.scan_layers)
    return [Row(f"scan with prefix reuse / naive ({size.scan_tokens} tokens, layers {size.scan_layers})",
                t_reuse / t_naive, 0.65,
                f"python bench/bench_scan.py --model {size.model} --tokens {size.scan_tokens} --layers {size.scan_layers}",
                note=f"{t_reuse:.1f} s / {t_naive:.1f} s; KLD/NLL sums agree to {worst:.1e}")]


def run_rows(size: Size) -> list[Row]:
    from bench.bench_run_overhead import overhead

    with contextlib.redirect_stdout(io.StringIO()):  # the run's own console output
        whole, bare, _ = overhead("configs/int4_g64.yaml", list(size.run_overrides))
    sets = " ".join(f"-s {o}" for o in size.run_overrides)
    return [Row("whole run of configs/int4_g64.yaml / its forward passes", whole / bare, 1.2,
                f"python bench/bench_run_overhead.py configs/int4_g64.yaml {sets}".rstrip(),
                note=f"{whole:.1f} s / {bare:.1f} s")]


def decode_rows(size: Size) -> list[Row]:
    from functools import partial

    from bench.bench_decode import generate
    from kveval.data import load_tokens
    from kveval.models import load_model
    from kveval.patch import QuantizedKVCache
    from kveval.policy import KVPolicy
    from kveval.tasks.common.decoding import left_padded, pad_token_id

    model, tok = load_model(size.model)
    pad = pad_token_id(model, tok)
    ids, mask = left_padded([load_tokens("builtin", tok)[: size.decode_prompt].tolist()], pad)
    buffered = partial(QuantizedKVCache, read="buffered")
    rows = []
    for name in DECODE_POLICIES:
        policy = KVPolicy.preset(name)
        seconds: dict[str, list[float]] = {"dynamic": [], name: []}
        generate(model, ids, mask, size.decode_tokens, policy, pad, buffered)  # warm-up
        for _ in range(size.repeats):
            seconds["dynamic"].append(generate(model, ids, mask, size.decode_tokens, None, pad)[2])
            seconds[name].append(generate(model, ids, mask, size.decode_tokens, policy, pad, buffered)[2])
        ratio = statistics.median(seconds["dynamic"]) / statistics.median(seconds[name])
        rows.append(Row(f"decode tokens/s, {name} real cache / DynamicCache, batch 1 x {size.decode_prompt}",
                        ratio, 0.9, f"python bench/bench_decode.py --model {size.model} --batch 1 --prompt "
                        f"{size.decode_prompt} --new-tokens {size.decode_tokens} --policies {name} --reads buffered "
                        f"--skip-single --stages", at_most=False))
    return rows


def long_rows(size: Size) -> list[Row]:
    from bench.bench_long_context import one_pass, tiny
    from bench.bench_presets import interleaved_ratio

    model = tiny("tiny-llama")
    tokens = size.long_tokens[1]
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    bare = one_pass(model, ids, None)
    rows = []
    for name in size.long_presets:
        ratio, _ = interleaved_ratio(bare, one_pass(model, ids, name), 1)
        rows.append(Row(f"{name}: one emulated pass / bare at {tokens} tokens (tiny-llama)", ratio, 1.5,
                        f"python bench/bench_long_context.py --lengths {tokens} --presets {name}"))
    return rows


def rss_growth(policy: str, tokens: int) -> int:
    """Bytes: the peak RSS of a fresh process during one pass of tiny-llama over ``tokens`` tokens (``policy``
    emulated, or ``bare``) minus its RSS just before the pass."""
    out = subprocess.run([sys.executable, "-m", "bench.speed_table", "--rss-child", policy, str(tokens)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: resident now, ``VmHWM``: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_child(policy: str, tokens: int) -> None:
    """The child of ``rss_growth``: prints the growth in bytes. The model is built and a short pass run first;
    then the high-water mark is reset to the resident size (``5`` into /proc/self/clear_refs: ru_maxrss cannot be
    reset, and after exec it still holds the parent's), and the measured pass's peak read back."""
    from bench.bench_long_context import one_pass, tiny

    model = tiny("tiny-llama")
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    which = None if policy == "bare" else policy
    one_pass(model, ids[:, :8], which)()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    one_pass(model, ids, which)()
    print((_status_kib("VmHWM") - before) * 1024)


def rss_rows(size: Size) -> list[Row]:
    half, whole = size.long_tokens
    bare = rss_growth("bare", whole)
    rows = [Row(f"bare pass: RSS growth {whole} / {half} tokens (2.00: linear)", bare / max(rss_growth("bare", half), 1),
                2.0 * 1.25, "python -m bench.speed_table --rows rss", note=f"bare {bare / 2**20:.0f} MiB at {whole}")]
    for name in size.long_presets:
        grown = rss_growth(name, whole)
        rows.append(Row(f"{name}: RSS growth / the bare pass's at {whole} tokens", grown / max(bare, 1), 1.5,
                        "python -m bench.speed_table --rows rss", note=f"{grown / 2**20:.0f} MiB"))
        rows.append(Row(f"{name}: RSS growth {whole} / {half} tokens (2.00: linear)",
                        grown / max(rss_growth(name, half), 1), 2.0 * 1.25, "python -m bench.speed_table --rows rss"))
    return rows


def generation_rows(size: Size) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["kveval", "run", "configs/generation.yaml", "-o", f"{tmp}/g", "--quiet"]
        for o in size.generation_overrides:
            cmd += ["-s", o]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kveval", *cmd[1:]], cwd=ROOT, check=True, capture_output=True)
        seconds = time.perf_counter() - t0
    return [Row("kveval run configs/generation.yaml, seconds", seconds, 480.0, " ".join(cmd[:3]))]


ROWS: dict[str, Callable[[Size], list[Row]]] = {
    "presets": preset_rows, "scan": scan_rows, "run": run_rows, "decode": decode_rows, "long": long_rows,
    "rss": rss_rows, "generation": generation_rows,
}
DEFAULT_ROWS = ("presets", "scan", "run", "decode", "long", "rss")


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| what | now | goal | met | command | note |", "|---|---:|---:|---|---|---|"]
    for r in rows:
        goal = f"<= {r.goal:g}" if r.at_most else f">= {r.goal:g}"
        lines.append(f"| {r.what} | {r.value:.2f} | {goal} | {'yes' if r.met else 'no'} | `{r.command}` | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"any of {', '.join(ROWS)}")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        _rss_child(args.rss_child[0], int(args.rss_child[1]))
        return []
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown rows {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    size = SIZES[args.size]
    rows: list[Row] = []
    for name in names:
        t0 = time.perf_counter()
        got = ROWS[name](size)
        rows += got
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{args.size} size, {torch.get_num_threads()} threads")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{**r.__dict__, "met": r.met} for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
