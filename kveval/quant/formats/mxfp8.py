"""MXFP8 as SGLang's KV cache stores it (``--kv-cache-dtype mxfp8``, the FA4 backend): FP8 E4M3 codes in blocks of
32 elements of head_dim, one E8M0 power-of-two scale per block.

Source: SGLang 0.5.23 ``sglang/kernels/ops/kvcache/mxfp8_quant_store_kv.py`` (``_mxfp8_quant_store_qkv_kernel``
L8-78, called by ``quant_store_kv_mxfp8`` from ``MHATokenToKVPoolMXFP8.set_kv_buffer``,
``srt/mem_cache/memory_pool.py`` L4000-4030; ``kv_cache_dtype.py`` maps ``mxfp8`` to ``torch.float8_e4m3fn``
storage). Per block of 32, in float32 (the kernel loads ``x.to(tl.float32)``)::

    amax = max(max |x|, 1e-30)
    s    = clamp(ceil(log2(amax / 448)) + 127, 0, 254)        # the E8M0 byte
    q    = e4m3(clamp(x / 2^(s - 127), -448, 448))            # round to nearest even
    x^   = float(q) * 2^(s - 127)

Worked: a block whose max is 500 -> log2(500 / 448) = 0.158 -> s = 128, scale 2: x = 500 -> 250 -> e4m3 256 ->
512; x = 3.3 -> 1.65 -> 1.625 -> 3.25. A block of zeros gets s = ceil(log2(1e-30 / 448)) + 127 = 19.

Storage: one code byte per element plus one scale byte per 32 (8.25 bits per element; the page layout of the
scales, FA4's interleaved ``(NKV, 32, PAGE // 32, SF)``, changes nothing in the count). No fixed parameters:
every block scales itself. Assumed rather than read on a GPU: Triton's ``tl.log2`` taken as exact (an
approximate ``lg2`` could move ``ceil`` by one just above an exact power of two times 448) and its float-to-e4m3
cast as round to nearest even. SGLang's FA4 attention also rounds the query to MXFP8 (the layer's per-token
``q_descale``); the format is the cache alone.
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, check_finite
from .segment import QuantFormat

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


def mxfp8_fit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``x [..., 32]`` (float32) -> (e4m3 codes ``[..., 32]``, E8M0 scale bytes as float32 ``[..., 1]``),
    as SGLang's store kernel (module docstring)."""
    amax = torch.clamp(x.abs().amax(-1, keepdim=True), min=1e-30)
    s = torch.clamp(torch.ceil(torch.log2(amax / E4M3_MAX)) + E8M0_BIAS, 0.0, 254.0)
    descale = torch.exp2(s - E8M0_BIAS)
    codes = torch.clamp(x / descale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, s


class MXFP8Format(QuantFormat):
    """SGLang's MXFP8 KV cache: E4M3 in blocks of 32 with an E8M0 scale (module docstring)."""

    name = "mxfp8"
    mappings = ("symmetric",)
    supports_static = False
    scale_dtypes = ("e8m0",)

    def validate(self, spec: Spec) -> None:
        if spec.bits != 8:
            raise ValueError(f"QuantSpec.bits must be 8 for format 'mxfp8' (E4M3 codes); got {spec.bits}")
        super().validate(spec)
        if spec.granularity != "group" or spec.group_size != BLOCK:
            raise ValueError(f"format 'mxfp8' scales blocks of {BLOCK} elements of head_dim: granularity 'group' with "
                             f"group_size {BLOCK}; got {spec.granularity!r} {spec.group_size!r}")
        if spec.scale_dtype != "e8m0":
            raise ValueError(f"format 'mxfp8' stores E8M0 scales: scale_dtype must be 'e8m0'; got {spec.scale_dtype!r}")
        if spec.outliers:
            raise ValueError("format 'mxfp8' takes no outliers")

    def check_head_dim(self, spec: Spec, head_dim: int) -> None:
        if head_dim % BLOCK:
            raise ValueError(f"format 'mxfp8' quantizes blocks of {BLOCK} elements: head_dim {head_dim} is not a "
                             f"multiple of {BLOCK}")

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # the kernel converts the bf16 K/V to float32

    def code_bits(self, spec: Spec) -> int:
        return 8

    def bits_label(self, spec: Spec) -> str:
        return "MXFP8"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.float8_e4m3fn

    def param_nbytes(self, spec: Spec) -> int:
        return 1  # one E8M0 byte per block

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        return codes.view(torch.uint8)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != n:
            raise ValueError(f"expected uint8 [..., {n}] for {n} mxfp8 codes; got {packed.dtype} {tuple(packed.shape)}")
        return packed.view(torch.float8_e4m3fn)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError("format 'mxfp8' computes its block scales from each block; it takes no fixed parameters")

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError("format 'mxfp8' computes its block scales from each block; it takes no fixed parameters")

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """xv ``[..., 32]`` (group segment): codes and E8M0 scales ``[..., 1]``."""
        check_finite(xv.abs().amax(-1))
        codes, s = mxfp8_fit(xv.to(torch.float32))
        return codes, QParams(s.to(torch.uint8).view(torch.float8_e8m0fnu))

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        return self.fit(xv, dims, spec)[1]

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """x^ = float(code) * 2^(s - 127) (exact in float32)."""
        return codes.to(scale.dtype).mul_(scale)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        codes, qp = self.fit(xv, dims, spec)
        return self.decode(codes, qp.scale.to(torch.float32), None, spec).to(xv.dtype)

    def describe(self, spec: Spec) -> str:
        return "mxfp8 (E4M3, g32, E8M0 scales, SGLang)"


FORMATS = (MXFP8Format(),)
