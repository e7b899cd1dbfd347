"""``kveval calibrate CONFIG [--out FILE]``: static K/V scales from the corpus tail, written as a scales file."""

from __future__ import annotations

from pathlib import Path

from kveval.calibration.calibrate import calibrate, calibration_slice, default_output
from kveval.errors import KvevalError


def calibrate_command(config_path: str, overrides: list[str] | None = None, out: str | None = None,
                      quiet: bool = False) -> Path:
    """``kveval calibrate``: load the config's model and corpus, calibrate, write the scales file; returns its path."""
    import sys

    from rich.console import Console

    from kveval.config import load_config
    from kveval.data import load_tokens
    from kveval.models import load_model
    from kveval.progress import Progress

    cfg = load_config(config_path, overrides)
    path = Path(out) if out else default_output(cfg)
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(f"[bold]kveval calibrate[/] {cfg.name}: {cfg.model.name} on {cfg.data.source}, "
                  f"{cfg.calibration.tokens} tokens, method {cfg.calibration.method}")
    model, tokenizer = load_model(cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
                                  trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed)
    d = cfg.data
    tokens = load_tokens(d.source, tokenizer, split=d.split, text_field=d.text_field)
    calibration_slice(len(tokens), cfg.calibration.tokens)  # errors before any slow work
    try:
        written = calibrate(model, tokenizer, tokens, cfg, path, Progress(console, quiet=quiet))
    except OSError as exc:
        raise KvevalError(f"cannot write the scales file {path}: {exc}") from None
    console.print(f"scales: {written}")
    return written
