"""The figures' shared style and helpers: the Okabe-Ito colours and markers per policy, :func:`save` (every PNG
kveval writes goes through it), byte and symmetric-log axes, the Pareto front, and point labels that do not
overprint (:func:`place_labels`). Used by :mod:`kveval.report.plots` and by the tasks' figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from kveval.fileio import atomic_write_bytes
from kveval.results import BASELINE

# Okabe & Ito (2008), "Color Universal Design": black first for the baseline
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442", "#000000"]
BASELINE_COLOR = "#555555"
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
DPI = 100


def color(i: int) -> str:
    return OKABE_ITO[i % len(OKABE_ITO)]


def marker(i: int) -> str:
    return MARKERS[i % len(MARKERS)]


def policy_styles(policies: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A fixed (colour, marker) per policy name, in the run's order; the baseline is grey circles."""
    out, i = {}, 0
    for p in policies:
        if p == BASELINE:
            out[p] = (BASELINE_COLOR, "o")
        elif p not in out:
            out[p] = (color(i), marker(i))
            i += 1
    return out


def save(fig: Figure, path: str | Path, dpi: int = DPI, palette: bool = True) -> Path:
    """Write ``fig`` as a PNG (no software metadata, so that reruns give identical files), atomically: the image
    is rendered in memory and replaces ``path`` in one rename (:func:`kveval.fileio.atomic_write_bytes`), so an
    interrupted report (Ctrl-C, a full disk) leaves the previous figure or none, never a truncated one, and a
    symbolic link at ``path`` is replaced, never written through. Every PNG kveval writes goes through here.

    ``palette``: store it with a 256-colour palette (Pillow, median cut): a plot has few colours, so this looks
    the same and is about three times smaller, which keeps HTML reports and committed reference runs small.
    """
    import io

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png", metadata={"Software": None})
    data = buf.getvalue()
    if palette:
        try:
            from PIL import Image

            img = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
            out = io.BytesIO()
            img.save(out, format="PNG", optimize=True)
            data = out.getvalue() if out.tell() < len(data) else data
        except (ImportError, AttributeError, OSError, ValueError):  # no Pillow, or one too old: the plain PNG
            pass
    atomic_write_bytes(path, data)
    return path


def bytes_label(x: float, _pos=None) -> str:
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    if x >= 2**10:
        return f"{x / 2**10:.1f} KiB"
    return f"{x:.0f} B"


KIB = 1024.0


def pareto_front(x: Sequence[float], y: Sequence[float]) -> list[int]:
    """Indices of the points not dominated by another (smaller or equal x and y, one strictly), by rising x."""
    pts = sorted((float(a), float(b), i) for i, (a, b) in enumerate(zip(x, y)) if np.isfinite(a) and np.isfinite(b))
    front, best = [], math.inf
    for _a, b, i in pts:
        if b < best:
            front.append(i)
            best = b
    return front


def use_symlog(values: Sequence[float], scale: float) -> bool:
    """Symmetric log when the largest |value| exceeds 10x the threshold: small damage stays readable."""
    vals = [abs(v) for v in values if np.isfinite(v)]
    return bool(vals) and max(vals) > 10 * max(scale, 1e-12)


def readable_linthresh(values: Sequence[float], threshold: float) -> float:
    """Where a symmetric-log ΔPPL axis turns logarithmic: the decade at or below the smallest nonzero |value|,
    between threshold / 100 and the threshold, so that 0.2% and 20% are both read off the axis (a linear part up
    to the threshold gives 0-1 the height of 1-20)."""
    small = [abs(v) for v in values if np.isfinite(v) and v != 0]
    if not small:
        return threshold
    decade = 10.0 ** np.floor(np.log10(min(small)))
    return float(min(threshold, max(decade, threshold / 100)))


def symlog_axis(ax, values: Sequence[float], linthresh: float) -> None:
    """Linear up to the threshold, logarithmic beyond, with ticks at 1-2-5 multiples of the threshold."""
    ax.set_yscale("symlog", linthresh=linthresh)
    vals = [v for v in values if np.isfinite(v)]
    hi, lo = max(vals + [0.0]), min(vals + [0.0])
    ticks = {0.0, linthresh / 2, linthresh}
    k = linthresh
    while k < hi * 1.01:
        ticks.update({2 * k, 5 * k, 10 * k})
        k *= 10
    ticks = {t for t in ticks if t <= max(hi * 1.3, linthresh)}
    if lo < 0:
        ticks.update(-t for t in list(ticks) if t <= max(-lo * 1.3, linthresh))
    ax.set_yticks(sorted(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_locator(null_locator())


def scale_note(ax) -> str:
    if ax.get_yscale() == "symlog":
        return f"\nlinear up to {ax.yaxis.get_transform().linthresh:g}, log above"
    return ""


def null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


_CANDIDATES = [(7, 4, "left", "bottom"), (7, -4, "left", "top"), (-7, 4, "right", "bottom"),
               (-7, -4, "right", "top"), (0, 9, "center", "bottom"), (0, -9, "center", "top"),
               (10, 14, "left", "bottom"), (10, -14, "left", "top"), (-10, 14, "right", "bottom"),
               (-10, -14, "right", "top"), (0, 20, "center", "bottom"), (0, -20, "center", "top")]


def place_labels(fig: Figure, jobs: list, multi: bool) -> None:
    """Name each point without overprinting: points at the same spot share one label; each label takes the
    first position around its point (right, left, above, below, then further out) that overlaps no other
    label, marker or legend and stays inside the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.canvas.draw()  # final layout and scales, so that display coordinates are right
    renderer = fig.canvas.get_renderer()
    for ax, points in jobs:
        merged: dict[tuple[float, float], list[tuple[str, str]]] = {}
        for x, y, pol, run in points:
            merged.setdefault((float(x), float(y)), []).append((pol, run))
        items = []
        for (x, y), names in merged.items():
            if multi:
                pols = list(dict.fromkeys(p for p, _ in names))
                text = "; ".join(f"{p} ({', '.join(r for q, r in names if q == p)})" for p in pols)
            else:
                text = ", ".join(p for p, _ in names)
            items.append((x, y, text, ax.transData.transform((x, y))))
        pad = 6 * fig.dpi / 72
        markers = [Bbox.from_bounds(d[0] - pad, d[1] - pad, 2 * pad, 2 * pad) for *_, d in items]
        taken = []
        legend = ax.get_legend()
        if legend is not None:
            taken.append(legend.get_window_extent(renderer))
        for i, (x, y, text, _d) in enumerate(items):
            others = taken + [m for j, m in enumerate(markers) if j != i]
            chosen = None
            for dx, dy, ha, va in _CANDIDATES:
                ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8,
                                  ha=ha, va=va)
                ann.set_in_layout(False)
                bb = ann.get_window_extent(renderer)
                inside = (bb.x0 >= ax.bbox.x0 and bb.x1 <= ax.bbox.x1 and bb.y0 >= ax.bbox.y0
                          and bb.y1 <= ax.bbox.y1)
                if inside and not any(bb.overlaps(o) for o in others):
                    chosen = (ann, bb)
                    break
                ann.remove()
            if chosen is None:  # crowded: the first position, accepted as is
                ann = ax.annotate(text, (x, y), xytext=(7, 4), textcoords="offset points", fontsize=8)
                ann.set_in_layout(False)
                chosen = (ann, ann.get_window_extent(renderer))
            taken.append(chosen[1])


def label_cells(ax, image, grid: np.ndarray, fmt: str) -> None:
    """A heatmap's finishing: each finite cell of ``grid`` (``[rows, columns]``, as drawn by ``image``) written
    in its square with ``fmt``, and a colour bar beside ``ax``."""
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=8)
    ax.figure.colorbar(image, ax=ax)


def log_scale_ok(values: Sequence[float]) -> bool:
    vals = [v for v in values if np.isfinite(v)]
    return bool(vals) and min(vals) > 0 and max(vals) / min(vals) > 20


__all__ = ["OKABE_ITO", "BASELINE_COLOR", "MARKERS", "DPI", "KIB", "color", "marker", "policy_styles", "save",
           "bytes_label", "pareto_front", "use_symlog", "symlog_axis", "scale_note", "null_locator", "place_labels", "label_cells",
           "log_scale_ok"]
