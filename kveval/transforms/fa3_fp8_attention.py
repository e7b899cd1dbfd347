"""FlashAttention 3's FP8 forward pass: the softmax probabilities are rounded to E4M3, tile by tile, before P·V.

What vLLM runs for ``--kv-cache-dtype fp8`` on the FLASH_ATTN backend with FlashAttention 3 (Hopper): Q, K and V
are E4M3 (the query through ``query_fp8``, K and V from the cache: spec ``fp8_e4m3``) and FA3's FP8 kernel computes
the whole attention. Sources, vllm-project/flash-attention at 617264c (2026-08-06; the fork vLLM builds as
``vllm_flash_attn``; its FP8 softmax is unchanged since c92ca63, 2024-08, and is Dao-AILab/flash-attention's
hopper/ code):

- hopper/flash_fwd_kernel_sm90.h: for an FP8 element type the kernel multiplies ``softmax_scale_log2``
  (softmax_scale · log2 e) by ``q_descale · k_descale`` and instantiates ``flash::Softmax`` with
  ``Max_offset = 8``.
- hopper/softmax.h: ``scale_apply_exp2`` computes ``P = exp2(S · scale_log2 - (m · scale_log2 - 8))``, m the
  running row max (0 in place of a max of -inf), so P lies in [0, 256] "to use more of the FP8 range";
  ``online_softmax`` adds these float32 P, before any rounding, to ``row_sum``; ``max_get_scale``: when a tile
  raises the max, ``row_sum`` and the output accumulator are multiplied by ``exp2((m_old - m_new) · scale_log2)``;
  ``finalize``: the output is multiplied by ``v_descale / row_sum`` (0 when the sum is 0 or NaN).
- hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp (``CollectiveMainloopFwdSm90::mma``): tiles of ``kBlockN`` keys,
  aligned at key 0, are processed from the last one (``n_block_max - 1``) down to the first; per tile S = Q·Kᵀ
  (FP8 operands, float32 accumulators), masking, the online softmax, then ``convert_type_out`` converts P to the
  element type (cutlass ``NumericArrayConverter<float_e4m3_t, float>``: round to nearest even, saturating) and
  the tensor cores add P_fp8 · V_fp8 to the float32 output.
- hopper/tile_size.h (``tile_size_fwd_sm90``, element size 1) with hopper/heuristics.h (``use_one_mma_wg``):
  kBlockN = 128 for head_dim <= 96, decode and prefill; for head_dim 128, 96 in decode (query rows x GQA group
  <= 64) and 192 in prefill (at 617264c; earlier commits used 160 for head_dim 64 prefill, 224 for 128).

Hence, for one query row, with c = scaling · log2 e, s_j = q·k_j · c, tiles t(j) = position_j // block_n, the max
M_t over the visible keys of tiles >= t (the running max while tile t is processed) and M = M_0::

    P_j = e4m3(exp2(s_j - M_t(j) + 8))                    # rounded from float32, P_j in [0, 256]
    o   = Σ_j 2^(M_t(j) - M) · P_j · v_j  /  Σ_j 2^(M_t(j) - M) · exp2(s_j - M_t(j) + 8)

(the rescaling of earlier tiles, collapsed into 2^(M_t - M)). Worked, one tile, c = 1: scores [0, -1, -0.5] give
P = [256, 128, 2^7.5 = 181.02 -> 176] (between 128 and 256 the E4M3 step is 16) and the denominator 565.02, not
560. The q and k descales are folded into q and k (``query_fp8`` returns e4m3(q/q_scale)·q_scale and the cache
reads e4m3(k/k_scale)·k_scale), v_descale into v: the same products in another order.

Not reproduced: the split-KV path (``num_splits`` > 1, chosen by FA3's heuristic for small batches, each split
then has its own running max and the splits are merged in float32), the float32 accumulation order and precision
of the tensor cores (scores and P·V are computed in q's dtype here), exp2 as ``ex2.approx``, FA3's BF16 output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kveval.quant.formats.fp8 import _fp8_to_float
from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register

#: log2(P) offset of FA3's FP8 softmax (``Max_offset`` in hopper/flash_fwd_kernel_sm90.h): P in [0, 2^8]
MAX_OFFSET = 8
LOG2_E = math.log2(math.e)
#: query rows computed at once: a block's scores stay near the CPU's caches (bench/bench_presets.py)
ROW_BLOCK = 64


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float32, then to the nearest E4M3 value (ties to even, saturating at ±448), in x's dtype."""
    codes = x.to(torch.float32).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return _fp8_to_float(codes, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


#: float32 bits of 2^-6, E4M3's smallest normal: below it E4M3's step is fixed at 2^-9
_E4M3_MIN_NORMAL_BITS = 0x3C800000
#: float32 keeps 23 fraction bits, E4M3 3: an ulp of E4M3 is 2^20 float32 ulps
_DROPPED_BITS = 23 - 3


def round_p_to_e4m3(p: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``round_to_e4m3`` for p in [0, 448] (the softmax's P lies in [0, 256]), in four float32 passes: x + c - c
    with c = 2^(max(e, -6) + 20), e the exponent of x, rounds x to multiples of 2^(max(e, -6) - 3), E4M3's step
    at x, ties to even (the float32 addition's own rounding). Checked equal to ``round_to_e4m3`` on every float32
    in [0, 256] (tests/test_transforms.py samples them). ``in_place``: the result is written into p and p is
    returned (for a float32 p the only new tensor is c)."""
    x = p.to(torch.float32)
    c = (x.view(torch.int32).bitwise_and(0x7F800000).clamp_min_(_E4M3_MIN_NORMAL_BITS)
         .add_(_DROPPED_BITS << 23).view(torch.float32))
    if not in_place:
        return (x + c).sub_(c).to(p.dtype)
    if x is p:
        return p.add_(c).sub_(c)
    return p.copy_(x.add_(c).sub_(c))


def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      key_positions: torch.Tensor, scaling: float, block_n: int,
                      row_block: int = ROW_BLOCK) -> torch.Tensor:
    """FlashAttention 3's FP8 attention (module docstring) on dequantized tensors.

    q ``[batch, heads, Tq, head_dim]``; k, v ``[batch, kv_heads, Tk, head_dim]`` (heads a multiple of kv_heads:
    query head h reads kv head h // (heads / kv_heads)); ``allowed`` bool broadcastable to ``[batch, heads, Tq,
    Tk]``; ``key_positions`` int64 ``[Tk]`` (>= 0; keys of one position are versions of one token, of which a query
    sees at most one); ``scaling`` the softmax scale; ``block_n`` keys per tile. Returns ``[batch, heads, Tq,
    head_dim]`` in q's dtype; a row that sees no key is 0 (as FA3).

    The keys are laid out tile by tile (``tile_layout``), and ``row_block`` query rows are computed at a time over
    the tiles some row of the block sees (a causal prefill skips the tiles after the block, as FA3 skips the key
    tiles after a query tile; a tile no row sees adds -inf to the maxima and 0 to the sums)."""
    heads, kv_heads, n_queries, n_keys = q.shape[1], k.shape[1], q.shape[-2], k.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if key_positions.shape != (n_keys,):
        raise ValueError(f"key_positions must have shape [{n_keys}]; got {tuple(key_positions.shape)}")
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    if n_keys == 0:
        return out
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    allowed = allowed.expand(*allowed.shape[:-2], n_queries, n_keys)
    k, v, allowed, width = tile_layout(k, v, allowed, key_positions.to(q.device), block_n)
    n_tiles = k.shape[-2] // width
    for start in range(0, n_queries, row_block):
        rows = slice(start, min(start + row_block, n_queries))
        seen = allowed[..., rows, :]
        tiles = seen.reshape(-1, n_tiles, width).any(-1).any(0).nonzero()  # the tiles some row of the block sees
        if len(tiles) == 0:
            continue
        cols = slice(int(tiles[0]) * width, (int(tiles[-1]) + 1) * width)
        out[..., rows, :] = _fa3_tiles(q[..., rows, :], k[..., cols, :], v[..., cols, :], seen[..., cols], width,
                                       scaling)
    return out


def tile_layout(k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, key_positions: torch.Tensor,
                block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The keys grouped by FA3 tile (position // block_n) into ``n_tiles`` slots of ``width`` keys each (width:
    the most keys of one tile, more than ``block_n`` where keys are versions of one token), empty slots padded
    with zero keys and values that no query sees. k, v ``[batch, heads, Tk, d]``, allowed ``[..., Tq, Tk]``,
    key_positions int64 ``[Tk]``; returns (k, v ``[batch, heads, n_tiles · width, d]``, allowed ``[..., Tq,
    n_tiles · width]``, width). Keys in position order from a tile's start (a prefill, a sliding window) move
    only by the padding."""
    tiles = torch.div(key_positions, block_n, rounding_mode="floor")
    tiles = tiles - tiles.min()
    n_tiles = int(tiles.max()) + 1
    counts = torch.bincount(tiles, minlength=n_tiles)
    width = int(counts.max())
    order = torch.argsort(tiles, stable=True)
    first_of_tile = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(tiles)
    slot[order] = torch.arange(len(tiles), device=tiles.device) - first_of_tile[tiles[order]]
    dest = tiles * width + slot
    size = n_tiles * width
    if torch.equal(dest, torch.arange(len(tiles), device=tiles.device)):  # only padding at the end
        pad = size - len(tiles)
        if pad == 0:  # whole tiles: the tensors as they are (F.pad would copy them)
            return k, v, allowed, width
        return (F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(allowed, (0, pad), value=False), width)
    k_out = k.new_zeros((*k.shape[:-2], size, k.shape[-1])).index_copy_(-2, dest, k)
    v_out = v.new_zeros((*v.shape[:-2], size, v.shape[-1])).index_copy_(-2, dest, v)
    allowed_out = allowed.new_zeros((*allowed.shape[:-1], size)).index_copy_(-1, dest, allowed)
    return k_out, v_out, allowed_out, width


def _fa3_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, width: int,
               scaling: float) -> torch.Tensor:
    """The closed form of the module docstring for q ``[batch, heads, Tq, d]`` over k, v ``[batch, heads, n_tiles ·
    width, d]`` (GQA expanded, tile by tile: ``tile_layout``), ``allowed`` broadcastable to ``[batch, heads, Tq,
    n_tiles · width]``."""
    scores = (q @ k.transpose(-1, -2)).mul_(scaling * LOG2_E).masked_fill_(~allowed, -math.inf)  # log2 units
    scores = scores.unflatten(-1, (-1, width))  # [batch, heads, Tq, n_tiles, width]
    # running[..., t]: the max over tiles t, t+1, ... (FA3 processes them from the last), [batch, heads, Tq, n_tiles]
    running = scores.amax(-1).flip(-1).cummax(-1).values.flip(-1)
    seen = running > -math.inf  # False only where this tile and every later one are masked
    # P in [0, 256], in the scores' buffer (the same ops as out of place: the same bits, no new [.., keys] tensors)
    p = scores.sub_((torch.where(seen, running, 0.0) - MAX_OFFSET).unsqueeze(-1)).exp2_()
    rescale = torch.where(seen, torch.exp2(running - running[..., :1]), 0.0).unsqueeze(-1)  # later rescalings
    row_sum = (p.sum(-1, keepdim=True) * rescale).sum(-2)  # of the unrounded P, tile by tile, as FA3's row_sum
    out = round_p_to_e4m3(p, in_place=True).mul_(rescale).flatten(-2) @ v
    return out * torch.where(row_sum > 0, 1.0 / row_sum, 0.0)


@register
@dataclass(frozen=True)
class Fa3Fp8Attention(KVTransform):
    """The attention computed as FlashAttention 3's FP8 kernel does it, with ``block_n`` keys per tile (module
    docstring). Attention hook only; K/V precision comes from the spec (``fp8_e4m3`` for vLLM's cache), the query's
    from ``query_fp8``."""

    name: ClassVar[str] = "fa3_fp8_attention"
    block_n: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.block_n, int) or isinstance(self.block_n, bool) or self.block_n < 1:
            raise ValueError(f"'block_n' must be a positive integer (keys per tile); got {self.block_n!r}")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  key_positions: torch.Tensor, scaling: float, ctx: TransformContext) -> torch.Tensor:
        return fa3_fp8_attention(q, k, v, allowed, key_positions, scaling, self.block_n)


__all__ = ["Fa3Fp8Attention", "MAX_OFFSET", "fa3_fp8_attention", "round_p_to_e4m3", "round_to_e4m3", "tile_layout"]
