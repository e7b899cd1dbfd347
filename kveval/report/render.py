"""The report's content: one run or several as a list of blocks (:func:`build`), which ``kveval report``
(:mod:`kveval.commands.report`) renders twice, as Markdown and as self-contained HTML
(:mod:`kveval.report.document`). The sections every run has are built here; each task adds its own through its
reporting plug-in (:mod:`kveval.report.sections`), and "Reading" is :mod:`kveval.report.reading`.
"""

from __future__ import annotations

import re
import shlex
from datetime import datetime
from pathlib import Path

import pandas as pd

from kveval.report import plots, tables
from kveval.report.document import Block, to_html, to_markdown
from kveval.report.reading import reading_of, worst_layers_table
from kveval.report.sections import task_reporting
from kveval.report.tables import format_general as _g
from kveval.report.tables import is_number as _ok
from kveval.results import BASELINE, RunResults

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
    "bits_per_layer": "Bits per layer of the mixed-precision policies.",
    "weights_x_kv": "Quantized weights × quantized KV cache: the combined effect against the sum of the two "
                    "single effects (weights alone + KV alone), one point per (weight variant, KV policy), every "
                    "effect against the FP model; above the dashed diagonal the combination is worse than the sum.",
}


# ------------------------------------------------------------------------------------------- content


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
        blocks.extend(_machine_blocks(runs))
    for r in runs:
        blocks.extend(_run_blocks(r, out, prefix=f"{_slug(r.name)}_" if multi else "", level=2 if multi else 1))
    blocks.append(Block("h", "Tables", 2))
    blocks.append(Block("p", "CSV files beside this report: " + ", ".join(f"tables/{p.name}" for p in csvs.values())
                        + " (one row per policy, per position bin, per layer...; a run column first)."))
    return blocks


def _machine_blocks(runs: list[RunResults]) -> list[Block]:
    """Runs of the same inputs (:func:`kveval.report.machines.same_inputs`), each against the first of them: what
    their machines were and which differences the runs resolve (:mod:`kveval.report.machines`)."""
    from kveval.report import machines

    b: list[Block] = []
    for i, first in enumerate(runs):
        if any(machines.same_inputs(earlier, first) for earlier in runs[:i]):
            continue  # compared against an earlier run already
        twins = [r for r in runs[i + 1:] if machines.same_inputs(first, r)]
        for other in twins:
            rows = machines.difference_rows(first, other)
            if not rows:
                continue
            beyond = [f"{r['policy']} {r['metric']}" for r in rows if r["within"] == "no"]
            b.append(Block("h", f"Same config: {first.name} and {other.name}", 2))
            b.append(Block("p", f"{first.name} and {other.name} ran the same config on the same tokens. A difference "
                                "is within noise when it is at most what the runs resolve (1.96 x the root sum of "
                                "squares of their standard uncertainties) or their path noise floor, whichever is "
                                "larger. " + (f"Beyond it: {', '.join(beyond)} (a machine-dependent result: "
                                              "docs/findings.md)." if beyond else
                                              "Every difference is within noise.")))
            b.append(Block("table", pd.DataFrame(machines.machine_rows([first, other])),
                           caption="The machines (env.json)"))
            b.append(Block("table", pd.DataFrame(rows), caption="Differences (second minus first)"))
    return b


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
    dctx, _ = tables.deployment_memory(r)
    where = (f"; max batch: sequences of {dctx:,} tokens that fit next to the weights on "
             f"{(r.metrics.get('memory') or {}).get('gpu_memory', 'the configured GPU')}" if dctx else "")
    b.append(Block("table", tables.glance_table(r), caption=f"Policies against the threshold ({crit_s}); MDE: "
                                                            "the smallest ΔPPL the run detects (alpha 0.05, power "
                                                            "0.8); inconclusive: the threshold lies below it and "
                                                            f"the measurement within one MDE of the threshold{where}. "
                                                            "Every column: the appendix"))
    for label in dict.fromkeys(r.task_entries["task"]):
        b.append(Block("h", f"Task {label}: {_task_words(r, str(label))}", sub))
        b.append(Block("table", tables.task_entry_table(r, str(label)),
                       caption=f"The policies under {label} alone, against the same threshold (a later entry of a "
                               "task kind already in the config; the tables above are the first entry's)"))
    b.extend(_weights_blocks(r, out, prefix, sub))
    for plugin in task_reporting().values():  # each task's own section and figures (kveval.report.sections)
        if plugin.section is not None:
            b.extend(plugin.section(r, out, prefix, sub))
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
            dctx, _ = tables.deployment_memory(r)
            also = f"; the last two columns at {dctx:,} tokens, the deployment context" if dctx and dctx != ctx else ""
            b.append(Block("table", tables.memory_table(r), caption=f"Memory bill of one sequence of {ctx:,} tokens "
                                                                    f"(full-precision parts in FP16){also}"))
        if stem == "layer_errors":
            worst = worst_layers_table(r)
            if not worst.empty:
                b.append(Block("table", worst, caption="Worst layers per policy (largest relative MSE)"))
    b.append(Block("h", "Appendix: every column", sub))
    b.append(Block("table", tables.verdict_table(r), caption="Every per-policy number of the run (tables/summary.csv "
                                                             "holds them unformatted)"))
    b.extend(_llama_blocks(r, sub))
    b.append(Block("h", "Environment and reproduction", sub))
    b.append(Block("table", _env_table(r), caption="Environment of the run"))
    cmd = reproduce_command(r.env)
    lines = [f"# rerun (results into {r.path})", cmd or "# (the run's command was not recorded)",
             "# rebuild this report", shlex.join(["kveval", "report", str(r.path)])]
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
    argv = env.get("argv")
    if isinstance(argv, list) and len(argv) > 1 and Path(str(argv[0])).name in ("kveval", "__main__.py"):
        return "kveval " + shlex.join(str(a) for a in argv[1:])
    return env.get("command")


def _plot_title(stem: str) -> str:
    return {"quality_vs_memory": "Quality vs memory", "policy_quality": "Quality per policy",
            "by_position": "By token position", "kld_distribution": "Per-token KL divergence", "memory": "Memory",
            "layer_errors": "Per-layer K/V error", "bits_per_layer": "Bits per layer"}.get(stem, stem)


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
        run_ctx = int(r.memory["context"].iloc[0])
        dctx, _ = tables.deployment_memory(r)
        items.append(f"Memory figures at {run_ctx:,} tokens of context (the run's)"
                     + (f" and {dctx:,} (the deployment's: memory.context, else the model's limit)"
                        if dctx and dctx != run_ctx else "")
                     + (f", GPU memory {mem['gpu_memory']}" if mem.get("gpu_memory") else ""))
    items.append("Policies: " + ", ".join(r.policies) + " (specifications in the appendix)")
    scales = r.env.get("scales") if isinstance(r.env, dict) else None
    for name, source in (scales.items() if isinstance(scales, dict) else ()):
        if isinstance(source, dict) and source.get("describe"):  # env.json's scales: where they came from
            items.append(f"Static scales of {name}: {source['describe']}")
    when = _duration(r.env)
    if when:
        items.append(when)
    return items


def _seq_len(r: RunResults) -> int | None:
    """The window length of the first task entry that scores windows (``seq_len``), for the overview's line on
    tokens evaluated."""
    for entry in r.config.get("tasks") or []:
        for params in (entry.values() if isinstance(entry, dict) else ()):
            if isinstance(params, dict) and params.get("seq_len") is not None:
                return params["seq_len"]
    return None


def _minutes(secs: float) -> str:
    return f"{secs / 60:.1f} min" if secs >= 60 else f"{secs:.0f} s"


def _duration(env: dict) -> str:
    """``Run: 2026-12-07 12:00 UTC, 7.1 min``; a resumed run states all its parts' time from its first start."""
    try:
        s = datetime.fromisoformat(env["started"])
        f = datetime.fromisoformat(env["finished"])
    except (KeyError, TypeError, ValueError):
        return ""
    this = (f - s).total_seconds()
    parts, total = env.get("parts"), env.get("seconds")
    if isinstance(parts, int) and parts > 1 and isinstance(total, (int, float)) and total >= this:
        try:
            first = datetime.fromisoformat(env["first_started"])
        except (KeyError, TypeError, ValueError):
            first = s
        return f"Run: {first:%Y-%m-%d %H:%M} UTC, {_minutes(total)} in {parts} parts (the last, resumed: {_minutes(this)})"
    return f"Run: {s:%Y-%m-%d %H:%M} UTC, {_minutes(this)}"


def _env_table(r: RunResults) -> pd.DataFrame:
    keys = ["python", "torch", "transformers", "kveval", "git_commit", "platform", "device", "cuda_device",
            "threads", "started", "finished"]
    rows = [{"field": k, "value": str(r.env[k])} for k in keys if r.env.get(k) is not None]
    if not rows:
        rows = [{"field": "env.json", "value": "not recorded"}]
    return pd.DataFrame(rows)


__all__ = ["build", "reading_of", "worst_layers_table", "to_markdown", "to_html", "Block"]
