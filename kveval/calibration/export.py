"""Scales out: ``kveval calibrate CONFIG --export compressed-tensors DIR`` writes a model folder that vLLM loads with
the calibrated FP8 KV scales: the model's weights unchanged (``save_pretrained`` of the model as loaded), its
tokenizer, ``config.json`` with a compressed-tensors ``quantization_config`` whose ``kv_cache_scheme`` is built
by compressed-tensors itself (:func:`kveval.scales.checkpoint.kv_cache_config`), and one FP8 E4M3 scale per
layer and K/V (``strategy: tensor``, ``[1]``) or per KV head (``attn_head``, ``[num_kv_heads, 1, 1]``) named
``<attention module>.k_scale`` / ``.v_scale`` (``model.layers.N.self_attn.k_scale``), float32, in a shard of
their own (``kv_cache_scales.safetensors``) listed in ``model.safetensors.index.json`` beside the weights' shards.

A scale is kveval's calibrated one, ``absmax / 448`` of the scales file's ranges (post-RoPE keys, values), the
value ``kveval.quant.qparams_from_range`` gives a ``fp8_e4m3_tensor`` / ``fp8_e4m3_head`` spec: the folder read
back through the checkpoint-scales path (``scales: DIR``, or as a run's model with ``vllm_fp8``) gives the metrics
of the scales file. The folder is written to a temporary sibling and moved into place at the end (a new or empty
``DIR`` only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.scales.checkpoint import ScalesOut, fp8_scale, kv_cache_config

FORMATS = ("compressed-tensors",)
SCALES_SHARD = "kv_cache_scales.safetensors"
INDEX = "model.safetensors.index.json"


def attention_names(model) -> list[str]:
    """The module names of the model's attention layers in layer order (``model.layers.0.self_attn`` ...)."""
    from kveval.patch.attention import attention_modules

    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in attention_modules(model)]


def scale_tensors(sf, names: list[str], strategy: str) -> dict[str, torch.Tensor]:
    """``{name.k_scale: [1] or [H, 1, 1], name.v_scale: ...}`` float32 from a scales file's key/value ranges."""
    gran = "tensor" if strategy == "tensor" else "head"
    out = {}
    for layer, name in enumerate(names):
        for kind, suffix in (("key", "k_scale"), ("value", "v_scale")):
            s = fp8_scale(sf.ranges(layer, kind, gran).absmax)
            out[f"{name}.{suffix}"] = (s.reshape(1) if strategy == "tensor" else s.reshape(-1, 1, 1)).contiguous()
    return out


def export_compressed_tensors(model, tokenizer, scales_path: str | Path, folder: str | Path,
                              strategy: str = "tensor") -> ScalesOut:
    """Write the checkpoint folder (module docstring) from the loaded ``model`` and the scales file
    ``scales_path``; returns what was written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kveval.fileio import atomic_path, remove_stale_folders
    from kveval.scales.file import load_scales

    sf = load_scales(scales_path)
    names = attention_names(model)
    if len(names) != sf.header.get("layers"):
        raise KvevalError(f"the scales file has {sf.header.get('layers')} layers, the model {len(names)} attention "
                          "layers")
    tensors = scale_tensors(sf, names, strategy)
    folder = Path(folder).expanduser()
    remove_stale_folders(Path(folder))  # the partial folder of an export killed part-way (its pid is gone)
    with atomic_path(folder, folder=True, suffix=f".pid{os.getpid()}") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = kv_cache_config(strategy)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / SCALES_SHARD), metadata={"format": "pt"})
        index_path = tmp / INDEX
        if index_path.is_file():
            index = json.loads(index_path.read_text())
        else:
            with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
                index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
        index.setdefault("weight_map", {}).update({n: SCALES_SHARD for n in tensors})
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return ScalesOut(str(folder), strategy, tensors)
