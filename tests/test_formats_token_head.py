"""vLLM's per-token-head KV cache formats (kveval/quant/formats/per_token_head.py): hand-computed codes, scales and
bytes for int8_per_token_head, fp8_per_token_head and int4_per_token_head (with its Hadamard rotation and the zero
point hidden in the scale's low mantissa bits), the rotation against the Sylvester definition, bad input, and on the
tiny model: float64 emulation equal to real-cache decoding and the memory bill equal to the cache."""

from __future__ import annotations

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.quant import dequantize, fake_quantize, packed_nbytes, preset, quantize
from kveval.quant.formats.per_token_head import (
    int4_pth_scale_word,
    int4_pth_unword,
    rht,
    rht_inverse,
    rht_signs,
)
from kveval.quant.rotation import walsh_hadamard


def _x(rows: list[list[float]], d: int) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (d - len(r)) for r in rows], dtype=torch.float32).reshape(1, 1, len(rows), d)


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


# ------------------------------------------------------------------------------------------------ INT8
def test_int8_rounds_half_away_from_zero():
    spec = preset("int8_per_token_head")
    # row 0: amax 127 -> s = 1: 2.5 -> 3, -2.5 -> -3, 0.4 -> 0, -0.5 -> -1, 126.5 -> 127 (RNE: 2, -2, 0, 0, 126);
    # row 1 all zero -> s = 1e-6 (the floor); row 2: amax 1e-5 -> 1e-5/127 < 1e-6 -> s = 1e-6, x / s = 10
    x = _x([[127, 2.5, -2.5, 0.4, -0.5, 126.5], [], [1e-5, -4e-6]], 16)
    qt = quantize(x, spec)
    assert qt.scale.dtype == torch.float32 and qt.scale.flatten().tolist() == [1.0, f32(1e-6), f32(1e-6)]
    assert qt.codes[0, 0, 0, :6].tolist() == [127, 3, -3, 0, -1, 127]
    assert (qt.codes[0, 0, 1] == 0).all() and qt.codes[0, 0, 2, :2].tolist() == [10, -4]
    assert dequantize(qt)[0, 0, 0, :6].tolist() == [127, 3, -3, 0, -1, 127]
    # the int8 bytes as they are (two's complement): -3 -> 0xFD
    assert spec.fmt.pack(qt.codes, spec)[0, 0, 0, :3].tolist() == [127, 3, 0xFD]
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 48, "scales": 12, "outliers": 0, "total": 60}
    assert torch.equal(fake_quantize(x, spec), dequantize(qt))


def test_int8_scale_is_amax_over_127_in_float32():
    spec = preset("int8_per_token_head")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 32, generator=g)
    qt = quantize(x, spec)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(qt.scale, torch.clamp(amax / 127.0, min=1e-6))
    y = x * (1.0 / qt.scale)
    want = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))  # half away from zero, no ties to even
    assert torch.equal(qt.codes.float(), want)


# ------------------------------------------------------------------------------------------------ FP8
def test_fp8_per_token_head():
    spec = preset("fp8_per_token_head")
    # amax 896 -> s = 2: 3.3 -> 1.65 -> E4M3 1.625 -> 3.25; 896 -> 448; amax 448 -> s = 1: 0.3 -> 0.3125 (0.28125
    # and 0.3125 around 0.3: nearer 0.3125); a zero row -> s = 1e-6
    x = _x([[896, 3.3, -1.0], [448, 0.3], []], 16)
    qt = quantize(x, spec)
    assert qt.scale.flatten().tolist() == [2.0, 1.0, f32(1e-6)]
    assert qt.codes.dtype == torch.float8_e4m3fn
    assert dequantize(qt)[0, 0, 0, :3].tolist() == [896, 3.25, -1.0]
    assert dequantize(qt)[0, 0, 1, :2].tolist() == [448, 0.3125]
    assert spec.fmt.pack(qt.codes, spec)[0, 0, 1, :2].tolist() == [0x7E, 0x2A]
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 48, "scales": 12, "outliers": 0, "total": 60}


# ------------------------------------------------------------------------------------------------ INT4 + RHT
def test_hadamard_is_sylvester_and_rht_inverts():
    for d in (2, 4, 32):
        h = walsh_hadamard(torch.eye(d, dtype=torch.float64))
        want = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(d)] for i in range(d)], dtype=torch.float64)
        assert torch.equal(h, want)
        s = rht_signs(d)
        assert set(s.tolist()) <= {-1.0, 1.0} and torch.equal(rht_signs(d), s)
        x = torch.randn(3, d, dtype=torch.float64)
        torch.testing.assert_close(rht_inverse(rht(x)), x, rtol=0, atol=1e-13)
        torch.testing.assert_close(rht(x), x * s.double() @ want.T, rtol=0, atol=1e-12)
    # the seed 0x9E3779B9 fixes the signs: the same draw as a fresh CPU generator with that seed
    gen = torch.Generator().manual_seed(0x9E3779B9)
    assert torch.equal(rht_signs(32), 2 * torch.bernoulli(torch.full((32,), 0.5), generator=gen) - 1)


def _rotated_row(y: list[float]) -> torch.Tensor:
    """x with rht(x) == y exactly (small dyadic numbers: the butterfly is exact)."""
    return rht_inverse(torch.tensor(y, dtype=torch.float32)).reshape(1, 1, 1, len(y))


def test_int4_zero_point_in_the_scale_bits():
    spec = preset("int4_per_token_head")
    # rotated row [15, 0, 7.5, 3]: min 0, max 15 -> s = 1, z = 0, codes [15, 0, 8 (7.5 half away), 3]
    x = _rotated_row([15, 0, 7.5, 3])
    assert rht(x).flatten().tolist() == [15, 0, 7.5, 3]
    qt = quantize(x, spec)
    assert qt.codes.flatten().tolist() == [15, 0, 8, 3]
    assert qt.scale.view(torch.int32).item() == 0x3F800000
    assert rht(dequantize(qt)).flatten().tolist() == [15, 0, 8, 3]
    # [-2, 1, 0.5, 13]: s = 1, z = round(2) = 2 in the low 4 bits, codes y + 2 = [0, 3, 3 (2.5 up), 15]
    qt = quantize(_rotated_row([-2, 1, 0.5, 13]), spec)
    assert qt.codes.flatten().tolist() == [0, 3, 3, 15]
    assert qt.scale.view(torch.int32).item() == 0x3F800002
    assert rht(dequantize(qt)).flatten().tolist() == [-2, 1, 1, 13]
    # [0, 0.5, 0.25, 1]: s = fp32(1/15) = 0x3D888889, stored 0x3D888880 | z (z = 0); the read uses the truncated s
    qt = quantize(_rotated_row([0, 0.5, 0.25, 1]), spec)
    word = qt.scale.view(torch.int32).item()
    assert word == 0x3D888880
    s_read = torch.tensor(word, dtype=torch.int32).view(torch.float32).item()
    assert s_read < f32(1 / 15)
    codes = qt.codes.flatten().tolist()
    # 1 / s = 14.999999 (s rounded up): 0.5 -> 7.4999996 -> 7 (not 8), 0.25 -> 3.75 -> 4, 1 -> 15
    assert codes == [0, 7, 4, 15]
    torch.testing.assert_close(rht(dequantize(qt)).flatten(), torch.tensor(codes, dtype=torch.float32) * s_read,
                               rtol=0, atol=1e-7)
    assert spec.fmt.pack(qt.codes, spec).flatten().tolist() == [0x70, 0xF4]


def test_int4_scale_word_round_trip():
    s = torch.tensor([1.0, 0.123456, 3e-5])
    z = torch.tensor([0.0, 7.0, 15.0])
    s2, z2 = int4_pth_unword(int4_pth_scale_word(s, z))
    assert z2.tolist() == z.tolist()
    assert torch.equal(s2.view(torch.int32), s.view(torch.int32) & -16)


def test_int4_bytes_and_fake_path():
    spec = preset("int4_per_token_head")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 5, 64, generator=g)
    qt = quantize(x, spec)
    assert torch.equal(fake_quantize(x, spec), dequantize(qt))
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 20 * 32, "scales": 20 * 4, "outliers": 0,
                                                           "total": 20 * 36}
    assert spec.bits_per_element(128) == 4.25
    # reconstruction error is bounded by half a step of each row, measured in the rotated domain
    y, yhat = rht(x), rht(dequantize(qt))
    step = (y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)) / 15
    assert ((yhat - y).abs() <= step * 0.5 + step * 1e-3 + 1e-6).all()


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("cfg, match", [
    ({"spec": {"preset": "int8_per_token_head", "granularity": "group", "group_size": 16}}, "granularity must be 'token'"),
    ({"spec": {"preset": "fp8_per_token_head", "scale_dtype": "float16"}}, "scale_dtype must be 'float32'"),
    ({"spec": {"preset": "int4_per_token_head", "zero_point": "float"}}, "zero_point must be 'int'"),
    ({"spec": {"preset": "int4_per_token_head", "mapping": "symmetric"}}, "mapping must be 'asymmetric'"),
    ({"spec": {"preset": "int8_per_token_head", "clip_ratio": 0.9}}, "no clip_ratio"),
])
def test_bad_specs_are_one_line_errors(cfg, match):
    with pytest.raises(KvevalError, match=match) as err:
        KVPolicy.from_config(cfg)
    assert "\n" not in str(err.value)


def test_int4_head_dim_must_be_a_power_of_two():
    with pytest.raises(KvevalError, match="head_dim must be a power of two; got 96") as err:
        KVPolicy.preset("vllm_int4_per_token_head").check_model(4, 96)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ end to end
POLICIES = ["vllm_int8_per_token_head", "vllm_fp8_per_token_head", "vllm_int4_per_token_head"]


@pytest.mark.parametrize("name", POLICIES)
def test_emulation_equals_real_cache_float64(tiny_llama64, name):
    model, _ = tiny_llama64
    ids = ids_for(model, 14)
    for policy, prefill in ((KVPolicy.preset(name), 5),
                            (KVPolicy.from_config({"preset": name, "residual": 3, "sink_tokens": 1}), 1)):
        emulated = emulated_logits(model, ids, policy, prefill_len=prefill)
        decoded = decoded_logits(model, ids, policy, prefill_len=prefill)[0]
        with torch.no_grad():
            baseline = model(ids).logits
        assert (emulated - baseline).abs().max() > 1e-6
        torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", POLICIES)
@torch.no_grad()
def test_real_cache_bytes_equal_the_bill(tiny_llama64, name):
    model, _ = tiny_llama64
    arch = Arch.from_model(model)
    policy = KVPolicy.from_config({"preset": name, "residual": 2, "sink_tokens": 1})
    ids = ids_for(model, 11, seed=1)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    for t in range(7, 12):
        model(ids[:, :7] if t == 7 else ids[:, t - 1 : t], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t, 1, fp_bytes=8)
        measured = cache.nbytes()
        assert {k: measured[k] for k in ("codes", "scales", "residual", "total")} == {
            "codes": bill.codes, "scales": bill.scales, "residual": bill.residual, "total": bill.total}, t
    rows = arch.layers * 2 * arch.kv_heads * (11 - 2 - 1)
    assert measured["scales"] == rows * 4  # one fp32 word per token and head (INT4: zero point inside)
