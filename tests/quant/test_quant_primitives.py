"""quantize / dequantize / fake_quantize against hand-computed numbers, and their invariants."""

from __future__ import annotations

import pytest
import torch

from kveval.quant import (
    QParams,
    QuantSpec,
    choose_qparams,
    dequantize,
    dequantize_into,
    fake_quantize,
    preset,
    preset_names,
    quantize,
)

ALL = preset_names()
QUANTIZED = [n for n in ALL if n != "none"]


def t(rows, dtype=torch.float32):
    """A [1, 1, T, D] tensor from a list of token rows."""
    return torch.tensor(rows, dtype=dtype).reshape(1, 1, len(rows), -1)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (distinguishes -0.0 from +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
    return torch.equal(a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype]))


def sample(shape=(2, 3, 40, 128), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def block_for(name):
    return 16 if preset(name).granularity == "channel" else None


# ------------------------------------------------------------------------------------- hand-computed examples
def test_token_symmetric_int4():
    # absmax 7 -> s = 7/7 = 1; absmax 3.5 -> s = 0.5. x/s rounds half to even: 2.5 -> 2, -2.4 -> -2, 1.5 -> 2.
    x = t([[7.0, -3.4, 2.5, 0.49], [3.5, -1.2, 0.75, -3.5]])
    spec = QuantSpec(bits=4, scale_dtype="float32")
    qt = quantize(x, spec)
    assert qt.codes.dtype == torch.int8
    assert qt.codes.flatten().tolist() == [7, -3, 2, 0, 7, -2, 2, -7]
    assert qt.scale.flatten().tolist() == [1.0, 0.5] and qt.scale.shape == (1, 1, 2, 1)
    assert qt.zero_point is None
    assert dequantize(qt).flatten().tolist() == [7.0, -3.0, 2.0, 0.0, 3.5, -1.0, 1.0, -3.5]


def test_token_symmetric_float16_scale_is_what_is_used():
    # absmax 1 -> s = 1/7 -> fp16 0.142822265625; x/s = [3.5009, -7.0017, 1.7504, 5.2513] -> [4, -7, 2, 5].
    x = t([[0.5, -1.0, 0.25, 0.75]])
    qt = quantize(x, QuantSpec(bits=4))
    assert qt.scale.dtype == torch.float16 and qt.scale.item() == 0.142822265625
    assert qt.codes.flatten().tolist() == [4, -7, 2, 5]
    s = 0.142822265625
    assert fake_quantize(x, QuantSpec(bits=4)).flatten().tolist() == [4 * s, -7 * s, 2 * s, 5 * s]


@pytest.mark.parametrize("scale_dtype, stored", [("float16", 0.333251953125), ("bfloat16", 0.333984375),
                                                 ("float32", float(torch.tensor(1 / 3)))])
def test_scale_dtype_rounding_one_third(scale_dtype, stored):
    # int2 asymmetric: [0, 1] -> s = (1-0)/3 = 1/3 rounded to the storage dtype; code of 1 is 3 -> x^ = 3*s.
    x = t([[0.0, 1.0]], dtype=torch.float64)
    spec = QuantSpec(bits=2, mapping="asymmetric", scale_dtype=scale_dtype)
    qp = choose_qparams(x, spec)
    assert qp.scale.item() == stored and qp.zero_point.item() == 0.0
    assert fake_quantize(x, spec).flatten().tolist() == [0.0, 3 * stored]


def test_group_symmetric_int3():
    # g2, qmax 3: [3, -1.2] -> s = 1, codes [3, -1]; [1.5, -0.75] -> s = 0.5, codes [3, -2] (-1.5 -> -2).
    x = t([[3.0, -1.2, 1.5, -0.75]])
    spec = QuantSpec(bits=3, granularity="group", group_size=2, scale_dtype="float32")
    qt = quantize(x, spec)
    assert qt.scale.shape == (1, 1, 1, 2, 1) and qt.scale.flatten().tolist() == [1.0, 0.5]
    assert qt.codes.shape == (1, 1, 1, 4) and qt.codes.flatten().tolist() == [3, -1, 3, -2]
    assert fake_quantize(x, spec).flatten().tolist() == [3.0, -1.0, 1.5, -1.0]


def test_token_asymmetric_float_zero_point():
    # int4: m = -5, s = 15/15 = 1; (x-m)/s = [0, 5, 7.5, 15] -> [0, 5, 8, 15] (half to even); x^ = q*s + m.
    # second token: m = -1, s = 0.2 (float32 0.200000003), (x-m)/s = [0, 5, 7.4999999, 15] -> [0, 5, 7, 15].
    x = t([[-5.0, 0.0, 2.5, 10.0], [-1.0, 0.0, 0.5, 2.0]], dtype=torch.float64)
    spec = QuantSpec(bits=4, mapping="asymmetric", scale_dtype="float32")
    qt = quantize(x, spec)
    s = float(torch.tensor(0.2, dtype=torch.float32))
    assert qt.codes.dtype == torch.uint8 and qt.codes.flatten().tolist() == [0, 5, 8, 15, 0, 5, 7, 15]
    assert qt.scale.flatten().tolist() == [1.0, s] and qt.zero_point.flatten().tolist() == [-5.0, -1.0]
    assert qt.zero_point.dtype == torch.float32
    assert dequantize(qt).flatten().tolist() == [-5.0, 0.0, 3.0, 10.0, -1.0, 5 * s - 1, 7 * s - 1, 15 * s - 1]


def test_channel_asymmetric_blocks_with_partial_last_block():
    # int2 (codes 0..3), channel_block 3, T = 5 -> blocks [t0..t2] and the partial [t3, t4].
    # block 1: ch0 [0, 1.4, 3] -> m 0, s 1, codes [0, 1, 3]; ch1 [-1, -0.3, 0.5] -> m -1, s 0.5, (x-m)/s =
    # [0, 1.4, 3] -> [0, 1, 3] -> x^ [-1, -0.5, 0.5]. block 2: ch0 [2, 3.5] -> s 0.5, codes [0, 3]; ch1 constant 5.
    x = t([[0.0, -1.0], [1.4, -0.3], [3.0, 0.5], [2.0, 5.0], [3.5, 5.0]])
    spec = QuantSpec(bits=2, mapping="asymmetric", granularity="channel", scale_dtype="float32")
    qt = quantize(x, spec, channel_block=3)
    assert qt.scale.shape == (1, 1, 2, 1, 2)
    assert qt.scale.flatten().tolist() == [1.0, 0.5, 0.5, 0.0]
    assert qt.zero_point.flatten().tolist() == [0.0, -1.0, 2.0, 5.0]
    assert qt.codes[0, 0, :, 0].tolist() == [0, 1, 3, 0, 3] and qt.codes[0, 0, :3, 1].tolist() == [0, 1, 3]
    expected = [[0.0, -1.0], [1.0, -0.5], [3.0, 0.5], [2.0, 5.0], [3.5, 5.0]]
    assert fake_quantize(x, spec, channel_block=3)[0, 0].tolist() == expected
    # default channel_block: the whole sequence is one block
    assert choose_qparams(x, spec).scale.shape == (1, 1, 1, 1, 2)


def test_head_asymmetric_int_zero_point():
    # int4, one (scale, z) per kv head; the range is widened to include 0.
    # head 0: [-5, 0, 2.4, 10] -> s = 15/15 = 1, z = 5, codes round(x) + 5 = [0, 5, 7, 15] -> x^ [-5, 0, 2, 10]
    # head 1: [1, 2, 3, 7.5] -> range [0, 7.5], s = 0.5, z = 0, codes [2, 4, 6, 15] -> exact
    x = torch.tensor([[[-5.0, 0.0], [2.4, 10.0]], [[1.0, 2.0], [3.0, 7.5]]]).reshape(1, 2, 2, 2)
    spec = QuantSpec(bits=4, mapping="asymmetric", zero_point="int", granularity="head", scale_dtype="float32")
    qt = quantize(x, spec)
    assert qt.scale.shape == (1, 2, 1, 1) and qt.scale.flatten().tolist() == [1.0, 0.5]
    assert qt.zero_point.dtype == torch.uint8 and qt.zero_point.flatten().tolist() == [5, 0]
    assert qt.codes.flatten().tolist() == [0, 5, 7, 15, 2, 4, 6, 15]
    assert dequantize(qt).flatten().tolist() == [-5.0, 0.0, 2.0, 10.0, 1.0, 2.0, 3.0, 7.5]


def test_tensor_fp8_e4m3_dynamic():
    # absmax 896 -> s = 896/448 = 2; x/s = [448, 1.65, -0.05, -250] -> e4m3 [448, 1.625, -0.05078125, -256].
    x = t([[896.0, 3.3], [-0.1, -500.0]])
    spec = QuantSpec(format="fp8_e4m3", granularity="tensor", scale_dtype="float32")
    qt = quantize(x, spec)
    assert qt.codes.dtype == torch.float8_e4m3fn and qt.scale.shape == (1, 1, 1, 1) and qt.scale.item() == 2.0
    assert qt.codes.float().flatten().tolist() == [448.0, 1.625, -0.05078125, -256.0]
    assert fake_quantize(x, spec).flatten().tolist() == [896.0, 3.25, -0.1015625, -512.0]


def test_head_int8_static_scale_saturates():
    # static s = 0.5: x/s = [2, -128.4, 200] -> [2, -128, 127 (saturated)] -> x^ [1, -64, 63.5].
    x = t([[1.0, -64.2, 100.0]])
    spec = QuantSpec(granularity="head", static_scale=0.5, scale_dtype="float32")
    qt = quantize(x, spec)
    assert qt.codes.flatten().tolist() == [2, -128, 127] and qt.scale.shape == (1, 1, 1, 1)
    assert dequantize(qt).flatten().tolist() == [1.0, -64.0, 63.5]


def test_fp8_static_scale_one_is_a_saturating_cast():
    x = torch.tensor([1e6, -1e6, 3.3, 1e-3, 60000.0, -70000.0]).reshape(1, 1, 1, 6)
    for name, fp8, fmax in [("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)]:
        y = fake_quantize(x, preset(name))
        ref = x.clamp(-fmax, fmax).to(fp8).float()
        assert torch.isfinite(y).all() and torch.equal(y, ref)
        assert y[0, 0, 0, 0].item() == fmax and y[0, 0, 0, 1].item() == -fmax


def test_fp8_decode_is_exact_for_every_byte():
    from kveval.quant.formats.fp8 import _fp8_to_float

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(fp8)
        ref, got = codes.float(), _fp8_to_float(codes, out=torch.empty(256))
        finite = torch.isfinite(ref)
        assert torch.equal(ref[finite].view(torch.int32), got[finite].view(torch.int32))


def test_fp8_token_dynamic_matches_torch_cast():
    x = sample((1, 2, 16, 64)) * 10
    y = fake_quantize(x, preset("fp8_e4m3_token"))
    s = (x.abs().amax(-1, keepdim=True) / 448).to(torch.float16).float()
    ref = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(y, ref)


def test_clip_ratio_scales_the_range_and_saturates():
    # int4 sym, absmax 7, clip 0.5 -> s = 3.5/7 = 0.5; 7/0.5 = 14 saturates to 7 -> 3.5.
    x = t([[7.0, 1.0, -2.0, -7.0]])
    spec = QuantSpec(bits=4, clip_ratio=0.5, scale_dtype="float32")
    assert choose_qparams(x, spec).scale.item() == 0.5
    assert fake_quantize(x, spec).flatten().tolist() == [3.5, 1.0, -2.0, -4.0]  # -14 -> -8 (the extra level)
    # asymmetric: [min, max] * 0.5 = [-0.5, 1.5] -> int2 s = 2/3
    spec = QuantSpec(bits=2, mapping="asymmetric", clip_ratio=0.5, scale_dtype="float32")
    qp = choose_qparams(t([[-1.0, 3.0]]), spec)
    assert qp.zero_point.item() == -0.5 and qp.scale.item() == float(torch.tensor(2 / 3))


# ------------------------------------------------------------------------------------------------- invariants
def test_none_is_identity():
    x = sample()
    assert fake_quantize(x, preset("none")) is x
    assert dequantize(quantize(x, preset("none"))) is x


@pytest.mark.parametrize("name", QUANTIZED)
def test_fake_quantize_equals_dequantize_quantize_bit_for_bit(name):
    spec = preset(name)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = sample((2, 3, 37, 128), seed=1, dtype=dtype)
        x[0, 0, 0, :5] = 0.0
        x[0, 0, 1] = -1e-9  # rounds to -0.0 in float16/bfloat16: the sign of zero must match too
        cb = block_for(name)
        y = fake_quantize(x, spec, channel_block=cb)
        assert y.dtype == dtype and y.shape == x.shape
        assert bits_equal(y, dequantize(quantize(x, spec, channel_block=cb))), dtype
        assert bits_equal(y, fake_quantize(x.clone(), spec, channel_block=cb))  # deterministic


def test_float64_is_computed_in_float64():
    x = sample((1, 2, 8, 64), dtype=torch.float64)
    spec = QuantSpec(scale_dtype="float32")
    s = (x.abs().amax(-1, keepdim=True) / 127).to(torch.float32).to(torch.float64)
    ref = (x / s).round().clamp(-128, 127) * s
    assert torch.equal(fake_quantize(x, spec), ref)


# iq4_nl is symmetric but its non-linear codebook has no 0 (the entry nearest 0 is +1): zero becomes d; the
# TurboQuant key codebooks have no 0 either, and their rotation mixes the coordinates
@pytest.mark.parametrize("name", [n for n in QUANTIZED if preset(n).mapping == "symmetric" and n != "iq4_nl"
                                  and not preset(n).format.startswith("turboquant")])
def test_symmetric_keeps_zero_exact(name):
    x = sample((1, 2, 32, 128))
    x[:, :, ::3, ::5] = 0.0
    y = fake_quantize(x, preset(name), channel_block=block_for(name))
    assert (y[x == 0] == 0).all()


def _mse(x, spec, cb=None):
    return ((fake_quantize(x, spec, channel_block=cb) - x) ** 2).mean().item()


@pytest.mark.parametrize("granularity, group_size", [("token", None), ("group", 32), ("channel", None)])
@pytest.mark.parametrize("mapping", ["symmetric", "asymmetric"])
def test_error_falls_as_bits_rise(granularity, group_size, mapping):
    gauss = sample((1, 2, 128, 128), seed=2)
    heavy = sample((1, 2, 128, 128), seed=3) * sample((1, 2, 128, 128), seed=4).exp()  # log-normal scale mixture
    heavy[..., [3, 77]] *= 30.0  # outlier channels, as real keys have
    for x in (gauss, heavy):
        errs = [_mse(x, QuantSpec(bits=b, mapping=mapping, granularity=granularity, group_size=group_size), 64)
                for b in (2, 3, 4, 8)]
        assert errs[0] > errs[1] > errs[2] > errs[3] > 0, errs


@pytest.mark.parametrize("name", QUANTIZED)
def test_all_zero_groups_reconstruct_to_zero(name):
    x = torch.zeros(1, 2, 8, 128)
    qt = quantize(x, preset(name), channel_block=block_for(name))
    assert torch.isfinite(qt.scale.float()).all()
    assert torch.equal(dequantize(qt), x)


# int4_per_token_head rotates each row (Hadamard) before quantizing: a constant row is no longer constant
@pytest.mark.parametrize("name", [n for n in QUANTIZED if preset(n).mapping == "asymmetric"
                                  and preset(n).format != "int4_per_token_head"])
def test_constant_groups_asymmetric_reconstruct_exactly(name):
    x = torch.full((1, 2, 8, 128), 0.75)  # representable in fp16: the stored min is exact
    x[0, 1] = -3.5
    assert torch.equal(fake_quantize(x, preset(name), channel_block=block_for(name)), x)


def test_constant_group_int_zero_point_is_finite_and_close():
    x = torch.full((1, 1, 4, 64), 0.7)
    spec = QuantSpec(bits=4, mapping="asymmetric", zero_point="int")
    y = fake_quantize(x, spec)
    s = choose_qparams(x, spec).scale.float()
    assert torch.isfinite(y).all() and ((y - x).abs() <= s / 2 + 1e-7).all()


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(name, bad):
    x = sample((1, 2, 8, 128))
    x[0, 1, 5, 17] = bad
    with pytest.raises(ValueError, match="non-finite values in input to quantize"):
        fake_quantize(x, preset(name), channel_block=block_for(name))
    with pytest.raises(ValueError, match="non-finite values in input to quantize"):
        quantize(x, preset(name), channel_block=block_for(name))


def test_channel_blocks_use_only_their_own_tokens():
    spec = preset("int2_channel")
    x = sample((1, 2, 300, 64))
    y = fake_quantize(x, spec, channel_block=128)
    x2 = x.clone()
    x2[:, :, 200] *= 50.0  # a token in block 2 (tokens 128..255)
    x2[:, :, 290] *= 50.0  # a token in the partial block 3 (tokens 256..299)
    y2 = fake_quantize(x2, spec, channel_block=128)
    assert torch.equal(y2[:, :, :128], y[:, :, :128])
    assert not torch.equal(y2[:, :, 128:256], y[:, :, 128:256])
    assert torch.equal(y2[:, :, 128:256], fake_quantize(x2[:, :, 128:256], spec))  # a block = its own tokens
    assert torch.equal(y2[:, :, 256:], fake_quantize(x2[:, :, 256:], spec))


def test_given_qparams_are_used_and_checked():
    x = sample((1, 2, 8, 64))
    spec = QuantSpec(granularity="head", scale_dtype="float32")
    qp = QParams(torch.tensor([0.01, 0.02]).reshape(1, 2, 1, 1))
    qt = quantize(x, spec, qp)
    s = qp.scale
    assert torch.equal(dequantize(qt), (x / s).round().clamp(-128, 127) * s)
    with pytest.raises(ValueError, match=r"qparams.scale has shape \(1, 1, 1, 1\); head needs \(1, 2, 1, 1\)"):
        quantize(x, spec, QParams(torch.ones(1, 1, 1, 1)))
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, spec, qp)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"expected x of shape \[batch, kv_heads, seq, head_dim\]"):
        fake_quantize(torch.zeros(4, 64), preset("int8"))
    with pytest.raises(ValueError, match="group_size 128 does not divide head_dim 64"):
        fake_quantize(torch.zeros(1, 1, 2, 64), preset("int4_g128"))
    with pytest.raises(ValueError, match="channel_block must be a positive integer"):
        fake_quantize(torch.zeros(1, 1, 2, 64), preset("int4_channel"), channel_block=0)


def test_empty_sequence():
    x = torch.zeros(1, 2, 0, 64)
    for name in ("int8", "int4_g32", "int2_channel", "q4_0", "fp8_e4m3"):
        assert fake_quantize(x, preset(name)).shape == x.shape
        assert dequantize(quantize(x, preset(name))).shape == x.shape


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_dequantize_into_a_slice_of_a_buffer_is_dequantize_bit_for_bit(name, dtype):
    """The lean cache's read: `dequantize_into` a strided slice of a larger buffer writes exactly `dequantize`'s
    values there (every preset; IntFormat's in-place path and the default copy) and nothing outside it."""
    spec = preset(name)
    D = 128
    if spec.granularity == "group" and D % spec.group_size:
        pytest.skip("group does not divide head_dim")
    x = torch.randn(2, 3, 37, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    qt = quantize(x, spec, channel_block=16)
    buf = torch.full((2, 3, 50, D), float("nan"), dtype=dtype)
    dequantize_into(qt, buf[:, :, 5:42])
    want = dequantize(qt)
    assert torch.equal(buf[:, :, 5:42], want)
    assert buf[:, :, :5].isnan().all() and buf[:, :, 42:].isnan().all()
