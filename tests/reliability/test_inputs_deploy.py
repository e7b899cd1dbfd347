"""kveval deploy on hand-edited inputs: a plan file whose fields have the wrong type, a broken config beside the
plan, a run folder whose metrics hold a NaN, a string or a list where a cost is, a resolved config whose kv is not
a mapping. Each is one line, or deploys with the damaged number left out ("not measured"), never a traceback and
never "KLD nan" printed as a measured cost."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from kveval.memory import Arch


def _scan(folder):
    """A scan folder of SmolLM2-135M's shape with int8 and int4_g64 cells (keys 10x values)."""
    cells = [{"layer": i, "tensor": t, "spec": s, "kld": (0.01 if t == "key" else 0.001) * (4 if s == "int4_g64" else 1),
              "nll_delta": 0.0} for i in range(30) for t in ("key", "value") for s in ("int8", "int4_g64")]
    metrics = {"run": "scan", "model": "builtin:smollm2-135m", "policies": {},
               "memory": {"arch": Arch.named("smollm2-135m").to_dict(), "context": 256},
               "sensitivity": {"specs": ["int8", "int4_g64"], "seq_len": 256, "cells": cells, "tokens": 255,
                               "token_end": 256}}
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name": "builtin:smollm2-135m"},
                                                                  "data": "builtin", "seed": 0}))
    return folder


@pytest.fixture
def plan_file(tmp_path):
    from kveval.commands.plan import plan_command

    config = plan_command(str(_scan(tmp_path / "scan")), "9", str(tmp_path / "plan.yaml"))
    side = tmp_path / "plan.plan.json"
    assert side.is_file(), config
    return side


@pytest.mark.parametrize("field,value", [("arch", "x"), ("arch", [1, 2]), ("context", "abc"), ("context", [1]),
                                         ("policy", 5), ("policy", ["int8"])])
def test_a_plan_field_of_the_wrong_type_is_one_line(h, plan_file, field, value):
    side = json.loads(plan_file.read_text())
    side[field] = value
    plan_file.write_text(json.dumps(side))
    h.assert_user_error(h.invoke("deploy", plan_file), "plan")


@pytest.mark.parametrize("text", ["model: [unclosed", "- just\n- a list\n", "model: {name: 5}\n", "\0\1binary"])
def test_a_broken_config_beside_the_plan_leaves_the_model_a_placeholder(h, plan_file, text):
    side = json.loads(plan_file.read_text())
    (plan_file.parent / "broken.yaml").write_text(text)
    side["config"] = str(plan_file.parent / "broken.yaml")
    plan_file.write_text(json.dumps(side))
    result = h.invoke("deploy", plan_file, "--engine", "vllm")
    assert result.exit_code == 0, result.output
    assert "vllm serve MODEL" in result.output or "not expressible" in result.output


@pytest.fixture
def run_folder(tmp_path):
    """A finished run's folder as deploy reads it: metrics with costs of two presets, and its resolved config."""
    folder = tmp_path / "run"
    folder.mkdir()
    metrics = {"model": "builtin:smollm2-135m", "baseline": {},
               "policies": {"llamacpp_q8_0": {"kld_mean": 0.0009, "delta_ppl_pct": 0.2},
                            "llamacpp_q5_1": {"kld_mean": 0.05, "delta_ppl_pct": 4.0}}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"kv": {"policies": {"llamacpp_q8_0": "llamacpp_q8_0"}}}))
    return folder


@pytest.mark.parametrize("kld", [math.nan, "0.01", [0.01], {"x": 1}, None])
def test_a_damaged_cost_in_the_run_folder_is_no_cost(h, plan_file, run_folder, kld):
    metrics = json.loads((run_folder / "metrics.json").read_text())
    metrics["policies"]["llamacpp_q8_0"]["kld_mean"] = kld
    metrics["policies"]["llamacpp_q5_1"]["delta_ppl_pct"] = "lots"
    (run_folder / "metrics.json").write_text(json.dumps(metrics))
    result = h.invoke("deploy", plan_file, "--engine", "llamacpp", "--run", run_folder)
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output.lower()
    q8 = next(line for line in result.output.splitlines() if line.strip().startswith("-ctk q8_0"))
    assert "not measured" in q8, q8
    q5 = next(line for line in result.output.splitlines() if line.strip().startswith("-ctk q5_1"))
    assert "KLD 0.05 (measured" in q5 and "ΔPPL" not in q5, q5


@pytest.mark.parametrize("kv", ["int8", ["int8"], 5])
def test_a_resolved_config_whose_kv_is_not_a_mapping(h, plan_file, run_folder, kv):
    (run_folder / "config.resolved.yaml").write_text(yaml.safe_dump({"kv": kv}))
    result = h.invoke("deploy", plan_file, "--engine", "llamacpp", "--run", run_folder)
    assert result.exit_code == 0, result.output
    assert "KLD 0.0009, ΔPPL +0.20% (measured" in result.output


def test_plan_for_transformers_on_a_sliding_window_model_is_refused(h, tmp_path):
    """transformers' QuantizedCache refuses a model with sliding-window layers, so a plan "for transformers" of one
    is one line before anything is written."""
    folder = _scan(tmp_path / "scan")
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["memory"]["arch"].update(sliding_window=8, sliding_layers=[0, 1])
    (folder / "metrics.json").write_text(json.dumps(metrics))
    h.assert_user_error(h.invoke("plan", folder, "--budget", "9", "--engine", "transformers", "-o",
                                 tmp_path / "p.yaml"), "sliding-window", "--engine transformers")
    assert not (tmp_path / "p.yaml").exists()
    assert h.invoke("plan", folder, "--budget", "9", "-o", tmp_path / "p.yaml").exit_code == 0  # without --engine


def test_a_scan_folder_whose_config_and_metrics_name_different_models(h, tmp_path):
    folder = _scan(tmp_path / "scan")
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name": "builtin:tiny-llama"},
                                                                  "data": "builtin", "seed": 0}))
    h.assert_user_error(h.invoke("plan", folder, "--budget", "9", "-o", tmp_path / "p.yaml"),
                        "builtin:tiny-llama", "builtin:smollm2-135m", "rerun the scan")
    assert not (tmp_path / "p.yaml").exists()


def test_the_printed_run_line_of_a_plan_pastes_back(h, tmp_path):
    """A plan written under a folder with a space: the printed `run it:` line, split as a shell would, names the
    config, and kveval validate accepts it."""
    import re
    import shlex

    folder = _scan(tmp_path / "scan")
    out = tmp_path / "my plans" / "p.yaml"
    result = h.invoke("plan", folder, "--budget", "9", "-o", out)
    assert result.exit_code == 0, result.output
    argv = shlex.split(re.search(r"run it: (.*)$", result.output, flags=re.M).group(1))
    assert argv == ["kveval", "run", str(out)]
    assert h.invoke("validate", *argv[2:], "-o", tmp_path / "o").exit_code == 0
