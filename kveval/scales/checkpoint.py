"""KV-cache scales that a checkpoint ships, read as the serving engines load them, and written back in the same form.

A model folder carries KV scales when its ``config.json`` ``quantization_config`` declares a KV cache scheme and its
safetensors hold one ``k_scale`` / ``v_scale`` (and, where attention is quantized too, ``q_scale``) per attention
layer:

- **compressed-tensors** (llm-compressor): ``quant_method: compressed-tensors`` with ``kv_cache_scheme``, a
  ``QuantizationArgs`` (parsed with the compressed-tensors library itself: ``QuantizationConfig.model_validate``);
  tensors ``model.layers.N.self_attn.{k,v,q}_scale``, shape ``[1]`` for ``strategy: tensor`` or
  ``[num_kv_heads, 1, 1]`` for ``strategy: attn_head`` (compressed-tensors 0.20 ``initialize_attn_qparams``), in
  the model's dtype; the scale of post-RoPE keys (the hook sits at ``past_key_values.update``).
- **NVIDIA ModelOpt**: ``quant_method: modelopt`` with ``kv_cache_scheme`` (a dict for FP8, else the algorithm's
  name) or ``hf_quant_config.json`` ``{"quantization": {"kv_cache_quant_algo": "FP8" | "NVFP4" | "INT8"}}``
  (modelopt 0.47 ``convert_hf_config.py`` L240-282; these few JSON keys are read directly: nvidia-modelopt, the
  library that defines them, is a heavy CUDA-oriented install); tensors ``model.layers.N.self_attn.k_proj.k_scale``
  and ``...v_proj.v_scale`` (``quant_utils.py`` ``_KV_CACHE_REPLACEMENTS``), float32 scalars, ``amax / 448``
  (NVFP4 before modelopt 0.42: ``amax / (6 * 448)``).

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

:class:`CheckpointScales` is a :class:`kveval.scales.file.ScalesFile` whose ``qparams`` give those scales to a
symmetric tensor/head spec (the patch code reads it as it reads a scales file); ``scales: DIR`` in a policy names
such a folder, and ``scales: checkpoint`` the run's own model folder (``kveval.calibration.checks``).

Writing (``kv_cache_config``, ``scale_tensor_names``): a compressed-tensors ``quantization_config`` with
``kv_cache_scheme`` (built and serialized by compressed-tensors' own ``QuantizationConfig``, ``format: dense``,
``quantization_status: compressed``, ``config_groups: {}``: what llm-compressor writes for a KV-only scheme and
what vLLM loads) and the scale tensors' names and shapes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.quant import QParams, QuantSpec
from kveval.quant.formats.base import SCALE_TORCH_DTYPES, store

#: ``scales: checkpoint`` in a policy: the scales of the run's own model folder
CHECKPOINT_SCALES = "checkpoint"
PRODUCERS = ("compressed-tensors", "modelopt")
STRATEGIES = ("tensor", "attn_head")
#: tensor kind (kveval's) -> the checkpoint's scale name
SCALE_NAMES = {"key": "k_scale", "value": "v_scale", "query": "q_scale"}
#: where the engines load checkpoint scales from (``engine_scales``); the presets below name one
ENGINES = ("vllm", "sglang", "sglang_sm100", "trtllm")
#: policy presets whose engine loads the checkpoint's KV scales, and the engine's loading rule. A policy made from
#: one of them without its own ``scales:`` takes the run's model folder's scales by default (when it has some).
PRESET_ENGINES: dict[str, str] = {
    "vllm_fp8": "vllm", "vllm_fp8_per_head": "vllm", "vllm_fp8_fa3": "vllm", "vllm_nvfp4": "vllm",
    "vllm_nvfp4_4over6": "vllm", "trtllm_int8": "trtllm", "trtllm_nvfp4": "trtllm", "sglang_nvfp4": "sglang",
}
#: the KV algorithm a checkpoint's scales are for, by format of the spec that uses them
_ALGO_OF_FORMAT = {"fp8_e4m3": "FP8", "nvfp4": "NVFP4", "nvfp4_4over6": "NVFP4", "int": "INT8"}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[A-Za-z_]+\.)?(?:(k|v|q)_proj\.)?(k|v|q|kv)_scale$")


def _fail(where: str, what: str) -> KvevalError:
    return KvevalError(f"checkpoint {where}: {what}")


@dataclass(frozen=True)
class KVScheme:
    """A checkpoint's declared KV cache quantization: ``producer`` (compressed-tensors or modelopt), ``algo``
    (``FP8``, ``NVFP4``, ``INT8``), ``strategy`` (``tensor`` or ``attn_head``), where it was declared
    (``config_file``) and the declaration as written (``declared``: the ``kv_cache_scheme`` dict or the algorithm)."""

    producer: str
    algo: str
    strategy: str
    config_file: str
    declared: dict | str
    library: str = ""

    def describe(self) -> str:
        per = "per head" if self.strategy == "attn_head" else "per tensor"
        return f"{self.producer} {self.algo} KV scales {per} ({self.config_file})"


def _read_json(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(where, f"{path.name} cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise _fail(where, f"{path.name} is not a JSON object")
    return data


def text_config(config: dict) -> dict:
    """The language model's part of a ``config.json`` (``text_config`` of a multimodal model, else itself)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def model_shape(folder: str | Path) -> tuple[int, int, int]:
    """(layers, kv heads, attention heads) from a model folder's ``config.json``."""
    where = str(folder)
    cfg = text_config(_read_json(Path(folder) / "config.json", where))
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    layers = cfg.get("num_hidden_layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, kv, heads)):
        raise _fail(where, "config.json has no positive num_hidden_layers / num_attention_heads / "
                           "num_key_value_heads")
    return layers, kv, heads


def read_scheme(folder: str | Path) -> KVScheme | None:
    """The KV scheme a model folder declares, or None (no quantization_config, or one without a KV scheme). A
    declared scheme that vLLM would refuse (not 8-bit float symmetric static per tensor or head, for
    compressed-tensors) is a KvevalError naming the field."""
    folder = Path(folder)
    where = str(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None
    qc = _read_json(cfg_path, where).get("quantization_config")
    hf_quant = folder / "hf_quant_config.json"
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    if (isinstance(qc, dict) and qc.get("quant_method") == "modelopt") or hf_quant.is_file():
        return _modelopt_scheme(qc if isinstance(qc, dict) else {}, hf_quant, where)
    return None


def _compressed_tensors_scheme(qc: dict, where: str) -> KVScheme | None:
    """compressed-tensors' own parse of the quantization_config, then vLLM's ``validate_kv_cache_scheme``."""
    if qc.get("kv_cache_scheme") is None:
        return None
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise _fail(where, "declares a compressed-tensors kv_cache_scheme; install compressed-tensors to read it "
                           "(pip install 'compressed-tensors==0.20.1')") from None
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(qc)
    except (ValidationError, ValueError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()
        raise _fail(where, f"config.json quantization_config is not a compressed-tensors config "
                           f"({first[0][:160] if first else type(exc).__name__})") from None
    args = parsed.kv_cache_scheme
    if args is None:
        return None
    strategy = str(getattr(args.strategy, "value", args.strategy))
    kind = str(getattr(args.type, "value", args.type))
    problems = []
    if kind != "float" or args.num_bits != 8:
        problems.append(f"type {kind} num_bits {args.num_bits} (vLLM: only num_bits 8 type float)")
    if strategy not in STRATEGIES:
        problems.append(f"strategy {strategy} (vLLM: tensor or attn_head)")
    if not args.symmetric:
        problems.append("symmetric: false (vLLM: symmetric only)")
    if args.dynamic:
        problems.append(f"dynamic: {args.dynamic} (no static scales to read)")
    if problems:
        raise _fail(where, f"kv_cache_scheme {'; '.join(problems)}: vLLM refuses it")
    declared = qc["kv_cache_scheme"]
    return KVScheme("compressed-tensors", "FP8", strategy, "config.json", declared if isinstance(declared, dict)
                    else {}, f"compressed-tensors {compressed_tensors.__version__}")


_MODELOPT_ALGOS = ("FP8", "NVFP4", "INT8")


def _modelopt_scheme(qc: dict, hf_quant: Path, where: str) -> KVScheme | None:
    """ModelOpt's KV algorithm from hf_quant_config.json or config.json (per-tensor scales only)."""
    algo, source = None, "config.json"
    if hf_quant.is_file():
        q = _read_json(hf_quant, where).get("quantization")
        algo, source = (q.get("kv_cache_quant_algo") if isinstance(q, dict) else None), hf_quant.name
    if algo is None:
        declared = qc.get("kv_cache_quant_algo", qc.get("kv_cache_scheme"))
        if isinstance(declared, dict):
            fp8 = declared.get("num_bits") == 8 and declared.get("type") == "float"
            algo = "FP8" if fp8 else None
            if not fp8:
                raise _fail(where, f"ModelOpt kv_cache_scheme {declared} is not FP8 (vLLM reads it as no KV scheme)")
        else:
            algo = declared
    if algo is None:
        return None
    if algo not in _MODELOPT_ALGOS:
        raise _fail(where, f"ModelOpt kv_cache_quant_algo {algo!r} is none of {', '.join(_MODELOPT_ALGOS)}")
    return KVScheme("modelopt", str(algo), "tensor", source, str(algo), "modelopt (JSON keys read directly)")


def _safetensors_files(folder: Path, where: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _fail(where, f"{index.name} has no weight_map")
        names = sorted({str(v) for v in weight_map.values()})
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise _fail(where, f"{index.name} names {missing[0]}, which is not in the folder")
        return files
    return sorted(folder.glob("*.safetensors"))


def read_scale_tensors(folder: str | Path) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """``{(layer, kind): (tensor name, tensor)}`` of the KV scales in a folder's safetensors (kind ``key``,
    ``value``, ``query``; both spellings: ``self_attn.k_scale`` and ModelOpt's ``self_attn.k_proj.k_scale``; a
    legacy single ``kv_scale`` is read as ``key``, as vLLM remaps it). Only the scale tensors are read."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    where = str(folder)
    out: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    kinds = {"k": "key", "v": "value", "q": "query", "kv": "key"}
    for path in _safetensors_files(folder, where):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    m = _LAYER_RE.search(name)
                    if m is None or (m.group(2) and m.group(2) != m.group(3)):
                        continue
                    key = (int(m.group(1)), kinds[m.group(3)])
                    if key in out:
                        raise _fail(where, f"layer {key[0]} holds two {SCALE_NAMES[key[1]]} tensors "
                                           f"({out[key][0]} and {name})")
                    out[key] = (name, f.get_tensor(name))
        except (SafetensorError, OSError) as exc:
            first = str(exc).strip().splitlines()
            raise _fail(where, f"{path.name} cannot be read ({first[0][:160] if first else type(exc).__name__})") \
                from None
    return out


def check_scale(t: torch.Tensor, name: str, layer: int, want: tuple[tuple[int, ...], ...], where: str,
                engine_note: str) -> torch.Tensor:
    """``t`` as float32 after the checks (one of the shapes ``want``, floating point, finite, > 0); a KvevalError
    naming the layer, the tensor and what the engine does with such a value otherwise."""
    if not t.is_floating_point():
        raise _fail(where, f"layer {layer} {name} is {str(t.dtype).removeprefix('torch.')}, not a float scale")
    if tuple(t.shape) not in want:
        shapes = " or ".join(str(list(s)) for s in want)
        raise _fail(where, f"layer {layer} {name} has shape {list(t.shape)}, expected {shapes}")
    v = t.detach().to(torch.float32)
    if not bool(torch.isfinite(v).all()):
        raise _fail(where, f"layer {layer} {name} holds NaN or infinity ({engine_note})")
    if bool((v == 0).any()):
        raise _fail(where, f"layer {layer} {name} holds 0 ({engine_note})")
    if bool((v < 0).any()):
        raise _fail(where, f"layer {layer} {name} is negative ({engine_note})")
    return v


def _engine_note(engine: str, producer: str) -> str:
    """What the engine does with a zero, negative or NaN scale (said beside kveval's refusal)."""
    if engine == "vllm":
        return ("vLLM's compressed-tensors loader would use it as it is" if producer == "compressed-tensors" else
                "vLLM stops on a zero or negative k_scale and copies k_scale over such a v_scale")
    return {"trtllm": "TensorRT-LLM would use it as it is"}.get(engine, "SGLang would use it as it is")


@dataclass
class CheckpointScales:
    """A model folder's KV scales as ``engine`` loads them, checked, with the interface of
    :class:`kveval.scales.file.ScalesFile` that the quantizers read (``qparams``, ``check_model``, ``kinds``).

    ``tensors``: ``key.scale`` / ``value.scale`` float32 ``[layers, H]`` (H = kv heads for ``attn_head``, else 1)
    and ``query.scale`` when the checkpoint has q scales; ``header``: the model's shape, the scheme and where the
    scales came from (``source``)."""

    header: dict
    tensors: dict[str, torch.Tensor]
    path: str = ""
    scheme: KVScheme | None = None
    engine: str = "vllm"

    @property
    def kinds(self) -> list[str]:
        return ["key", "value"]

    @property
    def per_head(self) -> bool:
        return self.scheme is not None and self.scheme.strategy == "attn_head"

    def ranges(self, layer: int, kind: str, granularity: str):
        raise KvevalError(f"checkpoint {self.path}: holds scales, not calibrated ranges; use a symmetric tensor or "
                          "head spec (FP8, INT8, NVFP4)")

    def scale(self, layer: int, kind: str) -> torch.Tensor:
        """The engine's float32 scale(s) of one layer's keys or values: ``[H]`` (``[1]`` per tensor)."""
        if kind not in ("key", "value"):
            what = "pre-RoPE keys" if kind == "key_pre_rope" else f"'{kind}'"
            raise KvevalError(f"checkpoint {self.path}: its KV scales are of post-RoPE keys and values, not of "
                              f"{what}; a policy that stores {what} needs its own calibration (scales: auto)")
        return self.tensors[f"{kind}.scale"][layer]

    def qparams(self, layer: int, kind: str, spec: QuantSpec) -> QParams:
        """The checkpoint's scale for a symmetric ``tensor`` (``[1, 1, 1, 1]``) or ``head`` (``[1, H, 1, 1]``: a
        per-tensor scale repeated over the heads, as the engine applies it) spec, in the spec's scale dtype."""
        if spec.mapping != "symmetric" or spec.granularity not in ("tensor", "head") or spec.outliers:
            raise KvevalError(f"checkpoint {self.path}: its KV scales fit a symmetric per-tensor or per-head spec "
                              f"without outliers; the policy uses {spec.describe()}")
        if spec.granularity == "tensor" and self.per_head:
            raise KvevalError(f"checkpoint {self.path}: its kv_cache_scheme is attn_head (one scale per KV head, "
                              f"which vLLM uses); the policy quantizes per tensor ({spec.describe()}): use a "
                              "per-head spec (vllm_fp8_per_head)")
        s = self.scale(layer, kind)
        heads = int(self.header["kv_heads"])
        shape = (1, 1, 1, 1) if spec.granularity == "tensor" else (1, heads, 1, 1)
        s = s.expand(heads) if spec.granularity == "head" and s.numel() == 1 else s
        sdt = SCALE_TORCH_DTYPES.get(spec.scale_dtype, torch.float32)
        return QParams(store(s.reshape(shape), sdt))

    def check_model(self, model_name: str, layers: int, kv_heads: int, head_dim: int) -> None:
        have = (self.header.get("layers"), self.header.get("kv_heads"))
        if have != (layers, kv_heads):
            raise KvevalError(f"checkpoint {self.path}: its KV scales are for {have[0]} layers x {have[1]} kv heads, "
                              f"the model has {layers} x {kv_heads}")

    def check_for(self, spec: QuantSpec, policy: str) -> None:
        """One line when the checkpoint's scales are for another KV format than ``spec``'s (an NVFP4 checkpoint
        under an FP8 policy: a scale of another meaning)."""
        if self.scheme is None or spec.is_none:
            return
        want = _ALGO_OF_FORMAT.get(spec.format)
        if want is None:
            raise KvevalError(f"policy '{policy}': checkpoint {self.path} holds {self.scheme.algo} KV scales; the "
                              f"policy's {spec.describe()} takes no checkpoint scales")
        if want != self.scheme.algo:
            raise KvevalError(f"policy '{policy}': checkpoint {self.path} holds {self.scheme.algo} KV scales "
                              f"({self.scheme.config_file}); the policy quantizes to {want} ({spec.describe()})")

    def query_scales(self) -> torch.Tensor | None:
        """float32 ``[layers, H]`` of the q scales the engine uses, or None when the checkpoint has none (vLLM:
        1.0 for compressed-tensors, k_scale for ModelOpt)."""
        return self.tensors.get("query.scale")

    def digest(self) -> str:
        """sha256 of the scales as loaded and of the scheme: a resumed run whose checkpoint scales changed is
        refused like a changed scales file."""
        h = hashlib.sha256(json.dumps(self.header.get("scheme"), sort_keys=True).encode())
        h.update(self.engine.encode())
        for name in sorted(self.tensors):
            h.update(name.encode())
            h.update(self.tensors[name].contiguous().numpy().tobytes())
        return h.hexdigest()

    def describe(self) -> str:
        """One line for env.json and the report: where the scales came from and how they were read."""
        if self.scheme is None:
            return f"{self.path}: no KV scheme in the checkpoint: scales 1.0, as {self.engine} uses them"
        s = torch.cat([self.tensors["key.scale"].flatten(), self.tensors["value.scale"].flatten()])
        return (f"{self.path}: {self.scheme.describe()}, read with {self.scheme.library}, loaded as {self.engine} "
                f"does (float32); k/v scales {float(s.min()):.4g} to {float(s.max()):.4g}")

    def source(self) -> dict:
        """env.json's record of these scales."""
        return {"kind": "checkpoint", "path": self.path, "engine": self.engine, "describe": self.describe(),
                "scheme": self.header.get("scheme"), "digest": self.digest()}


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
        raise _fail(where, f"holds KV scales for layer {stray[0]}, the model has {layers} layers (0-{layers - 1})")
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
                    raise _fail(where, f"declares {scheme.describe()} but layer {layer} has no {name} "
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


def split_target(target: str | Path) -> tuple[Path, str]:
    """``DIR`` or ``DIR#ENGINE`` (a policy's ``scales:``) -> (the folder, the engine whose loading applies; vllm by
    default)."""
    text = str(target)
    folder, sep, engine = text.rpartition("#")
    if not sep or not folder:
        return Path(text), "vllm"
    if engine not in ENGINES:
        raise KvevalError(f"scales '{text}': #{engine} names no engine; use DIR or DIR#ENGINE with ENGINE one of "
                          f"{', '.join(ENGINES)}")
    return Path(folder), engine


def is_checkpoint_target(target: str | Path) -> bool:
    """Whether a policy's ``scales:`` names a model folder (``DIR`` or ``DIR#ENGINE``) rather than a scales file."""
    text = str(target)
    if Path(text).is_dir():
        return True
    folder, sep, _ = text.rpartition("#")
    return bool(sep and folder) and Path(folder).is_dir()


def target_of(folder: str | Path, engine: str) -> str:
    """The ``scales:`` value that names ``folder``'s scales as ``engine`` loads them."""
    return str(folder) if engine == "vllm" else f"{folder}#{engine}"


def load_checkpoint_scales(target: str | Path, engine: str | None = None) -> CheckpointScales:
    """A model folder's KV scales as ``engine`` loads them (module docstring; ``target``: ``DIR`` or
    ``DIR#ENGINE``), checked; a folder that declares no KV scheme gives the engines' default, 1.0 for every layer
    (``scheme`` None)."""
    folder, named = split_target(target)
    engine = engine or named
    where = str(folder)
    if not folder.is_dir():
        raise KvevalError(f"checkpoint '{folder}' is not a model folder")
    if not (folder / "config.json").is_file():
        raise _fail(where, "has no config.json, so it is not a model folder with KV scales")
    layers, kv_heads, heads = model_shape(folder)
    scheme = read_scheme(folder)
    header: dict = {"format": 1, "method": "checkpoint", "layers": layers, "kv_heads": kv_heads,
                    "model": str(folder), "engine": engine, "corpus": None}
    if scheme is None:
        ones = torch.ones(layers, 1)
        tensors = {"key.scale": ones, "value.scale": ones.clone()}
        header["scheme"] = None
    else:
        raw = read_scale_tensors(folder)
        tensors = engine_scales(raw, scheme, layers, kv_heads, heads, engine, where)
        header["scheme"] = {"producer": scheme.producer, "algo": scheme.algo, "strategy": scheme.strategy,
                            "config_file": scheme.config_file, "declared": scheme.declared,
                            "library": scheme.library}
    return CheckpointScales(header=header, tensors=tensors, path=str(folder), scheme=scheme, engine=engine)


def has_kv_scheme(folder: str | Path) -> bool:
    """Whether a local folder declares a KV scheme (False for anything that is not a model folder)."""
    folder = Path(folder)
    return folder.is_dir() and (folder / "config.json").is_file() and read_scheme(folder) is not None


# ------------------------------------------------------------------------------------------------- the policy side
def default_engine(raw_policy) -> str | None:
    """The engine whose checkpoint loading a policy's config form follows by default: its preset's engine
    (:data:`PRESET_ENGINES`) when the config sets no ``scales:`` of its own (``"vllm_fp8"``, ``{preset:
    vllm_fp8, residual: 0}``); ``"vllm"`` for ``scales: checkpoint`` on any other policy; None otherwise."""
    if isinstance(raw_policy, str):
        return PRESET_ENGINES.get(raw_policy)
    if not isinstance(raw_policy, dict):
        return None
    preset = raw_policy.get("preset")
    if "scales" in raw_policy:
        if raw_policy["scales"] != CHECKPOINT_SCALES:
            return None
        return PRESET_ENGINES.get(preset, "vllm") if isinstance(preset, str) else "vllm"
    return PRESET_ENGINES.get(preset) if isinstance(preset, str) else None


def asks_checkpoint(raw_policy) -> bool:
    """Whether a policy's config form says ``scales: checkpoint`` itself (then a model without KV scales gets the
    engine's 1.0; a preset's default only uses scales that exist)."""
    return isinstance(raw_policy, dict) and raw_policy.get("scales") == CHECKPOINT_SCALES


# ------------------------------------------------------------------------------------------------- writing
def kv_cache_config(strategy: str = "tensor") -> dict:
    """config.json's ``quantization_config`` for FP8 E4M3 KV scales beside unquantized weights, built and
    serialized by compressed-tensors (``QuantizationConfig(...).model_dump()``; vLLM needs ``config_groups``
    present, even empty, to pass its head counts to the attn_head loader)."""
    if strategy not in STRATEGIES:
        raise KvevalError(f"KV scale strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    except ImportError:
        raise KvevalError("writing a compressed-tensors checkpoint needs compressed-tensors "
                          "(pip install 'compressed-tensors==0.20.1')") from None
    qc = QuantizationConfig(config_groups={}, format="dense", quantization_status="compressed",
                            kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                                             dynamic=False, strategy=strategy))
    body = qc.model_dump(exclude={"quant_method"})
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {}, **body}


def scale_tensor_names(layer: int, prefix: str = "model.layers") -> dict[str, str]:
    """kind -> the compressed-tensors tensor name of one layer's scale (``model.layers.N.self_attn.k_scale``)."""
    return {kind: f"{prefix}.{layer}.self_attn.{SCALE_NAMES[kind]}" for kind in ("key", "value")}


def fp8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The FP8 E4M3 scale of a range: ``absmax / 448`` in float32 (kveval's calibrated per-tensor/head scale,
    ``kveval.quant.qparams_from_range`` of the ``fp8_e4m3`` spec; 0 where absmax is 0 is kept as the smallest
    normal float32, since vLLM divides by it)."""
    s = absmax.float() / 448.0
    return torch.where(s > 0, s, torch.tensor(torch.finfo(torch.float32).tiny))


@dataclass
class ScalesOut:
    """What ``kveval calibrate --export compressed-tensors DIR`` wrote."""

    folder: str
    strategy: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def summary(self) -> str:
        vals = torch.cat([t.flatten() for t in self.tensors.values()]) if self.tensors else torch.zeros(1)
        return (f"{self.folder}: compressed-tensors kv_cache_scheme {self.strategy}, {len(self.tensors)} scale "
                f"tensors ({float(vals.min()):.4g} to {float(vals.max()):.4g})")


# ------------------------------------------------------------------------------------------------- policies
def _own_scales(policy) -> str:
    """What a policy uses when no checkpoint scales replace its own (for the record of where scales came from)."""
    if policy.scales == "auto":
        return "calibrated by kveval on the corpus tail (scales: auto)"
    if policy.scales:
        return f"the scales file {policy.scales}"
    statics = sorted({f"{s.static_scale:g}" for s in policy.all_specs() if s.static_scale is not None})
    return f"its spec's static scale {', '.join(statics)}" if statics else "dynamic scales"


def check_policy(cs: CheckpointScales, policy, name: str) -> None:
    """The checkpoint's scales fit ``policy`` (a :class:`kveval.policy.KVPolicy`): some spec takes static scales,
    each such spec is of the checkpoint's KV format, symmetric per tensor or head (per head for an attn_head
    checkpoint), keys stored after RoPE; a policy that rounds the query to FP8 (``query_fp8``) gets the q scale
    the engine would use. One KvevalError line naming the policy otherwise."""
    specs = [s for s in policy.all_specs() if not s.is_none]
    if not any(s.calibratable for s in specs):
        raise KvevalError(f"policy '{name}': scales: checkpoint, but none of its specs takes static scales "
                          f"({', '.join(s.describe() for s in specs) or 'nothing is quantized'})")
    if policy.pre_rope:
        raise KvevalError(f"policy '{name}': checkpoint {cs.path}'s KV scales are of post-RoPE keys; the policy "
                          "stores pre-RoPE keys (pre_rope: true)")
    for spec in (s for s in specs if s.calibratable):
        cs.check_for(spec, name)
        try:
            cs.qparams(0, "key", spec)
        except KvevalError as exc:
            raise KvevalError(f"policy '{name}': {exc}") from None
    for t in policy.transforms:
        if getattr(t, "name", None) != "query_fp8":
            continue
        q = cs.query_scales()
        if q is None:
            q = cs.tensors["key.scale"] if cs.scheme is not None and cs.scheme.producer == "modelopt" else None
        fixed = float(getattr(t, "scale", 1.0))
        if q is not None and not bool((q == fixed).all()):
            where = "q_scale" if cs.query_scales() is not None else "k_scale (vLLM's q_scale without one)"
            raise KvevalError(f"policy '{name}': the engine would round the query with the checkpoint's per-layer "
                              f"{where} ({float(q.min()):.4g} to {float(q.max()):.4g}); the policy's query_fp8 uses "
                              f"one scale, {fixed:g}")


def checkpoint_targets(model_name: str, raw_policies: dict, policies: dict) -> dict[str, tuple[str | None, dict]]:
    """For every policy whose engine loads checkpoint scales (:func:`default_engine` of its config form
    ``raw_policies[name]``): ``(scales target or None, source record)``. The target (``DIR`` or ``DIR#ENGINE``,
    a ``scales:`` value) replaces the policy's own scales when the model is a local folder that declares a KV
    scheme, or whenever the policy says ``scales: checkpoint`` (then a folder without a scheme gives the engine's
    1.0); None keeps the preset's own scales. The checkpoint's scales are read and checked here (one KvevalError
    line: a bad scale, a scheme of another format than the policy's, ``scales: checkpoint`` on a model that is not
    a local folder)."""
    folder = Path(str(model_name)).expanduser()
    is_folder = folder.is_dir() and (folder / "config.json").is_file()
    scheme = read_scheme(folder) if is_folder else None
    out: dict[str, tuple[str | None, dict]] = {}
    for name, raw in raw_policies.items():
        engine = default_engine(raw)
        if engine is None:
            continue
        policy = policies[name]
        explicit = asks_checkpoint(raw)
        if not is_folder:
            if explicit:
                raise KvevalError(f"policy '{name}': scales: checkpoint reads the KV scales of a local model folder; "
                                  f"model '{model_name}' is not one (it ships no KV scales: give the policy "
                                  "static_scale: 1.0, as the engine would use, or scales: auto)")
            out[name] = (None, {"kind": "preset", "describe": f"model {model_name} is not a local folder, so no "
                                f"checkpoint scales: {_own_scales(policy)}"})
            continue
        if scheme is None and not explicit:
            out[name] = (None, {"kind": "preset", "describe": f"{folder} declares no KV cache scheme: "
                                f"{_own_scales(policy)}"})
            continue
        target = target_of(folder, engine)
        cs = load_checkpoint_scales(target)
        check_policy(cs, policy, name)
        out[name] = (target, cs.source())
    return out
