"""How each serving engine loads a checkpoint's KV scales (:func:`engine_scales`): the raw tensors of
:func:`kveval.scales.checkpoint_tensors.read_scale_tensors` under a declared
:class:`kveval.scales.kv_scheme.KVScheme`, checked (:func:`check_scale`), turned into the float32 ``[layers, H]``
scales the engine would quantize with.

A scale s is the dequantization multiplier: the cache stores ``q = cast(x / s)`` and reads ``q * s``.

How each engine loads them (``engine_scales``; the values kveval quantizes with):

- **vLLM 0.33.0** (g4ba787ec9), compressed-tensors: ``CompressedTensorsKVCacheMethod``
  (``model_executor/layers/quantization/compressed_tensors/compressed_tensors.py`` L1093-1281):
  ``validate_kv_cache_scheme`` accepts only ``type: float, num_bits: 8, symmetric`` with strategy ``tensor`` or
  ``attn_head``; ``create_weights`` makes ``k/v/q_scale = torch.ones(n, float32)`` (n = kv heads for attn_head,
  else 1), so a **missing scale is 1.0**; the attn_head loader flattens ``[H, 1, 1]`` to ``[H]`` and takes the max
  of ``q_scale`` over each GQA group; every value is copied ``.to(float32)``; no check for zero, negative or NaN.
  ModelOpt: ``ModelOptKVCacheMethod`` = ``BaseKVCacheMethod`` (``quantization/kv_cache.py`` L21-42, L78-170):
  scalars initialised to -1 ("not loaded"); both loaded and > 0: used as loaded; both missing: 1.0; otherwise
  ``assert k_scale > 0`` and both become ``max(k_scale, v_scale)`` (a **zero v_scale becomes k_scale**, a zero
  k_scale stops the engine); a missing ``q_scale`` becomes ``k_scale``; on ROCm fp8-fnuz every scale is doubled
  (kveval's FP8 is CUDA's e4m3fn: not applied). Names: ``maybe_remap_kv_scale_name``
  (``model_loader/weight_utils.py`` L1722-1831) maps both spellings to ``self_attn.attn.{k,v,q}_scale``.
- **SGLang 0.5.23**: FP8 ``--kv-cache-dtype fp8_e4m3`` reads the checkpoint's ``k_scale`` / ``v_scale`` (1.0
  without; ``srt/arg_groups/fields/model.py`` L185-196); NVFP4 (``NVFP4KVCacheMethod.load_scales_from_model``,
  ``srt/layers/quantization/fp4_kv_cache_quant_method.py`` L498-560): 1.0 without, and on SM100 a loaded scale
  other than 1.0 is **multiplied by 6** (its TRT-LLM GenMHA kernels expect amax / 448, the checkpoints it assumes
  hold amax / (6 * 448)); kveval follows the SM90 path (``fp4_quantize`` with ``1 / global_scale``: no factor)
  unless the preset says SM100.
- **TensorRT-LLM** (PyTorch backend, ``tensorrt_llm/_torch/modules/linear.py``
  ``process_weights_after_loading_fused_qkv_linear``, stored version 3478255898): ``kv_scales = [1.0,
  max(k_scales), max(v_scales)]`` over the fused q/k/v shards (one shard each here), float32, ``ones(3)`` without
  (``TRTLLM_LOAD_KV_SCALES=1``, its default); its INT8 cache keeps one factor per layer for K and V together
  (the larger: docs/engines.md, from its documentation).

kveval refuses what an engine would silently turn into 1.0 or crash on: a declared scheme whose checkpoint lacks
a layer's scale, a zero, negative or non-finite scale, or one of the wrong shape is one :class:`KvevalError` line
naming the layer and the tensor (and what the engine would have done). A checkpoint without any KV scheme has no
checkpoint scales (``read_scheme`` gives None): the engine uses 1.0.
"""

from __future__ import annotations

import torch

from kveval.scales.checkpoint_tensors import SCALE_NAMES
from kveval.scales.kv_scheme import KVScheme, checkpoint_error

#: where the engines load checkpoint scales from (``engine_scales``); the presets of
#: :data:`kveval.scales.checkpoint.PRESET_ENGINES` name one
ENGINES = ("vllm", "sglang", "sglang_sm100", "trtllm")


def check_scale(t: torch.Tensor, name: str, layer: int, want: tuple[tuple[int, ...], ...], where: str,
                engine_note: str) -> torch.Tensor:
    """``t`` as float32 after the checks (one of the shapes ``want``, floating point, finite, > 0); a KvevalError
    naming the layer, the tensor and what the engine does with such a value otherwise."""
    if not t.is_floating_point():
        dtype = str(t.dtype).removeprefix("torch.")
        raise checkpoint_error(where, f"layer {layer} {name} is {dtype}, not a float scale")
    if tuple(t.shape) not in want:
        shapes = " or ".join(str(list(s)) for s in want)
        raise checkpoint_error(where, f"layer {layer} {name} has shape {list(t.shape)}, expected {shapes}")
    v = t.detach().to(torch.float32)
    if not bool(torch.isfinite(v).all()):
        raise checkpoint_error(where, f"layer {layer} {name} holds NaN or infinity ({engine_note})")
    if bool((v == 0).any()):
        raise checkpoint_error(where, f"layer {layer} {name} holds 0 ({engine_note})")
    if bool((v < 0).any()):
        raise checkpoint_error(where, f"layer {layer} {name} is negative ({engine_note})")
    return v


def _engine_note(engine: str, producer: str) -> str:
    """What the engine does with a zero, negative or NaN scale (said beside kveval's refusal)."""
    if engine == "vllm":
        return ("vLLM's compressed-tensors loader would use it as it is" if producer == "compressed-tensors" else
                "vLLM stops on a zero or negative k_scale and copies k_scale over such a v_scale")
    return {"trtllm": "TensorRT-LLM would use it as it is"}.get(engine, "SGLang would use it as it is")


def engine_scales(raw: dict[tuple[int, str], tuple[str, torch.Tensor]], scheme: KVScheme, layers: int,
                  kv_heads: int, heads: int, engine: str, where: str) -> dict[str, torch.Tensor]:
    """``{"key.scale", "value.scale"[, "query.scale"]}`` float32 ``[layers, H]`` as ``engine`` loads the raw
    checkpoint tensors (module docstring), after the checks: every layer has a k and a v scale of the scheme's
    shape, finite and > 0; q scales, where present, are checked too."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}; got {engine!r}")
    per_head = scheme.strategy == "attn_head"
    shapes = {"key": ((kv_heads, 1, 1), (kv_heads,)) if per_head else ((1,), ()),
              "value": ((kv_heads, 1, 1), (kv_heads,)) if per_head else ((1,), ()),
              "query": ((heads, 1, 1), (heads,), (kv_heads, 1, 1), (kv_heads,)) if per_head else ((1,), ())}
    stray = sorted({layer for layer, _ in raw if layer >= layers})
    if stray:
        raise checkpoint_error(where, f"holds KV scales for layer {stray[0]}, the model has {layers} layers "
                                      f"(0-{layers - 1})")
    note = _engine_note(engine, scheme.producer)
    out: dict[str, list[torch.Tensor]] = {"key": [], "value": [], "query": []}
    have_q = any(kind == "query" for _, kind in raw)
    for layer in range(layers):
        for kind in ("key", "value", "query"):
            entry = raw.get((layer, kind))
            if entry is None:
                if kind == "query" and not have_q:
                    continue
                if kind == "value" and (layer, "key") in raw and raw[(layer, "key")][0].endswith(".kv_scale"):
                    entry = raw[(layer, "key")]  # vLLM duplicates a legacy kv_scale to v
                else:
                    name = "self_attn." + ({"compressed-tensors": ""}.get(scheme.producer, f"{kind[0]}_proj.")
                                           + SCALE_NAMES[kind])
                    raise checkpoint_error(where, f"declares {scheme.describe()} but layer {layer} has no {name} "
                                                  f"({engine} would use 1.0 for it)")
            name, t = entry
            v = check_scale(t, name, layer, shapes[kind], where, note).flatten()
            if kind == "query" and per_head and v.numel() == heads and heads != kv_heads:
                v = v.view(kv_heads, heads // kv_heads).amax(dim=1)  # vLLM's max over each GQA group
            out[kind].append(v)
    if engine == "trtllm" and scheme.algo == "INT8":  # one factor per layer for K and V together, the larger
        both = [torch.maximum(k, v) for k, v in zip(out["key"], out["value"])]
        out["key"], out["value"] = both, list(both)
    if engine == "sglang_sm100" and scheme.algo == "NVFP4":  # load_scales_from_model: x6 unless exactly 1.0
        for kind in ("key", "value"):
            out[kind] = [torch.where(v != 1.0, v * 6.0, v) for v in out[kind]]
    tensors = {f"{kind}.scale": torch.stack(vals) for kind, vals in out.items() if vals}
    return tensors


__all__ = ["ENGINES", "check_scale", "engine_scales"]
