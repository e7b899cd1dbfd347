"""When does a cached token become quantized: the one schedule (kveval/policy/masks.py) against a step-by-step
simulation written here by hand, and against what the real cache returns at each step.

The hand simulation follows the engines' code, not kveval's:
- sliding (llama.cpp, vLLM with R = 0; a sliding full-precision window otherwise): a step stores its token, moves
  every token older than the newest R (after the sinks) into quantized storage, then attention reads;
- block (KIVI ``models/llama_kivi.py``, transformers ``QuantizedCache.update``): attention reads the residual in
  full precision, its own new token included; after the step, once R residual tokens have accumulated, they are
  quantized as one block.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy


def simulate(T: int, S: int, R: int, mode: str, prefill_len: int, prefill: str) -> list[set[int]]:
    """For each query position t: the set of tokens it reads quantized (a plain-Python replay of the steps)."""
    quantized: set[int] = set()
    residual: list[int] = []  # tokens after the sinks, not yet quantized, oldest first
    reads: list[set[int]] = []

    def store(tokens):
        for j in tokens:
            if j >= S:
                residual.append(j)

    def flush_sliding():
        while len(residual) > R:
            quantized.add(residual.pop(0))

    def flush_block():
        while len(residual) >= R:
            for _ in range(R):
                quantized.add(residual.pop(0))

    calls = [list(range(prefill_len))] if prefill_len > 1 else []
    calls += [[t] for t in range(prefill_len if prefill_len > 1 else 0, T)]
    for call in calls:
        store(call)
        if mode == "sliding":
            flush_sliding()
            seen = set(quantized)
        else:
            seen = set(quantized)
            flush_block()
        for t in call:  # causal: query t reads tokens 0..t only
            is_prompt = len(call) > 1
            reads.append(set() if is_prompt and prefill == "fp" else {j for j in seen if j <= t})
    return reads


CASES = [(T, S, R, mode, P, pf)
         for T, (S, R), mode, (P, pf) in itertools.product(
             [13], [(0, 4), (2, 4), (1, 3), (0, 1), (3, 5)], ["sliding", "block"],
             [(0, "fp"), (5, "fp"), (5, "quantized"), (8, "quantized")])]


@pytest.mark.parametrize(("T", "S", "R", "mode", "P", "prefill"), CASES)
def test_mask_matches_the_step_by_step_schedule(T, S, R, mode, P, prefill):
    policy = KVPolicy(key=KVPolicy.preset("int8").key, value=KVPolicy.preset("int8").value, residual=R,
                      residual_mode=mode, sink_tokens=S, prefill=prefill)
    fp = policy.full_precision_mask(T, T, prefill_len=P)
    want = simulate(T, S, R, mode, P, prefill)
    for t in range(T):
        got = {j for j in range(t + 1) if not bool(fp[t, j])}
        assert got == want[t], f"query {t}: reads {sorted(got)} quantized, the schedule says {sorted(want[t])}"


def test_the_completing_query_reads_its_block_in_full_precision():
    """The case the old schedule got wrong: R = 4, block, no sinks. Query 3 completes block 0-3 and reads it in full
    precision; query 4 reads it quantized."""
    policy = KVPolicy(key=KVPolicy.preset("int8").key, value=KVPolicy.preset("int8").value, residual=4,
                      residual_mode="block")
    fp = policy.full_precision_mask(6, 6)
    assert fp[3, :4].all()
    assert not fp[4, :4].any() and fp[4, 4]


@pytest.mark.parametrize(("S", "R", "mode"), [(0, 4, "block"), (2, 3, "block"), (1, 2, "sliding"), (0, 0, "sliding")])
def test_the_real_cache_returns_what_the_schedule_says(tiny_llama64, S, R, mode):
    """Decode token by token through QuantizedKVCache and record, per step, which returned keys of layer 0 differ
    from the full-precision ones (a token read quantized)."""
    model, _ = tiny_llama64
    policy = KVPolicy(key=KVPolicy.preset("int2_g32").key, value=KVPolicy.preset("int2_g32").value, residual=R,
                      residual_mode=mode, sink_tokens=S)
    T = 11
    ids = torch.randint(4, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[0].self_attn
    seen: list[torch.Tensor] = []
    cache = QuantizedKVCache(model, policy)
    original_update = cache.layers[0].update

    def spy(key_states, value_states, *args, **kwargs):
        keys, values = original_update(key_states, value_states, *args, **kwargs)
        seen.append(keys.detach().clone())
        return keys, values

    cache.layers[0].update = spy
    fp_cache = QuantizedKVCache(model, KVPolicy.preset("fp16"))
    fp_seen: list[torch.Tensor] = []
    fp_update = fp_cache.layers[0].update

    def fp_spy(key_states, value_states, *args, **kwargs):
        keys, values = fp_update(key_states, value_states, *args, **kwargs)
        fp_seen.append(keys.detach().clone())
        return keys, values

    fp_cache.layers[0].update = fp_spy
    with torch.no_grad():
        for c in (cache, fp_cache):
            kw = cache_kwargs(model, c)
            for t in range(T):
                model(ids[:, t : t + 1], use_cache=True, **kw)
    assert layer is not None and len(seen) == len(fp_seen) == T
    want = simulate(T, S, R, mode, 0, "fp")
    for t in range(T):
        differs = (seen[t] - fp_seen[t]).abs().amax(dim=(0, 1, 3)) > 0
        got = {j for j in range(t + 1) if bool(differs[j])}
        assert got == want[t], f"step {t}: the cache returned {sorted(got)} quantized, the schedule says {sorted(want[t])}"
