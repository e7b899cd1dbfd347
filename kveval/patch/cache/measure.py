"""Measuring what the real cache holds: ``resident_nbytes`` (the bytes of the tensors a cache keeps alive, each
storage once), ``watch_peak`` (the largest of that plus what a call returns, over the calls) and ``state_nbytes``
(a linear-attention / Mamba layer's states)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kveval.patch.quantizers import TensorQuantizer
from kveval.policy import KVPolicy


def state_nbytes(layer) -> int:
    """Bytes of a linear-attention / Mamba layer's conv and recurrent states as held (0 for other layers)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return 0
    held = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in held if t is not None)


#: transformers' token counters of a cache layer (a 0-d integer tensor in LinearAttentionLayer since 5.25):
#: bookkeeping, neither K/V nor state, so ``resident_nbytes`` leaves them out as the bill does
_TOKEN_COUNTERS = frozenset({"cumulative_length", "cumulative_length_linear"})


def resident_nbytes(cache, exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the tensors ``cache`` holds between calls, each storage counted once (a view counts its whole
    storage: what keeping it keeps alive). Walks the cache's layers and their stores (or any tuple, list or dict of
    them); the model's modules and the quantizers (the policy's, not the cache's) are not counted, nor the
    storages of ``exclude`` (e.g. the model's own key/value tensors a call received), nor transformers' token
    counters (``_TOKEN_COUNTERS``)."""
    seen: dict[tuple, int] = {}
    visited: set[int] = set()

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[(st.data_ptr(), obj.device.type)] = st.nbytes()
            return
        if id(obj) in visited or isinstance(obj, torch.nn.Module | TensorQuantizer | KVPolicy | str | int | float):
            return
        visited.add(id(obj))
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("kveval.", "transformers.")):
            for name, v in vars(obj).items():
                if name not in _TOKEN_COUNTERS:
                    walk(v)

    walk(cache)
    for t in exclude:
        seen.pop((t.untyped_storage().data_ptr(), t.device.type), None)
    return sum(seen.values())


def watch_peak(cache) -> list[int]:
    """Wrap every layer's ``update`` of ``cache`` to record, at each call, what the cache holds plus what the call
    returned to attention (``resident_nbytes``; the call's inputs are the model's tensors, not the cache's: a fused
    QKV output holds Q too). Returns a one-element list holding the largest so far (bytes)."""
    peak = [0]
    for layer in cache.layers:
        if not hasattr(layer, "update"):
            continue

        def watched(*a, _update=layer.update, **kw):
            out = _update(*a, **kw)
            peak[0] = max(peak[0], resident_nbytes((cache, out), exclude=a[:2]))
            return out

        layer.update = watched
    return peak
