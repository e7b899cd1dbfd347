"""``kveval report``: Markdown + self-contained HTML + CSV tables + PNG plots, for one run or across runs.

    report_command(["results/int4_g64"])                      # into results/int4_g64/
    report_command(["results/a", "results/b"], out="cmp/")    # one table and one Pareto plot for both runs

The report is built once as a list of blocks (heading, paragraph, list, table, image, code) and rendered twice:
Markdown (images as relative ``plots/*.png`` links) and HTML (images embedded as base64 ``data:`` URIs, the
stylesheet inline, no scripts and no external links: one file that reads offline).
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path

import pandas as pd

from kveval.errors import KvevalError
from kveval.fileio import atomic_write_text
from kveval.report import plots, tables
from kveval.report.task_figures import ruler_figure_name, write_task_figures
from kveval.results import BASELINE, PLOTS_DIR, TABLES_DIR, RunResults, load, lock_folder
from kveval.results.layout import REPORT_FILES

CAPTIONS = {
    "quality_vs_memory": "Quality against memory: one point per policy; dashed: the Pareto front (no other policy "
                         "is both smaller and better); red: the threshold.",
    "policy_quality": "ΔPPL and KL divergence per policy, KLD with its 95% bootstrap interval; green passes the "
                      "threshold, orange (hatched) fails.",
    "by_position": "Damage by token position inside the evaluation window: loss increase over the baseline and "
                   "KLD per position bin.",
    "kld_distribution": "Per-token KL divergence against the baseline: the share of scored tokens per logarithmic "
                        "bin, and the tail of the cumulative distribution (the share of tokens above each KLD) "
                        "with each policy's 99th percentile (dotted): the rare bad tokens a mean hides.",
    "memory": "KV-cache bytes per token, split into codes, scales (+ zero points) and full-precision tokens.",
    "layer_errors": "Relative reconstruction error of keys and values per layer (log scale); policies that "
                    "share a spec for a tensor draw the same line there (one hides the other).",
    "needle_grid": "Needle retrieval accuracy by context length and needle depth, and its difference from the baseline.",
    "sensitivity_grid": "Per-layer sensitivity: KLD when only one layer's keys or values are quantized.",
    "bits_per_layer": "Bits per layer of the mixed-precision policies.",
    "weights_x_kv": "Quantized weights × quantized KV cache: the combined effect against the sum of the two "
                    "single effects (weights alone + KV alone), one point per (weight variant, KV policy), every "
                    "effect against the FP model; above the dashed diagonal the combination is worse than the sum.",
}


@dataclass
class Block:
    kind: str  # "h" | "p" | "ul" | "table" | "img" | "code"
    content: object
    level: int = 2
    caption: str = ""


# ------------------------------------------------------------------------------------------- public API


def report_command(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write ``report.md``, ``report.html``, ``tables/*.csv`` and ``plots/*.png`` for one or several runs.

    ``out`` defaults to the run folder (one run) or ``reports/<YYYY-MM-DD>`` (several). Returns the output folder.
    A missing or corrupt results folder raises :class:`KvevalError` with a one-line message before anything is
    written. One run also gets its tasks' own figures (needle heatmaps, the scan's heatmap and ranking, for the
    tasks whose ``plots`` parameter is true: :func:`kveval.report.task_figures.write_task_figures`).

    The output folder has one owner while the report is written (:func:`kveval.results.lock_folder`: a run still
    writing its folder refuses the report with one line naming it; ``kveval run`` itself already holds it). Every
    file is replaced atomically, never written through a symbolic link, so an interrupted report leaves the
    previous one (or none) and never a half-written file; a folder or file in the way, or one that cannot be
    written, is a one-line :class:`KvevalError`.
    """
    if not run_dirs:
        raise KvevalError("give at least one results folder (results/<run>)")
    runs = [load(d) for d in run_dirs]
    _dedupe_names(runs)
    if out is None:
        out = Path(run_dirs[0]) if len(runs) == 1 else Path("reports") / date.today().isoformat()
    out = Path(out)
    with lock_folder(out, command="kveval report " + " ".join(str(d) for d in run_dirs),
                     hint="give another folder with -o"):
        _check_targets(out)
        try:
            if len(runs) == 1:  # first: the report's RULER section shows (and the HTML embeds) these figures
                write_task_figures(runs[0], out)
            blocks = build(runs, out)
            title = f"kveval report: {', '.join(r.name for r in runs)}"
            atomic_write_text(out / "report.md", to_markdown(blocks))
            atomic_write_text(out / "report.html", to_html(blocks, title, out))
        except OSError as exc:
            raise KvevalError(f"cannot write the report into {out}: {exc.strerror or exc}; make it writable, or "
                              "give another folder with -o") from None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:  # hand-edited run files
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise KvevalError(f"the report of {', '.join(str(d) for d in run_dirs)} failed on its numbers "
                              f"({type(exc).__name__}: {first}); is metrics.json hand-edited? rerun the config to "
                              "rebuild it") from None
    return out


def _check_targets(out: Path) -> None:
    """Refuse (one line) a report folder where a file kveval writes is a folder or a symbolic link, or where
    ``tables`` / ``plots`` is not a plain folder: the report never writes through a link or over a foreign
    object."""
    problems = []
    for name in REPORT_FILES:
        p = out / name
        if p.is_symlink() or (p.exists() and not p.is_file()):
            problems.append(f"{name} is {'a symbolic link' if p.is_symlink() else 'not a file'}")
    for sub, pattern in ((TABLES_DIR, "*.csv"), (PLOTS_DIR, "*.png")):
        d = out / sub
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            problems.append(f"{sub} is {'a symbolic link' if d.is_symlink() else 'not a folder'}")
        elif d.is_dir():
            links = sorted(p.name for p in d.glob(pattern) if p.is_symlink() or not p.is_file())
            if links:
                problems.append(f"{sub}/{links[0]} is a symbolic link or not a file")
    if problems:
        raise KvevalError(f"{out}: {problems[0]}; kveval replaces only its own plain files there: remove it, or "
                          "give another folder with -o")


def write_run_report(run_dir: Path) -> None:
    """What ``kveval run`` calls at the end of every run: the report into the run folder, with the figures of its
    needle and sensitivity tasks (which draw nothing themselves).

    A report that fails is one :class:`KvevalError` line saying so (the command exits non-zero); the run's records
    and metrics are on disk before it is drawn and stay, so ``kveval report RUN_DIR`` redraws it once the cause is
    fixed. An error of another kind is a bug and goes through whole.
    """
    try:
        report_command([run_dir])
    except KvevalError as exc:
        raise KvevalError(f"the report of {run_dir} was not written: {exc} (its records and metrics.json are kept; "
                          f"kveval report {run_dir} draws it again)") from None


# ------------------------------------------------------------------------------------------- content


def _dedupe_names(runs: list[RunResults]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        n = seen.get(r.name, 0)
        seen[r.name] = n + 1
        if n:
            r.name = f"{r.name}-{n + 1}"
            for df in (r.summary, r.positions, r.layers, r.needle, r.ruler, r.sensitivity, r.memory, r.task_entries):
                if "run" in df:
                    df["run"] = r.name


def build(runs: list[RunResults], out: Path) -> list[Block]:
    """The report's blocks; writes the CSVs and PNGs as it goes."""
    csvs = tables.write_csvs(runs, out / "tables")
    blocks: list[Block] = []
    multi = len(runs) > 1
    if multi:
        blocks.append(Block("h", f"kveval report: {len(runs)} runs", 1))
        blocks.append(Block("p", "Runs: " + "; ".join(
            f"{r.name} ({r.metrics.get('model', '?')}, {_corpus(r)}, {r.path})" for r in runs) + "."))
        blocks.append(Block("h", "All policies of all runs", 2))
        blocks.append(Block("table", tables.verdict_table(runs), caption="Every policy of every run"))
        fig = plots.quality_vs_memory(runs)
        if fig is not None:
            blocks.append(_img(fig, out, "all_runs_quality_vs_memory", CAPTIONS["quality_vs_memory"]
                               + " Colour and marker: run.", alt="Quality vs memory, all runs"))
    for r in runs:
        blocks.extend(_run_blocks(r, out, prefix=f"{_slug(r.name)}_" if multi else "", level=2 if multi else 1))
    blocks.append(Block("h", "Tables", 2))
    blocks.append(Block("p", "CSV files beside this report: " + ", ".join(f"tables/{p.name}" for p in csvs.values())
                        + " (one row per policy, per position bin, per layer...; a run column first)."))
    return blocks


def _run_blocks(r: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    b: list[Block] = []
    sub = level + 1
    b.append(Block("h", f"kveval report: {r.name}" if level == 1 else f"Run {r.name}", level))
    b.append(Block("ul", _overview(r)))
    reading = reading_of(r)
    if reading:
        b.append(Block("h", "Reading", sub))
        b.append(Block("ul", reading))
    b.append(Block("h", "Verdicts", sub))
    thr = r.threshold
    crit = [f"ΔPPL ≤ {thr['delta_ppl_pct']:g}%" if thr.get("delta_ppl_pct") is not None else None,
            f"KLD ≤ {thr['kld']:g}" if thr.get("kld") is not None else None]
    crit_s = " and ".join(c for c in crit if c) or "no threshold configured"
    b.append(Block("table", tables.verdict_table(r), caption=f"Policies against the threshold ({crit_s}); MDE: "
                                                             "the smallest ΔPPL the run detects (alpha 0.05, power "
                                                             "0.8); inconclusive: the threshold lies below it and "
                                                             "the measurement within one MDE of the threshold"))
    b.extend(_llama_blocks(r, sub))
    for label in dict.fromkeys(r.task_entries["task"]):
        b.append(Block("h", f"Task {label}: {_task_words(r, str(label))}", sub))
        b.append(Block("table", tables.task_entry_table(r, str(label)),
                       caption=f"The policies under {label} alone, against the same threshold (a later entry of a "
                               "task kind already in the config; the tables above are the first entry's)"))
    b.extend(_weights_blocks(r, out, prefix, sub))
    b.extend(_ruler_blocks(r, out, sub))
    planned = tables.plan_table(r)
    if not planned.empty:
        plan = r.metrics["plan"]
        b.append(Block("h", "Plan: predicted against measured", sub))
        b.append(Block("table", planned, caption=f"kveval plan {plan.get('scan') or ''} --budget {plan.get('budget')} "
                                                 "predicted these; the run measured them"))
    for stem, fn in plots.RUN_PLOTS.items():
        fig = fn(r)
        if fig is None:
            continue
        b.append(Block("h", _plot_title(stem), sub))
        b.append(_img(fig, out, prefix + stem, CAPTIONS.get(stem, ""), alt=_plot_title(stem)))
        if stem == "memory" and not r.memory.empty:
            ctx = int(r.memory["context"].iloc[0])
            b.append(Block("table", tables.memory_table(r), caption=f"Memory bill of one sequence of {ctx} tokens "
                                                                    "(full-precision parts in FP16)"))
        if stem == "layer_errors":
            worst = worst_layers_table(r)
            if not worst.empty:
                b.append(Block("table", worst, caption="Worst layers per policy (largest relative MSE)"))
    b.append(Block("h", "Environment and reproduction", sub))
    b.append(Block("table", _env_table(r), caption="Environment of the run"))
    cmd = reproduce_command(r.env)
    lines = [f"# rerun (results into {r.path})", cmd or "# (the run's command was not recorded)",
             "# rebuild this report", f"kveval report {r.path}"]
    b.append(Block("code", "\n".join(lines)))
    return b


def _llama_blocks(r: RunResults, level: int) -> list[Block]:
    """llama-perplexity's statistics per policy (metrics.json's ``llama_perplexity``), as the tool prints them."""
    entries = {n: (m or {}).get("llama_perplexity") for n, m in ((r.metrics or {}).get("policies") or {}).items()}
    entries = {n: e for n, e in entries.items() if e}
    if not entries:
        return []
    tokens = sorted({int(e.get("tokens") or 0) for e in entries.values()})
    return [Block("h", "llama-perplexity statistics", level),
            Block("p", "The statistics llama.cpp's llama-perplexity --kl-divergence prints, computed as it computes "
                       "them (llama.cpp 0c1e570, tools/perplexity/perplexity.cpp), over every token this run scored "
                       f"({', '.join(f'{t:,}' for t in tokens)}; llama-perplexity itself scores the second half of "
                       "each chunk, so its numbers on the same text cover other tokens: kveval parity llamacpp "
                       "--tool perplexity compares on the tool's tokens), against the exact full-precision "
                       "distribution. ± is llama.cpp's uncertainty (tokens taken as independent); Δp = p(target) "
                       "under the policy minus under the baseline."),
            Block("table", tables.llama_stats_table(entries), caption="llama-perplexity's statistics per policy")]


def _weights_blocks(r: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """The weights x KV section (runs with ``model.weights``): which weights, the interaction table, its figure."""
    wx = tables.weights_table(r)
    if wx.empty:
        return []
    section = (r.metrics.get("weights") or {})
    ref = (section.get("reference") or {}).get("weights") or "the checkpoint's weights"
    items = []
    for vname, v in (section.get("variants") or {}).items():
        info = (v or {}).get("info") or {}
        nb, fp = v.get("weight_bytes"), v.get("weight_bytes_fp16")
        size = f"; weights {_bytes(nb)} instead of {_bytes(fp)} in FP16" if nb and fp else ""
        items.append(f"{vname}: {info.get('describe', '?')} on {', '.join(info.get('modules_quantized') or [])}"
                     f" ({info.get('matrices', '?')} matrices, {int(info.get('params_quantized') or 0):,} of "
                     f"{int(info.get('params_total') or 0):,} parameters, {_g(info.get('bits_per_weight'))} bits "
                     f"per weight with scales{size})" + (f"; {'; '.join(info['notes'])}" if info.get("notes") else ""))
    b = [Block("h", "Weights × KV cache", level),
         Block("p", f"Reference (the FP model): {ref} with a full-precision cache. Every effect below is measured "
                    "against it on the same tokens: W = the quantized weights with a full-precision cache, KV = the "
                    "KV policy on the reference weights, both = the quantized weights with the KV policy. "
                    "'Worse than sum': both > W + KV (* when the 95% bootstrap interval of the excess excludes "
                    "0). Weight variants:"),
         Block("ul", items),
         Block("table", wx, caption="Weights × KV cache (ΔPPL % and KLD against the FP model; max batch at the "
                                    "run's context beside the variant's weights)")]
    fig = plots.weights_x_kv(r)
    if fig is not None:
        b.append(_img(fig, out, prefix + "weights_x_kv", CAPTIONS["weights_x_kv"], alt="Weights x KV cache"))
    return b


def _ruler_reading(r: RunResults) -> list[str]:
    """One sentence on RULER: each entry's score over all samples, a policy's verdict and its worst family."""
    entries = {BASELINE: r.metrics.get(BASELINE) or {}, **(r.metrics.get("policies") or {})}
    parts = []
    for name, m in entries.items():
        if not isinstance(m, dict) or not _ok(m.get("ruler_score")):
            continue
        text = f"{name} {m['ruler_score']:.1f}"
        families = m.get("ruler_families") or {}
        worst = max(((f, v) for f, v in families.items() if isinstance(v, dict) and _ok(v.get("worst_drop"))),
                    key=lambda fv: fv[1]["worst_drop"], default=None)
        if name != BASELINE and m.get("ruler_verdict"):
            text += f" ({m['ruler_verdict']}"
            if worst is not None and worst[1]["worst_drop"] > 0:
                text += f"; {worst[0]} loses {worst[1]['worst_drop']:.1f} points at {worst[1].get('worst_length')} tokens"
            text += ")"
        parts.append(text)
    return ["RULER score (points, all samples): " + ", ".join(parts) + "."] if parts else []


def _ruler_blocks(r: RunResults, out: Path, level: int) -> list[Block]:
    """The RULER section (runs with a ruler task): the family × length table of scores with each policy's change
    and each family's verdict, and the heatmaps that :func:`kveval.report.task_figures.plot_ruler` drew into
    ``plots/`` (those that exist: a report of several runs, or a ruler task with ``plots: false``, has none)."""
    table = tables.ruler_table(r)
    if table.empty:
        return []
    params = (r.task_params("ruler") or [{}])[0]
    max_drop = params.get("max_drop", 5.0)
    b = [Block("h", "RULER (synthetic long context)", level),
         Block("table", table, caption=f"RULER score in points (0-100, greedy generation through the real quantized "
                                       f"cache, RULER's string match), in brackets the change against the baseline; "
                                       f"a family fails when it loses more than {max_drop:g} points at some length")]
    for name in dict.fromkeys(r.ruler["policy"]):
        rel = f"{PLOTS_DIR}/{ruler_figure_name(name)}"
        if (out / rel).is_file():
            b.append(Block("img", (rel, f"RULER {name}"),
                           caption=f"{name}: score, {'change against the baseline, ' if name != BASELINE else ''}"
                                   "answer log-probability per token, by family and length"))
    return b


def _bytes(n) -> str:
    from kveval.units import format_bytes

    return format_bytes(n) if _ok(n) else "?"


def _task_words(r: RunResults, label: str) -> str:
    """Task entry ``label`` (``tasks[1]``) of the run's config in words: ``perplexity (seq_len 16, max_tokens
    128)``, its parameters as the resolved config holds them (the kind alone when the config does not say)."""
    match = re.fullmatch(r"tasks\[(\d+)\]", label)
    entries = r.config.get("tasks") or []
    entry = entries[int(match.group(1))] if match and int(match.group(1)) < len(entries) else None
    named = {k: v for k, v in entry.items() if v is not None} if isinstance(entry, dict) else {}
    if len(named) != 1:  # the resolved config names every task kind, all but one null
        kinds = r.task_entries.loc[r.task_entries["task"] == label, "kind"]
        return str(kinds.iloc[0]) if len(kinds) else "task"
    kind, params = next(iter(named.items()))
    if not isinstance(params, dict) or not params:
        return str(kind)
    return f"{kind} ({', '.join(f'{k} {v}' for k, v in params.items() if v is not None)})"


def reproduce_command(env: dict) -> str | None:
    """The command that made the run, overrides included: ``argv`` with the program shown as ``kveval``
    (else env.json's ``command``)."""
    import shlex

    argv = env.get("argv")
    if isinstance(argv, list) and len(argv) > 1 and Path(str(argv[0])).name in ("kveval", "__main__.py"):
        return "kveval " + shlex.join(str(a) for a in argv[1:])
    return env.get("command")


def _plot_title(stem: str) -> str:
    return {"quality_vs_memory": "Quality vs memory", "policy_quality": "Quality per policy",
            "by_position": "By token position", "kld_distribution": "Per-token KL divergence", "memory": "Memory", "layer_errors": "Per-layer K/V error",
            "needle_grid": "Needle in a haystack", "sensitivity_grid": "Layer × K/V sensitivity",
            "bits_per_layer": "Bits per layer"}.get(stem, stem)


def _img(fig, out: Path, stem: str, caption: str, alt: str = "") -> Block:
    path = plots.save(fig, out / "plots" / f"{stem}.png")
    fig.clear()
    return Block("img", (path.relative_to(out).as_posix(), alt or stem), caption=caption)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _corpus(r: RunResults) -> str:
    data = r.config.get("data") or {}
    if isinstance(data, str):
        return data
    src = data.get("source", "?")
    return f"{src} ({data['split']} split)" if data.get("split") else str(src)


def _overview(r: RunResults) -> list[str]:
    m, base = r.metrics, r.metrics.get(BASELINE) or {}
    items = [f"Model: {m.get('model') or (r.config.get('model') or {}).get('name', '?')}"
             + (f" ({r.config['model'].get('dtype')}, {r.config['model'].get('device')})"
                if isinstance(r.config.get("model"), dict) else ""),
             f"Corpus: {_corpus(r)}"]
    if base.get("tokens") is not None:
        seq = _seq_len(r)
        items.append(f"Tokens evaluated: {int(base['tokens']):,}"
                     + (f" in {base['windows']} windows" if base.get("windows") else "")
                     + (f" of {seq} tokens" if seq else ""))
    if base.get("ppl") is not None:
        items.append(f"Baseline perplexity (full-precision KV): {base['ppl']:.3f}")
    thr = r.threshold
    if thr.get("delta_ppl_pct") is not None or thr.get("kld") is not None:
        parts = [f"ΔPPL ≤ {thr['delta_ppl_pct']:g}%" if thr.get("delta_ppl_pct") is not None else "",
                 f"KLD ≤ {thr['kld']:g}" if thr.get("kld") is not None else ""]
        items.append("Threshold: " + " and ".join(p for p in parts if p))
    mem = r.metrics.get("memory") or {}
    if not r.memory.empty:
        items.append(f"Memory figures at {int(r.memory['context'].iloc[0])} tokens of context"
                     + (f", GPU memory {mem['gpu_memory']}" if mem.get("gpu_memory") else ""))
    items.append("Policies: " + ", ".join(r.policies) + " (specifications in the verdict table)")
    scales = r.env.get("scales") if isinstance(r.env, dict) else None
    for name, source in (scales.items() if isinstance(scales, dict) else ()):
        if isinstance(source, dict) and source.get("describe"):  # env.json's scales: where they came from
            items.append(f"Static scales of {name}: {source['describe']}")
    when = _duration(r.env)
    if when:
        items.append(when)
    return items


def _seq_len(r: RunResults) -> int | None:
    for entry in r.config.get("tasks") or []:
        if isinstance(entry, dict) and isinstance(entry.get("perplexity"), dict):
            return entry["perplexity"].get("seq_len")
    return None


def _duration(env: dict) -> str:
    try:
        s = datetime.fromisoformat(env["started"])
        f = datetime.fromisoformat(env["finished"])
    except (KeyError, TypeError, ValueError):
        return ""
    secs = (f - s).total_seconds()
    return f"Run: {s:%Y-%m-%d %H:%M} UTC, {secs / 60:.1f} min" if secs >= 60 else f"Run: {s:%Y-%m-%d %H:%M} UTC, {secs:.0f} s"


def _env_table(r: RunResults) -> pd.DataFrame:
    keys = ["python", "torch", "transformers", "kveval", "git_commit", "platform", "device", "cuda_device",
            "threads", "started", "finished"]
    rows = [{"field": k, "value": str(r.env[k])} for k in keys if r.env.get(k) is not None]
    if not rows:
        rows = [{"field": "env.json", "value": "not recorded"}]
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------- automatic reading


def _spec_rank(spec) -> float:
    if spec.is_none:
        return 16
    return 8 if spec.format.startswith("fp8") else float(spec.bits or 16)


def kv_pairs(r: RunResults) -> list[tuple[str, str]]:
    """Pairs (low-bit-keys policy, low-bit-values policy) that differ only by swapping the K and V specs
    (e.g. k4v8 and k8v4)."""
    from kveval.policy import KVPolicy
    from kveval.results.read import CONFIG_ERRORS

    pols = {}
    for p in r.policies:
        try:
            pols[p] = KVPolicy.from_config(r.policy_config(p), name=p)
        except CONFIG_ERRORS:  # a policy this kveval cannot read (the run's summary says so): in no pair
            continue
    out = []
    names = list(pols)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = pols[a], pols[b]
            if pa.layers or pb.layers or pa.key == pa.value:
                continue
            same_windows = (pa.residual, pa.residual_mode, pa.sink_tokens, pa.prefill) == (
                pb.residual, pb.residual_mode, pb.sink_tokens, pb.prefill)
            if pa.key == pb.value and pa.value == pb.key and same_windows:
                if _spec_rank(pa.key) < _spec_rank(pa.value):
                    out.append((a, b))
                elif _spec_rank(pb.key) < _spec_rank(pb.value):
                    out.append((b, a))
    return out


def reading_of(r: RunResults) -> list[str]:
    """A few sentences read off the numbers: K vs V sensitivity (only when the run holds K/V-swapped policies),
    the cheapest policy within the threshold, error by position, worst layers, needle and scan highlights."""
    out: list[str] = []
    s = r.summary.set_index("policy")
    from kveval.policy import KVPolicy

    for lowk, lowv in kv_pairs(r):
        if lowk not in s.index or lowv not in s.index:
            continue
        a, b = s.loc[lowk], s.loc[lowv]
        pk = KVPolicy.from_config(r.policy_config(lowk), name=lowk)
        lab_k = f"K{pk.key.bits_label}/V{pk.value.bits_label}"
        lab_v = f"K{pk.value.bits_label}/V{pk.key.bits_label}"
        da, db = a["delta_ppl_pct"], b["delta_ppl_pct"]
        if not (_ok(da) and _ok(db)):
            continue
        overlap = (_ok(a["kld_ci95_lo"]) and _ok(b["kld_ci95_lo"])
                   and a["kld_ci95_lo"] <= b["kld_ci95_hi"] and b["kld_ci95_lo"] <= a["kld_ci95_hi"])
        costs = (f"{lab_k} ({lowk}) costs {da:+.2f}% ΔPPL (KLD {_g(a['kld_mean'])}), "
                 f"{lab_v} ({lowv}) {db:+.2f}% (KLD {_g(b['kld_mean'])})")
        if overlap:
            out.append(f"Keys and values are about equally sensitive on this model (the KLD intervals overlap): "
                       f"{costs}.")
        else:
            which = "Keys are more sensitive than values" if da > db else "Values are more sensitive than keys"
            out.append(f"{which} on this model: {costs}.")
    thr = r.threshold.get("delta_ppl_pct")
    q = s.drop(index=BASELINE, errors="ignore")
    if len(q) and "verdict" in q:
        ok = q[q["verdict"].isin(["pass", "within_noise"])]
        crit = f"ΔPPL ≤ {thr:g}%" if thr is not None else "the threshold"
        cost_col = "bytes_per_token" if q["bytes_per_token"].notna().any() else "bits_per_element"
        if len(ok):
            best = ok.sort_values([cost_col, "delta_ppl_pct"]).index[0]
            row = ok.loc[best]
            mem = _mem_words(row)
            out.append(f"The cheapest policy within {crit}: {best}{mem}, ΔPPL {row['delta_ppl_pct']:+.2f}%"
                       + (f", KLD {_g(row['kld_mean'])}" if _ok(row["kld_mean"]) else "") + ".")
            cheaper = q[(q[cost_col] < row[cost_col]) & ~q.index.isin(ok.index)] if _ok(row[cost_col]) else q.iloc[:0]
            if len(cheaper):
                nxt = cheaper.sort_values(cost_col, ascending=False).index[0]
                out.append(f"The next cheaper policy, {nxt}{_mem_words(cheaper.loc[nxt])}, fails with ΔPPL "
                           f"{cheaper.loc[nxt, 'delta_ppl_pct']:+.2f}%.")
        elif q["delta_ppl_pct"].notna().any():
            best = q["delta_ppl_pct"].idxmin()
            out.append(f"No policy stays within {crit}; the least damaging is {best} "
                       f"(ΔPPL {q.loc[best, 'delta_ppl_pct']:+.2f}%).")
    # error by position, for the most damaging policy
    pos = r.positions[(r.positions["policy"] != BASELINE) & r.positions["kld"].notna()]
    if not pos.empty and len(q) and q["kld_mean"].notna().any():
        worst = q["kld_mean"].idxmax()
        g = pos[pos["policy"] == worst].sort_values("bin")
        if len(g) >= 2 and g["kld"].iloc[0] > 0:
            first, last = g["kld"].iloc[0], g["kld"].iloc[-1]
            ratio = last / first
            trend = "grows" if ratio > 1.25 else "shrinks" if ratio < 0.8 else "stays about flat"
            out.append(f"Along the window, the KLD of {worst} {trend} from {_g(first)} (positions "
                       f"{_span(g.iloc[0])}) to {_g(last)} (positions {_span(g.iloc[-1])}), ×{ratio:.2f}.")
    worst_tab = worst_layers_table(r, n=3)
    if not worst_tab.empty and len(q) and q["delta_ppl_pct"].notna().any():
        worst = q["delta_ppl_pct"].idxmax()
        hit = worst_tab[worst_tab["policy"] == worst]
        if len(hit):
            w = hit.iloc[0]
            out.append(f"Worst layers under {worst} (the most damaging policy): keys {w['worst key layers']}, "
                       f"values {w['worst value layers']} (relative MSE averaged over layers: keys "
                       f"{w['mean key rel MSE']}, values {w['mean value rel MSE']}; the table below lists every "
                       "policy).")
    if len(q) and q["needle_accuracy"].notna().any():
        base_acc = s.loc[BASELINE, "needle_accuracy"] if BASELINE in s.index else math.nan
        parts = [f"{p} {a:.2f}" for p, a in q["needle_accuracy"].dropna().items()]
        out.append("Needle retrieval accuracy: " + (f"baseline {base_acc:.2f}, " if _ok(base_acc) else "")
                   + ", ".join(parts) + ".")
    out.extend(_weights_reading(r))
    out.extend(_ruler_reading(r))
    if not r.sensitivity.empty and r.sensitivity["kld"].notna().any():
        sc = r.sensitivity.dropna(subset=["kld"]).sort_values("kld", ascending=False)
        top = [f"layer {int(c['layer'])} {c['tensor']}s ({c['spec']}, KLD {_g(c['kld'])})" for _, c in
               sc.head(3).iterrows()]
        means = sc.groupby("tensor")["kld"].mean()
        kv = ""
        if {"key", "value"} <= set(means.index):
            kv = (f"; averaged over layers, quantizing keys costs {_g(means['key'])} KLD and values "
                  f"{_g(means['value'])}")
        out.append("Most sensitive in the scan: " + "; ".join(top) + kv + ".")
    return out


def _weights_reading(r: RunResults) -> list[str]:
    """One sentence per weight variant: its effect alone, and for how many KV policies the combination's KLD is
    worse than the sum of the two single effects (significantly: the 95% interval of the excess above 0)."""
    df = tables.weights_frame(r)
    out = []
    for vname, g in df.groupby("weights", sort=False):
        alone = g[g["policy"] == BASELINE]
        pairs = g[(g["policy"] != BASELINE) & g["kld_excess"].notna()]
        if alone.empty or pairs.empty:
            continue
        a = alone.iloc[0]
        worse = pairs[pairs["kld_worse_than_sum"] == True]  # noqa: E712 - an object column of bools
        sure = worse[worse["kld_interaction"] == "superadditive"]
        top = pairs.loc[pairs["kld_excess"].astype(float).idxmax()]
        out.append(f"Weights {vname} alone cost ΔPPL {a['delta_ppl_pct']:+.2f}% (KLD {_g(a['kld_mean'])}); with a "
                   f"quantized cache the KLD is worse than the sum of the two effects for {len(worse)} of "
                   f"{len(pairs)} policies ({len(sure)} beyond the 95% interval); the largest excess is "
                   f"{top['policy']}'s, {float(top['kld_excess']):+.3g} ({_g(top['kld_sum'])} expected, "
                   f"{_g(top['kld_mean'])} measured).")
    return out


def worst_layers_table(r: RunResults, n: int = 3) -> pd.DataFrame:
    """Per policy: the ``n`` layers with the largest key and value relative MSE, and the means."""
    lay = r.layers
    rows = []
    if lay.empty or "key_rel_mse" not in lay or "value_rel_mse" not in lay:
        return pd.DataFrame()
    for p, g in lay.groupby("policy", sort=False):
        k = g.nlargest(n, "key_rel_mse")
        v = g.nlargest(n, "value_rel_mse")
        rows.append({
            "policy": p,
            "worst key layers": ", ".join(str(int(x)) for x in k["layer"]),
            "key rel MSE": ", ".join(_g(x) for x in k["key_rel_mse"]),
            "worst value layers": ", ".join(str(int(x)) for x in v["layer"]),
            "value rel MSE": ", ".join(_g(x) for x in v["value_rel_mse"]),
            "mean key rel MSE": _g(g["key_rel_mse"].mean()),
            "mean value rel MSE": _g(g["value_rel_mse"].mean()),
        })
    return pd.DataFrame(rows)


def _mem_words(row) -> str:
    parts = []
    if _ok(row.get("bits_per_element")):
        parts.append(f"{row['bits_per_element']:.2f} bits/element")
    if _ok(row.get("compression_vs_fp16")):
        parts.append(f"{row['compression_vs_fp16']:.2f}× smaller than FP16")
    return f" ({', '.join(parts)})" if parts else ""


def _span(row) -> str:
    return f"{int(row['start'])}-{int(row['end'])}" if _ok(row["start"]) and _ok(row["end"]) else f"bin {row['bin']}"


def _ok(v) -> bool:
    try:
        return v is not None and not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def _g(v) -> str:
    return f"{float(v):.3g}" if _ok(v) else "n/a"


# ------------------------------------------------------------------------------------------- rendering


def _line(text: object) -> str:
    """``text`` on one line (line breaks as spaces): a run or policy name with a newline cannot start a heading,
    a list item or a table row of its own in report.md."""
    return " ".join(str(text).splitlines())


def _fence(code: str) -> str:
    """A code fence longer than any run of backticks in ``code`` (a path holding ````` cannot close it)."""
    longest = max((len(m) for m in re.findall(r"`+", code)), default=0)
    return "`" * max(3, longest + 1)


def to_markdown(blocks: list[Block]) -> str:
    """report.md from the blocks; names and other text from the run files are kept to their cell, line or item
    (tables: :func:`kveval.report.tables.md_cell`; headings, paragraphs, list items, captions: one line)."""
    out = []
    for b in blocks:
        if b.kind == "h":
            out.append("#" * b.level + " " + _line(b.content))
        elif b.kind == "p":
            out.append(_line(b.content))
        elif b.kind == "ul":
            out.append("\n".join(f"- {_line(item)}" for item in b.content))
        elif b.kind == "table":
            out.append((f"*{_line(b.caption)}*\n\n" if b.caption else "") + tables.to_markdown(b.content))
        elif b.kind == "img":
            src, alt = b.content
            out.append(f"![{_line(alt)}]({src})" + (f"\n\n*{_line(b.caption)}*" if b.caption else ""))
        elif b.kind == "code":
            fence = _fence(str(b.content))
            out.append(f"{fence}bash\n" + str(b.content) + f"\n{fence}")
    return "\n\n".join(out) + "\n"


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1150px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #0072B2; padding-bottom: .2em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .15em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: 0.9em; }
caption { caption-side: top; text-align: left; font-style: italic; padding-bottom: .3em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.pass { background: #d9f2e6; font-weight: 600; }
td.fail { background: #fbe0d2; font-weight: 600; }
td.within_noise { background: #dcecf7; font-weight: 600; }
td.inconclusive { background: #fdf3c8; font-weight: 600; }
figure { margin: 1em 0 1.6em; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-size: .9em; color: #444; }
pre { background: #f6f6f6; padding: .7em; overflow-x: auto; }
@media print { body { max-width: none; } figure { break-inside: avoid; } }
"""


def to_html(blocks: list[Block], title: str, out: Path) -> str:
    """One self-contained HTML file: inline stylesheet, PNGs as base64 data URIs, no scripts, no links."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style></head><body>"]
    for b in blocks:
        if b.kind == "h":
            parts.append(f"<h{b.level}>{html.escape(str(b.content))}</h{b.level}>")
        elif b.kind == "p":
            parts.append(f"<p>{html.escape(str(b.content))}</p>")
        elif b.kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{html.escape(str(i))}</li>" for i in b.content) + "</ul>")
        elif b.kind == "table":
            parts.append(tables.to_html(b.content, b.caption or None))
        elif b.kind == "img":
            src, alt = b.content
            data = base64.b64encode((out / src).read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(alt)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{html.escape(b.caption)}</figcaption>'
                         "</figure>")
        elif b.kind == "code":
            parts.append(f"<pre><code>{html.escape(str(b.content))}</code></pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


__all__ = ["report_command", "write_run_report", "build", "reading_of", "kv_pairs", "worst_layers_table",
           "to_markdown", "to_html"]
