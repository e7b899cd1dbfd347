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


def test_plan_prints_the_chosen_layers_and_whole_byte_counts(tmp_path, capsys):
    """Issue 53: plan printed ``1658880 B`` and named the chosen layers only inside the YAML."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deploy import readme_scan

    from kveval.commands.plan import layer_ranges, plan_command

    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and layer_ranges([3]) == "3" and layer_ranges([]) == ""
    config = plan_command(str(readme_scan(tmp_path / "scan")), "int4_g64", str(tmp_path / "p.yaml"))
    out = capsys.readouterr().out
    import json

    layers = json.loads((tmp_path / "p.plan.json").read_text())["layers"]
    assert config == str(tmp_path / "p.yaml")
    keys = re.search(r"^  keys: (.*)$", out, flags=re.M).group(1)
    for part in keys.split("; "):  # each spec's layers as printed are the layers the config gives it
        spec, ranges = part.split(" at ")
        printed = {i for r in ranges.split(", ") for i in range(int(r.split("-")[0]), int(r.split("-")[-1]) + 1)}
        assert printed == {entry["layer"] for entry in layers if entry["key"] == spec}, (part, layers)
    assert "1,658,880 B (1.58 MiB)" in out and "1658880" not in out


@pytest.mark.parametrize("engine", ["vllm", "llamacpp", None])
def test_a_budget_below_every_plan_names_the_least_that_plans(tmp_path, engine):
    """The refusal said "1658880 B is below ... 2949360 B"; it gives the smallest budget that plans, which, pasted
    back, plans."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deploy import readme_scan

    scan = readme_scan(tmp_path / "scan", ["int8", "fp8_e4m3", "q8_0", "q4_0"])
    extra = ["--engine", engine] if engine else []
    refused = _invoke(["plan", str(scan), "--budget", "2", *extra, "-o", str(tmp_path / "a.yaml")])
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert re.search(r"\d,\d{3},\d{3} B = ", line), line  # whole byte counts with separators
    least = re.search(r"give --budget ([0-9.]+) or more$", line).group(1)
    planned = _invoke(["plan", str(scan), "--budget", least, *extra, "-o", str(tmp_path / "b.yaml")])
    assert planned.exit_code == 0, (least, planned.output)


@pytest.mark.integration
def test_the_readme_scan_plans_and_deploys_for_vllm_and_llamacpp_with_no_second_scan(tmp_path):
    """Issue 53's acceptance at a tiny size: the README's scan config (configs/layer_scan.yaml, here on
    tiny-llama and 64 tokens), then every `kveval plan ... --engine E` line it prints, pasted back; each plan's
    printed deploy line, pasted back, prints the engine's flags; the plan's printed `kveval run` line runs."""
    from pathlib import Path

    scan_dir = tmp_path / "layer_scan"
    preset = yaml.safe_load((Path(__file__).parents[1] / "tasks" / "presets" / "scan_quick.yaml").read_text())
    # the preset's specs; groups of 64 become 32 (tiny-llama's heads are 32 wide), the engines' types stay
    specs = [s.replace("_g64", "_g32") for s in preset["sensitivity"]["specs"]]
    assert {"fp8_e4m3", "q8_0", "q4_0"} <= set(specs)
    argv = ["scan", "configs/layer_scan.yaml", "-s", "model.name=builtin:tiny-llama", "-s", "kv=[int8]", "-s",
            f"tasks[0].sensitivity.specs=[{','.join(specs)}]", "-s", "tasks[0].sensitivity.seq_len=32", "-s",
            "tasks[0].sensitivity.max_tokens=64", "-o", str(scan_dir), "--quiet"]
    scanned = _invoke(argv)
    assert scanned.exit_code == 0, scanned.output
    plans = {engine: line for line, engine in re.findall(r"^      (kveval plan .* --engine (\w+))$",
                                                         scanned.output, flags=re.M)}
    assert {"vllm", "llamacpp"} <= set(plans), scanned.output  # no second scan needed
    flags = {"vllm": "--kv-cache-dtype fp8", "llamacpp": "-ctk q"}
    for engine in ("vllm", "llamacpp"):
        out = tmp_path / f"plan_{engine}.yaml"
        planned = _invoke([*shlex.split(plans[engine])[1:], "-o", str(out)])
        assert planned.exit_code == 0, planned.output
        deploy_line = re.search(r"^its flags for \w+: (kveval deploy .*)$", planned.output, flags=re.M).group(1)
        deployed = _invoke(shlex.split(deploy_line)[1:])
        assert deployed.exit_code == 0 and flags[engine] in deployed.output, deployed.output
        run_line = re.search(r"run it: (kveval run .*)$", planned.output, flags=re.M).group(1)
        config = yaml.safe_load(out.read_text())
        assert config["model"]["name"] == "builtin:tiny-llama"  # the scanned model, not the config's default
        ran = _invoke([*shlex.split(run_line)[1:], "-s", "tasks[0].perplexity.max_tokens=128", "-o",
                       str(tmp_path / f"run_{engine}"), "--quiet"])
        assert ran.exit_code == 0, ran.output
        assert "planned" in ran.output


def test_each_engine_plan_line_a_scan_prints_plans(tmp_path):
    """The scan's closing lines gave every engine the scan's first spec as its budget: a scan that begins with
    int2_g32 printed `--budget int2_g32 --engine vllm`, which vLLM's fp8 cannot fit. Each engine line now names a
    budget that engine plans within; pasted back, every line plans."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deploy import readme_scan

    from kveval.tasks.sensitivity.closing import closing_lines

    scan = readme_scan(tmp_path / "scan", ["int2_g32", "fp8_e4m3", "q8_0", "q4_0", "int4_g64"])
    lines = closing_lines(json.loads((scan / "metrics.json").read_text()), str(scan))
    engines = {line.split("--engine ")[1]: line.strip() for line in lines if "--engine " in line and "(" not in line}
    assert {"vllm", "llamacpp", "transformers"} <= set(engines), lines
    assert "--budget int2_g32 --engine transformers" in engines["transformers"]  # the first spec where it plans
    assert "--budget int2_g32" not in engines["vllm"]
    for engine, line in engines.items():
        result = _invoke([*shlex.split(line)[1:], "-o", str(tmp_path / f"{engine}.yaml")])
        assert result.exit_code == 0, (line, result.output)
