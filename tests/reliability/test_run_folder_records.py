"""What a run folder's records may hold after damage, and what reaches the metrics: garbage in the middle of
records.jsonl, a torn or newline-less last line, duplicated and foreign records, lines that are not records, a
records.jsonl that is a symbolic link or a folder, a resolved config that is not YAML, records without a config,
an edited corpus, two perplexity tasks in one config, a truncated metrics.json, file modes.

Every case runs on builtin:tiny-llama with tiny windows. "Equal metrics" means equal to the undamaged run's.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.data import token_windows
from kveval.models import load_model
from kveval.results import MARKER_FILE, RunDir, read_records


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


def lines_of(out: Path) -> list[str]:
    return (out / "records.jsonl").read_text().splitlines()


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
    """(config path, run folder, its metrics): a copy of a finished run (output: run) in a fresh working folder."""
    shutil.copytree(finished, tmp_path / "run", symlinks=True)
    monkeypatch.chdir(tmp_path)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    return write(tmp_path / "c.yaml", tiny("run")), tmp_path / "run", metrics


def rerun(path: Path, *args: str):
    result = CliRunner().invoke(app, ["run", str(path), "--quiet", *args])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result


def metrics_of(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_garbage_line_in_the_middle_is_skipped_and_later_records_count(run_copy):
    path, out, metrics = run_copy
    lines = lines_of(out)
    lost = json.loads(lines[3])["key"]
    lines[3] = '{"key": "perplexity/w1/int8", "nll_sum": 1.5, GARBAGE'  # a record damaged in place
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    result = rerun(path)
    assert "1 line that are not JSON (line 4)" in result.stderr and "recomputed" in result.stderr
    after = lines_of(out)
    assert len(after) == len(lines) + 1 and json.loads(after[-1])["key"] == lost, "only the damaged unit is redone"
    assert metrics_of(out) == metrics


def test_torn_last_line_is_cut_not_glued_to_the_next_record(run_copy):
    path, out, metrics = run_copy
    text = (out / "records.jsonl").read_text()
    last = text.splitlines()[-1]
    (out / "records.jsonl").write_text(text[: len(text) - len(last) // 2 - 1])  # killed mid-write
    rerun(path)
    after = lines_of(out)
    assert all(isinstance(json.loads(line), dict) for line in after), "every line is one whole record"
    assert json.loads(after[-1])["key"] == json.loads(last)["key"] and len(after) == len(text.splitlines())
    assert metrics_of(out) == metrics


def test_complete_last_record_without_its_newline_is_kept(run_copy):
    path, out, metrics = run_copy
    text = (out / "records.jsonl").read_text()
    (out / "records.jsonl").write_text(text.rstrip("\n"))
    rerun(path)
    assert (out / "records.jsonl").read_text() == text, "the record counts; only its newline is restored"
    assert metrics_of(out) == metrics


def test_duplicated_records_count_once_first_wins(run_copy):
    """An older kveval run twice on one folder: every key recorded twice (the second copies different)."""
    path, out, metrics = run_copy
    lines = lines_of(out)
    dupes = []
    for line in lines:
        rec = json.loads(line)
        for k in ("nll_sum", "kld_sum", "agree_sum"):
            rec[k] = rec[k] * 3 + 1
        dupes.append(json.dumps(rec))
    (out / "records.jsonl").write_text("\n".join(lines + dupes) + "\n")
    result = rerun(path)
    assert f"{len(lines)} duplicate records ignored" in result.stderr
    assert metrics_of(out) == metrics
    assert len(read_records(out)) == len(lines)


def test_record_of_a_window_the_config_does_not_have_is_ignored(run_copy):
    path, out, metrics = run_copy
    foreign = dict(json.loads(lines_of(out)[0]), key="perplexity/w999/baseline", window=999, nll_sum=1e6,
                   n_tokens=31)
    with open(out / "records.jsonl", "a") as fh:
        fh.write(json.dumps(foreign) + "\n")
    rerun(path)
    assert metrics_of(out) == metrics


def test_record_with_fields_of_the_wrong_type_is_one_line(run_copy):
    path, out, _ = run_copy
    lines = lines_of(out)
    rec = json.loads(lines[2])
    rec["nll_sum"] = "not a number"
    lines[2] = json.dumps(rec)
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    before = (out / "records.jsonl").read_text()
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "records.jsonl", "--overwrite")
    assert (out / "records.jsonl").read_text() == before


def test_lines_that_are_not_records_are_skipped(run_copy):
    path, out, metrics = run_copy
    with open(out / "records.jsonl", "a") as fh:
        fh.write('[1, 2, 3]\n{"task": "perplexity", "nll_sum": 9}\n"text"\n{"key": 7}\n')
    result = rerun(path)
    assert "4 lines that are not records" in result.stderr
    assert metrics_of(out) == metrics


def test_records_file_that_is_a_symlink_is_never_written_through(run_copy, tmp_path):
    path, out, _ = run_copy
    victim = tmp_path / "victim.jsonl"
    victim.write_text((out / "records.jsonl").read_text())
    before = victim.read_text()
    (out / "records.jsonl").unlink()
    (out / "records.jsonl").symlink_to(victim)
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "records.jsonl", "symbolic link")
    assert victim.read_text() == before


def test_records_file_that_is_a_folder_is_refused(run_copy):
    path, out, _ = run_copy
    (out / "records.jsonl").unlink()
    (out / "records.jsonl").mkdir()
    (out / "records.jsonl" / "keep").write_text("x")
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "records.jsonl", "a folder", "--overwrite")
    assert (out / "records.jsonl" / "keep").read_text() == "x"


def test_resolved_config_that_is_not_yaml_is_refused(run_copy):
    path, out, _ = run_copy
    records = (out / "records.jsonl").read_text()
    (out / "config.resolved.yaml").write_text("name: [unclosed\n  - : :\n")
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "config.resolved.yaml", "not valid YAML")
    assert (out / "records.jsonl").read_text() == records


def test_resolved_config_that_is_a_folder_is_refused(run_copy):
    path, out, _ = run_copy
    records = (out / "records.jsonl").read_text()
    (out / "config.resolved.yaml").unlink()
    (out / "config.resolved.yaml").mkdir()
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "config.resolved.yaml", "a folder")
    assert (out / "records.jsonl").read_text() == records


def test_damaged_resolved_config_with_overwrite_starts_afresh(run_copy):
    path, out, metrics = run_copy
    (out / "config.resolved.yaml").write_bytes(b"\xff\xfe\x00garbage")
    rerun(path, "--overwrite")
    assert metrics_of(out) == metrics and (out / "config.resolved.yaml").read_text().startswith("name: tiny")


def test_records_without_a_config_are_refused(run_copy):
    path, out, _ = run_copy
    (out / "config.resolved.yaml").unlink()
    records = (out / "records.jsonl").read_text()
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "records.jsonl", "no config.resolved.yaml")
    assert (out / "records.jsonl").read_text() == records


def _corpus(path: Path, word: str) -> Path:
    path.write_text(" ".join(f"{word} number {i} walks into the archive." for i in range(400)))
    return path


def test_resume_on_an_edited_corpus_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = _corpus(tmp_path / "corpus.txt", "alpha")
    cfg = tiny("run")
    cfg["data"] = {"source": str(corpus)}
    path = write(tmp_path / "c.yaml", cfg)
    rerun(path)
    records = (tmp_path / "run" / "records.jsonl").read_text()
    _corpus(corpus, "omega")  # the user edits the corpus and reruns the same config
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "other corpus tokens", "--overwrite")
    assert (tmp_path / "run" / "records.jsonl").read_text() == records
    rerun(path, "--overwrite")
    assert (tmp_path / "run" / "records.jsonl").read_text() != records
    assert RunDir(tmp_path / "run").marker()["tokens"]["count"] > 0


def test_two_perplexity_tasks_keep_their_own_records(tmp_path):
    cfg = tiny(tmp_path / "two")
    cfg["tasks"] = [{"perplexity": dict(cfg["tasks"][0]["perplexity"])},
                    {"perplexity": dict(cfg["tasks"][0]["perplexity"], seq_len=16)}]
    metrics = run_experiment(validate(cfg), quiet=True)
    keys = [json.loads(line)["key"] for line in lines_of(tmp_path / "two")]
    assert len(keys) == len(set(keys))
    first = [k for k in keys if not k.startswith("tasks[")]
    second = [k for k in keys if k.startswith("tasks[1]/perplexity/")]
    assert len(first) + len(second) == len(keys)
    assert first and all(k.startswith("perplexity/w") for k in first), "the first task keeps the bare keys"
    tokens = __import__("kveval.data", fromlist=["load_tokens"]).load_tokens("builtin", load_model("builtin:tiny-llama")[1])
    n16 = len(list(token_windows(tokens, 16, max_tokens=128)))
    n32 = len(list(token_windows(tokens, 32, max_tokens=128)))
    assert len(second) == 2 * n16 and len(first) == 2 * n32
    assert metrics["baseline"]["windows"] == n32, "the first task's metrics come from its own windows only"
    assert metrics["tasks"]["tasks[1]"]["baseline"]["windows"] == n16, "so do the second's, in their own section"
    again = run_experiment(validate(cfg), quiet=True)
    assert again == json.loads(json.dumps(metrics)) and len(lines_of(tmp_path / "two")) == len(keys)


def test_truncated_metrics_json_is_rebuilt_by_a_rerun(run_copy):
    path, out, metrics = run_copy
    text = (out / "metrics.json").read_text()
    (out / "metrics.json").write_text(text[: len(text) // 2])
    rerun(path)
    assert metrics_of(out) == metrics


def test_metrics_json_that_is_a_folder_is_refused(run_copy):
    path, out, _ = run_copy
    records = (out / "records.jsonl").read_text()
    (out / "metrics.json").unlink()
    (out / "metrics.json").mkdir()
    one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), "metrics.json", "a folder", "--overwrite")
    assert (out / "records.jsonl").read_text() == records


def test_metrics_json_that_is_a_folder_with_overwrite_starts_afresh(run_copy):
    path, out, metrics = run_copy
    (out / "metrics.json").unlink()
    (out / "metrics.json").mkdir()
    rerun(path, "--overwrite")
    assert metrics_of(out) == metrics


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_files_get_the_ordinary_mode(tmp_path, monkeypatch, umask, mode):
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))  # the token cache is written afresh too
    old = os.umask(umask)
    try:
        run_experiment(validate(tiny(tmp_path / "run")), quiet=True)
    finally:
        os.umask(old)
    out = tmp_path / "run"
    files = [out / n for n in ("config.resolved.yaml", "env.json", "records.jsonl", "metrics.json", "report.md",
                               "report.html", MARKER_FILE)]
    files += sorted((out / "tables").glob("*.csv")) + sorted((tmp_path / "cache").rglob("*.npy"))
    assert any(p.suffix == ".npy" for p in files), "the token cache was written"
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == mode, (p, oct(p.stat().st_mode))
    for d in (out, out / "tables", out / "plots"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, d


@pytest.mark.parametrize("damage", ["nan_kld", "negative_kld", "extra_value", "string_value", "negated_count",
                                    "p_diff_out_of_range", "nan_sum"])
def test_damaged_per_token_statistics_are_one_line_never_a_nan_statistic(run_copy, damage):
    """Per-token statistics of a record read back on resume (kld_values, p_diff_values, llama_sums, the sums):
    NaN, negative, one value too many, a string, a negated count. The run stops in one line naming the window and
    the field (metrics.json keeps its numbers, records.jsonl is untouched) instead of writing a NaN percentile or a
    PPL of 10^7."""
    path, out, metrics = run_copy
    lines = lines_of(out)
    i = next(k for k, line in enumerate(lines) if '"kld_values"' in line)
    rec = json.loads(lines[i])
    if damage == "nan_kld":
        rec["kld_values"][3] = float("nan")
    elif damage == "negative_kld":
        rec["kld_values"][0] = -5.0
    elif damage == "extra_value":
        rec["kld_values"].append(0.1)
    elif damage == "string_value":
        rec["p_diff_values"][1] = "0.1"
    elif damage == "negated_count":
        rec["llama_sums"]["count"] = -rec["llama_sums"]["count"]
    elif damage == "p_diff_out_of_range":
        rec["p_diff_values"][2] = 3.0
    else:
        rec["llama_sums"]["kld"] = float("nan")
    lines[i] = json.dumps(rec)
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    before = (out / "records.jsonl").read_text()
    (out / "metrics.json").unlink()  # the rerun must aggregate the records again
    line = one_line_exit_2(CliRunner().invoke(app, ["run", str(path)]), f"window {rec['window']}", "--overwrite")
    assert any(f in line for f in ("kld_values", "p_diff_values", "llama_sums")), line
    assert (out / "records.jsonl").read_text() == before


def test_a_report_skips_a_policys_damaged_per_token_klds(run_copy):
    """The report of a finished run whose records were edited afterwards: the per-token plot leaves the damaged
    policy out instead of failing (and blaming metrics.json)."""
    from kveval.report import load
    from kveval.report.plots import token_klds

    _, out, _ = run_copy
    assert "int8" in token_klds(load(out))
    lines = lines_of(out)
    i = next(k for k, line in enumerate(lines) if '"kld_values"' in line)
    rec = json.loads(lines[i])
    rec["kld_values"][0] = float("nan")
    lines[i] = json.dumps(rec)
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    assert "int8" not in token_klds(load(out))
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
