"""What ``kveval scan`` prints when it ends (pure: text from the scan's metrics): the most sensitive layers of keys
and of values, and the commands that turn the scan into a policy (``kveval plan``, for each engine whose cache
types the scan holds, else how to scan them)."""

from __future__ import annotations

import shlex
from collections import defaultdict

#: the most sensitive layers named per tensor
TOP = 3


def sensitive_layers(metrics: dict) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """(the spec ranked by: the scanned spec of the largest mean KLD, {tensor: [(layer, KLD)] most sensitive
    first, at most :data:`TOP`})."""
    cells = [c for c in (metrics.get("sensitivity") or {}).get("cells") or [] if isinstance(c, dict)]
    by_spec: dict[str, list[float]] = defaultdict(list)
    for c in cells:
        if isinstance(c.get("kld"), (int, float)):
            by_spec[str(c.get("spec"))].append(float(c["kld"]))
    if not by_spec:
        return "", {}
    spec = max(by_spec, key=lambda s: sum(by_spec[s]) / len(by_spec[s]))
    ranked: dict[str, list[tuple[int, float]]] = {}
    for tensor in ("key", "value"):
        mine = [(int(c["layer"]), float(c["kld"])) for c in cells if c.get("spec") == spec
                and c.get("tensor") == tensor and isinstance(c.get("kld"), (int, float))]
        if mine:
            ranked[tensor] = sorted(mine, key=lambda x: -x[1])[:TOP]
    return spec, ranked


def _budget_that_plans(metrics: dict, engine: str, budgets: list[str]) -> str | None:
    """The first of ``budgets`` that ``engine`` can plan within from this scan (the scan's first spec, else the
    engine's own scanned types in scan order: a uniform plan of one fits its own memory); None when none does or
    the engine runs none of the scanned types."""
    from kveval.errors import KvevalError
    from kveval.tasks.sensitivity.planner import plan

    if len(budgets) < 2:  # the engine runs none of the scanned types
        return None
    for budget in budgets:
        try:
            plan(metrics, budget, engine=engine)
        except KvevalError:
            continue
        return budget
    return None


def closing_lines(metrics: dict, scan_dir: str) -> list[str]:
    """The lines ``kveval scan`` ends with (the module docstring)."""
    from kveval.engines.tables import ENGINES

    spec, ranked = sensitive_layers(metrics)
    lines = []
    if ranked:
        parts = [f"{'keys' if t == 'key' else 'values'} " + ", ".join(f"{i} ({kld:.3g})" for i, kld in layers)
                 for t, layers in ranked.items()]
        lines.append(f"scan: most sensitive layers (KLD with {spec} alone): " + "; ".join(parts))
    scanned = list((metrics.get("sensitivity") or {}).get("specs") or [])
    budget = scanned[0] if scanned else "4.5"
    where = shlex.quote(str(scan_dir))
    lines.append(f"next: kveval plan {where} --budget {shlex.quote(budget)}   (a mixed policy within the memory of "
                 f"{budget}; --budget also takes 4.5 bits/element, 35KiB/token, 28%)")
    engines = []
    for e, eng in ENGINES.items():
        own = _budget_that_plans(metrics, e, [budget, *[s for s in eng.candidates(scanned) if s != "none"]])
        if own is not None:  # a printed command runs: the budget is one the engine can plan within
            engines.append(e)
            lines.append(f"      kveval plan {where} --budget {shlex.quote(own)} --engine {e}")
    missing = [e for e in ("vllm", "llamacpp") if e not in engines]
    if missing:
        lines.append(f"      (no plan for {' or '.join(missing)} from this scan: kveval scan CONFIG --engine "
                     f"{missing[0]} scans the cache types it runs)")
    return lines


__all__ = ["closing_lines", "sensitive_layers"]
