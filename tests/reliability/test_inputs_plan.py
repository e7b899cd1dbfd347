"""Hostile planning inputs (a scan's metrics.json missing fields or hand-edited, a budget below the smallest plan,
a bad context or --out, a hand-edited .plan.json) and scales files (wrong head_dim, corrupt, NaN): one line each,
before anything is written or any run starts."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import yaml

from kveval.errors import KvevalError
from kveval.memory import Arch
from kveval.scales.file import load_scales, save_scales
from kveval.scales.ranges import Ranges


def _scan(folder: Path, *, layers: int = 4, edit=None) -> Path:
    """A scan's results folder (metrics.json and config.resolved.yaml) with random per-cell KLDs."""
    rng = random.Random(0)
    cells = [{"layer": i, "tensor": t, "spec": s, "kld": rng.uniform(0.01, 1) / (8 if s == "int4_g32" else 1),
              "nll_delta": 0.01} for i in range(layers) for t in ("key", "value") for s in ("int4_g32", "int2_g32")]
    arch = Arch(layers=layers, kv_heads=2, head_dim=32, name="fake", params=1000)
    metrics = {"run": "scan", "model": "builtin:tiny-llama", "policies": {},
               "memory": {"arch": arch.to_dict(), "context": 64},
               "sensitivity": {"specs": ["int4_g32", "int2_g32"], "seq_len": 64, "cells": cells, "token_end": 64}}
    if edit is not None:
        edit(metrics)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name": "builtin:tiny-llama"},
                                                                  "data": "builtin", "seed": 0}))
    return folder


def _plan(h, tmp_path, scan: Path, *args: str):
    return h.invoke("plan", scan, *args, "-o", tmp_path / "gen" / "p.yaml")


def test_a_good_scan_still_plans(h, tmp_path):
    result = _plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "int4_g32")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gen" / "p.plan.json").is_file()


def test_scan_without_arch(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["memory"].pop("arch"))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "memory.arch")


def test_scan_without_specs(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"].pop("specs"))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "sensitivity.specs")


def test_scan_cell_without_kld(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"]["cells"][2].pop("kld"))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "cells[2] has no 'kld'")


def test_scan_cell_with_a_string_kld(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"]["cells"][3].update(kld="big"))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "cells[3].kld is 'big'")


def test_scan_cell_with_a_nan_kld(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"]["cells"][0].update(kld=float("nan")))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "not a finite number")


def test_scan_cell_outside_the_layers(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"]["cells"][0].update(layer=99))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "layer is 99")


def test_scan_with_an_unknown_spec(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["sensitivity"]["specs"].append("int9_g7"))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "int9_g7")


def test_scan_with_absurd_layers(h, tmp_path):
    scan = _scan(tmp_path / "scan", edit=lambda m: m["memory"]["arch"].update(layers=10**9))
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"), "more than any model has")


def test_scan_metrics_not_an_object(h, tmp_path):
    scan = _scan(tmp_path / "scan")
    (scan / "metrics.json").write_text("[1, 2, 3]")
    h.assert_user_error(_plan(h, tmp_path, scan, "--budget", "4.5"))


def test_budget_below_the_smallest_plan(h, tmp_path):
    h.assert_user_error(_plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "0.001"),
                        "below the smallest plan")
    assert not (tmp_path / "gen").exists()


def test_budget_of_one_byte_per_token(h, tmp_path):
    h.assert_user_error(_plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "1B/token"), "below the smallest")


def test_negative_context(h, tmp_path):
    h.assert_user_error(_plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "4.5", "--context", "-5"),
                        "--context -5")


def test_huge_context(h, tmp_path):
    h.assert_user_error(_plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "4.5", "--context", "10000000000"),
                        "--context")


def test_out_under_a_file(h, tmp_path):
    (tmp_path / "afile").write_text("x")
    result = h.invoke("plan", _scan(tmp_path / "scan"), "--budget", "int4_g32", "-o", tmp_path / "afile" / "p.yaml")
    h.assert_user_error(result, "is a file")


def _planned(h, tmp_path) -> tuple[Path, Path]:
    result = _plan(h, tmp_path, _scan(tmp_path / "scan"), "--budget", "int4_g32")
    assert result.exit_code == 0, result.output
    return tmp_path / "gen" / "p.yaml", tmp_path / "gen" / "p.plan.json"


def test_hand_edited_plan_json_with_a_string(h, tmp_path):
    cfg, side = _planned(h, tmp_path)
    data = json.loads(side.read_text())
    data["predicted_kld_sum"] = "abc"
    side.write_text(json.dumps(data))
    h.assert_user_error(h.invoke("validate", cfg), "predicted_kld_sum is 'abc'")
    h.assert_user_error(h.invoke("run", cfg, "-s", f"output={tmp_path / 'run'}"), "predicted_kld_sum")
    assert not (tmp_path / "run").exists()


def test_hand_edited_plan_json_broken(h, tmp_path):
    cfg, side = _planned(h, tmp_path)
    side.write_text("{not json")
    h.assert_user_error(h.invoke("validate", cfg), "not valid JSON")


def test_plan_json_missing(h, tmp_path):
    cfg, side = _planned(h, tmp_path)
    side.unlink()
    h.assert_user_error(h.invoke("validate", cfg), "does not exist")


def test_plan_json_with_bad_uniform(h, tmp_path):
    cfg, side = _planned(h, tmp_path)
    data = json.loads(side.read_text())
    data["uniform"] = {"int4_g32": {"predicted_kld_sum": None}}
    side.write_text(json.dumps(data))
    h.assert_user_error(h.invoke("validate", cfg), "uniform.int4_g32")


# --- scales files ---------------------------------------------------------------------------------------------


def _scales(path: Path, *, head_dim_tensors: int = 32, head_dim_header: int = 32, fill: float = 1.0) -> Path:
    layers, heads = 4, 2
    ranges = {}
    for kind in ("key", "value", "key_pre_rope"):
        for gran, shape in (("tensor", ()), ("head", (heads,)), ("channel", (heads, head_dim_tensors))):
            ranges[(kind, gran)] = [Ranges(torch.full(shape, fill), -torch.ones(shape), torch.ones(shape))
                                    for _ in range(layers)]
    header = {"model": "builtin:tiny-llama", "layers": layers, "kv_heads": heads, "head_dim": head_dim_header,
              "corpus": "builtin", "tokenizer": "x", "token_start": 400000, "token_end": 400100, "tokens": 100,
              "seq_len": 50, "method": "absmax", "percentile": 99.9, "target": None}
    return save_scales(path, ranges, header)


def _scales_config(h, tmp_path, scales: Path) -> Path:
    raw = h.tiny_raw(tmp_path / "out", kv={"policies": {"s": {"spec": "int4_channel", "scales": str(scales)}}})
    return h.write_config(tmp_path / "c.yaml", raw)


def test_scales_tensors_that_disagree_with_their_header(h, tmp_path):
    cfg = _scales_config(h, tmp_path, _scales(tmp_path / "s.safetensors", head_dim_tensors=16))
    h.assert_user_error(h.invoke("validate", cfg), "key.channel.absmax has shape [4, 2, 16]", "delete it")
    h.assert_user_error(h.invoke("run", cfg), "shape")
    assert not (tmp_path / "out").exists()


def test_scales_for_another_head_dim_is_refused_before_the_run(h, tmp_path):
    cfg = _scales_config(h, tmp_path, _scales(tmp_path / "s.safetensors", head_dim_tensors=16, head_dim_header=16))
    h.assert_user_error(h.invoke("run", cfg), "head_dim 16", "calibrate for this model")
    assert not (tmp_path / "out").exists()


def test_scales_with_nan(h, tmp_path):
    cfg = _scales_config(h, tmp_path, _scales(tmp_path / "s.safetensors", fill=float("nan")))
    h.assert_user_error(h.invoke("validate", cfg), "NaN or infinity")


def test_scales_with_a_negative_range(h, tmp_path):
    cfg = _scales_config(h, tmp_path, _scales(tmp_path / "s.safetensors", fill=-1.0))
    h.assert_user_error(h.invoke("validate", cfg), "negative range")


def test_corrupt_scales_file_says_how_to_recalibrate(h, tmp_path):
    (tmp_path / "s.safetensors").write_bytes(os.urandom(1000))
    cfg = _scales_config(h, tmp_path, tmp_path / "s.safetensors")
    h.assert_user_error(h.invoke("validate", cfg), "cannot be read", "delete it and recalibrate")


def test_corrupt_auto_scales_can_be_recalibrated(h, tmp_path):
    """A run's scales: auto file that got corrupted: the line says to delete it, and deleting it is enough."""
    raw = h.tiny_raw(tmp_path / "out", kv={"policies": {"s": {"spec": "int8_tensor", "scales": "auto"}}},
                     calibration={"tokens": 64, "seq_len": 32})
    cfg = h.write_config(tmp_path / "c.yaml", raw)
    first = h.invoke("run", cfg, "--quiet")
    assert first.exit_code == 0, first.output
    scales = tmp_path / "out" / "scales.safetensors"
    scales.write_bytes(os.urandom(500))
    records = tmp_path / "out" / "records.jsonl"  # as if the run had been killed before the policy's windows
    kept = [line for line in records.read_text().splitlines(keepends=True) if '"policy": "s"' not in line]
    records.write_text("".join(kept))
    (tmp_path / "out" / "metrics.json").unlink()
    h.assert_user_error(h.invoke("run", cfg, "--quiet"), str(scales), "delete it")
    scales.unlink()
    again = h.invoke("run", cfg, "--quiet")
    assert again.exit_code == 0, again.output
    load_scales(scales)


def test_scales_file_header_sizes_not_integers(tmp_path):
    path = _scales(tmp_path / "s.safetensors")
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    header = json.loads(meta["kveval_scales"])
    header["layers"] = "four"
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"kveval_scales": json.dumps(header)})
    with pytest.raises(KvevalError, match="not positive integers"):
        load_scales(tmp_path / "t.safetensors")
