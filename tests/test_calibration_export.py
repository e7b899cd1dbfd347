"""Scales out: ``kveval calibrate CONFIG --export compressed-tensors DIR`` writes a checkpoint folder (the model's
weights unchanged, config.json ``kv_cache_scheme`` written by compressed-tensors, ``k_scale`` / ``v_scale`` in a
shard of their own) that reads back through the checkpoint-scales path with the metrics of the scales file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from typer.testing import CliRunner

from kveval.cli import app

pytest.importorskip("compressed_tensors")


def _config(tmp_path: Path, **extra) -> Path:
    raw = {"name": "cal", "model": "builtin:tiny-llama", "data": "builtin", "kv": ["vllm_fp8"],
           "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 192, "bootstrap": 0}}],
           "calibration": {"tokens": 256, "seq_len": 64}, **extra}
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(tmp_path: Path, name: str, model: str, kv) -> dict:
    from kveval.commands.run import run_experiment
    from kveval.config import validate

    cfg = validate({"name": name, "model": model, "data": "builtin", "kv": kv,
                    "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 192, "bootstrap": 0}}],
                    "output": str(tmp_path / name)})
    return run_experiment(cfg, quiet=True)["policies"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(scales file, tensor folder, attn_head folder) from one calibration of builtin:tiny-llama."""
    tmp = tmp_path_factory.mktemp("export")
    config = _config(tmp)
    scales, per_tensor, per_head = tmp / "s.safetensors", tmp / "ck_tensor", tmp / "ck_head"
    for folder, strategy in ((per_tensor, "tensor"), (per_head, "attn_head")):
        result = CliRunner().invoke(app, ["calibrate", str(config), "--out", str(scales), "-q",
                                          "--export", "compressed-tensors", str(folder), "--strategy", strategy])
        assert result.exit_code == 0, result.output
    return scales, per_tensor, per_head


def test_the_folder_is_a_compressed_tensors_checkpoint(exported):
    from compressed_tensors.quantization import QuantizationConfig

    from kveval.scales.file import load_scales

    scales, per_tensor, per_head = exported
    sf = load_scales(scales)
    for folder, strategy, shape in ((per_tensor, "tensor", (1,)), (per_head, "attn_head", (2, 1, 1))):
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "dense" and qc["config_groups"] == {}
        assert parsed.kv_cache_scheme.strategy == strategy and parsed.kv_cache_scheme.num_bits == 8
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert index["model.layers.3.self_attn.v_scale"] == "kv_cache_scales.safetensors"
        assert index["model.embed_tokens.weight"] == "model.safetensors"
        with safe_open(str(folder / "kv_cache_scales.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(f"model.layers.{i}.self_attn.{k}_scale" for i in range(4) for k in "kv")
            k2 = f.get_tensor("model.layers.2.self_attn.k_scale")
        assert k2.dtype == torch.float32 and tuple(k2.shape) == shape
        gran = "tensor" if strategy == "tensor" else "head"
        assert torch.equal(k2.flatten(), (sf.ranges(2, "key", gran).absmax.float() / 448).flatten())


def test_the_weights_are_unchanged(exported):
    from kveval.models import build_tiny_model

    _, per_tensor, _ = exported
    ref = build_tiny_model("tiny-llama").state_dict()
    with safe_open(str(per_tensor / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), ref[name]), name


def test_read_back_gives_the_metrics_of_the_scales_file(exported, tmp_path):
    scales, per_tensor, per_head = exported
    from_ckpt = _run(tmp_path, "ck", str(per_tensor), ["vllm_fp8", "vllm_fp8_per_head"])
    from_head = _run(tmp_path, "ckh", str(per_head), ["vllm_fp8_per_head"])
    from_file = _run(tmp_path, "file", "builtin:tiny-llama",
                     [{"vllm_fp8": {"preset": "vllm_fp8", "scales": str(scales)}},
                      {"vllm_fp8_per_head": {"preset": "vllm_fp8_per_head", "scales": str(scales)}}])
    for field in ("kld_mean", "ppl", "top1_agree"):
        assert from_ckpt["vllm_fp8"][field] == from_file["vllm_fp8"][field], field
        assert from_head["vllm_fp8_per_head"][field] == from_file["vllm_fp8_per_head"][field], field
    # a per-tensor checkpoint under the per-head preset: each head gets the layer's one scale
    assert from_ckpt["vllm_fp8_per_head"]["kld_mean"] == from_ckpt["vllm_fp8"]["kld_mean"]


def test_export_into_a_folder_that_holds_files_is_refused(tmp_path):
    config = _config(tmp_path)
    folder = tmp_path / "full"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    result = CliRunner().invoke(app, ["calibrate", str(config), "--out", str(tmp_path / "s.safetensors"),
                                      "--export", "compressed-tensors", str(folder)])
    assert result.exit_code == 2 and "not empty" in result.stderr, result.output
    assert not (tmp_path / "s.safetensors").exists() and sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_an_unknown_export_format_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", str(_config(tmp_path)), "--export", "gguf", str(tmp_path / "x")])
    assert result.exit_code == 2 and "compressed-tensors" in result.stderr, result.output
    assert not (tmp_path / "x").exists()
