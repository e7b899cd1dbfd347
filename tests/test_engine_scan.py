"""From a layer scan to a flag an engine runs (issue 53): `kveval scan CONFIG --engine E` scans the cache types E
runs; `kveval plan SCAN --engine E` on a scan without them refuses with the exact commands that scan them and plan
again, which, pasted back, run; the plan then deploys to E's own flags."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from typer.testing import CliRunner

from kveval.cli import app
from kveval.commands.scan import engine_specs


def _invoke(argv: list[str]):
    return CliRunner().invoke(app, argv)


@pytest.fixture()
def tiny_scan(tmp_path):
    config = tmp_path / "scan.yaml"
    config.write_text(yaml.safe_dump({
        "name": "scan", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["int8"], "output": str(tmp_path / "scan"),
        "tasks": [{"sensitivity": {"specs": ["int4_g32"], "seq_len": 32, "max_tokens": 64, "plots": False}}]}))
    result = _invoke(["scan", str(config), "--quiet"])
    assert result.exit_code == 0, result.output
    return config, tmp_path / "scan", result.output


def test_a_scan_ends_with_its_most_sensitive_layers_and_the_plan_commands(tiny_scan, tmp_path):
    """Issue 53: the scan ended with a policy table of "-" and no next step."""
    _, scan, output = tiny_scan
    assert "scan: most sensitive layers (KLD with int4_g32 alone): keys " in output and "; values " in output
    assert "┃ policy" not in output  # no table of memory-only policies
    nxt = re.search(r"^next: (kveval plan .*?)   \(", output, flags=re.M).group(1)
    engines = re.findall(r"^      (kveval plan .* --engine \w+)$", output, flags=re.M)
    assert any(line.endswith("--engine transformers") for line in engines), output  # int4_g32: its type
    assert "kveval scan CONFIG --engine vllm scans the cache types it runs" in output
    for line in [nxt, *engines]:  # pasted back: each plans
        result = _invoke([*shlex.split(line)[1:], "-o", str(tmp_path / "p" / f"{len(line)}.yaml")])
        assert result.exit_code == 0, (line, result.output)


def test_engine_specs_are_the_engines_cache_types():
    assert set(engine_specs("llamacpp")) == {"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "q8_0_x86"}
    assert "fp8_e4m3" in engine_specs("vllm") and "none" not in engine_specs("vllm")
    assert "fp8_e4m3_tensor" not in engine_specs("vllm")  # its scales come from calibration, not a scan


@pytest.mark.parametrize("engine,flag", [("llamacpp", "-ctk"), ("vllm", "--kv-cache-dtype")])
def test_a_scan_without_an_engines_types_prints_the_commands_that_plan_for_it(tiny_scan, tmp_path, engine, flag):
    _, scan, _ = tiny_scan
    refused = _invoke(["plan", str(scan), "--budget", "9", "--engine", engine, "-o", str(tmp_path / "p.yaml")])
    assert refused.exit_code == 2
    line = refused.output.strip().splitlines()[-1]
    assert "holds none of the specs" in line and "Traceback" not in refused.output
    scan_line, plan_line = re.search(r"scan them with: (kveval scan .*), then: (kveval plan .*)$", line).groups()
    argv = shlex.split(scan_line)
    assert argv[:2] == ["kveval", "scan"] and argv[argv.index("--engine") + 1] == engine
    pasted = _invoke([*argv[1:], "--quiet"])  # pasted back: the engine scan runs
    assert pasted.exit_code == 0, pasted.output
    out = tmp_path / f"p_{engine}.yaml"
    planned = _invoke([*shlex.split(plan_line)[1:], "-o", str(out)])
    assert planned.exit_code == 0, planned.output
    deployed = _invoke(["deploy", str(out.with_name(out.stem + ".plan.json")), "--engine", engine])
    assert deployed.exit_code == 0 and flag in deployed.output, deployed.output
