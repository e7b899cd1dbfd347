"""Tiny Llama models with planted K/V defects, for ``kveval inspect``'s tests: each defect at a known place, built
by editing the weights of ``builtin:tiny-llama`` (with attention biases), so that a saved folder carries them.

- ``key_bias``: a constant on one pre-RoPE key channel of one KV head of one layer (a per-channel key bias, as
  Qwen2's ``k_proj`` has), making that channel an outlier of every token;
- ``value_offset``: a constant added to every value channel of one layer (an offset value distribution);
- ``massive``: a huge value in one residual-stream channel of the BOS token (its embedding), a massive activation
  at position 0 in every layer;
- ``sink``: one layer whose queries all align with the BOS token's key in the lowest-frequency RoPE channel pair
  (which barely rotates over a window), so that token 0 takes most of that layer's attention.

Shapes (tiny-llama): hidden 64, 4 query heads and 2 KV heads of 32, 4 layers; RoPE pairs channel i with i + 16,
and pair 15 (channels 15, 31) turns the slowest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEAD_DIM = 32
SLOW = 15  # the lowest-frequency RoPE channel (its pair is 31)


@dataclass(frozen=True)
class Plants:
    """Where each defect sits (None: not planted)."""

    key_bias: tuple[int, int, int] | None = (1, 0, 5)  # (layer, kv head, channel)
    value_offset: int | None = 2  # layer
    massive_channel: int | None = 37  # residual channel of BOS
    sink_layer: int | None = 3


def planted_model(plants: Plants = Plants(), seed: int = 0):
    """(model, tokenizer): tiny-llama (float32, attention biases, zero at first) with ``plants``."""
    from kveval.models import load_model
    from kveval.models.builtin import build_tiny_model

    _, tokenizer = load_model("builtin:tiny-llama")
    model = build_tiny_model("tiny-llama", seed=seed, attention_bias=True)
    layers = model.model.layers
    with torch.no_grad():
        if plants.key_bias is not None:
            layer, head, channel = plants.key_bias
            layers[layer].self_attn.k_proj.bias[head * HEAD_DIM + channel] = 2.0
        if plants.value_offset is not None:
            layers[plants.value_offset].self_attn.v_proj.bias.fill_(0.5)
        if plants.massive_channel is not None:
            bos = tokenizer.bos_token_id
            model.model.embed_tokens.weight[bos, plants.massive_channel] = 20.0
        if plants.sink_layer is not None and plants.massive_channel is not None:
            attn = layers[plants.sink_layer].self_attn
            for head in range(2):  # every KV head's slow channel reads the massive channel ...
                row = head * HEAD_DIM + SLOW
                attn.k_proj.weight[row].zero_()
                attn.k_proj.weight[row, plants.massive_channel] = 0.2
            for qh in range(4):  # ... and every query points there
                attn.q_proj.bias[qh * HEAD_DIM + SLOW] = 35.0
    return model.eval(), tokenizer
