"""Hostile checkpoint KV scales (kveval.scales.checkpoint): a model folder whose config declares a KV cache scheme
but whose scales are missing, zero, negative, NaN or of the wrong shape, a scheme the engine refuses, scales of
another format than the policy's, and ``scales: checkpoint`` on a model that has no folder. Each is one line
naming the layer and the tensor, exit status 2, before anything is written (``kveval run`` and ``kveval
validate`` alike)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint_folders import add_compressed_tensors_scales, add_modelopt_scales, save_model_folder  # noqa: E402

pytest.importorskip("compressed_tensors")

GOOD = [0.0625, 0.125, 0.25, 0.5]  # bf16-exact scales, one per layer of builtin:tiny-llama


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    """builtin:tiny-llama saved as a model folder (no KV scheme)."""
    from kveval.models import build_tiny_model, byte_tokenizer

    return save_model_folder(build_tiny_model("tiny-llama"), byte_tokenizer(), tmp_path_factory.mktemp("plain"))


def _copy(plain: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(plain, tmp_path / "ckpt"))


def _run(h, tmp_path, folder, kv=("vllm_fp8",)):
    out = tmp_path / "run"
    path = h.write_config(tmp_path / "c.yaml", h.tiny_raw(out, model=str(folder), kv=list(kv)))
    return h.invoke("run", path, "-q"), out


@pytest.mark.parametrize(("edit", "needles"), [
    (lambda f: add_compressed_tensors_scales(f, GOOD, GOOD, skip=("model.layers.2.self_attn.v_scale",)),
     ("layer 2 has no self_attn.v_scale", "1.0")),
    (lambda f: add_compressed_tensors_scales(f, GOOD, [0.5, 0.5, 0.0, 0.5]), ("layer 2", "v_scale", "holds 0")),
    (lambda f: add_compressed_tensors_scales(f, [0.5, -0.25, 0.5, 0.5], GOOD), ("layer 1", "k_scale", "negative")),
    (lambda f: add_compressed_tensors_scales(f, [0.5, 0.5, 0.5, float("nan")], GOOD),
     ("layer 3", "k_scale", "NaN")),
    (lambda f: add_compressed_tensors_scales(f, [torch.ones(2), 0.5, 0.5, 0.5], GOOD),
     ("layer 0", "k_scale", "shape [2]", "expected [1]")),
    (lambda f: add_compressed_tensors_scales(f, [[0.5, 0.5, 0.5]] * 4, [[0.5, 0.5]] * 4, strategy="attn_head"),
     ("layer 0", "k_scale", "shape [3, 1, 1]", "[2, 1, 1]")),
    (lambda f: add_compressed_tensors_scales(f, GOOD + [0.5], GOOD + [0.5]), ("layer 4", "4 layers")),
    (lambda f: add_modelopt_scales(f, [0.5, 0.0, 0.5, 0.5], GOOD), ("layer 1", "k_proj.k_scale", "holds 0",
                                                                     "vLLM stops on a zero")),
], ids=["missing", "zero", "negative", "nan", "shape", "heads", "extra_layer", "modelopt_zero"])
def test_a_bad_checkpoint_scale_is_one_line_and_nothing_is_written(h, tmp_path, plain_folder, edit, needles):
    folder = _copy(plain_folder, tmp_path)
    edit(folder)
    result, out = _run(h, tmp_path, folder)
    h.assert_user_error(result, *needles)
    assert not out.exists()
    config = tmp_path / "c.yaml"
    h.assert_user_error(h.invoke("validate", config), *needles)


def test_a_scheme_vllm_refuses(h, tmp_path, plain_folder):
    folder = _copy(plain_folder, tmp_path)
    add_compressed_tensors_scales(folder, GOOD, GOOD)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"].update(num_bits=4)
    (folder / "config.json").write_text(json.dumps(cfg))
    result, out = _run(h, tmp_path, folder)
    h.assert_user_error(result, "num_bits 4", "vLLM refuses it")
    assert not out.exists()


def test_per_head_scales_under_a_per_tensor_policy(h, tmp_path, plain_folder):
    folder = _copy(plain_folder, tmp_path)
    add_compressed_tensors_scales(folder, [[0.5, 0.25]] * 4, [[0.5, 0.25]] * 4, strategy="attn_head")
    result, out = _run(h, tmp_path, folder)
    h.assert_user_error(result, "policy 'vllm_fp8'", "attn_head", "vllm_fp8_per_head")
    assert not out.exists()


def test_nvfp4_scales_under_an_fp8_policy(h, tmp_path, plain_folder):
    folder = _copy(plain_folder, tmp_path)
    add_modelopt_scales(folder, GOOD, GOOD, algo="NVFP4")
    result, out = _run(h, tmp_path, folder)
    h.assert_user_error(result, "policy 'vllm_fp8'", "NVFP4 KV scales", "quantizes to FP8")
    assert not out.exists()


def test_checkpoint_scales_of_a_model_without_a_folder(h, tmp_path):
    out = tmp_path / "run"
    path = h.write_config(tmp_path / "c.yaml", h.tiny_raw(out, kv={"policies": {"p": {"preset": "vllm_fp8",
                                                                                     "scales": "checkpoint"}}}))
    h.assert_user_error(h.invoke("run", path, "-q"), "scales: checkpoint", "not one")
    assert not out.exists()


def test_a_pre_rope_policy_cannot_take_checkpoint_scales(h, tmp_path, plain_folder):
    folder = _copy(plain_folder, tmp_path)
    add_compressed_tensors_scales(folder, GOOD, GOOD)
    result, out = _run(h, tmp_path, folder, kv=[{"p": {"preset": "vllm_fp8", "pre_rope": True}}])
    h.assert_user_error(result, "policy 'p'", "post-RoPE")
    assert not out.exists()


@pytest.mark.parametrize("link", [False, True])
def test_a_shard_that_is_a_fifo_is_refused_before_it_is_opened(tmp_path, link):
    """A FIFO named like a shard (or a symbolic link to one) blocked the run forever in open(); it is refused in one
    line (a thread keeps a regression from hanging the suite)."""
    import os
    import threading

    from kveval.errors import KvevalError
    from kveval.scales.checkpoint_tensors import read_scale_tensors

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    fifo = tmp_path / "pipe" if link else folder / "model.safetensors"
    os.mkfifo(fifo)
    if link:
        (folder / "model.safetensors").symlink_to(fifo)
    outcome: list = []

    def read():
        try:
            read_scale_tensors(folder)
            outcome.append("read")
        except KvevalError as exc:
            outcome.append(str(exc))

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    assert outcome and "not a regular file" in outcome[0], outcome or "read_scale_tensors blocked on the FIFO"


def test_a_shard_linked_into_the_hub_cache_layout_is_read(tmp_path):
    """The hub's cache keeps a snapshot's files as symbolic links to blobs: such a shard is followed and read."""
    import torch
    from safetensors.torch import save_file

    from kveval.scales.checkpoint_tensors import read_scale_tensors

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25)}, str(blobs / "0123"))
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123")
    got = read_scale_tensors(snapshot)
    assert float(got[(0, "key")][1]) == 0.5 and float(got[(0, "value")][1]) == 0.25


def test_a_refused_resume_of_a_checkpoint_scales_run_is_its_one_line(h, tmp_path, plain_folder):
    """A finished run, then the checkpoint's scales change: the rerun is refused in one line, with nothing of
    compressed-tensors' "Applying quantization config" progress bars before it (nor in the quiet run before)."""
    folder = _copy(plain_folder, tmp_path)
    add_compressed_tensors_scales(folder, GOOD, GOOD)
    result, out = _run(h, tmp_path, folder)
    assert result.exit_code == 0 and result.stderr.strip() == "", result.stderr
    records = (out / "records.jsonl").read_text()
    add_compressed_tensors_scales(folder, [s / 2 for s in GOOD], GOOD)
    h.assert_user_error(h.invoke("run", tmp_path / "c.yaml", "-q"), "scales", "changed", "--overwrite")
    assert (out / "records.jsonl").read_text() == records
