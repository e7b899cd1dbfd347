"""The figures of the needle and sensitivity tasks, drawn from their metrics (metrics.json), beside the report.

Tasks compute numbers and never draw; the report draws these files into ``plots/`` when it reports one run
(``kveval run`` does so at the end of every run), for each task of the run's config whose ``plots`` parameter is
true (the default):

* needle: ``needle_<policy>.png`` per policy and the baseline (exact match | answer log-prob, context × depth) and
  ``needle_<policy>_diff.png`` per policy (minus the baseline); with several variants in one run the variant is
  part of the name, ``needle_<variant>_<policy>[_diff].png`` (:func:`plot_needle`);
* sensitivity: ``sensitivity_heatmap.png`` (layers × spec and K/V, log10 KLD) and ``sensitivity_ranked.png`` (the
  most sensitive cells per spec) (:func:`plot_sensitivity`).

matplotlib's Agg canvas without pyplot (no global backend change); PNGs at 110 dpi in matplotlib's own colours (no
palette), written atomically through :func:`kveval.report.plots.save` (an interrupted report leaves the previous
figure or none, never a truncated file).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from kveval.report.plots import save
from kveval.results import BASELINE, PLOTS_DIR, RunResults

DPI = 110
TENSORS = ("key", "value")  # the scan's column order within a spec


def write_task_figures(res: RunResults, out: str | Path) -> list[Path]:
    """The task figures of one run into ``out/plots/``: needle heatmaps when a needle task of the run's config
    has ``plots`` true (the default), the scan's heatmap and ranking when a sensitivity task does, RULER's family
    x length heatmaps when a ruler task does. Returns the
    files written (none for a run without those tasks)."""
    plots_dir = Path(out) / PLOTS_DIR
    written: list[Path] = []
    if any(p.get("plots", True) for p in res.task_params("needle")):
        written += plot_needle(res.metrics, plots_dir)
    if any(p.get("plots", True) for p in res.task_params("sensitivity")):
        written += plot_sensitivity(res.metrics, plots_dir)
    if any(p.get("plots", True) for p in res.task_params("ruler")):
        written += plot_ruler(res.metrics, plots_dir)
    return written


# ------------------------------------------------------------------------------------------- needle


def _grid(cells: list[dict], variant: str, field: str, contexts: list[int], depths: list[float]) -> np.ndarray:
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
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=8)
    ax.figure.colorbar(im, ax=ax)


def _save(fig: Figure, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, atomically (:func:`kveval.report.plots.save`, without the palette)."""
    return save(fig, path, dpi=DPI, palette=False)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def plot_needle(metrics: dict, out_dir: str | Path) -> list[Path]:
    """Heatmaps (context × depth) from metrics.json's ``needle_cells``: per policy and the baseline
    ``needle_<name>.png`` (exact match | answer log-prob), per policy ``needle_<name>_diff.png`` (policy minus
    baseline). With several variants in one run, file names carry the variant: ``needle_<variant>_<name>.png``.
    Returns the files written (none when no entry has needle cells)."""
    entries = {BASELINE: metrics.get(BASELINE, {}), **metrics.get("policies", {})}
    entries = {n: e for n, e in entries.items() if e.get("needle_cells")}
    if not entries:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
        stem = "needle" if len(variants) == 1 else f"needle_{variant}"
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
            written.append(_save(fig, out_dir / f"{stem}_{_safe(name)}.png"))
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
            written.append(_save(fig, out_dir / f"{stem}_{_safe(name)}_diff.png"))
    return written


# ------------------------------------------------------------------------------------------- sensitivity


def _cell_table(cells: Sequence[dict], specs: Sequence[str], num_layers: int) -> np.ndarray:
    """KLD per (layer, spec × tensor): ``[num_layers, 2 * len(specs)]``, NaN where a cell was not scanned."""
    grid = np.full((num_layers, len(specs) * 2), np.nan)
    for c in cells:
        col = list(specs).index(c["spec"]) * 2 + TENSORS.index(c["tensor"])
        grid[c["layer"], col] = c["kld"]
    return grid


def sensitivity_heatmap_figure(cells: Sequence[dict], specs: Sequence[str], num_layers: int) -> Figure:
    """Layers (rows) x spec and K/V (columns), colour = log10 mean KLD against the baseline."""
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


def sensitivity_ranked_figure(cells: Sequence[dict], specs: Sequence[str], top: int = 40) -> Figure:
    """Per spec, the ``top`` most sensitive (layer, tensor) cells as bars, keys and values in two colours."""
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


def plot_sensitivity(metrics: dict, out_dir: str | Path) -> list[Path]:
    """``sensitivity_heatmap.png`` and ``sensitivity_ranked.png`` from metrics.json's ``sensitivity`` section
    (its ``cells`` and ``specs``); none when the scan has no cells. Returns the files written."""
    s = metrics.get("sensitivity") or {}
    cells, specs = s.get("cells") or [], s.get("specs") or []
    if not cells:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    heatmap = _save(sensitivity_heatmap_figure(cells, specs, _num_layers(metrics, cells)),
                    out_dir / "sensitivity_heatmap.png")
    ranked = _save(sensitivity_ranked_figure(cells, specs), out_dir / "sensitivity_ranked.png")
    return [heatmap, ranked]


__all__ = ["write_task_figures", "plot_needle", "plot_sensitivity", "sensitivity_heatmap_figure",
           "sensitivity_ranked_figure"]


# ------------------------------------------------------------------------------------------- ruler


def _ruler_panel(ax, cells: Sequence[dict], field: str, families: list[str], lengths: list[int], title: str,
                 cmap: str, vmin: float | None, vmax: float | None, fmt: str) -> np.ndarray:
    """One family × length heatmap of ``field`` of metrics.json's ``ruler_cells`` (blank where a cell is missing);
    returns the grid."""
    grid = np.full((len(families), len(lengths)), np.nan)
    for c in cells:
        if c.get(field) is not None and c["family"] in families and c["length"] in lengths:
            grid[families.index(c["family"]), lengths.index(c["length"])] = c[field]
    im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(families)), families, fontsize=8)
    ax.set_xlabel("length (tokens)")
    ax.set_title(title, fontsize=10)
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=8)
    ax.figure.colorbar(im, ax=ax)
    return grid


def ruler_figure_name(name: str) -> str:
    """The file name of ``name``'s RULER heatmaps in ``plots/`` (``ruler_<name>.png``)."""
    return f"ruler_{_safe(name)}.png"


def plot_ruler(metrics: dict, out_dir: str | Path) -> list[Path]:
    """Heatmaps (family × length) from metrics.json's ``ruler_cells``, one ``ruler_<name>.png`` per policy and the
    baseline: RULER score (0..100) and answer log-prob per token; a policy's figure adds its drop against the
    baseline in score points (red: lost), with each family's verdict beside its name. Returns the files written
    (none when no entry has ruler cells)."""
    entries = {BASELINE: metrics.get(BASELINE, {}), **metrics.get("policies", {})}
    entries = {n: e for n, e in entries.items() if e.get("ruler_cells")}
    if not entries:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
        written.append(_save(fig, out_dir / ruler_figure_name(name)))
    return written


__all__ += ["plot_ruler", "ruler_figure_name"]
