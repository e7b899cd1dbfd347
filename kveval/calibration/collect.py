"""Collect the keys and values every attention layer sees (for calibration), without changing the outputs.

``with collect_kv(model) as kv: model(ids)`` then ``kv.samples(layer)`` gives ``{"key", "key_pre_rope", "value"}``
as ``[tokens, kv_heads, head_dim]`` float32 tensors on the CPU (every forward call appended; batch rows flattened
into tokens). ``key_pre_rope`` is present for rotary models.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.rope_capture import captured_rope, track_rope
from kveval.rope import unrotate


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

    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.parts["key"].append(_tokens_first(key))
        self.parts["value"].append(_tokens_first(value))
        rope = captured_rope(module, key.shape[-1])
        if rope is not None:
            self.parts["key_pre_rope"].append(_tokens_first(unrotate(key, *rope)))
        return attn.stock_attention(module, self.implementation)(module, query, key, value, attention_mask, *args,
                                                                 **kwargs)


class Collected:
    def __init__(self, layers: list[LayerCollector]):
        self.layers = layers

    def samples(self, layer: int) -> dict[str, torch.Tensor]:
        """``{kind: [tokens, kv_heads, head_dim]}`` of one layer (kinds with no samples are left out)."""
        parts = self.layers[layer].parts
        return {k: torch.cat(v) for k, v in parts.items() if v}

    def clear(self) -> None:
        for layer in self.layers:
            for v in layer.parts.values():
                v.clear()


@contextmanager
def collect_kv(model):
    """Record every attention layer's K/V during forward passes (see the module docstring)."""
    modules = attn.attention_modules(model)
    if not modules:
        raise KvevalError(f"{type(model).__name__}: no attention modules with a layer index found; cannot calibrate")
    base = attn.base_implementation(model)
    track_rope(model)
    layers = [LayerCollector(m.layer_idx, base) for m in modules]
    with attn.patched(model, dict(zip(modules, layers))):
        yield Collected(layers)
