"""The plan file: the ``.plan.json`` beside a planned config, one schema (:class:`PlanFile`) for its writer and its
readers, below the tasks.

``kveval plan`` writes it (:meth:`PlanFile.write`, from the sensitivity planner's plan); a config names it (``plan:
PATH``), the config's input checks read it (:func:`read_plan_file`, before anything is written), a planned run puts
its predictions in its metrics (:func:`plan_predictions`), for the report's predicted-vs-measured table, and
``kveval deploy`` reads its policy, model shape and context. Neither the config nor the run imports the planner.

The fields are written in the order of the schema (``json.dumps(indent=2)``: an unchanged plan writes the same
bytes); numbers are kept as they are given (an int stays an int). Reading is strict: unknown keys, wrong types and
numbers that are not finite are one :class:`KvevalError` line naming the file and the field. ``engine`` may be
absent (files written before ``kveval plan --engine``).

Pure: no transformers import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PlainValidator, ValidationError

from kveval.errors import KvevalError
from kveval.schema import Strict, is_finite_number

MAX_PLAN_BYTES = 16 << 20  # a plan file is a few KiB; a bigger file is not a plan file


def _finite(value: Any) -> Any:
    if not is_finite_number(value):
        raise ValueError("not a finite number")
    return value


def _policy_form(value: Any) -> Any:
    if not isinstance(value, (str, dict)):
        raise ValueError("not a policy (a preset name or a mapping)")
    return value


#: a number read from the file: an int or a float (kept as given), finite
FiniteNumber = Annotated[float, PlainValidator(_finite)]
Count = Annotated[int, Field(ge=0)]


class PlannedLayer(Strict):
    """The spec chosen for one layer's keys and values."""

    layer: Count
    key: str
    value: str


class UniformPlan(Strict):
    """A uniform policy near the budget, for comparison: its bill and the scan's prediction."""

    bits_per_element: FiniteNumber
    total_bytes: Count
    predicted_kld_sum: FiniteNumber


class PlanFile(Strict):
    """A ``.plan.json``: where the plan comes from (``scan``, ``command``, the ``config`` written beside it), the
    budget and the bill at ``context`` tokens of the model shape ``arch`` (``Arch.to_dict``), the predictions, the
    per-layer choice and the mixed ``policy`` (its config form), and the nearest ``uniform`` policies."""

    scan: str
    command: str
    config: str
    budget: str
    budget_bytes: Count
    context: Annotated[int, Field(ge=1)]
    arch: dict[str, Any]
    total_bytes: Count
    bits_per_element: FiniteNumber
    bytes_per_token: FiniteNumber
    fraction_of_fp16: FiniteNumber
    predicted_kld_sum: FiniteNumber
    predicted_delta_ppl_pct: FiniteNumber
    estimated_specs: list[str]
    allow_fp: bool
    engine: str | None = None
    layers: list[PlannedLayer]
    policy: Annotated[str | dict[str, Any], PlainValidator(_policy_form)]
    uniform: dict[str, UniformPlan]

    def write(self, path: str | Path) -> None:
        """The file at ``path``: indented JSON in the schema's field order (atomic)."""
        from kveval.fileio import atomic_write_json

        atomic_write_json(path, self.model_dump())


_EXPECTED = {"string_type": "not a string", "int_type": "not an integer", "bool_type": "not true or false",
             "dict_type": "not an object", "model_type": "not an object", "list_type": "not a list"}


def _error_line(err: ValidationError) -> str:
    """The first schema error as ``FIELD is VALUE, not WHAT``."""
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    if e["type"] == "missing":
        return f"{where} is missing"
    if e["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    if e["type"] in ("greater_than_equal", "greater_than"):
        what = f"not at least {e['ctx']['ge']}" if "ge" in e.get("ctx", {}) else e["msg"]
    else:
        what = _EXPECTED.get(e["type"]) or e["msg"].removeprefix("Value error, ")
    shown = repr(e.get("input"))
    return f"{where} is {shown if len(shown) <= 80 else shown[:77] + '...'}, {what}"


def read_plan_file(path: str | Path) -> PlanFile:
    """A ``.plan.json`` (written by ``kveval plan``), checked against :class:`PlanFile`: one KvevalError line when
    it is missing, not JSON, or a field is missing, unknown, of the wrong type or a number that is not finite."""
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
    try:
        return PlanFile.model_validate(side)
    except ValidationError as exc:
        raise KvevalError(f"{not_plan}: {_error_line(exc)}") from None


def plan_predictions(path: str | Path) -> dict:
    """What a planned run puts in its metrics (``metrics["plan"]``) for the report's predicted-vs-measured table,
    from its ``.plan.json`` (:func:`read_plan_file`'s checks): ``{"sidecar", "budget", "scan", "policy": "planned",
    "predicted": {POLICY: {"kld", "delta_ppl_pct"?}}}``."""
    side = read_plan_file(path)
    predicted = {"planned": {"kld": side.predicted_kld_sum, "delta_ppl_pct": side.predicted_delta_ppl_pct}}
    for name, u in side.uniform.items():
        predicted[name] = {"kld": u.predicted_kld_sum}
    return {"sidecar": str(path), "budget": side.budget, "scan": side.scan, "policy": "planned",
            "predicted": predicted}
