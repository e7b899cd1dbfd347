"""``kveval calibrate CONFIG [--out FILE] [--export compressed-tensors DIR [--strategy tensor|attn_head]]``: static
K/V scales from the corpus tail, written as a scales file; with ``--export`` also as a checkpoint folder that vLLM
loads (:mod:`kveval.calibration.export`)."""

from __future__ import annotations

import os
from pathlib import Path

from kveval.calibration.calibrate import calibrate, calibration_slice, default_output
from kveval.errors import KvevalError


def calibrate_command(config_path: str, overrides: list[str] | None = None, out: str | None = None,
                      quiet: bool = False, export: tuple[str, str] | None = None, strategy: str = "tensor") -> Path:
    """``kveval calibrate``: load the config's model and corpus, calibrate, write the scales file; returns its path.

    ``out`` (``~`` expanded; default ``calibration.output`` or ``results/scales/<name>.safetensors``) is replaced
    atomically. When it lies in a kveval run folder, that folder's lock is held meanwhile (refused, one line, while
    a run writes there) and it must not take the name of one of the run's other files. ``export``: (format, folder),
    the checkpoint folder to write from the scales (``compressed-tensors``: FP8 E4M3 KV scales per tensor, or per
    KV head with ``strategy`` ``attn_head``); checked before anything is computed.
    """
    from kveval.config import load_config

    cfg = load_config(config_path, overrides)
    path = Path(os.path.expanduser(str(out))) if out else default_output(cfg)
    target = check_export_target(export[0], export[1], strategy) if export else None
    with _lock_if_run_folder(path, config_path):
        written = _calibrate(cfg, path, quiet=quiet, export=target, strategy=strategy)
    return written


def check_export_target(fmt: str, folder: str | Path, strategy: str) -> Path:
    """The ``--export`` folder, checked before any slow work: a known format and strategy, a folder that does not
    exist or is empty, writable."""
    from kveval.calibration.export import FORMATS
    from kveval.config import check_writable_path
    from kveval.scales.checkpoint import STRATEGIES

    if fmt not in FORMATS:
        raise KvevalError(f"--export {fmt}: the formats kveval writes are {', '.join(FORMATS)}")
    if strategy not in STRATEGIES:
        raise KvevalError(f"--strategy {strategy}: expected one of {', '.join(STRATEGIES)}")
    path = Path(os.path.expanduser(str(folder)))
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "is not a folder" if not path.is_dir() else "is a folder that is not empty"
        raise KvevalError(f"--export {fmt} {path}: it {what}; give a new or empty folder")
    check_writable_path(path, "--export", folder=True)
    return path


def _lock_if_run_folder(path: Path, config_path: str):
    """The lock of ``path``'s folder when that folder is a kveval run folder (a scales file written into a run
    must not change under a run that is using it), else nothing; a scales file may not take the name of another
    of the run's files."""
    from contextlib import nullcontext

    from kveval.results.layout import OWN_FILES, SCALES_FILE
    from kveval.results.lock import lock_folder
    from kveval.results.store import folder_kind

    if folder_kind(path.parent) not in ("marked", "legacy"):
        return nullcontext()
    if path.name in OWN_FILES and path.name != SCALES_FILE:
        raise KvevalError(f"--out {path}: {path.name} is a file of the run in {path.parent}, not a scales file; "
                          f"give another name (a run's calibration is {SCALES_FILE})")
    return lock_folder(path.parent, command=f"kveval calibrate {config_path}", hint="give another file with --out")


def _calibrate(cfg, path: Path, *, quiet: bool, export: Path | None = None, strategy: str = "tensor") -> Path:
    """Load the model and corpus, calibrate, write ``path`` (and the ``export`` checkpoint folder)."""
    import sys

    from rich.console import Console
    from rich.text import Text

    from kveval.data import load_tokens
    from kveval.messages import print_line
    from kveval.models import load_model
    from kveval.progress import Progress

    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(Text.assemble(("kveval calibrate", "bold"), f" {cfg.name}: {cfg.model.name} on {cfg.data.source}, "
                                f"{cfg.calibration.tokens} tokens, method {cfg.calibration.method}"), highlight=False)
    model, tokenizer = load_model(cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
                                  trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed,
                                  device_map=cfg.model.device_map, max_memory=cfg.model.max_memory)
    d = cfg.data
    tokens = load_tokens(d.source, tokenizer, split=d.split, text_field=d.text_field)
    calibration_slice(len(tokens), cfg.calibration.tokens)  # errors before any slow work
    try:
        written = calibrate(model, tokenizer, tokens, cfg, path, Progress(console, quiet=quiet))
    except OSError as exc:
        raise KvevalError(f"cannot write the scales file {path}: {exc}") from None
    print_line(console, f"scales: {written}")
    if export is not None:
        from kveval.calibration.export import export_compressed_tensors

        try:
            done = export_compressed_tensors(model, tokenizer, written, export, strategy)
        except OSError as exc:
            raise KvevalError(f"cannot write the checkpoint folder {export}: {exc}") from None
        print_line(console, f"checkpoint: {done.summary()}")
    return written
