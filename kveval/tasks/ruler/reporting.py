"""The RULER task's part of the report (:class:`kveval.report.sections.TaskReporting`): the ``ruler`` table (one
row per policy, family and length: ``RunResults.ruler``, ``tables/ruler.csv``), a sentence of the reading, and
its section: the family × length table of scores with each policy's change and each family's verdict, and the
heatmaps it draws from metrics.json's ``ruler_cells``, one ``ruler_<policy>.png`` per policy and the baseline
(:func:`plot_ruler`; drawn when the report is written, for a run whose ruler task has ``plots`` true, the
default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import TaskReporting, figure_file, plots_enabled, save_figure
from kveval.report.style import label_cells
from kveval.report.tables import format_number, has_value, is_number
from kveval.results import BASELINE, PLOTS_DIR, RunResults

NAME = "ruler"
#: Columns of ``RunResults.ruler``: one row per (policy, family, length) of metrics.json's ``ruler_cells``, with
#: the family's verdict (``pass`` | ``fail``; empty for the baseline).
RULER_COLUMNS = ["run", "policy", "family", "length", "samples", "score", "drop", "logprob", "logprob_delta",
                 "verdict"]


def ruler_frame(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """``{"ruler": one row per (policy, family, length)}``, the baseline first."""
    rows = []
    for pname, m in [(BASELINE, metrics.get(BASELINE) or {}), *(metrics.get("policies") or {}).items()]:
        families = (m or {}).get("ruler_families") or {}
        for cell in (m or {}).get("ruler_cells") or []:
            if isinstance(cell, dict):
                verdict = (families.get(cell.get("family")) or {}).get("verdict") if isinstance(families, dict) else None
                rows.append({"run": run_name, "policy": pname, **{c: cell.get(c) for c in RULER_COLUMNS[2:-1]},
                             "verdict": verdict or ""})
    return {NAME: pd.DataFrame(rows, columns=RULER_COLUMNS)}


def ruler_table(res: RunResults) -> pd.DataFrame:
    """RULER per family × length (rows) and policy (columns, the baseline first): the score in points (0..100)
    over the cell's samples, a policy's change against the baseline in brackets (negative: points lost), and each
    family's verdict on its first row. Empty when the run has no ruler task."""
    df = res.tables.get(NAME)
    if df is None or df.empty:
        return pd.DataFrame()
    names = list(dict.fromkeys(df["policy"]))
    rows = []
    for (family, length), cell in df.groupby(["family", "length"], sort=False):
        row = {"family": family, "length": int(length), "samples": int(cell["samples"].max())}
        for name in names:
            hit = cell[cell["policy"] == name]
            if not len(hit):
                row[name] = ""
                continue
            h = hit.iloc[0]
            row[name] = format_number(h["score"], ".1f") + (
                "" if name == BASELINE or not has_value(h["drop"])
                else f" ({format_number(-float(h['drop']) + 0.0, '+.1f')})")
        rows.append(row)
    out = pd.DataFrame(rows)
    verdicts = df[df["policy"] != BASELINE].groupby(["family", "policy"], sort=False)["verdict"].first()
    for name in names[1:] if names and names[0] == BASELINE else names:
        out[f"{name} verdict"] = [_family_verdict(res, name, f, verdicts.get((f, name), ""))
                                  if i == 0 or out["family"].iloc[i - 1] != f else ""
                                  for i, f in enumerate(out["family"])]
    return out


def _family_verdict(res: RunResults, policy: str, family: str, verdict) -> str:
    """A family's verdict with the minimum detectable drop at its worst length (score points) and, when
    inconclusive, how many more samples per cell would decide it (metrics.json's ``ruler_families`` and
    ``ruler_cells``; the verdict alone for a run that has none)."""
    m = ((res.metrics or {}).get("policies") or {}).get(policy) or {}
    fam = (m.get("ruler_families") or {}).get(family) or {}
    cell = next((c for c in m.get("ruler_cells") or [] if c.get("family") == family
                 and c.get("length") == fam.get("worst_length")), {})
    text = str(verdict or "")
    extra = []
    if has_value(cell.get("drop_mde")):
        extra.append(f"MDE {float(cell['drop_mde']):.1f}")
    if text == "inconclusive" and has_value(fam.get("more_samples_to_decide")):
        extra.append(f"+{int(fam['more_samples_to_decide']):,} samples")
    return text + (f" ({', '.join(extra)})" if text and extra else "")


def reading(res: RunResults) -> list[str]:
    """One sentence on RULER: each entry's score over all samples, a policy's verdict and its worst family."""
    entries = {BASELINE: res.metrics.get(BASELINE) or {}, **(res.metrics.get("policies") or {})}
    parts = []
    for name, m in entries.items():
        if not isinstance(m, dict) or not is_number(m.get("ruler_score")):
            continue
        text = f"{name} {m['ruler_score']:.1f}"
        families = m.get("ruler_families") if isinstance(m.get("ruler_families"), dict) else {}
        worst = max(((f, v) for f, v in families.items() if isinstance(v, dict) and is_number(v.get("worst_drop"))),
                    key=lambda fv: fv[1]["worst_drop"], default=None)
        if name != BASELINE and m.get("ruler_verdict"):
            text += f" ({m['ruler_verdict']}"
            if worst is not None and worst[1]["worst_drop"] > 0:
                text += f"; {worst[0]} loses {worst[1]['worst_drop']:.1f} points at {worst[1].get('worst_length')} tokens"
            text += ")"
        parts.append(text)
    return ["RULER score (points, all samples): " + ", ".join(parts) + "."] if parts else []


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """The RULER section: the family × length table, then the heatmaps (when the task's ``plots`` is true)."""
    table = ruler_table(res)
    if table.empty:
        return []
    params = (res.task_params(NAME) or [{}])[0]
    max_drop = params.get("max_drop", 5.0)
    b = [Block("h", "RULER (synthetic long context)", level),
         Block("table", table, caption=f"RULER score in points (0-100, greedy generation through the real quantized "
                                       f"cache, RULER's string match), in brackets the change against the baseline; "
                                       f"a family fails when it loses more than {max_drop:g} points at some length")]
    written = plot_ruler(res.metrics, out / PLOTS_DIR, prefix) if plots_enabled(res, NAME) else []
    for path in written:
        name = path.stem.removeprefix(f"{prefix}ruler_")
        b.append(Block("img", (path.relative_to(out).as_posix(), f"RULER {name}"),
                       caption=f"{name}: score, {'change against the baseline, ' if name != BASELINE else ''}"
                               "answer log-probability per token, by family and length"))
    return b


def _ruler_panel(ax, cells: Sequence[dict], field: str, families: list[str], lengths: list[int], title: str,
                 cmap: str, vmin: float | None, vmax: float | None, fmt: str) -> np.ndarray:
    """One family × length heatmap of ``field`` of metrics.json's ``ruler_cells`` (blank where a cell is missing);
    returns the grid ``[len(families), len(lengths)]``."""
    grid = np.full((len(families), len(lengths)), np.nan)
    for c in cells:
        if c.get(field) is not None and c["family"] in families and c["length"] in lengths:
            grid[families.index(c["family"]), lengths.index(c["length"])] = c[field]
    im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(families)), families, fontsize=8)
    ax.set_xlabel("length (tokens)")
    ax.set_title(title, fontsize=10)
    label_cells(ax, im, grid, fmt)
    return grid


def ruler_figure_name(name: str) -> str:
    """The file name of ``name``'s RULER heatmaps in ``plots/`` (``ruler_<name>.png``)."""
    return f"ruler_{figure_file(name)}.png"


def plot_ruler(metrics: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Heatmaps (family × length) from metrics.json's ``ruler_cells``, one ``ruler_<name>.png`` (``prefix``
    first) per policy and the baseline: RULER score (0..100) and answer log-prob per token; a policy's figure adds
    its drop against the baseline in score points (red: lost), with each family's verdict beside its name.
    Returns the files written (none when no entry has ruler cells)."""
    from matplotlib.figure import Figure

    entries = {BASELINE: metrics.get(BASELINE, {}), **metrics.get("policies", {})}
    entries = {n: e for n, e in entries.items() if e.get("ruler_cells")}
    if not entries:
        return []
    out_dir = Path(out_dir)
    all_cells = [c for e in entries.values() for c in e["ruler_cells"]]
    families = list(dict.fromkeys(c["family"] for c in all_cells))
    lengths = sorted({c["length"] for c in all_cells})
    lps = [c["logprob"] for c in all_cells if c.get("logprob") is not None]
    lp_lo, lp_hi = (min(lps), max(lps)) if lps else (None, None)
    written = []
    for name, entry in entries.items():
        cells = entry["ruler_cells"]
        policy = name != BASELINE
        fig = Figure(figsize=(5.0 + (4.2 if policy else 0.0) + 0.9 * len(lengths), 0.42 * len(families) + 2.2))
        axes = fig.subplots(1, 3 if policy else 2)
        _ruler_panel(axes[0], cells, "score", families, lengths, f"{name}: RULER score", "RdYlGn", 0, 100, ".0f")
        if policy:
            verdicts = entry.get("ruler_families") or {}
            drops = [c["drop"] for c in cells if c.get("drop") is not None]
            lim = max([abs(d) for d in drops] + [1.0])
            _ruler_panel(axes[1], cells, "drop", families, lengths,
                         f"drop vs baseline (points; fail > {entry.get('ruler_max_drop', '?')})", "RdBu_r", -lim, lim,
                         "+.0f")
            axes[1].set_yticks(range(len(families)),
                               [f"{f} ({(verdicts.get(f) or {}).get('verdict') or '-'})" for f in families], fontsize=8)
        _ruler_panel(axes[-1], cells, "logprob", families, lengths, f"{name}: answer log-prob / token", "viridis",
                     lp_lo, lp_hi, ".2f")
        fig.tight_layout()
        written.append(save_figure(fig, out_dir / (prefix + ruler_figure_name(name))))
    return written


REPORTING = TaskReporting(kind=NAME, tables=ruler_frame, reading=reading, section=section)

__all__ = ["REPORTING", "RULER_COLUMNS", "plot_ruler", "ruler_figure_name", "ruler_frame", "ruler_table"]
