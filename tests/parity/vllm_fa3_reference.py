"""A reference implementation of vLLM's FP8 KV cache on the FlashAttention 3 backend (``--kv-cache-dtype fp8``,
FLASH_ATTN backend, Hopper), written from reading the sources and independent of kveval (it imports torch and
transformers only), for the parity tests of kveval's ``vllm_fp8_fa3`` preset. vLLM and FA3 need CUDA and a Hopper
GPU; this follows their arithmetic in plain torch, as a transformers ``Cache`` plus an attention function that a
HuggingFace Llama-family or Gemma3 model runs in place of its own.

Sources read (paraphrased, not copied):

- vllm-project/vllm at 5704f34 (V1 engine), with 0084b78 for the older layout:
  * vllm/attention/layer.py: ``set_default_quant_scales`` gives ``_q_scale = _k_scale = _v_scale = 1.0`` unless a
    checkpoint carries the scales (``calculate_kv_scales``, off by default, would set them once from the first
    batch: max|x| / 200 for q and k, / 100 for v); with an fp8 cache and a backend whose
    ``supports_quant_query_input`` is set (FlashAttention), ``Attention.forward`` quantizes the query with
    ``QuantFP8(static=True, group_shape=PER_TENSOR)`` and ``_q_scale`` (before vllm-project/vllm#24914, 2025-09,
    ``FlashAttentionImpl.forward`` did the same with ``ops.scaled_fp8_quant(query, layer._q_scale)``).
  * vllm/model_executor/layers/quantization/input_quant_fp8.py (``QuantFP8.forward_native``) and
    csrc/quantization/w8a8/fp8/common.cu (``scaled_fp8_quant_kernel_strided``): in float32, ``x * (1 / scale)``,
    clamp to [-448, 448], convert to e4m3 (round to nearest even).
  * vllm/v1/attention/backends/flash_attn.py: ``do_kv_cache_update`` (``forward`` in 0084b78) writes the new K/V
    with ``reshape_and_cache_flash(..., kv_cache_dtype, layer._k_scale, layer._v_scale)`` before the attention
    call, so a prompt attends to its own FP8 K/V; ``forward`` views the cache as float8_e4m3fn and calls
    ``flash_attn_varlen_func(q, k_cache, v_cache, ..., softmax_scale, causal=True, window_size=(sliding_window - 1,
    0), q_descale=_q_scale, k_descale=_k_scale, v_descale=_v_scale)``.
  * csrc/cache_kernels.cu (``reshape_and_cache_flash_kernel``, ``CopyWithScaleOp``) and
    csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh (``scaled_vec_conversion``): ``__nv_cvt_float_to_fp8(
    float(x) / scale, __NV_SATFINITE, __NV_E4M3)``: a true division in float32, then a saturating conversion.
- vllm-project/flash-attention at 617264c (vLLM's fork, built as ``vllm_flash_attn``), hopper/:
  * flash_api.cpp: FP8 input gives a BF16 output; a single query row with no window is run as non-causal.
  * flash_fwd_kernel_sm90.h: for FP8 the softmax scale (softmax_scale · log2 e) is multiplied by
    ``q_descale · k_descale``; ``flash::Softmax`` gets ``Max_offset = 8``.
  * mainloop_fwd_sm90_tma_gmma_ws.hpp (``mma``): key tiles of ``kBlockN`` keys, aligned at key 0, from the last one
    down to the first; per tile: S = Q·Kᵀ, masking, the online softmax, P converted to e4m3 (``convert_type_out``),
    O += P·V; at the end O is multiplied by the factor ``finalize`` returns.
  * softmax.h: ``max_get_scale`` (new running max; ``row_sum`` and O are multiplied by ``exp2((m_old - m_new) ·
    scale)``; a max of -inf counts as 0), ``scale_apply_exp2`` (``P = exp2(S · scale - (m · scale - 8))``),
    ``online_softmax`` (``row_sum`` adds the float32 P before rounding), ``finalize`` (``v_descale / row_sum``, 0
    for a zero or NaN sum).
  * tile_size.h / heuristics.h: kBlockN = 128 for the FP8 kernel with head_dim <= 96.

Here every product is computed in the dtype of the model (float64 in the exact tests; FA3 accumulates in float32
on tensor cores), P is rounded to float32 and then to e4m3 as FA3 converts its float32 P, and the attention output
stays in the model's dtype (not BF16). One split only (FA3's split-KV for small batches is not followed).

Shapes: K/V ``[batch, kv_heads, seq, head_dim]``, queries ``[batch, heads, seq, head_dim]``.
"""

from __future__ import annotations

import inspect
import math

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

VLLM_COMMIT = "5704f34f361c6c59a9c092c4e1e96730cc6dc14d"
FLASH_ATTENTION_COMMIT = "617264c1c7955c9e84817654ebeedff069f3c5f1"
E4M3_MAX = 448.0
MAX_OFFSET = 8  # Max_offset of FA3's FP8 softmax
IMPLEMENTATION = "vllm_fa3_fp8_reference"


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn through float32, saturating (``__NV_SATFINITE``)."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_query(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    """vLLM's static per-tensor query quantization: float32 ``x * (1 / q_scale)``, clamp, e4m3 codes."""
    inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(q_scale, dtype=torch.float32)
    return (q.to(torch.float32) * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def write_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``reshape_and_cache_flash`` for one tensor: float32 ``x / scale``, saturating e4m3 codes."""
    return e4m3(x.to(torch.float32) / torch.tensor(scale, dtype=torch.float32))


def fa3_fp8_forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, softmax_scale: float, q_descale: float,
                    k_descale: float, v_descale: float, block_n: int, window_left: int | None = None,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """FA3's FP8 forward for one sequence: q8 ``[batch, heads, Tq, d]``, k8/v8 ``[batch, kv_heads, Tk, d]``
    (float8_e4m3fn codes, the Tq queries being the last Tq positions), causal (bottom-right aligned) with an
    optional left window (key j visible to query i at position p_i iff p_i - window_left <= j <= p_i). Returns
    ``[batch, heads, Tq, d]`` in ``dtype``, computed tile by tile as the kernel's main loop does."""
    heads, kv_heads, n_q, n_k = q8.shape[1], k8.shape[1], q8.shape[2], k8.shape[2]
    group = heads // kv_heads
    q = q8.to(dtype)
    k = k8.to(dtype).repeat_interleave(group, dim=1)
    v = v8.to(dtype).repeat_interleave(group, dim=1)
    scale_log2 = softmax_scale * math.log2(math.e) * q_descale * k_descale
    query_pos = torch.arange(n_k - n_q, n_k)[:, None]  # [Tq, 1]
    shape = (*q.shape[:-1], 1)
    row_max = torch.full(shape, -math.inf, dtype=dtype)
    row_sum = torch.zeros(shape, dtype=dtype)
    acc = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)
    n_tiles = (n_k + block_n - 1) // block_n
    for tile in reversed(range(n_tiles)):  # n_block_max - 1 down to 0
        lo, hi = tile * block_n, min((tile + 1) * block_n, n_k)
        key_pos = torch.arange(lo, hi)[None, :]
        visible = key_pos <= query_pos
        if window_left is not None:
            visible &= key_pos >= query_pos - window_left
        s = (q @ k[:, :, lo:hi].transpose(-1, -2)).masked_fill(~visible, -math.inf)
        # max_get_scale
        old_max = row_max
        row_max = torch.maximum(old_max, s.amax(-1, keepdim=True))
        current = torch.where(row_max == -math.inf, 0.0, row_max)
        rescale = torch.exp2((old_max - current) * scale_log2)  # exp2(-inf) = 0 on the first visible tile
        row_sum = row_sum * rescale
        acc = acc * rescale
        # online_softmax (scale_apply_exp2 with Max_offset, then the float P summed before rounding)
        max_scaled = torch.where(row_max == -math.inf, 0.0, row_max * scale_log2 - MAX_OFFSET)
        p = torch.exp2(s * scale_log2 - max_scaled)
        row_sum = row_sum + p.sum(-1, keepdim=True)
        acc = acc + e4m3(p).to(dtype) @ v[:, :, lo:hi]
    # finalize
    inv_sum = torch.where((row_sum == 0) | torch.isnan(row_sum), 0.0, 1.0 / row_sum)
    return acc * (inv_sum * v_descale)


class Fp8CacheLayer(DynamicLayer):
    """One layer of vLLM's FP8 cache: every token's K/V as e4m3 codes (``write_cache``), kept whole."""

    def __init__(self, k_scale: float, v_scale: float):
        super().__init__()
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k8: torch.Tensor | None = None
        self.v8: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens, then hand attention the whole cache as codes (in the model's dtype: exact)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k8, v8 = write_cache(key_states, self.k_scale), write_cache(value_states, self.v_scale)
        self.k8 = k8 if self.k8 is None else torch.cat([self.k8, k8], dim=-2)
        self.v8 = v8 if self.v8 is None else torch.cat([self.v8, v8], dim=-2)
        return self.k8.to(self.dtype), self.v8.to(self.dtype)

    def get_seq_length(self) -> int:
        return 0 if self.k8 is None else self.k8.shape[-2]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k8, self.v8) if t is not None)


class Fp8Cache(Cache):
    """vLLM's FP8 KV cache for ``num_layers`` layers (per-tensor ``k_scale``/``v_scale``, 1.0 by default)."""

    def __init__(self, num_layers: int, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__(layers=[Fp8CacheLayer(k_scale, v_scale) for _ in range(num_layers)])
        self.k_scale, self.v_scale = k_scale, v_scale

    def nbytes(self) -> int:
        """Bytes of the e4m3 codes held (one per element, K and V): what vLLM's blocks hold for these tokens."""
        return sum(layer.nbytes() for layer in self.layers)


def float32_value(x: float) -> float:
    """x as vLLM holds a scale: a float32 tensor (``_q_scale``, ``_k_scale``, ``_v_scale``)."""
    return torch.tensor(x, dtype=torch.float32).item()


def attention_function(block_n: int, q_scale: float, k_scale: float, v_scale: float):
    """A transformers attention function running vLLM's FA3 FP8 attention over the codes ``Fp8Cache`` returns
    (the descales are the float32 scales)."""
    q_scale, k_scale, v_scale = float32_value(q_scale), float32_value(k_scale), float32_value(v_scale)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  **kwargs):
        q8 = quantize_query(query, q_scale)
        window_left = None if not sliding_window else sliding_window - 1  # vLLM: (sliding_window - 1, 0)
        out = fa3_fp8_forward(q8, e4m3(key), e4m3(value), softmax_scale=scaling, q_descale=q_scale,
                              k_descale=k_scale, v_descale=v_scale, block_n=block_n, window_left=window_left,
                              dtype=query.dtype)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _cache_kwargs(model, cache) -> dict:
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


@torch.no_grad()
def reference_logits(model, ids: torch.Tensor, prompt: int, *, block_n: int = 128, q_scale: float = 1.0,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, Fp8Cache]:
    """vLLM-FA3-FP8 logits ``[T, vocab]`` of ids ``[T]``: the first ``prompt`` ids in one call, then one id per
    step, each call writing its K/V to the FP8 cache before attending. Returns (logits, the cache). The model's
    attention implementation is switched for the calls and restored afterwards."""
    ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, attention_function(block_n, q_scale, k_scale, v_scale))
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)
    original = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        cache = Fp8Cache(model.config.num_hidden_layers, k_scale, v_scale)
        kw = _cache_kwargs(model, cache)
        ids = ids[None]
        out = [model(ids[:, :prompt], use_cache=True, **kw).logits[0]]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], use_cache=True, **kw).logits[0])
        return torch.cat(out), cache
    finally:
        model.set_attn_implementation(original)
