"""Model folders with KV scales, built in the tests: a model saved with ``save_pretrained``, then a compressed-tensors
``kv_cache_scheme`` (written with compressed-tensors' own ``QuantizationConfig``, as llm-compressor writes it) or a
ModelOpt ``kv_cache_quant_algo`` in its config, and the scale tensors in a shard of their own (listed in
``model.safetensors.index.json``, as sharded checkpoints are)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_model_folder(model, tokenizer, folder: Path) -> Path:
    """``model`` and ``tokenizer`` saved to ``folder`` (safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _index(folder: Path, extra_file: str, names: list[str]) -> None:
    from safetensors import safe_open

    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({n: extra_file for n in names})
    index_path.write_text(json.dumps(index, indent=2))


def _quantization_config(folder: Path, qc: dict) -> None:
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = qc
    cfg_path.write_text(json.dumps(cfg, indent=2))


def add_compressed_tensors_scales(folder: Path, k: list, v: list, strategy: str = "tensor", q: list | None = None,
                                  dtype: torch.dtype = torch.bfloat16, skip: tuple = ()) -> Path:
    """A compressed-tensors KV-only checkpoint: ``k[i]`` / ``v[i]`` (floats for ``tensor``, lists per KV head for
    ``attn_head``; tensors are taken as given, to write bad shapes) as ``model.layers.i.self_attn.k_scale`` ...
    in ``dtype``; ``skip``: names left out."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    qc = QuantizationConfig(config_groups={}, format="dense", quantization_status="compressed",
                            kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy=strategy))
    _quantization_config(folder, {"quant_method": "compressed-tensors", **qc.model_dump(exclude={"quant_method"})})

    def as_tensor(x):
        if isinstance(x, torch.Tensor):
            return x.to(dtype)
        t = torch.tensor(x, dtype=dtype)
        return t.reshape(1) if strategy == "tensor" else t.reshape(-1, 1, 1)

    tensors = {}
    for i, (ki, vi) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = as_tensor(ki)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = as_tensor(vi)
        if q is not None:
            tensors[f"model.layers.{i}.self_attn.q_scale"] = as_tensor(q[i])
    tensors = {n: t.contiguous() for n, t in tensors.items() if n not in skip}
    save_file(tensors, str(folder / "kv_scales.safetensors"), metadata={"format": "pt"})
    _index(folder, "kv_scales.safetensors", list(tensors))
    return folder


def add_modelopt_scales(folder: Path, k: list, v: list, algo: str = "FP8") -> Path:
    """A ModelOpt checkpoint's KV part: hf_quant_config.json with ``kv_cache_quant_algo`` and float32 scalars
    ``model.layers.i.self_attn.k_proj.k_scale`` / ``v_proj.v_scale``."""
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"},
         "quantization": {"quant_algo": None, "kv_cache_quant_algo": algo, "exclude_modules": []}}))
    tensors = {}
    for i, (ki, vi) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(ki, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(vi, dtype=torch.float32)
    save_file(tensors, str(folder / "kv_scales.safetensors"), metadata={"format": "pt"})
    _index(folder, "kv_scales.safetensors", list(tensors))
    return folder
