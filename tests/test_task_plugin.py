"""Adding a task is adding its package (and its preset): nothing outside ``kveval/tasks/<task>/`` changes.

The test copies kveval's source, adds docs/extending.md's worked task (``kveval/tasks/divergence/``: the doc's
``params.py``, ``task.py`` and ``reporting.py`` blocks) and its preset (``divergence_quick.yaml``) to the copy,
and runs ``kveval validate``, ``kveval ls`` and ``kveval run`` from the copy in a fresh process: the config
accepts the task and its preset, the run resumes nothing and writes its metrics, and the report, its CSV tables
and the console table show the plug-in's section, table and column. The copy differs from the source only by
the added files (asserted), so none of the config, results, report or command code was edited for it.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_extending import BLOCKS

ROOT = Path(__file__).resolve().parents[1]
ADDED = {
    "kveval/tasks/divergence/__init__.py": '"""Greedy divergence through the real quantized cache."""\n',
    "kveval/tasks/divergence/params.py": BLOCKS["task-params-example"],
    "kveval/tasks/divergence/task.py": BLOCKS["task-example"],
    "kveval/tasks/divergence/reporting.py": BLOCKS["task-reporting-example"],
    "kveval/task_definitions/presets/divergence_quick.yaml": BLOCKS["task-preset-example"],
}
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")


def _differences(a: Path, b: Path) -> set[str]:
    """Paths (relative to ``b``) of files that are only in ``b`` or differ from ``a``'s (recursively)."""
    out: set[str] = set()

    def walk(cmp: filecmp.dircmp, rel: Path) -> None:
        out.update(str(rel / n) for n in cmp.right_only + cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, rel / name)

    walk(filecmp.dircmp(a, b, ignore=["__pycache__"]), Path())
    return out


@pytest.mark.integration
def test_a_task_package_and_its_preset_are_all_a_new_task_needs(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kveval", src / "kveval", ignore=IGNORE)
    shutil.copytree(ROOT / "tasks", src / "kveval" / "task_definitions", ignore=IGNORE)  # as the wheel installs it
    for rel, text in ADDED.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    changed = _differences(ROOT / "kveval", src / "kveval") - {"task_definitions"}
    assert changed == {"tasks/divergence"}, changed  # a new folder; no file of kveval edited
    assert _differences(ROOT / "tasks", src / "kveval" / "task_definitions") == {"presets/divergence_quick.yaml"}

    config = tmp_path / "div.yaml"
    config.write_text(json.dumps({
        "name": "div", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["fp16", "int2_g32"],
        "tasks": [{"preset": "divergence_quick", "prompts": 2, "prompt_tokens": 32, "new_tokens": 8}],
        "output": str(tmp_path / "out"),
    }))
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}

    def kveval(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kveval", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    where = subprocess.run([sys.executable, "-c", "import kveval.tasks.divergence.task as t; print(t.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(src)), where.stderr  # the copy, not the installed kveval
    listed = kveval("ls", "tasks")
    assert listed.returncode == 0 and "divergence" in listed.stdout and "divergence_quick" in listed.stdout
    assert kveval("validate", str(config)).returncode == 0
    done = kveval("run", str(config))
    assert done.returncode == 0, done.stderr
    assert "first diff" in done.stdout  # the plug-in's console column

    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["policies"]["fp16"]["divergence_first"] == 8  # nothing quantized: the baseline's tokens
    assert 0 <= metrics["policies"]["int2_g32"]["divergence_first"] <= 8
    report = (out / "report.md").read_text()
    assert "## Greedy divergence" in report and "first diff" in report  # its section and its verdict column
    table = (out / "tables" / "divergence.csv").read_text().splitlines()
    assert table[0] == "run,policy,divergence_first,divergence_identical" and len(table) == 3
    assert "divergence_first" in (out / "tables" / "summary.csv").read_text().splitlines()[0]


def _plugin_package(root: Path, name: str, tasks: dict[str, str]) -> None:
    """A package ``name`` under ``root`` with one sub-package per task holding ``reporting.py`` = the text."""
    for task, text in tasks.items():
        (root / name / task).mkdir(parents=True)
        (root / name / task / "__init__.py").write_text("")
        (root / name / task / "reporting.py").write_text(text)
    (root / name / "__init__.py").write_text("")
    (root / name / "_private").mkdir()
    (root / name / "plain.py").write_text("")


def test_plugins_are_found_by_folder_and_a_wrong_one_is_refused(tmp_path, monkeypatch):
    from kveval.report import sections

    good = ("from kveval.report.sections import SummaryColumn, TaskReporting\n"
            "REPORTING = TaskReporting(kind='alpha', summary_columns=(SummaryColumn('alpha_score'),))\n")
    _plugin_package(tmp_path, "fake_tasks_bad", {"alpha": good, "beta": "X = 1\n"})  # beta: no REPORTING
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sections, "TASKS_PACKAGE", "fake_tasks_bad")
    sections.task_reporting.cache_clear()
    with pytest.raises(TypeError, match=r"fake_tasks_bad\.beta\.reporting\.REPORTING is not a TaskReporting of kind 'beta'"):
        sections.task_reporting()
    sections.task_reporting.cache_clear()

    _plugin_package(tmp_path, "fake_tasks_kind", {"gamma": good})  # REPORTING of another kind
    monkeypatch.setattr(sections, "TASKS_PACKAGE", "fake_tasks_kind")
    with pytest.raises(TypeError, match="is not a TaskReporting of kind 'gamma'"):
        sections.task_reporting()
    sections.task_reporting.cache_clear()

    _plugin_package(tmp_path, "fake_tasks_one", {"alpha": good})
    monkeypatch.setattr(sections, "TASKS_PACKAGE", "fake_tasks_one")
    try:
        assert list(sections.task_reporting()) == ["alpha"]  # the package without reporting.py adds nothing
        assert sections.summary_keys() == ["alpha_score"]
    finally:
        monkeypatch.undo()
        sections.task_reporting.cache_clear()
