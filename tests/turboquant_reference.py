"""A reference TurboQuant KV cache written from vLLM's source, for tests/test_turboquant.py: what vLLM's Triton store
kernel writes into a cache slot, and what its dequantisation reads back, for one head's vectors [N, D], in float32
on the CPU, step by step as the kernels do it (binary-search bucketize, shift-and-or packing, fp16 bytes).

Read (vllm-project/vllm):

- ``vllm/model_executor/layers/quantization/turboquant/centroids.py`` @06d0369d (``solve_lloyd_max``):
  ``lloyd_max_gaussian``;
- ``vllm/model_executor/layers/quantization/turboquant/config.py`` @1471680b (``TQ_PRESETS``, ``key_packed_size``,
  ``value_packed_size``, ``get_boundary_skip_layers``): ``PRESETS``, ``boundary_skip_layers``;
- ``vllm/v1/attention/backends/turboquant_attn.py`` @0135d081 (``_build_hadamard_cached``, ``_ensure_on_device``):
  ``hadamard``, ``tables``;
- ``vllm/v1/attention/ops/triton_turboquant_store.py`` @0135d081 (``triton_turboquant_store``,
  ``_tq_fused_store_mse``, ``_tq_fused_store_fp8``, ``_store_quantized_value``): ``store_keys``, ``store_values``;
- ``vllm/v1/attention/ops/triton_turboquant_decode.py`` @055e47c2 (``_tq_full_dequant_kv``): ``load_keys``,
  ``load_values``.

Slot layout of one head at one position: [key bytes | value bytes]; keys: ceil(D * b / 8) bytes of codes then the
fp16 norm (2 bytes, little-endian), or D bytes of FP8 E4M3 for ``turboquant_k8v4``; values: ceil(D * b / 8) bytes of
codes, then fp16 scale and fp16 min. Codes are packed LSB first: b = 4 two per byte (even index in the low nibble),
b = 3 eight per 3 bytes.
"""

from __future__ import annotations

import math

import torch

#: --kv-cache-dtype -> (key bits, value bits, norm correction); key bits 8 = FP8 keys (config.py TQ_PRESETS)
PRESETS = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


def lloyd_max_gaussian(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> list[float]:
    """centroids.py ``solve_lloyd_max(d, bits)`` before its float32 rounding: Lloyd-Max for N(0, 1/d), integrals by
    the trapezoid rule with 200 panels, outer edges at 3 x 3.5 sigma, start evenly spread over +-3.5 sigma."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x: float) -> float:
        return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))

    def trapz(f, a: float, b: float, n: int = 200) -> float:
        h = (b - a) / n
        s = 0.5 * (f(a) + f(b))
        i = 1
        while i < n:
            s += f(a + i * h)
            i += 1
        return s * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(max_iter):
        bounds = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3, *bounds, hi * 3]
        new = []
        for i in range(n_levels):
            num = trapz(lambda x: x * pdf(x), edges[i], edges[i + 1])
            den = trapz(pdf, edges[i], edges[i + 1])
            new.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new[i] - centroids[i]) for i in range(n_levels)) < tol:
            break
        centroids = new
    return centroids


def tables(d: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 centroids sorted, float32 midpoints (c[:-1] + c[1:]) / 2), as ``_ensure_on_device`` builds them."""
    c = torch.tensor(lloyd_max_gaussian(d, bits), dtype=torch.float32).sort().values
    return c, (c[:-1] + c[1:]) / 2


def hadamard(d: int) -> torch.Tensor:
    """``_build_hadamard_cached``: Sylvester doubling from [[1]], then divided by sqrt(d), float32."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def boundary_skip_layers(num_layers: int, n: int = 2) -> list[int]:
    """``TurboQuantConfig.get_boundary_skip_layers`` for a dense model: the first and last min(n, L // 2) layers."""
    if n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


# ------------------------------------------------------------------------------------------------ packing
def _pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, D] (int32) -> bytes [N, ceil(D * bits / 8)] the way the store kernels write them."""
    n, d = idx.shape
    if bits == 4:  # pairs: (q[2i] & 0xF) | (q[2i+1] & 0xF) << 4
        pairs = idx.reshape(n, d // 2, 2) & 0xF
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    if bits == 3:  # groups of 8 codes: 24 bits, little-endian, code j at bit 3j
        grp = (idx.reshape(n, d // 8, 8) & 0x7).to(torch.int64)
        word = (grp << (torch.arange(8) * 3)).sum(-1)
        return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], -1).reshape(n, -1).to(torch.uint8)
    raise ValueError(f"vLLM packs 3- and 4-bit codes; got {bits}")


def _unpack(raw: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """The decode kernels' gather: raw16 = byte[o // 8] | byte[o // 8 + 1] << 8 at bit offset o = i * bits, then
    (raw16 >> o % 8) & mask (the byte after the codes may be read; its bits are shifted out)."""
    padded = torch.cat([raw.to(torch.int32), torch.zeros(raw.shape[0], 1, dtype=torch.int32)], 1)
    off = torch.arange(d) * bits
    raw16 = padded[:, off // 8] | (padded[:, off // 8 + 1] << 8)
    return (raw16 >> (off % 8)) & ((1 << bits) - 1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [N] -> [N, 2] uint8: fp16 bits, low byte first."""
    u = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([u & 0xFF, u >> 8], -1).to(torch.uint8)


def _fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    u = (b[:, 0].to(torch.int32) | (b[:, 1].to(torch.int32) << 8)).to(torch.int16)
    return u.view(torch.float16).to(torch.float32)


# ------------------------------------------------------------------------------------------------ keys
def store_keys(key: torch.Tensor, bits: int) -> torch.Tensor:
    """Key bytes [N, key_packed_size] of key [N, D]. bits 8: FP8 E4M3 (Triton's satfinite cast: clamp to +-448,
    round to nearest even); else the MSE path: norm, unit vector, Hadamard, binary-search bucketize, pack, fp16
    norm."""
    k = key.float()
    if bits == 8:
        return k.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    n_centroids = 2**bits
    norms = k.norm(dim=1, keepdim=True)
    y = (k / (norms + 1e-8)) @ hadamard(k.shape[1])
    _, mid = tables(k.shape[1], bits)
    lo = torch.zeros(y.shape, dtype=torch.int32)
    hi = torch.full(y.shape, n_centroids - 1, dtype=torch.int32)
    for _ in range(bits):  # _tq_fused_store_mse: MSE_BITS halvings
        m = (lo + hi) >> 1
        ge = y >= mid[m.clamp(max=n_centroids - 2).long()]
        lo = torch.where(ge, m + 1, lo)
        hi = torch.where(ge, hi, m)
    idx = lo.clamp(max=n_centroids - 1)
    return torch.cat([_pack(idx, bits), _fp16_bytes(norms[:, 0])], 1)


def key_codes(key_bytes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """The codebook indices [N, D] (int32) stored in key bytes."""
    return _unpack(key_bytes[:, : math.ceil(d * bits / 8)], bits, d)


def load_keys(key_bytes: torch.Tensor, bits: int, d: int, norm_correction: bool) -> torch.Tensor:
    """``_tq_full_dequant_kv`` then the inverse rotation: k^ [N, D] float32 (without the kernel's fp16 buffer)."""
    if bits == 8:
        return key_bytes[:, :d].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    mse_bytes = math.ceil(d * bits / 8)
    c, _ = tables(d, bits)
    v = c[key_codes(key_bytes, bits, d).long()]
    if norm_correction:
        v = v * (1.0 / torch.sqrt((v * v).sum(1, keepdim=True) + 1e-16))
    norm = _fp16_from_bytes(key_bytes[:, mse_bytes : mse_bytes + 2])
    return (norm[:, None] * v) @ hadamard(d)


# ------------------------------------------------------------------------------------------------ values
def store_values(value: torch.Tensor, bits: int) -> torch.Tensor:
    """Value bytes [N, value_packed_size] of value [N, D] (``_store_quantized_value``)."""
    v = value.float()
    vmin = v.min(1, keepdim=True).values
    vmax = v.max(1, keepdim=True).values
    scale = (vmax - vmin) / (2**bits - 1)
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = ((v - vmin) / scale + 0.5).to(torch.int32).clamp(0, 2**bits - 1)
    return torch.cat([_pack(q, bits), _fp16_bytes(scale[:, 0]), _fp16_bytes(vmin[:, 0])], 1)


def value_codes(value_bytes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    return _unpack(value_bytes[:, : math.ceil(d * bits / 8)], bits, d)


def load_values(value_bytes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """v^ [N, D] float32 = code * fp16 scale + fp16 min."""
    nb = math.ceil(d * bits / 8)
    scale = _fp16_from_bytes(value_bytes[:, nb : nb + 2])
    vmin = _fp16_from_bytes(value_bytes[:, nb + 2 : nb + 4])
    return value_codes(value_bytes, bits, d).to(torch.float32) * scale[:, None] + vmin[:, None]


def slot_bytes(cache_dtype: str, d: int) -> tuple[int, int]:
    """(key_packed_size, value_packed_size) of config.py for one head and position."""
    kb, vb, _ = PRESETS[cache_dtype]
    key = d if kb == 8 else math.ceil(d * kb / 8) + 2
    return key, math.ceil(d * vb / 8) + 4
