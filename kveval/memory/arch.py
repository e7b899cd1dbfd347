"""What a model's cache holds, layer by layer (:class:`Arch`), from a model config or a named shape: what the memory
bill, the real cache, the emulation and the scan read about a model without loading it.

Pure data (no transformers import). A config is a transformers config object (its ``layer_types`` may be a
property, as in Falcon-H1 or Jamba) or a dict (``to_dict()``, the JSON of config.json, a named shape).

Per layer, one of (``Arch.layer_kinds``, from the config's ``layer_types`` / ``layers_block_type``, else its
``sliding_window`` / ``attention_chunk_size``):

- ``full``: K/V of every token; ``sliding``: K/V of the newest ``sliding_window`` tokens (Gemma 2/3, Mistral,
  GPT-OSS); ``chunked``: K/V of the newest ``attention_chunk_size`` tokens (Llama-4's local layers: transformers
  and vLLM keep them like a sliding window; the mask limits attention to the current chunk);
- ``state``: no K/V, a fixed-size state per sequence: a convolution state and a recurrent (SSM) state
  (Qwen3-Next's Gated DeltaNet, Mamba layers of Jamba, Bamba, Granite-4, Nemotron-H); ``hybrid``: both, K/V of every
  token and a state (Falcon-H1's parallel attention + Mamba layers);
- ``none``: nothing (an MLP- or MoE-only block of Nemotron-H).

What a K/V layer stores per token (``Arch.kv_shapes``): keys ``[kv_heads, head_dim]`` and values the same, except
for multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, GLM-4.5-style configs with ``kv_lora_rank``):
engines (vLLM's MLA backends, SGLang, llama.cpp) and transformers 5.24's own cache store the compressed latent,
``c_kv`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the RoPE'd ``k_pe`` (``qk_rope_head_dim``
values) of one "head", and decompress them with ``kv_b_proj`` on read: the ``latent`` layout, where a policy's key
spec quantizes ``c_kv`` and its value spec ``k_pe`` (what transformers' attention hands its cache as K and V).
The ``decompressed`` layout (per-head keys ``[heads, qk_nope_head_dim + qk_rope_head_dim]`` and values
``[heads, v_head_dim]``, as attention sees them; what transformers before 5.x cached) is kept for comparison, in
emulation only.

State bytes per sequence (:class:`StateShape`; the conv state in the model's dtype, the recurrent state in float32,
as transformers 5.24 holds them): Gated DeltaNet conv ``[2 nk dk + nv dv, K]``, recurrent ``[nv, dk, dv]``;
Mamba-2 conv ``[d_inner + 2 n_groups d_state, d_conv]``, SSM ``[n_heads, head_dim, d_state]``; Mamba-1 (Jamba) conv
``[d_inner, d_conv]``, SSM ``[d_inner, d_state]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kveval.errors import KvevalError
from kveval.memory.shapes import NAMED_SHAPES  # name -> a published model's config values
from kveval.policy.parse import MLA_LAYOUTS

LayerKind = Literal["full", "sliding", "chunked", "state", "hybrid", "hybrid_sliding", "none"]
LAYER_KINDS: tuple[str, ...] = ("full", "sliding", "chunked", "state", "hybrid", "hybrid_sliding", "none")
#: the kinds that hold K/V, and the kinds that hold a fixed-size state
KV_KINDS = frozenset({"full", "sliding", "chunked", "hybrid", "hybrid_sliding"})
STATE_KINDS = frozenset({"state", "hybrid", "hybrid_sliding"})
#: a config's layer type -> kveval's kind (transformers' names, and the older names of hybrid configs)
_TYPE_KINDS = {
    "full_attention": "full", "attention": "full", "global": "full",
    "sliding_attention": "sliding", "local": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "state", "conv": "state", "mamba": "state", "mamba2": "state",
    "hybrid": "hybrid", "hybrid_sliding": "hybrid_sliding",
    "mlp": "none", "moe": "none", "dummy": "none",
}
#: bytes per element of the recurrent (SSM) state as transformers 5.24 holds it (float32 on every backend it has)
RECURRENT_BYTES = 4


def positive_int(value: Any, what: str) -> int:
    """``value`` when it is a positive int (not a bool); KvevalError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvevalError(f"{what} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention's dimensions: the latent ``kv_lora_rank``, the RoPE part ``qk_rope_head_dim``,
    the per-head ``qk_nope_head_dim`` and ``v_head_dim`` that ``kv_b_proj`` decompresses to, and the query
    ``heads``."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    heads: int

    def to_dict(self) -> dict:
        return {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                "qk_nope_head_dim": self.qk_nope_head_dim, "v_head_dim": self.v_head_dim, "heads": self.heads}


@dataclass(frozen=True)
class StateShape:
    """The fixed-size state of one state layer, per sequence: ``conv`` elements (the model's dtype) and
    ``recurrent`` elements (float32), of the ``family`` (``gated_delta_net``, ``mamba2``, ``mamba``)."""

    family: str
    conv: int
    recurrent: int

    def nbytes(self, fp_bytes: int) -> int:
        """Bytes per sequence: the conv state at ``fp_bytes`` per element, the recurrent state in float32."""
        return self.conv * fp_bytes + self.recurrent * RECURRENT_BYTES

    def to_dict(self) -> dict:
        return {"family": self.family, "conv_elements": self.conv, "recurrent_elements": self.recurrent}


@dataclass(frozen=True)
class Arch:
    """What a model's cache holds (module docstring): ``layers`` layers of K/V ``[batch, kv_heads, seq,
    head_dim]`` unless ``layer_kinds`` says otherwise per layer.

    ``sliding_window`` / ``sliding_layers``: the layers that keep the newest ``sliding_window`` tokens;
    ``chunk_size`` / ``chunked_layers``: those that keep the newest ``chunk_size`` (chunked local attention);
    ``layer_kinds``: one kind per layer (empty: ``sliding`` for ``sliding_layers``, ``chunked`` for
    ``chunked_layers``, ``full`` for the others); ``mla``: latent-attention dimensions (the K/V of every K/V layer
    are then the latent and its RoPE part, :meth:`kv_shapes`); ``state``: the fixed state of the state layers.

    ``params`` (parameter count) and ``weight_bytes_per_param`` (2 = FP16/BF16 weights) size the model for the
    capacity figures; ``params=None`` means unknown (capacity then needs ``model_bytes``). ``weight_bytes``: the
    exact bytes of the weights when they are not all stored at ``weight_bytes_per_param`` (quantized weights:
    :meth:`with_quantized_weights`); it then replaces ``params * weight_bytes_per_param`` in ``model_bytes``, so
    that ``kv_budget``, ``max_batch`` and ``max_context`` count the quantized weights' codes and scales.
    """

    layers: int
    kv_heads: int
    head_dim: int
    name: str = "custom"
    params: int | None = None
    weight_bytes_per_param: float = 2
    sliding_window: int | None = None  # tokens a sliding-window layer keeps (None: no such layers)
    sliding_layers: tuple[int, ...] = ()  # indices of the sliding-window layers
    weight_bytes: int | None = None  # exact weight bytes (quantized weights); None: params * weight_bytes_per_param
    chunk_size: int | None = None  # tokens a chunked-attention layer keeps (None: no such layers)
    chunked_layers: tuple[int, ...] = ()
    layer_kinds: tuple[str, ...] = ()
    mla: Mla | None = None
    state: StateShape | None = None
    model_type: str | None = None
    #: facts of the attention a K/V transform may need (``partial_rotary``: the share of head_dim RoPE rotates;
    #: ``nope_layers``: layers without RoPE), read from the config
    partial_rotary: float = 1.0
    nope_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        positive_int(self.layers, "layers")
        positive_int(self.kv_heads, "kv_heads")
        positive_int(self.head_dim, "head_dim")
        for what in ("sliding_window", "chunk_size"):
            if getattr(self, what) is not None:
                positive_int(getattr(self, what), what)
        for what, window in (("sliding", "sliding_window"), ("chunked", "chunk_size")):
            found = tuple(sorted(set(getattr(self, f"{what}_layers"))))
            object.__setattr__(self, f"{what}_layers", found)
            bad = [i for i in found if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers]
            if bad:
                raise KvevalError(f"{what} layers {bad} are outside the model's {self.layers} layers "
                                  f"(0..{self.layers - 1})")
            if found and getattr(self, window) is None:
                raise KvevalError(f"{what} layers given without a {window.replace('_', ' ')}; give both or neither")
        if set(self.sliding_layers) & set(self.chunked_layers):
            raise KvevalError("a layer cannot be both sliding and chunked")
        if self.layer_kinds:
            kinds = tuple(self.layer_kinds)
            if len(kinds) != self.layers or any(k not in LAYER_KINDS for k in kinds):
                raise KvevalError(f"layer_kinds must name one of {', '.join(LAYER_KINDS)} for each of the "
                                  f"{self.layers} layers")
            object.__setattr__(self, "layer_kinds", kinds)
            if not any(k in KV_KINDS for k in kinds):
                raise KvevalError("no layer of this model holds K/V; there is no KV cache to quantize")
            if any(k in STATE_KINDS for k in kinds) and self.state is None:
                raise KvevalError("state layers given without their state shape")
        if self.params is not None:
            positive_int(self.params, "params")
        if not isinstance(self.weight_bytes_per_param, (int, float)) or self.weight_bytes_per_param <= 0:
            raise KvevalError(f"weight_bytes_per_param must be positive; got {self.weight_bytes_per_param!r}")
        if self.weight_bytes is not None:
            positive_int(self.weight_bytes, "weight_bytes")

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def named(cls, name: str) -> Arch:
        """A named shape (:data:`NAMED_SHAPES`, ``kveval memory --shape``): a published model's config values
        (``llama-3.1-8b``, ``deepseek-v3``, ``qwen3-next-80b-a3b``, ...), or one of kveval's worked shapes
        (``llama-7b-mha``, ``llama-7b-gqa4``, ``smollm2-135m``)."""
        key = str(name).removeprefix("builtin:").lower()
        if key not in NAMED_SHAPES:
            import difflib

            close = difflib.get_close_matches(key, list(NAMED_SHAPES), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise KvevalError(f"unknown shape '{name}'{hint} (known shapes: {', '.join(NAMED_SHAPES)})")
        entry = NAMED_SHAPES[key]
        return cls.from_model_config(entry["config"], name=key, params=entry.get("params"))

    @classmethod
    def from_model_config(cls, config: Any, name: str | None = None, params: int | None = None) -> Arch:
        """From a transformers config (or its ``to_dict()``): ``num_hidden_layers``, ``num_key_value_heads``
        (else ``num_attention_heads``), ``head_dim`` (else ``hidden_size // num_attention_heads``), the layer
        kinds (module docstring), MLA's dimensions (``kv_lora_rank`` ...), the state layers' state, RoPE facts.
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
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") // heads if cfg.get("hidden_size") else None)
        if head_dim is None:
            raise KvevalError("model config has neither 'head_dim' nor 'hidden_size'; give --head-dim")
        kinds = layer_kinds_of(cfg, layers)
        mla = _mla_of(cfg, heads)
        state = _state_of(cfg) if any(k in STATE_KINDS for k in kinds) else None
        sliding_window = cfg.get("sliding_window") if any(k in ("sliding", "hybrid_sliding") for k in kinds) else None
        chunk = cfg.get("attention_chunk_size") if "chunked" in kinds else None
        if params is None and mla is None and state is None and not cfg.get("num_local_experts") \
                and not cfg.get("n_routed_experts") and not cfg.get("num_experts"):
            params = _estimate_params(cfg, layers, heads, kv_heads, head_dim)
        nm = name or cfg.get("_name_or_path") or cfg.get("model_type") or "custom"
        plain = all(k in ("full", "sliding") for k in kinds)
        return cls(layers=layers, kv_heads=kv_heads, head_dim=head_dim, name=str(nm), params=params,
                   sliding_window=sliding_window,
                   sliding_layers=tuple(i for i, k in enumerate(kinds) if k in ("sliding", "hybrid_sliding")),
                   chunk_size=chunk, chunked_layers=tuple(i for i, k in enumerate(kinds) if k == "chunked"),
                   layer_kinds=() if plain else kinds, mla=mla, state=state, model_type=cfg.get("model_type"),
                   partial_rotary=_partial_rotary(cfg), nope_layers=_nope_layers(cfg, layers))

    @classmethod
    def from_dict(cls, data: dict) -> Arch:
        """The inverse of :meth:`to_dict` (a run's ``memory.arch``); KvevalError (one line) for a field that is not
        one of its own or a value of the wrong kind."""
        if not isinstance(data, dict):
            raise KvevalError(f"a model shape must be a mapping; got {type(data).__name__}")
        fields = dict(data)
        try:
            if fields.get("mla") is not None:
                fields["mla"] = Mla(**fields["mla"])
            if fields.get("state") is not None:
                st = fields["state"]
                fields["state"] = StateShape(st["family"], st["conv_elements"], st["recurrent_elements"])
            for key in ("sliding_layers", "chunked_layers", "layer_kinds", "nope_layers"):
                if key in fields:
                    fields[key] = tuple(fields[key])
            return cls(**fields)
        except (TypeError, KeyError) as exc:
            raise KvevalError(f"not a model shape: {exc}") from None

    @classmethod
    def from_model(cls, model: Any, weight_bytes_per_param: float = 2) -> Arch:
        """From a loaded model: its config's shape and its exact parameter count."""
        arch = cls.from_model_config(model.config, name=getattr(model, "kveval_name", None) or None)
        n = sum(p.numel() for p in model.parameters())
        return replace(arch, params=n, weight_bytes_per_param=weight_bytes_per_param)

    # --- per layer ----------------------------------------------------------------------------------------------
    def kind(self, layer: int) -> str:
        """The kind of layer ``layer`` (module docstring)."""
        if self.layer_kinds:
            return self.layer_kinds[layer]
        if layer in self.sliding_layers:
            return "sliding"
        if layer in self.chunked_layers:
            return "chunked"
        return "full"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that hold K/V (what a policy quantizes, what the scan and the planner see)."""
        return tuple(i for i in range(self.layers) if self.kind(i) in KV_KINDS)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that hold a fixed-size state."""
        return tuple(i for i in range(self.layers) if self.kind(i) in STATE_KINDS)

    def window(self, layer: int) -> int | None:
        """The tokens layer ``layer`` keeps: the sliding window or the chunk size for such a layer, None (all)
        otherwise."""
        if layer in self.sliding_layers:
            return self.sliding_window
        if layer in self.chunked_layers:
            return self.chunk_size
        return None

    def held_tokens(self, layer: int, n: int) -> int:
        """Tokens layer ``layer`` holds once ``n`` are stored: ``min(n, window)`` in a layer with a window (the
        window the newest token's query reads, its own token included), ``n`` in other K/V layers, 0 in layers
        without K/V."""
        if self.kind(layer) not in KV_KINDS:
            return 0
        w = self.window(layer)
        return n if w is None else min(n, w)

    def kv_shapes(self, mla_layout: str = "latent") -> tuple[tuple[int, int], tuple[int, int]]:
        """``((key heads, key dim), (value heads, value dim))`` stored per token by a K/V layer: ``(kv_heads,
        head_dim)`` twice; with MLA, ``(1, kv_lora_rank)`` and ``(1, qk_rope_head_dim)`` in the ``latent`` layout,
        ``(heads, qk_nope_head_dim + qk_rope_head_dim)`` and ``(heads, v_head_dim)`` in the ``decompressed`` one."""
        if self.mla is None:
            return (self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)
        m = self.mla
        if mla_layout == "decompressed":
            return (m.heads, m.qk_nope_head_dim + m.qk_rope_head_dim), (m.heads, m.v_head_dim)
        if mla_layout != "latent":
            raise KvevalError(f"MLA layout must be one of {', '.join(MLA_LAYOUTS)}; got {mla_layout!r}")
        return (1, m.kv_lora_rank), (1, m.qk_rope_head_dim)

    def state_bytes(self, fp_bytes: int = 2) -> int:
        """The fixed state of one sequence over all state layers (0 without state layers)."""
        if self.state is None:
            return 0
        return len(self.state_layers) * self.state.nbytes(fp_bytes)

    def describe_layers(self) -> str:
        """One line on what is unusual about the layers ('' for a model whose every layer caches K/V in full):
        ``sliding-window layers 0, 2 hold min(context, 8) tokens``, ``MLA: the latent (512) and its RoPE part
        (64) per token``, ``state layers 0-2: 74.25 MiB per sequence``..."""
        parts = []
        if self.sliding_layers:
            parts.append(f"sliding-window layers {_ranges(self.sliding_layers)} hold min(context, "
                         f"{self.sliding_window:,}) tokens")
        if self.chunked_layers:
            parts.append(f"chunked-attention layers {_ranges(self.chunked_layers)} hold min(context, "
                         f"{self.chunk_size:,}) tokens")
        if self.mla is not None:
            parts.append(f"MLA: each K/V layer stores the latent ({self.mla.kv_lora_rank}) and its RoPE part "
                         f"({self.mla.qk_rope_head_dim}) per token")
        if self.state is not None:
            parts.append(f"state layers {_ranges(self.state_layers)} ({self.state.family}) hold no K/V but a "
                         f"fixed state per sequence")
        none = [i for i in range(self.layers) if self.kind(i) == "none"]
        if none:
            parts.append(f"layers {_ranges(tuple(none))} hold nothing")
        return "; ".join(parts)

    # --- weights ------------------------------------------------------------------------------------------------
    @property
    def model_bytes(self) -> int | None:
        """Weight bytes: ``weight_bytes`` when set (quantized weights), else ``params * weight_bytes_per_param``
        (None when the parameter count is unknown)."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        return None if self.params is None else int(self.params * self.weight_bytes_per_param)

    def with_quantized_weights(self, quantized_params: int, quantized_bytes: int) -> Arch:
        """This shape with ``quantized_params`` of its parameters stored in ``quantized_bytes`` (codes + scales +
        zero points, e.g. :func:`kveval.weights.matrix_nbytes` summed) and the others at
        ``weight_bytes_per_param``: ``weight_bytes = (params - quantized_params) * weight_bytes_per_param +
        quantized_bytes``. Worked: 134,515,008 parameters, 106,168,320 of them in INT8 per output channel (1 B
        each + a 2 B scale per output row: 106,168,320 + 2 * 155,520 B): 2 * 28,346,688 + 106,479,360 = 163,172,736 B
        instead of 269,030,016 B in FP16."""
        if self.params is None:
            raise KvevalError("quantized weights need the model's parameter count (params)")
        if isinstance(quantized_params, bool) or not isinstance(quantized_params, int) or \
                not 0 <= quantized_params <= self.params:
            raise KvevalError(f"quantized_params must be an integer in 0..{self.params}; got {quantized_params!r}")
        if isinstance(quantized_bytes, bool) or not isinstance(quantized_bytes, int) or quantized_bytes < 0:
            raise KvevalError(f"quantized_bytes must be a non-negative integer; got {quantized_bytes!r}")
        rest = int((self.params - quantized_params) * self.weight_bytes_per_param)
        return replace(self, weight_bytes=rest + quantized_bytes)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "name": self.name, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
            "params": self.params, "weight_bytes_per_param": self.weight_bytes_per_param,
            "sliding_window": self.sliding_window, "sliding_layers": list(self.sliding_layers)}
        if self.weight_bytes is not None:  # only when set: the JSON of FP16 weights stays as it was
            out["weight_bytes"] = self.weight_bytes
        # only for the models that have them, likewise
        if self.chunked_layers:
            out["chunk_size"], out["chunked_layers"] = self.chunk_size, list(self.chunked_layers)
        if self.layer_kinds:
            out["layer_kinds"] = list(self.layer_kinds)
        if self.mla is not None:
            out["mla"] = self.mla.to_dict()
        if self.state is not None:
            out["state"] = self.state.to_dict()
        if self.model_type is not None:
            out["model_type"] = self.model_type
        if self.partial_rotary != 1.0:
            out["partial_rotary"] = self.partial_rotary
        if self.nope_layers:
            out["nope_layers"] = list(self.nope_layers)
        return out


# ------------------------------------------------------------------------------------------------- config reading
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

    def get(self, key: str, default: Any = None) -> Any:
        if self.obj is not None:
            try:
                value = getattr(self.obj, key)
            except (AttributeError, KeyError, TypeError, ValueError, IndexError):
                value = None
            if value is not None:
                return value
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value


def layer_kinds_of(cfg: _ConfigView | dict | Any, layers: int) -> tuple[str, ...]:
    """Each layer's kind (module docstring) from the config's ``layer_types`` (else ``layers_block_type``), else
    ``sliding`` for every layer of a config with ``sliding_window`` (and ``use_sliding_window`` not false:
    Mistral-style), ``chunked`` with ``attention_chunk_size``, else ``full``. KvevalError for a type kveval does
    not know."""
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


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _mla_of(cfg: _ConfigView, heads: int) -> Mla | None:
    rank = cfg.get("kv_lora_rank")
    if not _positive(rank):
        return None
    dims = [cfg.get(k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    if not all(_positive(d) for d in dims):
        raise KvevalError("an MLA config (kv_lora_rank) needs qk_rope_head_dim, qk_nope_head_dim and v_head_dim")
    return Mla(rank, dims[0], dims[1], dims[2], heads)


def _state_of(cfg: _ConfigView) -> StateShape:
    """The state of one state layer (module docstring), by the config's family; KvevalError for another family."""
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


def _ranges(layers: tuple[int, ...]) -> str:
    """``0-2, 5, 7-9``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _estimate_params(cfg: _ConfigView, layers: int, heads: int, kv_heads: int, head_dim: int) -> int | None:
    hidden, inter, vocab = cfg.get("hidden_size"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    if not (hidden and inter and vocab):
        return None
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + embed + hidden


__all__ = ["Arch", "KV_KINDS", "LAYER_KINDS", "MLA_LAYOUTS", "Mla", "NAMED_SHAPES", "STATE_KINDS", "StateShape",
           "layer_kinds_of", "positive_int", "sliding_window_layers"]
