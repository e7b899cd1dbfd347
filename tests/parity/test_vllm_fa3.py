"""kveval's ``vllm_fp8_fa3`` (FP8 E4M3 cache + ``query_fp8`` + ``fa3_fp8_attention``) against a reference
implementation of vLLM's FP8 cache on FlashAttention 3 (tests/parity/vllm_fa3_reference.py, written from
vllm-project/vllm 5704f34 and vllm-project/flash-attention 617264c), and its memory bill against both caches.

Numbers are compared on tiny random models: logits of the reference (prompt in one call, then one token per step)
against kveval's real cache decoded the same way and against one emulated pass. In float64 they agree to a few
ulps (the arithmetic is the same; only the order of the sums differs), while leaving out the query or P rounding
moves the logits by 1e-2: the comparison has teeth.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from twopaths import decoded_logits, emulated_logits
from vllm_fa3_reference import fa3_fp8_forward, quantize_query, reference_logits, write_cache

from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import POLICY_PRESETS, KVPolicy
from kveval.quant import QuantSpec, fake_quantize
from kveval.transforms import Fa3Fp8Attention, QueryFp8, TransformContext
from kveval.transforms.fa3_fp8_attention import fa3_fp8_attention

CTX = TransformContext(layer=0, head_dim=1)


def fa3_policy(block_n: int = 128, q_scale: float = 1.0, kv_scale: float = 1.0, **extra) -> KVPolicy:
    """``vllm_fp8_fa3`` with another tile width or static scales (``extra``: more policy keys)."""
    spec = {"preset": "fp8_e4m3", "static_scale": kv_scale}
    return KVPolicy.from_config({"key": spec, "value": spec, "prefill": "quantized", **extra,
                                 "transforms": [{"name": "query_fp8", "scale": q_scale},
                                                {"name": "fa3_fp8_attention", "block_n": block_n}]})


def plain_fp8_policy(kv_scale: float = 1.0) -> KVPolicy:
    """The same FP8 cache without the query and P rounding (``vllm_fp8`` with this scale)."""
    spec = {"preset": "fp8_e4m3", "static_scale": kv_scale}
    return KVPolicy.from_config({"key": spec, "value": spec, "prefill": "quantized"})


def token_ids(model, n: int = 60, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------- by hand
def test_the_preset_is_the_policy_tested_here():
    assert KVPolicy.preset("vllm_fp8_fa3") == KVPolicy.from_config(POLICY_PRESETS["vllm_fp8_fa3"][0],
                                                                   name="vllm_fp8_fa3")
    preset = KVPolicy.preset("vllm_fp8_fa3").to_config()
    assert preset.pop("designs") == ["gqa", "sliding", "chunked", "state"]  # PRESET_DESIGNS: no MLA, no sinks
    assert preset == fa3_policy().to_config()
    assert "vllm@5704f34" in POLICY_PRESETS["vllm_fp8_fa3"][1]


def test_query_and_cache_writes_by_hand():
    """vLLM's query cast (x * (1/q_scale), clamp to 448, e4m3 to nearest even) and cache write (x / scale,
    saturating): 0.3 -> 0.3125 (steps of 1/32 in [0.25, 0.5)), 1000 -> 448, 0.001 -> 2^-9 and 2^-10 -> 0 (a half
    subnormal step, to even); kveval's query hook and fp8_e4m3 spec give the same values."""
    x = torch.tensor([0.3, 1000.0, -1000.0, 0.001, 2.0**-10], dtype=torch.float64)
    expected = [0.3125, 448.0, -448.0, 2.0**-9, 0.0]
    assert quantize_query(x, 1.0).to(torch.float64).tolist() == expected
    assert QueryFp8().query(x.reshape(1, 1, 1, 5), CTX).flatten().tolist() == expected
    # scale 0.5: codes of 2x, read back times 0.5: 0.3 -> 0.6 -> 0.625 (steps of 1/16 in [0.5, 1)) -> 0.3125
    assert quantize_query(x[:1], 0.5).item() == 0.625
    assert QueryFp8(scale=0.5).query(x[:1].reshape(1, 1, 1, 1), CTX).item() == 0.3125
    assert write_cache(torch.tensor([500.0, -0.3]), 1.0).to(torch.float32).tolist() == [448.0, -0.3125]
    spec = QuantSpec(format="fp8_e4m3", granularity="tensor", scale_dtype="float32", static_scale=1.0)
    assert fake_quantize(torch.tensor([[[[500.0, -0.3]]]]), spec).flatten().tolist() == [448.0, -0.3125]


@pytest.mark.parametrize("block_n", [1, 3])
def test_fa3_softmax_by_hand(block_n):
    """One query, scores 0, -1, -0.5 in log2 units (softmax_scale = 1/log2 e), values one-hot. One tile of 3: P =
    2^8 · 2^s = [256, 128, 2^7.5 = 181.02 -> 176] (E4M3 steps of 16 in [128, 256)), divided by the sum of the
    unrounded P. Tiles of 1, from the last key: key 2 sets the max -0.5 (P 256), key 1 gets 2^7.5 -> 176, key 0
    raises the max to 0, so the earlier P and their sum are multiplied by 2^-0.5 (not re-rounded)."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, -1.0, -0.5], dtype=torch.float64).reshape(1, 1, 3, 1)
    v = torch.eye(3, dtype=torch.float64).reshape(1, 1, 3, 3)
    scale = 1 / math.log2(math.e)
    if block_n == 3:
        expected = torch.tensor([256.0, 128.0, 176.0], dtype=torch.float64) / (256 + 128 + 2**7.5)
    else:
        r = 2**-0.5
        expected = torch.tensor([256.0, 176 * r, 256 * r], dtype=torch.float64) / (256 + (256 + 2**7.5) * r)
    ref = fa3_fp8_forward(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
                          softmax_scale=scale, q_descale=1.0, k_descale=1.0, v_descale=1.0, block_n=block_n)
    ours = fa3_fp8_attention(q, k, v, torch.ones(1, 1, 1, 3, dtype=torch.bool), torch.arange(3), scale, block_n)
    torch.testing.assert_close(ref.flatten(), expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(ours.flatten(), expected, rtol=1e-15, atol=0)
    assert Fa3Fp8Attention(block_n).attention(q, k, v, torch.ones(1, 1, 1, 3, dtype=torch.bool), torch.arange(3),
                                              scale, CTX).flatten().tolist() == ours.flatten().tolist()


# ------------------------------------------------------------------------------------------ against the reference
# (model, block_n, q_scale, kv_scale, prompt): the preset; tiles of 16 over 60 tokens (running max across tiles);
# scales of 1/1000 (about 30 of 448: q and k saturate at 0.448 where the tiny model reaches 0.6)
CASES = [
    ("tiny_llama64", 128, 1.0, 1.0, 1),
    ("tiny_llama64", 128, 1.0, 1.0, 16),
    ("tiny_llama64", 16, 1.0, 1.0, 1),
    ("tiny_llama64", 16, 0.001, 0.001, 16),
    ("tiny_gemma3_64", 16, 1.0, 1.0, 16),
    ("tiny_gemma3_64", 16, 0.001, 0.001, 1),
]


@pytest.mark.parametrize("fixture, block_n, q_scale, kv_scale, prompt", CASES)
def test_the_same_logits_as_the_reference_float64(fixture, block_n, q_scale, kv_scale, prompt, request):
    """Real cache and emulation against the reference, float64: measured at most 9e-16 apart (a float64 ulp of
    the sums' order), where the same FP8 cache without the query and P rounding is 1e-2 to 0.35 away. Gemma3's
    sliding-window layers (window 8) check the tiles of a windowed, evicting layer too."""
    model, _ = request.getfixturevalue(fixture)
    ids = token_ids(model)
    policy = fa3_policy(block_n, q_scale, kv_scale)
    ref, _ = reference_logits(model, ids, prompt, block_n=block_n, q_scale=q_scale, k_scale=kv_scale,
                              v_scale=kv_scale)
    decoded = decoded_logits(model, ids[None], policy, prompt)[0][0]
    emulated = emulated_logits(model, ids[None], policy, prompt if prompt > 1 else 0)[0]
    plain = decoded_logits(model, ids[None], plain_fp8_policy(kv_scale), prompt)[0][0]
    assert (plain - ref).abs().max() > 5e-3, "without the query and P rounding the logits must move"
    torch.testing.assert_close(decoded, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(emulated, ref, rtol=0, atol=1e-12)


def test_the_tile_width_matters(tiny_llama64):
    """Tiles of 16 against tiles of 128 (one tile for 60 tokens): measured 3.7e-3 apart, 10^12 times the agreement
    above: the reference and kveval agree on where the running max changes, not only on a one-tile softmax."""
    model, _ = tiny_llama64
    ids = token_ids(model)
    ref, _ = reference_logits(model, ids, 1, block_n=128)
    decoded = decoded_logits(model, ids[None], fa3_policy(16), 1)[0][0]
    assert (decoded - ref).abs().max() > 1e-4


def test_float32_within_float_noise(tiny_llama):
    """float32: the P roundings can differ where a float32 P falls on the other side of an E4M3 tie; measured at
    most 3e-7 apart (the FP8 effect: 1e-2)."""
    model, _ = tiny_llama
    ids = token_ids(model)
    ref, _ = reference_logits(model, ids, 1, block_n=16)
    policy = fa3_policy(16)
    decoded = decoded_logits(model, ids[None], policy, 1)[0][0]
    emulated = emulated_logits(model, ids[None], policy)[0]
    torch.testing.assert_close(decoded, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(emulated, ref, rtol=0, atol=2e-6)


# ------------------------------------------------------------------------------------- emulation = real cache
@pytest.mark.parametrize("fixture", ["tiny_llama64", "tiny_gemma3_64"])
@pytest.mark.parametrize("extra", [{}, {"residual": 8, "sink_tokens": 2}, {"residual": 8, "prefill": "fp"}])
@pytest.mark.parametrize("prompt", [1, 16])
def test_emulation_equals_real_cache_decoding(fixture, extra, prompt, request):
    """The preset (and with a full-precision window, sinks or an FP prefill, where emulation attends over
    ``[k ; k̂]`` and tells the attention hook each key's position) through both paths, float64, to 1e-9."""
    model, _ = request.getfixturevalue(fixture)
    ids = token_ids(model, 40, seed=1)[None]
    policy = fa3_policy(8, **extra)
    decoded, _ = decoded_logits(model, ids, policy, prompt)
    torch.testing.assert_close(emulated_logits(model, ids, policy, prompt if prompt > 1 else 0), decoded,
                               rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------------------------- memory
def test_the_bill_is_vllm_fp8s(tiny_llama):
    """Rounding the query and P stores nothing: the bill of vllm_fp8_fa3 is vllm_fp8's at every context, the real
    caches of both hold the same bytes as that bill after every step, and their codes are the reference's e4m3
    bytes (one per element)."""
    for context in (1, 512, 4096):
        arch = Arch.named("smollm2-135m")
        plain = kv_bytes(arch, "vllm_fp8", context)
        assert kv_bytes(arch, "vllm_fp8_fa3", context) == replace(plain, policy="vllm_fp8_fa3")
        assert plain.codes == 2 * 30 * 3 * context * 64  # one byte per element
    model, _ = tiny_llama
    arch = Arch.from_model(model)  # 4 layers, 2 KV heads, head_dim 32, float32
    ids = token_ids(model, 30)
    caches = {name: QuantizedKVCache(model, KVPolicy.preset(name)) for name in ("vllm_fp8", "vllm_fp8_fa3")}
    _, ref_cache = reference_logits(model, ids, 10)
    with torch.no_grad():
        for t in range(10, 31):
            step = ids[None, :10] if t == 10 else ids[None, t - 1 : t]
            for cache in caches.values():
                model(step, use_cache=True, **cache_kwargs(model, cache))
            bill = kv_bytes(arch, "vllm_fp8_fa3", t, fp_bytes=4)
            held = {k: v for k, v in caches["vllm_fp8_fa3"].nbytes().items() if k != "outliers"}
            assert held == {k: v for k, v in caches["vllm_fp8"].nbytes().items() if k != "outliers"}
            assert held == {"codes": bill.codes, "scales": bill.scales, "residual": bill.residual,
                            "total": bill.total}, t
    assert caches["vllm_fp8_fa3"].nbytes()["codes"] == ref_cache.nbytes() == 2 * 4 * 2 * 30 * 32
