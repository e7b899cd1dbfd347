"""Native (C) kernels for CPU hot paths that eager PyTorch runs as several memory passes, with the same numbers.

Two kernels, one library:

* ``dequant.c``: packed integer codes (format ``int``, per-token, per-group or per-channel statistics) unpacked,
  converted, scaled and offset in one pass over the output, the lean read path's decode step
  (``kveval.quant.formats.integer.IntFormat.read_packed_into``; ``dequantize_int``);
* ``quant.c``: rows quantized to packed integer codes (dynamic per-token or per-group statistics): statistics,
  scales in their storage dtype, codes, packing and read-back values in one pass, the real cache's store of new
  tokens (``IntFormat.quantize_packed``; ``quantize_int``).

It is built on first use with the system C compiler
(``$CC``, else ``cc``, ``gcc`` or ``clang``; 0.2-0.5 s) into ``<cache>/native/<key>/`` (the key hashes the source,
the flags, the compiler and the machine), checked against the eager arithmetic on a fixed example, and loaded with
ctypes. Without a compiler, with ``KVEVAL_NATIVE=0``, with a cache folder it cannot write, after a failed build or
a failed check, ``dequantize_int`` answers False (``quantize_int`` None) and the caller takes the eager path: the
same numbers, only slower.

A build writes a temporary file and renames it into place, so runs that build at once each end with a whole
library; a cached library that does not load (truncated, another machine's) is rebuilt once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kveval.errors import KvevalError

SOURCES = (Path(__file__).with_name("dequant.c"), Path(__file__).with_name("quant.c"))
#: -ffp-contract=off: every multiply and add rounds on its own, as PyTorch's element-wise kernels do
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
#: tried first (a compiler without OpenMP builds without it)
OPENMP = ("-fopenmp",)
#: the kernel's modes (dequant.c): how a code becomes a value
MODES = {"symmetric": 0, "float": 1, "int": 2}
#: quant.c's scale storage dtypes
SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_lib: ctypes.CDLL | None = None
_tried = False


def compiler() -> str | None:
    """The C compiler a build uses: ``$CC``, else the first of cc, gcc, clang on PATH; None without one."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return next((p for p in (shutil.which(n) for n in ("cc", "gcc", "clang")) if p), None)


def library_path(cc: str) -> Path:
    """Where the library built by ``cc`` from this source is cached."""
    from kveval.paths import cache_dir  # KvevalError when the cache folder cannot be used

    source = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(source + repr((FLAGS, OPENMP, cc, platform.machine(), sys.platform)).encode())
    return cache_dir("native", key.hexdigest()[:16]) / "libkveval_native.so"


def _build(cc: str, target: Path) -> None:
    """Compile with OpenMP (the rows split across PyTorch's threads; its runtime, already loaded, is the one the
    library binds to), else without (one thread: a compiler without OpenMP)."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        for extra in (OPENMP, ()):
            try:
                subprocess.run([cc, *FLAGS, *extra, *map(str, SOURCES), "-o", str(tmp)], check=True, capture_output=True,
                               timeout=300)
                break
            except subprocess.CalledProcessError:
                if not extra:
                    raise
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.kveval_dequant_int
    p, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [p, i64p, p, i64p, p, i64p, p, i64p, i64p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    fq = lib.kveval_quant_int
    fq.argtypes = [p, i64p, i64p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                   ctypes.c_int, p, p, p, p, ctypes.c_int]
    fq.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None when it is not to be had (module docstring). Tried once
    per process (``reset`` forgets the attempt)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("KVEVAL_NATIVE", "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        return None
    try:
        path = library_path(cc)
        if not path.is_file():
            _build(cc, path)
        try:
            lib = _load(path)
        except OSError:  # a cached file that does not load: build it again, once
            _build(cc, path)
            lib = _load(path)
    except (OSError, AttributeError, subprocess.SubprocessError, ValueError, KvevalError):
        return None  # no library to be had (AttributeError: one without the kernel's symbol)
    _lib = lib if _self_check(lib) else None
    return _lib


def reset() -> None:
    """Forget the loaded library and the attempt (tests; a changed ``CC`` or ``KVEVAL_NATIVE``)."""
    global _lib, _tried
    _lib, _tried = None, False


def _strides(t: torch.Tensor, n: int):
    return (ctypes.c_int64 * n)(*t.stride()[:n])


def _call(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, out: torch.Tensor,
          bits: int, offset: int, mode: int, token_block: int = 1) -> bool:
    B, H, T, D = out.shape
    groups = scale.shape[3]
    z = zero if zero is not None else scale
    rc = lib.kveval_dequant_int(
        packed.data_ptr(), _strides(packed, 3), scale.data_ptr(), _strides(scale, 4),
        zero.data_ptr() if zero is not None else None, _strides(z, 4), out.data_ptr(), _strides(out, 3),
        (ctypes.c_int64 * 4)(B, H, T, D), groups, token_block, bits, offset, mode, torch.get_num_threads())
    return rc == 0


def dequantize_int(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, out: torch.Tensor, *,
                   bits: int, offset: int, mode: str, token_block: int = 1) -> bool:
    """Write the values of packed integer codes into ``out``, or answer False (nothing written) when the kernel is
    not available or does not take these arguments.

    ``packed`` uint8 ``[B, H, T, D * bits / 8]`` (``kveval.quant.packing.pack``'s rows); ``scale`` and ``zero``
    float32 ``[B, H, ceil(T / token_block), G]``: G groups of D / G codes, each a whole number of bytes, or G = D
    (a parameter per channel); token t reads row ``t // token_block`` (1 for per-token and per-group statistics,
    KIVI's block for per-channel ones); granularity.py's scale shapes are taken as they are (``[B, H, T, G, 1]``,
    ``[B, H, NB, 1, D]``); ``zero`` None for ``mode="symmetric"``. ``out`` float32 ``[B, H, T, D]`` (a view,
    strided along B, H, T). Code q = field - ``offset``; ``mode``: ``symmetric`` (0 + q*s), ``float`` (q*s + m)
    or ``int`` ((q - z)*s) zero point. All on the CPU, each last dim contiguous."""
    lib = library()
    if lib is None or bits not in (1, 2, 4, 8) or token_block < 1:
        return False
    if scale.dim() == 5:  # [B, H, T, G, 1] (groups) or [B, H, NB, 1, D] (channels)
        dim = 4 if scale.shape[4] == 1 else 3
        scale = scale.squeeze(dim)
        zero = None if zero is None else zero.squeeze(dim)
    tensors = [packed, scale, out] + ([zero] if zero is not None else [])
    if any(t.device.type != "cpu" or t.dim() != 4 or (t.shape[-1] > 1 and t.stride(-1) != 1) for t in tensors):
        return False
    B, H, T, D = out.shape
    G = scale.shape[3]
    rows = -(-T // token_block)
    if (packed.dtype != torch.uint8 or out.dtype != torch.float32 or scale.dtype != torch.float32
            or tuple(packed.shape) != (B, H, T, D * bits // 8) or D * bits % 8 or G < 1 or D % G
            or (G != D and (D // G) * bits % 8) or tuple(scale.shape) != (B, H, rows, G)
            or (zero is None) != (mode == "symmetric")
            or (zero is not None and (zero.dtype != torch.float32 or zero.shape != scale.shape))):
        return False
    return _call(lib, packed, scale, zero, out, bits, offset, MODES[mode], token_block)


@dataclass(frozen=True)
class Quantized:
    """What ``quantize_int`` wrote for x ``[B, H, T, D]``: ``packed`` uint8 ``[B, H, T, ceil(D * bits / 8)]``
    (``kveval.quant.packing.pack``'s rows), ``scale`` ``[B, H, T, G]`` in the scale dtype, ``zero`` of that shape
    (the scale dtype for a float zero point, uint8 for an int one, None for symmetric codes), ``decoded`` float32
    ``[B, H, T, D]`` (None unless asked for); ``finite`` False when x held a NaN or an infinity (nothing else is
    then meaningful)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    decoded: torch.Tensor | None
    finite: bool


def _quantize(lib: ctypes.CDLL, x: torch.Tensor, groups: int, bits: int, mode: str, clip: float,
              scale_dtype: torch.dtype, decode: bool) -> Quantized | None:
    B, H, T, D = x.shape
    packed = torch.empty(B, H, T, -(-D * bits // 8), dtype=torch.uint8)
    scale = torch.empty(B, H, T, groups, dtype=scale_dtype)
    zero = None if mode == "symmetric" else torch.empty_like(scale, dtype=torch.uint8 if mode == "int" else None)
    decoded = torch.empty(B, H, T, D) if decode else None
    rc = lib.kveval_quant_int(
        x.data_ptr(), _strides(x, 3), (ctypes.c_int64 * 4)(B, H, T, D), groups, bits, MODES[mode], clip,
        int(clip != 1.0), SCALE_DTYPES[scale_dtype], packed.data_ptr(), scale.data_ptr(),
        None if zero is None else zero.data_ptr(), None if decoded is None else decoded.data_ptr(),
        torch.get_num_threads())
    return None if rc < 0 else Quantized(packed, scale, zero, decoded, rc == 0)


def quantize_int(x: torch.Tensor, *, groups: int, bits: int, mode: str, clip: float, scale_dtype: torch.dtype,
                 decode: bool) -> Quantized | None:
    """x ``[B, H, T, D]`` quantized to packed integer codes with dynamic statistics over ``groups`` groups of each
    row (1: per token), ``bits`` wide, ``mode`` as for ``dequantize_int``, clip ratio ``clip``, scales (and a float
    zero point) rounded to ``scale_dtype`` (float32, float16 or bfloat16), the read-back values too when
    ``decode``: the arithmetic of ``kveval.quant.formats.integer.IntFormat`` (quant.c's header). None (nothing
    done) when the kernel is not available or does not take these arguments: x float32 on the CPU, its last
    dimension contiguous and divided by ``groups``, not empty."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or not x.numel()
            or (x.shape[-1] > 1 and x.stride(-1) != 1) or scale_dtype not in SCALE_DTYPES or not 1 <= bits <= 8
            or (mode == "symmetric" and bits < 2) or groups < 1 or x.shape[-1] % groups):
        return None
    return _quantize(lib, x, groups, bits, mode, clip, scale_dtype, decode)


def _quant_check(lib: ctypes.CDLL) -> bool:
    """Whether quant.c gives the eager arithmetic's scales, packed codes and read-back values on a fixed example of
    every mode: 4-bit codes, groups of 8, float16 scales, an all-zero group (a zero scale)."""
    x = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 0, 0, :8] = 0.0
    xv = x.view(1, 2, 3, 2, 8)
    mn, mx = xv.amin(-1, keepdim=True), xv.amax(-1, keepdim=True)

    def store(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(-65504, 65504).to(torch.float16).add_(0.0)

    for mode in MODES:
        top = 7 if mode == "symmetric" else 15
        lo = mn.clamp(max=0.0) if mode == "int" else mn
        hi = mx.clamp(min=0.0) if mode == "int" else mx
        s = store(torch.maximum(-mn, mx) / 7) if mode == "symmetric" else store((hi - lo) / 15)
        sf = s.float()
        safe = torch.where(sf == 0, 1.0, sf)
        if mode == "symmetric":
            zero, q = None, (xv / safe).round().clamp(-8, 7)
            want = 0.0 + q * sf
        elif mode == "float":
            zero = store(mn)
            q = ((xv - zero.float()) / safe).round().clamp(0, top)
            want = q * sf + zero.float()
        else:
            zero = (-lo / safe).round().clamp(0, top).to(torch.uint8)
            q = ((xv / safe).round() + zero.float()).clamp(0, top)
            want = (q - zero.float()) * sf
        u = (q + (8 if mode == "symmetric" else 0)).to(torch.uint8).reshape(1, 2, 3, 16)
        got = _quantize(lib, x, 2, 4, mode, 1.0, torch.float16, True)
        if (got is None or not got.finite or got.decoded is None
                or not torch.equal(got.decoded.view(torch.int32), want.reshape(1, 2, 3, 16).view(torch.int32))
                or not torch.equal(got.scale.view(torch.int16), s.reshape(1, 2, 3, 2).view(torch.int16))
                or not torch.equal(got.packed, u[..., 0::2] | (u[..., 1::2] << 4))
                or (zero is None) != (got.zero is None)
                or (zero is not None and got.zero is not None
                    and not torch.equal(got.zero.view(torch.uint8), zero.reshape(1, 2, 3, 2).contiguous()
                                        .view(torch.uint8)))):
            return False
    return True


def _self_check(lib: ctypes.CDLL) -> bool:
    """Whether the built kernel gives the eager arithmetic's bits on a fixed example of every mode (a compiler that
    fused a multiply-add despite the flags would fail it): 4-bit codes, groups of 8, float32 scales that make
    rounding matter."""
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (1, 2, 5, 16), generator=g, dtype=torch.uint8)
    packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()
    s = torch.rand(1, 2, 5, 2, generator=g) / 3
    m = torch.randn(1, 2, 5, 2, generator=g)
    z = torch.randint(0, 16, (1, 2, 5, 2), generator=g).float()
    q = u.float().view(1, 2, 5, 2, 8)
    for mode, zero, want in (("symmetric", None, torch.addcmul(q.new_zeros(()), q - 8, s[..., None])),
                             ("float", m, q * s[..., None] + m[..., None]),
                             ("int", z, (q - z[..., None]) * s[..., None])):
        out = torch.empty(1, 2, 5, 16)
        offset = 8 if mode == "symmetric" else 0
        if not _call(lib, packed, s, zero, out, 4, offset, MODES[mode]):
            return False
        if not torch.equal(out.view(torch.int32), want.reshape(1, 2, 5, 16).view(torch.int32)):
            return False
    return _quant_check(lib)
