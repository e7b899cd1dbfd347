"""The closing console tables of ``kveval run``: one row per policy against the threshold, and the weights x KV
interaction table (rich Tables, from a run's metrics).

    console.print(summary_table(metrics, cfg))
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from kveval.report.sections import summary_columns
from kveval.results import BASELINE


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)



def part_for_summary(metrics: dict, part: dict) -> dict:
    """A later task entry's metrics (``metrics["tasks"][label]``) in the shape :func:`summary_table` reads, with
    the run's memory fields (bits per element) beside them."""
    def with_memory(entry: dict, top: dict) -> dict:
        return {**{k: v for k, v in top.items() if k == "bits_per_element"}, **entry}

    top_policies = metrics.get("policies") or {}
    return {"model": metrics.get("model"), BASELINE: with_memory(part.get(BASELINE) or {}, metrics.get(BASELINE) or {}),
            "policies": {n: with_memory(m or {}, top_policies.get(n) or {})
                         for n, m in (part.get("policies") or {}).items()}}



#: perplexity columns left empty on the baseline's row (all but bits/elem and PPL)
_BLANK = 6


def summary_table(metrics: dict, cfg: Any, label: str | None = None) -> RenderableType:
    """The closing console table: one row per policy against the threshold; perplexity columns when the run
    measured perplexity (with llama-perplexity's 99% KLD and same top p, and the minimum detectable ΔPPL beside
    the verdict), the tasks' own columns when measured (their plug-ins' ``SummaryColumn.console``); then, when the policies have them, the table of
    llama-perplexity's statistics (:func:`llama_table`). ``label``: the task entry the metrics are of, in the
    title (a later entry of a kind already in the config, ``tasks[1] (perplexity)``)."""
    thr = cfg.threshold
    base = metrics.get(BASELINE, {})
    rows = [(BASELINE, base), *metrics.get("policies", {}).items()]
    has_ppl = any(m.get("ppl") is not None for _, m in rows)
    task_cols = [c for c in summary_columns()  # the tasks' own columns (their reporting plug-ins), when measured
                 if c.console is not None and any(m.get(c.key) is not None for _, m in rows)]
    judged = has_ppl or not task_cols  # the verdict (and its threshold) is perplexity's
    title = f"{cfg.name}{' ' + label if label else ''}: {metrics['model']}"
    if judged:
        title += f", threshold ΔPPL <= {thr.delta_ppl_pct}%" + (f", KLD <= {thr.kld}" if thr.kld is not None else "")
    if any(m.get("delta_ppl_pct_mde") is not None for m in (metrics.get("policies") or {}).values()):
        title += "; MDE: the smallest ΔPPL % this run detects (alpha 0.05, power 0.8)"
    cols = [("bits/elem", lambda m: _fmt(m.get("bits_per_element"), ".2f"))]
    if judged:
        cols += [
            ("PPL", lambda m: _fmt(m.get("ppl"), ".4f")),
            ("ΔPPL %", lambda m: _fmt(m.get("delta_ppl_pct"), "+.3f")),
            ("KLD", lambda m: _fmt(m.get("kld_mean"), ".3g")),
            ("KLD CI95", lambda m: "-" if not m.get("kld_ci95") else f"[{m['kld_ci95'][0]:.3g}, {m['kld_ci95'][1]:.3g}]"),
            ("KLD 99%", lambda m: _fmt(_llama(m).get("kld_p99"), ".3g")),
            ("same top p %", lambda m: _same_top(m)),
            ("MDE %", lambda m: _fmt(m.get("delta_ppl_pct_mde"), ".2f")),
        ]
    for c in task_cols:
        header, spec = c.console or ("", "")
        cols.append((header, lambda m, key=c.key, spec=spec: _fmt(m.get(key), spec)))
    table = Table(title=title, title_justify="left")
    table.add_column("policy", justify="left", no_wrap=True)
    for name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True)
    if judged:
        table.add_column("verdict", justify="left", no_wrap=True)
    for name, m in rows:
        verdict = "" if name == BASELINE or not judged else m.get("verdict", "-")
        style = {"pass": "green", "fail": "red"}.get(verdict, "yellow")
        cells = [fn(m) for _, fn in cols]
        if name == BASELINE and has_ppl:
            cells[2:2 + _BLANK] = [""] * _BLANK
        if verdict == "inconclusive" and m.get("more_tokens_to_decide") is not None:
            verdict += f" +{m['more_tokens_to_decide']:,} tok"
        table.add_row(name, *cells, *([f"[{style}]{verdict}[/]" if verdict else ""] if judged else []))
    extra = llama_table(metrics, cfg, label)
    return table if extra is None else Group(table, extra)


def _llama(m: dict) -> dict:
    return m.get("llama_perplexity") or {}


def _same_top(m: dict) -> str:
    """llama-perplexity's same top p with its uncertainty (percent); the top-1 agreement of an older run (no
    ``llama_perplexity``) in percent, without one."""
    if _llama(m).get("same_top_p_pct") is not None:
        return _pm(_llama(m), "same_top_p_pct", ".2f")
    return _fmt(None if m.get("top1_agree") is None else 100 * m["top1_agree"], ".2f")


def _pm(stats: dict, key: str, spec: str, unc_spec: str | None = None) -> str:
    """``value ± uncertainty`` of a llama-perplexity statistic, ``-`` when absent."""
    v, u = stats.get(key), stats.get(f"{key}_unc")
    if v is None:
        return "-"
    return format(v, spec) + ("" if u is None else f" ± {format(u, unc_spec or spec)}")


def llama_table(metrics: dict, cfg: Any, label: str | None = None) -> Table | None:
    """The headline statistics of llama-perplexity per policy (metrics.json's ``llama_perplexity``; computed as
    llama.cpp computes them, over the tokens this run scored), or None when no policy has them."""
    rows = [(n, _llama(m or {})) for n, m in (metrics.get("policies") or {}).items()]
    rows = [(n, lp) for n, lp in rows if lp]
    if not rows:
        return None
    from rich import box

    table = Table(title=f"{cfg.name}{' ' + label if label else ''}: llama-perplexity statistics (as llama.cpp "
                        "computes them, over the tokens scored here)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    cols = [("tokens", lambda lp: _fmt(lp.get("tokens"), ",d")),
            ("ln(PPL_Q/PPL_base)", lambda lp: _pm(lp, "ln_ppl_ratio", ".3g", ".2g")),
            ("mean KLD", lambda lp: _pm(lp, "kld_mean", ".3g", ".2g")),
            ("median", lambda lp: _fmt(lp.get("kld_median"), ".3g")),
            ("99%", lambda lp: _fmt(lp.get("kld_p99"), ".3g")),
            ("99.9%", lambda lp: _fmt(lp.get("kld_p99_9"), ".3g")),
            ("max KLD", lambda lp: _fmt(lp.get("kld_max"), ".3g")),
            ("mean Δp %", lambda lp: _pm(lp, "delta_p_mean_pct", ".3f")),
            ("RMS Δp %", lambda lp: _pm(lp, "delta_p_rms_pct", ".3f"))]
    table.add_column("policy", justify="left", no_wrap=True)
    for c, _ in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for name, lp in rows:
        table.add_row(name, *[fn(lp) for _, fn in cols])
    return table



def _yes_no(flag, interaction: str | None) -> str:
    """``yes`` / ``no`` for "worse than the sum", with ``*`` when the bootstrap interval of the excess excludes 0."""
    if flag is None:
        return "-"
    sure = interaction in ("superadditive", "subadditive")
    return ("yes" if flag else "no") + ("*" if sure else "")



def weights_interaction_table(metrics: dict, cfg: Any) -> Table:
    """The weights x KV interaction table: per weight variant, its effect alone (KV ``fp16``) and, per policy, the
    weight effect alone (W), the KV effect on the checkpoint's weights (KV), the combined effect (both), their
    sum and whether the combination is worse than the sum (``*``: the 95% interval of the excess excludes 0);
    every effect against the FP model (checkpoint weights, full-precision cache)."""
    from rich import box

    table = Table(title=f"{cfg.name}: weights x KV cache against the FP model; worse: both > W + KV (*: the 95% "
                        "interval of the excess excludes 0)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    cols = ["weights", "KV", "ΔPPL% W", "ΔPPL% KV", "ΔPPL% both", "W + KV", "worse",
            "KLD W", "KLD KV", "KLD both", "W + KV", "worse"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("weights", "KV") else "right", no_wrap=True)
    for vname, v in metrics["weights"]["variants"].items():
        alone = v.get("alone") or {}
        table.add_row(vname, "fp16", _fmt(alone.get("delta_ppl_pct"), "+.3f"), "", "", "", "",
                      _fmt(alone.get("kld_mean"), ".3g"), "", "", "", "")
        for pname, m in (v.get("policies") or {}).items():
            table.add_row(
                vname, pname,
                _fmt(m.get("weights_delta_ppl_pct"), "+.3f"), _fmt(m.get("kv_delta_ppl_pct"), "+.3f"),
                _fmt(m.get("delta_ppl_pct"), "+.3f"), _fmt(m.get("delta_ppl_pct_sum"), "+.3f"),
                _yes_no(m.get("delta_ppl_worse_than_sum"), m.get("delta_ppl_interaction")),
                _fmt(m.get("weights_kld_mean"), ".3g"), _fmt(m.get("kv_kld_mean"), ".3g"),
                _fmt(m.get("kld_mean"), ".3g"), _fmt(m.get("kld_sum"), ".3g"),
                _yes_no(m.get("kld_worse_than_sum"), m.get("kld_interaction")),
            )
    return table
