"""The sensitivity scan's part of the report (:class:`kveval.report.sections.TaskReporting`): the
``sensitivity`` table (one row per scanned cell: layer, tensor, spec, KLD, ΔPPL %: ``RunResults.sensitivity``,
``tables/sensitivity.csv``), a sentence of the reading, and its section with the figures it draws from
metrics.json's ``sensitivity`` section (its ``cells`` and ``specs``):

* ``sensitivity_heatmap.png``: layers (rows) x spec and K/V (columns), log10 mean KLD (:func:`plot_sensitivity`);
* ``sensitivity_ranked.png``: per spec, the most sensitive (layer, tensor) cells.

The scan computes numbers and never draws; these figures are drawn when the report is written, for a run whose
scan has ``plots`` true (the default).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kveval.report.blocks import Block
from kveval.report.sections import TaskReporting, plots_enabled, save_figure
from kveval.report.tables import format_general
from kveval.results import PLOTS_DIR, RunResults

NAME = "sensitivity"
#: Columns of ``RunResults.sensitivity``
SENSITIVITY_COLUMNS = ["run", "layer", "tensor", "spec", "kld", "delta_ppl_pct"]
TENSORS = ("key", "value")  # the scan's column order within a spec


def sensitivity_table(run_name: str, metrics: dict) -> dict[str, pd.DataFrame]:
    """``{"sensitivity": the scan's cells}`` (metrics.json's ``sensitivity.cells``)."""
    cells = (metrics.get(NAME) or {}).get("cells") or []
    rows = [{"run": run_name, **{c: cell.get(c) for c in SENSITIVITY_COLUMNS[1:]}} for cell in cells
            if isinstance(cell, dict)]
    return {NAME: pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)}


def reading(res: RunResults) -> list[str]:
    """The three most sensitive cells, and keys against values averaged over layers."""
    scan = res.tables.get(NAME)
    if scan is None or scan.empty or not scan["kld"].notna().any():
        return []
    sc = scan.dropna(subset=["kld"]).sort_values("kld", ascending=False)
    top = [f"layer {int(c['layer'])} {c['tensor']}s ({c['spec']}, KLD {format_general(c['kld'])})"
           for _, c in sc.head(3).iterrows()]
    means = sc.groupby("tensor")["kld"].mean()
    kv = ""
    if {"key", "value"} <= set(means.index):
        kv = (f"; averaged over layers, quantizing keys costs {format_general(means['key'])} KLD and values "
              f"{format_general(means['value'])}")
    return ["Most sensitive in the scan: " + "; ".join(top) + kv + "."]


def section(res: RunResults, out: Path, prefix: str, level: int) -> list[Block]:
    """The scan's heatmap and ranking (drawn when the scan's ``plots`` is true); ``[]`` without scan cells."""
    if not plots_enabled(res, NAME):
        return []
    written = plot_sensitivity(res.metrics, out / PLOTS_DIR, prefix)
    if not written:
        return []
    heatmap, ranked = written
    return [Block("h", "Layer × K/V sensitivity", level),
            Block("img", (heatmap.relative_to(out).as_posix(), "Layer × K/V sensitivity"),
                  caption="Per-layer sensitivity: the mean KLD against the baseline when only one layer's keys or "
                          "values are quantized (log scale)."),
            Block("img", (ranked.relative_to(out).as_posix(), "Most sensitive layers"),
                  caption="Per spec, the most sensitive (layer, tensor) cells (red: keys, blue: values).")]


def _cell_table(cells: Sequence[dict], specs: Sequence[str], num_layers: int) -> np.ndarray:
    """KLD per (layer, spec × tensor): ``[num_layers, 2 * len(specs)]``, NaN where a cell was not scanned."""
    grid = np.full((num_layers, len(specs) * 2), np.nan)
    for c in cells:
        col = list(specs).index(c["spec"]) * 2 + TENSORS.index(c["tensor"])
        grid[c["layer"], col] = c["kld"]
    return grid


def sensitivity_heatmap_figure(cells: Sequence[dict], specs: Sequence[str], num_layers: int):
    """Layers (rows) x spec and K/V (columns), colour = log10 mean KLD against the baseline (a Figure)."""
    from matplotlib.figure import Figure

    grid = _cell_table(cells, specs, num_layers)
    fig = Figure(figsize=(2.0 + 1.3 * grid.shape[1], 1.0 + 0.22 * num_layers))
    ax = fig.subplots()
    shown = np.log10(np.clip(grid, 1e-8, None))
    im = ax.imshow(shown, aspect="auto", cmap="magma_r", interpolation="nearest")
    ax.set_xticks(range(grid.shape[1]), [f"{s}\n{t[0].upper()}" for s in specs for t in TENSORS], fontsize=8)
    ax.set_yticks(range(num_layers), [str(i) for i in range(num_layers)], fontsize=7)
    ax.set_ylabel("layer")
    ax.set_title("Per-layer sensitivity: KLD vs FP (one tensor quantized)", fontsize=9)
    fig.colorbar(im, ax=ax, label="log10 mean KLD")
    fig.tight_layout()
    return fig


def sensitivity_ranked_figure(cells: Sequence[dict], specs: Sequence[str], top: int = 40):
    """Per spec, the ``top`` most sensitive (layer, tensor) cells as bars, keys and values in two colours."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.8 * len(specs)))
    axes = fig.subplots(len(specs), 1, squeeze=False)
    colours = {"key": "tab:red", "value": "tab:blue"}
    for ax, spec in zip(axes[:, 0], specs):
        ranked = sorted((c for c in cells if c["spec"] == spec), key=lambda c: -c["kld"])[:top]
        ax.bar(range(len(ranked)), [max(c["kld"], 1e-12) for c in ranked],
               color=[colours[c["tensor"]] for c in ranked])
        ax.set_xticks(range(len(ranked)), [f"{c['layer']}{c['tensor'][0].upper()}" for c in ranked],
                      rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("mean KLD")
        ax.set_title(f"{spec}: most sensitive layers (red K, blue V)", fontsize=9)
    fig.tight_layout()
    return fig


def _num_layers(metrics: dict, cells: Sequence[dict]) -> int:
    """The model's layer count (``memory.arch.layers``), else one more than the deepest scanned layer."""
    layers = ((metrics.get("memory") or {}).get("arch") or {}).get("layers")
    return layers if isinstance(layers, int) and layers > 0 else max(c["layer"] for c in cells) + 1


def plot_sensitivity(metrics: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """``sensitivity_heatmap.png`` and ``sensitivity_ranked.png`` (``prefix`` first) from metrics.json's
    ``sensitivity`` section (its ``cells`` and ``specs``); none when the scan has no cells. Returns the files
    written."""
    s = metrics.get(NAME) or {}
    cells, specs = s.get("cells") or [], s.get("specs") or []
    if not cells:
        return []
    out_dir = Path(out_dir)
    heatmap = save_figure(sensitivity_heatmap_figure(cells, specs, _num_layers(metrics, cells)),
                          out_dir / f"{prefix}sensitivity_heatmap.png")
    ranked = save_figure(sensitivity_ranked_figure(cells, specs), out_dir / f"{prefix}sensitivity_ranked.png")
    return [heatmap, ranked]


REPORTING = TaskReporting(kind=NAME, tables=sensitivity_table, reading=reading, section=section)

__all__ = ["REPORTING", "SENSITIVITY_COLUMNS", "plot_sensitivity", "sensitivity_heatmap_figure",
           "sensitivity_ranked_figure", "sensitivity_table"]
