"""The lm_eval task's part of the report (:class:`kveval.report.sections.TaskReporting`): its summary column
(``lm_eval_mean``: the mean of the primary metric of the tasks the config names, per policy), the ``lm_eval``
table (one row per policy, lm-eval task and metric: ``RunResults.lm_eval``, ``tables/lm_eval.csv``), a sentence of
the reading, and its section: each task's primary metric per policy with its standard error, and each policy's
change against the FP baseline with the smallest change the task's samples detect (MDE)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import SummaryColumn, TaskReporting
from kveval.report.tables import format_number, is_number
from kveval.results import BASELINE, RunResults

NAME = "lm_eval"
#: Columns of ``RunResults.lm_eval``
LM_EVAL_COLUMNS = ["run", "policy", "task", "metric", "value", "stderr", "delta", "delta_mde", "n"]


def _entries(metrics: dict) -> list[tuple[str, dict]]:
    rows = [(BASELINE, metrics.get(BASELINE) or {}), *(metrics.get("policies") or {}).items()]
    return [(n, (m or {}).get("lm_eval") or {}) for n, m in rows if isinstance((m or {}).get("lm_eval"), dict)]


def lm_eval_table(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """``{"lm_eval": one row per (policy, task, metric)}`` of metrics.json's ``lm_eval`` (the baseline first)."""
    rows = []
    for pname, entry in _entries(metrics):
        for task, ms in entry.items():
            if not isinstance(ms, dict):
                continue
            for key, value in ms.items():
                if key in ("n", "layers_quantized") or "_stderr" in key or key.startswith("delta_"):
                    continue
                metric, _, flt = key.partition(",")
                rows.append({"run": run_name, "policy": pname, "task": task, "metric": key, "value": value,
                             "stderr": ms.get(f"{metric}_stderr" + (f",{flt}" if flt else "")),
                             "delta": ms.get(f"delta_{key}"), "delta_mde": ms.get(f"delta_{key}_mde"),
                             "n": ms.get("n")})
    return {NAME: pd.DataFrame(rows, columns=LM_EVAL_COLUMNS)}


def _primary_rows(res: RunResults) -> pd.DataFrame:
    """The rows of each task's primary metric (its first, as lm-eval reports it)."""
    from kveval.tasks.lm_eval.task import primary_metric

    df = getattr(res, NAME, pd.DataFrame(columns=LM_EVAL_COLUMNS))
    if df.empty:
        return df
    keep = []
    for pname, entry in _entries(res.metrics or {}):
        for task, ms in entry.items():
            p = primary_metric(ms) if isinstance(ms, dict) else None
            if p is not None:
                keep.append((pname, task, p[0]))
    index = pd.MultiIndex.from_frame(df[["policy", "task", "metric"]])
    return df[index.isin(keep)]


def reading(res: RunResults) -> list[str]:
    """The mean of the tasks' primary metrics per policy against the baseline's."""
    s = res.summary.set_index("policy")
    if "lm_eval_mean" not in s or not s["lm_eval_mean"].notna().any():
        return []
    base = s["lm_eval_mean"].get(BASELINE)
    parts = [f"{p} {v:.3f}" + (f" ({v - base:+.3f})" if is_number(base) else "")
             for p, v in s["lm_eval_mean"].drop(index=BASELINE, errors="ignore").dropna().items()]
    return ["lm-eval, the mean of each task's primary metric: " + (f"baseline {base:.3f}, " if is_number(base) else "")
            + ", ".join(parts) + " (per task, with standard errors and MDEs: the lm-eval section)."]


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """Each task's primary metric: one row per (task, metric), a column per policy (value ± stderr; the policies'
    Δ against the baseline with its MDE); ``[]`` when the run has no lm-eval results."""
    rows = _primary_rows(res)
    if rows.empty:
        return []
    table = []
    for (task, metric), group in rows.groupby(["task", "metric"], sort=False):
        row = {"task": task, "metric": metric}
        for _, r in group.iterrows():
            cell = format_number(r["value"], ".3f") + (f" ± {format_number(r['stderr'], '.3f')}"
                                                      if is_number(r["stderr"]) else "")
            if r["policy"] != BASELINE and is_number(r["delta"]):
                cell += f" (Δ {float(r['delta']):+.3f}" + (f", MDE {float(r['delta_mde']):.3f}"
                                                           if is_number(r["delta_mde"]) else "") + ")"
            row[str(r["policy"])] = cell
        table.append(row)
    return [Block("h", "lm-eval", level),
            Block("table", pd.DataFrame(table),
                  caption="Each task's primary metric (its first, as lm-eval reports it) ± lm-eval's standard error; "
                          "Δ: against the FP baseline; MDE: the smallest change these samples detect (alpha 0.05, "
                          "power 0.8). Every metric: tables/lm_eval.csv")]


REPORTING = TaskReporting(
    kind=NAME,
    summary_columns=(SummaryColumn("lm_eval_mean", table=("lm-eval mean", ".3f"), console=("lm-eval mean", ".3f")),),
    tables=lm_eval_table,
    reading=reading,
    section=section,
)
