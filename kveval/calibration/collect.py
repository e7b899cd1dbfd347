"""Collect the keys and values every attention layer sees (for calibration), without changing the outputs.

``with collect_kv(model) as kv: model(ids)`` then ``kv.samples(layer)`` gives ``{"key", "key_pre_rope", "value"}``
as ``[tokens, kv_heads, head_dim]`` float32 tensors on the CPU (every forward call appended; batch rows flattened
into tokens). ``key_pre_rope`` is present for rotary models.

``collect_kv(model, fisher=True)`` also retains the gradients of those K/V tensors: after ``loss.backward()``,
``kv.harvest()`` turns them into ``kv.fisher(layer)``, the same kinds and shapes holding the squared gradient of
the loss with respect to each element (KVQuant's Fisher information, ``gradients/run-fisher.py``: ``act.grad ** 2``
of ``k_proj`` / ``v_proj``). A pre-RoPE key's gradient is the post-RoPE one through the transposed rotation
(``k = k_pre c + rotate_half(k_pre) s`` -> ``g_pre = g c - rotate_half(g) s``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.rope_capture import captured_rope, track_rope
from kveval.rope import rotate_half, unrotate


def rope_transposed(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transposed RoPE map applied to g ``[batch, kv_heads, T, head_dim]`` (cos/sin ``[batch, T, head_dim]``): the
    gradient with respect to the pre-RoPE key from the one with respect to the rotated key."""
    c, s = cos[:, None].to(g.dtype), sin[:, None].to(g.dtype)
    return g * c - rotate_half(g) * s


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, T, head_dim]`` -> ``[batch*T, kv_heads, head_dim]`` float32 on the CPU."""
    B, H, T, D = x.shape
    return x.detach().permute(0, 2, 1, 3).reshape(B * T, H, D).float().cpu()


@dataclass
class LayerCollector:
    """The attention-interface state of one layer: records K (post- and pre-RoPE) and V, then attends as stock."""

    layer_idx: int
    implementation: str
    parts: dict = field(default_factory=lambda: {"key": [], "key_pre_rope": [], "value": []})
    fisher: bool = False
    grads: dict = field(default_factory=lambda: {"key": [], "key_pre_rope": [], "value": []})
    live: list = field(default_factory=list)  # (key, value, rope) of this forward, gradients retained

    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.parts["key"].append(_tokens_first(key))
        self.parts["value"].append(_tokens_first(value))
        rope = captured_rope(module, key.shape[-1])
        if rope is not None:
            self.parts["key_pre_rope"].append(_tokens_first(unrotate(key, *rope)))
        if self.fisher and key.requires_grad and value.requires_grad:
            key.retain_grad()
            value.retain_grad()
            self.live.append((key, value, rope))
        return attn.stock_attention(module, self.implementation)(module, query, key, value, attention_mask, *args,
                                                                 **kwargs)


    def harvest(self) -> None:
        """Squared gradients of the K/V of the forward calls since the last harvest (zeros where the loss did not
        reach them)."""
        for key, value, rope in self.live:
            gk = key.grad if key.grad is not None else torch.zeros_like(key)
            gv = value.grad if value.grad is not None else torch.zeros_like(value)
            self.grads["key"].append(_tokens_first(gk.detach() ** 2))
            self.grads["value"].append(_tokens_first(gv.detach() ** 2))
            if rope is not None:
                self.grads["key_pre_rope"].append(_tokens_first(rope_transposed(gk.detach(), *rope) ** 2))
        self.live.clear()


class Collected:
    def __init__(self, layers: list[LayerCollector]):
        self.layers = layers

    def harvest(self) -> None:
        """Keep the squared gradients of the last forward/backward (``collect_kv(model, fisher=True)``)."""
        for layer in self.layers:
            layer.harvest()

    def fisher(self, layer: int) -> dict[str, torch.Tensor]:
        """``{kind: [tokens, kv_heads, head_dim]}`` squared gradients of one layer, aligned with `samples`."""
        grads = self.layers[layer].grads
        return {k: torch.cat(v) for k, v in grads.items() if v}

    def samples(self, layer: int) -> dict[str, torch.Tensor]:
        """``{kind: [tokens, kv_heads, head_dim]}`` of one layer (kinds with no samples are left out)."""
        parts = self.layers[layer].parts
        return {k: torch.cat(v) for k, v in parts.items() if v}

    def clear(self) -> None:
        for layer in self.layers:
            for v in layer.parts.values():
                v.clear()


@contextmanager
def collect_kv(model, fisher: bool = False):
    """Record every attention layer's K/V during forward passes (see the module docstring); ``fisher``: also retain
    their gradients (the embeddings' output is made to require grad, so that the model's own parameters need not)."""
    modules = attn.attention_modules(model)
    if not modules:
        raise KvevalError(f"{type(model).__name__}: no attention modules with a layer index found; cannot calibrate")
    base = attn.base_implementation(model)
    track_rope(model)
    layers = [LayerCollector(m.layer_idx, base, fisher=fisher) for m in modules]
    hook = None
    if fisher:
        hook = model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    try:
        with attn.patched(model, dict(zip(modules, layers))):
            yield Collected(layers)
    finally:
        if hook is not None:
            hook.remove()
