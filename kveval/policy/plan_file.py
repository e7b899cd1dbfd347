"""The plan file: the ``.plan.json`` beside a planned config, a shared artifact read below the tasks.

``kveval plan`` writes it (the sensitivity planner, :mod:`kveval.tasks.sensitivity.planner`); a config names it
(``plan: PATH``), the config's input checks read it (:func:`read_plan_file`, before anything is written) and a
planned run puts its predictions in its metrics (:func:`plan_predictions`), for the report's predicted-vs-measured
table. Only what those readers need is here, so that neither the config nor the run imports the planner.

Pure: no transformers import.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kveval.errors import KvevalError

MAX_PLAN_BYTES = 16 << 20  # a plan file is a few KiB; a bigger file is not a plan file


def is_finite_number(value) -> bool:
    """An int or float (not a bool) that is finite: what a number read from a JSON file must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_plan_file(path: str | Path) -> dict:
    """A ``.plan.json`` (written by ``kveval plan``) as a dict, after checking what a run reads from it: one
    KvevalError line when it is missing, not JSON, or its predictions are not finite numbers."""
    from kveval.schema import read_text_file

    p = Path(path)
    if not p.is_file():
        what = "is not a file" if p.exists() else "does not exist"
        raise KvevalError(f"plan: '{path}' {what}; rerun kveval plan, or remove the plan: line")
    not_plan = f"plan: '{path}' is not a kveval plan file (.plan.json from kveval plan)"
    try:
        side = json.loads(read_text_file(p, "plan file", max_bytes=MAX_PLAN_BYTES))
    except (ValueError, RecursionError):
        raise KvevalError(f"{not_plan}: not valid JSON") from None
    if not isinstance(side, dict):
        raise KvevalError(f"{not_plan}: not a JSON object")
    for key in ("predicted_kld_sum", "predicted_delta_ppl_pct"):
        if not is_finite_number(side.get(key)):
            raise KvevalError(f"{not_plan}: {key} is {side.get(key)!r}, not a finite number")
    uniform = side.get("uniform", {})
    if not isinstance(uniform, dict):
        raise KvevalError(f"{not_plan}: uniform is not an object")
    for name, u in uniform.items():
        if not isinstance(u, dict) or not is_finite_number(u.get("predicted_kld_sum")):
            raise KvevalError(f"{not_plan}: uniform.{name}.predicted_kld_sum is not a finite number")
    for key in ("budget", "scan"):
        if side.get(key) is not None and not isinstance(side[key], str):
            raise KvevalError(f"{not_plan}: {key} is {side[key]!r}, not a string")
    return side


def plan_predictions(path: str | Path) -> dict:
    """What a planned run puts in its metrics (``metrics["plan"]``) for the report's predicted-vs-measured table,
    from its ``.plan.json`` (:func:`read_plan_file`'s checks): ``{"sidecar", "budget", "scan", "policy": "planned",
    "predicted": {POLICY: {"kld", "delta_ppl_pct"?}}}``."""
    side = read_plan_file(path)
    predicted = {"planned": {"kld": side["predicted_kld_sum"], "delta_ppl_pct": side["predicted_delta_ppl_pct"]}}
    for name, u in side.get("uniform", {}).items():
        predicted[name] = {"kld": u["predicted_kld_sum"]}
    return {"sidecar": str(path), "budget": side.get("budget"), "scan": side.get("scan"), "policy": "planned",
            "predicted": predicted}
