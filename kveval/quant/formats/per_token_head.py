"""vLLM's per-token-head KV cache dtypes: ``int8_per_token_head``, ``fp8_per_token_head`` and
``int4_per_token_head`` (formats of the same names, granularity 'token': one scale per token and KV head over
head_dim, computed when the token is written; scale_dtype 'float32').

Read in vLLM 0.33.0 (the wheel's Python sources): vllm/v1/attention/ops/triton_reshape_and_cache_flash.py
(``_reshape_cache_per_token_head``, the INT8/FP8 write), vllm/v1/attention/ops/int4_per_token_head.py (INT4 write,
read and the randomized Hadamard transform), vllm/v1/attention/ops/triton_unified_attention.py (the read:
``S += dot(Q, K) * (scale * k_token_head_scales)``, the probabilities times the value scales), vllm/v1/
kv_cache_interface.py (``KVQuantMode``), vllm/model_executor/layers/quantization/kv_cache.py (k/v_scale forced to
1.0: these dtypes ignore checkpoint scales). All arithmetic is float32 (the kernels load K/V ``.to(tl.float32)``),
whatever the input dtype; x^ is built in the compute dtype from the stored codes and the stored fp32 scale.

- ``int8_per_token_head`` (symmetric): s = max(amax / 127, 1e-6) (fp32, stored); y = x * (1 / s);
  y -> y + 0.5 (y >= 0) or y - 0.5; clamp to [-128, 127]; code = trunc(y) (the int8 store truncates): round half
  away from zero, so codes never reach -128. x^ = code * s. 1 byte per element + 4 bytes per token and head.
  Worked: row [127, 2.5, -2.5, 0.4, -0.5] -> s = 1, codes [127, 3, -3, 0, -1] (round half to even would give
  2, -2, 0, 0); an all-zero row -> s = 1e-6, codes 0.
- ``fp8_per_token_head`` (symmetric): s = max(amax / 448, 1e-6); code = e4m3(clamp(x * (1 / s), +-448)) rounded to
  nearest even (Triton's fp32 -> fp8e4nv store; the cache is uint8 viewed as float8_e4m3fn on CUDA, e4m3fnuz with
  max 240 on ROCm MI300, not modelled). x^ = float(code) * s.
- ``int4_per_token_head`` (asymmetric, 4 bits): each row is first rotated, y = H (d1 * x) with H the
  unnormalised Sylvester-Hadamard matrix of size D (H H = D I; D a power of two) and d1 = 2 * Bernoulli(0.5) - 1
  drawn from ``torch.Generator('cpu').manual_seed(0x9E3779B9)`` (``single_rht``, ``_get_rht_signs``). Then per
  row of y: s = max((max - min) / 15, 1e-6); z = clamp(round_half_away(-min / s), 0, 15);
  q = clamp(round_half_away(y * (1 / s) + z), 0, 15), round_half_away(v) = trunc(v + 0.5) or trunc(v - 0.5)
  by the sign of v. The zero point is hidden in the scale: the stored fp32 word is bits(s) & ~0xF | z, and the
  read uses s' = that word with its low 4 mantissa bits cleared: y^ = (q - z) * s'. The read kernel works in the
  rotated domain (query rotated, softmax scale / D, output rotated back / D), which equals attending to
  x^ = d1 * (H y^) / D: kveval stores y's codes and returns x^. 2 codes per byte (even element in the low
  nibble) + 4 bytes per token and head.

Where kveval assumes rather than reads: Triton's fp32 ``/`` as IEEE division and no FMA contraction of
``y * (1 / s) +- 0.5`` (or ``+ z``): with contraction a code can differ only when y / s lies within an ulp of a
half-integer. vLLM rounds the rotated INT4 rows back to the model dtype (``.to(key.dtype)``) and rotates with
hadacore (bf16) or a bf16 Triton matmul on CUDA; kveval rotates the float32 rows with the exact butterfly and keeps
float32, so INT4 codes match vLLM's CPU path on float32 inputs, not the GPU's bf16 rotation bit for bit.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..rotation import walsh_hadamard
from .base import QParams, Spec, check_finite
from .fp4 import E4M3_MAX, e4m3_rne, pack_nibbles, unpack_nibbles
from .segment import QuantFormat

SCALE_FLOOR = 1e-6
RHT_SEED = 0x9E3779B9


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """trunc(v + 0.5) for v >= 0, trunc(v - 0.5) otherwise (each addition rounded in v's dtype)."""
    return torch.where(v >= 0, v + 0.5, v - 0.5).trunc_()


def _row_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """max(amax / top, 1e-6) in float32."""
    return torch.clamp(amax / top, min=SCALE_FLOOR)


@lru_cache
def rht_signs(d: int) -> torch.Tensor:
    """vLLM's RHT signs d1 [d] (float32, +-1): Bernoulli(0.5) draws of a CPU generator seeded 0x9E3779B9."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def rht(x: torch.Tensor) -> torch.Tensor:
    """H (d1 * x) along the last dimension."""
    return walsh_hadamard(x * rht_signs(x.shape[-1]).to(x))


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """d1 * (H y) / D, the inverse of `rht`."""
    d = y.shape[-1]
    return walsh_hadamard(y) * rht_signs(d).to(y) / d


class _PerTokenHead(QuantFormat):
    """One scale per token and head, float32, computed when the token is written (module docstring)."""

    supports_static = False
    bits: int = 8

    def validate(self, spec: Spec) -> None:
        if spec.bits != self.bits:
            raise ValueError(f"QuantSpec.bits must be {self.bits} for format {self.name!r}; got {spec.bits}")
        super().validate(spec)
        if spec.granularity != "token":
            raise ValueError(f"format {self.name!r} has one scale per token and head: granularity must be 'token'; "
                             f"got {spec.granularity!r}")
        if spec.scale_dtype != "float32":
            raise ValueError(f"format {self.name!r} stores float32 scales: scale_dtype must be 'float32'; "
                             f"got {spec.scale_dtype!r}")
        if spec.clip_ratio != 1.0 or spec.outliers:
            raise ValueError(f"format {self.name!r} takes no clip_ratio or outliers (vLLM's kernel has none)")

    def code_bits(self, spec: Spec) -> int:
        return self.bits

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # the Triton kernels load K/V as float32

    def param_nbytes(self, spec: Spec) -> int:
        return 4  # one float32 per token and head (INT4: the zero point lives in its low bits)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError(f"format {self.name!r} computes its scales per token when the token is written; it takes no "
                         "fixed parameters")

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (vLLM, per token and head, fp32 scales)"


class Int8PerTokenHead(_PerTokenHead):
    """vLLM ``int8_per_token_head``: symmetric, s = max(amax/127, 1e-6), round half away from zero."""

    name = "int8_per_token_head"
    mappings = ("symmetric",)

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.int8

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        amax = xv.abs().amax(-1, keepdim=True)
        check_finite(amax)
        return QParams(_row_scale(amax.to(torch.float32), 127.0))

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        y = xv.to(torch.float32) * (1.0 / scale.to(torch.float32))
        return _round_half_away(y).clamp_(-128, 127).to(torch.int8)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return codes.to(scale.dtype).mul_(scale)

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        """The int8 codes' own bytes (two's complement, as vLLM's int8 cache holds them)."""
        return codes.contiguous().view(torch.uint8)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != n:
            raise ValueError(f"expected uint8 [..., {n}] for {n} int8 codes; got {packed.dtype} {tuple(packed.shape)}")
        return packed.view(torch.int8)


class Fp8PerTokenHead(_PerTokenHead):
    """vLLM ``fp8_per_token_head``: s = max(amax/448, 1e-6), E4M3 of clamp(x * (1/s)) rounded to nearest even."""

    name = "fp8_per_token_head"
    mappings = ("symmetric",)

    def bits_label(self, spec: Spec) -> str:
        return "FP8"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.float8_e4m3fn

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        amax = xv.abs().amax(-1, keepdim=True)
        check_finite(amax)
        return QParams(_row_scale(amax.to(torch.float32), E4M3_MAX))

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return e4m3_rne(xv.to(torch.float32) * (1.0 / scale.to(torch.float32)))

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return codes.to(scale.dtype).mul_(scale)

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        return codes.contiguous().view(torch.uint8)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != n:
            raise ValueError(f"expected uint8 [..., {n}] for {n} fp8 codes; got {packed.dtype} {tuple(packed.shape)}")
        return packed.view(torch.float8_e4m3fn)


def int4_pth_scale_word(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The stored float32 word: bits(s) with the low 4 mantissa bits replaced by the zero point z (0..15)."""
    bits = s.to(torch.float32).contiguous().view(torch.int32)
    return ((bits & -16) | z.to(torch.int32)).view(torch.float32)


def int4_pth_unword(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s' = the word with its low 4 bits cleared, z = those bits), both float32, from a stored word."""
    bits = word.to(torch.float32).contiguous().view(torch.int32)
    return (bits & -16).view(torch.float32), (bits & 0xF).to(torch.float32)


class Int4PerTokenHead(_PerTokenHead):
    """vLLM ``int4_per_token_head``: RHT, then asymmetric 4-bit per row with the zero point in the scale's low
    mantissa bits (module docstring). Codes are the 4-bit codes of the rotated row (uint8 0..15)."""

    name = "int4_per_token_head"
    mappings = ("asymmetric",)
    bits = 4

    def validate(self, spec: Spec) -> None:
        super().validate(spec)
        if spec.zero_point != "int":
            raise ValueError(f"format {self.name!r} has an integer zero point (in the scale's low bits): zero_point "
                             f"must be 'int'; got {spec.zero_point!r}")

    def check_head_dim(self, spec: Spec, head_dim: int) -> None:
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"format {self.name!r} rotates rows by a Hadamard matrix: head_dim must be a power of "
                             f"two; got {head_dim}")

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        y = rht(xv.to(torch.float32))
        mn, mx = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        check_finite(mn, mx)
        s = torch.clamp((mx - mn) / 15.0, min=SCALE_FLOOR)
        z = _round_half_away(-mn / s).clamp_(0, 15)
        q = _round_half_away(y * (1.0 / s) + z).clamp_(0, 15)
        return q.to(torch.uint8), QParams(int4_pth_scale_word(s, z))

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        return self.fit(xv, dims, spec)[1]

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        raise ValueError(f"format {self.name!r} computes its scales per token when the token is written; it takes no "
                         "fixed parameters")

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        s, z = int4_pth_unword(scale)
        y = (codes.to(torch.float32) - z) * s
        return rht_inverse(y).to(scale.dtype)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        codes, qp = self.fit(xv, dims, spec)
        return self.decode(codes, qp.scale.to(xv.dtype), None, spec)

    def pack(self, codes: torch.Tensor, spec: Spec) -> torch.Tensor:
        return pack_nibbles(codes)

    def unpack(self, packed: torch.Tensor, spec: Spec, n: int) -> torch.Tensor:
        if packed.dtype != torch.uint8 or packed.shape[-1] != n // 2:
            raise ValueError(f"expected uint8 [..., {n // 2}] for {n} int4 codes; got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        return unpack_nibbles(packed)

    def row_nbytes(self, spec: Spec, head_dim: int) -> int:
        return head_dim // 2

    def describe(self, spec: Spec) -> str:
        return f"{self.name} (vLLM, Hadamard-rotated, asym per token and head, fp32 scale + zp in its low bits)"


FORMATS = (Int8PerTokenHead(), Fp8PerTokenHead(), Int4PerTokenHead())
