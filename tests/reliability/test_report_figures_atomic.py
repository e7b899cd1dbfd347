"""PNG figures are written atomically: rendered in memory, then put in place by one rename from a hidden sibling
(kveval.fileio.atomic_path). An interrupted or failed figure write leaves the previous figure whole (or none), never
a truncated PNG and never a temporary file; a symbolic link in a figure's place is replaced, never written through.

No model: figures are drawn from hand-written metrics or a synthetic run (tests/synthetic_runs.py).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from synthetic_runs import write_synthetic_run
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.report import report_command
from kveval.report.plots import save
from kveval.tasks.needle.reporting import plot_needle
from kveval.tasks.sensitivity.reporting import plot_sensitivity

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PREVIOUS = PNG_MAGIC + b"the previous figure"

SCAN_METRICS = {"sensitivity": {"specs": ["int2_g32"], "cells": [
    {"layer": i, "tensor": t, "spec": "int2_g32", "kld": 0.1 * (i + 1) * (3 if t == "key" else 1)}
    for i in range(4) for t in ("key", "value")]}}
NEEDLE_METRICS = {
    "baseline": {"needle_cells": [{"variant": "passkey", "context": 64, "depth": 0.5, "accuracy": 1.0,
                                   "logprob": -0.1, "token_acc": 1.0}]},
    "policies": {"int8": {"needle_cells": [{"variant": "passkey", "context": 64, "depth": 0.5, "accuracy": 0.0,
                                            "logprob": -0.9, "token_acc": 0.5}]}},
}


def _fail_fsync_of(monkeypatch, name: str, error: BaseException) -> None:
    """``os.fsync`` raises ``error`` for the temporary sibling of ``name`` (``.<name>.<random>``)."""
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc")
    real = os.fsync

    def fsync(fd):
        if f"/.{name}." in os.readlink(f"/proc/self/fd/{fd}"):
            raise error
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _hidden(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def test_interrupted_task_figure_keeps_the_previous_png(tmp_path, monkeypatch):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "sensitivity_heatmap.png").write_bytes(PREVIOUS)
    _fail_fsync_of(monkeypatch, "sensitivity_heatmap.png", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        plot_sensitivity(SCAN_METRICS, plots)
    assert (plots / "sensitivity_heatmap.png").read_bytes() == PREVIOUS
    assert _hidden(plots) == [], "no temporary file is left"


def test_task_figures_never_render_into_their_final_path(tmp_path, monkeypatch):
    """matplotlib is never handed the path of a figure (where a cut-short write would leave a truncated PNG):
    it renders into memory, and the file appears whole."""
    targets = []
    real = Figure.savefig

    def recording(self, fname, *args, **kwargs):
        targets.append(fname)
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    written = plot_needle(NEEDLE_METRICS, tmp_path / "plots") + plot_sensitivity(SCAN_METRICS, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["needle_baseline.png", "needle_int8.png", "needle_int8_diff.png",
                                               "sensitivity_heatmap.png", "sensitivity_ranked.png"]
    assert len(targets) == len(written)
    assert not any(isinstance(t, (str, os.PathLike)) for t in targets), targets
    for path in written:
        assert path.read_bytes().startswith(PNG_MAGIC), path


def test_a_figure_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"precious")
    (tmp_path / "plot.png").symlink_to(victim)
    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    save(fig, tmp_path / "plot.png")
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "plot.png").is_symlink()
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)


def test_report_on_a_full_disk_keeps_the_previous_figures(tmp_path, monkeypatch):
    """`kveval report` whose figure cannot be written (no space left): one line, exit 2, the previous figure and the
    run's files untouched, no temporary file."""
    run = write_synthetic_run(tmp_path / "run", policies=("int8", "int4_g64"))
    report_command([run])
    before = {p.name: p.read_bytes() for p in (run / "plots").iterdir()}
    metrics = (run / "metrics.json").read_bytes()
    _fail_fsync_of(monkeypatch, "policy_quality.png", OSError(errno.ENOSPC, "No space left on device"))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "No space left on device" in lines[0], lines
    assert (run / "plots" / "policy_quality.png").read_bytes() == before["policy_quality.png"]
    assert (run / "metrics.json").read_bytes() == metrics
    assert _hidden(run / "plots") == [] and not [n for n in _hidden(run) if n.endswith(".png")]


def test_no_module_writes_a_figure_but_the_atomic_writer():
    """Every PNG kveval writes (report, task figures, parity) goes through kveval.report.plots.save: no module
    calls savefig on a path itself."""
    root = Path(__file__).resolve().parents[2] / "kveval"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), start=1):
            if ".savefig(" in line and "savefig(buf" not in line:
                offenders.append(f"{path.relative_to(root)}:{number}")
    assert offenders == [], f"savefig outside kveval.report.plots.save: {offenders}"
