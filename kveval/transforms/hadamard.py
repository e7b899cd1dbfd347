"""Blocked Hadamard rotation of Q with K and of V with the attention output (llama.cpp's attention rotation).

``H_n`` is the normalised Sylvester-Hadamard matrix of order ``n`` (a power of two): ``H_1 = [1/sqrt(n)]``,
``H_2s = [[H_s, H_s], [H_s, -H_s]]``; symmetric and orthonormal, hence self-inverse (``H_n H_n = I``). A tensor
``x [batch, heads, T, head_dim]`` is rotated in consecutive groups of ``n`` channels along head_dim
(``y = blockdiag(H_n, ..., H_n) x``, n dividing head_dim, so no group crosses a head).

What llama.cpp does (``src/llama-kv-cache.cpp``: ``ggml_gen_hadamard``, the ``llama_kv_cache`` constructor,
``build_input_k_rot`` / ``build_input_v_rot``; ``src/llama-graph.cpp``: ``build_attn``), and this transform with
``block: 0``:

- keys: rotated only when the K cache type is quantized and ``head_dim % 64 == 0``; the block is the largest power
  of two >= 64 dividing head_dim (64 -> 64, 128 -> 128, 192 -> 64, 256 -> 256): ``llamacpp_block("key", d)``;
  the query is rotated with the same matrix (q·k unchanged) and the cache is never un-rotated;
- values: rotated only when the V cache type is quantized and ``head_dim % 64 == 0``, always in blocks of 64
  (``llamacpp_block("value", d)``); the attention output is rotated back with the same matrix;
- after RoPE, in llama.cpp's channel order (see ``gguf_order``), in float32; ``LLAMA_ATTN_ROT_DISABLE=1`` turns
  it off. Which of K and V is rotated follows the cache types, so a policy names it with ``on`` (``key``,
  ``value`` or ``both``: a K/V side whose spec is ``none``, llama.cpp's f16 cache, is not rotated by llama.cpp).

The cache stays rotated (``keeps_keys_transformed`` / ``keeps_values_transformed``): ``key_in(k) = Hk``,
``query(q) = Hq``, ``value_in(v) = Hv``, ``output(o') = Ho'``; ``key_out`` and ``value_out`` are the identity.
With ``block: 0`` and a head_dim that is not a multiple of 64 the transform is the identity, as in llama.cpp; an
explicit ``block`` must be a power of two dividing head_dim (else ValueError on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval.quant.rotation import is_power_of_two, rotate_blocks
from kveval.transforms.base import Kind, TransformContext
from kveval.transforms.registry import register
from kveval.transforms.rotation_base import RotationTransform

#: llama.cpp rotates only head dims that are multiples of this, and V always in blocks of this size
LLAMACPP_MIN_BLOCK = 64


def llamacpp_block(kind: Kind, head_dim: int) -> int:
    """llama.cpp's Hadamard block for keys (and queries) or values of a head_dim, 0 when it does not rotate
    (head_dim not a multiple of 64). Keys: the largest power of two >= 64 dividing head_dim (64 -> 64,
    128 -> 128, 192 -> 64); values: 64. (``build_input_k_rot`` / ``build_input_v_rot``, src/llama-kv-cache.cpp.)"""
    if head_dim <= 0 or head_dim % LLAMACPP_MIN_BLOCK:
        return 0
    if kind == "value":
        return LLAMACPP_MIN_BLOCK
    n = LLAMACPP_MIN_BLOCK
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


@register
@dataclass(frozen=True)
class Hadamard(RotationTransform):
    """Blocked Hadamard rotation kept in the cache (llama.cpp): ``on`` = ``key`` (Q with K), ``value`` (V with
    the output) or ``both``; ``block`` = the group size along head_dim (a power of two), 0 for llama.cpp's rule
    (``llamacpp_block``). Hooks see ``[batch, heads, T, head_dim]``."""

    name: ClassVar[str] = "hadamard"
    sides: ClassVar[tuple[str, ...]] = ("both", "key", "value")
    on: str = "both"
    block: int = 0

    def __post_init__(self) -> None:
        self.check_on()
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0 \
                or (self.block and not is_power_of_two(self.block)):
            raise ValueError(f"'block' must be 0 (llama.cpp's rule) or a power of two; got {self.block!r}")

    def block_for(self, kind: Kind, head_dim: int) -> int:
        """The block used on ``kind`` for a head_dim (0: no rotation)."""
        return self.block or llamacpp_block(kind, head_dim)

    def rotate(self, x: torch.Tensor, kind: Kind, ctx: TransformContext, back: bool = False) -> torch.Tensor:
        n = self.block_for(kind, x.shape[-1])
        return rotate_blocks(x, n) if n else x  # H symmetric and self-inverse: back is the same product


__all__ = ["Hadamard", "LLAMACPP_MIN_BLOCK", "llamacpp_block"]
