"""The layer of the real cache (``QuantizedKVLayer``) and the interface of its read path (``ReadPath``).

One attention layer's K/V, ``[batch, kv_heads, seq, head_dim]``: the schedule (which positions each row quantizes
at a call, ``kveval.patch.cache.schedule``), the flush into quantized storage (``kveval.patch.cache.storage``),
sliding-window eviction, the byte accounting (``nbytes``), the attention hook of transforms that act on the query
or the output, and the refusals of what transformers would otherwise do to its own placeholders. How attention
reads the history, a read buffer assembled at every call or one kept across calls, is the layer's read path, an
object it holds (``LayerSetup.read_path``: one of ``kveval.patch.cache.read_paths``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers.cache_utils import DynamicLayer

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.cache.buffers import RopeTable
from kveval.patch.cache.flush_batch import FlushBatch, FlushJob, deferrable, quantize_together, together
from kveval.patch.cache.schedule import RowPositions, row_pads
from kveval.patch.cache.storage import TensorStore
from kveval.patch.quantizers import TensorQuantizer
from kveval.patch.rope_capture import rope_for
from kveval.policy import KVPolicy


class ReadPath(ABC):
    """How a layer holds the history that attention reads (the package docstring, "Two read paths"): what it keeps
    of the read buffers between calls, and how its buffers grow. A strategy, not a state: what it keeps lives in
    the layer's stores (``TensorStore.view``, ``tails``...), so one object serves every layer of a cache.
    ``reserve``: positions a growing buffer allocates at the first call (e.g. prompt + new tokens; None: twice the
    prompt)."""

    #: whether eviction copies what it keeps of a cut piece into tensors of its size (a slice keeps the forgotten
    #: bytes alive)
    evict_copies: ClassVar[bool]
    #: whether the read buffers (``TensorStore.view``, ``raw``) outlive a call: a flush may then wait for the end of
    #: the call (``kveval.patch.cache.flush_batch``)
    keeps_buffers: ClassVar[bool]

    def __init__(self, reserve: int | None = None):
        self.reserve = reserve

    @abstractmethod
    def open_call(self, layer: QuantizedKVLayer, n_after: int, key_states: torch.Tensor,
                  value_states: torch.Tensor) -> None:
        """At the start of a call: the layer's read buffers (``TensorStore.view``, ``raw``) hold positions
        ``[evicted, n_after)``, the history as attention reads it, with room for the call's new tokens."""

    @abstractmethod
    def close_call(self, layer: QuantizedKVLayer) -> None:
        """At the end of a call, after eviction: what the layer keeps of the read buffers until the next."""

    @abstractmethod
    def capacity_for(self, capacity: int, need: int) -> int:
        """Positions a growing buffer (the RoPE table) now holding ``capacity`` allocates for ``need``."""

    @abstractmethod
    def keeps_read_back(self, defer: bool) -> bool:
        """Whether a flush keeps the read-back values of what it quantizes (for the read buffer now, or, ``defer``,
        at the next call); if not, they are read back from the codes when needed."""


@dataclass(frozen=True, eq=False)
class LayerSetup:
    """What a layer is built from: its (key, value) quantizers, the policy and its read path; ``window``: the
    positions a sliding-window layer keeps (None: every one); ``module``: the attention module, whose rotary
    embedding transforms such as pre_rope need; ``implementation``: the stock attention implementation that
    ``attend`` wraps (None: no query/output hooks to apply); ``plans``: flush plans, shared by the layers of one
    cache."""

    key_q: TensorQuantizer
    value_q: TensorQuantizer
    policy: KVPolicy
    read_path: ReadPath
    window: int | None = None
    module: torch.nn.Module | None = None
    implementation: str | None = None
    plans: dict = field(default_factory=dict)
    flushes: FlushBatch | None = None


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized cache (the module docstring). Tensors are ``[batch, kv_heads, seq, head_dim]``.

    Keys and values each have their schedule (``KVPolicy.schedule``: KIVI quantizes keys in blocks and values in a
    sliding window), read buffer and quantized storage (``TensorStore``); the sink tokens are shared. Positions
    are stored positions (row ``b``'s real token ``i`` is at ``pads[b] + i``); ``prompt`` is the number of
    positions the first call stored (row ``b``'s prompt: ``prompt - pads[b]`` real tokens).

    A sliding-window layer (``window``: the model config's ``sliding_window``) forgets, at the end of each call,
    every position older than the ``window`` newest (``evicted`` of them so far), as
    ``kveval.memory.token_split`` bills it: sinks, quantized storage and residual are cut at ``n - window``; a
    per-channel token block keeps its codes and scales until all of its tokens have left. What attention reads is
    exactly positions ``[evicted, n)``, which the model's sliding mask limits further. The read buffers hold the
    positions from ``base`` on (``capacity`` of them during a call); what is kept of them between calls is the
    read path's (``read_path``). What it holds is read, without changing it, through
    ``kveval.patch.cache.holdings.LayerHoldings``.
    """

    def __init__(self, setup: LayerSetup, left_padding: Sequence[int] | None = None):
        super().__init__()
        self.setup, self.read_path = setup, setup.read_path
        self.key_q, self.value_q, self.policy = setup.key_q, setup.value_q, setup.policy
        self.key_spec, self.value_spec = setup.key_q.spec, setup.value_q.spec
        self.window, self.is_sliding = setup.window, setup.window is not None
        self.module, self.implementation = setup.module, setup.implementation
        self.needs_rope = setup.key_q.needs_rope or setup.value_q.needs_rope
        self.left_padding = None if left_padding is None else [int(p) for p in left_padding]
        self._empty()

    def _empty(self) -> None:
        """Nothing stored: the state of a new layer (``reset`` returns to it)."""
        self.evicted = 0  # positions [0, evicted) are forgotten (sliding-window layers only)
        self.n_stored = 0
        self.prompt: int | None = None  # positions stored by the first call
        self.pads: list[int] = []
        self.base = 0  # stored position of slot 0 of the read buffers
        self.capacity = 0
        self.stores = {kind: TensorStore(kind, q, self.policy, self.rows_index)
                       for kind, q in (("key", self.key_q), ("value", self.value_q))}
        self.rope = RopeTable()  # only filled when a transform needs_rope: pre-RoPE keys are read back through it

    # --- rows ----------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.pads = row_pads(self.left_padding, key_states.shape[0])
        self._all_rows = tuple(range(key_states.shape[0]))
        # transformers reads dtype/device; fresh empty tensors (a view of key_states would keep its storage alive)
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        for store, x in ((self.stores["key"], key_states), (self.stores["value"], value_states)):
            store.shape = (x.shape[1], x.shape[3], x.dtype)
        self.is_initialized = True

    def rows_index(self, rows: tuple[int, ...]) -> slice | torch.Tensor:
        """Index of ``rows`` along dim 0: a slice for the whole batch (a view), else a LongTensor."""
        if rows == self._all_rows:
            return slice(None)
        return torch.tensor(rows, device=self.device)

    def positions(self) -> RowPositions:
        """Where the rows stand now (``RowPositions``)."""
        return RowPositions(tuple(self.pads), self.prompt or 1, self.n_stored, self.evicted)

    def rope_live(self) -> int:
        """The first position whose (cos, sin) may be read again: the window's first, or the first of a token
        block still stored (per-channel statistics keep a block while any of its tokens is in the window)."""
        firsts = [p.start for store in self.stores.values() for p in store.pieces if store.q.needs_rope]
        return min([self.evicted, *firsts])

    # --- the call ------------------------------------------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        """The attention call while this layer's cache is in use (``kveval.patch.attention.patched_while_passed``,
        only for layers whose transforms hook the query, the output or the attention itself): the query hooks, the
        stock attention (or the transforms' own, ``attn.attention_call``) over the keys/values ``update`` returned,
        then the output hooks. (output, weights) as the stock function."""
        stock = attn.stock_attention(module, self.implementation or "sdpa")
        rope = rope_for(module, query.shape[-1], self.key_q, self.value_q)
        compute = attn.attention_call(stock, self.value_q, rope)
        # ``update`` returned the newest positions in order, ending at n_stored (older ones may be evicted)
        positions = torch.arange(self.n_stored - key.shape[-2], self.n_stored, device=key.device)
        out, weights = compute(module, self.key_q.query(query, rope), key, value, attention_mask, *args,
                               key_positions=positions, **kwargs)
        return self.value_q.output(out, rope), weights

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.implementation is not None and getattr(self.module, attn.STATE_ATTR, None) is not self:
            raise RuntimeError(
                "kveval: this cache's transforms hook the query and the attention output; pass the cache to the "
                "model it was built for (model(..., past_key_values=cache) or model.generate), not to a submodule"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.setup.flushes is not None and self.setup.flushes.holds(self):
            self.setup.flushes.run()  # the last call stopped before its last layer: quantize what it left first
        n_new = key_states.shape[-2]
        n0, n1 = self.n_stored, self.n_stored + n_new
        if self.prompt is None:
            self.prompt = n1
            short = [b for b, p in enumerate(self.pads) if p >= n1]
            if short:
                raise KvevalError(f"rows {short} of the batch are all padding ({n1} positions); give every row a token")
        prefill_fp = self.policy.prefill == "fp" and n_new > 1
        new_rope = rope_for(self.module, key_states.shape[-1], self.key_q, self.value_q) if self.needs_rope else None
        if new_rope is not None:
            self.rope.write(n0, n1, new_rope, self.rope_live(), len(self.pads), self.read_path.capacity_for)
        self.read_path.open_call(self, n1, key_states, value_states)
        base, ev = self.base, self.evicted

        # store the new positions in full precision (as attention reads them; x itself in ``raw`` if that differs)
        fresh = {store.kind: store.store_new(x, n0, n1, base, new_rope)
                 for store, x in ((self.stores["key"], key_states), (self.stores["value"], value_states))}
        self.n_stored = n1
        stores = (self.stores["key"], self.stores["value"])
        out: list[torch.Tensor] = []
        for store in stores:
            assert store.view is not None
            if prefill_fp:  # the new tokens in full precision, after what the cache held before this call
                out.append(fresh[store.kind] if n0 == 0 else torch.cat(
                    [store.view[:, :, ev - base:n0 - base], fresh[store.kind]], dim=-2))
            else:
                out.append(store.view[:, :, ev - base:n1 - base])  # a view: it reads what the flush writes
        # the schedule of kveval.policy.masks (Schedule.read_quantized_end), per tensor: sliding mode stores then
        # reads; the other modes read, then quantize what this call completed (its queries saw it in full
        # precision): their read-back values reach the read buffer at the next call
        self._flush(n0)
        if prefill_fp:
            out = [self._single_token_rows(store, read, n0, n1) for store, read in zip(stores, out)]
        self._evict()
        self.read_path.close_call(self)  # ``out`` keeps what the read path drops alive until attention has read it
        if self.setup.flushes is not None and self.setup.flushes.last is self:
            self.setup.flushes.run()  # the call's last quantized layer: what every layer queued, together
        return out[0], out[1]

    def _single_token_rows(self, store: TensorStore, read: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
        """With ``prefill: fp``, a multi-token call answers its new tokens in full precision; a row whose part of
        the call is a single real token (padding before it) answers what the schedule reads instead, as that row
        decoded alone would (its call brings one token)."""
        rows = [b for b, p in enumerate(self.pads) if n1 - max(n0, p) == 1]
        if not rows:
            return read
        assert store.view is not None
        read = read.clone()
        sched_read = store.view[:, :, self.evicted - self.base:n1 - self.base]  # reads_first: pending not applied
        index = torch.tensor(rows, device=read.device)
        read[index] = sched_read[index]
        return read

    def _flush(self, n0: int) -> None:
        """Quantize the positions that left the keys' and the values' residual in this call, from ``n0`` to
        ``n_stored`` positions, as planned by ``RowPositions.flush_plan`` (a plan is shared by the layers of one
        cache: the same for every layer with this schedule and eviction state). Where the two are quantized alike
        (``flush_batch.together``), in one call; a flush that can wait for the end of the model call
        (``flush_batch.deferrable``) goes to the cache's ``FlushBatch``; any other, ``TensorStore.flush``."""
        positions, plans = self.positions(), self.setup.plans
        jobs: list[FlushJob] = []
        for store in (self.stores["key"], self.stores["value"]):
            if store.q.is_none:  # a tensor kept in full precision: the read buffer already holds it
                continue
            plan = plans.get((store.sched, n0, positions))
            if plan is None:
                if len(plans) > 256:
                    plans.clear()
                plan = plans[(store.sched, n0, positions)] = positions.flush_plan(store.sched, n0)
            if not plan:
                continue
            defer = store.sched.reads_first
            job = FlushJob(store, plan, self.read_path.keeps_read_back(defer), defer)
            if self.setup.flushes is not None and deferrable(self, job):
                self.setup.flushes.add(self, job)  # quantized with the other layers' at the end of the call
            else:
                jobs.append(job)
        if len(jobs) == 2 and together(*jobs):
            for rows, start, end in jobs[0].plan:
                quantize_together([(self, job) for job in jobs], rows, start, end)
            return
        for job in jobs:
            job.store.flush(job.plan, self.base, self.rope, job.keep, job.defer)

    def _evict(self) -> None:
        """Forget the positions older than the window's (sliding-window layers; see the class docstring)."""
        if self.window is None:
            return
        lo = self.n_stored - self.window
        if lo <= self.evicted:
            return
        self.evicted = lo
        for store in self.stores.values():
            store.evict(lo, copy=self.read_path.evict_copies)

    # --- bookkeeping ---------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Run the flushes the cache's layers queued and did not run yet (a call stopped before its last layer):
        before anything reads what the stores hold."""
        if self.setup.flushes is not None and self.setup.flushes.queued:
            self.setup.flushes.run()

    def get_seq_length(self) -> int:
        return self.n_stored

    def nbytes(self) -> dict:
        """Bytes held: ``codes`` (packed), ``scales`` (scales and zero points, outliers), ``residual``
        (full-precision tokens: sinks, residual windows, and tensors whose spec is ``none``), summed over the rows'
        real tokens (padding positions are not held)."""
        out = {"codes": 0, "scales": 0, "residual": 0}
        self.settle()
        if not self.is_initialized:
            return {**out, "total": 0}
        positions = self.positions()
        for store in self.stores.values():
            for part, n in store.nbytes(positions).items():
                out[part] += n
        out["total"] = out["codes"] + out["scales"] + out["residual"]
        return out

    # transformers' DynamicLayer would edit its own (empty) ``keys``/``values`` here and leave the stores as they
    # were: a beam search or an assisted decoding would then go on silently from the wrong history
    is_croppable = False

    def crop(self, tokens_to_remove: int) -> None:
        raise KvevalError("QuantizedKVCache cannot drop stored tokens (assisted or speculative decoding); "
                          "generate without an assistant model or prompt lookup")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KvevalError("QuantizedKVCache cannot reorder its rows (beam search); generate with num_beams=1")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.n_stored:
            raise KvevalError("QuantizedKVCache cannot repeat its rows (beam search, contrastive search); "
                              "generate with num_beams=1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.n_stored:
            raise KvevalError("QuantizedKVCache cannot select rows of a filled cache; build a new cache instead")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(key length, position of the first key) that the next call's attention mask covers: everything held
        plus the ``query_length`` new tokens, from position ``evicted``."""
        return self.n_stored - self.evicted + query_length, self.evicted

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def reset(self) -> None:
        """Empty the layer: nothing stored, as when it was built (its setup and the left padding it knows now
        kept)."""
        self.settle()  # nothing of this layer left waiting in the cache's batch
        self.keys = self.values = None
        self.is_initialized = False
        self._empty()
