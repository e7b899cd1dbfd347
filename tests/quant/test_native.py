"""The native dequantization kernel (kveval.native, dequant.c) against the eager arithmetic, bit for bit, and what
happens when it cannot be had: no compiler, switched off, a corrupted cached library, two builds at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kveval import native
from kveval.quant.primitives import dequantize, quantize
from kveval.quant.spec import QuantSpec

ROOT = Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """A cache of its own and a module that has not tried to build yet (and forgets this test's attempt)."""
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    native.reset()
    yield tmp_path / "cache"
    native.reset()


@pytest.fixture(scope="module")
def built_native(tmp_path_factory):
    """One cache (one build) for the parity tests of this module."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("KVEVAL_CACHE", str(tmp_path_factory.mktemp("native-cache")))
        native.reset()
        yield
    native.reset()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns (torch.equal takes -0.0 for +0.0)."""
    return t.contiguous().view(torch.int32)


def _read(spec: QuantSpec, x: torch.Tensor, front: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager, read_packed_into) values of x's stored form, the tokens before ``front`` dropped from the packed rows
    and the scales as a sliding window does (views, not copies), into a slice of a larger read buffer."""
    qt = quantize(x, spec)
    fmt = qt.spec.fmt
    packed = fmt.pack(qt.codes, qt.spec)[:, :, front:]
    rows = front // qt.channel_block if qt.spec.granularity == "channel" else front  # parameter rows dropped
    cut = replace(qt, codes=torch.empty(0, dtype=qt.codes.dtype), scale=qt.scale[:, :, rows:],
                  zero_point=None if qt.zero_point is None else qt.zero_point[:, :, rows:],
                  shape=torch.Size([*qt.shape[:2], qt.shape[2] - front, qt.shape[3]]))
    want = dequantize(qt)[:, :, front:]
    B, H, T, D = want.shape
    buf = torch.full((B, H, T + 9, D), float("nan"))
    out = buf[:, :, 4:4 + T]
    fmt.read_packed_into(cut, packed, D, out)
    assert bool(torch.isnan(buf[:, :, :4]).all()) and bool(torch.isnan(buf[:, :, 4 + T:]).all())  # only out
    return want, out


#: (bits, mapping, zero point) the kernel takes: every integer spec but symmetric 1-bit, which the format refuses
CODES = [(b, m, z) for b in (1, 2, 4, 8) for m, z in (("symmetric", "float"), ("asymmetric", "float"),
                                                     ("asymmetric", "int")) if (b, m) != (1, "symmetric")]


@needs_compiler
@pytest.mark.parametrize("codes", CODES, ids=lambda c: f"int{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("gran", [("token", 0), ("group", 16), ("group", 32), ("channel", 8), ("channel", 0)],
                         ids=lambda g: f"{g[0]}{g[1] or ''}")
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_native_read_is_the_eager_arithmetic_bit_for_bit(codes, gran, scale_dtype, native_answers, built_native):
    bits, mapping, zero_point = codes
    granularity, size = gran
    # per channel: KIVI's token blocks of 8 (37 tokens: a partial last block), or one block of all the tokens
    spec = QuantSpec(format="int", bits=bits, granularity=granularity, scale_dtype=scale_dtype, mapping=mapping,
                     zero_point=zero_point, **({"group_size": size} if size else {}))
    front = (0, 8) if granularity == "channel" else (0, 3)  # per-channel eviction drops whole blocks
    g = torch.Generator().manual_seed(bits * 100 + size)
    x = torch.randn(2, 3, 37, 64, generator=g) * torch.logspace(-3, 3, 64)  # scales of every size
    x[0, 1, 5] = 0.0  # a zero scale
    x[1, 2, 7, :32] = -1e-30  # tiny negatives: -0.0 products
    cuts = [c for c in front if not (granularity == "channel" and not size and c)]  # one block: nothing to evict
    for cut in cuts:
        want, got = _read(spec, x, cut)
        assert torch.equal(_bits(got), _bits(want))
    assert native_answers == [True] * len(cuts)  # the kernel wrote them, not the eager fallback  # the kernel wrote them, not the eager fallback


@needs_compiler
def test_native_read_splits_large_reads_across_threads_with_the_same_bits(native_answers, built_native):
    """An output of 2 x 4 x 600 x 128 elements (over the kernel's PARALLEL_MIN) with 1 and with 2 threads."""
    spec = QuantSpec(format="int", bits=4, granularity="group", group_size=64, mapping="asymmetric",
                     zero_point="float", scale_dtype="float16")
    x = torch.randn(2, 4, 600, 128, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            want, got = _read(spec, x)
            assert torch.equal(_bits(got), _bits(want))
    finally:
        torch.set_num_threads(threads)
    assert native_answers == [True, True]


def test_without_the_kernel_the_read_is_the_eager_path(monkeypatch, native_answers, fresh_native):
    """KVEVAL_NATIVE=0, a compiler that does not exist, one that fails, one that exits 0 and writes nothing, a cache
    folder that cannot be made: no library, the same values by the eager path."""
    spec = QuantSpec(format="int", bits=4, granularity="group", group_size=32, mapping="asymmetric")
    x = torch.randn(1, 2, 9, 64, generator=torch.Generator().manual_seed(1))
    blocked = fresh_native.parent / "a-file"
    blocked.write_text("not a folder")
    broken = [("CC", c) for c in ("false", "true") if shutil.which(c)]  # a compiler that fails, one that writes nothing
    for env, value in (("KVEVAL_NATIVE", "0"), ("CC", str(fresh_native / "no-such-cc")), *broken,
                       ("KVEVAL_CACHE", str(blocked))):  # a cache folder that cannot be made
        with monkeypatch.context() as m:
            m.setenv(env, value)
            native.reset()
            native_answers.clear()
            want, got = _read(spec, x)
            assert native.library() is None
            assert native_answers == [False]
            assert torch.equal(_bits(got), _bits(want))
    native.reset()


def _library_in_a_new_process(cache: Path) -> subprocess.CompletedProcess:
    """``native.library()`` in a fresh interpreter (a library this process loaded must not be overwritten under
    it): prints the library's path, exit status 3 without one."""
    code = ("from kveval import native; import sys; lib = native.library(); "
            "print(native.library_path(native.compiler())); sys.exit(0 if lib is not None else 3)")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVEVAL_CACHE": str(cache)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@needs_compiler
def test_a_corrupted_cached_library_is_rebuilt(fresh_native):
    first = _library_in_a_new_process(fresh_native)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    path.write_bytes(b"\x7fELF not really a library")  # truncated: what an interrupted copy leaves
    again = _library_in_a_new_process(fresh_native)
    assert again.returncode == 0, again.stderr  # rebuilt in place, loaded, self-checked
    assert path.read_bytes()[:4] == b"\x7fELF" and path.stat().st_size > 1000


@needs_compiler
def test_two_processes_building_at_once_both_get_a_whole_library(fresh_native):
    code = "from kveval import native; import sys; sys.exit(0 if native.library() is not None else 3)"
    env = {**os.environ, "KVEVAL_CACHE": str(fresh_native)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    built = list(fresh_native.glob("native/*/*"))
    assert [p.name for p in built] == ["libkveval_native.so"]  # no temporary left behind


def test_arguments_the_kernel_does_not_take_are_answered_false(fresh_native):
    """Shapes, dtypes and layouts outside the kernel's contract never reach it (the caller goes eager)."""
    packed = torch.zeros(1, 1, 4, 32, dtype=torch.uint8)
    scale = torch.ones(1, 1, 4, 1)
    out = torch.empty(1, 1, 4, 64)
    ok = dict(bits=4, offset=0, mode="float")
    assert native.dequantize_int(packed, scale, scale, out, **{**ok, "bits": 3}) is False
    assert native.dequantize_int(packed, scale.double(), scale, out, **ok) is False
    assert native.dequantize_int(packed, scale, scale, out.double(), **ok) is False
    assert native.dequantize_int(packed[..., :16], scale, scale, out, **ok) is False  # wrong row bytes
    assert native.dequantize_int(packed, scale, None, out, **ok) is False  # float zero point missing
    assert native.dequantize_int(packed, scale, scale, out.transpose(2, 3).contiguous().transpose(2, 3),
                                 **ok) is False  # head_dim not contiguous
