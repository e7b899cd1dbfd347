"""Where a run may write, and what --overwrite may remove: output: . and name: . / .. / a/b, ~ in output, a late
check after --overwrite, the user's files inside and beside run folders, run folders of an older kveval, an output
that is a file or cannot be written.

Every case runs on builtin:tiny-llama with tiny windows; refusals happen before the model is loaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.errors import KvevalError
from kveval.paths import cache_root
from kveval.results import LOCK_FILE, MARKER_FILE, run_folder


def tiny(out, **ppl) -> dict:
    params = {"seq_len": 32, "max_tokens": 128, "bootstrap": 0, "noise_windows": 0, "position_bins": 2, **ppl}
    cfg = {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"],
           "tasks": [{"perplexity": params}]}
    if out is not None:
        cfg["output"] = str(out)
    return cfg


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


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): to prove nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` where no file can be created: mode 0555, or for root (whom modes do not stop) the immutable
    attribute; skips the test where neither works."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("cannot make a folder read-only for root here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
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
    """(config path, run folder): a copy of a finished run (output: run) in a fresh working folder."""
    shutil.copytree(finished, tmp_path / "run", symlinks=True)
    monkeypatch.chdir(tmp_path)
    return write(tmp_path / "c.yaml", tiny("run")), tmp_path / "run"


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working folder holding the user's own files (and a config)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.md").write_text("my notes\n")
    (work / "data").mkdir()
    (work / "data" / "corpus.txt").write_text("my corpus\n")
    monkeypatch.chdir(work)
    return work


def test_overwrite_with_output_dot_deletes_nothing(workdir):
    path = write(workdir / "c.yaml", tiny("."))
    before = snapshot(workdir)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "--overwrite"]), "not a kveval run's",
                    "never deletes")
    assert snapshot(workdir) == before
    assert not (workdir / LOCK_FILE).exists()


def test_output_dot_without_overwrite_writes_nothing(workdir):
    path = write(workdir / "c.yaml", tiny("."))
    before = snapshot(workdir)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "not a kveval run's", "output:")
    assert snapshot(workdir) == before and sorted(os.listdir(workdir)) == ["c.yaml", "data", "notes.md"]


def test_name_dot_with_overwrite_keeps_the_other_runs(workdir, finished):
    shutil.copytree(finished, workdir / "results" / "other")
    cfg = tiny(None)
    cfg["name"] = "."
    path = write(workdir / "c.yaml", cfg)
    before = snapshot(workdir)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "--overwrite"]), "name:", "'.'")
    assert snapshot(workdir) == before


def test_name_dotdot_does_not_write_into_the_working_folder(workdir):
    cfg = tiny(None)
    cfg["name"] = ".."
    path = write(workdir / "c.yaml", cfg)
    before = snapshot(workdir)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "name:", "'..'")
    assert snapshot(workdir) == before and not (workdir / "results").exists()


def test_name_with_a_path_separator_is_refused(workdir):
    cfg = tiny(None)
    cfg["name"] = "../../escape"
    path = write(workdir / "c.yaml", cfg)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "name", "../../escape")
    assert not (workdir.parent.parent / "escape").exists() and not (workdir / "results").exists()


def test_output_tilde_is_the_home_folder(workdir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVAL_CACHE", str(cache_root()))  # the token cache stays where it is
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    path = write(workdir / "c.yaml", tiny("~/kv_runs/tiny"))
    result = CliRunner().invoke(app, ["run", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (home / "kv_runs" / "tiny" / "metrics.json").is_file()
    assert not (workdir / "~").exists(), "no literal ./~ folder"


def test_output_tilde_of_an_unknown_user_is_refused(workdir):
    path = write(workdir / "c.yaml", tiny("~no_such_user_kveval/x"))
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "output:", "home folder")
    assert not (workdir / "~no_such_user_kveval").exists()


def test_run_folder_containment_function():
    assert run_folder("int4_g64", None) == Path("results/int4_g64")
    assert run_folder("a.b-c_d", "out/x") == Path("out/x")
    assert run_folder("x", "~/r") == Path(os.path.expanduser("~")) / "r"
    for bad in (".", "..", "...", "a/b", "a\\b", "", "  ", "a\nb", "a\0b"):
        with pytest.raises(KvevalError):
            run_folder(bad, None)
    for bad in ("", "out\n| x |", "~no_such_user_kveval"):
        with pytest.raises(KvevalError):
            run_folder("ok", bad)


def test_overwrite_removes_nothing_when_a_later_check_fails(run_copy):
    path, out = run_copy
    before = snapshot(out)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "-s", "seed=3", "-s", "plan=nope.plan.json",
                                             "--overwrite"]), "nope.plan.json")
    assert snapshot(out) == before


def test_overwrite_keeps_the_users_files_inside_a_run_folder(run_copy):
    path, out = run_copy
    (out / "my_notes.txt").write_text("why I ran this\n")
    old_records = (out / "records.jsonl").read_text()
    result = CliRunner().invoke(app, ["run", str(path), "-s", "seed=3", "--overwrite", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "my_notes.txt").read_text() == "why I ran this\n"
    assert "seed: 3" in (out / "config.resolved.yaml").read_text()
    assert (out / "records.jsonl").read_text().count("\n") == old_records.count("\n"), "started afresh, once"
    assert (out / MARKER_FILE).is_file()


def test_overwrite_replaces_a_run_folder_of_an_older_kveval(run_copy):
    path, out = run_copy
    (out / MARKER_FILE).unlink()  # made before the marker existed: only kveval's own files
    result = CliRunner().invoke(app, ["run", str(path), "-s", "seed=3", "--overwrite", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / MARKER_FILE).is_file() and "seed: 3" in (out / "config.resolved.yaml").read_text()


def test_overwrite_refuses_an_unmarked_folder_with_foreign_files(run_copy):
    path, out = run_copy
    (out / MARKER_FILE).unlink()
    (out / "thesis.tex").write_text("\\documentclass{article}\n")
    before = snapshot(out)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "-s", "seed=3", "--overwrite"]), "thesis.tex")
    assert snapshot(out) == before


def test_resume_of_a_run_folder_of_an_older_kveval(run_copy):
    path, out = run_copy
    (out / MARKER_FILE).unlink()
    records = (out / "records.jsonl").read_text()
    result = CliRunner().invoke(app, ["run", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "records.jsonl").read_text() == records, "bare keys resume: nothing recomputed"
    assert (out / MARKER_FILE).is_file()


def test_output_that_is_a_file_is_refused(workdir):
    path = write(workdir / "c.yaml", tiny("notes.md"))
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "notes.md", "is a file, not a folder")
    assert (workdir / "notes.md").read_text() == "my notes\n"


def test_output_below_a_file_is_refused(workdir):
    path = write(workdir / "c.yaml", tiny("notes.md/run"))
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "notes.md", "folder")
    assert (workdir / "notes.md").read_text() == "my notes\n"


def test_output_in_an_unwritable_folder_is_refused(workdir):
    locked = workdir / "locked"
    locked.mkdir()
    path = write(workdir / "c.yaml", tiny("locked/run"))
    with read_only(locked):
        one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "locked", "writ")
    assert os.listdir(locked) == []


def test_resume_in_a_read_only_run_folder_is_refused(run_copy):
    path, out = run_copy
    before = snapshot(out)
    with read_only(out):
        one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "run", "writable")
    assert snapshot(out) == before


def test_validate_refuses_a_folder_holding_another_configs_run_as_run_does(h, tmp_path):
    """Issue 53: `kveval validate` said ok where `kveval run` with the same arguments refused ("holds a run of a
    different config"): validate checks the output folder as run does, --overwrite included."""
    out = tmp_path / "out"
    config = h.write_config(tmp_path / "c.yaml", h.tiny_raw(out))
    assert h.invoke("run", config, "--quiet").exit_code == 0
    assert h.invoke("validate", config).exit_code == 0  # the same config: it resumes
    line = h.assert_user_error(h.invoke("validate", config, "-s", "seed=1"), "holds a run of a different config")
    assert "--overwrite" in line
    h.assert_user_error(h.invoke("run", config, "-s", "seed=1", "--quiet"), "holds a run of a different config")
    assert h.invoke("validate", config, "-s", "seed=1", "--overwrite").exit_code == 0
