"""Pre-RoPE keys (KVQuant): quantize keys before the rotary embedding and rotate them again on read.

``key_in(k) = unrotate(k, cos, sin)``, ``key_out(k̂) = rotate(k̂, cos, sin)`` with ``(cos, sin)`` ``[batch, T,
head_dim]`` of the keys' positions (``kveval.rope``; k ``[batch, kv_heads, T, head_dim]``). Values, queries and
outputs are untouched, and attention runs in the model's own domain: full-precision keys skip it. Calibrated
scales for the stored keys are the scales file's ``key_pre_rope`` kind.

``pre_rope: true`` in a policy puts this transform first in the policy's sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval.rope import rotate, unrotate
from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register


def _rope(ctx: TransformContext) -> tuple[torch.Tensor, torch.Tensor]:
    if ctx.rope is None:
        raise ValueError("pre_rope needs the rotary embedding (cos, sin) of the keys' positions")
    return ctx.rope


@register
@dataclass(frozen=True)
class PreRope(KVTransform):
    """Keys stored before RoPE: ``unrotate`` before quantization, ``rotate`` after dequantization."""

    name: ClassVar[str] = "pre_rope"
    needs_rope: ClassVar[bool] = True

    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return unrotate(k, *_rope(ctx))

    def key_out(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return rotate(k, *_rope(ctx))

    def scales_kind(self, kind: str) -> str | None:
        return "key_pre_rope" if kind == "key" else None
