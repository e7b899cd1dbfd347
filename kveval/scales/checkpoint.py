"""KV-cache scales that a checkpoint ships, read as the serving engines load them, and written back in the same form.

A model folder carries KV scales when its ``config.json`` ``quantization_config`` declares a KV cache scheme
(compressed-tensors' ``kv_cache_scheme``, ModelOpt's ``kv_cache_quant_algo``) and its safetensors hold one
``k_scale`` / ``v_scale`` (and, where attention is quantized too, ``q_scale``) per attention layer. Each step has
its module, and every name below is importable from this one as well:

- :mod:`kveval.scales.kv_scheme`: the declared scheme, per producer (:func:`read_scheme` -> :class:`KVScheme`),
  and the model's shape (:func:`model_shape`);
- :mod:`kveval.scales.checkpoint_tensors`: the scale tensors as stored in the safetensors shards
  (:func:`read_scale_tensors`);
- :mod:`kveval.scales.engine_loading`: how vLLM, SGLang and TensorRT-LLM load them (:func:`engine_scales`: float32
  ``[layers, H]``), refusing in one line what an engine would silently turn into 1.0 or crash on;
- :mod:`kveval.scales.compressed_tensors_export`: the compressed-tensors ``quantization_config`` and scale tensors
  written back (:func:`kv_cache_config`, :func:`fp8_scale`).

:class:`CheckpointScales` is a :class:`kveval.scales.file.ScalesFile` whose ``qparams`` give those scales to a
symmetric tensor/head spec (the patch code reads it as it reads a scales file); ``scales: DIR`` in a policy names
such a folder, and ``scales: checkpoint`` the run's own model folder (``kveval.calibration.checks``).

Here: :func:`load_checkpoint_scales` (a ``DIR`` or ``DIR#ENGINE`` target -> :class:`CheckpointScales`), and the
policy side: which policies take a checkpoint's scales by default (:data:`PRESET_ENGINES`,
:func:`default_engine`), whether they fit (:func:`check_policy`), and the scales target of each policy of a run
(:func:`checkpoint_targets`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.quant import QParams, QuantSpec
from kveval.quant.formats.base import SCALE_TORCH_DTYPES, store
from kveval.scales.checkpoint_tensors import SCALE_NAMES, read_scale_tensors
from kveval.scales.compressed_tensors_export import ScalesOut, fp8_scale, kv_cache_config, scale_tensor_names
from kveval.scales.engine_loading import ENGINES, check_scale, engine_scales
from kveval.scales.kv_scheme import (
    PRODUCERS,
    STRATEGIES,
    KVScheme,
    checkpoint_error,
    model_shape,
    read_scheme,
    text_config,
)

#: ``scales: checkpoint`` in a policy: the scales of the run's own model folder
CHECKPOINT_SCALES = "checkpoint"
#: policy presets whose engine loads the checkpoint's KV scales, and the engine's loading rule. A policy made from
#: one of them without its own ``scales:`` takes the run's model folder's scales by default (when it has some).
PRESET_ENGINES: dict[str, str] = {
    "vllm_fp8": "vllm", "vllm_fp8_per_head": "vllm", "vllm_fp8_fa3": "vllm", "vllm_nvfp4": "vllm",
    "vllm_nvfp4_4over6": "vllm", "trtllm_int8": "trtllm", "trtllm_nvfp4": "trtllm", "sglang_nvfp4": "sglang",
}
#: the KV algorithm a checkpoint's scales are for, by format of the spec that uses them
_ALGO_OF_FORMAT = {"fp8_e4m3": "FP8", "nvfp4": "NVFP4", "nvfp4_4over6": "NVFP4", "int": "INT8"}


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
    """A model folder's KV scales as ``engine`` loads them (:mod:`kveval.scales.engine_loading`; ``target``:
    ``DIR`` or ``DIR#ENGINE``), checked; a folder that declares no KV scheme gives the engines' default, 1.0 for
    every layer (``scheme`` None)."""
    folder, named = split_target(target)
    engine = engine or named
    where = str(folder)
    if not folder.is_dir():
        raise KvevalError(f"checkpoint '{folder}' is not a model folder")
    if not (folder / "config.json").is_file():
        raise checkpoint_error(where, "has no config.json, so it is not a model folder with KV scales")
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


__all__ = ["CHECKPOINT_SCALES", "ENGINES", "PRESET_ENGINES", "PRODUCERS", "SCALE_NAMES", "STRATEGIES",
           "CheckpointScales", "KVScheme", "ScalesOut", "asks_checkpoint", "check_policy", "check_scale",
           "checkpoint_targets", "default_engine", "engine_scales", "fp8_scale", "is_checkpoint_target",
           "kv_cache_config", "load_checkpoint_scales", "model_shape",
           "read_scale_tensors", "read_scheme", "scale_tensor_names", "split_target", "target_of", "text_config"]
