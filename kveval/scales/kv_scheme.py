"""The KV cache scheme a checkpoint declares (:func:`read_scheme` -> :class:`KVScheme`), read from its
``config.json`` (and ModelOpt's ``hf_quant_config.json``); the model's shape from the same ``config.json``
(:func:`model_shape`).

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

A declared scheme vLLM would refuse is one :class:`KvevalError` line naming the field; a folder without a KV
scheme has none (None: the engines use 1.0). The scale tensors are read by :mod:`kveval.scales.checkpoint_tensors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from kveval.errors import KvevalError
from kveval.fileio import read_regular_bytes

PRODUCERS = ("compressed-tensors", "modelopt")
STRATEGIES = ("tensor", "attn_head")


def checkpoint_error(where: str, what: str) -> KvevalError:
    """The one-line error about checkpoint ``where``: ``checkpoint DIR: what``."""
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


def read_json(path: Path, where: str) -> dict:
    """A JSON object file of checkpoint ``where``; one KvevalError line when it cannot be read or is no object."""
    try:
        data = json.loads(read_regular_bytes(path).decode("utf-8"))  # a FIFO is refused (OSError), never opened
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise checkpoint_error(where, f"{path.name} cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise checkpoint_error(where, f"{path.name} is not a JSON object")
    return data


def text_config(config: dict) -> dict:
    """The language model's part of a ``config.json`` (``text_config`` of a multimodal model, else itself)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def model_shape(folder: str | Path) -> tuple[int, int, int]:
    """(layers, kv heads, attention heads) from a model folder's ``config.json``."""
    where = str(folder)
    cfg = text_config(read_json(Path(folder) / "config.json", where))
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    layers = cfg.get("num_hidden_layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, kv, heads)):
        raise checkpoint_error(where, "config.json has no positive num_hidden_layers / num_attention_heads / "
                                      "num_key_value_heads")
    return cast(tuple[int, int, int], (layers, kv, heads))


def read_scheme(folder: str | Path) -> KVScheme | None:
    """The KV scheme a model folder declares, or None (no quantization_config, or one without a KV scheme). A
    declared scheme that vLLM would refuse (not 8-bit float symmetric static per tensor or head, for
    compressed-tensors) is a KvevalError naming the field."""
    folder = Path(folder)
    where = str(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None
    qc = read_json(cfg_path, where).get("quantization_config")
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
        raise checkpoint_error(where, "declares a compressed-tensors kv_cache_scheme; install compressed-tensors "
                                      "to read it (pip install 'compressed-tensors==0.20.1')") from None
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(qc)
    except (ValidationError, ValueError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()
        raise checkpoint_error(where, f"config.json quantization_config is not a compressed-tensors config "
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
        raise checkpoint_error(where, f"kv_cache_scheme {'; '.join(problems)}: vLLM refuses it")
    declared = qc["kv_cache_scheme"]
    return KVScheme("compressed-tensors", "FP8", strategy, "config.json", declared if isinstance(declared, dict)
                    else {}, f"compressed-tensors {compressed_tensors.__version__}")


_MODELOPT_ALGOS = ("FP8", "NVFP4", "INT8")


def _modelopt_scheme(qc: dict, hf_quant: Path, where: str) -> KVScheme | None:
    """ModelOpt's KV algorithm from hf_quant_config.json or config.json (per-tensor scales only)."""
    algo, source = None, "config.json"
    if hf_quant.is_file():
        q = read_json(hf_quant, where).get("quantization")
        algo, source = (q.get("kv_cache_quant_algo") if isinstance(q, dict) else None), hf_quant.name
    if algo is None:
        declared = qc.get("kv_cache_quant_algo", qc.get("kv_cache_scheme"))
        if isinstance(declared, dict):
            fp8 = declared.get("num_bits") == 8 and declared.get("type") == "float"
            algo = "FP8" if fp8 else None
            if not fp8:
                raise checkpoint_error(where, f"ModelOpt kv_cache_scheme {declared} is not FP8 (vLLM reads it as "
                                              "no KV scheme)")
        else:
            algo = declared
    if algo is None:
        return None
    if algo not in _MODELOPT_ALGOS:
        raise checkpoint_error(where, f"ModelOpt kv_cache_quant_algo {algo!r} is none of "
                                      f"{', '.join(_MODELOPT_ALGOS)}")
    return KVScheme("modelopt", str(algo), "tensor", source, str(algo), "modelopt (JSON keys read directly)")
