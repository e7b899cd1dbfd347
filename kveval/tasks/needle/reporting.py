"""The needle task's part of the report (:class:`kveval.report.sections.TaskReporting`): its summary columns
(exact match, answer log-prob and token accuracy per policy), the ``needle`` table (one row per policy, context
length and depth: ``RunResults.needle``, ``tables/needle.csv``), a sentence of the reading, and its section with
the heatmaps (context x depth) it draws from metrics.json's ``needle_cells``:

* ``needle_<policy>.png`` per policy and the baseline (exact match | answer log-prob) and ``needle_<policy>_diff.png``
  per policy (minus the baseline); with several variants in one run the variant is part of the name,
  ``needle_<variant>_<policy>[_diff].png`` (:func:`plot_needle`).

The task computes numbers and never draws; these figures are drawn when the report is written, for a run whose
needle task has ``plots`` true (the default).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import SummaryColumn, TaskReporting, figure_file, plots_enabled, save_figure
from kveval.report.style import label_cells
from kveval.report.tables import is_number
from kveval.results import BASELINE, PLOTS_DIR, RunResults

NAME = "needle"
#: Columns of ``RunResults.needle``
NEEDLE_COLUMNS = ["run", "policy", "context", "depth", "accuracy", "logprob", "token_acc"]


def needle_table(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """``{"needle": one row per (policy, context, depth) of metrics.json's needle_cells}`` (the baseline first)."""
    rows = []
    for pname, m in [(BASELINE, metrics.get(BASELINE) or {}), *(metrics.get("policies") or {}).items()]:
        for cell in (m or {}).get("needle_cells") or []:
            if isinstance(cell, dict):
                rows.append({"run": run_name, "policy": pname, **{c: cell.get(c) for c in NEEDLE_COLUMNS[2:]}})
    return {NAME: pd.DataFrame(rows, columns=NEEDLE_COLUMNS)}


def reading(res: RunResults) -> list[str]:
    """Needle retrieval accuracy per policy, the baseline's first."""
    s = res.summary.set_index("policy")
    if "needle_accuracy" not in s:
        return []
    q = s.drop(index=BASELINE, errors="ignore")
    if not (len(q) and q["needle_accuracy"].notna().any()):
        return []
    base_acc = s.loc[BASELINE, "needle_accuracy"] if BASELINE in s.index else math.nan
    parts = [f"{p} {a:.2f}" for p, a in q["needle_accuracy"].dropna().items()]
    return ["Needle retrieval accuracy: " + (f"baseline {base_acc:.2f}, " if is_number(base_acc) else "")
            + ", ".join(parts) + "."]


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """The heatmaps of the baseline and each policy's difference from it (drawn when the task's ``plots`` is
    true); ``[]`` when the run has no needle cells or draws none."""
    if not plots_enabled(res, NAME):
        return []
    written = plot_needle(res.metrics, out / PLOTS_DIR, prefix)
    shown = [p for p in written if p.stem.endswith("_diff") or p.stem.endswith(f"_{figure_file(BASELINE)}")]
    if not shown:
        return []
    blocks = [Block("h", "Needle in a haystack", level),
              Block("p", "Retrieval by context length (rows) and needle depth (columns): exact match and the answer's "
                         "log-probability per token for the baseline, then each policy minus the baseline (figures "
                         "of each policy alone are beside the report in plots/).")]
    for path in shown:
        what = ("the policy minus the baseline: " if path.stem.endswith("_diff") else "") + "exact match and answer " \
               "log-probability per token, by context length and needle depth"
        blocks.append(Block("img", (path.relative_to(out).as_posix(), path.stem), caption=f"{path.stem}: {what}"))
    return blocks


def _grid(cells: list[dict], variant: str, field: str, contexts: list[int], depths: list[float]) -> np.ndarray:
    """``field`` of the cells of ``variant`` as ``[len(contexts), len(depths)]``, NaN where a cell is missing."""
    grid = np.full((len(contexts), len(depths)), np.nan)
    for c in cells:
        if c["variant"] == variant and c[field] is not None:
            grid[contexts.index(c["context"]), depths.index(c["depth"])] = c[field]
    return grid


def _heatmap(ax, grid: np.ndarray, contexts: list[int], depths: list[float], title: str, cmap: str,
             vmin: float | None, vmax: float | None, fmt: str) -> None:
    im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context (tokens)")
    ax.set_title(title, fontsize=10)
    label_cells(ax, im, grid, fmt)


def plot_needle(metrics: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Heatmaps (context × depth) from metrics.json's ``needle_cells``: per policy and the baseline
    ``needle_<name>.png`` (exact match | answer log-prob), per policy ``needle_<name>_diff.png`` (policy minus
    baseline). With several variants in one run, file names carry the variant: ``needle_<variant>_<name>.png``;
    ``prefix`` starts every file name. Returns the files written (none when no entry has needle cells)."""
    from matplotlib.figure import Figure

    entries = {BASELINE: metrics.get(BASELINE, {}), **metrics.get("policies", {})}
    entries = {n: e for n, e in entries.items() if e.get("needle_cells")}
    if not entries:
        return []
    out_dir = Path(out_dir)
    all_cells = [c for e in entries.values() for c in e["needle_cells"]]
    variants = sorted({c["variant"] for c in all_cells})
    base_cells = entries.get(BASELINE, {}).get("needle_cells", [])
    written = []
    for variant in variants:
        cells_v = [c for c in all_cells if c["variant"] == variant]
        contexts = sorted({c["context"] for c in cells_v})
        depths = sorted({c["depth"] for c in cells_v})
        lps = [c["logprob"] for c in cells_v if c["logprob"] is not None]
        lp_lo, lp_hi = (min(lps), max(lps)) if lps else (None, None)
        stem = prefix + ("needle" if len(variants) == 1 else f"needle_{variant}")
        base_acc = _grid(base_cells, variant, "accuracy", contexts, depths)
        base_lp = _grid(base_cells, variant, "logprob", contexts, depths)
        for name, entry in entries.items():
            acc = _grid(entry["needle_cells"], variant, "accuracy", contexts, depths)
            lp = _grid(entry["needle_cells"], variant, "logprob", contexts, depths)
            fig = Figure(figsize=(11, 0.6 * len(contexts) + 2.6))
            ax1, ax2 = fig.subplots(1, 2)
            _heatmap(ax1, acc, contexts, depths, f"{name}: exact match ({variant})", "RdYlGn", 0, 1, ".2f")
            _heatmap(ax2, lp, contexts, depths, f"{name}: answer log-prob / token", "viridis", lp_lo, lp_hi, ".2f")
            fig.tight_layout()
            written.append(save_figure(fig, out_dir / f"{stem}_{figure_file(name)}.png"))
            if name == BASELINE or not base_cells:
                continue
            d_acc, d_lp = acc - base_acc, lp - base_lp
            lim = float(np.nanmax(np.abs(d_lp))) if np.isfinite(d_lp).any() else 1.0
            fig = Figure(figsize=(11, 0.6 * len(contexts) + 2.6))
            ax1, ax2 = fig.subplots(1, 2)
            _heatmap(ax1, d_acc, contexts, depths, f"{name} - baseline: exact match", "RdBu", -1, 1, "+.2f")
            _heatmap(ax2, d_lp, contexts, depths, f"{name} - baseline: log-prob / token", "RdBu",
                     -max(lim, 1e-6), max(lim, 1e-6), "+.2f")
            fig.tight_layout()
            written.append(save_figure(fig, out_dir / f"{stem}_{figure_file(name)}_diff.png"))
    return written


REPORTING = TaskReporting(
    kind=NAME,
    summary_columns=(SummaryColumn("needle_accuracy", table=("needle acc", ".2f"), console=("needle EM", ".3f")),
                     SummaryColumn("needle_answer_logprob", console=("answer logp/tok", ".3f")),
                     SummaryColumn("needle_token_acc")),
    tables=needle_table,
    reading=reading,
    section=section,
)

__all__ = ["NEEDLE_COLUMNS", "REPORTING", "needle_table", "plot_needle"]
