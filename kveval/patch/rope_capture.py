"""The rotary embedding each attention layer receives, captured for the K/V transforms that need it (pre-RoPE
keys: ``KVTransform.needs_rope``).

transformers' attention modules get ``position_embeddings = (cos, sin)`` ``[batch, T, head_dim]`` from the decoder
layer and hand only the rotated keys to the attention function and to the cache. ``track_rope(model)`` adds a
forward pre-hook to every attention module that keeps the latest ``(cos, sin)`` on the module (idempotent; the hook
holds no other state), and ``rope_of(module)`` reads it during the same forward call.
"""

from __future__ import annotations

import sys

import torch

from kveval.errors import KvevalError
from kveval.patch.attention import attention_modules

_ATTR = "_kveval_rope"
_HOOKED = "_kveval_rope_hooked"


def _capture(module, args, kwargs):
    pe = kwargs.get("position_embeddings")
    if pe is None and len(args) > 1:
        pe = args[1]
    setattr(module, _ATTR, pe)


def track_rope(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Install the capture hook on every attention module (once); returns the modules."""
    modules = attention_modules(model)
    for m in modules:
        if not getattr(m, _HOOKED, False):
            m.register_forward_pre_hook(_capture, with_kwargs=True)
            setattr(m, _HOOKED, True)
    return modules


def captured_rope(module: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cos, sin)`` of the current forward call when the layer received a full-dimension rotary embedding."""
    pe = getattr(module, _ATTR, None)
    if isinstance(pe, (tuple, list)) and len(pe) == 2 and pe[0].shape[-1] == head_dim:
        return pe[0], pe[1]
    return None


def rope_of(module: torch.nn.Module, head_dim: int, user: str = "pre_rope") -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[batch, T, head_dim]`` of the current forward call of ``module``; ``user`` (the transforms
    that need it) names the feature in the errors."""
    pe = getattr(module, _ATTR, None)
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2):
        raise KvevalError(
            f"{type(module).__name__}: no rotary position embeddings reached this layer; {user} needs a RoPE model"
        )
    cos, sin = pe
    if cos.shape[-1] != head_dim:
        raise KvevalError(f"{type(module).__name__}: rotary dimension {cos.shape[-1]} != head_dim {head_dim}; "
                          f"{user} supports full-dimension RoPE only")
    _check_rotate_half_form(module, cos, sin, user)
    return cos, sin


def rope_for(module: torch.nn.Module, head_dim: int, *quantizers) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rope_of(module)`` when one of the ``TensorQuantizer``s ``needs_rope``, else None (nothing read)."""
    users = [q.transforms for q in quantizers if q.needs_rope]
    if not users:
        return None
    names = sorted({t.name for chain in users for t in chain.transforms if t.needs_rope})
    return rope_of(module, head_dim, ", ".join(names))


def _check_rotate_half_form(module, cos: torch.Tensor, sin: torch.Tensor, user: str = "pre_rope") -> None:
    """Once per module: kveval's ``rotate`` must reproduce the model's own ``apply_rotary_pos_emb`` (models that
    interleave the pairs, or rotate differently, are refused instead of being inverted wrongly)."""
    if getattr(module, "_kveval_rope_checked", False):
        return
    from kveval.rope import rotate

    name = type(module).__name__
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise KvevalError(f"{name}: no apply_rotary_pos_emb found next to it; {user} cannot check this model's RoPE")
    c, s = cos[:1, :8], sin[:1, :8]
    x = torch.randn(1, 1, c.shape[1], c.shape[-1], generator=torch.Generator().manual_seed(0)).to(c)
    try:
        ref = fn(x, x, c, s)[1]
    except (TypeError, RuntimeError, ValueError):
        raise KvevalError(f"{name}: its apply_rotary_pos_emb has an unexpected form; {user} cannot invert it") from None
    if not torch.allclose(ref, rotate(x, c, s), rtol=1e-4, atol=1e-5):
        raise KvevalError(f"{name}: its rotary embedding is not the rotate-half form kveval inverts (interleaved?); "
                          f"{user} is not supported for this model")
    module._kveval_rope_checked = True
