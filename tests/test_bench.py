"""The benchmarks in bench/ still import what they use (they run by hand, not in CI: a rename elsewhere would
otherwise break them silently)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).resolve().parents[1] / "bench").glob("*.py"))


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.name)
def test_every_kveval_name_a_benchmark_imports_exists(path):
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kveval"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.module}.{alias.name}")
    assert not missing


def test_bench_presets_takes_the_names_its_table_prints():
    """``--presets`` takes a policy preset, ``spec:NAME`` (a quantization preset as a K/V policy, as the table
    labels it) and lists an unknown name as skipped with the reason."""
    import importlib.util

    from kveval.policy import KVPolicy

    spec = importlib.util.spec_from_file_location("bench_presets", BENCH[0].parent / "bench_presets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = dict(module.policies("kivi2,spec:q4_1,no_such_preset"))
    assert got["kivi2"] == KVPolicy.preset("kivi2")
    assert got["spec:q4_1"].key.describe() == got["spec:q4_1"].value.describe() == KVPolicy.from_config(
        {"spec": "q4_1"}).key.describe()
    assert isinstance(got["no_such_preset"], str) and "no_such_preset" in got["no_such_preset"]


def test_the_speed_table_runs_every_row_at_its_tiny_size(tmp_path, capsys, monkeypatch):
    """``python -m bench.speed_table --size tiny`` measures every row (issue #55's table) and writes them as JSON;
    its numbers are not asserted (timings are not stable in CI), only that each row measured a positive ratio
    and names a command that exists, with the flags the benchmark takes."""
    import json
    import sys

    root = BENCH[0].parent.parent
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    from bench import speed_table

    out = tmp_path / "rows.json"
    rows = speed_table.main(["--size", "tiny", "--rows", ",".join(speed_table.ROWS), "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("tiny size") and printed.count("\n| ") == len(rows) + 1
    saved = json.loads(out.read_text())
    assert [r["what"] for r in saved] == [r.what for r in rows]
    assert len(rows) >= 12 and all(r.value > 0 for r in rows)
    for row in rows:
        words = row.command.split()
        if words[:2] == ["python", "-m"]:
            assert words[2] == "bench.speed_table"
            continue
        if words[0] == "kveval":
            continue
        script = root / words[1]
        assert script.exists(), row.command
        flags = {w for w in words if w.startswith("--")}
        source = script.read_text()
        assert all(f'"{flag}"' in source for flag in flags), row.command
    assert sys.modules["bench.speed_table"] is speed_table
