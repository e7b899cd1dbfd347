"""TurboQuant KV-cache formats as vLLM writes them (``--kv-cache-dtype turboquant_*``): Lloyd-Max codebook keys with
a per-vector norm ('turboquant', 'turboquant_nc') and uniform per-token values ('turboquant_uniform').

Source read (vllm-project/vllm; TurboQuant came in with PR #38479, April 2026; PR #40194 replaced the per-layer
random-sign Hadamard by one plain Hadamard shared by every layer; the release docs of v0.20.1 carry #40194's text):

- ``vllm/model_executor/layers/quantization/turboquant/config.py`` @1471680b: ``TQ_PRESETS`` (k8v4: FP8 keys + 4-bit
  values; 4bit_nc, k3v4_nc, 3bit_nc: 4/3-bit codebook keys with norm correction + 4/4/3-bit values),
  ``key_packed_size`` = ceil(D * bits / 8) + 2 (fp16 norm), ``value_packed_size`` = ceil(D * bits / 8) + 4 (fp16
  scale + fp16 min), ``get_boundary_skip_layers`` (first and last 2 layers kept in the model's dtype);
- ``.../turboquant/centroids.py`` @06d0369d: ``solve_lloyd_max`` (the codebook, below);
- ``vllm/v1/attention/backends/turboquant_attn.py`` @0135d081: ``_build_hadamard`` (Sylvester, / sqrt(D), no signs,
  one matrix for every layer), ``_ensure_on_device`` (float32 centroids, midpoints of the sorted centroids);
- ``vllm/v1/attention/ops/triton_turboquant_store.py`` @0135d081: ``triton_turboquant_store`` (norm, rotation,
  bucketize, packing; ``_store_quantized_value`` for values);
- ``vllm/v1/attention/ops/triton_turboquant_decode.py`` @055e47c2: ``_tq_decode_stage1`` / ``_tq_full_dequant_kv``
  (decoding, norm correction).

Keys, one vector k [D] (D = head_dim, a power of two), in float32 (float64 for float64 inputs):

    n = ||k||;  u = k / (n + 1e-8);  y = u H          H: the normalised Sylvester-Hadamard matrix [D, D] (symmetric)
    code[i] = #{j : y[i] >= m[j]}                     m: the 2^b - 1 midpoints of the sorted float32 codebook c
    stored: the codes (b bits each, LSB-first bitstream: vLLM's byte layout for b = 3, 4) and fp16(n)
    decode: v = c[code];  'turboquant_nc': v = v * (1 / sqrt(sum(v^2) + 1e-16));  k^ = (fp16(n) * v) H

vLLM scores the decode query in the rotated domain (q H) . (n v); k^ is the same vector in the model's domain.
Codebook (``vllm_codebook``): Lloyd iterations for N(0, 1/D), the Gaussian approximation of one coordinate of a
random rotation of a unit vector (the exact law is a scaled Beta), each integral by the trapezoid rule with 200
panels over cells whose outer edges are +-10.5 sigma, from 2^b centroids spread evenly over +-3.5 sigma; at most 200
iterations, stopping (and keeping the previous iterate) once no centroid moves by 1e-10; rounded to float32. For b = 4
the 200 iterations end before that tolerance: the largest centroid is 2.7309 sigma against Max's 2.7326.

Values, one vector v [D], per token (vLLM computes in float32; here float32, float64 for float64 inputs):

    lo = min(v), s = max((max(v) - lo) / (2^b - 1), 1e-8);  q = clamp(trunc((v - lo) / s + 0.5), 0, 2^b - 1)
    stored: q (b bits each), fp16(s), fp16(lo);  decode: v^ = q * fp16(s) + fp16(lo)

The codes come from the unrounded s and lo (as ggml's q4_1 does), unlike kveval's 'int' format. Worked, b = 2,
v = [0, 1, 2, 3]: s = 1, q = [0, 1, 2, 3], v^ = v. Norms, scales and mins beyond fp16's range are clamped to 65504
(vLLM would store Inf).

Not reproduced (numerical paths of vLLM's kernels): GPU reduction and GEMM order, the kernels' fp32 division and square
root (which Triton may lower to approximate instructions) and fused multiply-adds, and the fp16 buffers of the
continuation-prefill path; kveval rounds each operation once, correctly, in float32 (or float64).
"""

from __future__ import annotations

import functools
import math

import torch

from ..rotation import hadamard_matrix
from .base import SCALE_TORCH_DTYPES, SHORT_DTYPE, QParams, Spec, check_finite, minmax, store
from .segment import QuantFormat

#: ``u = k / (n + NORM_EPS)`` (triton_turboquant_store)
NORM_EPS = 1e-8
#: norm correction: ``v / sqrt(sum(v^2) + NC_EPS)`` (``_tq_decode_stage1``)
NC_EPS = 1e-16
#: the value scale's floor, ``max((max - min) / (2^b - 1), SCALE_FLOOR)`` (``_store_quantized_value``)
SCALE_FLOOR = 1e-8
MAX_BITS = 8

# vLLM's solve_lloyd_max parameters: trapezoid panels per cell, iterations, tolerance, spread of the first centroids
# and outer edges (in sigma)
_PANELS, _MAX_ITER, _TOL, _START, _OUTER = 200, 200, 1e-10, 3.5, 3.0


def _trapezoid(f, a: float, b: float) -> float:
    """Composite trapezoid rule of f over [a, b] with ``_PANELS`` panels, summed left to right in float64."""
    h = (b - a) / _PANELS
    total = 0.5 * (f(a) + f(b))
    for i in range(1, _PANELS):
        total += f(a + i * h)
    return total * h


@functools.lru_cache(maxsize=64)
def vllm_codebook(head_dim: int, bits: int) -> tuple[float, ...]:
    """The 2^bits centroids (ascending, float64 before vLLM's float32 rounding) of ``solve_lloyd_max(head_dim,
    bits)`` (centroids.py): Lloyd iterations for N(0, 1/head_dim) as the module docstring says. Worked: bits 1 ->
    +-0.7977 / sqrt(head_dim) (the exact conditional mean is sqrt(2 / pi) = 0.79788)."""
    if head_dim < 1 or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"a TurboQuant codebook needs head_dim >= 1 and bits in 1..{MAX_BITS}; got {head_dim}, {bits}")
    levels = 2**bits
    var = 1.0 / head_dim
    sigma = math.sqrt(var)
    norm = 1.0 / math.sqrt(2 * math.pi * var)

    def density(x: float) -> float:
        return norm * math.exp(-x * x / (2 * var))

    def moment(x: float) -> float:
        return x * density(x)

    lo, hi = -_START * sigma, _START * sigma
    cents = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(_MAX_ITER):
        edges = [lo * _OUTER] + [(cents[i] + cents[i + 1]) / 2.0 for i in range(levels - 1)] + [hi * _OUTER]
        moved = []
        for i in range(levels):
            mass = _trapezoid(density, edges[i], edges[i + 1])
            moved.append(_trapezoid(moment, edges[i], edges[i + 1]) / mass if mass > 1e-15 else cents[i])
        if max(abs(a - b) for a, b in zip(moved, cents)) < _TOL:
            break  # vLLM keeps the iterate before this step
        cents = moved
    return tuple(cents)


@functools.lru_cache(maxsize=64)
def _tables(head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor(vllm_codebook(head_dim, bits), dtype=torch.float32).sort().values
    return c, (c[:-1] + c[1:]) / 2


def codebook(head_dim: int, bits: int) -> torch.Tensor:
    """vLLM's float32 centroids c [2^bits], ascending (``get_centroids``)."""
    return _tables(head_dim, bits)[0].clone()


def midpoints(head_dim: int, bits: int) -> torch.Tensor:
    """The float32 decision thresholds m [2^bits - 1] = (c[:-1] + c[1:]) / 2 of the sorted centroids, rounded in
    float32 (``_ensure_on_device``)."""
    return _tables(head_dim, bits)[1].clone()


def _check_bits(name: str, spec: Spec) -> None:
    if not 1 <= spec.bits <= MAX_BITS:
        raise ValueError(f"QuantSpec.bits must be in 1..{MAX_BITS} for format {name!r}; got {spec.bits}")
    if spec.granularity != "token":
        raise ValueError(f"format {name!r} quantizes each head_dim vector on its own: granularity must be 'token'; "
                         f"got {spec.granularity!r}")
    if spec.clip_ratio != 1.0:
        raise ValueError(f"format {name!r} takes no clip_ratio; got {spec.clip_ratio!r}")


class TurboQuantFormat(QuantFormat):
    """Keys as vLLM's TurboQuant stores them (module docstring): codes index the Lloyd-Max codebook of the rotated
    unit vector, the 'scale' is the vector's norm (``scale_dtype``, fp16 in vLLM); ``norm_correction`` renormalises
    the centroid vector before the inverse rotation (vLLM's ``*_nc`` dtypes). Codes: uint8 [B, H, T, D]; scale
    [B, H, T, 1]."""

    mappings = ("symmetric",)
    supports_static = False

    def __init__(self, name: str, norm_correction: bool):
        self.name, self.norm_correction = name, norm_correction

    def validate(self, spec: Spec) -> None:
        _check_bits(self.name, spec)
        super().validate(spec)

    def check_head_dim(self, spec: Spec, head_dim: int) -> None:
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"format {self.name!r} rotates by a Hadamard matrix: head_dim must be a power of two; "
                             f"got {head_dim}")

    def code_bits(self, spec: Spec) -> int:
        return spec.bits

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def short_name(self, spec: Spec) -> str:
        return f"tq{spec.bits}" + ("-nc" if self.norm_correction else "")

    def describe(self, spec: Spec) -> str:
        nc = ", norm correction" if self.norm_correction else ""
        return (f"{self.short_name(spec)} (Hadamard + Lloyd-Max codebook per vector{nc}, "
                f"{SHORT_DTYPE[spec.scale_dtype]} norm)")

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError(f"format {self.name!r} takes no parameters from a range (its scale is each vector's norm)")

    def _norm(self, xv: torch.Tensor) -> torch.Tensor:
        n = torch.linalg.vector_norm(xv, dim=-1, keepdim=True)
        check_finite(n)
        return n

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        """The stored norm of each vector of xv [..., D] (NaN/Inf raise ValueError)."""
        return QParams(store(self._norm(xv), _scale_dtype(spec)))

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """Codes of xv [..., D] given each vector's norm ``scale`` [..., 1] (``fit`` passes the unrounded norm)."""
        d = xv.shape[-1]
        self.check_head_dim(spec, d)
        y = (xv / (scale + NORM_EPS)) @ hadamard_matrix(d, xv.dtype, xv.device)
        m = _tables(d, spec.bits)[1].to(device=xv.device, dtype=xv.dtype)
        return torch.bucketize(y, m, right=True).to(torch.uint8)

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        n = self._norm(xv)
        return self.encode(xv, n, None, spec), QParams(store(n, _scale_dtype(spec)))

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        d = codes.shape[-1]
        v = _tables(d, spec.bits)[0].to(device=codes.device, dtype=scale.dtype)[codes.long()]
        if self.norm_correction:
            v = v * (1.0 / torch.sqrt((v * v).sum(-1, keepdim=True) + NC_EPS))
        return (scale * v) @ hadamard_matrix(d, scale.dtype, scale.device)


class TurboQuantUniformFormat(QuantFormat):
    """Values as vLLM's TurboQuant stores them (module docstring): per-token asymmetric uniform codes computed from
    the unrounded float scale and min, stored with the rounded ones. Codes: uint8 [B, H, T, D]; scale and float zero
    point (the min) [B, H, T, 1]."""

    mappings = ("asymmetric",)
    supports_static = False

    def __init__(self, name: str):
        self.name = name

    def validate(self, spec: Spec) -> None:
        _check_bits(self.name, spec)
        if spec.zero_point != "float":
            raise ValueError(f"format {self.name!r} stores the min as its zero point: zero_point must be 'float'; "
                             f"got {spec.zero_point!r}")
        super().validate(spec)

    def code_bits(self, spec: Spec) -> int:
        return spec.bits

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def short_name(self, spec: Spec) -> str:
        return f"tq-uint{spec.bits}"

    def _params(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> torch.Tensor:
        s = (mx - mn) / (2**spec.bits - 1)
        return torch.where(s > SCALE_FLOOR, s, SCALE_FLOOR)

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        sdt = _scale_dtype(spec)
        return QParams(store(self._params(mn, mx, spec), sdt), store(mn, sdt))

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        assert zero_point is not None
        q = ((xv - zero_point) / scale).add_(0.5).trunc_()
        return q.clamp_(0, 2**spec.bits - 1).to(torch.uint8)

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        mn, mx = minmax(xv, dims)
        check_finite(mn, mx)
        s = self._params(mn, mx, spec)
        sdt = _scale_dtype(spec)
        return self.encode(xv, s, mn, spec), QParams(store(s, sdt), store(mn, sdt))

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        assert zero_point is not None
        return codes.to(scale.dtype) * scale + zero_point


def _scale_dtype(spec: Spec) -> torch.dtype:
    return SCALE_TORCH_DTYPES[spec.scale_dtype]


FORMATS = (TurboQuantFormat("turboquant", norm_correction=False), TurboQuantFormat("turboquant_nc", norm_correction=True),
           TurboQuantUniformFormat("turboquant_uniform"))
