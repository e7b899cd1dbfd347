"""Rotary position embedding (RoPE) as Llama-family models apply it, and its exact inverse (pure tensor maths).

transformers rotates ``x [batch, heads, T, head_dim]`` with ``cos, sin [batch, T, head_dim]`` as
``x·cos + rotate_half(x)·sin`` where ``rotate_half([x1, x2]) = [-x2, x1]`` (the two halves of head_dim). Per pair
``(x1_i, x2_i)`` this is a rotation by angle ``θ_i·t``; ``rotate_half`` is the 90° rotation J (J² = -1), so the
rotation is ``cos + J·sin`` and its inverse ``cos - J·sin``.

Some rotary variants (YaRN, longrope) scale cos and sin by a factor a (``attention_scaling``): then
``cos² + sin² = a²`` and the inverse divides by it. Half-precision inputs are rotated in float32 and cast back.

Pre-RoPE key quantization (KVQuant) stores ``Q(unrotate(k))`` and reads ``rotate(Q(unrotate(k)))``: the per-channel
statistics of pre-RoPE keys do not mix channels of different frequencies across positions. The ``pre_rope``
transform (``kveval.transforms.pre_rope``) applies exactly that through the K/V transform seam.
Worked (head_dim 2, θ·t = 90°: cos 0, sin 1): rotate([1, 0]) = [0, 1]; unrotate([0, 1]) = [1, 0].
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (split in two halves)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _broadcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos/sin ``[batch, T, head_dim]`` (or ``[T, head_dim]``) -> ``[batch, 1, T, head_dim]`` in ``dtype``."""
    if t.dim() == 2:
        t = t[None]
    return t[:, None].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x ``[batch, heads, T, head_dim]``, cos/sin ``[batch, T, head_dim]`` -> same shape as x."""
    cdt = _compute_dtype(x)
    c, s, xc = _broadcast(cos, cdt), _broadcast(sin, cdt), x.to(cdt)
    return (xc * c + rotate_half(xc) * s).to(x.dtype)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: ``unrotate(rotate(x, cos, sin), cos, sin) == x`` up to float rounding, also when cos and sin
    carry an attention scaling a (the result is divided by cos² + sin² = a²)."""
    cdt = _compute_dtype(x)
    c, s, xc = _broadcast(cos, cdt), _broadcast(sin, cdt), x.to(cdt)
    return ((xc * c - rotate_half(xc) * s) / (c * c + s * s)).to(x.dtype)
