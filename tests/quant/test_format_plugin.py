"""Quantizer formats as plug-ins: a toy format defined and registered HERE (kveval's source never names it) is
quantized, emulated, stored by the real cache and billed like the built-in ones; and every built-in format, through
one preset each, holds the same contracts (emulation == real-cache decoding, real cache bytes == memory bill).
"""

from __future__ import annotations

import pytest
import torch

from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs, decode_logits, emulate
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, dequantize, fake_quantize, pack, packed_nbytes, preset, preset_names, quantize
from kveval.quant.formats import QParams, QuantFormat, format_names, get_format, register_format, unregister_format
from kveval.quant.formats.base import store

TOY = "toy_sm3"


class SignMagnitude3(QuantFormat):
    """3-bit sign-magnitude codes with one float16 scale per token (granularity 'token', mapping 'symmetric').

    s = absmax / 3 (stored in float16), m = clamp(round(|x| / s), 0, 3), code = 4 * [x < 0 and m > 0] + m (uint8,
    0..7; the code 4, "-0", never occurs), x^ = (-1)^(code >> 2) * (code & 3) * s. A zero scale divides by 1.
    """

    name = TOY
    mappings = ("symmetric",)
    supports_static = False

    def validate(self, spec: QuantSpec) -> None:
        if spec.bits != 3:
            raise ValueError(f"QuantSpec.bits must be 3 for format {TOY!r}; got {spec.bits}")
        if spec.granularity != "token":
            raise ValueError(f"format {TOY!r} has one scale per token; got granularity {spec.granularity!r}")
        super().validate(spec)

    def code_bits(self, spec: QuantSpec) -> int:
        return 3

    def code_dtype(self, spec: QuantSpec) -> torch.dtype:
        return torch.uint8

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: QuantSpec) -> QParams:
        return QParams(store(torch.maximum(-mn, mx) / 3, torch.float16))

    def encode(self, xv, scale, zero_point, spec):
        m = (xv.abs() / torch.where(scale == 0, 1.0, scale)).round().clamp(0, 3)
        return (m + 4 * ((xv < 0) & (m > 0))).to(torch.uint8)

    def decode(self, codes, scale, zero_point, spec):
        c = codes.to(torch.int16)
        sign = 1 - 2 * ((c >> 2) & 1)
        return (c & 3).to(scale.dtype) * sign.to(scale.dtype) * scale


@pytest.fixture
def toy():
    """The toy format registered for one test and unregistered afterwards (other tests never see it)."""
    register_format(SignMagnitude3())
    try:
        yield QuantSpec(format=TOY, bits=3)
    finally:
        unregister_format(TOY)
    assert TOY not in format_names()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


# ----------------------------------------------------------------------------------------------- the registry
def test_unknown_format_is_one_line_listing_the_registered_ones():
    with pytest.raises(ValueError) as err:
        QuantSpec(format=TOY, bits=3)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("QuantSpec.format must be one of 'int', 'fp8_e4m3', 'fp8_e5m2', 'none'")
    assert TOY not in format_names()


def test_registered_format_is_accepted_and_asked(toy):
    assert TOY in format_names("format") and get_format(TOY).name == TOY
    assert toy.fmt is get_format(TOY) and not toy.is_none
    assert toy.code_bits == 3 and toy.bits_label == "3"
    assert toy.bits_per_element(32) == (12 + 2) * 8 / 32  # 12 bytes of codes + one fp16 scale per row of 32
    assert toy.describe() == "toy_sm3 sym token (fp16 scales)"
    assert QuantSpec.from_dict(toy.to_dict()) == toy
    assert not toy.calibratable
    with pytest.raises(ValueError, match=r"^QuantSpec.bits must be 3 for format 'toy_sm3'; got 4$"):
        QuantSpec(format=TOY, bits=4)
    with pytest.raises(ValueError, match="has one scale per token"):
        QuantSpec(format=TOY, bits=3, granularity="group", group_size=8)
    with pytest.raises(ValueError, match="already registered"):
        register_format(SignMagnitude3())


# ----------------------------------------------------------------------------------------------- the maths
def test_hand_computed_codes_and_fake_equals_quantize_dequantize(toy):
    # row 0: absmax 1.5 -> s = 0.5 (exact in fp16); |x|/s = [3, 1, 0, 2, 1.5, 3, 0.4, 2.4] -> m = [3, 1, 0, 2, 2
    # (half to even), 3, 0, 2]; signs of the non-zero m: -0.5, -1.0, -1.5 -> codes [3, 5, 0, 6, 2, 7, 0, 2]
    # (-0.2 rounds to m = 0: code 0, x^ = +0.0). Row 1 is all zero: s = 0, codes 0, x^ 0.
    x = torch.tensor([[1.5, -0.5, 0.0, -1.0, 0.75, -1.5, -0.2, 1.2], [0.0] * 8]).reshape(1, 1, 2, 8)
    qt = quantize(x, toy)
    assert qt.codes.dtype == torch.uint8
    assert qt.codes.flatten().tolist() == [3, 5, 0, 6, 2, 7, 0, 2] + [0] * 8
    assert qt.scale.dtype == torch.float16 and qt.scale.flatten().tolist() == [0.5, 0.0]
    assert qt.scale.shape == (1, 1, 2, 1) and qt.zero_point is None
    xhat = dequantize(qt)
    assert xhat.flatten().tolist() == [1.5, -0.5, 0.0, -1.0, 1.0, -1.5, 0.0, 1.0] + [0.0] * 8
    assert not torch.signbit(xhat[0, 0, 0, 6]) and not torch.signbit(xhat[0, 0, 1]).any()  # -0.2 -> +0.0
    assert bits_equal(fake_quantize(x, toy), xhat)
    # 3-bit codes pack 8 per 3 bytes: [c0 | c1<<3 | (c2&3)<<6], [c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7], [c5>>1 | ...]
    packed = toy.fmt.pack(qt.codes, toy)
    assert packed[0, 0, 0].tolist() == [3 | 5 << 3, 6 << 1 | 2 << 4 | 1 << 7, 7 >> 1 | 2 << 5]
    assert torch.equal(toy.fmt.unpack(packed, toy, 8), qt.codes)
    assert torch.equal(packed, pack(qt.codes, 3))
    assert qt.nbytes() == packed_nbytes(toy, (1, 1, 2, 8)) == {"codes": 6, "scales": 4, "outliers": 0, "total": 10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_fake_equals_quantize_dequantize_on_random_tensors(toy, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 32, generator=g, dtype=torch.float64).to(dtype)
    assert bits_equal(fake_quantize(x, toy), dequantize(quantize(x, toy)))
    with_outliers = QuantSpec(format=TOY, bits=3, outliers=0.05)
    assert bits_equal(fake_quantize(x, with_outliers), dequantize(quantize(x, with_outliers)))


# ----------------------------------------------------------------------------------------------- end to end
def _ids(model, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.config.vocab_size, (1, n), generator=g)


def _check_emulation_equals_decoding(model, policy: KVPolicy) -> None:
    ids = _ids(model, 16)
    with torch.no_grad():
        baseline = model(ids).logits
        with emulate(model, policy):
            emulated = model(ids).logits
    decoded = decode_logits(model, ids, policy, prefill_len=1)
    assert (emulated - baseline).abs().max() > 1e-6, "the policy must change something, or the test proves nothing"
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


@torch.no_grad()
def _check_cache_equals_bill(model, policy: KVPolicy, steps: int = 4) -> None:
    """A 7-token prefill, then single tokens: the cache's bytes equal the bill to the byte after every call
    (float64 model: fp_bytes 8)."""
    arch = Arch.from_model(model)
    ids = _ids(model, 7 + steps, seed=1)
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    for t in range(7, 8 + steps):
        model(ids[:, :7] if t == 7 else ids[:, t - 1 : t], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t, 1, fp_bytes=8)
        measured = cache.nbytes()
        assert {k: measured[k] for k in ("codes", "scales", "residual", "total")} == {
            "codes": bill.codes, "scales": bill.scales, "residual": bill.residual, "total": bill.total}, t
    assert (measured["codes"] > 0) != policy.is_none


def _toy_policy(toy: QuantSpec) -> KVPolicy:
    return KVPolicy(key=toy, value=toy, residual=3, sink_tokens=1)


def test_toy_emulation_equals_real_cache_decoding_float64(toy, tiny_llama64):
    model, _ = tiny_llama64
    _check_emulation_equals_decoding(model, _toy_policy(toy))


def test_toy_real_cache_bytes_equal_the_bill(toy, tiny_llama64):
    model, _ = tiny_llama64
    _check_cache_equals_bill(model, _toy_policy(toy))
    _check_cache_equals_bill(model, KVPolicy(key=QuantSpec(format=TOY, bits=3, outliers=0.05), value=toy))


# ----------------------------------------------------------------------------------------------- every format
def _one_preset_per_format() -> dict[str, str]:
    """format name -> the first preset using it that works without a scales file."""
    out: dict[str, str] = {}
    for name in preset_names():
        fmt = preset(name).fmt.name
        if fmt not in out:
            try:
                KVPolicy.preset(name)
            except Exception:
                continue
            out[fmt] = name
    return out


def test_every_registered_format_has_a_preset():
    assert set(_one_preset_per_format()) == set(format_names())


@pytest.mark.parametrize("name", sorted(set(_one_preset_per_format().values())))
def test_every_format_contracts(name, tiny_llama64):
    model, _ = tiny_llama64
    policy = KVPolicy.preset(name)
    if not policy.is_none:
        _check_emulation_equals_decoding(model, policy)
    _check_cache_equals_bill(model, policy)
