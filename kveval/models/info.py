"""What a model is, read from its config without running it: :func:`model_info` of a loaded model, the context
it was built for, and :func:`model_config` of a name (the config alone, never the weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError
from kveval.fileio import read_regular_bytes
from kveval.memory.arch import Arch
from kveval.memory.fit import model_designs
from kveval.models.builtin import BUILTIN_CONTEXT, tiny_model_config
from kveval.models.checks import check_config_sizes, first_line, text_config
from kveval.models.hub import hub_guard
from kveval.models.placement import placement_summary
from kveval.models.source import model_source

CONTEXT_LIMIT_FALLBACK = 2048  # used by model_context_limit when the config names no limit


def config_context_limit(config) -> int | None:
    """The longest context a transformers config names: ``max_position_embeddings`` (else ``n_positions``,
    ``max_sequence_length``, ``seq_length``) of its text config; None when it names none."""
    cfg = text_config(config)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_context_limit(model) -> int:
    """The longest context the model was built for (:func:`config_context_limit`), falling back to
    ``CONTEXT_LIMIT_FALLBACK`` (2048)."""
    return config_context_limit(model.config) or CONTEXT_LIMIT_FALLBACK


def model_arch(model) -> Arch:
    """What the loaded model's cache holds, layer by layer (:class:`kveval.memory.Arch` of its config, with its
    exact parameter count): KvevalError (one line) for layers kveval does not model."""
    return Arch.from_model(model)


def model_info(model) -> dict:
    """Facts about a loaded model that the memory and report code use.

    Keys: name, model_type, num_layers, num_attention_heads, num_kv_heads, head_dim (``config.head_dim`` or
    hidden_size // num_attention_heads), hidden_size, vocab_size, context_limit, sliding_window,
    sliding_layers (indices of sliding-window layers, [] if none), kv_layers (the layers that hold K/V: every
    layer but linear-attention, Mamba and MLP-only ones), state_layers, chunked_layers, mla (the latent's
    dimensions, None without MLA), designs (``kveval.memory.fit.model_designs``), dtype, device (``cpu``,
    ``cuda:0``; for a dispatched model the modules per device, ``dispatched: cpu 3, disk 2``), num_parameters.
    """
    cfg = text_config(model.config)
    arch = model_arch(model)
    param = next(model.parameters())
    return {
        "name": getattr(model, "kveval_name", None) or getattr(model, "name_or_path", None) or "",
        "model_type": cfg.model_type,
        "num_layers": arch.layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_kv_heads": arch.kv_heads,
        "head_dim": arch.head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "context_limit": model_context_limit(model),
        "sliding_window": arch.sliding_window,
        "sliding_layers": list(arch.sliding_layers),
        "kv_layers": list(arch.kv_layers),
        "state_layers": list(arch.state_layers),
        "chunked_layers": list(arch.chunked_layers),
        "mla": None if arch.mla is None else arch.mla.to_dict(),
        "designs": list(model_designs(arch)),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": placement_summary(model) or str(param.device),
        "num_parameters": arch.params,
    }


def context_limit_of(name: str) -> int | None:
    """The model's context (as :func:`model_context_limit` would give it) when it is known without loading the
    model: builtins, and local folders whose config.json names ``max_position_embeddings`` (or its text config);
    None otherwise (hub ids, GGUF files)."""
    name = str(name)
    if name.startswith("builtin:"):
        return BUILTIN_CONTEXT.get(name.split(":", 1)[1])
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads(read_regular_bytes(path / "config.json").decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    for section in (cfg.get("text_config"), cfg) if isinstance(cfg, dict) else ():
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_config(name: str) -> Any:
    """The transformers config of the model ``name`` names (:func:`kveval.models.source.model_source`), read
    without its weights: a builtin's (the tiny models' from code, SmolLM2's from its GGUF header), a GGUF file's
    header, a folder's config.json, a hub id's config (offline when the hub cannot be reached). KvevalError (one
    line) when it cannot be read."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    source = model_source(name)
    if source.kind == "builtin" and source.key != "smollm2-135m":
        return tiny_model_config(name)
    try:
        if source.kind == "builtin":
            from kveval.models.builtin import smollm2_gguf

            path = smollm2_gguf()
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if source.kind == "gguf" and source.path is not None:
            return AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        if source.kind == "folder" and source.path is not None:
            raw = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
            if isinstance(raw, dict):
                check_config_sizes(source.path, raw)  # a head count of 0 would divide by zero in transformers
            return AutoConfig.from_pretrained(str(source.path))
        with hub_guard() as offline:
            try:
                return AutoConfig.from_pretrained(name)
            except (OSError, ValueError) as exc:
                if offline:
                    raise KvevalError(f"the config of {name!r} is not in the local HuggingFace cache and the hub "
                                      "cannot be reached; use --shape or --layers --kv-heads --head-dim") from None
                raise KvevalError(f"the config of {name!r} could not be read: {first_line(exc)}") from None
    except (OSError, ValueError, KeyError, AttributeError, TypeError, ArithmeticError, RecursionError,
            StrictDataclassError) as exc:  # a config class refusing values
        raise KvevalError(f"the config of {name!r} could not be read: {first_line(exc)}") from None  # refusing values
