"""Sliding-window layers: the bill holds min(context, window) tokens in them, the real cache holds no more (its
nbytes equal the bill after every call), emulation still equals decoding, and full-attention models are
unchanged."""

from __future__ import annotations

import pytest
import torch
from twopaths import emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import MAX_CONTEXT, Arch, block_bytes, fp16_bytes, kv_bytes, max_context, token_split
from kveval.models import build_tiny_model, tiny_model_config
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy

WINDOW = 8  # tiny-gemma3: sliding window 8 on layers 0 and 2

POLICIES = {
    "int4_g32": {"spec": "int4_g32"},
    # residual 11 > window 8: full-precision tokens leave the window before they are quantized
    "residual_over_window": {"spec": "int4_g32", "residual": 11, "sink_tokens": 1},
    "sinks_mixed": {"key": "int4_g32", "value": "int8", "residual": 3, "sink_tokens": 2},
    # KIVI-like: per-channel key blocks of 4 tokens (dropped whole), values in a lagging window
    "channel_blocks": {"key": {"bits": 2, "granularity": "channel", "mapping": "asymmetric"}, "value": "int2_g32",
                       "residual": 4, "residual_mode": {"key": "block", "value": "sliding_lag"}},
    "channel_blocks_sinks": {"key": {"bits": 2, "granularity": "channel", "mapping": "asymmetric"},
                             "value": "int4_g32", "residual": 4, "sink_tokens": 3, "residual_mode": "block"},
    "prompt_block": {"key": "int2_g32", "value": "int4_g32", "residual": 4, "residual_mode": "prompt_block"},
}


@pytest.fixture(scope="module")
def gemma64():
    return build_tiny_model("tiny-gemma3", dtype="float64")


def test_arch_reads_layer_types():
    arch = Arch.from_model_config(tiny_model_config("tiny-gemma3"))
    assert (arch.sliding_window, arch.sliding_layers) == (8, (0, 2))
    assert [arch.window(i) for i in range(4)] == [8, None, 8, None]
    llama = Arch.from_model_config(tiny_model_config("tiny-llama"))
    assert (llama.sliding_window, llama.sliding_layers) == (None, ())


@pytest.mark.parametrize(("extra", "expected"), [
    ({"sliding_window": 4096}, (4096, (0, 1, 2))),  # Mistral v0.1 style: every layer slides
    ({"sliding_window": 4096, "use_sliding_window": False}, (None, ())),  # Qwen2 with the window off
    ({"sliding_window": None}, (None, ())),
    ({"sliding_window": 512, "layer_types": ["full_attention"] * 3}, (None, ())),
    ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     (512, (0, 2))),
])
def test_arch_sliding_from_config_dicts(extra, expected):
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **extra}
    arch = Arch.from_model_config(cfg)
    assert (arch.sliding_window, arch.sliding_layers) == expected


def test_token_split_worked_examples():
    block = KVPolicy.from_config({"key": {"bits": 2, "granularity": "channel"}, "value": "int8", "residual": 4,
                                  "residual_mode": "block"})
    # docstring example: positions 7..12 held; quantized end 12; 7 lies in the block [4, 8): [4, 12) stored
    assert token_split(block, 13, "key", window=6, block=4) == (1, 8)
    # token-local statistics: exactly the window's positions
    assert token_split(block, 13, "key", window=6) == (1, 5)
    sliding = KVPolicy.from_config({"spec": "int8", "residual": 3, "sink_tokens": 2})
    # n = 20, window 8: positions 12..19; sinks gone, quantized [12, 17), residual [17, 20)
    assert token_split(sliding, 20, window=8) == (3, 5)
    # n = 9, window 8: positions 1..8; sink 1 held, quantized [2, 6), residual [6, 9)
    assert token_split(sliding, 9, window=8) == (4, 4)
    # residual longer than the window: all held tokens are full precision
    wide = KVPolicy.from_config({"spec": "int8", "residual": 11})
    assert token_split(wide, 30, window=8) == (8, 0)
    # no window: unchanged
    assert token_split(sliding, 20) == (5, 15)


def test_bill_caps_sliding_layers_and_leaves_full_models_alone():
    gemma = Arch.from_model_config(tiny_model_config("tiny-gemma3"))
    H, D = gemma.kv_heads, gemma.head_dim
    for n in (3, 8, 100):
        rows = 2 * min(n, WINDOW) + 2 * n  # layers 0 and 2 slide, 1 and 3 keep everything
        assert fp16_bytes(gemma, n) == 2 * rows * H * D * 2
        assert kv_bytes(gemma, "fp16", n).total == fp16_bytes(gemma, n)
        # int8 per token: 1 byte per element + one fp16 scale per token row and head (the default int8 spec)
        bill = kv_bytes(gemma, "int8", n)
        per_layer = [k.total + v.total for k, v in bill.per_layer]
        assert per_layer[0] == per_layer[2] == kv_bytes(gemma, "int8", min(n, WINDOW)).per_layer[1][0].total * 2
        assert per_layer[1] == per_layer[3]
    llama = Arch.from_model_config(tiny_model_config("tiny-llama"))
    assert fp16_bytes(llama, 100) == 2 * 4 * 100 * llama.kv_heads * llama.head_dim * 2
    assert kv_bytes(llama, "int4_g32", 100).to_dict()["sliding_layers"] == []


def test_all_sliding_layers_capacity_and_blocks():
    arch = Arch(layers=2, kv_heads=2, head_dim=32, sliding_window=16, sliding_layers=(0, 1))
    assert max_context(arch, "fp16", gpu_memory=2**20) == MAX_CONTEXT  # the bill stops growing at the window
    mixed = Arch(layers=2, kv_heads=2, head_dim=32, sliding_window=16, sliding_layers=(0,))
    full_one = Arch(layers=1, kv_heads=2, head_dim=32)
    assert block_bytes(mixed, "int8") == block_bytes(full_one, "int8")  # only full layers grow per block


def test_bad_sliding_arch_is_one_line():
    with pytest.raises(KvevalError, match="outside the model's 2 layers"):
        Arch(layers=2, kv_heads=2, head_dim=32, sliding_window=16, sliding_layers=(0, 5))
    with pytest.raises(KvevalError, match="without a sliding window"):
        Arch(layers=2, kv_heads=2, head_dim=32, sliding_layers=(0,))


def test_channel_blocks_longer_than_the_window_are_refused(gemma64):
    kivi = KVPolicy.preset("kivi2")  # per-channel key blocks of 128 tokens > window 8
    with pytest.raises(KvevalError, match="longer than the 8-token sliding window of layer 0"):
        kv_bytes(Arch.from_model(gemma64), kivi, 100)
    with pytest.raises(KvevalError, match="longer than the 8-token sliding window"):
        QuantizedKVCache(gemma64, kivi)


def _held_tokens(layer) -> int:
    return layer.n_stored - layer.evicted


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("prompt", [1, 5, 12])
def test_cache_holds_the_bill_after_every_call_and_decodes_as_emulated(gemma64, name, prompt):
    """Per call: the real cache's bytes equal the bill (per layer), sliding layers hold at most the window;
    at the end, token-by-token decoding equals one emulated pass (float64)."""
    policy = KVPolicy.from_config(POLICIES[name])
    arch = Arch.from_model(gemma64)
    ids = ids_for(gemma64, 30)
    cache = QuantizedKVCache(gemma64, policy)
    kw = cache_kwargs(gemma64, cache)
    logits = []
    with torch.no_grad():
        for start, stop in [(0, prompt), *((t, t + 1) for t in range(prompt, ids.shape[1]))]:
            logits.append(gemma64(ids[:, start:stop], use_cache=True, **kw).logits)
            bill = kv_bytes(arch, policy, stop, fp_bytes=8, prompt=prompt)
            for i, layer in enumerate(cache.layers):
                held = layer.nbytes()
                want = bill.per_layer[i][0] + bill.per_layer[i][1]
                assert (held["codes"], held["scales"], held["residual"]) == (want.codes, want.scales, want.residual), \
                    (i, stop)
                assert _held_tokens(layer) == (min(stop, WINDOW) if i in (0, 2) else stop)
            assert cache.nbytes()["total"] == bill.total
    decoded = torch.cat(logits, dim=1)
    emulated = emulated_logits(gemma64, ids, policy, prefill_len=0 if prompt == 1 else prompt)
    torch.testing.assert_close(decoded, emulated, rtol=0, atol=1e-12)


def test_generate_with_a_sliding_window_cache(gemma64):
    """model.generate through the cache: the sliding layers end at the window, greedy tokens equal the emulated
    model's argmax continuation."""
    policy = KVPolicy.from_config({"spec": "int4_g32", "residual": 2})
    ids = ids_for(gemma64, 6)
    cache = QuantizedKVCache(gemma64, policy)
    out = gemma64.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == 18
    assert [_held_tokens(la) for la in cache.layers] == [WINDOW, 17, WINDOW, 17]
    emulated = emulated_logits(gemma64, out[:, :-1], policy, prefill_len=6)
    assert torch.equal(emulated[0, 5:].argmax(-1), out[0, 6:])


def test_full_attention_model_cache_keeps_everything():
    llama = build_tiny_model("tiny-llama", dtype="float64")
    policy = KVPolicy.from_config({"spec": "int4_g32", "residual": 3})
    ids = ids_for(llama, 20)
    cache = QuantizedKVCache(llama, policy)
    with torch.no_grad():
        llama(ids, use_cache=True, **cache_kwargs(llama, cache))
    assert [_held_tokens(la) for la in cache.layers] == [20] * 4
    assert cache.nbytes()["total"] == kv_bytes(Arch.from_model(llama), policy, 20, fp_bytes=8).total


def test_mistral_style_window_on_every_layer():
    """A config with ``sliding_window`` and no ``layer_types`` (Mistral): every layer slides, in the bill and in
    the cache, and decoding still equals emulation."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MistralForCausalLM(config).to(torch.float64).eval()
    arch = Arch.from_model(model)
    assert (arch.sliding_window, arch.sliding_layers) == (6, (0, 1))
    policy = KVPolicy.from_config({"key": {"bits": 4, "granularity": "group", "group_size": 16}, "value": "int8", "residual": 2, "sink_tokens": 1})
    ids = ids_for(model, 20)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        decoded = torch.cat([model(ids[:, t : t + 1], use_cache=True, **kw).logits for t in range(20)], dim=1)
    assert [_held_tokens(la) for la in cache.layers] == [6, 6]
    assert cache.nbytes()["total"] == kv_bytes(arch, policy, 20, fp_bytes=8, prompt=1).total
    torch.testing.assert_close(decoded, emulated_logits(model, ids, policy), rtol=0, atol=1e-12)


def test_skip_sliding_keeps_sliding_layers_in_full_precision(gemma64):
    """``skip_sliding: true`` (vLLM ``--kv-cache-dtype-skip-layers sliding_window``): the sliding-window layers hold
    full-precision K/V in the bill and in the real cache, the others are quantized; emulation == decoding."""
    policy = KVPolicy.from_config({"spec": "int4_g32", "skip_sliding": True})
    assert KVPolicy.from_config(policy.to_config()) == policy
    arch = Arch.from_model(gemma64)
    bill = kv_bytes(arch, policy, 30, fp_bytes=8)
    plain = kv_bytes(arch, KVPolicy.from_config({"spec": "int4_g32"}), 30, fp_bytes=8)
    for i, (k, v) in enumerate(bill.per_layer):
        if i in (0, 2):  # 8 held tokens x 2 heads x 32 dims x 8 bytes (float64), K and V
            assert (k.codes, k.residual, v.residual) == (0, 8 * 2 * 32 * 8, 8 * 2 * 32 * 8)
        else:
            assert (k, v) == plain.per_layer[i]
    ids = ids_for(gemma64, 30)
    cache = QuantizedKVCache(gemma64, policy)
    kw = cache_kwargs(gemma64, cache)
    with torch.no_grad():
        decoded = torch.cat([gemma64(ids[:, t : t + 1], use_cache=True, **kw).logits for t in range(30)], dim=1)
    assert cache.nbytes()["total"] == bill.total
    torch.testing.assert_close(decoded, emulated_logits(gemma64, ids, policy), rtol=0, atol=1e-12)
    assert not torch.allclose(decoded, emulated_logits(gemma64, ids, KVPolicy.from_config({"spec": "int4_g32"})))


def test_skip_sliding_needs_the_model_and_a_boolean():
    policy = KVPolicy.from_config({"spec": "int8", "skip_sliding": True})
    with pytest.raises(KvevalError, match="skip_sliding needs the model's sliding-window layers"):
        policy.specs_for_layer(0, 4)
    assert policy.specs_for_layer(1, 4, sliding_layers=(0, 2))[0].format != "none"
    assert policy.specs_for_layer(2, 4, sliding_layers=(0, 2))[0].is_none
    with pytest.raises(KvevalError, match=r"skip_sliding: expected true or false, got 'yes'"):
        KVPolicy.from_config({"spec": "int8", "skip_sliding": "yes"})
