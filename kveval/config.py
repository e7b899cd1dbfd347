"""The experiment config: a closed, typed schema (unknown keys are errors with a "did you mean").

A config is pure data (YAML); nothing in it is executed. Shape::

    name: int4_g64
    model: builtin:smollm2-135m          # or {name: ..., device: cpu|cuda|auto, dtype: float32|float64|...,
                                         #     weights: [int8_channel, int4_g64]}  (weight variants x KV policies)
                                         # big models: {name: ..., device_map: auto, max_memory: {0: 70GiB, cpu: 200GiB}}
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

import contextlib
import contextvars
import copy
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, create_model, field_validator, model_validator

from kveval.errors import KvevalError
from kveval.policy import AUTO_SCALES, KVPolicy
from kveval.results.layout import BASELINE
from kveval.schema import Strict, load_yaml, read_text_file
from kveval.tasks import task_params, task_presets

MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; a bigger file is not a config
MAX_NAME_CHARS = 100  # run and policy names name folders and files (plots/needle_<policy>_diff.png)
MAX_SEED = 2**32 - 1  # every generator kveval seeds (random, torch, numpy) takes it
MAX_BOOTSTRAP = 100_000
MAX_GPU_MEMORY = 2**60  # bytes (1 EiB): a bigger "GPU" is a typo
MAX_TOKENS = 2**31 - 1  # a token count (window, residual, sinks) beyond this overflows index arithmetic
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_NAME_RULE = (f"use letters, digits, '_', '-' and '.' only, not starting with '.' or '-', at most {MAX_NAME_CHARS} "
              "characters")
ALLOW_CODE_HINT = "pass --allow-code on the command line if you trust it"
_ALLOW_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar("kveval_allow_code", default=False)


@contextlib.contextmanager
def code_allowed(allow: bool = True):
    """Within the block, :func:`load_config` calls that do not say otherwise allow code (the command line's
    ``--allow-code`` for verbs whose bodies load the config themselves, such as ``kveval scan``)."""
    token = _ALLOW_CODE.set(bool(allow))
    try:
        yield
    finally:
        _ALLOW_CODE.reset(token)


class ModelConfig(Strict):
    """The model. ``weights``: weight variants to evaluate beside the checkpoint's own weights (always the
    reference), each crossed with every KV policy: ``{NAME: SPEC}`` or ``{NAME: {spec: SPEC, modules: [...]}}``
    (shorthands: one preset name, a list of them; ``none``: the checkpoint alone, the default). See
    :mod:`kveval.weights.spec`."""

    name: str = "builtin:smollm2-135m"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    weights: dict[str, Any] = {}
    #: Place the model's layers across devices with accelerate (big models): a strategy (``auto``, ``balanced``,
    #: ``balanced_low_0``, ``sequential``) or ``{MODULE: DEVICE}`` (``cpu``, ``disk``, ``cuda:N`` or ``N``). Layers
    #: offloaded to ``cpu``/``disk`` are brought to the compute device layer by layer (:func:`kveval.models.load_model`).
    device_map: str | dict[str, str | int] | None = None
    #: Memory per device for a strategy ``device_map``: ``{0: 70GiB, 1: 70GiB, cpu: 200GiB}`` (GPU index or
    #: ``cuda:N``, ``cpu``); what does not fit goes to disk.
    max_memory: dict[str | int, str | int] | None = None

    @field_validator("device_map", "max_memory")
    @classmethod
    def _placement_field(cls, value, info):
        from kveval.models import check_device_map, check_max_memory

        check = check_device_map if info.field_name == "device_map" else check_max_memory
        try:
            check(value)
        except KvevalError as exc:
            raise ValueError(str(exc)) from None  # reported as model.device_map: ... / model.max_memory: ...
        return value

    @model_validator(mode="after")
    def _placement(self):
        """``device_map`` places the layers itself: a ``device`` beside it, ``max_memory`` without a strategy to
        apply it, or quantized weight variants (which swap weights in place, impossible for offloaded layers) are
        refused."""
        if self.device_map is None:
            if self.max_memory is not None:
                raise ValueError("max_memory needs device_map: auto (or balanced, balanced_low_0, sequential) to "
                                 "apply it")
            return self
        if "device" in self.model_fields_set:
            raise ValueError("device and device_map: give one (device_map places the layers on its devices)")
        if isinstance(self.device_map, dict) and self.max_memory is not None:
            raise ValueError("max_memory applies to a strategy (device_map: auto, balanced, balanced_low_0, "
                             "sequential), not to an explicit {module: device} map")
        if self.weights:
            raise ValueError("weights with device_map: weight variants are swapped into the loaded matrices, "
                             "which an offloaded layer does not hold; load the model on one device")
        return self

    @field_validator("weights", mode="before")
    @classmethod
    def _weight_variants(cls, value):
        from kveval.weights.spec import normalise_weights, parse_variants

        value = normalise_weights(value)
        parse_variants(value)  # raises KvevalError with a clear line (model.weights.NAME: ...)
        return value

    def weight_variants(self) -> dict:
        """``{NAME: WeightVariant}`` in config order (empty: the checkpoint alone)."""
        from kveval.weights.spec import parse_variants

        return parse_variants(self.weights)


class DataConfig(Strict):
    source: str = "builtin"
    text_field: str = "text"
    split: str | None = None


TASK_TYPES: dict[str, type[Strict]] = task_params()  # the parameter modules only, never the evaluators


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

    @field_validator("gpu_memory")
    @classmethod
    def _size(cls, value):
        from kveval.units import parse_size

        try:
            n = parse_size(value)
        except (OverflowError, ValueError):  # 1e400GiB: infinity
            raise ValueError(f"gpu_memory {value!r} is not a finite size; write e.g. 80GiB") from None
        except KvevalError as exc:
            raise ValueError(str(exc)) from None
        if n > MAX_GPU_MEMORY:
            raise ValueError(f"gpu_memory {value!r} is larger than any GPU (at most 1EiB)")
        return value


class CalibrationConfig(Strict):
    """How ``kveval calibrate`` (and ``scales: auto`` policies) compute static scales: on the last ``tokens`` tokens
    of the config's corpus in windows of ``seq_len``, by ``method`` (absmax | percentile | mse; ``target``: the
    preset mse optimises for; ``minmax_ema``: llm-compressor's moving average of each window's min and max,
    weight ``averaging_constant``). ``outliers``: fractions p for which ranges of the dense part (each vector without
    its ceil(p * head_dim) largest magnitudes) are added, for specs with ``outliers: p``. Runs refuse scales whose tokens overlap the perplexity tokens unless
    ``allow_overlap``. ``output``: where ``kveval calibrate`` writes (default ``results/scales/<name>.safetensors``)."""

    tokens: int = Field(2048, gt=1)
    seq_len: int = Field(512, gt=1)
    method: Literal["absmax", "percentile", "mse", "minmax_ema"] = "absmax"
    percentile: float = Field(99.9, ge=50, le=100)
    #: method minmax_ema (llm-compressor's default KV observer, kveval.scales.ema): the weight of each new window
    averaging_constant: float = Field(0.01, gt=0, le=1)
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
            if name == BASELINE:
                raise ValueError(f"the policy name '{BASELINE}' is reserved for the full-precision reference "
                                 "(always run); name your policy otherwise")
            if len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
                raise ValueError(f"policy name {name!r}: {_NAME_RULE} (it names files)")
            policy = KVPolicy.from_config(cfg, name=name)  # raises KvevalError with a clear line
            for field in ("residual", "sink_tokens"):
                if getattr(policy, field) > MAX_TOKENS:
                    raise ValueError(f"policy '{name}': {field} {getattr(policy, field)} is more tokens than any "
                                     f"context (at most {MAX_TOKENS})")
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
    output: str | None = Field(None, min_length=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    # Not a config key: set by the command line (kveval run --allow-code) or validate(allow_code=True) only.
    _allow_code: bool = PrivateAttr(default=False)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value):
        if len(value) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(value):
            raise ValueError(f"{_NAME_RULE} (it names the results folder)")
        return value

    @model_validator(mode="after")
    def _task_ranges(self):
        """Values that would fail only after the evaluation (no window to score, a bootstrap that does not fit in
        memory, more position bins than positions): refused here, before the first forward pass."""
        for i, entry in enumerate(self.tasks):
            p = entry.params
            max_tokens = getattr(p, "max_tokens", None)
            if max_tokens is not None and max_tokens < 2:
                raise ValueError(f"tasks[{i}].{entry.kind}.max_tokens {max_tokens}: at least 2 tokens are needed "
                                 "(the first one only gives context)")
            bootstrap = getattr(p, "bootstrap", None)
            if isinstance(bootstrap, int) and bootstrap > MAX_BOOTSTRAP:
                raise ValueError(f"tasks[{i}].{entry.kind}.bootstrap {bootstrap} is more than {MAX_BOOTSTRAP} "
                                 "resamples (1000 give a stable 95% interval)")
            bins, seq_len = getattr(p, "position_bins", None), getattr(p, "seq_len", None)
            if isinstance(bins, int) and isinstance(seq_len, int) and bins > seq_len:
                raise ValueError(f"tasks[{i}].{entry.kind}.position_bins {bins} is more than seq_len {seq_len}")
        return self

    @model_validator(mode="after")
    def _distinct_tasks(self):
        """Two entries of one kind are told apart by their place (the later one's records and metrics carry
        ``tasks[i]``: :func:`kveval.results.store.task_label`) and by their parameters; two identical entries
        would compute the same numbers twice under two labels that say nothing: refused here."""
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.tasks):
            key = repr(sorted(entry.params.model_dump(mode="json").items()))
            first = seen.setdefault(f"{entry.kind}:{key}", i)
            if first != i:
                raise ValueError(f"tasks[{i}] repeats tasks[{first}] (the same {entry.kind} task with the same "
                                 "parameters), so their results could not be told apart; remove one, or change "
                                 "a parameter")
        return self

    @model_validator(mode="after")
    def _weights_need_perplexity(self):
        """Weight variants are measured by the perplexity task (every window under every weight variant x KV
        policy); any other task would silently run on the checkpoint's weights alone: refused."""
        if not self.model.weights:
            return self
        kinds = [entry.kind for entry in self.tasks]
        other = next((i for i, k in enumerate(kinds) if k != "perplexity"), None)
        if other is not None:
            raise ValueError(f"model.weights: weight variants are measured by the perplexity task only; "
                             f"tasks[{other}] ({kinds[other]}) would run on the checkpoint's weights alone: run it "
                             "from a config without model.weights")
        return self

    @property
    def allow_code(self) -> bool:
        """Whether this run may execute code that its inputs name (lm-eval include folders with Python,
        ``trust_remote_code``): only by an explicit opt-in outside the config (``kveval run --allow-code``)."""
        return self._allow_code

    def policies(self) -> dict[str, KVPolicy]:
        """The policies to compare, by name, in config order (the FP baseline is implicit and always run)."""
        return {name: KVPolicy.from_config(cfg, name=name) for name, cfg in self.kv.policies.items()}

    @model_validator(mode="after")
    def _run_folder(self):
        self.output_dir()  # the run folder's own checks (kveval.results.layout.run_folder): one KvevalError line
        return self

    def output_dir(self) -> Path:
        """The run folder: ``output`` (``~`` expanded), else ``results/<name>`` (:func:`kveval.results.layout.run_folder`)."""
        from kveval.results.layout import run_folder

        return run_folder(self.name, self.output)

    def resolved(self) -> dict:
        """Plain data after defaults, with every policy expanded to its full form (written as config.resolved.yaml)."""
        data = self.model_dump(mode="json")
        if self.calibration == CalibrationConfig():
            del data["calibration"]  # default: left out, so that runs from before the section existed still resume
        elif self.calibration.averaging_constant == CalibrationConfig().averaging_constant:
            del data["calibration"]["averaging_constant"]  # likewise for runs from before minmax_ema
        if self.plan is None:
            del data["plan"]
        if self.model.weights:  # every variant in its full form ({spec: {QuantSpec fields}, modules: [...]})
            data["model"]["weights"] = {n: v.to_config() for n, v in self.model.weight_variants().items()}
        else:
            del data["model"]["weights"]  # default: left out, so that runs from before weights existed resume
        for key in ("device_map", "max_memory"):  # left out when unset, so that older run folders resume
            if data["model"].get(key) is None:
                del data["model"][key]
        if self.model.device_map is not None:
            del data["model"]["device"]  # the device map places the layers (and the resolved form re-validates)
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
    if isinstance(raw.get("model"), dict) and "weights" in raw["model"]:
        from kveval.weights.spec import normalise_weights

        raw["model"]["weights"] = normalise_weights(raw["model"]["weights"])  # so that overrides reach variants
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
    data = load_yaml(read_text_file(presets[name], "task preset"), str(presets[name]))
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


def _fields_at(loc: tuple, root: type[BaseModel]) -> list[str]:
    """The valid keys of the mapping at ``loc`` (the location of an unknown key, without the key itself) in the
    schema ``root``."""
    classes: list[type[BaseModel]] = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        nxt = []
        for cls in classes:
            if part in cls.model_fields:
                nxt.extend(_model_classes(cls.model_fields[part].annotation))
        classes = nxt
    return sorted({f for cls in classes for f in cls.model_fields})


def schema_error_line(err: ValidationError, root: type[BaseModel], *, unknown_key_first: bool = False) -> str:
    """One line for a schema error of a document validated against ``root``: the key path, what is wrong, and
    "did you mean" for an unknown key. ``unknown_key_first``: report an unknown key (a typo) before the other
    errors, which it may cause; else the first error."""
    errors = err.errors()
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0]) if unknown_key_first else errors[0]
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = _loc_text(loc)
    if e["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1], root)
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
        value = load_yaml(value_text, f"override '{item}'")  # strict: no duplicate keys, no tags
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


def validate(raw: Any, source: str = "config", overrides: list[str] | None = None, *,
             allow_code: bool = False) -> ExperimentConfig:
    """Validate plain data (already parsed YAML) into an ExperimentConfig; errors are one-line KvevalErrors.

    ``allow_code``: the opt-in (``kveval run --allow-code``, never a config key) that lets the run execute code
    its inputs name: ``model.trust_remote_code: true`` is refused without it, and so (at run time, or by
    :func:`check_inputs`) is an lm-eval ``include_path`` that holds Python.
    """
    if not isinstance(raw, dict):
        raise KvevalError(f"{source}: expected a YAML mapping at the top level")
    try:
        raw = _normalise(raw)
        parsed = parse_overrides(overrides or [])
        for (path, value), text in zip(parsed, overrides or []):
            # shorthands (model: NAME) become mappings before a dotted override reaches into them
            _apply_override(raw, path, value, text)
        raw = _normalise(raw)
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise KvevalError(f"{source}: {schema_error_line(exc, ExperimentConfig)}") from None
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None
    except RecursionError:  # a structure nested past Python's stack (only from Python callers: YAML is capped)
        raise KvevalError(f"{source}: nested too deeply") from None
    cfg._allow_code = bool(allow_code)
    if cfg.model.trust_remote_code and not allow_code:
        raise KvevalError(f"{source}: model.trust_remote_code: true runs Python code from the model's folder or hub "
                          f"repository; configs are pure data: {ALLOW_CODE_HINT}")
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None, *, allow_code: bool | None = None,
                check: bool = True) -> ExperimentConfig:
    """Read (UTF-8, at most ``MAX_CONFIG_BYTES``), parse (strict YAML: no duplicate keys, no tags), normalise,
    override and validate a YAML experiment config; with ``check`` (the default) also :func:`check_inputs`.
    ``allow_code``: see :func:`validate` (default: False, or True inside :func:`code_allowed`)."""
    if allow_code is None:
        allow_code = _ALLOW_CODE.get()
    path = Path(path)
    if not path.exists():
        raise KvevalError(f"config file '{path}' does not exist (the configs/ folder has examples)")
    text = read_text_file(path, "config file", max_bytes=MAX_CONFIG_BYTES)
    cfg = validate(load_yaml(text, str(path)), str(path), overrides, allow_code=allow_code)
    if check:
        check_inputs(cfg, str(path))
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Inputs on this machine: what run would refuse later, refused before the first forward pass (and by validate)
# ---------------------------------------------------------------------------------------------------------------
_NAMED_CORPORA = ("builtin", "wikitext2", "pg19")
_MAX_COMPONENT = 240  # bytes of one path component: NAME_MAX (255) less room for atomic writes' temporary names


def check_inputs(cfg: ExperimentConfig, source: str = "config") -> None:
    """What the config names on this machine, checked without loading a model (``kveval validate`` and ``kveval
    run`` both call it, before anything is written).

    The model name (a builtin, an existing local folder whose config parses, with safetensors weights and no code
    it would need, a GGUF file), a CUDA device that exists, an output folder that can be created (not a file, no
    file in its way, writable, names not too long), ``calibration.output`` likewise, the cache root
    (``KVEVAL_CACHE``) a folder, a local corpus file that reads as non-empty UTF-8 text with string text fields,
    an lm-eval include folder that exists and holds no code unless ``allow_code``, ``scales:`` files and the
    ``plan:`` file that are what they claim to be. Errors are one KvevalError line starting with ``source``."""
    from kveval.models import check_model_source
    from kveval.paths import check_cache_root

    try:
        check_model_source(cfg.model.name, cfg.model.trust_remote_code)
        _check_windows_fit(cfg)
        _check_weight_widths(cfg)
        from kveval.weights.spec import check_variant_files

        check_variant_files(cfg.model.weight_variants())
        if cfg.model.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise KvevalError("model.device: cuda requested but CUDA is not available; use device: cpu or auto")
        if cfg.model.device_map is not None:
            from kveval.models import check_placement_devices

            check_placement_devices(cfg.model.device_map, cfg.model.max_memory)
        check_writable_path(cfg.output_dir(), "output", folder=True)
        if cfg.calibration.output:
            check_writable_path(Path(cfg.calibration.output), "calibration.output", folder=False)
        check_cache_root()
        if cfg.data.source not in _NAMED_CORPORA:
            from kveval.data import load_text

            load_text(cfg.data.source, split=cfg.data.split, text_field=cfg.data.text_field)
        for entry in cfg.tasks:
            if entry.kind == "lm_eval":
                from kveval.tasks.lm_eval.task import check_include_path

                check_include_path(entry.params.include_path, allow_code=cfg.allow_code)
        from kveval.scales.checkpoint import CHECKPOINT_SCALES, checkpoint_targets

        checkpoint_targets(cfg.model.name, cfg.kv.policies, cfg.policies())  # checkpoint KV scales, as engines load
        for name, policy in cfg.policies().items():
            if policy.needs_scales_file() and policy.scales not in (AUTO_SCALES, CHECKPOINT_SCALES):
                from kveval.scales.file import load_scales

                try:
                    load_scales(str(policy.scales))
                except KvevalError as exc:
                    raise KvevalError(f"policy '{name}': {exc}") from None
        if cfg.plan is not None:
            from kveval.tasks.sensitivity.planner import read_plan_file

            read_plan_file(cfg.plan)
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None


def _check_windows_fit(cfg: ExperimentConfig) -> None:
    """Task windows longer than the model's context, when the context is known without loading the model (the
    tasks' own checks say the same at run time, for every model)."""
    from kveval.models import context_limit_of

    limit = context_limit_of(cfg.model.name)
    if limit is None:
        return
    for i, entry in enumerate(cfg.tasks):
        p = entry.params
        field = "context_lengths" if hasattr(p, "context_lengths") else "seq_len"
        longest = max(getattr(p, field)) if field == "context_lengths" else getattr(p, field, None)
        if isinstance(longest, int) and longest > limit:
            raise KvevalError(f"tasks[{i}].{entry.kind}.{field} {longest} is longer than the model's context "
                              f"({limit} tokens); lower it")


#: The builtin checkpoint's shape, known without reading its GGUF file (kveval validate's weight checks)
_SMOLLM2_DIMS = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "head_dim": 64}


def _model_dims(name: str) -> dict | None:
    """The model's config dict when it is known without loading the model: builtins and local folders with a
    config.json; None otherwise (hub ids, GGUF files: the run checks the loaded matrices)."""
    import json

    if name == "builtin:smollm2-135m":
        return _SMOLLM2_DIMS
    from kveval.models.builtin import TINY_FAMILIES

    if name.removeprefix("builtin:") in TINY_FAMILIES and name.startswith("builtin:"):
        from kveval.models import tiny_model_config

        return tiny_model_config(name).to_dict()
    path = Path(name).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _check_weight_widths(cfg: ExperimentConfig) -> None:
    """Weight variants whose group size cannot tile the model's projections, when the model's widths are known
    without loading it (the run checks every loaded matrix again, for every model)."""
    if not cfg.model.weights:
        return
    from kveval.weights.spec import check_widths, widths_from_config

    widths = widths_from_config(_model_dims(cfg.model.name))
    if widths is not None:
        check_widths(cfg.model.weight_variants(), widths, cfg.model.name)


def check_writable_path(path: Path, what: str, *, folder: bool) -> None:
    """KvevalError unless ``path`` (a folder with ``folder``, else a file) could be created or written here:
    nothing of the other kind in its place, no file among its parents, the nearest existing folder writable,
    every name at most ``_MAX_COMPONENT`` bytes. Creates nothing."""
    for part in path.parts:
        if len(os.fsencode(part)) > _MAX_COMPONENT:
            raise KvevalError(f"{what} '{path}': the name '{part[:40]}...' is longer than the file system allows "
                              f"({_MAX_COMPONENT} bytes); shorten it")
    if len(os.fsencode(str(path.absolute()))) > 3800:
        raise KvevalError(f"{what} '{path}': the path is longer than the file system allows; shorten it")
    if path.exists():
        if folder and not path.is_dir():
            raise KvevalError(f"{what} '{path}' is a file, not a folder; choose another output")
        if not folder and path.is_dir():
            raise KvevalError(f"{what} '{path}' is a folder, not a file")
        if not folder and not path.is_file():  # /dev/null, a pipe: an atomic write would replace it
            raise KvevalError(f"{what} '{path}' is not a regular file; give the path of a file to write")
        target = path if path.is_dir() else path.parent
    else:
        target = path.absolute().parent
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise KvevalError(f"{what} '{path}': '{target}' is a file, so no folder can be made under it")
    if not os.access(target, os.W_OK | os.X_OK):
        raise KvevalError(f"{what} '{path}': '{target}' is not writable (permission denied or a read-only file "
                          "system); choose another output")
