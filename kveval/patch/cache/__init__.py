"""A real quantized KV cache for ``model.generate()`` and step-by-step decoding.

Each layer holds, per row and in position order: the sink tokens in full precision, the quantized middle as packed
integer codes (or FP8 bytes) with scales/zero points in their storage dtype, and the full-precision residual
window. ``nbytes()`` reports the bytes held.

Usage::

    cache = QuantizedKVCache(model, KVPolicy.preset("int4_g64"))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20)
    # a left-padded batch: each row is quantized exactly as if it were decoded alone
    out = model.generate(ids, attention_mask=mask, past_key_values=QuantizedKVCache(model, policy), ...)

Semantics (the same as ``emulate``; ``kveval.policy.masks``, per tensor: keys and values may follow different
schedules): a token is quantized when it leaves the residual window (``sliding``: stored, then read;
``sliding_lag``: read, then moved), after the call that completes its block of ``residual`` tokens (``block``:
read, then flushed), or, for transformers' schedule (``prompt_block``), at the end of the first call for the
prompt and then in blocks counted from the prompt end; sinks never are. A call that brings more than one token (the prefill) answers,
with ``prefill: fp``, the new tokens in full precision (what serving engines do); with ``prefill: quantized`` and
for single-token decode steps it answers what it holds under that schedule.

Batches and left padding. Row ``b`` of a batch may start with ``p_b`` padding positions (``left_padding``, read
from the ``attention_mask`` of the first forward call that receives the cache, or given to the constructor). Every
row follows the schedule of its own tokens, exactly as if it were decoded alone: its sinks are its first
``sink_tokens`` real tokens, its residual window and blocks count its real tokens (``prompt_block`` counts from its
own prompt end), per-channel statistics never see a padding position, and sliding-window eviction drops the same
real tokens. Padding positions are never quantized and never billed: ``nbytes()`` is the sum of the rows' bills
(static scales, one per layer and tensor, counted once). Without an attention mask and without ``left_padding``,
every row starts at position 0. Exactness per row needs what the model itself guarantees: the same logits for a
row alone and in a padded batch (float rounding aside).

Two read paths (``read=``; ``READ_PATHS`` gives the class of each, a strategy object every quantized layer of the
cache holds), the same numbers (tested bit for bit in float64):

* ``"lean"`` (the default): between calls a layer holds what its bill says and nothing else: the packed codes and
  scales, and the full-precision sink and residual tokens (``nbytes()`` equals the bytes of the tensors it holds,
  ``resident_nbytes``). One exception: with pre-RoPE keys (``pre_rope``) a layer also keeps the ``(cos, sin)`` of
  every held position, 2 x head_dim values per token in the model's dtype, which an engine recomputes from the
  positions. A call dequantizes that layer's history into a transient buffer
  ``[batch, kv_heads, n, head_dim]``, attends over it and drops it, as a kernel that dequantizes on read would: the
  peak is the bill plus one layer's full-precision history, and a step costs O(context) dequantization.
* ``"buffered"``: what attention reads lives in one preallocated buffer per tensor (``[batch, kv_heads, capacity,
  head_dim]`` with a fill pointer): a stored token is written once, a quantized token is overwritten once by its
  read-back value, and a call returns a view of the buffer, never a concatenation of the history. Faster (a step
  costs O(new tokens)), but it keeps every token's read-back value in full precision besides its codes: more
  memory than an unquantized cache. For speed where memory does not matter (the tasks' generation).

In both, the packed codes and scales of the tokens quantized in one call (by all rows that quantize the same
positions, in one quantize call; on the buffered path, by every layer whose quantizer is the same, in one call at
the end of the model call, ``flush_batch``) form a ``StoredChunk``; consecutive chunks are merged in a binary-counter
pattern, so each token's codes are copied O(log n) times in all. Which rows quantize which positions at a call is
computed once per call and shared by all layers.

The modules: ``storage`` (``StoredChunk``, ``StoredPiece``, ``TensorStore``: what a layer stores per tensor kind),
``schedule`` (``RowPositions``: which positions each row holds quantized), ``buffers`` (buffer growth, the RoPE
table), ``layer`` (``QuantizedKVLayer``, the one layer class: schedule, flush, eviction, byte accounting, refusals;
``ReadPath``, the interface of the read path it holds), ``flush_batch`` (``FlushBatch``: the layers' flushes of one call quantized together), ``read_paths`` (``LeanReadPath``, ``BufferedReadPath``),
``hybrid`` (``QuantizedHybridLayer``: a layer that also holds a linear-attention / Mamba state), ``holdings``
(``LayerHoldings``, a read-only view of what a layer holds, for tests and tools), ``quantized_cache``
(``QuantizedKVCache``, ``READ_PATHS``, ``decode_logits``) and ``measure`` (``resident_nbytes``, ``watch_peak``,
``state_nbytes``).
"""

from kveval.patch.cache.holdings import LayerHoldings
from kveval.patch.cache.hybrid import QuantizedHybridLayer
from kveval.patch.cache.layer import LayerSetup, QuantizedKVLayer, ReadPath
from kveval.patch.cache.measure import resident_nbytes, state_nbytes, watch_peak
from kveval.patch.cache.quantized_cache import (
    READ_PATHS,
    QuantizedKVCache,
    cache_kwargs,
    decode_logits,
    left_padding_of,
)
from kveval.patch.cache.read_paths import BufferedReadPath, LeanReadPath
from kveval.patch.cache.storage import StoredChunk

__all__ = [
    "READ_PATHS", "BufferedReadPath", "LayerHoldings", "LayerSetup", "LeanReadPath", "QuantizedHybridLayer",
    "QuantizedKVCache", "QuantizedKVLayer", "ReadPath", "StoredChunk", "cache_kwargs", "decode_logits",
    "left_padding_of", "resident_nbytes", "state_nbytes", "watch_peak",
]
