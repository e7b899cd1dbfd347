"""``kveval scan CONFIG [--naive]``: run a config holding a ``sensitivity`` task (the per-layer scan)."""

from __future__ import annotations

from kveval.errors import KvevalError


def engine_specs(engine: str) -> list[str]:
    """The cache types ``engine`` can run, as scan specs: what ``--engine`` scans. Every type of its table but the
    model's own dtype (nothing to scan: a planned layer may keep it where the engine allows) and the per-tensor
    and per-head types whose scales come from calibration (``fp8_e4m3_tensor``, ``fp8_e4m3_head``: a scan
    quantizes with dynamic statistics; ``kveval calibrate`` and a run with ``scales:`` measure those)."""
    from kveval.engines.names import check_engine_names
    from kveval.engines.tables import ENGINES
    from kveval.quant import preset

    check_engine_names([engine])

    def calibrated(name: str) -> bool:
        spec = preset(name)
        return spec.granularity in ("tensor", "head") and spec.static_scale is None

    return list(dict.fromkeys(s for t in ENGINES[engine].types for s in t.specs
                              if s != "none" and not calibrated(s)))


def engine_scan_line(config: str, engine: str, out: str) -> str:
    """The command that scans what ``engine`` runs, as a user pastes it: ``kveval scan CONFIG --engine E -o OUT``."""
    import shlex

    return shlex.join(["kveval", "scan", config, "--engine", engine, "-o", out])


def scan_command(config_path: str, overrides: list[str] | None = None, naive: bool = False,
                 overwrite: bool = False, quiet: bool = False, engine: str | None = None) -> dict:
    """``kveval scan CONFIG``: run a config holding a ``sensitivity`` task; returns the metrics.

    ``naive``: the same scan without prefix reuse (for checking), written to ``<output>-naive``. ``engine``: scan
    the cache types that engine can run (:func:`engine_specs`) in place of the config's specs, into
    ``<output>-<engine>`` unless an output is given; ``kveval plan SCAN --engine E`` then plans among them. The
    folder is a run folder like any other (:func:`kveval.commands.run.run_experiment`: one owner at a time, checks
    before any write).
    """
    from kveval.commands.run import run_experiment
    from kveval.config import load_config
    from kveval.results.layout import run_folder

    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    indices = [i for i, t in enumerate(cfg.tasks) if t.kind == "sensitivity"]
    if not indices:
        raise KvevalError(f"{config_path}: no 'sensitivity' task; kveval scan needs one (see configs/layer_scan.yaml)")
    if engine is not None:
        specs = engine_specs(engine)
        extra = [f"tasks[{i}].sensitivity.specs=[{','.join(specs)}]" for i in indices]
        if not any(o.startswith("output=") for o in overrides):
            extra.append(f"output={run_folder(cfg.name, cfg.output)}-{engine}")
        overrides = overrides + extra
        cfg = load_config(config_path, overrides)
    if naive:
        extra = [f"tasks[{i}].sensitivity.naive=true" for i in indices]
        extra.append(f"output={run_folder(cfg.name, cfg.output)}-naive")  # contained, '~' expanded
        cfg = load_config(config_path, overrides + extra)
    return run_experiment(cfg, overwrite=overwrite, quiet=quiet, config_path=str(config_path))
