"""ggml's iq4_nl as llama.cpp's KV cache writes it (``iq4_nl``, selected by ``QuantSpec.ggml``): 4-bit indices into
a fixed non-linear codebook, one float16 scale per block of 32 along head_dim.

The cache write calls ``quantize_row_iq4_nl`` (src/ggml-cpu/quants.c), which is ``quantize_row_iq4_nl_ref``
(src/ggml-quants.c) = ``quantize_row_iq4_nl_impl(32, 32, ..., quant_weights = NULL, ntry = -1)``: no importance
matrix and no scale search (``quantize_iq4_nl``, used for model weights, searches 15 scales: not this one).
Per block xb [..., 32], in float32, each operation rounded separately (the reference build has no FMA):

    values = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]   (kvalues_iq4nl,
             src/ggml-common.h)
    m      = the element of largest |x| with its sign (the FIRST one on ties)
    d0     = m / -127;  id = 1 / d0
    L[j]   = best_index_int8(id * x[j]): the nearest codebook entry (x <= -127 -> 0, x >= 113 -> 15; a tie
             between two entries goes to the UPPER one)
    w[j]   = x[j]^2;  sumqx = sum_j (w[j] * values[L[j]]) * x[j];  sumq2 = sum_j (w[j] * values[L[j]]) * values[L[j]]
             (summed in order j = 0..31)
    d      = sumqx / sumq2 (0 if sumq2 == 0), stored as float16;  x^[j] = fp16(d) * values[L[j]]

The indices are NOT recomputed with the final d. A block with max |x| < 1e-15 gets d = 0 (x^ = 0); its indices are
whatever the caller's buffer held in ggml (here: 8, the entry 1). Worked: xb = [2, 1, 0, ..., 0] (m = 2): d0 =
-2/127, id * x = [-127, -63.5, -0, ...] -> L = [0, 3, 8, ...] (-63.5 is nearer -65 than -49), q = [-127, -65, 1,
...], w = [4, 1, 0, ...]: sumqx = -508*2 + -65*1 = -1081, sumq2 = 64516 + 4225 = 68741, d = -0.0157257...
-> fp16 -0.0157318115234375.

Codes are the indices (uint8, 0..15), packed 4 bits each: 16 bytes + 2 for the scale = 18 bytes per block, as
ggml (whose nibble layout differs: low nibbles hold elements 0..15, high nibbles 16..31; ``iq4_nl_to_ggml_bytes``
builds ggml's bytes). In attention, iq4_nl keys see a q8_0 query (``vec_dot_iq4_nl_q8_0``) and iq4_nl values are
dequantized to float32 (``dequantize_row_iq4_nl``).
"""

from __future__ import annotations

import torch

from .base import QParams, Spec, check_finite, count_reached
from .ggml import GgmlFormat

NAME = "iq4_nl"
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15
_ZERO_BLOCK_INDEX = 8  # an index for all-zero blocks (any index decodes to 0 with d = 0)


def _values(device: torch.device) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.float32, device=device)


def best_index(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml's ``best_index_int8`` over the sorted integer codebook ``values [16]`` for every element of x (float32):
    int64 indices of x's shape. ggml clamps the ends (x <= values[0] -> 0, x >= values[-1] -> 15), binary-searches
    the neighbours lo <= x < hi and takes ``x - lo < hi - x ? lo : hi`` in float32, so the upper neighbour wins
    ties. That is the number of midpoints ``(lo + hi) / 2`` x reaches (``count_reached``): the midpoints of
    integers are exact in float32, and the two float32 differences can only round the comparison the other way
    within 2^-17 of a midpoint, where both are exact (tests/quant/test_quant_llamacpp.py checks every float32 within
    1e-3 of each midpoint against the transcription of ggml's code)."""
    midpoints = ((values[1:] + values[:-1]) / 2).tolist()
    return count_reached(x, midpoints).long()


def iq4_nl_blocks(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_row_iq4_nl_ref`` on blocks xb [..., 32] (float32): (indices float32 [..., 32] with integer values
    0..15, d float16 [..., 1]). ValueError on NaN/Inf (detected on the block maxima)."""
    values = _values(xb.device)
    ax = xb.abs()
    amax, arg = ax.max(-1, keepdim=True)  # first maximal index on ties
    check_finite(amax)
    m = xb.gather(-1, arg)
    small = amax < GROUP_MAX_EPS
    d0 = m / values[0]
    inv = torch.where(small, torch.ones_like(d0), torch.ones_like(d0) / torch.where(small, 1.0, d0))
    idx = best_index(inv * xb, values)
    q = values[idx]
    wq = (xb * xb).mul_(q)
    # sum_j in order j = 0..31, as the C loop (a vectorised or double-precision sum would round differently):
    # one column at a time over all blocks, columns made contiguous first
    terms_x = (wq * xb).movedim(-1, 0).contiguous()
    terms_q = (wq * q).movedim(-1, 0).contiguous()
    sumqx, sumq2 = terms_x[0].clone(), terms_q[0].clone()
    for j in range(1, terms_x.shape[0]):
        sumqx.add_(terms_x[j])
        sumq2.add_(terms_q[j])
    sumqx, sumq2 = sumqx.unsqueeze(-1), sumq2.unsqueeze(-1)
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1.0), 0.0)
    d = torch.where(small, 0.0, d)
    idx = torch.where(small, _ZERO_BLOCK_INDEX, idx)
    return idx.to(torch.float32), d.to(torch.float16).add_(0.0)


def iq4_nl_decode(idx: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x^ = fp16(d) * values[idx] in float32 (``dequantize_row_iq4_nl``); idx [..., 32], d [..., 1]."""
    values = _values(idx.device)
    return values[idx.long()] * d.to(torch.float32)


def iq4_nl_to_ggml_bytes(idx: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """ggml's ``block_iq4_nl`` bytes [..., 18] (fp16 d little-endian, then qs[j] = L[j] | L[j+16] << 4) of indices
    [..., 32] and d [..., 1]: for comparisons with ggml and the ``gguf`` package."""
    lo = idx[..., :16].to(torch.uint8)
    hi = idx[..., 16:].to(torch.uint8)
    qs = lo | (hi << 4)
    dbytes = d.to(torch.float16).contiguous().view(torch.uint8).reshape(*d.shape[:-1], 2)
    return torch.cat([dbytes, qs], dim=-1)


class IQ4NLFormat(GgmlFormat):
    """iq4_nl blocks written by llama.cpp's cache (see the module docstring). Codes: codebook indices (uint8)."""

    def __init__(self) -> None:
        self.name = NAME
        self.bits, self.mapping = 4, "symmetric"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        idx, d = iq4_nl_blocks(xv.to(torch.float32))
        return idx.to(torch.uint8), QParams(d, None)

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        idx, d = iq4_nl_blocks(xv.to(torch.float32))
        return iq4_nl_decode(idx, d)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        return iq4_nl_decode(codes, scale).to(scale.dtype)


FORMATS = (IQ4NLFormat(),)
