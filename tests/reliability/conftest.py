"""Helpers of the hostile-input tests: run the CLI in-process and check the promise for bad input (exit status 2,
one ``error:`` line on stderr, no traceback), and a finished tiny run whose records must survive bad reruns."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kveval.cli import app


def tiny_raw(out: Path | None = None, **extra) -> dict:
    """A valid config on builtin:tiny-llama and the builtin corpus, small enough to run in seconds."""
    raw = {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"],
           "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}]}
    if out is not None:
        raw["output"] = str(out)
    raw.update(extra)
    return raw


def write_config(path: Path, raw: dict | None = None, *, text: str | None = None, data: bytes | None = None) -> Path:
    """Write a config file from plain data, text or raw bytes; returns its path."""
    if data is not None:
        path.write_bytes(data)
    else:
        path.write_text(text if text is not None else yaml.safe_dump(raw, sort_keys=False))
    return path


def invoke(*args: str):
    """``kveval ARGS`` in this process (typer's CliRunner; stderr kept apart)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles: str, strict: bool = True) -> str:
    """Exit status 2, no traceback, exactly one ``error:`` line on stderr holding every needle; with ``strict``
    that line is all of stderr (else lines of third-party progress bars or logs may precede it). Returns it."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    if strict:
        assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


class Helpers:
    """The helpers above, as a fixture (``h``), so that test modules need not import this conftest."""

    tiny_raw = staticmethod(tiny_raw)
    write_config = staticmethod(write_config)
    invoke = staticmethod(invoke)
    assert_user_error = staticmethod(assert_user_error)


@pytest.fixture
def h() -> type[Helpers]:
    """The helpers of this folder: ``h.tiny_raw``, ``h.write_config``, ``h.invoke``, ``h.assert_user_error``."""
    return Helpers


@pytest.fixture
def finished_run(tmp_path):
    """(config path, run folder, records text) of a finished tiny run, for checking that a bad rerun loses nothing."""
    from kveval.commands.run import run_experiment
    from kveval.config import validate

    out = tmp_path / "run"
    raw = tiny_raw(out)
    path = write_config(tmp_path / "c.yaml", raw)
    run_experiment(validate(raw), quiet=True)
    return path, out, (out / "records.jsonl").read_text()
