"""The memory bill: published golden figures, hand-computed cases, capacity, paging, the JSON schema, bad input,
and (integration) the real quantized cache's measured bytes == the bill, to the byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kveval.commands.memory import memory_command, render_table, resolve_arch
from kveval.errors import KvevalError
from kveval.memory import Arch, block_bytes, fp16_bytes, kv_bytes, max_batch, max_context, paging
from kveval.memory.rows import memory_json, memory_rows, policy_memory_fields
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec
from kveval.units import parse_size

KiB, MiB, GiB = 2**10, 2**20, 2**30

# The published figures' conventions: symmetric, float32 scales, no zero point.
INT8_TENSOR = QuantSpec(format="int", bits=8, granularity="tensor", scale_dtype="float32", static_scale=1.0)
INT4_G64 = QuantSpec(format="int", bits=4, granularity="group", group_size=64, scale_dtype="float32")
INT4_G128 = QuantSpec(format="int", bits=4, granularity="group", group_size=128, scale_dtype="float32")


def both(spec: QuantSpec, name: str) -> KVPolicy:
    return KVPolicy(name=name, key=spec, value=spec)


MHA, GQA4 = Arch.named("llama-7b-mha"), Arch.named("llama-7b-gqa4")


# ------------------------------------------------------------------------------------------- golden figures


@pytest.mark.parametrize("arch, context, policy, expected", [
    (MHA, 2048, "fp16", 1 * GiB),
    (MHA, 2048, both(INT8_TENSOR, "int8_tensor"), 512 * MiB + 256),
    (MHA, 2048, both(INT4_G64, "int4_g64"), 288 * MiB),
    (MHA, 2048, both(INT4_G128, "int4_g128"), 272 * MiB),
    (GQA4, 2048, "fp16", 128 * MiB),
    (GQA4, 2048, both(INT8_TENSOR, "int8_tensor"), 64 * MiB + 256),
    (GQA4, 2048, both(INT4_G64, "int4_g64"), 36 * MiB),
    (MHA, 32768, "fp16", 16 * GiB),
    (MHA, 32768, both(INT8_TENSOR, "int8_tensor"), 8 * GiB + 256),
    (MHA, 32768, both(INT4_G64, "int4_g64"), 4 * GiB + 512 * MiB),
])
def test_published_figures(arch, context, policy, expected):
    bill = kv_bytes(arch, policy, context, batch=1)
    assert bill.total == expected
    assert bill.total == bill.codes + bill.scales + bill.residual
    assert bill.residual == 0 or policy == "fp16"


def test_published_figures_fp16_matches_helper():
    assert fp16_bytes(MHA, 2048) == 1 * GiB == kv_bytes(MHA, "fp16", 2048).residual
    assert fp16_bytes(GQA4, 2048, batch=4) == 512 * MiB


def test_published_k4_g64_v8_tensor():
    bill = kv_bytes(MHA, KVPolicy(name="k4v8", key=INT4_G64, value=INT8_TENSOR), 2048)
    assert bill.codes == 384 * MiB
    assert bill.key.scales == 16 * MiB
    assert bill.value.scales == 128  # 32 layers x one float32 scale
    assert bill.total == 384 * MiB + 16 * MiB + 128
    assert bill.key.codes == 128 * MiB and bill.value.codes == 256 * MiB


def test_int8_tensor_scale_is_per_layer_not_per_token_or_sequence():
    # one scale per layer for K and for V, whatever the context and the batch
    for context, batch in ((1, 1), (2048, 1), (4096, 8)):
        assert kv_bytes(MHA, both(INT8_TENSOR, "t"), context, batch).scales == 256
    head = QuantSpec(format="int", bits=8, granularity="head", scale_dtype="float32", static_scale=1.0)
    assert kv_bytes(GQA4, both(head, "h"), 2048).scales == 32 * 2 * 4 * 4  # per layer, tensor, head


def test_int4_g64_fp16_scales_under_30_percent_of_fp16():
    for arch in (MHA, GQA4, Arch.named("smollm2-135m")):
        bill = kv_bytes(arch, "int4_g64", 2048)  # asymmetric, fp16 scale + fp16 min per 64
        assert bill.total <= 0.30 * fp16_bytes(arch, 2048)
        assert bill.bits_per_element == 4.5


# ------------------------------------------------------------------------------------------- by hand


def test_hand_computed_channel_keys_blocks_zero_points_residual_sinks():
    """2 layers, 2 KV heads, head_dim 8, batch 3, 45 tokens; 4 sinks, block residual 16.

    Quantized tokens: [4, 4 + floor(41 / 16) * 16) = [4, 36): 32; full precision: 4 sinks + 9 = 13.
    Keys INT2 per-channel, asymmetric, fp16 scale + uint8 zero point (3 B) per channel per head per 16-token block.
    Values INT4 g4 asymmetric, fp16 scale + fp16 min (4 B) per group of 4.
    B*H = 6 (sequence, head) pairs per tensor.
      K codes    6 * 32 * ceil(8*2/8) = 6 * 32 * 2 = 384
      K scales   6 * (32/16 = 2 blocks) * 8 channels * 3 B = 288
      V codes    6 * 32 * ceil(8*4/8) = 768
      V scales   6 * 32 tokens * (8/4 = 2 groups) * 4 B = 1536
      residual   6 * 13 * 8 * 2 B = 1248 for K and for V
    Layer 1 overrides values to `none`: 6 * 45 * 8 * 2 = 4320 of residual, no V codes/scales.
    """
    arch = Arch(layers=2, kv_heads=2, head_dim=8)
    k = QuantSpec(format="int", bits=2, mapping="asymmetric", granularity="channel", zero_point="int")
    v = QuantSpec(format="int", bits=4, mapping="asymmetric", granularity="group", group_size=4)
    policy = KVPolicy(name="hand", key=k, value=v, residual=16, residual_mode="block", sink_tokens=4)
    bill = kv_bytes(arch, policy, context=45, batch=3)
    assert (bill.quantized_tokens, bill.fp_tokens) == (32, 13)
    assert bill.key.codes == 2 * 384 and bill.key.scales == 2 * 288 and bill.key.residual == 2 * 1248
    assert bill.value.codes == 2 * 768 and bill.value.scales == 2 * 1536 and bill.value.residual == 2 * 1248
    assert bill.total == 2 * (384 + 288 + 1248 + 768 + 1536 + 1248) == 10944
    assert bill.bytes_per_token == 10944 / (3 * 45)

    mixed = KVPolicy.from_config({"key": k, "value": v, "residual": 16, "residual_mode": "block",
                                  "sink_tokens": 4, "layers": {"1": {"value": "none"}}}, name="mixed")
    m = kv_bytes(arch, mixed, context=45, batch=3)
    assert m.codes == 2 * 384 + 768 and m.scales == 2 * 288 + 1536
    assert m.residual == 3 * 1248 + 4320
    assert m.total == 11712
    (k0, v0), (k1, v1) = m.per_layer
    assert v1.codes == v1.scales == 0 and v1.residual == 4320 and k1 == k0

    # fp_bytes sizes every full-precision byte and nothing else
    b4 = kv_bytes(arch, policy, 45, 3, fp_bytes=4)
    assert b4.residual == 2 * bill.residual and b4.codes == bill.codes and b4.scales == bill.scales


def test_sliding_window_and_short_contexts():
    arch = Arch(layers=1, kv_heads=1, head_dim=64)
    pol = KVPolicy(name="s", key=INT4_G64, value=INT4_G64, residual=10, sink_tokens=3)
    # 12 tokens: quantized [3, max(12-10, 3)) is empty; all 12 full precision
    assert kv_bytes(arch, pol, 12).residual == 2 * 12 * 64 * 2 and kv_bytes(arch, pol, 12).codes == 0
    # 20 tokens: quantized [3, 10): 7 tokens of 32 B codes + one 4 B float32 scale (64 = head_dim), 13 full precision
    b = kv_bytes(arch, pol, 20)
    assert (b.codes, b.scales, b.residual) == (2 * 7 * 32, 2 * 7 * 4, 2 * 13 * 128)
    # a tensor scale is only stored once something is quantized
    t = KVPolicy(name="t", key=INT8_TENSOR, value=INT8_TENSOR, residual=10)
    assert kv_bytes(arch, t, 10).scales == 0 and kv_bytes(arch, t, 11).scales == 8


def test_kivi_amortised_channel_blocks():
    arch = Arch.named("smollm2-135m")
    # 2000 tokens: keys in 15 complete 128-token blocks (1920 tokens) quantized, 80 in the residual; values: all but
    # the newest 128 quantized (KIVI's sliding value window)
    b = kv_bytes(arch, "kivi2", 2000)
    assert (b.quantized_tokens, b.fp_tokens) == (1920, 80)
    assert b.value_tokens == (128, 1872)
    # keys: per group of 32 tokens per head per channel, fp16 scale + fp16 min = 4 B; 1920 / 32 = 60 groups
    assert b.key.scales == 30 * 3 * 60 * 64 * 4
    # values int2 g32: per token per head 2 groups * 4 B
    assert b.value.scales == 30 * 3 * 1872 * 2 * 4
    assert b.codes == 30 * 3 * (1920 + 1872) * 16
    assert b.residual == 30 * 3 * (80 + 128) * 64 * 2


# ------------------------------------------------------------------------------------------- capacity, paging


def test_max_batch_by_hand():
    weights = 6_738_415_616 * 2  # LLaMA-7B parameters in FP16
    budget = 80 * GiB - weights  # 72,422,514,688
    assert max_batch(MHA, "fp16", 2048, 80 * GiB) == budget // GiB == 67
    assert max_batch(MHA, both(INT4_G64, "g64"), 2048, 80 * GiB) == budget // (288 * MiB) == 239
    # given weights and activations
    assert max_batch(MHA, "fp16", 2048, 10 * GiB, model_bytes=2 * GiB, activation_bytes=1 * GiB) == 7
    assert max_batch(MHA, "fp16", 2048, 10 * GiB, model_bytes=2 * GiB, activation_bytes=1 * GiB + 1) == 6
    # an explicit shape has no parameter count: the whole GPU is for the cache
    assert max_batch(Arch(layers=32, kv_heads=32, head_dim=128), "fp16", 2048, 8 * GiB) == 8


def test_max_context_by_hand():
    budget = 80 * GiB - 6_738_415_616 * 2
    assert max_context(MHA, "fp16", 80 * GiB) == budget // (512 * KiB) == 138134
    assert max_context(MHA, "fp16", 80 * GiB, batch=4) == budget // (4 * 512 * KiB)
    ctx = max_context(MHA, both(INT8_TENSOR, "t"), 80 * GiB)
    assert kv_bytes(MHA, both(INT8_TENSOR, "t"), ctx).total <= budget < kv_bytes(MHA, both(INT8_TENSOR, "t"), ctx + 1).total
    assert max_context(MHA, "fp16", 14 * GiB) == (14 * GiB - 6_738_415_616 * 2) // (512 * KiB)


def test_paging_by_hand():
    p = paging(MHA, "fp16", 2050, batch=3, block_size=16)
    assert p.blocks_per_sequence == 129 and p.blocks == 387
    assert p.total == 3 * 129 * 16 * 512 * KiB
    assert p.waste == 3 * 14 * 512 * KiB
    assert p.block_bytes == 16 * 512 * KiB == 8 * MiB
    assert p.tokens_for(1 * GiB) == 128 * 16
    # INT4 g64 symmetric float32 scales: 32 layers * 2 * 32 heads * 16 tokens * (64 + 8) B
    assert block_bytes(MHA, both(INT4_G64, "g"), 16) == 2_359_296
    assert paging(MHA, both(INT4_G64, "g"), 2050).tokens_for(1 * GiB) == (GiB // 2_359_296) * 16
    # exact multiples waste nothing; a block of 32
    assert paging(MHA, "int8", 2048).waste == 0 and paging(MHA, "fp16", 2048, block_size=32).blocks == 64
    # kivi: per-channel key scales amortised over their 32-token group (fp16 scale + min per channel and head)
    kb = block_bytes(Arch(layers=1, kv_heads=1, head_dim=64), "kivi2", 16)
    assert kb == 16 * 16 + 64 * 4 * 16 / 32 + 16 * (16 + 2 * 4)


# ------------------------------------------------------------------------------------------- reports


ROW_KEYS = ["policy", "total", "codes", "scales", "residual", "bytes_per_token", "saving_vs_fp16", "max_batch",
            "blocks", "state"]


def test_json_schema():
    doc = memory_json(MHA, ["fp16", "int4_g64,kivi2"], context=2048, batch=2, gpu_memory="80GiB")
    assert list(doc) == ["arch", "context", "batch", "rows"]
    assert doc["arch"]["name"] == "llama-7b-mha" and doc["arch"]["layers"] == 32
    assert doc["context"] == 2048 and doc["batch"] == 2
    assert [r["policy"] for r in doc["rows"]] == ["fp16", "int4_g64", "kivi2"]
    for row in doc["rows"]:
        assert list(row) == ROW_KEYS
        assert all(isinstance(row[k], int) for k in ("total", "codes", "scales", "residual", "max_batch", "blocks"))
        assert row["total"] == row["codes"] + row["scales"] + row["residual"]
    fp16, g64 = doc["rows"][0], doc["rows"][1]
    assert fp16["total"] == 2 * GiB and fp16["saving_vs_fp16"] == 0 and fp16["max_batch"] == 67
    assert fp16["blocks"] == 2 * 128 and fp16["bytes_per_token"] == 512 * KiB
    assert g64["saving_vs_fp16"] == 1 - 4.5 / 16
    assert json.loads(json.dumps(doc)) == doc
    assert json.loads(memory_command(shape="llama-7b-mha", context=2048, batch=2, kv="fp16,int4_g64,kivi2",
                                     gpu_memory="80GiB", json_output=True)) == doc
    assert memory_rows(MHA, ["fp16"], 2048)[0]["max_batch"] is None


def test_table_and_text():
    rows = memory_rows(GQA4, ["fp16", "int8", "int4_g64"], 4096, gpu_memory="24GiB")
    table = render_table(rows)
    assert table.row_count == 3 and len(table.columns) == 7
    text = memory_command(shape="llama-7b-gqa4", context=4096, kv="fp16,int8,int4_g64", gpu_memory="24GiB")
    assert "int4_g64" in text and "max batch" in text and "llama-7b-gqa4" in text


def test_policy_memory_fields():
    f = policy_memory_fields(MHA, "int4_g64", 2048, gpu_memory=80 * GiB)
    assert list(f) == ["bytes_per_token", "compression_vs_fp16", "max_batch", "bits_per_element"]
    assert f["bytes_per_token"] == 512 * KiB * 4.5 / 16
    assert f["compression_vs_fp16"] == 16 / 4.5
    assert f["bits_per_element"] == 4.5
    assert f["max_batch"] == (80 * GiB - 6_738_415_616 * 2) // (288 * MiB)
    assert policy_memory_fields(MHA, "fp16", 2048)["max_batch"] is None
    assert policy_memory_fields(MHA, "fp16", 2048)["compression_vs_fp16"] == 1.0


def test_parse_size():
    assert parse_size("80GiB") == 80 * GiB
    assert parse_size("80 GB") == 80 * 10**9
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("4096") == 4096 == parse_size(4096)
    assert parse_size("24g") == 24 * GiB
    for bad in ("", "GiB", "80 gibibytes", "-1GiB", "0", "1e-9", "eighty", True):
        with pytest.raises(KvevalError):
            parse_size(bad)


def test_resolve_arch():
    assert resolve_arch(shape="llama-7b-gqa4") == GQA4
    assert resolve_arch(layers=2, kv_heads=3, head_dim=16) == Arch(layers=2, kv_heads=3, head_dim=16)
    smol = resolve_arch(model="builtin:smollm2-135m")
    assert (smol.layers, smol.kv_heads, smol.head_dim, smol.params) == (30, 3, 64, 134_515_008)
    tiny = resolve_arch(model="builtin:tiny-llama")
    assert (tiny.layers, tiny.kv_heads, tiny.head_dim) == (4, 2, 32)


def test_from_model_config():
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    a = Arch.from_model_config(cfg, name="smol")
    assert a == Arch(layers=30, kv_heads=3, head_dim=64, name="smol", params=134_515_008)
    mha = Arch.from_model_config({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
                                  "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False})
    assert (mha.kv_heads, mha.head_dim, mha.params) == (32, 128, 6_738_415_616)
    from kveval.models import tiny_model_config

    assert Arch.from_model_config(tiny_model_config("tiny-gemma3")).head_dim == 32


@pytest.mark.parametrize("call", [
    lambda: Arch.named("llama-70b"),
    lambda: resolve_arch(shape="llama-7b-mqa"),
    lambda: resolve_arch(),
    lambda: resolve_arch(shape="llama-7b-mha", layers=2),
    lambda: resolve_arch(layers=2, kv_heads=2),
    lambda: resolve_arch(layers=0, kv_heads=2, head_dim=64),
    lambda: resolve_arch(model="builtin:gpt-17"),
    lambda: resolve_arch(model="./no/such/folder"),
    lambda: Arch(layers=32, kv_heads=-1, head_dim=128),
    lambda: kv_bytes(Arch(layers=2, kv_heads=2, head_dim=48), "int4_g64", 100),  # 64 does not divide 48
    lambda: kv_bytes(Arch(layers=2, kv_heads=2, head_dim=48), "q4_0", 100),  # 32 does not divide 48
    lambda: kv_bytes(MHA, "int4_g64", 0),
    lambda: kv_bytes(MHA, "int4_g64", 2048, batch=-2),
    lambda: kv_bytes(MHA, "int5_g64", 2048),
    lambda: paging(MHA, "fp16", 2048, block_size=0),
    lambda: max_batch(MHA, "fp16", 2048, 8 * GiB),  # 12.55 GiB of weights
    lambda: max_context(MHA, "fp16", 8 * GiB),
    lambda: memory_rows(MHA, ["fp16"], 2048, gpu_memory="12GiB"),
    lambda: memory_command(shape="llama-7b-mha", context=2048, kv="int4_g64", gpu_memory="lots"),
    lambda: memory_command(shape="llama-7b-mha", context=2048, kv=","),
])
def test_bad_input_is_one_line(call):
    with pytest.raises(KvevalError) as exc:
        call()
    assert "\n" not in str(exc.value) and str(exc.value)


def test_memory_module_does_not_import_transformers():
    code = "import sys, kveval.memory, kveval.memory.rows, kveval.commands.memory; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------- vs the real cache


def _ids(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (1, n), generator=g)


def _measured(cache) -> dict:
    return {k: v for k, v in cache.nbytes().items() if k in ("codes", "scales", "residual", "total")}


def _billed(arch, policy, n, fp_bytes) -> dict:
    b = kv_bytes(arch, policy, n, 1, fp_bytes)
    return {"codes": b.codes, "scales": b.scales, "residual": b.residual, "total": b.total}


# name -> (policy, single-token steps after a 7-token prefill: enough to cross every window and block)
TINY_POLICIES = {
    "sliding_sinks_mixed": (KVPolicy.from_config({"key": "int4_g32", "value": "int8", "residual": 5, "sink_tokens": 2,
                                                 "layers": {"0": {"value": "none"}, "last 1": {"key": "int2_g32"}}}), 6),
    "kivi_block_sinks": (KVPolicy.from_config({"key": QuantSpec(format="int", bits=2, mapping="asymmetric",
                                                               granularity="channel", zero_point="int"),
                                              "value": "int2_g32", "residual": 8, "residual_mode": "block",
                                              "sink_tokens": 3}), 14),
    "fp8_token": (KVPolicy.preset("fp8_e4m3_token"), 3),
    "q5_1": (KVPolicy.preset("q5_1"), 3),
    # static per-tensor / per-head scales: the cache keeps one scale per layer (per head), as the bill counts
    "static_tensor_head": (KVPolicy(key=QuantSpec(format="fp8_e4m3", granularity="tensor", static_scale=0.05),
                                    value=QuantSpec(bits=8, granularity="head", scale_dtype="float32",
                                                    static_scale=0.01), residual=4), 6),
}


@pytest.mark.parametrize("name", list(TINY_POLICIES))
@torch.no_grad()
def test_real_cache_equals_bill_tiny(tiny_llama, name):
    """Step by step on the tiny model (float32 -> fp_bytes 4): a prefill of 7, then single-token steps."""
    model, _ = tiny_llama
    policy, steps = TINY_POLICIES[name]
    arch = Arch.from_model(model)
    n = 7 + steps
    ids = _ids(model.config.vocab_size, n)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    model(ids[:, :7], use_cache=True, **kw)
    assert _measured(cache) == _billed(arch, policy, 7, 4)
    for t in range(7, n):
        model(ids[:, t:t + 1], use_cache=True, **kw)
        assert _measured(cache) == _billed(arch, policy, t + 1, 4), t


REAL_CACHE_POLICIES = ["int8", "int4_g64", "kivi2", "q4_0"]


@pytest.fixture(scope="module")
def smollm_states(builtin_model):
    """One 2048-token prefill of the builtin model (float32) through a real int8 cache; returns (model, the int8
    cache, {layer: (keys, values)} exactly as the attention modules handed them to the cache).

    The other policies are fed these states through ``cache.update(k, v, layer)`` (the call the attention modules
    make), so the test costs one forward pass (~10 s on 2 cores) instead of one per policy and per decode step.
    """
    model, _ = builtin_model
    cache = QuantizedKVCache(model, KVPolicy.preset("int8"))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(cache.layers):
        def recording(k, v, *args, _update=layer.update, _i=i, **kwargs):
            seen[_i] = (k, v)
            return _update(k, v, *args, **kwargs)
        layer.update = recording
    with torch.no_grad():
        model(_ids(model.config.vocab_size, 2048), use_cache=True, **cache_kwargs(model, cache))
    assert sorted(seen) == list(range(len(cache.layers))) and seen[0][0].shape[-2] == 2048
    return model, cache, seen


@pytest.mark.integration
def test_real_cache_equals_bill_builtin(smollm_states):
    """SmolLM2-135M (float32: fp_bytes 4), 2048 tokens in one prefill: measured bytes == the bill, to the byte."""
    model, int8_cache, states = smollm_states
    arch = resolve_arch(model="builtin:smollm2-135m")
    assert Arch.from_model(model) == arch  # the hard-coded shape and parameter count are the model's
    assert _measured(int8_cache) == _billed(arch, "int8", 2048, 4)  # end to end through the model
    for name in REAL_CACHE_POLICIES[1:]:
        cache = QuantizedKVCache(model, KVPolicy.preset(name))
        for i, (k, v) in states.items():
            cache.update(k, v, i)
        assert _measured(cache) == _billed(arch, name, 2048, 4), name
        if name == "int4_g64":  # fp16 scale + min per 64: 4.5 bits per element
            assert cache.nbytes()["total"] <= 0.30 * fp16_bytes(arch, 2048)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["int4_g64", "kivi2"])
def test_real_cache_equals_bill_builtin_decode(smollm_states, name):
    """A prefill of 2000 then 48 single-token steps (kivi2: 1920 quantized + 80 in the residual after the prefill,
    the 16th block completes at 2048). The whole cache is compared after the prefill and at the end; every step
    is compared on the first and the last layer (each step re-reads the cache, ~0.5 s for all 30 layers)."""
    model, _, states = smollm_states
    arch = resolve_arch(model="builtin:smollm2-135m")
    policy = KVPolicy.preset(name)
    cache = QuantizedKVCache(model, policy)
    for i, (k, v) in states.items():
        cache.update(k[:, :, :2000], v[:, :, :2000], i)
    assert _measured(cache) == _billed(arch, policy, 2000, 4)
    watched = (0, arch.layers - 1)
    for t in range(2000, 2048):
        for i in watched:
            k, v = states[i]
            cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], i)
        bill = kv_bytes(arch, policy, t + 1, fp_bytes=4)
        for i in watched:
            kp, vp = bill.per_layer[i]
            expected = {"codes": kp.codes + vp.codes, "scales": kp.scales + vp.scales,
                        "residual": kp.residual + vp.residual, "total": kp.total + vp.total}
            assert cache.layers[i].nbytes() == expected, (t, i)
    for i, (k, v) in states.items():  # bring the other layers to 2048 in one update each
        if i not in watched:
            cache.update(k[:, :, 2000:], v[:, :, 2000:], i)
    if name == "kivi2":  # keys: 80 tokens in the residual; values: the newest 128
        assert kv_bytes(arch, policy, 2000, fp_bytes=4).residual == 30 * 3 * (80 + 128) * 64 * 4
    assert _measured(cache) == _billed(arch, policy, 2048, 4)
