"""What an installed kveval holds: pyproject.toml names every package of kveval/ (the list is explicit, since the
top-level tasks/ folder is installed as kveval.task_definitions), and its package data covers every task
definition, so a wheel has the presets and the local lm-eval tasks that configs name."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    folders = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kveval").rglob("__init__.py"))
    listed = setuptools_table()["packages"]
    assert sorted(p for p in listed if p != "kveval.task_definitions") == folders
    assert setuptools_table()["package-dir"] == {"kveval.task_definitions": "tasks"}


def test_every_task_definition_is_package_data():
    patterns = setuptools_table()["package-data"]["kveval.task_definitions"]
    files = [p.relative_to(ROOT / "tasks").as_posix() for p in (ROOT / "tasks").rglob("*")
             if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts]
    assert files and not [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]


def test_the_installed_package_finds_them():
    from kveval.task_definitions import LM_EVAL_DIR, PRESETS_DIR
    from kveval.tasks import task_presets

    assert (LM_EVAL_DIR / "kveval_facts_mc.yaml").is_file()
    assert set(task_presets()) == {p.stem for p in PRESETS_DIR.glob("*.yaml")} and "ppl_quick" in task_presets()
