"""Two runs of one config, from two machines: which of their differences the runs can resolve.

The same commit and config can give different numbers on two machines (docs/findings.md: torch's CPU kernels
round differently per instruction set, and a model that amplifies rounding makes that visible). ``kveval report A
B`` on two runs of the same inputs (the resolved config less its output folder, and the same evaluated tokens when
both runs recorded their digest) adds a section that says, per policy and headline metric, whether the difference
is within what the runs resolve:

- ``resolvable``: 1.96 x sqrt(u_a^2 + u_b^2), ``u`` being each run's own standard uncertainty of the metric
  (llama-perplexity's: ``ppl_base_unc`` for the baseline's PPL, ``ppl_ratio_unc`` x 100 for ΔPPL %,
  ``kld_mean_unc``): a difference below it
  changes no conclusion either run supports;
- ``path floor``: the larger of the runs' path noise floors when measured (``noise_floor_ppl_pct``,
  ``noise_floor_kld``: the same arithmetic computed two ways, single pass against decoding);
- ``within``: ``yes`` when ``|difference|`` is at most the larger of the two, ``no`` otherwise (a difference
  beyond both: a machine-dependent result worth reporting).

Pure: reads :class:`kveval.results.RunResults` and returns rows; ``render.build`` draws them.
"""

from __future__ import annotations

import math
from typing import Any

from kveval.results import BASELINE, RunResults

#: env.json fields that say what the machine was
MACHINE_FIELDS = ("cpu", "cpu_capability", "threads", "torch", "platform", "git_commit")
#: (label, summary column, llama-perplexity uncertainty field and its scale, noise-floor column)
METRICS = (
    ("PPL", "ppl", "ppl_base_unc", 1.0, None),  # the baseline's, as every policy's block states it
    ("ΔPPL %", "delta_ppl_pct", "ppl_ratio_unc", 100.0, "noise_floor_ppl_pct"),
    ("KLD", "kld_mean", "kld_mean_unc", 1.0, "noise_floor_kld"),
)
Z95 = 1.959963984540054


def _inputs(run: RunResults) -> tuple[dict, Any]:
    config = {k: v for k, v in run.config.items() if k != "output"}
    tokens = run.marker.get("tokens")
    return config, tokens.get("sha256") if isinstance(tokens, dict) else None


def same_inputs(a: RunResults, b: RunResults) -> bool:
    """Whether two runs evaluated the same config (its output folder aside) on the same tokens (when both say)."""
    (ca, ta), (cb, tb) = _inputs(a), _inputs(b)
    return ca == cb and (ta is None or tb is None or ta == tb)


def machine_rows(runs: list[RunResults]) -> list[dict]:
    """One row per run: its name and what env.json says of its machine ("?" for a field it lacks)."""
    return [{"run": r.name, **{f: str(r.env.get(f, "?")) if r.env.get(f) is not None else "?"
                               for f in MACHINE_FIELDS}} for r in runs]


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _uncertainty(run: RunResults, policy: str, field: str, scale: float) -> float | None:
    """The standard uncertainty ``field`` of llama-perplexity's statistics of ``policy`` (the baseline's: from the
    first policy's block that states it), times ``scale``; None when the run has none."""
    policies = run.metrics.get("policies")
    policies = policies if isinstance(policies, dict) else {}
    blocks = list(policies.values()) if policy == BASELINE else [policies.get(policy)]
    for block in blocks:
        lp = block.get("llama_perplexity") if isinstance(block, dict) else None
        u = _number(lp.get(field)) if isinstance(lp, dict) else None
        if u is not None:
            return u * scale
    return None


def _summary_value(run: RunResults, policy: str, column: str) -> float | None:
    s = run.summary
    if column not in s.columns:
        return None
    rows = s[s["policy"] == policy]
    return None if rows.empty else _number(rows.iloc[0][column])


def difference_rows(a: RunResults, b: RunResults) -> list[dict]:
    """Per policy both runs hold (the baseline first) and headline metric both measured: ``policy``, ``metric``,
    the two values, ``difference`` (b - a), ``resolvable``, ``path_floor`` and ``within`` (the module
    docstring)."""
    policies = [p for p in a.summary["policy"] if p in set(b.summary["policy"])]
    out = []
    for policy in policies:
        for label, column, unc_field, scale, floor_column in METRICS:
            if (policy == BASELINE) != (column == "ppl"):
                continue
            va, vb = _summary_value(a, policy, column), _summary_value(b, policy, column)
            if va is None or vb is None:
                continue
            ua, ub = _uncertainty(a, policy, unc_field, scale), _uncertainty(b, policy, unc_field, scale)
            resolvable = None if ua is None or ub is None else Z95 * math.hypot(ua, ub)
            floors = [f for f in (_summary_value(r, policy, floor_column) for r in (a, b)) if f is not None] \
                if floor_column else []
            floor = max(floors) if floors else None
            bounds = [x for x in (resolvable, floor) if x is not None]
            diff = vb - va
            within = None if not bounds else abs(diff) <= max(bounds)
            out.append({"policy": policy, "metric": label, a.name: va, b.name: vb, "difference": diff,
                        "resolvable": resolvable, "path_floor": floor,
                        "within": "?" if within is None else "yes" if within else "no"})
    return out


__all__ = ["MACHINE_FIELDS", "difference_rows", "machine_rows", "same_inputs"]
