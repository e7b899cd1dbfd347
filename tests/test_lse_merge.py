"""The split chunks of the emulation (``kveval.patch.lse_merge``): the bulk of the keys every query of a chunk reads
quantized in one unmasked call, the rest in a masked one, merged by their log-sum-exp. The merge against one
softmax over the union, the log-sum-exp against its definition, and the emulation contract (float64, 1e-9
against token-by-token decoding through the real cache) with every chunk split, for the policies that keep
full-precision tokens (windows, blocks, sinks, an FP prefill, a session's later turns)."""

from dataclasses import replace

import pytest
import torch
from test_patch import POLICIES
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.patch import QuantizedKVCache, cache_kwargs, emulate, lse_merge
from kveval.policy import KVPolicy

FP_TOKENS = ["sliding_residual_sinks", "block_residual_sinks", "channel_block_kivi"]


def _reference(query, key, value, allowed, scale):
    """Softmax attention written out (repeat_kv, scores, -inf where not allowed): output and log-sum-exp."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_lse_gives_the_softmax_and_its_log_sum_exp(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 7, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 3, 11, 16, generator=g, dtype=dtype) for _ in range(2))
    allowed = torch.rand(7, 11, generator=g) < 0.6
    allowed[2] = False  # a row that reads no key of this part
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for mask in (None, allowed):
        out, lse = lse_merge.attention_lse(q, k, v, 0.3, mask)
        want, want_lse = _reference(q, k, v, mask, 0.3)
        rows = torch.ones(7, dtype=torch.bool) if mask is None else mask.any(dim=-1)
        torch.testing.assert_close(out[:, :, rows], want[:, :, rows], rtol=0, atol=tol)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=tol)  # -inf for the empty row
        if mask is not None:
            assert torch.isneginf(lse[:, :, 2]).all()


def test_merging_two_parts_is_the_softmax_over_their_union():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(5, 8, generator=g) < 0.5
    allowed[3] = False  # row 3 reads only the bulk
    bulk = lse_merge.attention_lse(q, k[:, :, :12], v[:, :, :12], None)
    rest = lse_merge.attention_lse(q, k[:, :, 12:], v[:, :, 12:], None, allowed)
    union = torch.cat([torch.ones(5, 12, dtype=torch.bool), allowed], dim=1)
    want, _ = _reference(q, k, v, union, 8 ** -0.5)
    torch.testing.assert_close(lse_merge.merged([bulk, rest]), want, rtol=0, atol=1e-13)


@pytest.fixture
def every_chunk_split(monkeypatch):
    """Chunks of 8 queries, split from a bulk of one token; counts the chunks that split."""
    monkeypatch.setattr(lse_merge, "BULK_MIN", 1)
    monkeypatch.setattr(lse_merge, "ROWS", 8)
    split = []
    real = lse_merge.split_chunk

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        split.append(out is not None)
        return out

    monkeypatch.setattr(lse_merge, "split_chunk", counting)
    return split


@pytest.mark.parametrize("prefill", ["fp", "quantized"])
@pytest.mark.parametrize("name", FP_TOKENS)
def test_split_chunks_keep_the_emulation_contract_float64(name, prefill, tiny_llama64, every_chunk_split):
    model, _ = tiny_llama64
    policy = replace(POLICIES[name], prefill=prefill)
    ids = ids_for(model, 60, seed=2)
    emulated = emulated_logits(model, ids, policy, prefill_len=13)
    assert sum(every_chunk_split) >= 8, every_chunk_split  # the path under test ran, in every layer
    decoded, _ = decoded_logits(model, ids, policy, prefill_len=13)
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)
    assert (emulated - model(ids).logits).abs().max() > 1e-6  # the policy changes something


def test_split_chunks_keep_a_sessions_later_turns_float64(tiny_llama64, every_chunk_split):
    """A session: a prompt, then turns fed as one call each (read in full precision by their own queries under
    ``prefill: fp``) between single decoded tokens."""
    model, _ = tiny_llama64
    policy = replace(POLICIES["sliding_residual_sinks"], prefill="fp")
    ids = ids_for(model, 64, seed=3)
    chunks = [(24, 31), (45, 52)]
    calls = [(0, 10)] + [(t, t + 1) for t in range(10, 24)] + [chunks[0]] + [(t, t + 1) for t in range(31, 45)] \
        + [chunks[1]] + [(t, t + 1) for t in range(52, 64)]
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        real = torch.cat([model(ids[:, a:b], use_cache=True, **kw).logits for a, b in calls], dim=1)
        with emulate(model, policy, prefill_len=10, chunks=chunks):
            emulated = model(ids).logits
    assert sum(every_chunk_split) >= 8
    torch.testing.assert_close(emulated, real, rtol=0, atol=1e-9)


def test_a_batch_splits_as_each_row_alone(tiny_llama64, every_chunk_split):
    model, _ = tiny_llama64
    policy = POLICIES["channel_block_kivi"]
    ids = torch.cat([ids_for(model, 48, seed=4), ids_for(model, 48, seed=5)])
    both = emulated_logits(model, ids, policy)
    for b in range(2):
        torch.testing.assert_close(both[b:b + 1], emulated_logits(model, ids[b:b + 1], policy), rtol=0, atol=1e-12)
    assert sum(every_chunk_split) >= 8


def test_the_default_split_equals_the_chunk_plans_float64(tiny_llama64, monkeypatch):
    """At the default sizes (a bulk of 1,024 tokens from the fifth chunk of 256 on), KIVI's own preset: the
    attention of a split pass equals the chunk plans' within float64 rounding, layer by layer."""
    model, _ = tiny_llama64
    policy = KVPolicy.preset("kivi2")
    ids = ids_for(model, 1800, seed=6)
    outputs: dict[str, list] = {"split": [], "plans": []}
    real = lse_merge.split_chunk
    split = []

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        split.append(out is not None)
        return out

    monkeypatch.setattr(lse_merge, "split_chunk", counting)
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(
            lambda _m, _a, out: outputs[mode].append(out[0].detach().clone())))
    try:
        for mode in ("split", "plans"):
            if mode == "plans":
                monkeypatch.setattr(lse_merge, "applies", lambda *a, **k: False)
            emulated_logits(model, ids, policy)
    finally:
        for h in hooks:
            h.remove()
    assert any(split) and not all(split)  # the late chunks split, the first ones keep their plans
    for a, b in zip(outputs["split"], outputs["plans"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert a.abs().max() > 0.01


@pytest.mark.parametrize("case", ["mask", "eager", "hook", "cuda", "value_width", "dropout", "softcap", "not_causal"])
def test_split_applies_only_where_the_plain_call_would_run(case, tiny_llama):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, _ = tiny_llama
    module = model.model.layers[0].self_attn
    q, k, v = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32), torch.zeros(1, 2, 8, 32)
    plain = dict(stock=sdpa_attention_forward, replaces_attention=False, module=module, query=q, key=k, value=v,
                 attention_mask=None, args=(), kwargs={"scaling": 0.2, "dropout": 0.0})
    assert lse_merge.applies(**plain)
    changed = {
        "mask": dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)),
        "eager": dict(stock=lambda *a, **k: None),
        "hook": dict(replaces_attention=True),
        "cuda": dict(query=torch.zeros(1, 4, 8, 32, device="meta")),
        "value_width": dict(value=torch.zeros(1, 2, 8, 16)),
        "dropout": dict(kwargs={"dropout": 0.1}),
        "softcap": dict(kwargs={"softcap": 30.0}),
        "not_causal": dict(kwargs={"is_causal": False}),
    }[case]
    assert not lse_merge.applies(**{**plain, **changed})
