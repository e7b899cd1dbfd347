"""Two task entries of one kind in a config (two perplexity tasks with different windows): each keeps its own
records (a later entry's keys carry ``tasks[i]/``) and its own metrics (a later entry reports under
``metrics["tasks"]["tasks[i]"]``, the first at the top level), the report shows both, and a resumed run reads each
entry's own records back. Two identical entries cannot be told apart: refused with one line before anything runs.

Every case runs on builtin:tiny-llama with tiny windows.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate

PARAMS = {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0, "position_bins": 2}
MEMORY_FIELDS = ("bytes_per_token", "compression_vs_fp16", "max_batch", "bits_per_element")


def config(out: str, *tasks: dict) -> dict:
    return {"name": "tiny", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8", "int4_g32"],
            "tasks": [{"perplexity": t} for t in tasks], "output": out}


def task_fields(section: dict) -> dict:
    """A metrics section (``{"baseline", "policies"}``) without the memory fields (those belong to the run)."""
    def strip(m: dict) -> dict:
        return {k: v for k, v in m.items() if k not in MEMORY_FIELDS}

    return {"baseline": strip(section["baseline"]),
            "policies": {n: strip(m) for n, m in section["policies"].items()}}


def as_json(data):
    return json.loads(json.dumps(data))


@pytest.fixture(scope="module")
def two_entries(tmp_path_factory) -> tuple[Path, dict, dict]:
    """(run folder, its config, its metrics) of a finished run with two perplexity entries (seq_len 32 and 16),
    made with ``output: run`` in its own working folder (so that a copy elsewhere resumes under the same config)."""
    base = tmp_path_factory.mktemp("two")
    cfg = config("run", PARAMS, dict(PARAMS, seq_len=16))
    cwd = os.getcwd()
    os.chdir(base)
    try:
        metrics = as_json(run_experiment(validate(cfg), quiet=True))
    finally:
        os.chdir(cwd)
    return base / "run", cfg, metrics


def _one_line_exit_2(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_each_entry_reports_its_own_numbers(two_entries, tmp_path):
    """The first entry's numbers stay at the top level, the second's are under tasks["tasks[1]"], and each equals
    what a config holding that entry alone measures: nothing of one reached the other's fields."""
    _, _, metrics = two_entries
    alone = {seq: as_json(run_experiment(validate(config(str(tmp_path / f"s{seq}"), dict(PARAMS, seq_len=seq))),
                                         quiet=True)) for seq in (32, 16)}
    assert set(metrics["tasks"]) == {"tasks[1]"} and metrics["tasks"]["tasks[1]"]["kind"] == "perplexity"
    assert task_fields(metrics) == task_fields(alone[32])
    assert task_fields(metrics["tasks"]["tasks[1]"]) == task_fields(alone[16])
    assert metrics["baseline"]["ppl"] != metrics["tasks"]["tasks[1]"]["baseline"]["ppl"]


def test_a_resumed_run_reads_each_entrys_records_back(two_entries, tmp_path, monkeypatch):
    """Metrics gone and the last records of the second entry lost (a killed run): the rerun recomputes exactly
    those and ends with the same metrics; the first entry's records are never taken for the second's."""
    folder, cfg, metrics = two_entries
    copy = tmp_path / "run"
    shutil.copytree(folder, copy, symlinks=True)
    monkeypatch.chdir(tmp_path)
    (copy / "metrics.json").unlink()
    lines = (copy / "records.jsonl").read_text().splitlines()
    second = [i for i, line in enumerate(lines) if json.loads(line)["key"].startswith("tasks[1]/")]
    kept = [line for i, line in enumerate(lines) if i not in second[-3:]]
    (copy / "records.jsonl").write_text("\n".join(kept) + "\n")
    again = as_json(run_experiment(validate(cfg), quiet=True))
    assert again == metrics
    after = (copy / "records.jsonl").read_text().splitlines()
    assert len(after) == len(lines) and after[: len(kept)] == kept, "only the lost records were computed again"
    assert sorted(json.loads(line)["key"] for line in after) == sorted(json.loads(line)["key"] for line in lines)


def test_the_report_shows_the_second_entry(two_entries):
    folder, _, metrics = two_entries
    md = (folder / "report.md").read_text()
    assert "## Task tasks[1]: perplexity (seq_len 16, max_tokens 96" in md
    second_ppl = f"{metrics['tasks']['tasks[1]']['baseline']['ppl']:.3f}"
    section = md[md.index("## Task tasks[1]"):]
    section = section[: section.index("\n## ", 1)]
    assert second_ppl in section and f"{metrics['baseline']['ppl']:.3f}" not in section
    with open(folder / "tables" / "task_entries.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["task"], r["kind"], r["policy"]) for r in rows] == [
        ("tasks[1]", "perplexity", p) for p in ("baseline", "int8", "int4_g32")]
    assert float(rows[0]["ppl"]) == pytest.approx(metrics["tasks"]["tasks[1]"]["baseline"]["ppl"])
    assert rows[1]["verdict"] == metrics["tasks"]["tasks[1]"]["policies"]["int8"]["verdict"]


def test_identical_entries_are_refused_before_anything_runs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(str(tmp_path / "out"), PARAMS, dict(PARAMS))))
    for command in ("validate", "run"):
        _one_line_exit_2(CliRunner().invoke(app, [command, str(path)]), "tasks[1] repeats tasks[0]",
                         "same perplexity task", "remove one")
    assert not (tmp_path / "out").exists()


def test_the_same_task_preset_twice_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    raw = config(str(tmp_path / "out"))
    raw["tasks"] = ["ppl_quick", "ppl_quick"]
    path.write_text(yaml.safe_dump(raw))
    _one_line_exit_2(CliRunner().invoke(app, ["validate", str(path)]), "tasks[1] repeats tasks[0]")
