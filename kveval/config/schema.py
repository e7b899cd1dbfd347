"""The experiment config's schema: :class:`ExperimentConfig` and its parts (model, data, kv, tasks, threshold,
memory, calibration), closed pydantic models (an unknown key is an error; :mod:`kveval.config.load` words it).

The tasks' entries are built from the tasks' parameter classes (:func:`kveval.tasks.task_params`: the parameter
modules only, never the evaluators): one optional field per registered task, so that an unknown key inside a
task's parameters is reported with its full path. Rules that concern a task are read from its ``Params``
(``OMITTED_AT_DEFAULT``, ``MEASURES_WEIGHT_VARIANTS``: the hooks :mod:`kveval.tasks` describes), never named here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, create_model, field_validator, model_validator

from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.results.layout import BASELINE
from kveval.schema import Strict, Tokens
from kveval.tasks import task_params

MAX_NAME_CHARS = 100  # run and policy names name folders and files (plots/<task>_<policy>_diff.png)
MAX_SEED = 2**32 - 1  # every generator kveval seeds (random, torch, numpy) takes it
MAX_BOOTSTRAP = 100_000
MAX_GPU_MEMORY = 2**60  # bytes (1 EiB): a bigger "GPU" is a typo
MAX_TOKENS = 2**31 - 1  # a token count (window, residual, sinks) beyond this overflows index arithmetic
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_NAME_RULE = (f"use letters, digits, '_', '-' and '.' only, not starting with '.' or '-', at most {MAX_NAME_CHARS} "
              "characters")


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


def _measures_weights(params: type) -> bool:
    """Whether a task's ``Params`` declare that the task measures every weight variant (:mod:`kveval.tasks`)."""
    return bool(getattr(params, "MEASURES_WEIGHT_VARIANTS", False))


# One task: a mapping with exactly one task name, e.g. ``{TASK: {seq_len: 512}}``; one optional field per
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
    and the largest batch that fits a GPU of ``gpu_memory`` (e.g. ``80GiB``) next to the weights; the same bill at
    the deployment context (``memory.deployment`` in metrics.json: ``context`` when set, else the model's context
    limit), which the report's verdict table sizes batches at."""

    context: Tokens | None = Field(None, gt=0)
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
    its ceil(p * head_dim) largest magnitudes) are added, for specs with ``outliers: p``. Runs refuse scales whose tokens overlap the scored tokens unless
    ``allow_overlap``. ``output``: where ``kveval calibrate`` writes (default ``results/scales/<name>.safetensors``)."""

    tokens: int = Field(2048, gt=1)
    seq_len: Tokens = Field(512, gt=1)
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
    def _weights_measured(self):
        """Weight variants are measured by the tasks whose ``Params`` declare ``MEASURES_WEIGHT_VARIANTS`` (every
        window under every weight variant x KV policy); any other task would silently run on the checkpoint's
        weights alone: refused."""
        if not self.model.weights:
            return self
        other = next((i for i, e in enumerate(self.tasks) if not _measures_weights(type(e.params))), None)
        if other is not None:
            names = " or ".join(k for k, cls in TASK_TYPES.items() if _measures_weights(cls))
            measured = f"the {names} task only" if names else "no task"
            raise ValueError(f"model.weights: weight variants are measured by {measured}; "
                             f"tasks[{other}] ({self.tasks[other].kind}) would run on the checkpoint's weights "
                             "alone: run it from a config without model.weights")
        return self

    @property
    def allow_code(self) -> bool:
        """Whether this run may execute code that its inputs name (a task's folder of definitions with Python,
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
        for entry, task in zip(self.tasks, data["tasks"]):  # fields added later, left out at their default
            body = task.get(entry.kind)  # (older run folders resume): the task's Params.OMITTED_AT_DEFAULT
            for key, default in getattr(type(entry.params), "OMITTED_AT_DEFAULT", {}).items():
                if isinstance(body, dict) and body.get(key) == default:
                    del body[key]
        data["kv"] = {"policies": {n: p.to_config() for n, p in self.policies().items()}}
        return data

