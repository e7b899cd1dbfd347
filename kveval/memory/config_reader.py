"""Reading a model's config into the fields of an :class:`kveval.memory.arch.Arch` (:func:`arch_fields`): layer
counts and head sizes, each layer's kind (:func:`layer_kinds_of`), MLA's dimensions, the state layers' state, RoPE
facts, an estimated parameter count; and the named shapes' configs (:func:`named_config`).

Pure data (no transformers import). A config is a transformers config object (its ``layer_types`` may be a
property, as in Falcon-H1 or Jamba) or a dict (``to_dict()``, the JSON of config.json, a named shape); a multimodal
config is read through its text config. The kinds, MLA layouts and state shapes are those of
:mod:`kveval.memory.arch`'s module docstring.
"""

from __future__ import annotations

from typing import Any

from kveval.errors import KvevalError, did_you_mean
from kveval.memory.layer_kinds import STATE_KINDS, Mla, StateShape
from kveval.memory.shapes import NAMED_SHAPES

#: a config's layer type -> kveval's kind (transformers' names, and the older names of hybrid configs)
_TYPE_KINDS = {
    "full_attention": "full", "attention": "full", "global": "full",
    "sliding_attention": "sliding", "local": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "state", "conv": "state", "mamba": "state", "mamba2": "state",
    "hybrid": "hybrid", "hybrid_sliding": "hybrid_sliding",
    "mlp": "none", "moe": "none", "dummy": "none",
}


class _ConfigView:
    """A config read the same way whether it is a transformers config (attributes, properties included) or a
    dict; the text config of a multimodal config."""

    def __init__(self, config: Any):
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        self.obj = None if isinstance(config, dict) else config
        self.data = config if isinstance(config, dict) else (config.to_dict() if hasattr(config, "to_dict")
                                                             else vars(config))

    def per_layer(self, key: str) -> list | None:
        """Each layer's value of ``key`` when the config gives it per layer (transformers' heterogeneous configs,
        e.g. Gemma-4's head_dim, read through ``per_layer_config``; a dict's ``per_layer_config`` overrides; a raw
        Gemma-4 config.json's ``global_head_dim`` on its full-attention layers), else None."""
        if self.obj is not None:
            if not getattr(self.obj, "is_heterogeneous", False):
                return None
            try:
                return [getattr(layer, key, None) for layer in self.obj.per_layer_config]
            except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError):
                return None
        overrides = self.data.get("per_layer_config")
        layers = self.data.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= 100_000:
            return None
        if isinstance(overrides, dict) and any(isinstance(o, dict) and key in o for o in overrides.values()):
            values = [self.data.get(key)] * layers
            for idx, o in overrides.items():
                if isinstance(o, dict) and key in o and str(idx).isdigit() and int(idx) < layers:
                    values[int(idx)] = o[key]
            return values
        types = self.data.get("layer_types")
        if key == "head_dim" and self.data.get("global_head_dim") is not None and isinstance(types, list):
            return [self.data.get("global_head_dim") if t == "full_attention" else self.data.get(key)
                    for t in types[:layers]]
        return None

    def get(self, key: str, default: Any = None) -> Any:
        values = self.per_layer(key)
        if values is not None:
            distinct = sorted({repr(v) for v in values})
            if len(distinct) > 1:
                where = "; ".join(f"{v} on {_ranges([i for i, x in enumerate(values) if repr(x) == v])}"
                                  for v in distinct)
                raise KvevalError(f"the model config's {key} differs from layer to layer ({where}); kveval bills one "
                                  f"{key} per model and cannot say what this model caches")
            if values and values[0] is not None:
                return values[0]
        if self.obj is not None:
            try:
                value = getattr(self.obj, key)
            except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError):
                value = None  # RuntimeError: transformers' ambiguous per-layer attribute (per_layer above)
            if value is not None:
                return value
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value


def named_config(name: str) -> tuple[str, dict, int | None]:
    """``(key, config, params)`` of a named shape (:data:`kveval.memory.shapes.NAMED_SHAPES`; ``builtin:`` and
    case ignored); KvevalError (one line, with the closest name) for an unknown one."""
    key = str(name).removeprefix("builtin:").lower()
    if key not in NAMED_SHAPES:
        raise KvevalError(f"unknown shape '{name}'{did_you_mean(key, NAMED_SHAPES)} (known shapes: "
                          f"{', '.join(NAMED_SHAPES)})")
    entry = NAMED_SHAPES[key]
    return key, entry["config"], entry.get("params")


def arch_fields(config: Any, name: str | None = None, params: int | None = None) -> dict[str, Any]:
    """The :class:`kveval.memory.arch.Arch` fields of a transformers config (or its ``to_dict()``; what
    ``Arch.from_model_config`` builds): ``num_hidden_layers``, ``num_key_value_heads`` (else
    ``num_attention_heads``), ``head_dim`` (else ``hidden_size // num_attention_heads``), the layer kinds
    (:func:`layer_kinds_of`), MLA's dimensions (``kv_lora_rank`` ...), the state layers' state, RoPE facts.
    KvevalError (one line) for a config kveval does not model (state layers of an unknown family, sliding and
    chunked layers together with different windows).

    ``params`` defaults to an estimate for Llama-like decoders (attention + gated MLP + norms + embeddings),
    None when the config lacks ``intermediate_size`` or ``vocab_size`` or is not Llama-like (MoE, MLA, state
    layers).
    """
    cfg = _ConfigView(config)
    try:
        layers = cfg.need("num_hidden_layers")
        heads = cfg.need("num_attention_heads")
    except KeyError as exc:
        raise KvevalError(f"model config has no {exc.args[0]!r}; give --layers --kv-heads --head-dim") from None
    _check_positive(layers, "num_hidden_layers")
    _check_positive(heads, "num_attention_heads")
    kinds = layer_kinds_of(cfg, layers)  # first: layers that share K/V are named as such, before their head sizes
    kv_heads = cfg.get("num_key_value_heads") or heads
    _check_positive(kv_heads, "num_key_value_heads")
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if _positive(hidden) else None)
    if head_dim is None:
        raise KvevalError("model config has neither 'head_dim' nor 'hidden_size'; give --head-dim")
    _check_positive(head_dim, "head_dim")
    mla = _mla_of(cfg, heads)
    state = _state_of(cfg) if any(k in STATE_KINDS for k in kinds) else None
    sliding_window = cfg.get("sliding_window") if any(k in ("sliding", "hybrid_sliding") for k in kinds) else None
    chunk = cfg.get("attention_chunk_size") if "chunked" in kinds else None
    if params is None and mla is None and state is None and not cfg.get("num_local_experts") \
            and not cfg.get("n_routed_experts") and not cfg.get("num_experts"):
        params = _estimate_params(cfg, layers, heads, kv_heads, head_dim)
    nm = name or cfg.get("_name_or_path") or cfg.get("model_type") or "custom"
    plain = all(k in ("full", "sliding") for k in kinds)
    return dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, name=str(nm), params=params,
                sliding_window=sliding_window,
                sliding_layers=tuple(i for i, k in enumerate(kinds) if k in ("sliding", "hybrid_sliding")),
                chunk_size=chunk, chunked_layers=tuple(i for i, k in enumerate(kinds) if k == "chunked"),
                layer_kinds=() if plain else kinds, mla=mla, state=state, model_type=cfg.get("model_type"),
                partial_rotary=_partial_rotary(cfg), nope_layers=_nope_layers(cfg, layers))


def layer_kinds_of(cfg: _ConfigView | dict | Any, layers: int) -> tuple[str, ...]:
    """Each layer's kind (:mod:`kveval.memory.arch`) from the config's ``layer_types`` (else
    ``layers_block_type``), else ``sliding`` for every layer of a config with ``sliding_window`` (and
    ``use_sliding_window`` not false: Mistral-style), ``chunked`` with ``attention_chunk_size``, else ``full``.
    KvevalError for a type kveval does not know."""
    view = cfg if isinstance(cfg, _ConfigView) else _ConfigView(cfg)
    sharing = view.get("kv_sharing_modes")
    if isinstance(sharing, (list, tuple)) and "reuse" in sharing:
        raise KvevalError("layers that reuse another layer's K/V (the config's kv_sharing_modes) are not modelled "
                          "by kveval; it cannot say what their cache holds")
    types = view.get("layer_types") or view.get("layers_block_type")
    if types:
        types = list(types)[:layers]
        unknown = sorted({str(t) for t in types if str(t) not in _TYPE_KINDS})
        if unknown:
            raise KvevalError(f"model layers of type {', '.join(repr(t) for t in unknown)} are not modelled by "
                              f"kveval (known: {', '.join(sorted(_TYPE_KINDS))}); it cannot say what they cache")
        kinds = [_TYPE_KINDS[str(t)] for t in types]
        if len(kinds) < layers:
            raise KvevalError(f"the config's layer types name {len(kinds)} of its {layers} layers")
        window = view.get("sliding_window")
        if any(k in ("sliding", "hybrid_sliding") for k in kinds) and not _positive(window):
            kinds = ["full" if k == "sliding" else "hybrid" if k == "hybrid_sliding" else k for k in kinds]
        if "chunked" in kinds and not _positive(view.get("attention_chunk_size")):
            kinds = ["full" if k == "chunked" else k for k in kinds]
        return tuple(kinds)
    if _positive(view.get("sliding_window")) and view.get("use_sliding_window", True) is not False:
        return ("sliding",) * layers
    if _positive(view.get("attention_chunk_size")):
        return ("chunked",) * layers
    return ("full",) * layers


def sliding_window_layers(cfg: Any, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) of a config: the layers of kind ``sliding`` (:func:`layer_kinds_of`)."""
    view = cfg if isinstance(cfg, _ConfigView) else _ConfigView(cfg)
    sliding = tuple(i for i, k in enumerate(layer_kinds_of(view, layers)) if k in ("sliding", "hybrid_sliding"))
    return (view.get("sliding_window") if sliding else None), sliding


def _check_positive(value: Any, key: str) -> None:
    """KvevalError (one line) unless the config's ``key`` is a whole number above zero (a head count of 0 divides
    by zero further on)."""
    if not _positive(value):
        raise KvevalError(f"the model config's {key} is {value!r}: it must be a whole number above 0; fix the config")


def _ranges(layers: list[int]) -> str:
    """``layers 0-4, 6`` for layers 0, 1, 2, 3, 4 and 6 (``layer 5`` for one)."""
    parts, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(parts)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _mla_of(cfg: _ConfigView, heads: int) -> Mla | None:
    rank = cfg.get("kv_lora_rank")
    if rank is None:
        return None
    if not _positive(rank):  # a zero or negative latent: not MLA, and not the per-head K/V it would be billed as
        raise KvevalError(f"the model config's kv_lora_rank is {rank!r}: an MLA latent needs a positive width; fix "
                          "the config (or remove kv_lora_rank for a model without MLA)")
    dims = [cfg.get(k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    if not all(_positive(d) for d in dims):
        raise KvevalError("an MLA config (kv_lora_rank) needs qk_rope_head_dim, qk_nope_head_dim and v_head_dim")
    return Mla(rank, dims[0], dims[1], dims[2], heads)


def _state_of(cfg: _ConfigView) -> StateShape:
    """The state of one state layer (:mod:`kveval.memory.arch`), by the config's family; KvevalError for another
    family."""
    mt = str(cfg.get("model_type") or "")
    if cfg.get("linear_num_value_heads") is not None:  # Gated DeltaNet (Qwen3-Next, Qwen3.5-style)
        nk, nv = cfg.need("linear_num_key_heads"), cfg.need("linear_num_value_heads")
        dk, dv, k = cfg.need("linear_key_head_dim"), cfg.need("linear_value_head_dim"), cfg.need(
            "linear_conv_kernel_dim")
        return StateShape("gated_delta_net", (2 * nk * dk + nv * dv) * k, nv * dk * dv)
    hidden = cfg.get("hidden_size")
    if mt == "jamba":
        d_inner = cfg.get("mamba_expand", 2) * hidden
        return StateShape("mamba", d_inner * cfg.get("mamba_d_conv", 4), d_inner * cfg.get("mamba_d_state", 16))
    mamba2 = {  # model type -> (heads, head dim, groups, state, conv, d_inner) keys
        "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
        "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
        "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
        "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    }
    if mt not in mamba2:
        raise KvevalError(f"model type '{mt or '?'}' has layers that hold a recurrent or convolution state of a "
                          "family kveval does not bill (supported: Qwen3-Next's Gated DeltaNet, the Mamba layers of "
                          "Falcon-H1, Granite-4 hybrid, Bamba, Nemotron-H and Jamba)")
    heads_k, head_k, groups_k, state_k, conv_k = mamba2[mt]
    n_heads, head, groups = cfg.need(heads_k), cfg.need(head_k), cfg.need(groups_k)
    d_state, d_conv = cfg.need(state_k), cfg.need(conv_k)
    d_inner = n_heads * head
    return StateShape("mamba2", (d_inner + 2 * groups * d_state) * d_conv, n_heads * head * d_state)


def _partial_rotary(cfg: _ConfigView) -> float:
    rope = cfg.get("rope_parameters")
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor if factor is not None else cfg.get("partial_rotary_factor", 1.0)
    return float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0


def _nope_layers(cfg: _ConfigView, layers: int) -> tuple[int, ...]:
    """Layers without RoPE: Llama-4's ``no_rope_layers`` (1 = RoPE, 0 = NoPE)."""
    flags = cfg.get("no_rope_layers")
    if not isinstance(flags, (list, tuple)):
        return ()
    return tuple(i for i, f in enumerate(list(flags)[:layers]) if not f)


def _estimate_params(cfg: _ConfigView, layers: int, heads: int, kv_heads: int, head_dim: int) -> int | None:
    """A Llama-like decoder's parameter count: attention, a gated MLP and two norms per layer, the embeddings (and
    an untied LM head), the final norm; None without ``hidden_size``, ``intermediate_size`` or ``vocab_size``."""
    hidden, inter, vocab = cfg.get("hidden_size"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    if not (hidden and inter and vocab):
        return None
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + embed + hidden


__all__ = ["arch_fields", "layer_kinds_of", "named_config", "sliding_window_layers"]
