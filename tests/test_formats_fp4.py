"""FP4 microscaling formats (kveval/quant/formats/fp4.py): the E2M1, E4M3 and E8M0 encodings against references
written here from the specs (OCP Microscaling Formats v1.0; E4M3 "fn": bias 7, no Inf, S.1111.111 = NaN), crafted
blocks with known codes and bytes for mxfp4, fp4_mx_block16 (SGLang), nvfp4 and nvfp4_4over6 (vLLM), bad input,
and on the tiny model: float64 emulation equal to real-cache decoding and the memory bill equal to the cache."""

from __future__ import annotations

import math

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, dequantize, fake_quantize, packed_nbytes, preset, qparams_from_range, quantize
from kveval.quant.formats.fp4 import (
    e2m1_half_away_value,
    e2m1_half_up,
    e2m1_rne,
    e2m1_values,
    e4m3_rne,
    e4m3_to_float,
    pack_nibbles,
    unpack_nibbles,
)

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------------------------------------------ references
def e2m1_spec_value(code: int) -> float:
    """OCP E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m * 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def e4m3_spec_value(b: int) -> float:
    """E4M3 (fn): sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; S.1111.111 is NaN, no Inf."""
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return math.nan
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def nearest(a: float, grid: list[float], tie: str) -> int:
    """Index of the grid point nearest to a >= 0 (brute force); tie: 'even' (even index), 'up' (larger)."""
    d = [abs(a - g) for g in grid]
    best = min(d)
    idx = [i for i, v in enumerate(d) if v == best]
    if len(idx) == 1:
        return idx[0]
    return idx[1] if tie == "up" else next(i for i in idx if i % 2 == 0)


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def probes(points: list[float]) -> list[float]:
    """Each point, and the float32 neighbours just below and above it."""
    out = []
    for p in points:
        t = torch.tensor(p, dtype=torch.float32)
        out += [p, torch.nextafter(t, torch.tensor(-1e9)).item(), torch.nextafter(t, torch.tensor(1e9)).item()]
    return out


# ------------------------------------------------------------------------------------------------ encodings
def test_all_16_e2m1_codes():
    assert e2m1_values(torch.float64).tolist() == [e2m1_spec_value(c) for c in range(16)]
    assert [e2m1_spec_value(c) for c in range(8)] == MAGS
    assert math.copysign(1.0, e2m1_values()[8].item()) == -1.0  # code 8 is -0


def test_e2m1_round_to_nearest_even_with_saturation():
    mids = [(a + b) / 2 for a, b in zip(MAGS, MAGS[1:])]
    ys = probes(mids + MAGS[1:] + [6.5, 7.0, 8.0, 1e30]) + [0.0, 0.1, 0.26]
    for y in ys + [-v for v in ys]:
        got = int(e2m1_rne(torch.tensor([y], dtype=torch.float32))[0])
        a = min(abs(y), 6.0)
        want = nearest(a, MAGS, "even") | (8 if math.copysign(1.0, y) < 0 else 0)
        assert got == want, (y, got, want)
    # the worked ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 7 saturates to 6
    got = e2m1_rne(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -3.4]))
    assert got.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 13]
    assert e2m1_rne(torch.tensor([-0.0, -0.1, 0.0])).tolist() == [8, 8, 0]  # the sign of a zero result is kept


def test_e2m1_ties_up_and_away():
    mids = [(a + b) / 2 for a, b in zip(MAGS, MAGS[1:])]
    for y in probes(mids + [6.5, 9.0]):
        a = min(abs(y), 6.0)
        i = nearest(a, MAGS, "up")
        assert int(e2m1_half_up(torch.tensor([y]))[0]) == i
        assert int(e2m1_half_up(torch.tensor([-y]))[0]) == i | 8
        assert e2m1_half_away_value(torch.tensor([-y])).item() == -MAGS[i]
    assert e2m1_half_up(torch.tensor([0.25, 1.25, 5.0, -0.1, -0.0])).tolist() == [1, 3, 7, 8, 0]


def test_e2m1_roundings_equal_the_midpoint_rules_on_every_float_near_a_bound():
    """The three E2M1 roundings against their rules written out (one comparison per midpoint, ties as each system
    breaks them) on every float32 within 1e-3 of each midpoint and non-zero magnitude, both signs, tiny values,
    and 2M random values over [-8, 8]; float64 and bfloat16 inputs too."""
    mids = [(a + b) / 2 for a, b in zip(MAGS, MAGS[1:])]
    tie_up = [nearest(m, MAGS, "even") > i for i, m in enumerate(mids)]  # ties to even: up where the upper is even
    near = []
    for p in mids + MAGS[1:]:  # (every float near 0 would be a billion of them: the tiny ones are listed below)
        a, b = (torch.tensor(p + e, dtype=torch.float32).view(torch.int32).item() for e in (-1e-3, 1e-3))
        near.append(torch.arange(min(a, b), max(a, b) + 1, dtype=torch.int32).view(torch.float32))
    g = torch.Generator().manual_seed(0)
    y = torch.cat([*near, torch.rand(2_000_000, generator=g) * 16 - 8,
                   torch.tensor([0.0, 1e-45, 1e-38, 1e-30, 1e-3, 1e30])])
    y = torch.cat([y, -y])
    for x in (y, y.double(), y.bfloat16()):
        a = x.abs()
        rne = sum(((a >= m) if up else (a > m)).long() for m, up in zip(mids, tie_up))
        assert torch.equal(e2m1_rne(x), (rne | (torch.signbit(x).long() << 3)).to(torch.uint8))
        up = sum((a >= m).long() for m in mids)
        assert torch.equal(e2m1_half_up(x), (up | ((x < 0).long() << 3)).to(torch.uint8))
        away = torch.copysign(torch.tensor(MAGS, dtype=x.dtype)[up], x)
        assert torch.equal(e2m1_half_away_value(x), away) and e2m1_half_away_value(x).dtype == x.dtype
    assert sum(t.numel() for t in near) > 15 * 1000


def test_all_256_e4m3_codes():
    got = e4m3_to_float(torch.arange(256), torch.float64).tolist()
    for b in range(256):
        want = e4m3_spec_value(b)
        assert (math.isnan(got[b]) and math.isnan(want)) or got[b] == want, b
    assert e4m3_spec_value(0x7E) == 448.0 and e4m3_spec_value(0x01) == 2.0**-9


def test_e4m3_round_to_nearest_even_saturating():
    vals = [e4m3_spec_value(b) for b in range(0x7F)]  # 0 .. 448, increasing
    for i in range(len(vals) - 1):
        lo, hi = vals[i], vals[i + 1]
        mid = (lo + hi) / 2
        for y, want in ((mid, i if i % 2 == 0 else i + 1), (lo, i), (hi, i + 1)):
            assert int(e4m3_rne(torch.tensor([y], dtype=torch.float32)).view(torch.uint8)[0]) == want, (y, want)
        below, above = probes([mid])[1:]
        assert int(e4m3_rne(torch.tensor([below])).view(torch.uint8)[0]) == i
        assert int(e4m3_rne(torch.tensor([above])).view(torch.uint8)[0]) == i + 1
    # satfinite: anything above 448 stores 448 (0x7E); 2^-10 (half the smallest subnormal) ties to 0
    got = e4m3_rne(torch.tensor([464.0, 1e9, -1e9, 2.0**-10, 2.0**-10 * 1.0001])).view(torch.uint8).tolist()
    assert got == [0x7E, 0x7E, 0xFE, 0x00, 0x01]


def test_all_e8m0_scales():
    spec = preset("mxfp4")
    assert spec.scale_dtype == "e8m0"
    b = torch.arange(255, dtype=torch.uint8)
    got = b.view(torch.float8_e8m0fnu).to(torch.float64).tolist()
    assert got == [math.ldexp(1.0, int(v) - 127) for v in range(255)]


def test_nibble_packing_low_first():
    codes = torch.tensor([[7, 5, 4, 8, 0, 15]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x57, 0x84, 0xF0]]
    assert torch.equal(unpack_nibbles(packed), codes)


# ------------------------------------------------------------------------------------------------ MXFP4
def _row(values: list[float], d: int) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (d - len(values)), dtype=torch.float32)


def test_mxfp4_crafted_blocks():
    spec = preset("mxfp4")
    # block 0: max 7 -> E = floor(log2 7) - 2 = 0; block 1: max 0.75 -> E = -1 - 2 = -3 (scale 1/8);
    # block 2: max 8 -> E = 1; block 3: all zero -> E = -127 (byte 0)
    b0 = _row([7, 2.6, 2.5, -0.2, 0.25, -6.5], 32)
    b1 = _row([0.75, 0.1, -0.05], 32)
    b2 = _row([8, 5, -3], 32)
    b3 = _row([], 32)
    x = torch.cat([b0, b1, b2, b3]).reshape(1, 1, 1, 128)
    qt = quantize(x, spec)
    assert qt.scale.view(torch.uint8).flatten().tolist() == [127, 124, 128, 0]
    codes = qt.codes.reshape(4, 32)
    assert codes[0, :6].tolist() == [7, 5, 4, 8, 0, 15]  # 7 saturates to 6, 2.6 -> 3, 2.5 -> 2, -0.2 -> -0
    assert codes[1, :3].tolist() == [7, 2, 9]  # 6, 0.8 -> 1.0, -0.4 -> -0.5
    assert codes[2, :3].tolist() == [6, 4, 11]  # 4, 2.5 -> 2 (tie to even), -1.5
    assert (codes[3] == 0).all()
    xhat = dequantize(qt).reshape(4, 32)
    assert xhat[0, :6].tolist() == [6, 3, 2, 0, 0, -6]
    assert xhat[1, :3].tolist() == [0.75, 0.125, -0.0625]
    assert xhat[2, :3].tolist() == [8, 4, -3]
    row = spec.fmt.pack(qt.codes, spec)
    assert row.shape[-1] == 64 and row.flatten()[:3].tolist() == [0x57, 0x84, 0xF0]
    assert torch.equal(fake_quantize(x, spec), dequantize(qt))
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 64, "scales": 4, "outliers": 0, "total": 68}
    assert spec.bits_per_element(128) == 8 * 17 / 32


def test_mxfp4_matches_spec_reference_on_random_blocks():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 5, 64, generator=g) * torch.rand(2, 3, 5, 1, generator=g).mul(40).exp2().mul(1e-6))
    xhat = fake_quantize(x, preset("mxfp4")).reshape(-1, 32)
    for blk, got in zip(x.reshape(-1, 32).tolist(), xhat.tolist()):
        amax = max(abs(v) for v in blk)
        e = max(-127, math.frexp(amax)[1] - 1 - 2) if amax else -127
        want = [math.copysign(MAGS[nearest(min(abs(v) / 2.0**e, 6.0), MAGS, "even")], v) * 2.0**e for v in blk]
        assert got == [f32(w) for w in want]


# ------------------------------------------------------------------------------------------------ SGLang fp4_e2m1
def test_sglang_block16_crafted():
    spec = preset("fp4_mx_block16")
    # block 0: amax 3 -> 3/6 = 0.5 -> e = -1 (byte 126), y = 2x; block 1: amax 6 -> e = 0; block 2: amax 7 ->
    # 7/6 -> e = 1 (the scale never lets |y| pass 6); block 3: zero -> e = ceil(log2 1e-10) = -33 (byte 94)
    x = torch.cat([_row([3, 0.625, -0.125, 1.1], 16), _row([6, 5, -0.1, 0.25], 16), _row([7, 2.5], 16),
                   _row([], 16)]).reshape(1, 1, 1, 64)
    qt = quantize(x, spec)
    assert qt.scale.view(torch.uint8).flatten().tolist() == [126, 127, 128, 94]
    codes = qt.codes.reshape(4, 16)
    assert codes[0, :4].tolist() == [7, 3, 9, 4]  # 6, 1.25 -> 1.5 (tie up), -0.25 -> -0.5 (tie up), 2.2 -> 2
    assert codes[1, :4].tolist() == [7, 7, 8, 1]  # 6, 5 -> 6 (tie up), -0.1 -> -0, 0.25 -> 0.5
    assert codes[2, :2].tolist() == [6, 3]  # 3.5 -> 4 (tie up), 1.25 -> 1.5
    assert dequantize(qt).reshape(4, 16)[0, :4].tolist() == [3, 0.75, -0.25, 1.0]
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 32, "scales": 4, "outliers": 0, "total": 36}
    assert torch.equal(fake_quantize(x, spec), dequantize(qt))


def test_sglang_block16_matches_formula_on_random_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 7, 32, generator=g, dtype=torch.float64) * 3
    xhat = fake_quantize(x, preset("fp4_mx_block16")).reshape(-1, 16)
    for blk, got in zip(x.reshape(-1, 16).tolist(), xhat.tolist()):
        e = math.ceil(math.log2(max(max(abs(v) for v in blk) / 6, 1e-10)))
        want = [math.copysign(MAGS[nearest(abs(v) / 2.0**e, MAGS, "up")], v) * 2.0**e for v in blk]
        assert got == want


# ------------------------------------------------------------------------------------------------ NVFP4
def test_nvfp4_crafted_two_level():
    spec = preset("nvfp4")
    # block 0: amax 6 -> SF = e4m3(1) = 0x38, codes of x; block 1: amax 12 -> SF = 2 (0x40), codes of x/2
    x = torch.cat([_row([6, 3, -1.5, 0.25, 0.74], 16), _row([12, -12, 1], 16)]).reshape(1, 1, 1, 32)
    qt = quantize(x, spec)
    assert qt.scale.dtype == torch.float32 and qt.scale.flatten().tolist() == [1.0]
    e2 = (qt.codes & 0xF).reshape(2, 16)
    assert e2[0, :5].tolist() == [7, 5, 11, 0, 1] and e2[1, :3].tolist() == [7, 15, 1]
    assert ((qt.codes >> 4) & 0xFF).reshape(2, 16)[:, 0].tolist() == [0x38, 0x40]
    assert dequantize(qt).reshape(2, 16)[:, :3].tolist() == [[6, 3, -1.5], [12, -12, 1]]
    row = spec.fmt.pack(qt.codes, spec).flatten().tolist()
    assert len(row) == 18 and row[:3] == [0x57, 0x0B, 0x01] and row[8:10] == [0xF7, 0x01] and row[16:] == [0x38, 0x40]
    assert torch.equal(spec.fmt.unpack(spec.fmt.pack(qt.codes, spec), spec, 32), qt.codes)
    # the fp32 per-tensor scale is stored once per tensor: 18 bytes per row + 4
    assert qt.nbytes() == packed_nbytes(spec, x.shape) == {"codes": 18, "scales": 4, "outliers": 0, "total": 22}
    assert spec.bits_per_element(128) == 4.5


def test_nvfp4_global_scale_saturation_and_underflow():
    two = QuantSpec(format="nvfp4", bits=4, granularity="tensor", scale_dtype="float32", static_scale=2.0)
    # s_t = 2, g = 1/2: amax 6 -> SF = e4m3(0.5) = 0x30, multiplier rcp(0.5 * 2) = 1; x^ = value * 0.5 * 2
    qt = quantize(_row([6, 3], 16).reshape(1, 1, 1, 16), two)
    assert int(qt.codes[0, 0, 0, 0]) >> 4 == 0x30 and dequantize(qt).flatten()[:2].tolist() == [6, 3]
    spec = preset("nvfp4")
    # amax 3000: SF = e4m3(500) saturates to 448 (0x7E), 3000/448 = 6.7 saturates to 6: x^ = 2688.
    # amax 0.005: 0.005/6 < 2^-10 -> SF = 0, the block is 0; amax 0.006 -> SF = 2^-9 (0x01)
    x = torch.cat([_row([3000, 1000], 16), _row([0.005], 16), _row([0.006], 16)]).reshape(1, 1, 1, 48)
    qt = quantize(x, spec)
    assert ((qt.codes >> 4) & 0xFF).reshape(3, 16)[:, 0].tolist() == [0x7E, 0x00, 0x01]
    xhat = dequantize(qt).reshape(3, 16)
    assert xhat[0, :2].tolist() == [2688, 896] and xhat[1, 0].item() == 0
    assert xhat[2, 0].item() == 3 * 2.0**-9  # 0.006 * 512 = 3.07 -> 3


def test_nvfp4_calibrated_scale():
    spec = preset("nvfp4_tensor")
    qp = qparams_from_range(torch.tensor(-5376.0), torch.tensor(2688.0), spec)
    assert qp.scale.dtype == torch.float32 and qp.scale.flatten().tolist() == [2.0]  # amax / (6 * 448)
    x = _row([5376, -2688, 12], 16).reshape(1, 1, 1, 16)
    qt = quantize(x, spec, qp)
    assert int(qt.codes[0, 0, 0, 0]) >> 4 == 0x7E  # the calibrated amax lands on the largest E4M3 scale
    assert dequantize(qt).flatten()[:3].tolist() == [5376, -2688, 0]  # 12 / 896 = 0.013 -> 0


def test_nvfp4_4over6_picks_the_smaller_error():
    plain, fos = preset("nvfp4"), preset("nvfp4_4over6")
    # [4, 3]: max/6 gives SF = e4m3(0.667) = 0.6875 (0x33): 4 -> 4.125, 3 -> 2.75; max/4 gives SF = 1 (0x38): exact
    x = _row([4, 3], 16).reshape(1, 1, 1, 16)
    a, b = quantize(x, plain), quantize(x, fos)
    assert int(a.codes[0, 0, 0, 0]) >> 4 == 0x33 and (a.codes[0, 0, 0, :2] & 0xF).tolist() == [7, 6]
    assert dequantize(a).flatten()[:2].tolist() == [4.125, 2.75]
    assert int(b.codes[0, 0, 0, 0]) >> 4 == 0x38 and (b.codes[0, 0, 0, :2] & 0xF).tolist() == [6, 5]
    assert dequantize(b).flatten()[:2].tolist() == [4, 3]
    # [6, 5.9]: both candidates err by 0.1 on 5.9 only: a tie keeps max/6 (SF = 1)
    t = quantize(_row([6, 5.9], 16).reshape(1, 1, 1, 16), fos)
    assert int(t.codes[0, 0, 0, 0]) >> 4 == 0x38
    # on random rows 4-over-6 never does worse than plain NVFP4 per block (the error it minimises)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 9, 64, generator=g)
    ea = ((fake_quantize(x, plain) - x) ** 2).reshape(-1, 16).sum(-1)
    eb = ((fake_quantize(x, fos) - x) ** 2).reshape(-1, 16).sum(-1)
    assert (eb <= ea * (1 + 1e-5) + 1e-12).all() and (eb < ea).any()


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("cfg, match", [
    ({"spec": {"preset": "mxfp4", "group_size": 16}}, "group_size must be 32"),
    ({"spec": {"preset": "fp4_mx_block16", "group_size": 32}}, "group_size must be 16"),
    ({"spec": {"preset": "mxfp4", "scale_dtype": "float16"}}, "scale_dtype must be 'e8m0'"),
    ({"spec": {"preset": "int8", "scale_dtype": "e8m0"}}, "block-scale encoding"),
    ({"spec": {"preset": "nvfp4", "granularity": "group", "group_size": 16, "static_scale": None}},
     "granularity 'tensor' or 'head'"),
    ({"spec": {"preset": "nvfp4", "bits": 8}}, "bits must be 4"),
])
def test_bad_specs_are_one_line_errors(cfg, match):
    with pytest.raises(KvevalError, match=match) as err:
        KVPolicy.from_config(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, head_dim, match", [
    ("vllm_nvfp4", 40, "head_dim 40 is not a multiple of 16"),
    ("mxfp4", 48, "group_size 32 does not divide head_dim 48"),
    ("sglang_fp4_e2m1", 24, "group_size 16 does not divide head_dim 24"),
])
def test_head_dim_not_a_multiple_of_the_block(name, head_dim, match):
    with pytest.raises(KvevalError, match=match) as err:
        KVPolicy.preset(name).check_model(4, head_dim)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):
        packed_nbytes(KVPolicy.preset(name).key, (1, 1, 3, head_dim))


# ------------------------------------------------------------------------------------------------ end to end
POLICIES = ["vllm_nvfp4", "vllm_nvfp4_4over6", "sglang_fp4_e2m1", "mxfp4"]


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
    policy = KVPolicy.from_config({"preset": name, "residual": 2})
    ids = ids_for(model, 11, seed=1)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    for t in range(7, 12):
        model(ids[:, :7] if t == 7 else ids[:, t - 1 : t], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t, 1, fp_bytes=8)
        measured = cache.nbytes()
        assert {k: measured[k] for k in ("codes", "scales", "residual", "total")} == {
            "codes": bill.codes, "scales": bill.scales, "residual": bill.residual, "total": bill.total}, t
    if name.startswith("vllm_nvfp4"):  # one fp32 per-tensor scale per layer and K/V, counted once
        assert measured["scales"] == arch.layers * 2 * 4
        assert measured["codes"] == arch.layers * 2 * arch.kv_heads * (11 - 2) * (arch.head_dim // 2 + arch.head_dim // 16)
