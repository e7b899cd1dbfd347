"""One full-precision forward pass of a window, keeping what every attention layer received and returned.

``capture_window(model, ids)`` runs ``ids`` ``[1, T]`` through the model with its own attention and returns a
``Window``: per attention layer a ``LayerCall`` (the attention interface's arguments, which
``kveval.patch.emulate.LayerEmulation.attend`` accepts as they are, and the stock output), and per decoder layer the
residual stream entering it. The outputs are the model's own: the capture only records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.rope_capture import captured_rope, track_rope
from kveval.rope import unrotate


@dataclass
class LayerCall:
    """One attention call: ``query`` ``[1, heads, T, head_dim]`` (post-RoPE), ``key`` / ``value`` ``[1, kv_heads,
    T, head_dim]`` as attention reads them, ``key_pre_rope`` (None on a model without full-dimension RoPE),
    ``rope`` ``(cos, sin)`` ``[1, T, head_dim]`` or None, ``output`` ``[1, T, heads, head_dim]`` (the stock
    attention's), and the call's ``mask``, ``args`` and ``kwargs``."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_pre_rope: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None
    output: torch.Tensor
    mask: torch.Tensor | None
    args: tuple
    kwargs: dict


@dataclass
class Window:
    """The captured calls of one window, by layer index, its full-precision logits, and ``residual[i]`` ``[T,
    hidden]``: the hidden state entering decoder layer ``i`` (the residual stream)."""

    ids: torch.Tensor
    logits: torch.Tensor | None = None  # [T, vocab], the full-precision pass's
    calls: dict[int, LayerCall] = field(default_factory=dict)
    residual: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Recorder:
    """The attention-interface state of one layer during the capture pass: attends as stock and records."""

    implementation: str
    window: Window
    layer_idx: int

    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        out = attn.stock_attention(module, self.implementation)(module, query, key, value, attention_mask, *args,
                                                                **kwargs)
        rope = captured_rope(module, key.shape[-1])
        pre = unrotate(key, *rope) if rope is not None else None
        self.window.calls[self.layer_idx] = LayerCall(
            module, query.detach(), key.detach(), value.detach(), None if pre is None else pre.detach(),
            None if rope is None else (rope[0].detach(), rope[1].detach()), out[0].detach(), attention_mask, args,
            dict(kwargs))
        return out


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``); [] when the model has another shape."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    return list(getattr(decoder, "layers", None) or [])


@torch.no_grad()
def capture_window(model, ids: torch.Tensor) -> Window:
    """The full-precision pass of ``ids`` ``[1, T]`` with every attention layer's call recorded (see the module
    docstring). KvevalError (one line) when the model has no attention modules kveval can patch, or when a layer
    was not reached through the patched attention."""
    modules = attn.attention_modules(model)
    if not modules:
        raise KvevalError(f"{type(model).__name__}: no attention modules with a layer index found; kveval inspect "
                          "cannot capture its keys and values")
    track_rope(model)
    window = Window(ids)
    base = attn.base_implementation(model)
    states: dict[torch.nn.Module, object] = {m: _Recorder(base, window, cast(int, m.layer_idx)) for m in modules}

    def hook(index):
        def pre(_module, args, kw):
            hidden = args[0] if args else kw.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                window.residual[index] = hidden.detach()[0]
        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(decoder_layers(model))]
    try:
        with attn.patched(model, states):
            window.logits = model(ids, use_cache=False).logits.detach()[0]
    finally:
        for h in handles:
            h.remove()
    bad = [i for i, c in sorted(window.calls.items())
           if not all(bool(torch.isfinite(t).all()) for t in (c.query, c.key, c.value, c.output))]
    if bad or (window.logits is not None and not bool(torch.isfinite(window.logits).all())):
        where = f"at layer {bad[0]}" if bad else "in its logits"
        raise KvevalError(f"{type(model).__name__}: the full-precision pass produced NaN or inf {where}; kveval "
                          "inspect needs a model whose own activations are finite (check its weights and dtype)")
    missed = [m.layer_idx for m in modules if m.layer_idx not in window.calls]
    if missed:
        raise KvevalError(f"{type(model).__name__}: attention layers {missed[:8]} were not reached through the "
                          "patched attention; kveval inspect cannot capture this model")
    return window
