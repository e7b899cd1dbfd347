"""A checkpoint's KV scale tensors as stored (:func:`read_scale_tensors`): the safetensors shards of a model folder
(those its ``model.safetensors.index.json`` names, else every ``*.safetensors``), and in them one ``k_scale`` /
``v_scale`` (``q_scale`` where attention is quantized too) per attention layer, under either spelling:
compressed-tensors' ``model.layers.N.self_attn.k_scale`` (``[1]`` per tensor, ``[num_kv_heads, 1, 1]`` per head)
or ModelOpt's ``model.layers.N.self_attn.k_proj.k_scale`` (a float32 scalar ``[]``).

Only the scale tensors are read, untouched (dtype and shape as stored); what the engines make of them is
:mod:`kveval.scales.engine_loading`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kveval.scales.kv_scheme import checkpoint_error, read_json

#: tensor kind (kveval's) -> the checkpoint's scale name
SCALE_NAMES = {"key": "k_scale", "value": "v_scale", "query": "q_scale"}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[A-Za-z_]+\.)?(?:(k|v|q)_proj\.)?(k|v|q|kv)_scale$")


def safetensors_files(folder: Path, where: str) -> list[Path]:
    """The shards of a model folder: the files its ``model.safetensors.index.json`` ``weight_map`` names (each
    must be there), else every ``*.safetensors`` in it; sorted."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict):
            raise checkpoint_error(where, f"{index.name} has no weight_map")
        names = sorted({str(v) for v in weight_map.values()})
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise checkpoint_error(where, f"{index.name} names {missing[0]}, which is not in the folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    for f in files:  # a FIFO or a device (or a link to one) would block or stream forever when opened
        if not f.is_file():
            raise checkpoint_error(where, f"{f.name} is not a regular file (a pipe, a device or a broken link); "
                                          "a safetensors shard must be a file")
    return files


def read_scale_tensors(folder: str | Path) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """``{(layer, kind): (tensor name, tensor)}`` of the KV scales in a folder's safetensors (kind ``key``,
    ``value``, ``query``; both spellings: ``self_attn.k_scale`` and ModelOpt's ``self_attn.k_proj.k_scale``; a
    legacy single ``kv_scale`` is read as ``key``, as vLLM remaps it). Only the scale tensors are read."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    where = str(folder)
    out: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    kinds = {"k": "key", "v": "value", "q": "query", "kv": "key"}
    for path in safetensors_files(folder, where):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    m = _LAYER_RE.search(name)
                    if m is None or (m.group(2) and m.group(2) != m.group(3)):
                        continue
                    key = (int(m.group(1)), kinds[m.group(3)])
                    if key in out:
                        raise checkpoint_error(where, f"layer {key[0]} holds two {SCALE_NAMES[key[1]]} tensors "
                                                      f"({out[key][0]} and {name})")
                    out[key] = (name, f.get_tensor(name))
        except (SafetensorError, OSError) as exc:
            first = str(exc).strip().splitlines()
            raise checkpoint_error(where, f"{path.name} cannot be read "
                                          f"({first[0][:160] if first else type(exc).__name__})") from None
    return out


__all__ = ["SCALE_NAMES", "read_scale_tensors", "safetensors_files"]
