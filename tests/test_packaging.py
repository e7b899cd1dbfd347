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


def test_the_llama_perplexity_build_finds_its_cached_binary_every_time(tmp_path):
    """scripts/build_llama_perplexity.sh reuses a cached binary that reports the pinned commit. A binary that writes
    more after the commit line (llama-perplexity prints its build lines after it) made `tool | grep -q` fail under
    pipefail whenever grep exited first, and the set-up rebuilt a good binary (one run in three here)."""
    import hashlib
    import re
    import subprocess

    script = ROOT / "scripts" / "build_llama_perplexity.sh"
    commit = re.search(r'^COMMIT="([0-9a-f]{40})"', script.read_text(), re.M).group(1)
    flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = line.split(":")[1]
            break
    cpu = hashlib.sha256("".join(sorted(flags.split(" "))).encode()).hexdigest()[:8]
    machine = subprocess.run(["uname", "-m"], capture_output=True, text=True, check=True).stdout.strip()
    tool = tmp_path / "llama.cpp" / f"{commit[:12]}-{machine}-{cpu}" / "bin" / "llama-perplexity"
    tool.parent.mkdir(parents=True)
    # the commit line, then far more than a pipe holds: a reader that stops early leaves the writer a SIGPIPE
    tool.write_text(f"#!/bin/sh\necho 'version: 1 (build 1, commit {commit[:7]})'\nyes 'built with cc' | head -c 1000000\n")
    tool.chmod(0o755)
    for _ in range(5):
        # PYTHON=false and no PATH to cmake: a rebuild could not even start, it would fail
        out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "KVEVAL_CACHE": str(tmp_path), "PYTHON": "false"})
        assert out.returncode == 0 and "up to date" in out.stdout, out.stdout + out.stderr
        assert out.stdout.strip().splitlines()[-1] == str(tool)
