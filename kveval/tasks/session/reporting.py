"""The session task's part of the report (:class:`kveval.report.sections.TaskReporting`): summary columns (the
first variant's accuracy, recovery and verdict per policy), the tables ``session`` (one row per policy and
variant: accuracy, recovery, drop with its MDE, verdict, effective depth, depth area, tool-call validity) and
``session_depth`` (accuracy per history-depth bucket), a sentence of the reading, and the "Sessions" section:
accuracy by depth per policy beside the FP curve (a figure), the tables, the survival by turn, and the earliest
failing turns side by side (the FP model's answer and the policy's)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import SummaryColumn, TaskReporting, figure_file, plots_enabled, save_figure
from kveval.report.tables import format_number, is_number
from kveval.results import BASELINE, RunResults
from kveval.results.read import read_records

NAME = "session"
SESSION_COLUMNS = ["run", "policy", "variant", "accuracy", "recovery", "drop", "drop_mde", "verdict",
                   "effective_depth", "depth_area", "tool_parsed", "tool_schema", "tool_exact", "kld_first_turn",
                   "kld_last_turn"]
DEPTH_COLUMNS = ["run", "policy", "variant", "upto", "turns", "accuracy"]


def _runs(metrics: dict) -> list[tuple[str, str, dict]]:
    """(policy, variant, summary) of the baseline (variant ``fp``) and every policy x variant."""
    out = []
    base = (metrics.get(BASELINE) or {}).get(NAME)
    if isinstance(base, dict):
        out.append((BASELINE, "fp", base))
    for name, m in (metrics.get("policies") or {}).items():
        for variant, s in ((m or {}).get(NAME) or {}).items():
            if isinstance(s, dict):
                out.append((name, variant, s))
    return out


def session_tables(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    rows, depth = [], []
    for policy, variant, s in _runs(metrics):
        tool = s.get("tool") or {}
        klds = [k for k in s.get("kld_by_turn") or [] if k is not None]
        rows.append({"run": run_name, "policy": policy, "variant": variant, "accuracy": s.get("accuracy"),
                     "recovery": s.get("recovery"), "drop": s.get("drop"), "drop_mde": s.get("drop_mde"),
                     "verdict": s.get("verdict"), "effective_depth": s.get("effective_depth"),
                     "depth_area": s.get("depth_area"), "tool_parsed": tool.get("parsed"),
                     "tool_schema": tool.get("schema"), "tool_exact": tool.get("exact"),
                     "kld_first_turn": klds[0] if klds else None, "kld_last_turn": klds[-1] if klds else None})
        for b in s.get("by_depth") or []:
            depth.append({"run": run_name, "policy": policy, "variant": variant, **b})
    return {NAME: pd.DataFrame(rows, columns=SESSION_COLUMNS),
            "session_depth": pd.DataFrame(depth, columns=DEPTH_COLUMNS)}


def reading(res: RunResults) -> list[str]:
    df = getattr(res, NAME, pd.DataFrame(columns=SESSION_COLUMNS))
    if df.empty:
        return []
    base = df[df["policy"] == BASELINE]
    parts = [f"{r.policy} ({r.variant}) {100 * r.accuracy:.0f}% ({r.verdict})"
             for r in df[df["policy"] != BASELINE].itertuples() if is_number(r.accuracy)]
    head = f"FP {100 * base['accuracy'].iloc[0]:.0f}%, " if not base.empty and is_number(base["accuracy"].iloc[0]) \
        else ""
    return ["Multi-turn sessions, turns answered correctly with the history in the cache: " + head + ", ".join(parts)
            + " (by history depth and turn: the Sessions section)."]


def _depth_figure(res: RunResults, out: Path, prefix: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = getattr(res, "session_depth", pd.DataFrame(columns=DEPTH_COLUMNS))
    df = df[df["upto"].notna()]
    if df.empty:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (policy, variant), g in df.groupby(["policy", "variant"], sort=False):
        style = dict(color="black", linewidth=2.2) if policy == BASELINE else {}
        ax.plot(g["upto"], 100 * g["accuracy"].astype(float), marker="o", label=f"{policy} ({variant})", **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("history before the turn (tokens, bucket upper edge)")
    ax.set_ylabel("turns correct (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{(res.metrics or {}).get('model', '')}: session accuracy by history depth", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save_figure(fig, out / "plots" / f"{prefix}session_depth.png")


def _examples(res: RunResults, limit: int) -> pd.DataFrame:
    """Per policy and variant, its ``limit`` earliest failing turns (one per session) where the FP model answered
    correctly: both answers side by side."""
    records = read_records(res.path) if getattr(res, "path", None) else []
    fp = {(r["session"], t["turn"]): t for r in records if r.get("task") == NAME and r.get("policy") == BASELINE
          for t in r["turns"]}
    by_run: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r.get("task") != NAME or r.get("policy") == BASELINE:
            continue
        for t in r["turns"]:
            f = fp.get((r["session"], t["turn"]))
            if f and f.get("correct") and not t.get("correct"):
                by_run.setdefault((r["policy"], r["variant"]), []).append(
                    {"policy": r["policy"], "variant": r["variant"], "session": r["session"], "turn": t["turn"],
                     "kind": t.get("kind"), "expected": t.get("expected"),
                     "FP answer": str(f.get("text", ""))[:160], "policy answer": str(t.get("text", ""))[:160]})
                break
    rows = [row for found in by_run.values() for row in sorted(found, key=lambda x: x["turn"])[:limit]]
    return pd.DataFrame(rows)


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    df = getattr(res, NAME, pd.DataFrame(columns=SESSION_COLUMNS))
    if df.empty:
        return []
    blocks = [Block("h", "Sessions", level)]
    if plots_enabled(res, NAME):
        fig = _depth_figure(res, out, figure_file(prefix))
        if fig is not None:
            blocks.append(Block("img", (str(fig.relative_to(out)), "accuracy by history depth"),
                                caption="Turns answered correctly per history-depth bucket (the tokens of history "
                                        "before a turn), the FP model in black."))
    shown = df.drop(columns=["run"]).copy()
    for col in ("accuracy", "depth_area", "tool_parsed", "tool_schema", "tool_exact"):
        shown[col] = [format_number(100 * v, ".1f") if is_number(v) else "" for v in shown[col]]
    for col in ("recovery", "drop", "drop_mde"):
        shown[col] = [format_number(v, ".1f") if is_number(v) else "" for v in shown[col]]
    shown["effective_depth"] = ["" if p == BASELINE else f"{int(v)}" if is_number(v) else "none"
                                for p, v in zip(shown["policy"], shown["effective_depth"])]
    for col in ("kld_first_turn", "kld_last_turn"):
        shown[col] = [format_number(v, ".4f") if is_number(v) else "" for v in shown[col]]
    blocks.append(Block("table", shown, caption="Accuracy, depth area and tool-call validity in %; drop in points "
                                                "(paired on the same turns) with the smallest drop the run detects "
                                                "(MDE); effective depth: the deepest bucket (tokens) up to which every "
                                                "bucket is within max_drop of FP (none: not even the first); "
                                                "KLD along the FP answers (fp_history). tables/session.csv"))
    limit = max((int(p.get("examples", 3)) for p in res.task_params(NAME)), default=3)
    examples = _examples(res, limit)
    if not examples.empty:
        blocks.append(Block("table", examples, caption="Per policy and variant, the earliest turns it failed "
                                                       "where the FP model answered correctly: both answers."))
    return blocks


REPORTING = TaskReporting(
    kind=NAME,
    summary_columns=(SummaryColumn("session_accuracy", table=("session acc", ".3f"),
                                   console=("session acc", ".3f")),),
    tables=session_tables,
    reading=reading,
    section=section,
)
