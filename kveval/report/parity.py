"""The parity report: kveval's presets against the systems they are named after (``kveval parity``).

Input: the rows of ``kveval.parity`` as plain dicts (``ParityRow.to_dict()``, as ``parity.json`` holds them).
Output: a Markdown table and a figure of KL(P_system ‖ P_kveval) by token position, one line per cache type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from kveval.report.plots import color, marker

COLUMNS = [
    ("cache_type", "cache type"), ("preset", "kveval preset"), ("ref_delta_ppl_pct", "system ΔPPL %"),
    ("ref_kld", "system KLD"), ("kv_delta_ppl_pct", "kveval ΔPPL %"), ("kv_kld", "kveval KLD"),
    ("kld_between", "KLD(system ‖ kveval)"), ("ratio", "ratio"),
]


def _fmt(key: str, value: object) -> str:
    if isinstance(value, float):
        if key.endswith("pct"):
            return f"{value:+.3f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[dict]) -> str:
    """One line per cache type; ``ratio`` = KLD(system ‖ kveval) / KLD(system FP ‖ system) (0 is identical)."""
    head = "| " + " | ".join(label for _, label in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    body = ["| " + " | ".join(_fmt(k, r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def by_position(rows: Sequence[dict], system: str, window: int = 16) -> Figure | None:
    """KL(P_system ‖ P_kveval) by token position (moving mean over ``window`` positions), log scale."""
    drawn = [r for r in rows if r.get("kld_between_by_position")]
    if not drawn:
        return None
    fig = Figure(figsize=(7.5, 4.0))
    ax = fig.subplots()
    for i, r in enumerate(drawn):
        y = np.asarray(r["kld_between_by_position"], dtype=np.float64)
        w = max(1, min(window, len(y)))
        smooth = np.convolve(y, np.ones(w) / w, mode="valid")
        x = np.arange(len(smooth)) + (w - 1) / 2
        ax.plot(x, np.maximum(smooth, 1e-12), color=color(i), marker=marker(i), markevery=max(1, len(x) // 8),
                label=f"{r['cache_type']} ({r['preset']})")
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel(f"KL(P_{system} ‖ P_kveval), mean of {window}")
    ax.set_title(f"kveval against {system}, per position")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
