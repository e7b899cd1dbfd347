"""Ctrl-C (SIGINT) while a report is written: exit status 130 (the shells' convention for an interrupt, never the
2 of bad input), one line on stderr, no traceback, and no half-written file: the run's records and metrics stay
whole, every figure is the previous one or none, and no temporary file is left. A rerun of the same command
finishes the job.

In-process cases raise KeyboardInterrupt where a real Ctrl-C would land (the fsync of a figure's temporary file);
one case sends a real SIGINT to a ``kveval run`` process while it writes the report at the end of the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from synthetic_runs import write_synthetic_run
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.report import report_command
from kveval.results import LOCK_FILE

ROOT = Path(__file__).resolve().parents[2]

# Sends this process a real SIGINT when the temporary file of plots/policy_quality.png is flushed (the report at
# the end of the run), then runs the kveval command line given in argv.
_INTERRUPT_AT_FIGURE = """
import os, signal, sys
real_fsync = os.fsync
def fsync(fd):
    if "/.policy_quality.png." in os.readlink(f"/proc/self/fd/{fd}"):
        os.kill(os.getpid(), signal.SIGINT)
    return real_fsync(fd)
os.fsync = fsync
from kveval.cli import app
sys.argv = ["kveval", *sys.argv[1:]]
app()
"""


def _interrupted(result) -> None:
    assert result.exit_code == 130, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted;") and "rerun the same command" in lines[0], lines


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _temporaries(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if p.name != ".kveval-run.json")


@pytest.fixture
def needs_proc():
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc")


def test_ctrl_c_while_a_figure_is_written_exits_130(tmp_path, monkeypatch, needs_proc):
    run = write_synthetic_run(tmp_path / "run", policies=("int8", "int4_g64"))
    report_command([run])
    before = _snapshot(run)
    real_fsync = os.fsync

    def interrupted(fd):
        if "/.policy_quality.png." in os.readlink(f"/proc/self/fd/{fd}"):
            raise KeyboardInterrupt
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    result = CliRunner().invoke(app, ["report", str(run)])
    monkeypatch.setattr(os, "fsync", real_fsync)
    _interrupted(result)
    assert _snapshot(run) == before, "every file is the previous one"
    assert _temporaries(run) == [] and not (run / LOCK_FILE).exists()


def test_ctrl_c_while_the_error_line_prints_still_exits_130(tmp_path, monkeypatch):
    """A Ctrl-C that lands while the line of a bad-input error is being printed: the command was interrupted, so
    130, with the interrupt's line, never a traceback nor click's 'Aborted!' (exit 1)."""
    import kveval.cli as cli

    real_print = cli.err_console.print

    def print_interrupted(*args, **kwargs):
        if str(args[0]).startswith("error:"):
            raise KeyboardInterrupt
        return real_print(*args, **kwargs)

    monkeypatch.setattr(cli.err_console, "print", print_interrupted)
    _interrupted(CliRunner().invoke(app, ["report", str(tmp_path / "missing")]))


def test_real_sigint_during_the_run_report_exits_130_and_the_rerun_finishes(tmp_path, needs_proc):
    out = tmp_path / "run"
    raw = {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"], "output": str(out),
           "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 64, "bootstrap": 0, "noise_windows": 0,
                                     "position_bins": 2}}]}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_FIGURE, "run", str(config), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job ignores it
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "interrupted; rerun the same command" in proc.stderr
    records = (out / "records.jsonl").read_text()
    metrics = json.loads((out / "metrics.json").read_text())  # whole: written before the report began
    assert metrics["policies"]["int8"]["verdict"] in ("pass", "fail", "within_noise")
    assert not (out / "plots" / "policy_quality.png").exists(), "the interrupted figure is absent, not truncated"
    assert _temporaries(out) == [] and not (out / LOCK_FILE).exists()

    result = CliRunner().invoke(app, ["run", str(config), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "records.jsonl").read_text() == records, "the rerun resumes: no unit is computed again"
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert (out / "plots" / "policy_quality.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "report.md").exists()
