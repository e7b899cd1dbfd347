"""The experiment config: a closed, typed schema (unknown keys are errors with a "did you mean").

A config is pure data (YAML); nothing in it is executed. Shape::

    name: int4_g64
    model: builtin:smollm2-135m          # or {name: ..., device: cpu|cuda|auto, dtype: float32|float64|...}
    data: builtin                        # or {source: builtin|wikitext2|pg19|PATH, text_field: text}
    kv: [fp16, int4_g64]                 # preset names, or {policies: {NAME: POLICY}}, or one POLICY mapping
    tasks:
      - perplexity: {seq_len: 512, max_tokens: 4096}
    threshold: {delta_ppl_pct: 1.0}
    memory: {gpu_memory: 80GiB}          # max_batch in metrics.json is computed for this GPU size
    output: results/int4_g64             # default: results/<name>
    seed: 0

``load_config(path, overrides)`` returns an ``ExperimentConfig`` or raises ``KvevalError`` with one line such as
``configs/x.yaml: tasks[0].perplexity.seq_lenn: unknown key; did you mean 'seq_len'?``.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.schema import Strict
from kveval.tasks import TASKS, task_presets


class ModelConfig(Strict):
    name: str = "builtin:smollm2-135m"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False


class DataConfig(Strict):
    source: str = "builtin"
    text_field: str = "text"
    split: str | None = None


TASK_TYPES: dict[str, type[Strict]] = {name: module.Params for name, module in TASKS.items()}


class _TaskEntryBase(Strict):
    @model_validator(mode="after")
    def _exactly_one(self):
        chosen = [k for k in TASK_TYPES if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(f"each task entry names exactly one task ({', '.join(TASK_TYPES)}), got {len(chosen)}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in TASK_TYPES if getattr(self, k) is not None)

    @property
    def params(self) -> Strict:
        return getattr(self, self.kind)


# One task: a mapping with exactly one task name, e.g. ``{perplexity: {seq_len: 512}}``; one optional field per
# registered task (kveval/tasks/), so that unknown keys inside a task are reported with their full path.
TaskEntry = create_model(
    "TaskEntry", __base__=_TaskEntryBase, **{name: (cls | None, None) for name, cls in TASK_TYPES.items()}
)


class Threshold(Strict):
    """Pass/fail rule per policy: ΔPPL % at most ``delta_ppl_pct`` and, when set, mean KLD at most ``kld``."""

    delta_ppl_pct: float = Field(1.0, ge=0)
    kld: float | None = Field(None, ge=0)


class MemoryConfig(Strict):
    """The memory bill written beside each policy: at ``context`` tokens (default: the longest task window),
    and the largest batch that fits a GPU of ``gpu_memory`` (e.g. ``80GiB``) next to the weights."""

    context: int | None = Field(None, gt=0)
    gpu_memory: str = "80GiB"


class CalibrationConfig(Strict):
    """How ``kveval calibrate`` (and ``scales: auto`` policies) compute static scales: on the last ``tokens`` tokens
    of the config's corpus in windows of ``seq_len``, by ``method`` (absmax | percentile | mse; ``target``: the
    preset mse optimises for). ``outliers``: fractions p for which ranges of the dense part (each vector without
    its ceil(p * head_dim) largest magnitudes) are added, for specs with ``outliers: p``. Runs refuse scales whose tokens overlap the perplexity tokens unless
    ``allow_overlap``. ``output``: where ``kveval calibrate`` writes (default ``results/scales/<name>.safetensors``)."""

    tokens: int = Field(2048, gt=1)
    seq_len: int = Field(512, gt=1)
    method: Literal["absmax", "percentile", "mse"] = "absmax"
    percentile: float = Field(99.9, ge=50, le=100)
    target: str | None = None
    outliers: list[float] = []
    allow_overlap: bool = False
    output: str | None = None

    @field_validator("outliers")
    @classmethod
    def _fractions(cls, value):
        bad = [v for v in value if not 0 < v < 0.5]
        if bad:
            raise ValueError(f"outlier fractions must be in (0, 0.5); got {bad[0]}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _target_for_mse(self):
        if self.method == "mse" and not self.target:
            raise ValueError("method mse needs target: the preset the scales are searched for (e.g. int8)")
        if self.target is not None:
            from kveval.quant import preset

            preset(self.target)  # unknown preset -> ValueError with a suggestion
        return self


class KVConfig(Strict):
    """Named policies to compare. Each value is a preset name or a policy mapping (see ``KVPolicy.from_config``)."""

    policies: dict[str, str | dict[str, Any]]

    @field_validator("policies")
    @classmethod
    def _valid_policies(cls, value):
        if not value:
            raise ValueError("at least one policy is needed")
        for name, cfg in value.items():
            KVPolicy.from_config(cfg, name=name)  # raises KvevalError with a clear line
        return value


_OMITTED_AT_DEFAULT = {"perplexity": {"start_token": 0}}


class ExperimentConfig(Strict):
    name: str = Field(min_length=1)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    kv: KVConfig
    tasks: list[TaskEntry] = Field(min_length=1)
    threshold: Threshold = Threshold()
    memory: MemoryConfig = MemoryConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    plan: str | None = None  # the .plan.json of a planned config (kveval plan): the report compares with it
    output: str | None = None
    seed: int = 0

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value):
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
            raise ValueError("use letters, digits, '_', '-' and '.' only (it names the results folder)")
        return value

    def policies(self) -> dict[str, KVPolicy]:
        """The policies to compare, by name, in config order (the FP baseline is implicit and always run)."""
        return {name: KVPolicy.from_config(cfg, name=name) for name, cfg in self.kv.policies.items()}

    def output_dir(self) -> Path:
        return Path(self.output) if self.output else Path("results") / self.name

    def resolved(self) -> dict:
        """Plain data after defaults, with every policy expanded to its full form (written as config.resolved.yaml)."""
        data = self.model_dump(mode="json")
        if self.calibration == CalibrationConfig():
            del data["calibration"]  # default: left out, so that runs from before the section existed still resume
        if self.plan is None:
            del data["plan"]
        for task in data["tasks"]:  # fields added later, left out at their default (older run folders resume)
            for kind, defaults in _OMITTED_AT_DEFAULT.items():
                body = task.get(kind)
                for key, default in defaults.items():
                    if isinstance(body, dict) and body.get(key) == default:
                        del body[key]
        data["kv"] = {"policies": {n: p.to_config() for n, p in self.policies().items()}}
        return data


# ---------------------------------------------------------------------------------------------------------------
# Shorthands: the normalisation of the friendly forms into the schema's one form
# ---------------------------------------------------------------------------------------------------------------
def _normalise(raw: dict) -> dict:
    raw = copy.deepcopy(raw)
    if isinstance(raw.get("model"), str):
        raw["model"] = {"name": raw["model"]}
    if isinstance(raw.get("data"), str):
        raw["data"] = {"source": raw["data"]}
    kv = raw.get("kv")
    if isinstance(kv, str):
        raw["kv"] = {"policies": {kv: kv}}
    elif isinstance(kv, list):
        policies = {}
        for i, item in enumerate(kv):
            if isinstance(item, str):
                policies[item] = item
            elif isinstance(item, dict) and len(item) == 1 and isinstance(next(iter(item.values())), (dict, str)):
                policies.update(item)
            else:
                raise KvevalError(f"kv[{i}]: expected a preset name or a one-key mapping {{NAME: POLICY}}")
        raw["kv"] = {"policies": policies}
    elif isinstance(kv, dict) and "policies" not in kv:
        raw["kv"] = {"policies": {kv.get("preset", "policy"): kv}}
    if isinstance(raw.get("tasks"), list):
        raw["tasks"] = [_expand_task(t, i) for i, t in enumerate(raw["tasks"])]
    return raw


def _expand_task(entry: Any, index: int) -> Any:
    """``"perplexity"`` -> ``{perplexity: {}}``; a preset name (a file in kveval/tasks/presets/) -> its contents;
    ``{preset: NAME, ...}`` -> the preset with the given fields overriding its parameters."""
    if isinstance(entry, str):
        if entry in TASK_TYPES:
            return {entry: {}}
        return _load_task_preset(entry, index)
    if isinstance(entry, dict) and "preset" in entry:
        base = _load_task_preset(entry["preset"], index)
        kind = next(iter(base))
        overrides = {k: v for k, v in entry.items() if k != "preset"}
        return {kind: {**(base[kind] or {}), **overrides}}
    if isinstance(entry, dict) and len(entry) == 1:
        kind, body = next(iter(entry.items()))
        if body is None:
            return {kind: {}}
    return entry


def _load_task_preset(name: str, index: int) -> dict:
    presets = task_presets()
    if name not in presets:
        choices = list(TASK_TYPES) + list(presets)
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f" (tasks: {', '.join(choices)})"
        raise KvevalError(f"tasks[{index}]: unknown task or task preset '{name}'{hint}")
    data = yaml.safe_load(presets[name].read_text())
    if not isinstance(data, dict) or len(data) != 1:
        raise KvevalError(f"task preset {presets[name]}: expected one mapping {{TASK: {{...}}}}")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Errors: one line, naming the key path, with a suggestion
# ---------------------------------------------------------------------------------------------------------------
def _loc_text(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _model_classes(annotation) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, dict, tuple):
        return [c for a in typing.get_args(annotation) for c in _model_classes(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _fields_at(loc: tuple) -> list[str]:
    """The valid keys of the mapping at ``loc`` (the location of an unknown key, without the key itself)."""
    classes: list[type[BaseModel]] = [ExperimentConfig]
    for part in loc:
        if isinstance(part, int):
            continue
        nxt = []
        for cls in classes:
            if part in cls.model_fields:
                nxt.extend(_model_classes(cls.model_fields[part].annotation))
        classes = nxt
    return sorted({f for cls in classes for f in cls.model_fields})


def _error_line(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = _loc_text(loc)
    if e["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else (f" (valid keys: {', '.join(valid)})" if valid else "")
        return f"{where}: unknown key{hint}"
    if e["type"] == "missing":
        return f"{where}: required key is missing"
    msg = e["msg"].removeprefix("Value error, ")
    got = e.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else ""
    return f"{where}: {msg}{shown}" if where else f"{msg}{shown}"


def parse_overrides(items: list[str]) -> list[tuple[list, Any]]:
    """``["tasks[0].perplexity.seq_len=256", "model.dtype=float64"]`` -> [(path, value)], values parsed as YAML."""
    out = []
    for item in items:
        if "=" not in item:
            raise KvevalError(f"override '{item}' must look like key.path=value")
        path_text, value_text = item.split("=", 1)
        path: list = []
        for token in re.findall(r"[^.\[\]]+|\[\d+\]", path_text.strip()):
            path.append(int(token[1:-1]) if token.startswith("[") else (int(token) if token.isdigit() else token))
        if not path:
            raise KvevalError(f"override '{item}' has an empty key path")
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError:
            raise KvevalError(f"override '{item}': the value is not valid YAML") from None
        out.append((path, value))
    return out


def _apply_override(raw: Any, path: list, value: Any, text: str) -> None:
    node = raw
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                raise KvevalError(f"override '{text}': there is no item {key} at {_loc_text(tuple(path[:i]))}")
            node = node[key]
        else:
            if not isinstance(node, dict):
                raise KvevalError(f"override '{text}': {_loc_text(tuple(path[:i]))} is not a mapping")
            if key not in node or node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            elif isinstance(node[key], str) and not isinstance(nxt, int):
                node[key] = {"name" if key == "model" else "source": node[key]} if key in ("model", "data") else node[key]
            node = node[key]
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise KvevalError(f"override '{text}': there is no item {last} to set")
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise KvevalError(f"override '{text}': {_loc_text(tuple(path[:-1]))} is not a mapping")


def validate(raw: Any, source: str = "config", overrides: list[str] | None = None) -> ExperimentConfig:
    """Validate plain data (already parsed YAML) into an ExperimentConfig; errors are one-line KvevalErrors."""
    if not isinstance(raw, dict):
        raise KvevalError(f"{source}: expected a YAML mapping at the top level")
    try:
        raw = _normalise(raw)
        parsed = parse_overrides(overrides or [])
        for (path, value), text in zip(parsed, overrides or []):
            # shorthands (model: NAME) become mappings before a dotted override reaches into them
            _apply_override(raw, path, value, text)
        raw = _normalise(raw)
        return ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise KvevalError(f"{source}: {_error_line(exc)}") from None
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, normalise, override and validate a YAML experiment config."""
    path = Path(path)
    if not path.is_file():
        raise KvevalError(f"config file '{path}' does not exist (the configs/ folder has examples)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise KvevalError(f"{path}: not valid YAML{at}; check the indentation and quoting") from None
    return validate(raw, str(path), overrides)
