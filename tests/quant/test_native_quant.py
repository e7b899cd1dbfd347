"""The native quantization kernel (kveval.native, quant.c) against the eager arithmetic, bit for bit: scales, zero
points, packed codes and read-back values of ``quantize_packed`` equal ``quantize`` + ``pack`` + ``dequantize``;
non-finite input refused alike; the real cache stores the same bytes and reads the same values with the kernel and
without it."""

from __future__ import annotations

import pytest
import torch

from kveval import native
from kveval.quant.formats.base import NONFINITE
from kveval.quant.primitives import dequantize, quantize, quantize_packed
from kveval.quant.spec import QuantSpec

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def built_native(tmp_path_factory):
    """One cache (one build) for this module."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVEVAL_CACHE", str(tmp_path_factory.mktemp("native-quant-cache")))
        native.reset()
        assert native.library() is not None
        yield
    native.reset()


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """The bit patterns of a tensor (torch.equal takes -0.0 for +0.0 and never NaN for NaN)."""
    if t is None or not t.is_floating_point():
        return t
    view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _hard_input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Rows of every size (1e-7 to 1e7: float16 scales that underflow to subnormals or zero and that clamp at
    65504), an all-zero row, a constant row, -0.0 entries, ties at half a step, a row of one sign."""
    g = torch.Generator().manual_seed(seed)
    B, H, T, D = shape
    x = torch.randn(shape, generator=g) * torch.logspace(-7, 7, T).view(1, 1, T, 1)
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 0.75
    x[0, -1, 2, ::2] = -0.0
    x[-1, 0, 3] = torch.arange(D) * 0.5 - 3.0  # multiples of a half: codes on ties
    x[-1, -1, 4] = x[-1, -1, 4].abs() + 1.0  # all positive: an int zero point of 0
    return x


def _eager(x: torch.Tensor, spec: QuantSpec):
    qt = quantize(x, spec)
    return qt, qt.spec.fmt.pack(qt.codes, qt.spec), dequantize(qt)


SPECS = [dict(bits=b, mapping=m, zero_point=z) for b in range(1, 9)
         for m, z in (("symmetric", "float"), ("asymmetric", "float"), ("asymmetric", "int"))
         if (b, m) != (1, "symmetric")]


@needs_compiler
@pytest.mark.parametrize("codes", SPECS, ids=lambda c: f"int{c['bits']}-{c['mapping'][:4]}-{c['zero_point']}")
@pytest.mark.parametrize("gran", [("token", 0), ("group", 16), ("group", 32)], ids=lambda g: f"{g[0]}{g[1] or ''}")
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_fused_store_is_quantize_pack_dequantize_bit_for_bit(codes, gran, scale_dtype, built_native):
    granularity, size = gran
    for clip in (1.0, 0.9):
        spec = QuantSpec(format="int", granularity=granularity, scale_dtype=scale_dtype, clip_ratio=clip,
                         **({"group_size": size} if size else {}), **codes)
        x = _hard_input((2, 3, 12, 64), seed=codes["bits"] * 10 + size)
        fused = quantize_packed(x, spec)
        assert fused is not None, "the kernel did not take a spec it is written for"
        qt, packed, decoded = fused
        want, want_packed, want_decoded = _eager(x, spec)
        assert torch.equal(packed, want_packed)
        assert _same(qt.scale, want.scale) and _same(qt.zero_point, want.zero_point)
        assert _same(decoded, want_decoded)
        assert (qt.shape, qt.dtype, qt.spec, qt.codes.numel()) == (want.shape, want.dtype, want.spec, 0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_compute_in_float32_as_eager(dtype, built_native):
    """A 16-bit model's keys: computed in float32 and read back in the model's dtype; scales of dtype ``model``."""
    for scale_dtype in ("model", "float16"):
        spec = QuantSpec(format="int", bits=4, granularity="group", group_size=32, scale_dtype=scale_dtype)
        x = (torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
        qt, packed, decoded = quantize_packed(x, spec)
        want, want_packed, want_decoded = _eager(x, spec)
        assert torch.equal(packed, want_packed) and _same(decoded, want_decoded) and decoded.dtype == dtype
        assert _same(qt.scale, want.scale) and _same(qt.zero_point, want.zero_point)


@needs_compiler
def test_strided_inputs_and_the_threaded_path(built_native):
    """A slice of a larger buffer along tokens and rows (what a cache's flush quantizes), and an input over the
    kernel's PARALLEL_MIN with 1 and 2 threads."""
    spec = QuantSpec(format="int", bits=2, granularity="group", group_size=32)
    buf = _hard_input((3, 2, 40, 64), seed=7)
    for x in (buf[1:3, :, 5:17], buf[:, :, 9:10], buf[::2]):
        assert not x.is_contiguous()
        qt, packed, decoded = quantize_packed(x, spec)
        want, want_packed, want_decoded = _eager(x, spec)
        assert torch.equal(packed, want_packed) and _same(decoded, want_decoded) and _same(qt.scale, want.scale)
    big = torch.randn(2, 4, 300, 128, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            qt, packed, decoded = quantize_packed(big, spec)
            want, want_packed, want_decoded = _eager(big, spec)
            assert torch.equal(packed, want_packed) and _same(decoded, want_decoded)
    finally:
        torch.set_num_threads(threads)


@needs_compiler
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_as_eager_refuses_it(bad, built_native):
    spec = QuantSpec(format="int", bits=8, granularity="token", mapping="symmetric")
    x = torch.randn(1, 2, 4, 64)
    x[0, 1, 3, 17] = bad
    with pytest.raises(ValueError, match=NONFINITE):
        quantize(x, spec)
    with pytest.raises(ValueError, match=NONFINITE):
        quantize_packed(x, spec)


@needs_compiler
def test_what_the_kernel_does_not_take_goes_the_long_way(built_native):
    """Outliers, a fixed static scale (per tensor), per-channel statistics, other formats and float64 inputs: None (the cache
    then quantizes, packs and dequantizes); the spec 'none' too."""
    x = torch.randn(1, 2, 4, 64)
    for spec in (QuantSpec(format="int", bits=4, outliers=0.02), QuantSpec(format="int", bits=8, mapping="symmetric",
                                                                           granularity="tensor", static_scale=0.1),
                 QuantSpec(format="int", bits=2, granularity="channel"), QuantSpec(format="fp8_e4m3"),
                 QuantSpec(format="none")):
        assert quantize_packed(x, spec) is None
    assert quantize_packed(x.double(), QuantSpec(format="int", bits=4)) is None
    assert quantize_packed(x[:, :, :0], QuantSpec(format="int", bits=4)) is None
    assert native.quantize_int(x.double(), groups=1, bits=4, mode="float", clip=1.0, scale_dtype=torch.float16,
                               decode=True) is None
    assert native.quantize_int(x, groups=3, bits=4, mode="float", clip=1.0, scale_dtype=torch.float16,
                               decode=True) is None  # groups that do not divide head_dim
    assert native.quantize_int(torch.randn(1, 1, 2, 4104), groups=1, bits=4, mode="float", clip=1.0,
                               scale_dtype=torch.float16, decode=True) is None  # rows over quant.c's CODES_MAX


def _decode_run(model, policy, ids, steps: int):
    """Logits of a prefill and ``steps`` greedy decode steps through the real cache, and its stored pieces."""
    from kveval.patch import QuantizedKVCache, cache_kwargs

    cache = QuantizedKVCache(model, policy, read="buffered")
    logits = []
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    pieces = [(p.start, p.end, p.chunk.packed, p.chunk.qt.scale, p.chunk.qt.zero_point)
              for layer in cache.layers for store in layer.stores.values() for p in store.pieces]
    return torch.stack(logits), pieces


@needs_compiler
@pytest.mark.parametrize("preset", ["int8", "int4_g32", "int2_g32", "int4_token", "kivi2"])
def test_the_real_cache_is_the_same_with_and_without_the_kernel(preset, monkeypatch, built_native, tiny_llama):
    """Decoding through QuantizedKVCache: the same logits, bit for bit, and the same stored bytes, with the fused
    store and with KVEVAL_NATIVE=0 (the eager quantize, pack and dequantize)."""
    from kveval.policy import KVPolicy

    model, _ = tiny_llama
    ids = torch.randint(0, model.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))
    policy = KVPolicy.preset(preset)
    calls = []
    real = native.quantize_int
    monkeypatch.setattr(native, "quantize_int", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused_logits, fused_pieces = _decode_run(model, policy, ids, 12)
    assert calls, "the fused store did not run"
    monkeypatch.setenv("KVEVAL_NATIVE", "0")
    native.reset()
    eager_logits, eager_pieces = _decode_run(model, policy, ids, 12)
    monkeypatch.delenv("KVEVAL_NATIVE")
    native.reset()
    assert torch.equal(_bits(fused_logits), _bits(eager_logits))
    assert len(fused_pieces) == len(eager_pieces)
    for a, b in zip(fused_pieces, eager_pieces, strict=True):
        assert a[:2] == b[:2] and torch.equal(a[2], b[2]) and _same(a[3], b[3]) and _same(a[4], b[4])
