"""ggml q8_0/q4_0/q4_1/q5_0/q5_1 presets bit for bit against the gguf package's reference quantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from kveval.quant import dequantize, fake_quantize, packed_nbytes, preset, quantize

KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def reference(x: np.ndarray, kind: str) -> np.ndarray:
    qtype = GGMLQuantizationType[kind.upper()]
    return gq.dequantize(gq.quantize(x.astype(np.float32), qtype), qtype).reshape(x.shape)


def blocks() -> np.ndarray:
    """[1, 2, 12, 64] float32: random, zero, single-outlier, negative-dominant, tied, tiny and constant blocks."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 12, 64)).astype(np.float32)
    x[0, 0, 1, :32] = 0.0  # zero maximum
    x[0, 0, 2, :32] = rng.standard_normal(32) * 1e-2
    x[0, 0, 2, 7] = 40.0  # single positive outlier
    x[0, 0, 3, 32:] = rng.standard_normal(32) * 1e-2
    x[0, 0, 3, 40] = -40.0  # single negative outlier
    x[0, 0, 4] = -np.abs(x[0, 0, 4]) * 3  # negative-dominant
    x[0, 0, 5, :32] = 1.5
    x[0, 0, 5, 3] = -1.5  # |max| tie of opposite signs: ggml takes the first
    x[0, 0, 6] *= 1e-6  # scale d in fp16's subnormal range
    x[0, 0, 7, 32:] = 0.3  # constant block
    x[0, 0, 8] *= 1000.0
    x[0, 1] *= rng.uniform(0.01, 20, size=(12, 1)).astype(np.float32)
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_fake_quantize_matches_gguf_bit_for_bit(kind):
    x = blocks()
    ref = reference(x, kind)
    y = fake_quantize(torch.from_numpy(x), preset(kind)).numpy()
    assert np.array_equal(ref.view(np.int32), y.view(np.int32))  # -0.0 vs +0.0 included
    assert np.array_equal(dequantize(quantize(torch.from_numpy(x), preset(kind))).numpy().view(np.int32),
                          ref.view(np.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_random_blocks_many_seeds(kind):
    for seed in range(5):
        x = np.random.default_rng(100 + seed).standard_normal((2, 3, 16, 128)).astype(np.float32) * 10 ** (seed - 2)
        assert np.array_equal(fake_quantize(torch.from_numpy(x), preset(kind)).numpy(), reference(x, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_scales_match_gguf_bytes(kind):
    x = blocks()[:, :, :, :32].copy()  # one block per row: gguf bytes = d (2) [+ m (2)] [+ qh (4)] + qs
    raw = gq.quantize(x, GGMLQuantizationType[kind.upper()]).reshape(-1, {"q8_0": 34, "q4_0": 18, "q4_1": 20,
                                                                           "q5_0": 22, "q5_1": 24}[kind])
    qt = quantize(torch.from_numpy(x), preset(kind))
    assert np.array_equal(qt.scale.numpy().reshape(-1, 1).view(np.uint8), raw[:, :2])
    off = 2
    if kind.endswith("_1"):
        m = qt.zero_point.numpy().reshape(-1)
        ref_m = raw[:, 2:4].copy().view(np.float16).reshape(-1)
        assert np.array_equal(m, ref_m)  # as values: the stored min here is never -0.0
        off = 4
    codes = qt.codes.reshape(-1, 32).numpy().astype(np.int32)
    if kind == "q8_0":
        assert np.array_equal(codes, raw[:, 2:].view(np.int8))
        return
    if kind.startswith("q5"):
        qh = np.unpackbits(raw[:, off : off + 4], axis=-1, bitorder="little").astype(np.int32)
        off += 4
    else:
        qh = np.zeros((raw.shape[0], 32), np.int32)
    qs = raw[:, off:].astype(np.int32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (qh << 4)  # ggml: low nibbles = elements 0..15
    bias = {"q4_0": 8, "q5_0": 16}.get(kind, 0)
    assert np.array_equal(codes + bias, q)


@pytest.mark.parametrize("kind", KINDS)
def test_float64_and_bfloat16_inputs_go_through_float32(kind):
    x = blocks().astype(np.float64) * 1.0000001
    y = fake_quantize(torch.from_numpy(x), preset(kind))
    assert y.dtype == torch.float64
    assert np.array_equal(y.numpy(), reference(x.astype(np.float32), kind).astype(np.float64))
    xb = torch.from_numpy(blocks()).to(torch.bfloat16)
    yb = fake_quantize(xb, preset(kind))
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, torch.from_numpy(reference(xb.float().numpy(), kind)).to(torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_block_equal_ggml_type_size(kind):
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]]
    assert packed_nbytes(preset(kind), (1, 1, 1, block))["total"] == type_size
    assert quantize(torch.randn(1, 1, 1, 64), preset(kind)).nbytes()["total"] == 2 * type_size
