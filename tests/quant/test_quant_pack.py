"""pack/unpack layouts and round trips; packed_nbytes == QuantizedTensor.nbytes() == real bytes."""

from __future__ import annotations

import math

import pytest
import torch

from kveval.quant import QuantSpec, pack, packed_nbytes, preset, preset_names, quantize, unpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8, 13, 64, 128])
def test_round_trip_all_bits(bits, signed, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    codes = torch.randint(lo, hi + 1, (2, 3, 5, n), generator=g).to(torch.int8 if signed else torch.uint8)
    codes[0, 0, 0, 0], codes[0, 0, 0, -1] = lo, hi
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, math.ceil(n * bits / 8))
    back = unpack(packed, bits, n, signed=signed)
    assert back.dtype == codes.dtype and torch.equal(back, codes)


def test_layouts_by_hand():
    u8 = torch.uint8
    assert pack(torch.tensor([1, 2, 3, 4], dtype=u8), 4).tolist() == [0x21, 0x43]  # low nibble first
    assert pack(torch.tensor([0, 1, 2, 3], dtype=u8), 2).tolist() == [0b11100100]
    assert pack(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=u8), 1).tolist() == [0b10001101, 0b1]
    # INT3: 8 codes in 3 bytes: [c0 | c1<<3 | (c2&3)<<6], [c2>>2 | c3<<1 | c4<<4 | (c5&1)<<7], [c5>>1 | c6<<2 | c7<<5]
    c = [1, 2, 3, 4, 5, 6, 7, 0]
    assert pack(torch.tensor(c, dtype=u8), 3).tolist() == [1 | 2 << 3 | 3 << 6, 0 | 4 << 1 | 5 << 4, 3 | 7 << 2]
    # 4 INT4 codes packed by the general bitstream path (n odd) agree with the fast path's bytes
    assert pack(torch.tensor([1, 2, 3], dtype=u8), 4).tolist() == [0x21, 0x03]
    # signed codes are offset by 2^(bits-1): INT4 [-8, 7] -> [0, 15] -> 0xF0
    assert pack(torch.tensor([-8, 7], dtype=torch.int8), 4).tolist() == [0xF0]
    assert pack(torch.tensor([-1, 2], dtype=torch.int64), 3, signed=True).tolist() == [3 | 6 << 3]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("signed", [False, True])
def test_unpack_of_every_byte_is_the_bitstream_definition(bits, signed):
    """Every byte value, as the bitstream of `pack`'s docstring reads it bit by bit in Python (the table lookup
    of 1, 2 and 4 bits, the copy of 8), in a transposed (non-contiguous) tensor as well."""
    per, off = 8 // bits, 2 ** (bits - 1) if signed else 0
    want = [[((b >> (k * bits)) & (2**bits - 1)) - off for k in range(per)] for b in range(256)]
    packed = torch.arange(256, dtype=torch.uint8).reshape(2, 128, 1)
    got = unpack(packed, bits, per, signed=signed)
    assert got.dtype == (torch.int8 if signed else torch.uint8) and got.reshape(256, per).tolist() == want
    wide = torch.arange(256, dtype=torch.uint8).reshape(4, 64).t()  # [64, 4] non-contiguous
    flat = unpack(wide, bits, 4 * per, signed=signed).tolist()
    assert flat == [sum((want[wide[r, c].item()] for c in range(4)), []) for r in range(64)]


def test_out_of_range_codes_raise():
    with pytest.raises(ValueError, match="do not fit unsigned 4-bit"):
        pack(torch.tensor([16], dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="do not fit signed 4-bit"):
        pack(torch.tensor([-9], dtype=torch.int8), 4)
    with pytest.raises(ValueError, match=r"expected uint8 \[..., 2\]"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 4)


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize("shape, cb", [((2, 3, 37, 128), 16), ((1, 2, 64, 64), None)])
def test_nbytes_prediction_equals_real_bytes(name, shape, cb):
    spec = preset(name)
    if spec.granularity == "group" and shape[-1] % spec.group_size:
        pytest.skip("group does not divide head_dim")
    x = torch.randn(shape, dtype=torch.float16)
    qt = quantize(x, spec, channel_block=cb)
    real = qt.nbytes()
    assert real == packed_nbytes(spec, shape, channel_block=cb, dtype=torch.float16)
    if spec.is_none:
        assert real["total"] == x.numel() * 2
        return
    code_bytes = spec.fmt.pack(qt.codes, spec).numel()  # the format's own rows (FP8 bytes, NVFP4 codes + E4M3)
    scale_bytes = qt.scale.numel() * qt.scale.element_size()
    if qt.zero_point is not None:
        scale_bytes += qt.zero_point.numel() * qt.zero_point.element_size()
    assert real == {"codes": code_bytes, "scales": scale_bytes, "outliers": 0, "total": code_bytes + scale_bytes}


def test_nbytes_worked_numbers():
    shape = (1, 8, 4096, 128)
    assert packed_nbytes(preset("int4_g64"), shape) == {"codes": 2097152, "scales": 262144, "outliers": 0, "total": 2359296}
    assert packed_nbytes(preset("none"), shape)["total"] == 8388608
    # int3 rows of 128: 48 bytes; int zero points are 1 byte next to a 2-byte scale
    spec = QuantSpec(bits=3, mapping="asymmetric", zero_point="int", granularity="group", group_size=64)
    assert packed_nbytes(spec, shape) == {"codes": 32768 * 48, "scales": 32768 * 2 * 3, "outliers": 0, "total": 32768 * 54}
    # channel, block 128, T = 300 -> 3 blocks (the last partial) of 128 channels, fp16 scale + min
    assert packed_nbytes(preset("int2_channel"), (1, 1, 300, 128), channel_block=128)["scales"] == 3 * 128 * 4
    assert packed_nbytes(preset("fp8_e4m3"), shape)["scales"] == 4
