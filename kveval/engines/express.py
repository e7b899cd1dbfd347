"""A policy in an engine's own syntax, or, where the engine cannot express it, why (:class:`NotExpressible`) and the
nearest policies it can run with their cost (:func:`deploy`). Per engine (:mod:`kveval.engines.tables`):

- **vLLM**: ``vllm serve MODEL --kv-cache-dtype T [--kv-cache-dtype-skip-layers i j ...]``; FP8 with calibrated
  scales needs a checkpoint carrying them (``kveval calibrate CONFIG --export compressed-tensors DIR``), per-head
  ones FlashAttention 3 (``--attention-backend FLASH_ATTN``).
- **llama.cpp**: ``[LLAMA_ATTN_ROT_DISABLE=1] llama-server -m MODEL.gguf -ctk K -ctv V -fa on``.
- **SGLang**: ``python -m sglang.launch_server --model-path MODEL --kv-cache-dtype T [--attention-backend B]``.
- **TensorRT-LLM**: ``LLM(model=..., kv_cache_config=KvCacheConfig(dtype=...))`` (PyTorch backend).
- **transformers**: ``model.generate(..., cache_implementation="quantized", cache_config={...})``
  (``QuantizedCache``).

A policy is expressible when every layer's K and V map to one of the engine's types under its rules (one type
for all layers; K and V alike except llama.cpp; vLLM's layers may also stay in the model dtype) and it needs no
feature the engine lacks (residual windows and sinks: only transformers' ``residual_length``; transforms: only
the engine's own, such as llama.cpp's rotation). Otherwise the engine's uniform policies nearest in memory are
listed, each with its measured or predicted cost (or "not measured"; :mod:`kveval.engines.costs`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from kveval.engines.costs import Costs, Option, nearest_options
from kveval.engines.names import check_engine_names
from kveval.engines.tables import ENGINES, Engine, EngineType
from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy


class NotExpressible(Exception):
    """A policy an engine cannot run; the message says why."""


@dataclass
class Deployment:
    """One policy on one engine: the ``lines`` to run it, or ``reason`` it cannot and the ``nearest`` options."""

    engine: str
    policy: str
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reason: str = ""
    nearest: list[Option] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.reason


def _layer_specs(policy: KVPolicy, arch: Arch) -> list[tuple]:
    return [policy.specs_for_layer(i, arch.layers, arch.sliding_layers) for i in range(arch.layers)]


def _check_features(engine: Engine, policy: KVPolicy) -> None:
    if policy.pre_rope:
        raise NotExpressible("pre-RoPE keys (pre_rope) are no engine's cache")
    if policy.sink_tokens:
        raise NotExpressible(f"{engine.title} keeps no attention-sink tokens in full precision")
    if policy.residual and engine.key != "transformers":
        raise NotExpressible(f"{engine.title} has no full-precision residual window")
    foreign = [t.name for t in policy.transforms if t.name not in engine.transforms]
    if foreign:
        raise NotExpressible(f"{engine.title} does not apply the transform(s) {', '.join(foreign)}")


def _one_type(engine: Engine, specs: list, what: str) -> EngineType:
    types = {engine.type_of(s) for s in specs}
    if None in types:
        bad = next(s for s in specs if engine.type_of(s) is None)
        raise NotExpressible(f"{bad.describe()} is none of {engine.title}'s cache types "
                             f"({', '.join(t.name for t in engine.types)})")
    if len(types) > 1:
        names = sorted(t.name for t in types if t is not None)
        raise NotExpressible(f"{what} mixes {', '.join(names)}; {engine.title} runs one type in every layer")
    (t,) = types
    assert t is not None
    return t


def _scales_notes(policy: KVPolicy, specs: list, config_hint: str) -> list[str]:
    static = [s for s in specs if policy.uses_static(s)]
    if static:
        strategy = ["--strategy", "attn_head"] if any(s.granularity == "head" for s in static) else []
        folder = f"{Path(config_hint).stem}-kv-checkpoint"
        line = shlex.join(["kveval", "calibrate", config_hint, "--export", "compressed-tensors", folder, *strategy])
        return [f"static scales: serve a checkpoint that carries them ({line}, then serve {folder} as the model)"]
    if any(s.static_scale is not None for s in specs):
        return ["scales 1.0: the engine's default for a checkpoint without k_scale / v_scale"]
    return []


#: the builtin models an engine can load: (hub id for the HF-based engines, GGUF file name for llama.cpp)
_BUILTIN_ENGINE_MODELS = {"builtin:smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def engine_model(model: str, engine_key: str) -> tuple[str, list[str]]:
    """(the model as ``engine_key`` takes it, notes). llama.cpp takes a GGUF file: a ``.gguf`` path as it is, the
    builtin SmolLM2 as its GGUF file, anything else as ``model.gguf`` with the note that converts it. The other
    engines take a hub id or folder; the builtin SmolLM2 is its hub id; a random-weight builtin has no engine."""
    notes = []
    if model.startswith("builtin:") and model not in _BUILTIN_ENGINE_MODELS:
        notes.append(f"{model} is a random-weight test model that no engine serves: pass your model with --model")
    if engine_key == "llamacpp":
        if model.lower().endswith(".gguf"):
            return model, notes
        if model == "builtin:smollm2-135m":
            from kveval.models.builtin import smollm2_gguf

            try:
                return str(smollm2_gguf()), notes
            except KvevalError:
                pass
        return "model.gguf", notes + [f"model.gguf: {model} converted with llama.cpp's convert_hf_to_gguf.py "
                                      "(python convert_hf_to_gguf.py MODEL_DIR --outfile model.gguf)"]
    return _BUILTIN_ENGINE_MODELS.get(model, model), notes


def express(engine: Engine, policy: KVPolicy, arch: Arch, model: str, config_hint: str = "CONFIG") -> Deployment:
    """The lines that run ``policy`` on ``engine`` (module docstring); NotExpressible when it cannot. Shell lines
    are quoted for a POSIX shell (``shlex.join``), Python lines with ``repr``."""
    _check_features(engine, policy)
    layers = _layer_specs(policy, arch)
    dep = Deployment(engine.key, policy.name)
    model, dep.notes = engine_model(model, engine.key)
    quantized = [(i, k, v) for i, (k, v) in enumerate(layers) if not (k.is_none and v.is_none)]
    if engine.key == "vllm":
        half = [i for i, k, v in quantized if k.is_none or v.is_none]
        if half:
            raise NotExpressible(f"layer {half[0]} quantizes only one of K and V; vLLM's skip-layers keep both")
        if not quantized:
            dep.lines = [shlex.join(["vllm", "serve", model, "--kv-cache-dtype", "auto"])]
            return dep
        t = _one_type(engine, [s for _, k, v in quantized for s in (k, v)], "the policy")
        if len({(k, v) for _, k, v in quantized}) > 1 or any(k != v for _, k, v in quantized):
            raise NotExpressible("K and V (or layers) use different specs of one vLLM type")
        skip = [str(i) for i, (k, v) in enumerate(layers) if k.is_none and v.is_none]
        if policy.skip_sliding and arch.sliding_layers:
            skip = [s for s in skip if int(s) not in arch.sliding_layers] + ["sliding_window"]
        cmd = ["vllm", "serve", model, "--kv-cache-dtype", t.name]
        if skip:
            cmd += ["--kv-cache-dtype-skip-layers", *skip]
        names = {tr.name for tr in policy.transforms}
        per_head = any(s.granularity == "head" for _, k, _v in quantized for s in (k,))
        if names or per_head:
            cmd += ["--attention-backend", "FLASH_ATTN"]
            dep.notes.append("FlashAttention 3 (Hopper): " + ("FP8 query and P·V (vllm_fp8_fa3)" if names else
                                                             "per-head scales need it"))
        dep.lines = [shlex.join(cmd)]
        dep.notes += _scales_notes(policy, [k for _, k, _ in quantized], config_hint)
        if t.note:
            dep.notes.append(t.note)
        return dep
    if engine.key == "llamacpp":
        kt = _one_type(engine, [k for k, _ in layers], "the keys")
        vt = _one_type(engine, [v for _, v in layers], "the values")
        names = {tr.name for tr in policy.transforms}
        quant = kt.name != "f16" or vt.name != "f16"
        env = ["LLAMA_ATTN_ROT_DISABLE=1"] if quant and "hadamard" not in names else []
        fa = ["-fa", "on"] if vt.name != "f16" else []
        dep.lines = [shlex.join([*env, "llama-server", "-m", model, "-ctk", kt.name, "-ctv", vt.name, *fa])]
        if quant and not {"gguf_order", "query_quant"} <= names:
            dep.notes.append("the policy's specs are the ggml formats alone; llama.cpp's cache also reads a GGUF's "
                             "channel order and converts the query (kveval's llamacpp_* presets)")
        return dep
    specs = [s for _, k, v in quantized for s in (k, v)]
    if len(quantized) != arch.layers:
        raise NotExpressible(f"{engine.title} quantizes every layer or none; the policy keeps layers "
                             f"{[i for i, (k, v) in enumerate(layers) if k.is_none and v.is_none]} in full precision")
    t = _one_type(engine, specs, "the policy")
    if any(k != v for _, k, v in quantized):
        raise NotExpressible(f"K and V take different specs; {engine.title} runs one type for both")
    if engine.key == "sglang":
        backend = {"nvfp4": ["--attention-backend", "trtllm_mha"], "mxfp8": ["--attention-backend", "fa4"]}
        dep.lines = [shlex.join(["python", "-m", "sglang.launch_server", "--model-path", model, "--kv-cache-dtype",
                                 t.name, *backend.get(t.name, [])])]
    elif engine.key == "trtllm":
        if t.name == "int8":
            raise NotExpressible("INT8 KV cache runs on TensorRT-LLM's TensorRT backend only (a ModelOpt checkpoint "
                                 "with kv_cache_quant_algo INT8, built with trtllm-build); the PyTorch backend "
                                 "takes fp8 and nvfp4")
        dep.lines = ["from tensorrt_llm import LLM",
                     "from tensorrt_llm.llmapi import KvCacheConfig",
                     f"llm = LLM(model={model!r}, kv_cache_config=KvCacheConfig(dtype={t.name!r}))"]
    else:
        dep.lines = transformers_code(t, specs[0], policy, arch)
    dep.notes += _scales_notes(policy, specs, config_hint) if engine.key != "transformers" else []
    if t.note:
        dep.notes.append(t.note)
    return dep


def transformers_code(t: EngineType, spec, policy: KVPolicy, arch: Arch) -> list[str]:
    """``generate`` through transformers' QuantizedCache for type ``t`` (``model``, ``inputs`` given); NotExpressible
    for a model with sliding-window layers (QuantizedCache builds full-attention layers only) and for a group size
    that does not divide head_dim (its quantizer groups along head_dim)."""
    if arch.sliding_layers:
        raise NotExpressible(f"transformers' QuantizedCache has no sliding-window layers; the model has "
                             f"{len(arch.sliding_layers)}")
    backend, _, nbits = t.name.partition(":")
    if backend != "fp8" and spec.group_size and arch.head_dim % spec.group_size:
        raise NotExpressible(f"transformers' QuantizedCache groups along head_dim; the group size {spec.group_size} "
                             f"does not divide head_dim {arch.head_dim}")
    if backend == "fp8":
        if policy.residual:
            raise NotExpressible("transformers' fp8 cache keeps no residual window")
        config: dict[str, object] = {"backend": "fp8"}
    else:
        if policy.residual and policy.residual_mode != "prompt_block":
            raise NotExpressible(f"transformers' QuantizedCache flushes its residual in blocks after the prompt "
                                 f"(prompt_block); the policy's residual is {policy.residual_mode}")
        config = {"backend": backend, "nbits": int(nbits), "q_group_size": spec.group_size,
                  "residual_length": policy.residual}
        if backend == "hqq":
            config.update(axis_key=1, axis_value=1)
    return ["out = model.generate(**inputs, cache_implementation=\"quantized\", "
            f"cache_config={config!r}, max_new_tokens=32)"]


def deploy(policies: dict[str, KVPolicy], arch: Arch, context: int, model: str, costs: Costs,
           engines: list[str] | None = None, config_hint: str = "CONFIG") -> list[Deployment]:
    """One :class:`Deployment` per (engine, policy): its lines, or the reason and the nearest options."""
    out = []
    check_engine_names(engines)
    for key in engines or list(ENGINES):
        engine = ENGINES[key]
        for name, policy in policies.items():
            try:
                dep = express(engine, policy, arch, model, config_hint)
            except NotExpressible as exc:
                dep = Deployment(key, name, reason=str(exc))
                dep.nearest = nearest_options(engine, arch, context, kv_bytes(arch, policy, context).bits_per_element,
                                              costs)
            dep.policy = name
            out.append(dep)
    return out
