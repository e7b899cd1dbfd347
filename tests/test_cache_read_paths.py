"""The real cache's two read paths (kveval.patch.cache, "Two read paths"): ``lean`` holds what its bill says,
``buffered`` also keeps every token's read-back value; both give the same logits, bit for bit (float64), for every
attention family, in a left-padded batch, with sinks, sliding windows and transforms."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.models import build_tiny_model
from kveval.models.builtin import TINY_FAMILIES
from kveval.patch import QuantizedKVCache, cache_kwargs, resident_nbytes, watch_peak
from kveval.patch.cache import LayerHoldings, QuantizedKVLayer
from kveval.policy import KVPolicy


def _policies() -> list[KVPolicy]:
    sinks = dataclasses.replace(KVPolicy.preset("int4_g32"), name="int4_g32_sinks", sink_tokens=2, residual=3)
    rot = KVPolicy.from_config({"spec": "int4_g32", "rotate": "hadamard"}, name="hadamard")
    pre = KVPolicy.from_config({"spec": "int4_g32", "pre_rope": True}, name="pre_rope")
    quantized = dataclasses.replace(KVPolicy.preset("vllm_fp8"), name="fp8_prefill_quantized", prefill="quantized")
    return [KVPolicy.preset(n) for n in ("int4_g32", "llamacpp_q4_0", "kivi2", "vllm_fp8_ds_mla")] + [
        sinks, rot, pre, quantized]


def _padded_batch(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 14 positions, the second and third left-padded by 3 and 6 (ids [3, 14], mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, model.config.vocab_size, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, model.config.pad_token_id), mask


def _generate(model, ids, mask, policy: KVPolicy, read: str):
    cache = QuantizedKVCache(model, policy, read=read)
    peak = watch_peak(cache)  # what the cache holds plus what each call hands attention
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=model.config.pad_token_id,
                         **cache_kwargs(model, cache))
    return torch.stack(out.scores), cache, peak[0]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_lean_equals_buffered_and_holds_its_bill(family):
    model = build_tiny_model(family, dtype="float64")
    ids, mask = _padded_batch(model)
    ran = 0
    for policy in _policies():
        try:
            QuantizedKVCache(model, policy)
        except KvevalError:
            continue  # refused for this design (tests/test_architectures.py checks the words)
        try:
            buffered, cb, _ = _generate(model, ids, mask, policy, "buffered")
        except KvevalError:
            continue  # refused at the first call (pre_rope on a model without full-dimension rotate-half RoPE)
        lean, cl, peak = _generate(model, ids, mask, policy, "lean")
        assert torch.equal(lean, buffered), (family, policy.name, float((lean - buffered).abs().max()))
        held = cl.nbytes()
        # pre-RoPE keys: the (cos, sin) of each held position besides the bill (the module docstring)
        rope = cl.rope_table_nbytes()
        for la in cl.layers:
            rope_table = LayerHoldings(la).rope if isinstance(la, QuantizedKVLayer) else None
            if rope_table is not None:  # exactly the held positions
                assert rope_table[0].shape[1] == la.get_seq_length() - la.evicted
        assert (rope > 0) == (policy.name == "pre_rope"), (family, policy.name)
        assert resident_nbytes(cl) == held["total"] + held.get("state", 0) + rope, (family, policy.name)
        assert cb.nbytes() == held  # the same bill: the buffered path's extra is not counted in it
        if held["codes"]:
            assert resident_nbytes(cb) > resident_nbytes(cl), (family, policy.name)
        # the peak: the bill plus at most one layer's transient history (K and V, in the model's dtype)
        arch = Arch.from_model(model)
        k_shape, v_shape = arch.kv_shapes(policy.mla)
        n = cl.get_seq_length()
        one_layer = 3 * n * 8 * (k_shape[0] * k_shape[1] + v_shape[0] * v_shape[1])
        raw = 2 if policy.name == "hadamard" else 1  # a transform domain: raw and read buffers
        assert peak <= held["total"] + held.get("state", 0) + rope + raw * one_layer, (family, policy.name, peak)
        ran += 1
    assert ran >= 4, (family, ran)


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-deepseek-v3", "tiny-falcon-h1"])
def test_lean_reads_through_the_native_kernel_give_the_eager_reads_logits_in_float32(family, monkeypatch,
                                                                                     native_answers):
    """In float32 the lean path reads integer codes through ``kveval.native`` (one pass): the same logits, bit for
    bit, as the same path reading them eagerly (``KVEVAL_NATIVE=0``), for per-group, per-token symmetric and
    KIVI-style (per-channel keys in token blocks, per-group values) codes; the kernel did the reading in the first
    and never in the second. (The float64 test above covers lean against buffered.)"""
    from kveval import native

    native.reset()
    if native.library() is None:
        pytest.skip("no C compiler: the lean path reads eagerly (the float64 test covers it)")
    model = build_tiny_model(family)
    ids, mask = _padded_batch(model)
    kivi_like = KVPolicy.from_config({"key": {"preset": "int2_channel", "group_size": 4}, "value": "int2_g32",
                                      "residual": 4, "residual_mode": {"key": "block", "value": "sliding_lag"}},
                                     name="kivi2_r4")  # KIVI-2 with a window short enough for 20 positions
    try:
        for policy in (KVPolicy.preset("int4_g32"), KVPolicy.preset("int8"), kivi_like):
            if policy is kivi_like and family == "tiny-deepseek-v3":
                continue  # refused on an MLA latent: keys and values share c_kv (tests/test_architectures.py)
            native_answers.clear()
            fast = _generate(model, ids, mask, policy, "lean")[0]
            assert native_answers and all(native_answers), (family, policy.name)
            with monkeypatch.context() as m:
                m.setenv("KVEVAL_NATIVE", "0")
                native.reset()
                native_answers.clear()
                eager = _generate(model, ids, mask, policy, "lean")[0]
                assert native_answers and not any(native_answers), (family, policy.name)
            native.reset()
            assert torch.equal(fast, eager), (family, policy.name, float((fast - eager).abs().max()))
    finally:
        native.reset()


def test_lean_cache_holds_its_bill_where_the_buffered_one_holds_more_than_a_dynamic_cache():
    """The pitfall the lean path removes (tiny-llama, float32, 200-token prompt + 56 new tokens, int4_g32)."""
    model = build_tiny_model("tiny-llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (1, 200), generator=g)
    held = {}
    for read in ("lean", "buffered", "dynamic"):
        cache = DynamicCache(config=model.config) if read == "dynamic" else QuantizedKVCache(
            model, KVPolicy.preset("int4_g32"), read=read)
        model.generate(ids, past_key_values=cache, max_new_tokens=56, min_new_tokens=56, do_sample=False,
                       pad_token_id=model.config.pad_token_id)
        held[read] = resident_nbytes(cache)
        if read != "dynamic":
            n = cache.get_seq_length()
            bill = kv_bytes(Arch.from_model(model), KVPolicy.preset("int4_g32"), n, fp_bytes=4, prompt=200)
            assert cache.nbytes()["total"] == bill.total
            if read == "lean":
                assert held[read] == bill.total
    assert held["lean"] * 4 < held["dynamic"] < held["buffered"], held


def test_lean_holds_its_bill_after_every_call(tiny_gemma3_64):
    """Token by token from a 3-token prompt to 60 tokens (sliding windows of 8, sinks, a residual window): after
    every call the lean cache holds exactly its bill, and its logits equal one emulated pass."""
    from twopaths import emulated_logits, ids_for

    model, _ = tiny_gemma3_64
    policy = KVPolicy.from_config({"key": "int4_g32", "value": "int8", "residual": 3, "sink_tokens": 2})
    arch = Arch.from_model(model)
    ids = ids_for(model, 60, seed=4)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    logits = []
    for start, stop in [(0, 3), *((t, t + 1) for t in range(3, 60))]:
        logits.append(model(ids[:, start:stop], use_cache=True, **kw).logits)
        bill = kv_bytes(arch, policy, stop, fp_bytes=8, prompt=3).total
        assert cache.nbytes()["total"] == bill == resident_nbytes(cache), stop
    emulated = emulated_logits(model, ids, policy, prefill_len=3)
    torch.testing.assert_close(torch.cat(logits, dim=1), emulated, rtol=0, atol=1e-12)


def test_unknown_read_path_is_one_line():
    model = build_tiny_model("tiny-llama")
    with pytest.raises(KvevalError, match="read must be one of lean, buffered; got 'fast'"):
        QuantizedKVCache(model, KVPolicy.preset("int4_g32"), read="fast")


def test_resident_bytes_count_a_view_by_its_storage():
    """A cache that keeps a slice of a big tensor keeps the whole tensor alive: resident_nbytes says so."""
    big = torch.zeros(1000)
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 10, 1), torch.zeros(1, 1, 10, 1), 0)
    assert resident_nbytes(cache) == 2 * 10 * 4
    cache.layers[0].keys = big[:10].view(1, 1, 10, 1)
    assert resident_nbytes(cache) == 1000 * 4 + 10 * 4


def test_a_reset_lean_cache_decodes_the_same_again():
    """Reusing one cache object after ``reset()`` (a careless caller's second prompt): the same logits, the same
    bill, nothing left of the first sequence."""
    model = build_tiny_model("tiny-gemma3", dtype="float64")
    ids, mask = _padded_batch(model)
    policy = KVPolicy.preset("int4_g32")
    cache = QuantizedKVCache(model, policy, left_padding=[0, 3, 6])
    kw = cache_kwargs(model, cache)
    runs = []
    for _ in range(2):
        with torch.no_grad():
            out = [model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True, **kw).logits]
            for t in range(9, 14):
                out.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], use_cache=True, **kw).logits)
        runs.append((torch.cat(out, 1), resident_nbytes(cache), cache.nbytes()["total"]))
        cache.reset()
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:] and runs[0][1] == runs[0][2]
    assert resident_nbytes(cache) == 0
