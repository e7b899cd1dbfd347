"""Loading an experiment config: the YAML file, its shorthands, task presets, ``-s path=value`` overrides, and
one-line schema errors.

``load_config(path, overrides)`` reads and parses the file (strict YAML), expands the shorthands (``model: NAME``,
``kv: [PRESET, ...]``, a task or task preset by name), applies the overrides, validates against
:class:`kveval.config.schema.ExperimentConfig` and, by default, checks the inputs on this machine
(:func:`kveval.config.checks.check_inputs`). Every problem is one :class:`KvevalError` line such as
``configs/x.yaml: tasks[0].TASK.seq_lenn: unknown key; did you mean 'seq_len'?``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ValidationError

from kveval.config.checks import check_inputs
from kveval.config.schema import TASK_TYPES, ExperimentConfig
from kveval.errors import KvevalError
from kveval.schema import load_yaml, read_text_file
from kveval.tasks import task_presets

MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; a bigger file is not a config
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
    """``"TASK"`` -> ``{TASK: {}}``; a preset name (a file in the top-level tasks/presets/) -> its contents;
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
    """``["tasks[0].TASK.seq_len=256", "model.dtype=float64"]`` -> [(path, value)], values parsed as YAML."""
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
    :func:`check_inputs`, through a task's own check) is a task's folder of definitions that holds Python.
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
        where = _override_source(exc, parsed, overrides or []) or source
        raise KvevalError(f"{where}: {schema_error_line(exc, ExperimentConfig)}") from None
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None
    except RecursionError:  # a structure nested past Python's stack (only from Python callers: YAML is capped)
        raise KvevalError(f"{source}: nested too deeply") from None
    cfg._allow_code = bool(allow_code)
    if cfg.model.trust_remote_code and not allow_code:
        raise KvevalError(f"{source}: model.trust_remote_code: true runs Python code from the model's folder or hub "
                          f"repository; configs are pure data: {ALLOW_CODE_HINT}")
    return cfg


def _override_source(exc: ValidationError, parsed: list, texts: list[str]) -> str | None:
    """``-s KEY=VALUE`` when the first schema error lies at or under an override's key (the last such override,
    which wins), so that a typo on the command line is not blamed on the file; None otherwise."""
    loc = tuple(p for p in exc.errors()[0]["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    at = _loc_text(loc)
    for (path, _value), text in reversed(list(zip(parsed, texts))):
        key = _loc_text(tuple(path))
        if at == key or at.startswith(key + ".") or at.startswith(key + "["):
            return f"-s {text}"
    return None


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

