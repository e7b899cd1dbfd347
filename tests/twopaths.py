"""The two computation paths of the emulation contract, for tests: one emulated pass, and token-by-token decoding
through the real quantized cache. Imported by name (``from twopaths import ...``; tests/ is on sys.path through
conftest.py)."""

from __future__ import annotations

import torch

from kveval.patch import QuantizedKVCache, cache_kwargs, emulate
from kveval.policy import KVPolicy


def ids_for(model, n: int, seed: int = 0) -> torch.Tensor:
    """Random token ids ``[1, n]`` (ids >= 4, clear of special tokens), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.config.vocab_size, (1, n), generator=g)


@torch.no_grad()
def emulated_logits(model, ids: torch.Tensor, policy: KVPolicy, prefill_len: int = 0) -> torch.Tensor:
    """Logits ``[1, T, vocab]`` of one pass under ``emulate``."""
    with emulate(model, policy, prefill_len=prefill_len):
        return model(ids).logits


@torch.no_grad()
def decoded_logits(model, ids: torch.Tensor, policy: KVPolicy, prefill_len: int = 1):
    """Prefill ``prefill_len`` tokens at once, then one token per step through the real cache:
    (logits ``[1, T, vocab]``, the cache)."""
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    out = [model(ids[:, :prefill_len], use_cache=True, **kw).logits]
    for t in range(prefill_len, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], use_cache=True, **kw).logits)
    return torch.cat(out, dim=1), cache
