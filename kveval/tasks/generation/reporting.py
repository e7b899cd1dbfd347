"""The generation task's part of the report (:class:`kveval.report.sections.TaskReporting`): its summary columns
(median divergence step, mean KLD along the policy's trajectory, greedy accuracy), its tables
(``generation``: one row per policy; ``generation_survival`` and ``generation_kld``: the curves, long format), a
sentence of the reading, and its section: the table, the survival curves (``generation_survival.png``), the KLD
by decode step along the policy's and the FP model's trajectory (``generation_kld.png``), and the earliest
departures side by side.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import SummaryColumn, TaskReporting, plots_enabled, save_figure
from kveval.report.style import policy_styles
from kveval.report.tables import format_general, format_number, has_value
from kveval.results import BASELINE, PLOTS_DIR, RunResults
from kveval.tasks.generation.params import NAME

#: Columns of ``RunResults.generation``
GENERATION_COLUMNS = [
    "run", "policy", "gen_divergence_median", "gen_divergence_median_lo", "gen_divergence_median_hi",
    "gen_diverged", "gen_kld_mean", "gen_kld_fp_mean", "gen_kld_slope", "gen_kld_fp_slope", "gen_similarity",
    "gen_length_mean", "gen_eos_rate", "gen_repeat_4gram", "gen_accuracy", "gen_pass1", "gen_pass_at_k",
    "gen_accuracy_drop", "gen_accuracy_mde", "gen_verdict",
]
SURVIVAL_COLUMNS = ["run", "policy", "step", "survival"]
KLD_COLUMNS = ["run", "policy", "trajectory", "start", "end", "kld", "count"]


def _entries(metrics: dict) -> list[tuple[str, dict]]:
    return [(n, m) for n, m in [(BASELINE, metrics.get(BASELINE) or {}), *(metrics.get("policies") or {}).items()]
            if isinstance(m, dict) and any(k.startswith("gen_") for k in m)]


def generation_tables(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """The ``generation``, ``generation_survival`` and ``generation_kld`` tables of one run."""
    rows, surv, kld = [], [], []
    for name, m in _entries(metrics):
        ci = m.get("gen_divergence_median_ci95") or [None, None]
        rows.append({"run": run_name, "policy": name, **{c: m.get(c) for c in GENERATION_COLUMNS[2:]},
                     "gen_divergence_median_lo": ci[0], "gen_divergence_median_hi": ci[1],
                     "gen_kld_slope": (m.get("gen_kld") or {}).get("slope"),
                     "gen_kld_fp_slope": (m.get("gen_kld_fp") or {}).get("slope")})
        s = m.get("gen_survival") or {}
        surv += [{"run": run_name, "policy": name, "step": t, "survival": v}
                 for t, v in zip(s.get("steps") or [], s.get("survival") or [])]
        for path, key in (("policy", "gen_kld"), ("fp", "gen_kld_fp")):
            curve = m.get(key) or {}
            edges = curve.get("edges") or []
            for i, (mean, count) in enumerate(zip(curve.get("mean") or [], curve.get("count") or [])):
                if i + 1 < len(edges):
                    kld.append({"run": run_name, "policy": name, "trajectory": path, "start": edges[i],
                                "end": edges[i + 1], "kld": mean, "count": count})
    return {NAME: pd.DataFrame(rows, columns=GENERATION_COLUMNS),
            f"{NAME}_survival": pd.DataFrame(surv, columns=SURVIVAL_COLUMNS),
            f"{NAME}_kld": pd.DataFrame(kld, columns=KLD_COLUMNS)}


def reading(res: RunResults) -> list[str]:
    """Per policy: the median step where its greedy output departs from the FP model's, and how the KLD grows."""
    table = res.tables.get(NAME)
    if table is None or table.empty:
        return []
    parts = []
    for _, r in table[table["policy"] != BASELINE].iterrows():
        median = (f"departs at step {r['gen_divergence_median']:.0f} (median)" if has_value(r["gen_divergence_median"])
                  else "stays identical for most prompts")
        slope = r["gen_kld_slope"]
        parts.append(f"{r['policy']} {median}, KLD {format_general(r['gen_kld_mean'])}"
                     + (f" ({float(slope):+.3g} per 1,000 steps)" if has_value(slope) else ""))
    return ["Long generations through the quantized cache: " + "; ".join(parts) + "."] if parts else []


def _table(res: RunResults) -> pd.DataFrame:
    df = res.tables[NAME]
    shown = []
    for _, r in df.iterrows():
        base = r["policy"] == BASELINE
        ci = (f" [{format_number(r['gen_divergence_median_lo'], '.0f')}, "
              f"{format_number(r['gen_divergence_median_hi'], '.0f')}]" if has_value(r["gen_divergence_median_lo"])
              else "")
        shown.append({
            "policy": r["policy"],
            "median departure (step)": "" if base else (format_number(r["gen_divergence_median"], ".0f") or "none") + ci,
            "departed": "" if base else format_number(r["gen_diverged"], ".0%"),
            "KLD (own path)": "" if base else format_general(r["gen_kld_mean"]),
            "KLD (FP path)": "" if base else format_general(r["gen_kld_fp_mean"]),
            "similarity": "" if base else format_number(r["gen_similarity"], ".2f"),
            "length": format_number(r["gen_length_mean"], ".0f"),
            "EOS": format_number(r["gen_eos_rate"], ".0%"),
            "repeated 4-grams": format_number(r["gen_repeat_4gram"], ".1%"),
            "accuracy %": format_number(r["gen_accuracy"], ".1f"),
            "pass@1 %": format_number(r["gen_pass1"], ".1f"),
            "pass@k %": format_number(r["gen_pass_at_k"], ".1f"),
            "drop (MDE)": "" if base or not has_value(r["gen_accuracy_drop"]) else
            f"{float(r['gen_accuracy_drop']):+.1f} ({format_number(r['gen_accuracy_mde'], '.1f')})",
            "verdict": "" if base or not isinstance(r["gen_verdict"], str) else r["gen_verdict"],
        })
    out = pd.DataFrame(shown)
    return out[[c for c in out.columns if c in ("policy",) or (out[c] != "").any()]]


def _curves(res: RunResults, out: Path, prefix: str) -> list[Path]:
    """The survival curves and the KLD-by-step curves, one figure each."""
    from matplotlib.figure import Figure

    surv, kld = res.tables[f"{NAME}_survival"], res.tables[f"{NAME}_kld"]
    style = policy_styles([BASELINE, *res.policies])
    written = []
    if not surv.empty:
        fig = Figure(figsize=(8, 4.2), layout="constrained")
        ax = fig.subplots()
        for name, g in surv.groupby("policy", sort=False):
            c, m = style.get(str(name), ("#333333", "o"))
            ax.step([0, *g["step"]], [1.0, *g["survival"]], where="post", color=c, label=str(name))
        ax.axhline(0.5, color="#888888", lw=0.8, ls="--")
        ax.set_xlabel("decode step")
        ax.set_ylabel("share of prompts still identical to FP")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
        ax.set_title(f"{res.metrics.get('model', '')}: greedy output identical to the FP model's (Kaplan-Meier)",
                     fontsize=9)
        written.append(save_figure(fig, out / PLOTS_DIR / f"{prefix}{NAME}_survival.png"))
    if not kld.empty:
        fig = Figure(figsize=(8, 4.2), layout="constrained")
        ax = fig.subplots()
        for (name, path), g in kld.groupby(["policy", "trajectory"], sort=False):
            c, m = style.get(str(name), ("#333333", "o"))
            centres = (g["start"] + g["end"]) / 2
            ax.plot(centres, g["kld"], color=c, marker=m, ls="-" if path == "policy" else ":",
                    label=f"{name} ({'own path' if path == 'policy' else 'FP path'})")
        ax.set_xlabel("decode step")
        ax.set_ylabel("mean KL(P_FP || P_policy) (nats)")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.legend(fontsize=7)
        ax.set_title(f"{res.metrics.get('model', '')}: KLD by decode step (solid: the policy's own tokens; "
                     "dotted: the FP model's)", fontsize=9)
        written.append(save_figure(fig, out / PLOTS_DIR / f"{prefix}{NAME}_kld.png"))
    return written


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """The table, the curves (when the task's ``plots`` is true) and the earliest departures."""
    table = res.tables.get(NAME)
    if table is None or table.empty:
        return []
    blocks = [Block("h", "Long generations", level),
              Block("table", _table(res), caption="Greedy generations through the real quantized cache against "
                                                  "the FP model's: the median decode step where the output departs "
                                                  "(95% interval), KLD per step along the policy's own tokens and "
                                                  "along the FP model's, output length, EOS rate, repeated 4-grams, "
                                                  "accuracy on the prompts with an answer")]
    if plots_enabled(res, NAME):
        for path in _curves(res, out, prefix):
            blocks.append(Block("img", (path.relative_to(out).as_posix(), path.stem),
                                caption="Share of prompts whose greedy output is still the FP model's, by decode step"
                                if path.stem.endswith("survival") else
                                "Mean KLD per decode-step bin: the cache's error on the policy's own path (solid) "
                                "and on the FP model's path (dotted)"))
    for name, m in ((res.metrics.get("policies") or {}).items()):
        examples = (m or {}).get("gen_examples") or []
        if examples:
            blocks.append(Block("p", f"{name}: the earliest departures (FP text | policy text, from the step where "
                                     "they part)"))
            blocks.append(Block("table", pd.DataFrame([{"prompt": e.get("prompt"), "step": e.get("step"),
                                                         "FP": e.get("fp"), "policy": e.get("policy")}
                                                        for e in examples])))
    return blocks


REPORTING = TaskReporting(
    kind=NAME,
    summary_columns=(SummaryColumn("gen_divergence_median", table=("departs at", ".0f"), console=("departs at", ".0f")),
                     SummaryColumn("gen_kld_mean", table=("gen KLD", ".3g"), console=("gen KLD", ".3g")),
                     SummaryColumn("gen_accuracy", table=("gen acc %", ".1f"), console=("gen acc %", ".1f"))),
    tables=generation_tables,
    reading=reading,
    section=section,
)

__all__ = ["GENERATION_COLUMNS", "REPORTING", "generation_tables"]
