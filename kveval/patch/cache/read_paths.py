"""The real cache's two read paths (the package docstring, "Two read paths"): how a layer holds the history that
attention reads, one ``ReadPath`` class each, which the layer holds (``QuantizedKVCache`` picks it from its
``READ_PATHS`` table); the same numbers (tested bit for bit in float64).

- ``LeanReadPath``: between calls, what the bill says (codes, scales, full-precision sinks and residual); a call
  assembles a transient read buffer ``[batch, kv_heads, n, head_dim]`` (``assembled``) and drops it.
- ``BufferedReadPath``: one read buffer per tensor, kept and grown across calls; a call writes its new tokens
  after the history (O(new tokens) a step, more memory than an unquantized cache).
"""

from __future__ import annotations

import torch

from kveval.patch.cache.buffers import grown_capacity, moved
from kveval.patch.cache.layer import QuantizedKVLayer, ReadPath
from kveval.patch.cache.storage import TensorStore


class LeanReadPath(ReadPath):
    """The lean read path: between calls the layer holds the packed codes and scales and, per tensor and row, the
    full-precision tokens not quantized (its sinks and its positions from where its quantized tokens end; no
    padding), exactly sized (``TensorStore.tails`` / ``sinks``); with pre-RoPE keys also the (cos, sin) of every
    held position. A call dequantizes the history into a transient read buffer (``assembled``), attends over it
    and drops it: the peak is the bill plus one layer's full-precision history."""

    evict_copies = True  # what eviction keeps of a piece, in tensors of its size: the bill, nothing more
    keeps_buffers = False  # the read buffers are dropped at the end of each call

    def capacity_for(self, capacity: int, need: int) -> int:
        return need  # the RoPE table holds exactly the positions held

    def keeps_read_back(self, defer: bool) -> bool:
        return not defer  # deferred: the next call assembles its read buffer from the codes

    def open_call(self, layer: QuantizedKVLayer, n_after: int, key_states: torch.Tensor,
                  value_states: torch.Tensor) -> None:
        """Transient read buffers for positions ``[evicted, n_after)`` (``assembled``), which the call fills and
        ``close_call`` drops."""
        for store in layer.stores.values():
            store.pending.clear()  # the codes hold them: read back
            store.view, store.raw = assembled(layer, store, n_after)
        layer.base, layer.capacity = layer.evicted, n_after - layer.evicted

    def close_call(self, layer: QuantizedKVLayer) -> None:
        """Keep, per tensor and row, only what is not quantized (``RowPositions.unquantized``), exactly sized; drop
        the read buffers."""
        base, n, positions = layer.base, layer.n_stored, layer.positions()
        for store in layer.stores.values():
            assert store.view is not None
            starts, sinks = positions.unquantized(store.sched, quantizes=not store.q.is_none)
            src = store.raw if store.raw is not None else store.view
            store.tails = [(tuple(rows), start, src[layer.rows_index(tuple(rows)), :, start - base:n - base].clone())
                           for start, rows in starts.items() if start < n]
            store.sinks = [(b, first, store.view[b:b + 1, :, first - base:end - base].clone())
                           for b, first, end in sinks]
            store.view = store.raw = None
            store.pending.clear()
        layer.capacity = 0
        layer.rope.trim(layer.rope_live())  # the window moved on: keep what is read again


def assembled(layer: QuantizedKVLayer, store: TensorStore, n_after: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``store``'s read buffer (and ``raw``) for positions ``[evicted, n_after)`` of a layer on the lean read path,
    built from what it holds between calls: the full-precision tokens as they are, the quantized ones read back
    from their codes, padding positions zero (masked, they weigh exactly 0); positions ``[n, n_after)`` are left
    for the call to write."""
    assert store.shape is not None
    base, n = layer.evicted, layer.n_stored
    heads, dim, dtype = store.shape
    # every position of a row is written below or by the call (sinks, pieces, tails, new tokens) but padding
    shape = (len(layer.pads), heads, n_after - base, dim)
    view = (torch.zeros if any(layer.pads) else torch.empty)(shape, dtype=dtype, device=layer.device)
    # raw is read only at positions still in full precision, which the tails and the call write
    raw = torch.empty_like(view) if store.q.reads_transformed and not store.q.is_none else None
    for rows, start, values in store.tails:
        index, lo, hi = layer.rows_index(rows), start - base, n - base
        if raw is not None:
            raw[index, :, lo:hi] = values
            values = store.q.full_precision(values, layer.rope.at(index, start, n))
        view[index, :, lo:hi] = values
    for row, start, values in store.sinks:
        view[row:row + 1, :, start - base:start - base + values.shape[2]] = values
    for p in store.pieces:
        first = max(p.start, base)
        if p.end <= first:
            continue
        index = layer.rows_index(p.rows)
        if isinstance(index, slice) and first == p.start and store.q.reads_back_stored:
            p.chunk.read_storage_into(view[:, :, first - base:p.end - base])  # no transform: in place
        else:
            view[index, :, first - base:p.end - base] = store.read_back(p, layer.rope)[:, :, first - p.start:]
    return view, raw


class BufferedReadPath(ReadPath):
    """The buffered read path: what attention reads lives in one preallocated buffer per tensor (``[batch,
    kv_heads, capacity, head_dim]`` with a fill pointer, kept across calls): a stored token is written once, a
    quantized token is overwritten once by its read-back value, and a call returns a view of the buffer, never a
    concatenation of the history. A step costs O(new tokens), but every token's read-back value is kept in full
    precision besides its codes."""

    evict_copies = False  # the read buffers hold every position anyway; compacted when they run out of room
    keeps_buffers = True

    def capacity_for(self, capacity: int, need: int) -> int:
        return grown_capacity(capacity, need, self.reserve)

    def keeps_read_back(self, defer: bool) -> bool:
        return True

    def open_call(self, layer: QuantizedKVLayer, n_after: int, key_states: torch.Tensor,
                  value_states: torch.Tensor) -> None:
        """Make the read buffers hold positions up to ``n_after``: allocate them at the first call (``reserve`` or
        twice the prompt), else drop the evicted front and/or double the capacity (amortised O(1) per position)."""
        if n_after - layer.base <= layer.capacity:
            return
        live = layer.evicted  # positions before ``evicted`` are never read nor quantized again
        capacity = grown_capacity(layer.capacity, n_after - live, self.reserve)
        start, stop = live - layer.base, layer.n_stored - layer.base
        for store, x in ((layer.stores["key"], key_states), (layer.stores["value"], value_states)):
            store.apply_pending(layer.base)
            store.view = moved(store.view, x, 2, start, stop, capacity)
            if store.q.reads_transformed and not store.q.is_none:
                store.raw = moved(store.raw, x, 2, start, stop, capacity)
        layer.base, layer.capacity = live, capacity

    def close_call(self, layer: QuantizedKVLayer) -> None:
        """Nothing: the read buffers are kept, and the next call writes after what they hold."""


__all__ = ["BufferedReadPath", "LeanReadPath", "assembled"]
