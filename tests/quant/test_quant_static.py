"""Calibrated (static) parameters, dense-and-sparse outliers, calibration ranges, RoPE inverse: against references."""

import math

import pytest
import torch

from kveval.quant import (
    QuantSpec,
    dequantize,
    fake_quantize,
    packed_nbytes,
    preset,
    qparams_from_range,
    quantize,
    split_outliers,
)
from kveval.rope import rotate, unrotate
from kveval.scales.ranges import calibrate_ranges, mse_ranges, percentile_ranges


def test_qparams_from_range_worked_example():
    spec = QuantSpec(bits=8, granularity="tensor", scale_dtype="float32")
    qp = qparams_from_range(torch.tensor(-2.54), torch.tensor(1.0), spec)
    assert qp.scale.shape == (1, 1, 1, 1) and qp.zero_point is None
    assert qp.scale.item() == pytest.approx(0.02, rel=1e-6)


def test_static_channel_matches_a_hand_reference():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    spec = QuantSpec(bits=4, mapping="symmetric", granularity="channel", scale_dtype="float32")
    absmax = torch.rand(3, 8) + 0.5  # [H, D]
    qp = qparams_from_range(-absmax, absmax, spec)
    assert qp.scale.shape == (1, 3, 1, 8)
    s = (absmax / 7).reshape(1, 3, 1, 8)
    want = (x / s).round().clamp(-8, 7) * s
    qt = quantize(x, spec, qp)
    assert qt.static and qt.scale.shape == (1, 3, 1, 8)
    torch.testing.assert_close(dequantize(qt), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(fake_quantize(x, spec, qparams=qp), dequantize(qt), rtol=0, atol=0)
    # the scale is stored once, whatever the number of tokens
    assert packed_nbytes(spec, x.shape, static=True) == qt.nbytes()


def test_static_asymmetric_head_range():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0]).reshape(1, 1, 1, 4).expand(1, 2, 1, 4).contiguous()
    spec = QuantSpec(bits=2, mapping="asymmetric", granularity="head", scale_dtype="float32")
    qp = qparams_from_range(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 6.0]), spec)
    # head 0: s = 1, m = 0 -> exact; head 1: s = 2 -> [0, 2 (1 rounds half to even: 0.5 -> 0), 2, 4]
    out = fake_quantize(x, spec, qparams=qp)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    torch.testing.assert_close(out[0, 1, 0], torch.tensor([0.0, 0.0, 2.0, 4.0]))


def test_split_outliers_worked_example():
    x = torch.tensor([0.1, -3.0, 0.2, 2.0]).reshape(1, 1, 1, 4)
    dense, values, index = split_outliers(x, 1)
    assert dense.flatten().tolist() == pytest.approx([0.1, 0.0, 0.2, 2.0])
    assert values.flatten().tolist() == [-3.0] and index.flatten().tolist() == [1] and index.dtype == torch.uint8


@pytest.mark.parametrize("name", ["int4_g32", "int8", "int2_g32"])
def test_outliers_are_restored_exactly_and_the_rest_is_quantized_dense(name):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 5, 64)
    x[0, 0, 2, 17] = 40.0  # a crafted outlier
    spec = QuantSpec(**{**preset(name).to_dict(), "outliers": 0.03})  # ceil(1.92) = 2 per row
    k = spec.outlier_count(64)
    assert k == 2
    qt = quantize(x, spec)
    out = dequantize(qt)
    dense, values, index = split_outliers(x, k)
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, index.long(), True)
    assert torch.equal(out[kept], x[kept])  # outliers exactly
    plain = QuantSpec(**{**spec.to_dict(), "outliers": 0.0})
    torch.testing.assert_close(out[~kept], fake_quantize(dense, plain)[~kept], rtol=0, atol=0)
    # the outlier no longer inflates its group's scale: the error elsewhere in that row drops
    row_err = (out - x)[0, 0, 2].abs().max()
    assert row_err < (fake_quantize(x, plain) - x)[0, 0, 2].abs().max()
    # bytes: values in x's dtype (4 B) + 1-byte index, k per row; equals the prediction
    nb = qt.nbytes()
    assert nb["outliers"] == 2 * 5 * k * (4 + 1)
    assert nb == packed_nbytes(spec, x.shape, dtype=torch.float32)
    torch.testing.assert_close(fake_quantize(x, spec), out, rtol=0, atol=0)


def test_percentile_clipping_changes_the_scale_as_expected():
    x = torch.arange(1, 1001, dtype=torch.float32).reshape(1000, 1, 1)  # [N, H, D]
    full = percentile_ranges(x, "tensor", 100.0)
    clipped = percentile_ranges(x, "tensor", 99.9)
    assert full.absmax.item() == 1000 and clipped.absmax.item() == 999
    assert clipped.hi.item() == 999 and clipped.lo.item() == 2  # mirror rank: 1000 + 1 - 999
    spec = QuantSpec(bits=8, granularity="tensor", scale_dtype="float32")
    s_full = qparams_from_range(-full.absmax, full.absmax, spec).scale.item()
    s_clip = qparams_from_range(-clipped.absmax, clipped.absmax, spec).scale.item()
    assert s_full == pytest.approx(1000 / 127) and s_clip == pytest.approx(999 / 127)


def test_ranges_per_head_and_channel_shapes_and_values():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 4)
    r = calibrate_ranges(x, "channel", "absmax")
    assert r.absmax.shape == (3, 4)
    torch.testing.assert_close(r.absmax, x.abs().amax(0))
    torch.testing.assert_close(r.lo, x.amin(0))
    h = calibrate_ranges(x, "head", "absmax")
    torch.testing.assert_close(h.hi, x.amax((0, 2)))


def test_mse_clipping_beats_absmax_with_one_outlier_and_is_deterministic():
    torch.manual_seed(0)
    x = torch.randn(4000, 1, 8)
    x[0, 0, 0] = 60.0
    target = preset("int4_g64")  # int4 asymmetric
    a = mse_ranges(x, "tensor", target)
    b = mse_ranges(x.clone(), "tensor", target)
    assert torch.equal(a.absmax, b.absmax) and torch.equal(a.lo, b.lo)
    assert a.absmax.item() < 60.0  # clipped
    spec = QuantSpec(bits=4, mapping="symmetric", granularity="tensor", scale_dtype="float16")
    x4 = x.permute(1, 0, 2)[None]

    def err(absmax):
        return (fake_quantize(x4, spec, qparams=qparams_from_range(-absmax, absmax, spec)) - x4).pow(2).sum()

    assert err(a.absmax) < err(torch.tensor(60.0))


def test_rope_inverse_and_worked_example():
    x = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)
    cos, sin = torch.zeros(1, 1, 2), torch.ones(1, 1, 2)
    assert rotate(x, cos, sin).flatten().tolist() == [0.0, 1.0]
    assert unrotate(torch.tensor([0.0, 1.0]).reshape(1, 1, 1, 2), cos, sin).flatten().tolist() == [1.0, 0.0]
    torch.manual_seed(0)
    y = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    theta = torch.rand(2, 5, 4, dtype=torch.float64) * 2 * math.pi
    c, s = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    torch.testing.assert_close(unrotate(rotate(y, c, s), c, s), y, rtol=0, atol=1e-14)
    # RoPE variants that scale cos and sin (YaRN's attention_scaling): the inverse still recovers x
    torch.testing.assert_close(unrotate(rotate(y, 1.3 * c, 1.3 * s), 1.3 * c, 1.3 * s), y, rtol=0, atol=1e-13)
    # a rotation keeps each pair's norm
    r = rotate(y, c, s)
    torch.testing.assert_close(r[..., :4] ** 2 + r[..., 4:] ** 2, y[..., :4] ** 2 + y[..., 4:] ** 2)


def test_spec_rejects_bad_outlier_fraction():
    with pytest.raises(ValueError, match="outliers must be a fraction"):
        QuantSpec(outliers=0.7)
    with pytest.raises(ValueError, match="ggml"):
        QuantSpec(**{**preset("q4_0").to_dict(), "outliers": 0.01})
