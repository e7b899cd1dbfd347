"""When does a cached token become quantized: the one schedule (kveval/policy/masks.py) against a step-by-step
simulation written here by hand, and against what the real cache returns at each step.

The hand simulation follows the engines' code, not kveval's:
- sliding (llama.cpp, vLLM with R = 0; a sliding full-precision window otherwise): a step stores its token, moves
  every token older than the newest R (after the sinks) into quantized storage, then attention reads;
- sliding_lag (KIVI's values, jy-yuan/KIVI @876b4d2 ``models/llama_kivi.py``: ``value_states_full`` gets the new
  token, attention reads it, then ``if value_full_length > residual_length`` the oldest token is quantized; the
  prefill keeps the last R values in full precision): store, read, then quantize all but the newest R;
- block (KIVI's keys, same file: ``key_states_full`` gets the new token, the scores read it, then ``if
  key_states_full.shape[-2] == residual_length`` all R are quantized; the prefill quantizes the complete blocks):
  attention reads the residual in full precision, its own new token included; after the step, once R residual
  tokens have accumulated, they are quantized as one block;
- prompt_block (transformers 5.24 ``cache_utils.py`` ``QuantizedLayer.update``): the first call quantizes everything
  it stored and returns the originals; a later call returns dequantized + residual + new, then, if the residual
  (before the append) plus the new tokens reaches ``residual_length``, quantizes all of it, else appends.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.patch.cache import LayerHoldings
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec


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

    def flush_all():
        quantized.update(residual)
        residual.clear()

    calls = [list(range(prefill_len))] if prefill_len > 1 else []
    calls += [[t] for t in range(prefill_len if prefill_len > 1 else 0, T)]
    for i, call in enumerate(calls):
        held = len(residual)
        store(call)
        if mode == "sliding":
            flush_sliding()
            seen = set(quantized)
        else:
            seen = set(quantized)
            if mode == "sliding_lag":
                flush_sliding()
            elif mode == "block":
                flush_block()
            elif i == 0 or held + len(call) >= R:  # prompt_block: transformers' QuantizedLayer.update
                flush_all()
        for t in call:  # causal: query t reads tokens 0..t only
            is_prompt = len(call) > 1
            reads.append(set() if is_prompt and prefill == "fp" else {j for j in seen if j <= t})
    return reads


MODES = ["sliding", "sliding_lag", "block", "prompt_block"]
CASES = [(T, S, R, mode, P, pf)
         for T, (S, R), mode, (P, pf) in itertools.product(
             [13], [(0, 4), (2, 4), (1, 3), (0, 1), (3, 5)], MODES,
             [(0, "fp"), (5, "fp"), (5, "quantized"), (8, "quantized"), (2, "fp")])]


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


@pytest.mark.parametrize(("T", "S", "R", "key_mode", "value_mode", "P", "prefill"),
                         [(T, S, R, km, vm, P, pf) for T, (S, R), (km, vm), (P, pf) in itertools.product(
                             [13], [(0, 4), (2, 3), (1, 5)],
                             [("block", "sliding_lag"), ("prompt_block", "sliding"), ("sliding_lag", "block")],
                             [(0, "fp"), (6, "fp"), (6, "quantized")])])
def test_separate_key_and_value_schedules(T, S, R, key_mode, value_mode, P, prefill):
    """Keys and values on different schedules (KIVI: keys in blocks, values in a sliding window): each tensor's mask
    is its own schedule's replay."""
    policy = KVPolicy(key=KVPolicy.preset("int8").key, value=KVPolicy.preset("int8").value, residual=R,
                      residual_mode={"key": key_mode, "value": value_mode}, sink_tokens=S, prefill=prefill)
    assert policy.split_modes and policy.mode("key") == key_mode and policy.mode("value") == value_mode
    for kind, mode in (("key", key_mode), ("value", value_mode)):
        fp = policy.full_precision_mask(T, T, prefill_len=P, kind=kind)
        want = simulate(T, S, R, mode, P, prefill)
        for t in range(T):
            got = {j for j in range(t + 1) if not bool(fp[t, j])}
            assert got == want[t], f"{kind}s, query {t}: reads {sorted(got)} quantized, the schedule says {sorted(want[t])}"


def test_transformers_schedule_by_hand():
    """transformers' QuantizedCache with residual_length 4 and a 5-token prompt: the prompt queries read originals;
    tokens 0-4 are quantized at the end of the prompt call; queries 5-8 read 0-4 quantized and 5.. in full precision
    (query 8 completes the residual 5-8 and still reads it in full precision); query 9 reads 0-8 quantized."""
    policy = KVPolicy(key=KVPolicy.preset("int8").key, value=KVPolicy.preset("int8").value, residual=4,
                      residual_mode="prompt_block")
    fp = policy.full_precision_mask(11, 11, prefill_len=5)
    assert fp[:5, :5].all()
    assert not fp[5, :5].any() and fp[5, 5]
    assert not fp[8, :5].any() and fp[8, 5:9].all()
    assert not fp[9, :9].any() and fp[9, 9]
    # a 1-token prompt (every token decoded): token 0 is quantized after the first call, then blocks 1-4, 5-8, ...
    fp1 = policy.full_precision_mask(11, 11)
    assert fp1[0, 0] and not fp1[1, 0] and fp1[1, 1] and fp1[4, 1:5].all() and not fp1[5, :5].any()
    assert [policy.quantized_block_end(n, prompt=1) for n in (1, 4, 5, 8, 9)] == [1, 1, 5, 5, 9]
    assert [policy.quantized_block_end(n, prompt=5) for n in (5, 8, 9, 13)] == [5, 5, 9, 13]


def test_kivi_values_read_one_more_token_in_full_precision():
    """KIVI's values: the step appends its value, reads R + 1 in full precision, then quantizes the oldest one."""
    policy = KVPolicy(key=KVPolicy.preset("int8").key, value=KVPolicy.preset("int8").value, residual=3,
                      residual_mode="sliding_lag")
    fp = policy.full_precision_mask(8, 8)
    assert fp[5, 2:6].all() and not fp[5, :2].any()  # R + 1 = 4 tokens in full precision
    assert policy.quantized_block_end(6) == 3  # after the step: R = 3 in full precision


CACHE_CASES = [(0, 4, "block"), (2, 3, "block"), (1, 2, "sliding"), (0, 0, "sliding"), (0, 3, "sliding_lag"),
               (2, 2, "sliding_lag"), (0, 4, "prompt_block"), (1, 3, "prompt_block"),
               (0, 4, ("block", "sliding_lag")), (1, 3, ("prompt_block", "sliding"))]


@pytest.mark.parametrize(("S", "R", "mode"), CACHE_CASES)
@pytest.mark.parametrize("P", [0, 5])
def test_the_real_cache_returns_what_the_schedule_says(tiny_llama64, S, R, mode, P):
    """Decode through QuantizedKVCache (a prompt of P tokens in one call, then token by token) and record, per step,
    which returned keys and values of layer 0 differ from the full-precision ones (a token read quantized)."""
    model, _ = tiny_llama64
    modes = mode if isinstance(mode, tuple) else (mode, mode)
    policy = KVPolicy(key=KVPolicy.preset("int2_g32").key, value=KVPolicy.preset("int2_g32").value, residual=R,
                      residual_mode={"key": modes[0], "value": modes[1]}, sink_tokens=S, prefill="quantized")
    T = 11
    ids = torch.randint(4, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    calls = ([(0, P)] if P > 1 else []) + [(t, t + 1) for t in range(P if P > 1 else 0, T)]

    def record(c) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        original_update = c.layers[0].update

        def spy(key_states, value_states, *args, **kwargs):
            keys, values = original_update(key_states, value_states, *args, **kwargs)
            seen.append((keys.detach().clone(), values.detach().clone()))
            return keys, values

        c.layers[0].update = spy
        kw = cache_kwargs(model, c)
        with torch.no_grad():
            for a, b in calls:
                model(ids[:, a:b], use_cache=True, **kw)
        return seen

    seen = record(QuantizedKVCache(model, policy))
    fp_seen = record(QuantizedKVCache(model, KVPolicy.preset("fp16")))
    assert len(seen) == len(fp_seen) == len(calls)
    for i, kind, mode_ in ((0, "key", modes[0]), (1, "value", modes[1])):
        want = simulate(T, S, R, mode_, P, "quantized")
        for (a, b), got_x, fp_x in zip(calls, (s[i] for s in seen), (s[i] for s in fp_seen)):
            differs = (got_x - fp_x).abs().amax(dim=(0, 1, 3)) > 0
            for t in range(a, b):
                got = {j for j in range(t + 1) if bool(differs[j])}
                assert got == want[t], (f"{kind}s, query {t}: the cache returned {sorted(got)} quantized, the "
                                        f"schedule says {sorted(want[t])}")


# --- the two paths under the new schedules ------------------------------------------------------------------------
INT2_T4 = QuantSpec(bits=2, mapping="asymmetric", granularity="channel", group_size=4)  # KIVI keys, G = 4 tokens
INT2_G32 = QuantSpec(bits=2, mapping="asymmetric", granularity="group", group_size=32)
INT4_G32_MODEL = QuantSpec(bits=4, mapping="asymmetric", granularity="group", group_size=32, scale_dtype="model")
SCHEDULE_POLICIES = {
    "kivi_like": KVPolicy(key=INT2_T4, value=INT2_G32, residual=8,
                          residual_mode={"key": "block", "value": "sliding_lag"}),
    "kivi_like_sinks": KVPolicy(key=INT2_T4, value=INT2_G32, residual=8, sink_tokens=2,
                                residual_mode={"key": "block", "value": "sliding_lag"}),
    "transformers_like": KVPolicy(key=INT4_G32_MODEL, value=INT2_G32, residual=6, residual_mode="prompt_block"),
    "sliding_lag": KVPolicy(key=INT2_G32, value=INT2_G32, residual=5, residual_mode="sliding_lag"),
    "prompt_block_keys_sliding_values": KVPolicy(key=INT2_G32, value=INT2_G32, residual=4, sink_tokens=1,
                                                 residual_mode={"key": "prompt_block", "value": "sliding"}),
}


@pytest.mark.parametrize("name", list(SCHEDULE_POLICIES))
@pytest.mark.parametrize(("P", "prefill"), [(0, "fp"), (13, "fp"), (13, "quantized")])
@pytest.mark.parametrize("model_fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_emulation_equals_the_real_cache_under_every_schedule(name, P, prefill, model_fixture, request):
    """One emulated pass (with the 4-part attention when key and value masks differ) == decoding through the real
    cache, float64, to 1e-9."""
    model, _ = request.getfixturevalue(model_fixture)
    policy = replace(SCHEDULE_POLICIES[name], prefill=prefill)
    ids = ids_for(model, 40, seed=2)
    emulated = emulated_logits(model, ids, policy, prefill_len=P)
    decoded, cache = decoded_logits(model, ids, policy, prefill_len=max(P, 1))
    with torch.no_grad():
        baseline = model(ids).logits
    assert (emulated - baseline).abs().max() > 1e-6, "the policy must change something, or the test proves nothing"
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)
    layer = LayerHoldings(cache.layers[0])
    n = ids.shape[1]
    for kind in ("key", "value"):
        assert layer.quantized_end(kind) == policy.quantized_block_end(n, kind, prompt=max(P, 1)), kind


def test_channel_token_groups_statistics():
    """A channel spec with group_size 4 (tokens) takes min/max per channel over each 4 consecutive tokens: the
    scale has one row per group, and a group's reconstruction does not depend on the other groups."""
    from kveval.quant import fake_quantize, quantize

    x = torch.randn(1, 2, 12, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    qt = quantize(x, INT2_T4, channel_block=12)
    assert qt.scale.shape == (1, 2, 3, 1, 8)
    whole = fake_quantize(x, INT2_T4, channel_block=12)
    for g in range(3):
        part = fake_quantize(x[:, :, 4 * g:4 * g + 4], INT2_T4)
        assert torch.equal(whole[:, :, 4 * g:4 * g + 4], part)
    mn = x[:, :, 4:8].amin(dim=2)
    assert torch.allclose(qt.zero_point[:, :, 1, 0].double(), mn.half().double())


def test_channel_token_groups_must_tile_the_block():
    with pytest.raises(KvevalError, match="groups of 4 tokens must tile the 6-token blocks"):
        KVPolicy(key=INT2_T4, value=INT2_G32, residual=6, residual_mode="block")
    with pytest.raises(KvevalError, match="set residual_mode: block \\(for the keys\\)"):
        KVPolicy(key=INT2_T4, value=INT2_G32, residual=8, residual_mode={"key": "sliding_lag", "value": "block"})


def test_scale_dtype_model_follows_the_tensor():
    from kveval.quant import quantize

    for dtype, name in ((torch.float32, "float32"), (torch.float64, "float64"), (torch.float16, "float16")):
        x = torch.randn(1, 1, 3, 32, dtype=dtype)
        qt = quantize(x, INT4_G32_MODEL)
        assert qt.scale.dtype == dtype and qt.zero_point.dtype == dtype and qt.spec.scale_dtype == name


def test_per_tensor_modes_config_form():
    cfg = {"key": "int2_g32", "value": "int2_g32", "residual": 8, "residual_mode": {"key": "block", "value": "sliding_lag"}}
    p = KVPolicy.from_config(cfg, name="p")
    assert p.residual_mode == ("block", "sliding_lag") and p.split_modes
    assert p.to_config()["residual_mode"] == {"key": "block", "value": "sliding_lag"}
    assert KVPolicy.from_config(p.to_config(), name="p") == p
    assert "residual 8 (K block, V sliding_lag)" in p.describe()
    same = KVPolicy.from_config({**cfg, "residual_mode": {"key": "block", "value": "block"}})
    assert same.residual_mode == "block" and not same.split_modes
    with pytest.raises(KvevalError, match="exactly the keys 'key' and 'value'"):
        KVPolicy.from_config({**cfg, "residual_mode": {"key": "block"}})
    with pytest.raises(KvevalError, match="residual_mode must be one of"):
        KVPolicy.from_config({**cfg, "residual_mode": {"key": "block", "value": "windowed"}})
    with pytest.raises(KvevalError, match="name the kind"):
        p.full_precision_mask(4, 4)
