"""``kveval scan CONFIG [--naive]``: run a config holding a ``sensitivity`` task (the per-layer scan)."""

from __future__ import annotations

from kveval.errors import KvevalError


def scan_command(config_path: str, overrides: list[str] | None = None, naive: bool = False,
                 overwrite: bool = False, quiet: bool = False) -> dict:
    """``kveval scan CONFIG``: run a config holding a ``sensitivity`` task; returns the metrics.

    ``naive``: the same scan without prefix reuse (for checking), written to ``<output>-naive``. The folder is
    a run folder like any other (:func:`kveval.commands.run.run_experiment`: one owner at a time, checks before
    any write).
    """
    from kveval.commands.run import run_experiment
    from kveval.config import load_config

    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    indices = [i for i, t in enumerate(cfg.tasks) if t.kind == "sensitivity"]
    if not indices:
        raise KvevalError(f"{config_path}: no 'sensitivity' task; kveval scan needs one (see configs/layer_scan.yaml)")
    if naive:
        from kveval.results.layout import run_folder

        extra = [f"tasks[{i}].sensitivity.naive=true" for i in indices]
        extra.append(f"output={run_folder(cfg.name, cfg.output)}-naive")  # contained, '~' expanded
        cfg = load_config(config_path, overrides + extra)
    return run_experiment(cfg, overwrite=overwrite, quiet=quiet, config_path=str(config_path))
