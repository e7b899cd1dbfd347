"""A run folder has one owner: two runs at once, a lock held by another process (run, scan, report, calibrate),
a lock left by a killed process, a refused run that leaves no trace, a lock file that is a symbolic link.

Every case runs on builtin:tiny-llama with tiny windows; refusals happen before the model is loaded.
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
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.results import LOCK_FILE
from kveval.results.lock import FolderLock, holder

ROOT = Path(__file__).resolve().parents[2]

# Holds the lock of argv[1] until stdin closes, as another kveval process would.
HOLD = """
import sys
from kveval.results.lock import lock_folder
with lock_folder(sys.argv[1], command="kveval run other.yaml"):
    print("held", flush=True)
    sys.stdin.read()
"""


def tiny(out, **ppl) -> dict:
    params = {"seq_len": 32, "max_tokens": 128, "bootstrap": 0, "noise_windows": 0, "position_bins": 2, **ppl}
    return {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"],
            "tasks": [{"perplexity": params}], "output": str(out)}


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def one_line_exit_2(result, *needles) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


class Holder:
    """Another process holding a folder's lock."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished tiny run (output: run, relative), to copy."""
    base = tmp_path_factory.mktemp("template")
    cwd = os.getcwd()
    os.chdir(base)
    try:
        run_experiment(validate(tiny("run")), quiet=True)
    finally:
        os.chdir(cwd)
    return base / "run"


@pytest.fixture
def run_copy(finished, tmp_path, monkeypatch):
    """(config path, run folder, records text): a copy of the finished run in a fresh working folder."""
    import shutil

    shutil.copytree(finished, tmp_path / "run", symlinks=True)
    monkeypatch.chdir(tmp_path)
    return write(tmp_path / "c.yaml", tiny("run")), tmp_path / "run", (tmp_path / "run" / "records.jsonl").read_text()


def test_two_runs_at_once_one_refused_metrics_equal_single_run(tmp_path):
    """The issue's acceptance test: the same `kveval run` started twice on one folder. One runs, the other is
    refused with one line naming the holder (exit 2); no key is recorded twice; the metrics equal a single run's."""
    cfg = tiny(tmp_path / "shared", max_tokens=32 * 80)
    path = write(tmp_path / "c.yaml", cfg)
    procs = [subprocess.Popen([sys.executable, "-m", "kveval", "run", str(path), "--quiet"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], (codes, [o[1] for o in outs])
    loser = outs[[p.returncode for p in procs].index(2)]
    winner = procs[[p.returncode for p in procs].index(0)]
    lines = [line for line in loser[1].splitlines() if line.strip()]
    assert len(lines) == 1 and "in use by another kveval process" in lines[0], loser[1]
    assert f"pid {winner.pid}" in lines[0] and "kveval run" in lines[0], lines[0]
    assert "Traceback" not in loser[1]

    out = tmp_path / "shared"
    keys = [json.loads(line)["key"] for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys)), "no unit recorded twice"
    assert not (out / LOCK_FILE).exists(), "the lock is released at the end"
    single = run_experiment(validate(tiny(tmp_path / "single", max_tokens=32 * 80)), quiet=True)
    single_keys = [json.loads(line)["key"] for line in (tmp_path / "single" / "records.jsonl").read_text().splitlines()]
    assert sorted(keys) == sorted(single_keys)
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(single))


def test_run_refused_while_another_process_holds_the_folder(run_copy):
    path, out, before = run_copy
    hold = Holder(out)
    try:
        line = one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "in use by another kveval process",
                               f"pid {hold.proc.pid}", "kveval run other.yaml", "wait for it to finish")
        assert "output:" in line
    finally:
        hold.release()
    assert (out / "records.jsonl").read_text() == before, "nothing recorded is touched"


def test_overwrite_refused_while_another_process_holds_the_folder(run_copy):
    path, out, before = run_copy
    hold = Holder(out)
    try:
        one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "-s", "seed=3", "--overwrite"]), "in use")
    finally:
        hold.release()
    assert (out / "records.jsonl").read_text() == before
    assert (out / "metrics.json").is_file()


def test_lock_of_a_killed_process_is_taken_over(run_copy):
    path, out, before = run_copy
    hold = Holder(out)
    hold.kill()  # SIGKILL: the lock file stays, naming a dead process; the kernel dropped its lock
    assert (out / LOCK_FILE).is_file() and holder(out) is None
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert "taking it over" in result.stderr and f"pid {hold.proc.pid}" in result.stderr
    assert not (out / LOCK_FILE).exists()
    assert (out / "records.jsonl").read_text() == before, "a finished run resumes without recomputing"


def test_scan_refused_while_folder_locked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny("scan")
    cfg["tasks"] = [{"sensitivity": {"seq_len": 32, "max_tokens": 32, "specs": ["int8"]}}]
    path = write(tmp_path / "scan.yaml", cfg)
    (tmp_path / "scan").mkdir()
    hold = Holder(tmp_path / "scan")
    try:
        one_line_exit_2(CliRunner().invoke(app, ["scan", str(path)]), "in use", "kveval run other.yaml")
    finally:
        hold.release()
    assert list((tmp_path / "scan").iterdir()) == []


def test_report_refused_while_run_holds_its_folder(run_copy):
    _, out, _ = run_copy
    report = (out / "report.md").read_text()
    hold = Holder(out)
    try:
        line = one_line_exit_2(CliRunner().invoke(app, ["report", str(out)]), "in use", "kveval run other.yaml")
        assert "-o" in line
    finally:
        hold.release()
    assert (out / "report.md").read_text() == report


def test_report_of_a_locked_run_into_another_folder_is_allowed(run_copy, tmp_path):
    _, out, _ = run_copy
    hold = Holder(out)
    try:
        result = CliRunner().invoke(app, ["report", str(out), "-o", str(tmp_path / "elsewhere")])
    finally:
        hold.release()
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "report.md").is_file()


def test_calibrate_into_a_locked_run_folder_is_refused(run_copy):
    path, out, _ = run_copy
    hold = Holder(out)
    try:
        one_line_exit_2(CliRunner().invoke(app, ["calibrate", str(path), "--out", str(out / "scales.safetensors")]),
                        "in use", "--out")
    finally:
        hold.release()
    assert not (out / "scales.safetensors").exists()


def test_calibrate_refuses_to_write_over_a_run_file(run_copy):
    path, out, before = run_copy
    one_line_exit_2(CliRunner().invoke(app, ["calibrate", str(path), "--out", str(out / "records.jsonl")]),
                    "records.jsonl", "not a scales file")
    assert (out / "records.jsonl").read_text() == before


def test_refused_new_folder_leaves_no_trace(tmp_path, monkeypatch):
    """A run refused by a late check (a missing plan file) removes the folders its lock created."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "c.yaml", tiny("new/deep/run"))
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "-s", "plan=nope.plan.json"]), "nope.plan.json")
    assert not (tmp_path / "new").exists()


def test_lock_released_after_a_refused_run(run_copy):
    path, out, _ = run_copy
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "-s", "plan=nope.plan.json"]), "nope.plan.json")
    assert not (out / LOCK_FILE).exists() and holder(out) is None


def test_lock_file_that_is_a_symlink_is_refused(run_copy, tmp_path):
    path, out, before = run_copy
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    (out / LOCK_FILE).symlink_to(target)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "symbolic link", LOCK_FILE)
    assert target.read_text() == "precious\n"
    assert (out / "records.jsonl").read_text() == before


def test_lock_is_reentrant_in_one_process_and_exclusive_across(tmp_path):
    folder = tmp_path / "f"
    with FolderLock(folder, "outer"):
        with FolderLock(folder, "inner"):  # kveval run writing its own report
            assert (folder / LOCK_FILE).exists()
        assert (folder / LOCK_FILE).exists(), "the inner release leaves the outer lock in place"
        info = holder(folder)
        assert info is not None and info["pid"] == os.getpid() and info["command"] == "outer"
        assert {"pid", "host", "command", "started"} <= set(info)
    assert not folder.exists(), "a folder the lock created and nobody wrote is removed"
