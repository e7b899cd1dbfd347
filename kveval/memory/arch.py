"""The shape of a model's KV cache (:class:`Arch`), from a model config or a named shape: what the memory bill and
the real cache read about a model without loading it.

Pure data (no transformers import): a config is read as a dict (``to_dict()`` of a transformers config, or the
JSON of config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kveval.errors import KvevalError

#: name -> (layers, kv_heads, head_dim, parameters)
NAMED_SHAPES: dict[str, tuple[int, int, int, int]] = {
    # LLaMA-7B: 6,738,415,616 parameters (32 x 202,383,360 + 2 x 32000 x 4096 embeddings + 4096 norm)
    "llama-7b-mha": (32, 32, 128, 6_738_415_616),
    # the same with 4 KV heads (K and V projections 4096 x 512): 939,524,096 fewer parameters
    "llama-7b-gqa4": (32, 4, 128, 5_798_891_520),
    # SmolLM2-135M(-Instruct), the builtin model: hidden 576, 9 q / 3 kv heads, tied 49152-token embeddings
    "smollm2-135m": (30, 3, 64, 134_515_008),
}


def positive_int(value: Any, what: str) -> int:
    """``value`` when it is a positive int (not a bool); KvevalError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvevalError(f"{what} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class Arch:
    """The shape of a model's KV cache: ``layers`` x K/V ``[batch, kv_heads, seq, head_dim]``.

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

    def __post_init__(self) -> None:
        positive_int(self.layers, "layers")
        positive_int(self.kv_heads, "kv_heads")
        positive_int(self.head_dim, "head_dim")
        if self.sliding_window is not None:
            positive_int(self.sliding_window, "sliding_window")
        object.__setattr__(self, "sliding_layers", tuple(sorted(set(self.sliding_layers))))
        bad = [i for i in self.sliding_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers]
        if bad:
            raise KvevalError(f"sliding layers {bad} are outside the model's {self.layers} layers (0..{self.layers - 1})")
        if self.sliding_layers and self.sliding_window is None:
            raise KvevalError("sliding layers given without a sliding window; give both or neither")
        if self.params is not None:
            positive_int(self.params, "params")
        if not isinstance(self.weight_bytes_per_param, (int, float)) or self.weight_bytes_per_param <= 0:
            raise KvevalError(f"weight_bytes_per_param must be positive; got {self.weight_bytes_per_param!r}")
        if self.weight_bytes is not None:
            positive_int(self.weight_bytes, "weight_bytes")

    @classmethod
    def named(cls, name: str) -> Arch:
        """A named shape: ``llama-7b-mha`` (32 layers, 32 KV heads, head_dim 128), ``llama-7b-gqa4`` (4 KV heads),
        ``smollm2-135m`` (30 layers, 3 KV heads, head_dim 64)."""
        key = str(name).removeprefix("builtin:")
        if key not in NAMED_SHAPES:
            import difflib

            close = difflib.get_close_matches(key, list(NAMED_SHAPES), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise KvevalError(f"unknown shape '{name}'{hint} (known shapes: {', '.join(NAMED_SHAPES)})")
        layers, heads, dim, params = NAMED_SHAPES[key]
        return cls(layers=layers, kv_heads=heads, head_dim=dim, name=key, params=params)

    @classmethod
    def from_model_config(cls, config: Any, name: str | None = None, params: int | None = None) -> Arch:
        """From a transformers config (or its ``to_dict()``): ``num_hidden_layers``, ``num_key_value_heads``
        (else ``num_attention_heads``), ``head_dim`` (else ``hidden_size // num_attention_heads``), and the
        sliding-window layers (``sliding_window_layers``: ``layer_types``, else ``sliding_window``).

        ``params`` defaults to an estimate for Llama-like decoders (attention + gated MLP + norms + embeddings),
        None when the config lacks ``intermediate_size`` or ``vocab_size``.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        cfg = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        try:
            layers = cfg["num_hidden_layers"]
            heads = cfg["num_attention_heads"]
        except KeyError as exc:
            raise KvevalError(f"model config has no {exc.args[0]!r}; give --layers --kv-heads --head-dim") from None
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if cfg.get("hidden_size") else None)
        if head_dim is None:
            raise KvevalError("model config has neither 'head_dim' nor 'hidden_size'; give --head-dim")
        if params is None:
            params = _estimate_params(cfg, layers, heads, kv_heads, head_dim)
        nm = name or cfg.get("_name_or_path") or cfg.get("model_type") or "custom"
        window, sliding = sliding_window_layers(cfg, layers)
        return cls(layers=layers, kv_heads=kv_heads, head_dim=head_dim, name=str(nm), params=params,
                   sliding_window=window, sliding_layers=sliding)

    @classmethod
    def from_model(cls, model: Any, weight_bytes_per_param: float = 2) -> Arch:
        """From a loaded model: its config's shape and its exact parameter count."""
        arch = cls.from_model_config(model.config, name=getattr(model, "kveval_name", None) or None)
        n = sum(p.numel() for p in model.parameters())
        return replace(arch, params=n, weight_bytes_per_param=weight_bytes_per_param)

    def window(self, layer: int) -> int | None:
        """The tokens layer ``layer`` keeps: ``sliding_window`` for a sliding-window layer, None (all) otherwise."""
        return self.sliding_window if layer in self.sliding_layers else None

    def held_tokens(self, layer: int, n: int) -> int:
        """Tokens layer ``layer`` holds once ``n`` are stored: ``min(n, sliding_window)`` in a sliding-window
        layer (the window the newest token's query reads, its own token included), ``n`` otherwise."""
        w = self.window(layer)
        return n if w is None else min(n, w)

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
        out = {"name": self.name, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
               "params": self.params, "weight_bytes_per_param": self.weight_bytes_per_param,
               "sliding_window": self.sliding_window, "sliding_layers": list(self.sliding_layers)}
        if self.weight_bytes is not None:  # only when set: the JSON of FP16 weights stays as it was
            out["weight_bytes"] = self.weight_bytes
        return out


def sliding_window_layers(cfg: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) of a config dict: the layers whose ``layer_types`` entry is
    ``sliding_attention`` (Gemma 2/3, Qwen2 with ``use_sliding_window``, transformers v5), else every layer when
    ``sliding_window`` is set and ``use_sliding_window`` is not false (Mistral-style); ``(None, ())`` otherwise."""
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None, ()
    types = cfg.get("layer_types")
    if types:
        sliding = tuple(i for i, t in enumerate(types[:layers]) if t == "sliding_attention")
    elif cfg.get("use_sliding_window", True):
        sliding = tuple(range(layers))
    else:
        sliding = ()
    return (window if sliding else None), sliding


def _estimate_params(cfg: dict, layers: int, heads: int, kv_heads: int, head_dim: int) -> int | None:
    hidden, inter, vocab = cfg.get("hidden_size"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    if not (hidden and inter and vocab):
        return None
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + embed + hidden


__all__ = ["Arch", "NAMED_SHAPES", "positive_int", "sliding_window_layers"]
