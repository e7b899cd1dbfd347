"""How each preset named after a system was checked (kveval/policy/provenance.py): every such preset says, the
tests it names exist and run what the kind claims, and docs/engines.md, `kveval ls` and the report show it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kveval.cli import app
from kveval.policy import POLICY_PRESETS, KVPolicy
from kveval.policy.provenance import CHECK_KINDS, PRESET_CHECKS, Check, check_of

ROOT = Path(__file__).resolve().parents[1]
#: name prefixes of presets named after a system (an engine, a library or a paper's code)
SYSTEM_PREFIXES = ("llamacpp_", "hf_", "vllm_", "sglang_", "trtllm_", "kivi", "kvquant")
#: what a test file of a ``system`` check imports: the real system
REAL_SYSTEMS = ("llama_cpp", "optimum.quanto", "hqq", "QuantizedCache")


def doc_rows() -> list[str]:
    """The table of docs/engines.md's "How each preset was checked", one line per preset, as the data says."""
    return [f"| `{name}` | {c.kind} | {c.against} | {c.depth} | {f'`{c.test}`' if c.test else '-'} |"
            for name, c in PRESET_CHECKS.items()]


def test_every_preset_named_after_a_system_says_how_it_was_checked():
    named = [n for n in POLICY_PRESETS if n.startswith(SYSTEM_PREFIXES)]
    assert named and not [n for n in named if check_of(n) is None]
    assert set(PRESET_CHECKS) <= set(POLICY_PRESETS), "a check of a preset that does not exist"
    assert check_of("int4_g64") is None and check_of("kivi2").kind == "reference"
    for name in PRESET_CHECKS:
        KVPolicy.preset(name)  # every checked preset builds


@pytest.mark.parametrize("name", sorted(PRESET_CHECKS))
def test_the_named_test_exists_and_runs_what_the_kind_says(name):
    check = PRESET_CHECKS[name]
    assert check.kind in CHECK_KINDS and check.against and check.depth
    if check.kind == "documented":
        assert check.test is None
        return
    source = (ROOT / check.test).read_text()
    family = name.split("_")[0] if not name.startswith(("kivi", "kvquant")) else name.rstrip("0123456789_pct")
    assert family.removesuffix("_") in source or name in source, (name, check.test)
    imports_system = any(s in source for s in REAL_SYSTEMS)
    assert imports_system == (check.kind == "system"), (name, check.kind, check.test)


def test_a_check_is_consistent():
    with pytest.raises(ValueError, match="kind"):
        Check("tested", "x", "y", "tests/t.py")
    with pytest.raises(ValueError, match="names its test"):
        Check("system", "x", "y")
    with pytest.raises(ValueError, match="names its test"):
        Check("documented", "x", "y", "tests/t.py")
    assert Check("documented", "vLLM", "none").label() == "documented: vLLM"


def test_engines_doc_holds_the_table():
    text = (ROOT / "docs" / "engines.md").read_text()
    missing = [row for row in doc_rows() if row not in text]
    assert not missing, "docs/engines.md's table differs from kveval/policy/provenance.py:\n" + "\n".join(missing)


def test_ls_shows_the_kind():
    result = CliRunner().invoke(app, ["ls", "presets"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert "checked: system (tests/parity/test_llamacpp.py)" in lines["llamacpp_q4_0"]
    assert "checked: reference (tests/parity/test_kivi.py)" in lines["kivi2"]
    assert "checked: documented (no test)" in lines["vllm_fp8"]
    assert "checked:" not in lines["int4_g64"]


def test_the_report_verdict_table_shows_the_kind(tmp_path):
    from synthetic_runs import write_synthetic_run

    from kveval.report.tables import verdict_table
    from kveval.results import load

    run = write_synthetic_run(tmp_path / "r", policies=("int8", "kivi2", "vllm_fp8"), records=False)
    table = verdict_table(load(run)).set_index("policy")
    assert table.loc["kivi2", "preset checked"] == "reference"
    assert table.loc["vllm_fp8", "preset checked"] == "documented"
    assert table.loc["int8", "preset checked"] == ""
    plain = write_synthetic_run(tmp_path / "p", policies=("int8",), records=False)
    assert "preset checked" not in verdict_table(load(plain)).columns  # no such preset: no column


def test_the_llamacpp_test_covers_every_llamacpp_preset():
    """The system check of every llamacpp_* preset is the 2-layer parity test: its cache type is among the types
    that test runs (with the rotation on and off)."""
    from kveval.parity.llamacpp import DEFAULT_TYPES

    source = (ROOT / "tests" / "parity" / "test_llamacpp.py").read_text()
    for name in (n for n in PRESET_CHECKS if n.startswith("llamacpp_")):
        t = name.removeprefix("llamacpp_").removesuffix("_norot")
        assert f"{t}/{t}" in DEFAULT_TYPES or f'"{t}/{t}"' in source, name
