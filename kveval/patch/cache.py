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

Two read paths (``read=``), the same numbers (tested bit for bit in float64):

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
positions, in one quantize call) form a ``StoredChunk``; consecutive chunks are merged in a binary-counter
pattern, so each token's codes are copied O(log n) times in all. Which rows quantize which positions at a call is
computed once per call and shared by all layers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.layers import model_quantizers
from kveval.patch.quantizers import TensorQuantizer
from kveval.patch.rope_capture import rope_for
from kveval.policy import KVPolicy
from kveval.policy.masks import Schedule
from kveval.quant import QuantizedTensor, dequantize, dequantize_into


@dataclass
class StoredChunk:
    """A run of quantized tokens: the codes as the spec's format packs them (``spec.fmt.pack``: uint8 rows along
    head_dim, e.g. two INT4 codes per byte, one FP8 byte per element) plus the QuantizedTensor's scales and zero
    points.

    ``decoded`` holds the values read back from that storage (dequantized once, when the tokens are stored: a decode
    step then costs O(new tokens), not O(context)); a kernel would dequantize on every read and get the same
    numbers. It is a compute cache, not counted in ``nbytes``; ``QuantizedKVLayer`` moves it into its read buffer
    and drops it from the chunk (None).
    """

    qt: QuantizedTensor  # scales, zero points, outliers and shape; its codes are empty (``packed`` holds them)
    packed: torch.Tensor  # uint8 [batch, kv_heads, tokens, spec.fmt.row_nbytes(spec, head_dim)]
    n_codes: int  # codes per row (head_dim)
    decoded: torch.Tensor | None = None

    @classmethod
    def store(cls, x: torch.Tensor, quantizer: TensorQuantizer, channel_block: int | None, rope=None,
              decode: bool = True) -> StoredChunk:
        """Quantize x ``[batch, kv_heads, n, head_dim]`` (``rope``: its ``(cos, sin)`` for pre-RoPE keys) and pack
        the codes through the spec's format, whatever the format. ``decoded`` is read back from the codes before
        packing (packing is lossless: ``read_storage`` gives the same numbers, which the tests check); with
        ``decode`` False it is left None (a caller that reads the tokens back from their codes later)."""
        qt = quantizer.quantize(x, channel_block, rope)
        spec = qt.spec
        packed = spec.fmt.pack(qt.codes, spec)
        chunk = cls(qt=replace(qt, codes=torch.empty(0, dtype=qt.codes.dtype)), packed=packed,
                    n_codes=qt.codes.shape[-1])
        if decode:
            chunk.decoded = quantizer.read_back(dequantize(qt), rope)
        return chunk

    @property
    def static(self) -> bool:
        """Whether the scales are static (per-tensor, per-head or calibrated): the same in every chunk, kept once."""
        return self.qt.static or self.qt.spec.gran.static_only

    def extend(self, other: StoredChunk) -> StoredChunk:
        """One chunk holding this chunk's tokens followed by ``other``'s (same rows).

        Codes, packed rows, scales, zero points and outliers all carry tokens (or token blocks) on dim 2;
        per-tensor, per-head and calibrated scales are static, the same in both chunks, and kept once."""
        a, b = self.qt, other.qt
        static = self.static

        def cat(x, y, keep_once=static):
            if x is None or keep_once:
                return x
            return torch.cat([x, y], dim=2)

        shape = torch.Size([*a.shape[:2], a.shape[2] + b.shape[2], a.shape[3]])
        qt = replace(a, scale=cat(a.scale, b.scale), zero_point=cat(a.zero_point, b.zero_point), shape=shape,
                     outlier_values=cat(a.outlier_values, b.outlier_values, False),
                     outlier_index=cat(a.outlier_index, b.outlier_index, False))
        decoded = None
        if self.decoded is not None and other.decoded is not None:
            decoded = torch.cat([self.decoded, other.decoded], dim=2)
        return StoredChunk(qt=qt, packed=torch.cat([self.packed, other.packed], dim=2), n_codes=self.n_codes,
                           decoded=decoded)

    def read_storage(self) -> torch.Tensor:
        """Unpack (``spec.fmt.unpack``) and dequantize everything stored: ``[batch, kv_heads, tokens,
        head_dim]``."""
        return dequantize(self._unpacked())

    def read_storage_into(self, out: torch.Tensor) -> None:
        """``out[...] = read_storage()`` without a temporary of the tokens' size (``out``: a slice of a read
        buffer, ``[batch, kv_heads, tokens, head_dim]``): the lean path's decode step, from the packed rows
        (``spec.fmt.read_packed_into``: one native pass for integer codes)."""
        spec = self.qt.spec
        if spec.is_none or not self.packed.numel():
            dequantize_into(self._unpacked(), out)
        else:
            spec.fmt.read_packed_into(self.qt, self.packed, self.n_codes, out)

    def _unpacked(self) -> QuantizedTensor:
        """The QuantizedTensor with its codes unpacked from ``packed`` (``spec.fmt.unpack``)."""
        spec = self.qt.spec
        return replace(self.qt, codes=spec.fmt.unpack(self.packed, spec, self.n_codes))

    def read(self) -> torch.Tensor | None:
        return self.decoded

    def drop_front(self, read_tokens: int, stored_tokens: int, blocks: int = 0, copy: bool = False) -> None:
        """Forget the oldest tokens (a sliding-window layer): ``read_tokens`` of what is read, ``stored_tokens`` of
        the packed rows and per-token side data, and ``blocks`` token blocks of per-channel scales (a block's
        scale and codes are kept while any of its tokens is in the window; static scales are kept). ``copy``:
        copy what is kept into tensors of its size (a slice alone keeps the forgotten bytes alive)."""
        if self.decoded is not None:
            self.decoded = self.decoded[:, :, read_tokens:]
        if stored_tokens == 0 and blocks == 0:
            return
        a = self.qt
        static = self.static

        def cut(x, n, keep_once=static):
            if x is None or keep_once:
                return x
            return x[:, :, n:].clone() if copy else x[:, :, n:]

        per_block = a.spec.gran.token_blocks
        drop_scales = blocks if per_block else stored_tokens
        shape = torch.Size([*a.shape[:2], a.shape[2] - stored_tokens, a.shape[3]])
        self.qt = replace(a, scale=cut(a.scale, drop_scales), zero_point=cut(a.zero_point, drop_scales),
                          shape=shape,
                          outlier_values=cut(a.outlier_values, stored_tokens, False),
                          outlier_index=cut(a.outlier_index, stored_tokens, False))
        self.packed = cut(self.packed, stored_tokens, False)

    def share_static(self, first: StoredChunk) -> None:
        """Hold ``first``'s static scales and zero points (equal to this chunk's: static) instead of a copy."""
        a, b = self.qt, first.qt
        if a.scale is not None and b.scale is not None and torch.equal(a.scale, b.scale):
            self.qt = replace(a, scale=b.scale)
        a = self.qt
        if a.zero_point is not None and b.zero_point is not None and torch.equal(a.zero_point, b.zero_point):
            self.qt = replace(a, zero_point=b.zero_point)

    def static_nbytes(self) -> int:
        """Bytes of the side data a layer keeps once whatever its tokens and rows: static scales and zero points
        and a calibrated codebook (counted in ``nbytes`` of every chunk that holds them)."""
        once = [self.qt.codebook]
        if self.static:
            once += [self.qt.scale, self.qt.zero_point]
        return sum(t.numel() * t.element_size() for t in once if t is not None)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: the packed code bytes as stored, plus scales and zero points in their storage dtype and the
        outliers (values + indices), counted with the scales as side data."""
        side = (self.qt.scale, self.qt.zero_point, self.qt.outlier_values, self.qt.outlier_index,
                self.qt.codebook)  # a calibrated codebook (nuq) is held once per layer and tensor
        scales = sum(t.numel() * t.element_size() for t in side if t is not None)
        codes = self.packed.numel() * self.packed.element_size()
        return {"codes": codes, "scales": scales, "total": codes + scales}


@dataclass
class _Piece:
    """Quantized tokens of the rows ``rows``: stored positions ``[start, end)`` of each of them (the same positions
    for all: rows that quantize different positions at a call get different pieces), as one ``StoredChunk`` of
    shape ``[len(rows), kv_heads, end - start, head_dim]``. ``token_block``: the statistics block of a dynamic
    per-channel spec (eviction then drops whole blocks), else None."""

    rows: tuple[int, ...]
    start: int
    end: int
    chunk: StoredChunk
    token_block: int | None = None


class _StoredRun:
    """What ``QuantizedKVLayer.chunks_k`` / ``chunks_v`` list: one piece of quantized storage with ``read()``,
    the values attention reads at its positions (``[rows, kv_heads, tokens, head_dim]``, from the layer's read
    buffer), and ``read_storage()``, a fresh unpack and dequantization of its packed codes, cut to the same
    tokens."""

    def __init__(self, layer: QuantizedKVLayer, kind: str, piece: _Piece):
        self.layer, self.kind, self.piece = layer, kind, piece

    def _first(self) -> int:
        return max(self.piece.start, self.layer.evicted, self.layer.base)

    def read(self) -> torch.Tensor:
        store = self.layer.stores[self.kind]
        p = self.piece
        if store.view is None:  # the lean path between calls: read back from the codes
            return self.layer.read_back(store, p)[:, :, self._first() - p.start:]
        store.apply_pending(self.layer.base)
        base = self.layer.base
        return store.view[self.layer.rows_index(p.rows), :, self._first() - base:p.end - base]

    def read_storage(self) -> torch.Tensor:
        return self.piece.chunk.read_storage()[:, :, self._first() - self.piece.start:]

    def nbytes(self) -> dict[str, int]:
        return self.piece.chunk.nbytes()


class _TensorStore:
    """One tensor kind (keys or values) of one layer: the read buffer, the quantized pieces, and the read-buffer
    writes that wait for the next call (modes that read before they quantize).

    ``view`` ``[batch, kv_heads, capacity, head_dim]``: what attention reads at each stored position (slot ``i``
    holds position ``layer.base + i``): the full-precision token as attention reads it
    (``TensorQuantizer.full_precision``) until the token is quantized, its read-back value after. ``raw`` (same
    shape) holds the model's own tensor when a transform keeps full-precision tokens in its domain (the
    quantizer needs x itself); otherwise ``view`` holds x until it is quantized and ``raw`` is None."""

    def __init__(self, kind: str, quantizer: TensorQuantizer, schedule: Schedule):
        self.kind, self.q, self.sched = kind, quantizer, schedule
        self.view: torch.Tensor | None = None
        self.raw: torch.Tensor | None = None
        self.pieces: list[_Piece] = []
        # (rows, start, end, read-back values): quantized this call, written into ``view`` at the next call
        self.pending: list[tuple[tuple[int, ...], int, int, torch.Tensor]] = []
        self.rows_index = None  # set by the layer: rows -> index for dim 0
        # the lean read path between calls (``view`` and ``raw`` are None then): ``tails`` ``(rows, start,
        # values)``: the positions ``[start, n)`` of those rows not quantized (``raw``'s tensor when a transform
        # keeps one, else ``view``'s); ``sinks`` ``(row, start, values)``: a row's sinks, as attention reads them
        self.tails: list[tuple[tuple[int, ...], int, torch.Tensor]] = []
        self.sinks: list[tuple[int, int, torch.Tensor]] = []
        self.shape: tuple[int, int, torch.dtype] | None = None  # (kv_heads, head_dim, dtype), set at the first call

    def source(self) -> torch.Tensor:
        assert self.view is not None
        return self.view if self.raw is None else self.raw

    def write_view(self, rows: tuple[int, ...], start: int, end: int, values: torch.Tensor, base: int) -> None:
        """Overwrite positions ``[start, end)`` of ``rows`` (those still in the buffer) with ``values``."""
        assert self.view is not None and self.rows_index is not None
        first = max(start, base)
        if end <= first:
            return
        self.view[self.rows_index(rows), :, first - base:end - base] = values[:, :, first - start:]

    def apply_pending(self, base: int) -> None:
        for rows, start, end, values in self.pending:
            self.write_view(rows, start, end, values, base)
        self.pending.clear()

    def push(self, piece: _Piece) -> None:
        """Append ``piece``; merge the last two pieces while the older is no longer than the newer (same rows,
        adjacent positions): each token's codes are then copied O(log n) times over a whole generation."""
        pieces = self.pieces
        if pieces and piece.chunk.static:  # one static scale per layer and tensor, as billed
            piece.chunk.share_static(pieces[0].chunk)
        pieces.append(piece)
        while len(pieces) >= 2:
            a, b = pieces[-2], pieces[-1]
            if (a.rows != b.rows or a.end != b.start or a.end - a.start > b.end - b.start
                    or a.chunk.qt.spec.fmt.whole_tensor):
                break
            pieces[-2:] = [_Piece(a.rows, a.start, b.end, a.chunk.extend(b.chunk), a.token_block)]

    def evict(self, lo: int, copy: bool = False) -> None:
        """Forget stored positions before ``lo``: pieces that end before it, and the front of the piece it cuts (by
        whole token blocks for per-channel statistics: a block is kept while any of its tokens is held; ``copy``:
        as ``StoredChunk.drop_front``)."""
        kept = []
        for p in self.pieces:
            if p.end <= lo:
                continue
            if p.start < lo:
                if p.token_block is None:
                    drop, blocks = lo - p.start, 0
                else:
                    blocks = (lo - p.start) // p.token_block
                    drop = blocks * p.token_block
                if drop:
                    p.chunk.drop_front(0, drop, blocks, copy)
                    p.start += drop
            kept.append(p)
        self.pieces = kept

    def nbytes(self) -> tuple[int, int]:
        """(codes, scales) of the pieces; static side data (static scales, a codebook) counted once."""
        codes = scales = 0
        for i, p in enumerate(self.pieces):
            b = p.chunk.nbytes()
            codes += b["codes"]
            scales += b["scales"] - (p.chunk.static_nbytes() if i else 0)
        return codes, scales


#: the cache's read paths (the module docstring): ``lean`` holds what its bill says, ``buffered`` is faster
READ_PATHS = ("lean", "buffered")


def _grown_capacity(capacity: int, need: int, reserve: int | None) -> int:
    """Positions a buffer holding ``capacity`` allocates for ``need``: ``reserve`` (or twice the need) at the first
    call, then doubling (amortised O(1) copies per position)."""
    if not capacity:
        return max(need, reserve or 2 * need, 16)
    return capacity if need <= capacity else max(need, 2 * capacity)


def _moved(buf: torch.Tensor | None, like: torch.Tensor, dim: int, start: int, stop: int,
           capacity: int) -> torch.Tensor:
    """A new buffer shaped as ``like`` with ``capacity`` along ``dim``, holding ``buf``'s slots ``[start, stop)``
    at its front."""
    shape = list(like.shape)
    shape[dim] = capacity
    new = like.new_empty(shape)
    if buf is not None and stop > start:
        new.narrow(dim, 0, stop - start).copy_(buf.narrow(dim, start, stop - start))
    return new


def _quantized_end(sched: Schedule, n: int, prompt: int) -> int:
    """Tokens ``[sink_tokens, end)`` of a row holding ``n`` real tokens are quantized (``Schedule.quantized_end``,
    at most ``n``); ``prompt``: the row's real tokens in the first call."""
    return min(sched.quantized_end(n, prompt), n) if n > 0 else 0


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized cache. Tensors are ``[batch, kv_heads, seq, head_dim]``.

    Keys and values each have their schedule (``KVPolicy.schedule``: KIVI quantizes keys in blocks and values in a
    sliding window), read buffer and quantized storage (``_TensorStore``); the sink tokens are shared. Positions
    are stored positions (row ``b``'s real token ``i`` is at ``pads[b] + i``); ``prompt`` is the number of
    positions the first call stored (row ``b``'s prompt: ``prompt - pads[b]`` real tokens).

    A sliding-window layer (``window``: the model config's ``sliding_window``) forgets, at the end of each call,
    every position older than the ``window`` newest (``evicted`` of them so far), as
    ``kveval.memory.token_split`` bills it: sinks, quantized storage and residual are cut at ``n - window``; a
    per-channel token block keeps its codes and scales until all of its tokens have left. What attention reads is
    exactly positions ``[evicted, n)``, which the model's sliding mask limits further. The read buffer keeps the
    positions from ``base`` on; it is compacted (positions before ``evicted`` dropped) when it runs out of room.
    """

    def __init__(self, key_q: TensorQuantizer, value_q: TensorQuantizer, policy: KVPolicy, is_sliding: bool = False,
                 module: torch.nn.Module | None = None, implementation: str | None = None,
                 window: int | None = None, *, left_padding: Sequence[int] | None = None,
                 reserve: int | None = None, plans: dict | None = None, read: str = "lean"):
        super().__init__()
        if read not in READ_PATHS:
            raise KvevalError(f"read must be one of {', '.join(READ_PATHS)}; got {read!r}")
        self.read = read
        self.key_q, self.value_q, self.policy = key_q, value_q, policy
        self.key_spec, self.value_spec = key_q.spec, value_q.spec
        self.sched_k, self.sched_v = policy.schedule("key"), policy.schedule("value")
        self.is_sliding = is_sliding
        self.window = window if is_sliding else None
        self.left_padding = None if left_padding is None else [int(p) for p in left_padding]
        self.reserve = reserve  # positions to allocate at the first call (e.g. prompt + new tokens)
        self.plans = {} if plans is None else plans  # flush plans, shared by the layers of one cache
        self.evicted = 0  # positions [0, evicted) are forgotten (sliding-window layers only)
        self.module = module  # the attention module, whose rotary embedding transforms such as pre_rope need
        # the stock attention implementation this layer's ``attend`` wraps; None: no query/output hooks to apply
        self.implementation = implementation
        self.needs_rope = key_q.needs_rope or value_q.needs_rope
        self.n_stored = 0
        self.prompt: int | None = None  # positions stored by the first call
        self.pads: list[int] = []
        self.base = 0  # stored position of slot 0 of the buffers
        self.capacity = 0
        self.stores = {"key": _TensorStore("key", key_q, self.sched_k),
                       "value": _TensorStore("value", value_q, self.sched_v)}
        for store in self.stores.values():
            store.rows_index = self.rows_index
        # (cos, sin) [batch, rope_capacity, head_dim] of the stored positions from ``rope_base`` on (only when a
        # transform needs_rope: pre-RoPE keys are read back through them)
        self.rope_buf: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rope_base = self.rope_capacity = 0

    # --- buffers ---------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B = key_states.shape[0]
        pads = self.left_padding if self.left_padding is not None else [0] * B
        if len(pads) != B:
            why = ("; beam search and num_return_sequences repeat the rows, which QuantizedKVCache does not model: "
                   "generate with num_beams=1, one sequence per prompt" if B > len(pads) and B % len(pads) == 0 else "")
            raise KvevalError(f"left_padding has {len(pads)} rows; the batch has {B}{why}")
        self.pads = pads
        self._all_rows = tuple(range(B))
        # transformers reads dtype/device; fresh empty tensors (a view of key_states would keep its storage alive)
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        for store, x in ((self.stores["key"], key_states), (self.stores["value"], value_states)):
            store.shape = (x.shape[1], x.shape[3], x.dtype)
        self.is_initialized = True

    def rows_index(self, rows: tuple[int, ...]):
        """Index of ``rows`` along dim 0: a slice for the whole batch (a view), else a LongTensor."""
        if rows == self._all_rows:
            return slice(None)
        return torch.tensor(rows, device=self.device)

    def _ensure_room(self, n_after: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make the read buffers hold positions up to ``n_after`` (the buffered path): allocate them at the first
        call (``reserve`` or twice the prompt), else drop the evicted front and/or double the capacity (amortised
        O(1) per position)."""
        if n_after - self.base <= self.capacity:
            return
        live = self.evicted  # positions before ``evicted`` are never read nor quantized again
        capacity = _grown_capacity(self.capacity, n_after - live, self.reserve)
        for store, x in ((self.stores["key"], key_states), (self.stores["value"], value_states)):
            store.apply_pending(self.base)
            store.view = _moved(store.view, x, 2, live - self.base, self.n_stored - self.base, capacity)
            if store.q.reads_transformed and not store.q.is_none:
                store.raw = _moved(store.raw, x, 2, live - self.base, self.n_stored - self.base, capacity)
        self.base, self.capacity = live, capacity

    def _grow_rope(self, n_after: int, rope) -> None:
        """Make ``rope_buf`` hold the positions up to ``n_after``: as ``_ensure_room`` the read buffers (buffered),
        or exactly those positions (lean: the table is then 2 x head_dim values per held position)."""
        if n_after - self.rope_base <= self.rope_capacity:
            return
        live, old = self._rope_live(), self.rope_buf
        if self.read == "lean":
            capacity = n_after - live
        else:
            capacity = _grown_capacity(self.rope_capacity, n_after - live, self.reserve)
        start, stop = live - self.rope_base, self.n_stored - self.rope_base
        self.rope_buf = tuple(  # type: ignore[assignment]
            _moved(None if old is None else old[i], rope[i].expand(len(self.pads), -1, -1), 1, start, stop,
                   capacity) for i in (0, 1))
        self.rope_base, self.rope_capacity = live, capacity

    def _rope_live(self) -> int:
        """The first position whose (cos, sin) may be read again: the window's first, or the first of a token
        block still stored (per-channel statistics keep a block while any of its tokens is in the window)."""
        firsts = [p.start for store in self.stores.values() for p in store.pieces if store.q.needs_rope]
        return min([self.evicted, *firsts])

    def rope_at(self, index, start: int, end: int):
        """(cos, sin) of stored positions ``[start, end)`` of the rows ``index``, or None without pre-RoPE."""
        if self.rope_buf is None:
            return None
        b = self.rope_base
        return self.rope_buf[0][index, start - b:end - b], self.rope_buf[1][index, start - b:end - b]

    # --- the lean read path ----------------------------------------------------------------------------------
    def read_back(self, store: _TensorStore, piece: _Piece) -> torch.Tensor:
        """What attention reads at ``piece``'s positions, from its packed codes (``[rows, kv_heads, tokens,
        head_dim]``): unpacked, dequantized and read back through the transforms, as ``StoredChunk.store``
        computed it."""
        rope = self.rope_at(self.rows_index(piece.rows), piece.start, piece.end) if store.q.needs_rope else None
        return store.q.read_back(piece.chunk.read_storage(), rope)

    def _assembled(self, store: _TensorStore, n_after: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lean path: ``store``'s read buffer (and ``raw``) for positions ``[evicted, n_after)``, built from what
        it holds: the full-precision tokens as they are, the quantized ones read back from their codes, padding
        positions zero (masked, they weigh exactly 0); positions ``[n, n_after)`` are left for the call to write."""
        assert store.shape is not None
        base = self.evicted
        heads, dim, dtype = store.shape
        # every position of a row is written below or by the call (sinks, pieces, tails, new tokens) but padding
        shape = (len(self.pads), heads, n_after - base, dim)
        view = (torch.zeros if any(self.pads) else torch.empty)(shape, dtype=dtype, device=self.device)
        # raw is read only at positions still in full precision, which the tails and the call write
        raw = torch.empty_like(view) if store.q.reads_transformed and not store.q.is_none else None
        for rows, start, values in store.tails:
            index, lo, hi = self.rows_index(rows), start - base, self.n_stored - base
            if raw is not None:
                raw[index, :, lo:hi] = values
                values = store.q.full_precision(values, self.rope_at(index, start, self.n_stored))
            view[index, :, lo:hi] = values
        for row, start, values in store.sinks:
            view[row:row + 1, :, start - base:start - base + values.shape[2]] = values
        for p in store.pieces:
            first = max(p.start, base)
            if p.end <= first:
                continue
            index = self.rows_index(p.rows)
            if isinstance(index, slice) and first == p.start and store.q.reads_back_stored:
                p.chunk.read_storage_into(view[:, :, first - base:p.end - base])  # no transform: in place
            else:
                view[index, :, first - base:p.end - base] = self.read_back(store, p)[:, :, first - p.start:]
        return view, raw

    def _materialize(self, n_after: int) -> None:
        """The lean path at the start of a call: transient read buffers for positions ``[evicted, n_after)``
        (``_assembled``), which the call fills and ``_release`` drops."""
        for store in self.stores.values():
            store.pending.clear()  # the codes hold them: read back
            store.view, store.raw = self._assembled(store, n_after)
        self.base, self.capacity = self.evicted, n_after - self.evicted

    def held(self, kind: str) -> torch.Tensor:
        """Everything held of ``kind`` (``"key"``/``"value"``) as attention reads it: positions ``[evicted, n)``,
        ``[batch, kv_heads, n - evicted, head_dim]`` (a view of the read buffer, or, lean, assembled from the codes
        and the full-precision tokens)."""
        store = self.stores[kind]
        if store.view is None:
            return self._assembled(store, self.n_stored)[0]
        store.apply_pending(self.base)
        return store.view[:, :, self.evicted - self.base:self.n_stored - self.base]

    def _release(self) -> None:
        """The lean path at the end of a call: keep, per tensor and row, only what is not quantized (its sinks and
        its positions from where its quantized tokens end; no padding), exactly sized; drop the read buffers."""
        base, lo = self.base, self.evicted
        for store in self.stores.values():
            assert store.view is not None
            S = store.sched.sink_tokens
            starts: dict[int, list[int]] = {}
            sinks = []
            for b, pad in enumerate(self.pads):
                n = self.n_stored - pad
                q_end = 0 if store.q.is_none else _quantized_end(store.sched, n, (self.prompt or 1) - pad)
                if q_end <= S:  # nothing of this row is quantized: all of it is held as is
                    starts.setdefault(max(pad, lo), []).append(b)
                    continue
                starts.setdefault(max(pad + q_end, lo), []).append(b)
                if pad + S > max(pad, lo):
                    sinks.append((b, max(pad, lo), pad + S))
            src = store.raw if store.raw is not None else store.view
            store.tails = [(tuple(rows), start, src[self.rows_index(tuple(rows)), :, start - base:self.n_stored - base]
                            .clone()) for start, rows in starts.items() if start < self.n_stored]
            store.sinks = [(b, first, store.view[b:b + 1, :, first - base:end - base].clone())
                           for b, first, end in sinks]
            store.view = store.raw = None
            store.pending.clear()
        self.capacity = 0
        live = self._rope_live()
        if self.rope_buf is not None and self.rope_base < live:  # the window moved on: keep what is read again
            cut = live - self.rope_base
            self.rope_buf = (self.rope_buf[0][:, cut:].clone(), self.rope_buf[1][:, cut:].clone())
            self.rope_base, self.rope_capacity = live, self.rope_capacity - cut

    # --- reads -------------------------------------------------------------------------------------------------
    @property
    def chunks_k(self) -> list[_StoredRun]:
        """The quantized key storage, piece by piece (``read()`` / ``read_storage()`` / ``nbytes()``)."""
        return [_StoredRun(self, "key", p) for p in self.stores["key"].pieces]

    @property
    def chunks_v(self) -> list[_StoredRun]:
        return [_StoredRun(self, "value", p) for p in self.stores["value"].pieces]

    def quantized_end(self, kind: str, row: int = 0) -> int:
        """Stored position where row ``row``'s quantized ``kind`` tokens end (``sink_tokens`` before any)."""
        sched = self.stores[kind].sched
        if not self.pads:
            return sched.sink_tokens
        pad = self.pads[row]
        n = max(self.n_stored - pad, 0)
        return pad + max(_quantized_end(sched, n, (self.prompt or 1) - pad), sched.sink_tokens)

    @property
    def q_end_k(self) -> int:
        return self.quantized_end("key")

    @property
    def q_end_v(self) -> int:
        return self.quantized_end("value")

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
            self._grow_rope(n1, new_rope)
            assert self.rope_buf is not None
            rb = self.rope_base
            self.rope_buf[0][:, n0 - rb:n1 - rb] = new_rope[0]
            self.rope_buf[1][:, n0 - rb:n1 - rb] = new_rope[1]
        if self.read == "lean":
            self._materialize(n1)
        else:
            self._ensure_room(n1, key_states, value_states)
        base, ev = self.base, self.evicted

        # store the new positions in full precision (as attention reads them; x itself in ``raw`` if that differs)
        fresh = {}
        for store, x in ((self.stores["key"], key_states), (self.stores["value"], value_states)):
            store.apply_pending(base)
            assert store.view is not None
            fresh[store.kind] = store.q.full_precision(x, new_rope)
            store.view[:, :, n0 - base:n1 - base] = fresh[store.kind]
            if store.raw is not None:
                store.raw[:, :, n0 - base:n1 - base] = x
        self.n_stored = n1
        out: list[torch.Tensor] = []
        for store in (self.stores["key"], self.stores["value"]):
            assert store.view is not None
            if prefill_fp:  # the new tokens in full precision, after what the cache held before this call
                read = fresh[store.kind] if n0 == 0 else torch.cat(
                    [store.view[:, :, ev - base:n0 - base], fresh[store.kind]], dim=-2)
            else:
                read = store.view[:, :, ev - base:n1 - base]
            # the schedule of kveval.policy.masks (Schedule.read_quantized_end), per tensor: sliding mode stores
            # then reads; the other modes read, then quantize what this call completed (its queries saw it in full
            # precision): their read-back values reach the read buffer at the next call
            self._flush(store, n0, n1, defer=store.sched.reads_first)
            if prefill_fp:
                read = self._single_token_rows(store, read, n0, n1)
            out.append(read)
        self._evict()
        if self.read == "lean":
            self._release()  # ``out`` keeps the transient buffers alive until attention has read them
        return out[0], out[1]

    def _single_token_rows(self, store: _TensorStore, read: torch.Tensor, n0: int, n1: int) -> torch.Tensor:
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

    def _flush_plan(self, sched: Schedule, n0: int, n1: int) -> tuple[tuple[tuple[int, ...], int, int], ...]:
        """Which stored positions each row quantizes in a call from ``n0`` to ``n1`` positions: ``(rows, start,
        end)`` groups (rows quantizing the same positions together). Per row, in its real tokens: from where its
        quantized tokens ended (or, later, from where the window evicted) to ``Schedule.quantized_end``. Shared
        by the layers of one cache (the same for every layer with this schedule and eviction state)."""
        key = (sched, n0, n1, self.evicted, self.prompt, tuple(self.pads))
        plan = self.plans.get(key)
        if plan is None:
            groups: dict[tuple[int, int], list[int]] = {}
            S = sched.sink_tokens
            for b, pad in enumerate(self.pads):
                prompt = (self.prompt or 1) - pad
                lo = max(self.evicted - pad, 0)
                start = max(_quantized_end(sched, max(n0 - pad, 0), prompt), S, lo)
                end = _quantized_end(sched, n1 - pad, prompt)
                if end > start:
                    groups.setdefault((pad + start, pad + end), []).append(b)
            plan = tuple((tuple(rows), a, e) for (a, e), rows in groups.items())
            if len(self.plans) > 256:
                self.plans.clear()
            self.plans[key] = plan
        return plan

    def _token_block(self, q: TensorQuantizer, block: int | None, tokens: int) -> int | None:
        """The token block of a dynamic per-channel spec's statistics (None for every other spec)."""
        if q.is_none or not q.spec.gran.token_blocks or q.spec.granularity != "channel" or block is None:
            return None
        if self.policy.uses_static(q.spec):
            return None
        return q.spec.gran.block(tokens, block)

    def _flush(self, store: _TensorStore, n0: int, n1: int, defer: bool) -> None:
        """Quantize the positions that left ``store``'s residual in this call (``_flush_plan``): one quantize call
        per group of rows (per row for whole-tensor formats, whose statistics span the batch); the read-back
        values go into the read buffer now, or at the next call (``defer``)."""
        q = store.q
        if q.is_none:  # a tensor kept in full precision: the read buffer already holds it
            return
        sched, base = store.sched, self.base
        block = sched.residual if sched.blocks else None
        channel_block = block if q.spec.granularity == "channel" else None
        # lean and deferred: the next call assembles its read buffer from the codes, so no read-back value is kept
        lean_later = defer and self.read == "lean"
        for rows, start, end in self._flush_plan(sched, n0, n1):
            parts = [(r,) for r in rows] if q.spec.fmt.whole_tensor and len(rows) > 1 else [rows]
            for part in parts:
                index = self.rows_index(part)
                x = store.source()[index, :, start - base:end - base]
                rope = self.rope_at(index, start, end) if q.needs_rope else None
                chunk = StoredChunk.store(x, q, channel_block, rope, decode=not lean_later)
                decoded, chunk.decoded = chunk.decoded, None
                store.push(_Piece(part, start, end, chunk, self._token_block(q, block, end - start)))
                if lean_later:
                    continue
                assert decoded is not None
                if defer:
                    store.pending.append((part, start, end, decoded))
                else:
                    store.write_view(part, start, end, decoded, base)

    def _evict(self) -> None:
        """Forget the positions older than the window's (sliding-window layers; see the class docstring)."""
        if self.window is None:
            return
        lo = self.n_stored - self.window
        if lo <= self.evicted:
            return
        self.evicted = lo
        for store in self.stores.values():
            store.evict(lo, copy=self.read == "lean")

    # --- bookkeeping -----------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.n_stored

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
        self.__init__(self.key_q, self.value_q, self.policy, self.is_sliding, self.module, self.implementation,
                      self.window, left_padding=self.left_padding, reserve=self.reserve, plans=self.plans,
                      read=self.read)

    def _full_precision_tokens(self, store: _TensorStore) -> int:
        """Real tokens of ``store``'s kind held in full precision, summed over the rows: sinks and residual window
        not yet evicted (every held token when the spec is ``none``)."""
        total, S = 0, store.sched.sink_tokens
        for pad in self.pads:
            n = self.n_stored - pad
            lo = max(self.evicted - pad, 0)
            if store.q.is_none:
                total += max(n - lo, 0)
                continue
            q_end = _quantized_end(store.sched, n, (self.prompt or 1) - pad)
            total += max(min(S, n) - lo, 0) + max(n - max(q_end, lo), 0)
        return total

    def nbytes(self) -> dict:
        """Bytes held: ``codes`` (packed), ``scales`` (scales and zero points, outliers), ``residual``
        (full-precision tokens: sinks, residual windows, and tensors whose spec is ``none``), summed over the rows'
        real tokens (padding positions are not held)."""
        out = {"codes": 0, "scales": 0, "residual": 0}
        if not self.is_initialized:
            return {**out, "total": 0}
        for store in self.stores.values():
            assert store.shape is not None
            H, D, dtype = store.shape
            out["residual"] += self._full_precision_tokens(store) * H * D * dtype.itemsize
            codes, scales = store.nbytes()
            out["codes"] += codes
            out["scales"] += scales
        out["total"] = out["codes"] + out["scales"] + out["residual"]
        return out


class QuantizedHybridLayer(LinearAttentionLayer, QuantizedKVLayer):
    """A layer that holds both a quantized K/V cache and a full-precision linear-attention / Mamba state (Falcon-H1's
    parallel attention + Mamba layers): transformers' ``LinearAttentionAndFullAttentionLayer`` with
    ``QuantizedKVLayer`` as its attention part. The conv and recurrent states are kept exactly as transformers keeps
    them (``LinearAttentionLayer``: the live tensors, updated in place by the model)."""

    is_compileable = False

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        QuantizedKVLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self._args, self._kwargs = args, kwargs

    def lazy_initialization(self, *args, **kwargs) -> None:  # type: ignore[override]
        # the attention part calls it with (keys, values); the state part with keyword arguments only
        if len(args) == 2 and not kwargs:
            QuantizedKVLayer.lazy_initialization(self, *args)
        elif not args:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    # the attention part answers for the tokens held (transformers >= 5.25 gives LinearAttentionLayer its own
    # counter, a tensor) and refuses what it cannot do to its stores
    get_max_length = QuantizedKVLayer.get_max_length
    get_seq_length = QuantizedKVLayer.get_seq_length
    is_croppable = False
    crop = QuantizedKVLayer.crop
    reorder_cache = QuantizedKVLayer.reorder_cache
    batch_repeat_interleave = QuantizedKVLayer.batch_repeat_interleave
    batch_select_indices = QuantizedKVLayer.batch_select_indices

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        QuantizedKVLayer.__init__(self, *self._args, **self._kwargs)


def state_nbytes(layer) -> int:
    """Bytes of a linear-attention / Mamba layer's conv and recurrent states as held (0 for other layers)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return 0
    held = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in held if t is not None)


#: transformers' cache layers kveval replaces (attention) or keeps as they are (states, nothing); any other layer
#: class (an indexer cache, compressed attention, ...) is a design kveval does not model
_ATTENTION_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer,
                     LinearAttentionAndSlidingWindowAttentionLayer)
_KEPT_LAYERS = (LinearAttentionLayer, DummyLayer)


def cache_kwargs(model, cache: Cache) -> dict:
    """The keyword that hands a cache to ``model.forward``: ``cache`` in newer transformers 5.x releases,
    ``past_key_values`` before (``generate()`` takes ``past_key_values``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def left_padding_of(attention_mask: torch.Tensor) -> list[int]:
    """Per row, the padding positions before its first token: ``attention_mask`` ``[batch, n]`` (1 = token,
    0 = padding) must be 0...0 1...1 in every row (KvevalError otherwise: right padding or holes would be stored
    as tokens). Worked: ``[[0, 0, 1, 1], [1, 1, 1, 1]]`` -> ``[2, 0]``."""
    mask = attention_mask.to(torch.bool)
    if mask.dim() != 2:
        raise KvevalError(f"expected a 2-D attention mask [batch, positions]; got shape {tuple(mask.shape)}")
    pads = (~mask).long().cumprod(dim=1).sum(dim=1)
    n = mask.shape[1]
    left = torch.arange(n, device=mask.device)[None, :] >= pads[:, None]
    if not torch.equal(left, mask):
        raise KvevalError("QuantizedKVCache: the attention mask is not left padding (0...0 1...1 in every row); "
                          "pad batches on the left for generation")
    return [int(p) for p in pads.tolist()]


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` whose layers store K/V quantized under ``policy``.

    One layer per model layer, built from transformers' own (``DynamicCache(config=...)``): its attention layers
    become ``QuantizedKVLayer`` (full-attention layers keep every token; sliding-window and chunked-attention
    layers keep the newest ``window`` tokens), a layer holding both K/V and a state (Falcon-H1) a
    ``QuantizedHybridLayer``; linear-attention / Mamba layers keep transformers' ``LinearAttentionLayer`` (their
    state in full precision) and MLP-only layers its ``DummyLayer``. So ``nbytes()`` equals the memory bill
    (``kveval.memory.kv_bytes`` of ``Arch.from_model``) after every call, for a batch the sum of its rows' bills,
    and ``nbytes()["state"]`` the bill's ``state``. An MLA model's layers hold what its attention hands the cache,
    the latent ``c_kv`` (key spec) and ``k_pe`` (value spec).

    ``left_padding``: per row, the padding positions before its first token (the module docstring, "Batches and
    left padding"); None: read from the ``attention_mask`` of the first forward call of ``model`` that receives
    this cache (``model.generate`` passes it), every row starting at position 0 when there is none.
    ``max_length``: positions the buffered read path allocates at the first call (prompt + new tokens; its buffers
    grow by doubling otherwise). ``read``: ``"lean"`` (holds what ``nbytes()`` bills, dequantizes a layer's history
    at each call) or ``"buffered"`` (also keeps every token's read-back value: faster, more memory than a
    DynamicCache); the same numbers (the module docstring).

    K/V transforms (``policy.transform_sequence()``) act through the layers' ``TensorQuantizer``s, as in
    ``emulate``. When a transform hooks the query or the attention output (e.g. a rotation that keeps the cache
    rotated, as llama.cpp does), the cache wraps the model's attention function during exactly the forward calls
    of ``model`` that receive this cache (``kveval.patch.attention.patched_while_passed``: forward hooks on
    ``model``, removed when the cache is garbage-collected); the model is restored after each call. Without such
    hooks nothing is wrapped and the model runs its own attention function.
    """

    def __init__(self, model, policy: KVPolicy, *, left_padding: Sequence[int] | torch.Tensor | None = None,
                 max_length: int | None = None, read: str = "lean"):
        if read not in READ_PATHS:
            raise KvevalError(f"read must be one of {', '.join(READ_PATHS)}; got {read!r}")
        mq = model_quantizers(model, policy, real_cache=True)
        arch = mq.arch
        hooked = any(q.hooks_attention for pair in mq.quantizers.values() for q in pair)
        base = attn.base_implementation(model) if hooked else None
        if isinstance(left_padding, torch.Tensor):
            left_padding = [int(p) for p in left_padding.tolist()]
        if left_padding is not None and any(p < 0 for p in left_padding):
            raise KvevalError(f"left_padding must be >= 0 per row; got {list(left_padding)}")
        stock = DynamicCache(config=model.config).layers  # transformers' own layer per model layer
        if len(stock) != arch.layers:
            raise KvevalError(f"transformers builds {len(stock)} cache layers for this model's {arch.layers} layers; "
                              "kveval does not model this design")
        plans: dict = {}
        layers: list = []
        for i, layer in enumerate(stock):
            if type(layer) in _KEPT_LAYERS and i not in mq.modules:
                layers.append(layer)  # a linear-attention / Mamba state (full precision) or nothing
                continue
            window = arch.window(i)
            if type(layer) not in _ATTENTION_LAYERS or i not in mq.modules \
                    or getattr(layer, "is_sliding", False) != (window is not None):
                raise KvevalError(f"layer {i}: transformers caches it as {type(layer).__name__}, which kveval does "
                                  "not model for this layer; it cannot say what a quantized cache would hold")
            k_q, v_q = mq.quantizers[i]
            kwargs = dict(is_sliding=window is not None, module=mq.modules[i],
                          implementation=base if k_q.hooks_attention or v_q.hooks_attention else None,
                          window=window, left_padding=left_padding, reserve=max_length, plans=plans, read=read)
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layers.append(QuantizedHybridLayer(k_q, v_q, policy, number_of_states=layer.number_of_states,
                                                   **kwargs))
            else:
                layers.append(QuantizedKVLayer(k_q, v_q, policy, **kwargs))
        super().__init__(layers=layers)
        self.policy, self.read = policy, read
        self.left_padding = None if left_padding is None else list(left_padding)
        attending = {mq.modules[i]: la for i, la in enumerate(layers)
                     if isinstance(la, QuantizedKVLayer) and la.implementation}
        if hooked:
            attn.patched_while_passed(model, attending, self)
        if left_padding is None:
            self._watch_first_mask(model)

    def _watch_first_mask(self, model) -> None:
        """Read the left padding from the ``attention_mask`` of the first forward call of ``model`` that receives
        this cache (a forward pre-hook, removed after that call or when the cache is garbage-collected)."""
        ref = weakref.ref(self)

        def before(_module, args, kwargs):
            cache = ref()
            if cache is None or not (any(a is cache for a in args) or any(v is cache for v in kwargs.values())):
                return
            handle.remove()
            mask = kwargs.get("attention_mask")
            if cache.get_seq_length() > 0 or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                return
            pads = left_padding_of(mask)
            if any(pads):
                cache.left_padding = pads
                for layer in cache.layers:
                    if isinstance(layer, QuantizedKVLayer):
                        layer.left_padding = pads

        handle = model.register_forward_pre_hook(before, with_kwargs=True)
        weakref.finalize(self, handle.remove)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by layer ``layer_idx``, an int (transformers >= 5.25 answers a linear-attention layer's count
        as a 0-d tensor)."""
        return int(super().get_seq_length(layer_idx))

    def rope_table_nbytes(self) -> int:
        """Bytes of the (cos, sin) tables that layers with pre-RoPE keys hold besides ``nbytes()`` (the module
        docstring: an engine recomputes them from the positions)."""
        return sum(2 * la.rope_buf[0].numel() * la.rope_buf[0].element_size() for la in self.layers
                   if isinstance(la, QuantizedKVLayer) and la.rope_buf is not None)

    def nbytes(self) -> dict:
        """Bytes held by all layers: ``codes``, ``scales``, ``residual`` and ``total`` of the K/V, and, for a model
        with linear-attention / Mamba layers, ``state``: their conv and recurrent states (full precision, not in
        ``total``)."""
        total = {"codes": 0, "scales": 0, "residual": 0, "total": 0}
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                for k, v in layer.nbytes().items():
                    total[k] += v
        if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.layers):
            total["state"] = sum(state_nbytes(layer) for layer in self.layers)
        return total


#: transformers' token counters of a cache layer (a 0-d integer tensor in LinearAttentionLayer since 5.25):
#: bookkeeping, neither K/V nor state, so ``resident_nbytes`` leaves them out as the bill does
_TOKEN_COUNTERS = frozenset({"cumulative_length", "cumulative_length_linear"})


def resident_nbytes(cache, exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the tensors ``cache`` holds between calls, each storage counted once (a view counts its whole
    storage: what keeping it keeps alive). Walks the cache's layers and their stores (or any tuple, list or dict of
    them); the model's modules and the quantizers (the policy's, not the cache's) are not counted, nor the
    storages of ``exclude`` (e.g. the model's own key/value tensors a call received), nor transformers' token
    counters (``_TOKEN_COUNTERS``)."""
    seen: dict[tuple, int] = {}
    visited: set[int] = set()

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[(st.data_ptr(), obj.device.type)] = st.nbytes()
            return
        if id(obj) in visited or isinstance(obj, torch.nn.Module | TensorQuantizer | KVPolicy | str | int | float):
            return
        visited.add(id(obj))
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("kveval.", "transformers.")):
            for name, v in vars(obj).items():
                if name not in _TOKEN_COUNTERS:
                    walk(v)

    walk(cache)
    for t in exclude:
        seen.pop((t.untyped_storage().data_ptr(), t.device.type), None)
    return sum(seen.values())


def watch_peak(cache) -> list[int]:
    """Wrap every layer's ``update`` of ``cache`` to record, at each call, what the cache holds plus what the call
    returned to attention (``resident_nbytes``; the call's inputs are the model's tensors, not the cache's: a fused
    QKV output holds Q too). Returns a one-element list holding the largest so far (bytes)."""
    peak = [0]
    for layer in cache.layers:
        if not hasattr(layer, "update"):
            continue

        def watched(*a, _update=layer.update, **kw):
            out = _update(*a, **kw)
            peak[0] = max(peak[0], resident_nbytes((cache, out), exclude=a[:2]))
            return out

        layer.update = watched
    return peak


@torch.no_grad()
def decode_logits(model, input_ids: torch.Tensor, policy: KVPolicy, prefill_len: int = 1) -> torch.Tensor:
    """Logits of token-by-token decoding through a real ``QuantizedKVCache``: ``prefill_len`` tokens in one call,
    then one token per step. input_ids ``[batch, T]`` -> logits ``[batch, T, vocab]``.

    The second computation path of the emulation contract: ``emulate(model, policy, prefill_len=P)`` gives the
    same logits up to float rounding (with ``prefill_len`` 0 or 1 both mean "every token decoded").
    """
    cache = QuantizedKVCache(model, policy, max_length=input_ids.shape[1])
    kw = cache_kwargs(model, cache)
    first = max(prefill_len, 1)
    out = [model(input_ids[:, :first], use_cache=True, **kw).logits]
    for t in range(first, input_ids.shape[1]):
        out.append(model(input_ids[:, t : t + 1], use_cache=True, **kw).logits)
    return torch.cat(out, dim=1)
