"""The sweep file and its expansion into run configs: pure data in, plain config mappings out (no I/O).

A sweep file is pure data (YAML read strictly, like a config; nothing in it is executed)::

    name: demo                               # the sweep's folder: results/sweeps/demo (or output:)
    base:                                    # what every run shares: any config key but name/output
      data: builtin
      tasks: [{perplexity: {seq_len: 128, max_tokens: 1024}}]
    grid:                                    # models x policy sets x task sets
      models: [builtin:tiny-llama, builtin:tiny-gemma3]   # or {LABEL: MODEL or {name: ..., dtype: ...}}
      policies: [int8, int4_g32]                           # or {LABEL: KV} (a KV value as in a config)
      tasks: {short: [ppl_quick]}                          # optional: {LABEL: TASKS}
    runs:                                    # and/or a list of configs
      - {config: configs/int4_g64.yaml, set: ["tasks[0].perplexity.max_tokens=512"]}
      - {name: smol_int8, config: {model: builtin:smollm2-135m, kv: [int8]}}
    set: ["seed=1"]                          # overrides for every run, as `kveval run -s`
    resources: {num_cpus: 1, num_gpus: 0, memory: 4GiB, timeout_s: 3600}   # per run (a Ray task)
    ray: {num_cpus: 8}                       # the local Ray's CPUs (default: the machine's)

A grid run is named ``MODEL__POLICIES`` (``MODEL__POLICIES__TASKS`` with task sets) from the axes' labels; a listed
run by its ``name``, else its config file's stem or its inline ``name``. Every run's config is ``base`` with the
run's own keys on top (mappings merged key by key, anything else replaced), ``name`` set to the run's name and
``output`` to ``<sweep output>/runs/<name>``. :func:`expand` returns :class:`RunSpec` s; validating them is
:mod:`kveval.sweep.load`'s work (the loader of ``kveval run``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from pydantic import Field, field_validator, model_validator

from kveval.errors import KvevalError
from kveval.schema import Strict

#: What joins the axis labels of a grid run's name (labels may hold '-' and '.', never two '_' in a row).
NAME_JOIN = "__"
#: Where each run's folder goes, under the sweep's output folder.
RUNS_DIR = "runs"
DEFAULT_ROOT = "results/sweeps"
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")
#: Config keys that the sweep sets for every run itself.
SWEEP_OWNED = ("name", "output")


class TaskResources(Strict):
    """What one run (one Ray task) asks of the cluster: Ray schedules a run only where these are free.
    ``memory``: Ray's logical memory resource (``4GiB``; scheduling only, nothing enforces it); ``timeout_s``: a
    run still working after this long is killed and reported failed (a rerun of the sweep resumes it)."""

    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(0, ge=0)
    memory: str | None = None
    timeout_s: float | None = Field(None, gt=0)

    @field_validator("num_cpus", "num_gpus", mode="before")
    @classmethod
    def _number(cls, value):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("memory")
    @classmethod
    def _size(cls, value):
        if value is not None:
            from kveval.units import parse_size

            try:
                parse_size(value)
            except (OverflowError, ValueError):
                raise ValueError(f"{value!r} is not a finite size; write e.g. 4GiB") from None
            except KvevalError as exc:
                raise ValueError(str(exc)) from None
        return value


class RayOptions(Strict):
    """The local Ray that ``kveval sweep`` starts in its own process (ignored with ``--address``): ``num_cpus`` and
    ``num_gpus`` it offers (default: what the machine has)."""

    num_cpus: int | None = Field(None, ge=1)
    num_gpus: int | None = Field(None, ge=0)


class Grid(Strict):
    """The axes of a grid: ``models`` and ``policies`` (a list, labelled from their values, or ``{LABEL: value}``)
    and optionally ``tasks`` (task sets)."""

    models: list[Any] | dict[str, Any] = Field(min_length=1)
    policies: list[Any] | dict[str, Any] = Field(min_length=1)
    tasks: list[Any] | dict[str, Any] | None = None


class ListedRun(Strict):
    """One run of ``runs:``: ``config`` (a config file, or the config as a mapping), an optional ``name`` and
    ``set`` overrides (as ``kveval run -s``)."""

    config: str | dict[str, Any]
    name: str | None = None
    set: list[str] = []


class SweepFile(Strict):
    """The closed schema of a sweep file (see the module's docstring)."""

    name: str = Field(min_length=1)
    output: str | None = Field(None, min_length=1)
    base: dict[str, Any] | str = {}
    grid: Grid | None = None
    runs: list[ListedRun] = []
    set: list[str] = []
    resources: TaskResources = TaskResources()
    ray: RayOptions = RayOptions()

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value):
        if _LABEL_CHARS.search(value) or value.startswith((".", "-")) or len(value) > 100:
            raise ValueError("use letters, digits, '_', '-' and '.' only, not starting with '.' or '-', at most 100 "
                             "characters (it names the sweep's folder)")
        return value

    @model_validator(mode="after")
    def _some_runs(self):
        if self.grid is None and not self.runs:
            raise ValueError("a sweep needs a grid: (models x policies, optionally x tasks) or runs: (a list of "
                             "configs)")
        if isinstance(self.base, dict):
            owned = [k for k in SWEEP_OWNED if k in self.base]
            if owned:
                raise ValueError(f"base.{owned[0]}: the sweep names each run and puts it under its output folder "
                                 "itself; remove it (set the sweep's output: instead)")
        return self

    def output_dir(self) -> str:
        """The sweep's folder: ``output``, else ``results/sweeps/<name>``."""
        return self.output or f"{DEFAULT_ROOT}/{self.name}"


@dataclass
class RunSpec:
    """One run of a sweep before validation: its ``name``, the config as plain data (``raw``, without name and
    output: :func:`with_placement` adds them), the ``overrides`` to apply (the sweep's ``set`` and the run's), the
    ``axes`` it sits on (``{"model": label, "policies": label, "tasks": label}`` for a grid run, ``{"config":
    label}`` for a listed one) and where it came from (``source``: ``grid`` or ``runs[i]``, for messages)."""

    name: str
    raw: dict
    overrides: list[str] = field(default_factory=list)
    axes: dict[str, str] = field(default_factory=dict)
    source: str = "grid"


def label_of(value: Any) -> str | None:
    """A label for an axis value given without one: a preset or model name made into a folder-name part
    (``builtin:tiny-llama`` -> ``tiny-llama``, ``org/Model-7B`` -> ``Model-7B``, ``/m/model.Q8_0.gguf`` ->
    ``model.Q8_0``); a mapping with a ``name`` (a model) by that name; None for anything else."""
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        value = value["name"]
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip().removeprefix("builtin:").rstrip("/\\")
    text = PurePath(text.replace("\\", "/")).name
    if text.lower().endswith(".gguf"):
        text = text[: -len(".gguf")]
    text = _LABEL_CHARS.sub("_", text).strip("_").lstrip(".-")
    return text or None


def _axis(values: list | dict, where: str) -> list[tuple[str, Any]]:
    """``[(label, value)]`` of one grid axis; labels given (a mapping) or derived (:func:`label_of`)."""
    if isinstance(values, dict):
        out = []
        for label, value in values.items():
            if _LABEL_CHARS.search(label) or not label or label.startswith((".", "-")) or NAME_JOIN in label:
                raise KvevalError(f"{where}: label {label!r}: use letters, digits, '-', '.' and single '_' only")
            out.append((label, value))
        return out
    out = []
    for i, value in enumerate(values):
        label = label_of(value)
        if label is None or isinstance(value, list):
            raise KvevalError(f"{where}[{i}]: this entry needs a label; write {where.rsplit('.', 1)[-1]}: "
                              "{LABEL: VALUE, ...} instead of a list")
        out.append((label.replace(NAME_JOIN, "_"), value))
    return out


def _normalised(raw: dict) -> dict:
    """The config shorthands that merging must see as mappings: ``model: NAME`` and ``data: SOURCE``."""
    raw = copy.deepcopy(raw)
    if isinstance(raw.get("model"), str):
        raw["model"] = {"name": raw["model"]}
    if isinstance(raw.get("data"), str):
        raw["data"] = {"source": raw["data"]}
    return raw


def merged(base: dict, top: dict) -> dict:
    """``base`` with ``top`` on top: mappings merged key by key (recursively), lists and scalars replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand(sweep: SweepFile, base: dict, listed: list[tuple[str | None, dict, str]]) -> list[RunSpec]:
    """Every run of ``sweep``: the grid's product (models x policy sets x task sets, in that order) then the listed
    runs. ``base``: the shared config as plain data (the sweep's ``base:`` mapping, or the file it names, read);
    ``listed``: per ``runs:`` entry ``(name or None, config as plain data, default label)`` (the caller reads
    config files). Duplicate run names are refused (one KvevalError line naming both places)."""
    base = _normalised(base)
    for key in SWEEP_OWNED:
        base.pop(key, None)
    runs: list[RunSpec] = []
    if sweep.grid is not None:
        g = sweep.grid
        models = _axis(g.models, "grid.models")
        policy_sets = _axis(g.policies, "grid.policies")
        task_sets = _axis(g.tasks, "grid.tasks") if g.tasks is not None else [(None, None)]
        for m_label, model in models:
            for p_label, kv in policy_sets:
                for t_label, tasks in task_sets:
                    top: dict[str, Any] = {"model": model if isinstance(model, dict) else {"name": model}, "kv": kv}
                    axes = {"model": m_label, "policies": p_label}
                    if t_label is not None:
                        top["tasks"] = tasks if isinstance(tasks, list) else [tasks]
                        axes["tasks"] = t_label
                    name = NAME_JOIN.join(axes.values())
                    runs.append(RunSpec(name, merged(base, _normalised(top)), list(sweep.set), axes, "grid"))
    for i, (entry, (given, raw, default)) in enumerate(zip(sweep.runs, listed)):
        run_name = entry.name or given or default
        runs.append(RunSpec(run_name, merged(base, _normalised({k: v for k, v in raw.items() if k not in SWEEP_OWNED})),
                            [*sweep.set, *entry.set], {"config": run_name}, f"runs[{i}]"))
    seen: dict[str, str] = {}
    for run in runs:
        if run.name in seen:
            raise KvevalError(f"two runs are named '{run.name}' ({seen[run.name]} and {run.source}); give them "
                              "distinct labels or names")
        seen[run.name] = run.source
    return runs


def with_placement(run: RunSpec, sweep_output: str) -> dict:
    """The run's config with its ``name`` and its folder (``<sweep output>/runs/<name>``) set."""
    return {**run.raw, "name": run.name, "output": f"{sweep_output.rstrip('/')}/{RUNS_DIR}/{run.name}"}
