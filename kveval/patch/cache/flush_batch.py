"""Fewer, larger quantize calls in the real cache: a layer's keys and values together (``together``), and the
flushes of every layer of a model call together (``FlushBatch``).

A decode step of a 30-layer model quantizes one new token of 60 tensors. Quantized one tensor at a time, that is 60
calls of a few dozen small tensor operations each, and at batch 1 their fixed costs are most of what the cache
adds to a step. Two ways to make fewer calls, the same bits:

* **Keys and values of one layer** quantized alike (the same spec, the same schedule, so the same flush plan; no
  transform, no calibrated parameters: ``quantizes_rows_alone``) are concatenated along the batch dimension and
  quantized in one call (``quantize_together``), then cut back into each store's piece. Every preset that
  quantizes K and V with one spec: 60 calls a step become 30.
* **Across layers**, a token that a call quantizes after its attention has read it in full precision (every mode
  but ``sliding``: ``Schedule.reads_first``) reaches the read buffer only at the next call
  (``TensorStore.pending``), so nothing in this call reads its codes: on the buffered read path the layers hand
  such flushes to the cache's ``FlushBatch``, which quantizes them, grouped by spec and plan, when the call's last
  quantized layer has stored its tokens (before the call returns). KIVI's values (``sliding_lag``): 30 calls a
  step become 1.

Why the bits are the same: the statistics of per-token and per-group formats never reach across rows (``whole
tensor`` formats, whose statistics span the heads, per-channel statistics, which span tokens, and the per-head and
per-tensor granularities, which take calibrated scales only, are left out), so a row quantized beside other rows
gets the codes, scales and read-back values it gets alone. tests/test_flush_batch.py checks it for every
quantization preset, mixed per-layer specs, KIVI, sinks and left-padded batches.

Shapes: a store's tensors ``[batch, kv_heads, T, head_dim]``; ``n`` stores' rows together ``[n * rows, kv_heads,
t, head_dim]``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch

from kveval.patch.cache.schedule import FlushPlan
from kveval.patch.cache.storage import StoredChunk, StoredPiece, TensorStore


class QuantizedKVLayer(Protocol):
    """What this module reads of a cache layer (``kveval.patch.cache.layer.QuantizedKVLayer``, which imports this
    module: the arrow points from the layer to its flushes)."""

    base: int
    window: int | None
    device: torch.device

    @property
    def read_path(self): ...

    def rows_index(self, rows: tuple[int, ...]) -> slice | torch.Tensor: ...


@dataclass(frozen=True)
class FlushJob:
    """One store's flush in a call: its plan (``RowPositions.flush_plan``), whether the read-back values are kept
    (``keep``) and whether they wait for the next call (``defer``)."""

    store: TensorStore
    plan: FlushPlan
    keep: bool
    defer: bool


def quantizes_rows_alone(store: TensorStore) -> bool:
    """Whether ``store``'s quantizer gives each batch row what it gives that row alone and depends on nothing of the
    layer: no transform, no calibrated parameters, statistics per token or per group of a token's channels."""
    q = store.q
    spec = q.spec
    return (not q.is_none and not q.transforms.transforms and q.qparams is None and not spec.fmt.whole_tensor
            and spec.granularity != "channel" and not spec.gran.static_only)


def together(a: FlushJob, b: FlushJob) -> bool:
    """Whether two stores' flushes may run as one quantize call: both quantize rows alone with the same spec, the
    same plan and the same handling of what they read back, and hold tensors of one shape."""
    return (quantizes_rows_alone(a.store) and quantizes_rows_alone(b.store) and a.store.q.spec == b.store.q.spec
            and a.plan == b.plan and a.keep == b.keep and a.defer == b.defer and a.store.shape == b.store.shape)


def deferrable(layer: QuantizedKVLayer, job: FlushJob) -> bool:
    """Whether ``job`` may wait for the end of the model call: its read-back values wait for the next call anyway
    (``defer``), the read buffer outlives the call (``ReadPath.keeps_buffers``), no window evicts after the flush,
    and its quantizer quantizes rows alone."""
    return (job.defer and layer.read_path.keeps_buffers and layer.window is None
            and quantizes_rows_alone(job.store))


def quantize_together(members: list[tuple[QuantizedKVLayer, FlushJob]], rows: tuple[int, ...], start: int,
                      end: int) -> None:
    """Positions ``[start, end)`` of ``rows`` of every member's store (one spec: ``together``), quantized in one
    call and cut back into one piece per store, their read-back values written into the read buffer now or at the
    next call (``defer``), as ``TensorStore.flush`` does for one store."""
    xs = [job.store.source()[layer.rows_index(rows), :, start - layer.base:end - layer.base] for layer, job in members]
    first = members[0][1]
    chunk = StoredChunk.store(torch.cat(xs) if len(xs) > 1 else xs[0], first.store.q, None, None, decode=first.keep)
    n = len(rows)
    for i, (layer, job) in enumerate(members):
        part = chunk.rows(i * n, (i + 1) * n) if len(members) > 1 else chunk
        decoded, part.decoded = part.decoded, None
        job.store.push(StoredPiece(rows, start, end, part, None))
        if not job.keep:
            continue
        assert decoded is not None
        if job.defer:
            job.store.pending.append((rows, start, end, decoded))
        else:
            job.store.write_view(rows, start, end, decoded, layer.base)


class FlushBatch:
    """The deferrable flushes the layers of one cache queue during a model call (module docstring), run together
    at the end of the update of ``last`` (the cache's last quantized layer), or earlier by ``run``: when a layer
    that has a flush queued starts its next call before that (a call that stopped early, a model that leaves its
    last layers' caches alone), and before anything reads what a layer stores (``QuantizedKVLayer.settle``)."""

    def __init__(self) -> None:
        self.last: QuantizedKVLayer | None = None
        self.queued: list[tuple[QuantizedKVLayer, FlushJob]] = []

    def add(self, layer: QuantizedKVLayer, job: FlushJob) -> None:
        """Queue ``job`` of ``layer``."""
        self.queued.append((layer, job))

    def holds(self, layer: QuantizedKVLayer) -> bool:
        """Whether a flush of ``layer`` waits here: its next call must not read before it has run."""
        return any(queued is layer for queued, _ in self.queued)

    def run(self) -> None:
        """Quantize everything queued: per (spec, plan, what is read back, shape, device), one call."""
        queued, self.queued = self.queued, []
        groups: dict[tuple, list[tuple[QuantizedKVLayer, FlushJob]]] = defaultdict(list)
        for layer, job in queued:
            groups[(job.store.q.spec, job.plan, job.keep, job.store.shape, str(layer.device))].append((layer, job))
        for members in groups.values():
            for rows, start, end in members[0][1].plan:
                quantize_together(members, rows, start, end)


__all__ = ["FlushBatch", "FlushJob", "deferrable", "quantize_together", "quantizes_rows_alone", "together"]
