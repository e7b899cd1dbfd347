"""What a model's cache holds, layer by layer (:class:`Arch`), from a model config or a named shape: what the memory
bill, the real cache, the emulation and the scan read about a model without loading it.

Pure data (no transformers import). A config is a transformers config object (its ``layer_types`` may be a
property, as in Falcon-H1 or Jamba) or a dict (``to_dict()``, the JSON of config.json, a named shape). It is read
into an Arch's fields by :mod:`kveval.memory.config_reader`; the layer kinds and the two stores that are not plain
K/V (:class:`Mla`, :class:`StateShape`) are :mod:`kveval.memory.layer_kinds`.

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
from typing import Any

from kveval.errors import KvevalError
from kveval.memory.config_reader import arch_fields, layer_kinds_of, named_config, sliding_window_layers
from kveval.memory.layer_kinds import (
    KV_KINDS,
    LAYER_KINDS,
    RECURRENT_BYTES,
    STATE_KINDS,
    LayerKind,
    Mla,
    StateShape,
    positive_int,
)
from kveval.memory.shapes import NAMED_SHAPES  # name -> a published model's config values
from kveval.policy.parse import MLA_LAYOUTS


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
        key, config, params = named_config(name)
        return cls.from_model_config(config, name=key, params=params)

    @classmethod
    def from_model_config(cls, config: Any, name: str | None = None, params: int | None = None) -> Arch:
        """From a transformers config (or its ``to_dict()``), read by
        :func:`kveval.memory.config_reader.arch_fields` (what it reads, the estimated ``params``)."""
        return cls(**arch_fields(config, name, params))

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
        return self.mla.kv_shapes(mla_layout)

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


def _ranges(layers: tuple[int, ...]) -> str:
    """``0-2, 5, 7-9``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


__all__ = ["Arch", "KV_KINDS", "LAYER_KINDS", "MLA_LAYOUTS", "RECURRENT_BYTES", "LayerKind", "Mla", "NAMED_SHAPES",
           "STATE_KINDS", "StateShape", "layer_kinds_of", "positive_int", "sliding_window_layers"]
