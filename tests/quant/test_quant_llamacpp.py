"""llama.cpp's run-time cache formats: ``q8_0_x86`` (x86 quantize_row_q8_0) and ``iq4_nl`` (quantize_row_iq4_nl_ref)
on crafted blocks (known codes and bytes), against the ``gguf`` package where it implements the type (iq4_nl
dequantization; q8_0 where the roundings agree), and byte for byte against the real library (the ggml shared
libraries of llama-cpp-python, through ctypes; skipped when llama_cpp is not importable)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from kveval.quant import dequantize, fake_quantize, pack, packed_nbytes, preset, quantize
from kveval.quant.formats.ggml import ggml_quantize_blocks
from kveval.quant.formats.iq4_nl import KVALUES, best_index, iq4_nl_blocks, iq4_nl_decode, iq4_nl_to_ggml_bytes
from kveval.quant.formats.q8_0_x86 import q8_0_x86_blocks

VALUES = torch.tensor(KVALUES, dtype=torch.float32)


def _blocks(n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g) * torch.logspace(-4, 3, n).unsqueeze(1)
    x[0] = 0.0
    x[1, 5] = 50.0  # single outlier
    x[2] = -x[2].abs()
    x[3, :] = 0.25  # constant
    x[4, 3], x[4, 9] = 2.0, -2.0  # |max| tie of opposite signs: the first wins
    x[5] *= 1e-9  # below the smallest normal fp16 scale
    return x


def _q8_bytes(codes: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    return torch.cat([d.reshape(-1, 1).view(torch.uint8).reshape(-1, 2), codes.to(torch.int8).view(torch.uint8)],
                     1).numpy()


# --------------------------------------------------------------------------------------------------- crafted
def test_iq4_nl_worked_example():
    """xb = [2, 1, 0, ...]: d0 = 2/-127, id*x = [-127, -63.5, -0, ...] -> indices [0, 3, 8, ...] (-63.5 is nearer
    -65 than -49; -0 nearer 1 than -10); sumqx = 4*-127*2 + 1*-65*1 = -1081, sumq2 = 4*127^2 + 65^2 = 68741,
    d = -1081/68741 -> fp16 -0.0157318115234375."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 2.0, 1.0
    idx, d = iq4_nl_blocks(x)
    assert idx[0, :3].tolist() == [0, 3, 8] and idx[0, 3:].eq(8).all()
    assert d.dtype == torch.float16 and d.item() == -0.0157318115234375
    assert d.item() == torch.tensor(-1081 / 68741, dtype=torch.float32).to(torch.float16).item()
    xhat = iq4_nl_decode(idx, d)
    assert xhat[0, :3].tolist() == [-127 * d.item(), -65 * d.item(), 1 * d.item()]
    # ggml bytes: fp16 d, then qs[j] = L[j] | L[j + 16] << 4
    raw = iq4_nl_to_ggml_bytes(idx, d)[0].tolist()
    assert raw[:2] == list(d.view(torch.uint8).reshape(-1).tolist()) and raw[2] == 0 | 8 << 4 and raw[3] == 3 | 8 << 4
    assert raw[4:] == [8 | 8 << 4] * 14


def _ggml_best_index(x: torch.Tensor) -> torch.Tensor:
    """``best_index_int8`` (src/ggml-quants.c) as written, element-wise: the end clamps, the neighbours found by
    the binary search, and ``x - val[mu-1] < val[mu] - x ? mu-1 : mu`` in float32."""
    n = VALUES.numel()
    mu = torch.searchsorted(VALUES, x.contiguous(), right=True).clamp_(1, n - 1)  # first entry > x
    lo, hi = VALUES[mu - 1], VALUES[mu]
    idx = torch.where((x - lo) < (hi - x), mu - 1, mu)
    idx = torch.where(x <= VALUES[0], torch.zeros_like(idx), idx)
    return torch.where(x >= VALUES[-1], torch.full_like(idx, n - 1), idx)


def test_iq4_nl_best_index_ties_go_up_and_ends_clamp():
    x = torch.tensor([-200.0, -127.0, -115.5, -115.4, -115.6, 7.0, 6.9, 113.0, 500.0, 101.0])
    assert best_index(x, VALUES).tolist() == [0, 0, 1, 1, 0, 9, 8, 15, 15, 15]


def test_iq4_nl_best_index_equals_ggml_on_every_float_near_a_midpoint():
    """Every float32 within 1e-3 of each midpoint of neighbouring codebook entries (where float32 rounding of the
    two differences could matter), the codebook entries and their neighbours, +-0, the ends, and 2M random values
    over [-140, 130] and over +-1e-3: the same index as ggml's code."""
    near = []
    for m in ((VALUES[1:] + VALUES[:-1]) / 2).tolist():
        a, b = (torch.tensor(m + e, dtype=torch.float32).view(torch.int32).item() for e in (-1e-3, 1e-3))
        near.append(torch.arange(min(a, b), max(a, b) + 1, dtype=torch.int32).view(torch.float32))
    g = torch.Generator().manual_seed(0)
    entries = torch.cat([VALUES, torch.nextafter(VALUES, VALUES - 1), torch.nextafter(VALUES, VALUES + 1)])
    x = torch.cat([*near, entries, torch.tensor([0.0, -0.0, -1e30, 1e30, -127.0, 113.0]),
                   torch.rand(1_000_000, generator=g) * 270 - 140, (torch.rand(1_000_000, generator=g) - 0.5) * 2e-3])
    assert sum(t.numel() for t in near) > 15 * 200  # each interval enumerated, not a handful of points
    assert torch.equal(best_index(x, VALUES), _ggml_best_index(x))


def test_iq4_nl_zero_block_and_first_max():
    idx, d = iq4_nl_blocks(torch.zeros(2, 32))
    assert d.eq(0).all() and iq4_nl_decode(idx, d).eq(0).all()
    x = torch.zeros(1, 32)
    x[0, 3], x[0, 9] = -2.0, 2.0  # tie of |x|: the first (-2) is the signed max, so d0 = -2/-127 > 0
    idx, _ = iq4_nl_blocks(x)
    assert idx[0, 3].item() == 0 and idx[0, 9].item() == 15


def test_q8_0_x86_crafted_ties():
    """amax = 127/32: 127/amax = 32 exactly; k/64 lands on k/2. x86 rounds half to even, gguf half away from 0."""
    x = torch.zeros(1, 32)
    x[0, 0] = 127 / 32
    x[0, 1:5] = torch.tensor([1.0, 3, 5, -5]) / 64
    codes, d = q8_0_x86_blocks(x)
    assert codes[0, :5].tolist() == [127, 0, 2, 2, -2] and d.item() == 1 / 32
    ref, _, _ = ggml_quantize_blocks(x.clone(), "q8_0")
    assert ref[0, :5].tolist() == [127, 1, 2, 3, -3]


@pytest.mark.parametrize("name", ["iq4_nl", "q8_0_x86"])
def test_fake_equals_quantize_dequantize_and_bytes(name):
    spec = preset(name)
    x = _blocks(64).reshape(2, 2, 8, 64)
    qt = quantize(x, spec)
    assert torch.equal(fake_quantize(x, spec), dequantize(qt))
    assert torch.equal(fake_quantize(x.double(), spec), dequantize(qt).double())
    assert packed_nbytes(spec, (1, 1, 1, 64)) == {"codes": {"iq4_nl": 32, "q8_0_x86": 64}[name], "scales": 4,
                                                  "outliers": 0, "total": {"iq4_nl": 36, "q8_0_x86": 68}[name]}
    assert spec.bits_per_element(64) == {"iq4_nl": 4.5, "q8_0_x86": 8.5}[name]
    assert pack(qt.codes, spec.code_bits).shape[-1] == {"iq4_nl": 32, "q8_0_x86": 64}[name]


# --------------------------------------------------------------------------------------------------- gguf package
def test_iq4_nl_decodes_like_gguf():
    x = _blocks(2000, seed=3)
    idx, d = iq4_nl_blocks(x)
    raw = iq4_nl_to_ggml_bytes(idx, d).numpy()
    ref = gq.dequantize(raw.reshape(-1), GGMLQuantizationType.IQ4_NL).reshape(x.shape)
    assert np.array_equal(ref.view(np.int32), iq4_nl_decode(idx, d).numpy().view(np.int32))


def test_q8_0_x86_equals_gguf_q8_0_except_at_rounding_ties():
    x = _blocks(4000, seed=5)
    codes, d = q8_0_x86_blocks(x)
    ref = gq.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    mine = _q8_bytes(codes, d)
    differ = (ref != mine).any(1)
    assert differ.mean() < 1e-3  # the two roundings agree away from (near-)ties
    assert np.array_equal(ref[:, :2], mine[:, :2])  # the scales always agree


# --------------------------------------------------------------------------------------------------- the library
def _libs():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e .[parity])")
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    try:
        return ctypes.CDLL(os.path.join(libdir, "libggml-base.so")), ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
    except OSError as exc:  # pragma: no cover - other platforms
        pytest.skip(f"ggml shared libraries not found: {exc}")


def _ggml(fn, x: torch.Tensor, block_bytes: int) -> np.ndarray:
    """Call a ggml ``quantize_row_*(const float *, void *, int64_t)`` on rows of 32: bytes [n_blocks, block_bytes]."""
    src = np.ascontiguousarray(x.numpy(), dtype=np.float32).reshape(-1)
    out = np.zeros(src.size // 32 * block_bytes, np.uint8)
    fn.restype = None
    fn(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(src.size))
    return out.reshape(-1, block_bytes)


def test_iq4_nl_equals_llamacpp_cache_write_byte_for_byte():
    """``quantize_row_iq4_nl`` of libggml-cpu (what set_rows calls for an iq4_nl cache). All-zero blocks are left
    out: ggml leaves their indices as whatever its buffer held (they decode to 0 either way)."""
    _, cpu = _libs()
    x = _blocks(20000, seed=7)[1:]
    ref = _ggml(cpu.quantize_row_iq4_nl, x, 18)
    idx, d = iq4_nl_blocks(x)
    assert np.array_equal(ref, iq4_nl_to_ggml_bytes(idx, d).numpy())


def test_q8_0_x86_equals_llamacpp_cache_write_byte_for_byte():
    """``quantize_row_q8_0`` of libggml-cpu (x86: 127/amax, round half to even), with crafted ties; kveval's
    ``q8_0`` equals the reference ``quantize_row_q8_0_ref`` of libggml-base instead."""
    base, cpu = _libs()
    x = _blocks(20000, seed=8)
    ties = torch.zeros(8, 32)
    ties[:, 0] = 127 / 32
    ties[:, 1:31] = torch.arange(1, 31) / 64 * torch.tensor([1.0, -1.0]).repeat(15)
    ties[4:, 0] = 1.375
    ties[4:, 1:8] = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]) / (torch.tensor(127.0) / 1.375)
    x = torch.cat([x, ties])
    codes, d = q8_0_x86_blocks(x)
    assert np.array_equal(_ggml(cpu.quantize_row_q8_0, x, 34), _q8_bytes(codes, d))
    ref_codes, ref_d, _ = ggml_quantize_blocks(x.clone(), "q8_0")
    lib_ref = _ggml(base.quantize_row_q8_0_ref, x, 34)
    assert np.array_equal(lib_ref, _q8_bytes(ref_codes, ref_d))
    assert not np.array_equal(lib_ref[-8:], _q8_bytes(codes, d)[-8:])  # the ties tell the two apart


@pytest.mark.parametrize("kind, block_bytes", [("q4_0", 18), ("q4_1", 20), ("q5_0", 22), ("q5_1", 24)])
def test_ggml_types_equal_llamacpp_cache_write(kind, block_bytes):
    """q4_0/q4_1/q5_0/q5_1 cache writes call the reference quantizers: kveval's formats decode to the values the
    library's bytes decode to (``dequantize_row_*`` of libggml-base)."""
    base, cpu = _libs()
    x = _blocks(4000, seed=9)
    raw = _ggml(getattr(cpu, f"quantize_row_{kind}"), x, block_bytes)
    deq = getattr(base, f"dequantize_row_{kind}")
    deq.restype = None
    out = np.zeros(x.numel(), np.float32)
    deq(raw.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.numel()))
    mine = fake_quantize(x.reshape(1, 1, -1, 32), preset(kind)).numpy().reshape(-1)
    assert np.array_equal(out.view(np.int32), mine.view(np.int32))
