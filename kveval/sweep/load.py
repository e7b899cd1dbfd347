"""Read a sweep file and check every run it expands to, before anything starts.

``load_sweep(path, overrides)`` reads the sweep file (strict YAML, closed schema), the config files it names,
expands the grid (:func:`kveval.sweep.expand.expand`) and validates every run's config exactly as ``kveval run``
does (:func:`kveval.config.validate` with the overrides, then :func:`kveval.config.check_inputs`). Any problem is
one :class:`KvevalError` line naming the sweep file and the run; nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kveval.config import MAX_CONFIG_BYTES, ExperimentConfig, check_inputs, schema_error_line, validate
from kveval.errors import KvevalError
from kveval.schema import load_yaml, read_text_file
from kveval.sweep.expand import SWEEP_OWNED, RunSpec, SweepFile, expand, with_placement


@dataclass
class PlannedRun:
    """A run of the sweep, validated: its spec, the config (``cfg``), its resolved form (what
    ``config.resolved.yaml`` of its folder will hold) and its folder."""

    spec: RunSpec
    cfg: ExperimentConfig
    resolved: dict
    folder: Path

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class SweepPlan:
    """A checked sweep: the file it came from, its schema object, where it writes (``output``) and its runs."""

    path: Path
    sweep: SweepFile
    output: Path
    runs: list[PlannedRun] = field(default_factory=list)


def _read_mapping(path: str | Path, what: str) -> dict:
    """A YAML file that must hold a mapping (a config), read as ``kveval run`` reads configs."""
    text = read_text_file(path, what, max_bytes=MAX_CONFIG_BYTES)
    data = load_yaml(text, str(path))
    if not isinstance(data, dict):
        raise KvevalError(f"{path}: expected a YAML mapping at the top level")
    return data


def load_sweep(path: str | Path, overrides: list[str] | None = None, *, allow_code: bool = False,
               output: str | None = None) -> SweepPlan:
    """The checked sweep of ``path``: every run expanded and validated like ``kveval run CONFIG -s ...``
    (``overrides``: applied to every run after the sweep's own ``set``; ``output``: the sweep's folder instead of
    the file's ``output:``). KvevalError (one line) otherwise, among them an override of a run's ``name`` or
    ``output`` (the sweep names and places each run: every run would share one folder)."""
    path = Path(path)
    if not path.exists():
        raise KvevalError(f"sweep file '{path}' does not exist (configs/sweep_example.yaml is an example)")
    raw = load_yaml(read_text_file(path, "sweep file", max_bytes=MAX_CONFIG_BYTES), str(path))
    if not isinstance(raw, dict):
        raise KvevalError(f"{path}: expected a YAML mapping at the top level")
    try:
        sweep = SweepFile.model_validate(raw)
    except ValidationError as exc:
        raise KvevalError(f"{path}: {schema_error_line(exc, SweepFile, unknown_key_first=True)}") from None
    except KvevalError as exc:
        raise KvevalError(f"{path}: {exc}") from None
    try:
        base = _read_mapping(sweep.base, "base config file") if isinstance(sweep.base, str) else sweep.base
        listed: list[tuple[str | None, dict, str]] = []
        for i, entry in enumerate(sweep.runs):
            if isinstance(entry.config, str):
                data = _read_mapping(entry.config, f"runs[{i}].config file")
                listed.append((None, data, Path(entry.config).stem))
            else:
                name = entry.config.get("name")
                if entry.name is None and not isinstance(name, str):
                    raise KvevalError(f"runs[{i}]: an inline config needs a name (name: beside config:)")
                listed.append((name if isinstance(name, str) else None, entry.config, f"runs{i}"))
        specs = expand(sweep, base, listed)
    except KvevalError as exc:
        raise KvevalError(f"{path}: {exc}") from None
    for override in overrides or []:
        _not_owned(override, f"-s {override}", "-o DIR on the command line")
    for spec in specs:
        for override in spec.overrides:
            _not_owned(override, f"{path}: run '{spec.name}' ({spec.source}): set: {override}",
                       "output: in the sweep file, or -o DIR")
    output = output or sweep.output_dir()
    plan = SweepPlan(path=path, sweep=sweep, output=Path(output).expanduser(), runs=[])
    seen: dict[str, str] = {}
    for spec in specs:
        source = f"{path}: run '{spec.name}' ({spec.source})"
        cfg = validate(with_placement(spec, output), source, [*spec.overrides, *(overrides or [])],
                       allow_code=allow_code)
        check_inputs(cfg, source)
        resolved = cfg.resolved()
        experiment = yaml.safe_dump({k: v for k, v in resolved.items() if k not in ("name", "output")},
                                    sort_keys=True)
        if experiment in seen:
            raise KvevalError(f"{path}: runs '{seen[experiment]}' and '{spec.name}' are the same experiment "
                              "(identical configs but for their names); remove one")
        seen[experiment] = spec.name
        plan.runs.append(PlannedRun(spec, cfg, resolved, cfg.output_dir()))
    return plan


def _not_owned(override: str, where: str, instead: str) -> None:
    """KvevalError (one line) where ``override`` sets what the sweep owns: a run's ``name`` or ``output``."""
    key = override.split("=", 1)[0].strip()
    if key in SWEEP_OWNED:
        fix = (f"set the sweep's folder with {instead}" if key == "output" else
               "a run's name comes from its grid labels or its runs[].name")
        raise KvevalError(f"{where}: the sweep names each run and puts it in <sweep folder>/runs/<run>, so every "
                          f"run would get this {key}; {fix}")


def resolved_yaml(resolved: dict[str, Any]) -> str:
    """A run's resolved config as the YAML file the sweep writes and its ``kveval run`` reads."""
    return yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True)
