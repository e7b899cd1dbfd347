"""A sweep writes only into a new, empty or sweep folder of its own (issue 54: `kveval sweep s.yaml -o
results/probe`, where that folder held a finished run, overwrote the run's report.md, report.html and plots)."""

from __future__ import annotations

import pytest
import yaml


def _sweep_file(tmp_path, output):
    data = {"name": "s", "output": str(output), "grid": {"models": ["builtin:tiny-llama"], "policies": ["int8"]},
            "base": {"data": "builtin",
                     "tasks": [{"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}]}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_sweep_into_a_finished_run_is_refused_and_the_run_kept(h, tmp_path, finished_run, dry_run):
    _, out, records = finished_run
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (out / "report.md").is_file()
    args = ["sweep", _sweep_file(tmp_path, tmp_path / "elsewhere"), "-o", out] + (["--dry-run"] if dry_run else [])
    h.assert_user_error(h.invoke(*args), str(out), "kveval run folder", "-o DIR")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_a_sweep_into_a_folder_of_other_files_is_refused(h, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    h.assert_user_error(h.invoke("sweep", _sweep_file(tmp_path, out)), "not a sweep's folder", "notes.txt")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_new_empty_or_sweep_folder_is_the_sweeps(tmp_path):
    from kveval.commands.sweep import check_sweep_folder

    check_sweep_folder(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_sweep_folder(tmp_path / "empty")
    sweep = tmp_path / "sweep"
    for name in ("runs", "configs", "logs", "plots", "tables"):
        (sweep / name).mkdir(parents=True)
    for name in ("sweep.json", "report.md", "report.html", ".kveval.lock", ".sweep.json.abc123"):
        (sweep / name).write_text("x")
    check_sweep_folder(sweep)
