"""A real quantized KV cache for ``model.generate()`` and step-by-step decoding.

Each layer holds, in position order: the sink tokens in full precision, the quantized middle as packed integer
codes (or FP8 bytes) with scales/zero points in their storage dtype, and the full-precision residual window.
Reads dequantize everything that is stored. ``nbytes()`` reports the bytes actually held.

Usage::

    cache = QuantizedKVCache(model, KVPolicy.preset("int4_g64"))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20)

Semantics (the same as ``emulate``; ``kveval.policy.masks``, per tensor: keys and values may follow different
schedules): a token is quantized when it leaves the residual window (``sliding``: stored, then read;
``sliding_lag``: read, then moved), after the call that completes its block of ``residual`` tokens (``block``:
read, then flushed), or, for transformers' schedule (``prompt_block``), at the end of the first call for the
prompt and then in blocks counted from the prompt end; sinks never are. A call that brings more than one token (the prefill) answers,
with ``prefill: fp``, the new tokens in full precision (what serving engines do); with ``prefill: quantized`` and
for single-token decode steps it answers what it holds under that schedule.

Limitation: with batch > 1 and left padding, sink tokens count from the first stored position of the row
(padding included), and per-channel blocks take statistics over the padded positions too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kveval.memory.bill import check_sliding_window, sliding_window_layers
from kveval.patch import attention as attn
from kveval.patch.attention import attention_modules
from kveval.patch.quantizers import TensorQuantizer, layer_quantizers, model_type_of, policy_scales
from kveval.patch.rope_capture import rope_for, track_rope
from kveval.policy import KVPolicy
from kveval.quant import QuantizedTensor, dequantize


@dataclass
class StoredChunk:
    """A run of quantized tokens: the codes as the spec's format packs them (``spec.fmt.pack``: uint8 rows along
    head_dim, e.g. two INT4 codes per byte, one FP8 byte per element) plus the QuantizedTensor's scales and zero
    points.

    ``decoded`` holds the values read back from that storage (unpacked and dequantized once, when the tokens are
    stored: a decode step then costs O(new tokens), not O(context)); a kernel would dequantize on every read and
    get the same numbers. It is a compute cache, not counted in ``nbytes``.
    """

    qt: QuantizedTensor  # scales, zero points, outliers and shape; its codes are empty (``packed`` holds them)
    packed: torch.Tensor  # uint8 [batch, kv_heads, tokens, spec.fmt.row_nbytes(spec, head_dim)]
    n_codes: int  # codes per row (head_dim)
    decoded: torch.Tensor | None = None

    @classmethod
    def store(cls, x: torch.Tensor, quantizer: TensorQuantizer, channel_block: int | None, rope=None) -> StoredChunk:
        """Quantize x ``[batch, kv_heads, n, head_dim]`` (``rope``: its ``(cos, sin)`` for pre-RoPE keys) and pack
        the codes through the spec's format, whatever the format."""
        qt = quantizer.quantize(x, channel_block, rope)
        spec = qt.spec
        packed = spec.fmt.pack(qt.codes, spec)
        chunk = cls(qt=replace(qt, codes=torch.empty(0, dtype=qt.codes.dtype)), packed=packed,
                    n_codes=qt.codes.shape[-1])
        chunk.decoded = quantizer.read_back(chunk.read_storage(), rope)
        return chunk

    def extend(self, other: StoredChunk) -> StoredChunk:
        """One chunk holding this chunk's tokens followed by ``other``'s (so that a read is one dequantize call).

        Codes, packed rows, scales, zero points and outliers all carry tokens (or token blocks) on dim 2;
        per-tensor, per-head and calibrated scales are static, the same in both chunks, and kept once."""
        a, b = self.qt, other.qt
        static = a.static or a.spec.gran.static_only

        def cat(x, y, keep_once=static):
            if x is None or keep_once:
                return x
            return torch.cat([x, y], dim=2)

        shape = torch.Size([*a.shape[:2], a.shape[2] + b.shape[2], a.shape[3]])
        qt = replace(a, scale=cat(a.scale, b.scale), zero_point=cat(a.zero_point, b.zero_point), shape=shape,
                     outlier_values=cat(a.outlier_values, b.outlier_values, False),
                     outlier_index=cat(a.outlier_index, b.outlier_index, False))
        return StoredChunk(qt=qt, packed=torch.cat([self.packed, other.packed], dim=2), n_codes=self.n_codes,
                           decoded=torch.cat([self.decoded, other.decoded], dim=2))

    def read_storage(self) -> torch.Tensor:
        """Unpack (``spec.fmt.unpack``) and dequantize everything stored: ``[batch, kv_heads, tokens,
        head_dim]``."""
        spec = self.qt.spec
        return dequantize(replace(self.qt, codes=spec.fmt.unpack(self.packed, spec, self.n_codes)))

    def read(self) -> torch.Tensor:
        return self.decoded

    def drop_front(self, read_tokens: int, stored_tokens: int, blocks: int = 0) -> None:
        """Forget the oldest tokens (a sliding-window layer): ``read_tokens`` of what is read, ``stored_tokens`` of
        the packed rows and per-token side data, and ``blocks`` token blocks of per-channel scales (a block's
        scale and codes are kept while any of its tokens is in the window; static scales are kept)."""
        self.decoded = self.decoded[:, :, read_tokens:]
        if stored_tokens == 0 and blocks == 0:
            return
        a = self.qt
        static = a.static or a.spec.gran.static_only

        def cut(x, n):
            return x if x is None or static else x[:, :, n:]

        per_block = a.spec.gran.token_blocks
        drop_scales = blocks if per_block else stored_tokens
        shape = torch.Size([*a.shape[:2], a.shape[2] - stored_tokens, a.shape[3]])
        self.qt = replace(a, scale=cut(a.scale, drop_scales), zero_point=cut(a.zero_point, drop_scales),
                          shape=shape,
                          outlier_values=None if a.outlier_values is None else a.outlier_values[:, :, stored_tokens:],
                          outlier_index=None if a.outlier_index is None else a.outlier_index[:, :, stored_tokens:])
        self.packed = self.packed[:, :, stored_tokens:]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: the packed code bytes as stored, plus scales and zero points in their storage dtype and the
        outliers (values + indices), counted with the scales as side data."""
        side = (self.qt.scale, self.qt.zero_point, self.qt.outlier_values, self.qt.outlier_index)
        scales = sum(t.numel() * t.element_size() for t in side if t is not None)
        codes = self.packed.numel() * self.packed.element_size()
        return {"codes": codes, "scales": scales, "total": codes + scales}


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized cache. Tensors are ``[batch, kv_heads, seq, head_dim]``.

    Keys and values each have their residual window, quantized end and chunks, so that they can follow different
    schedules (``KVPolicy.schedule``: KIVI quantizes keys in blocks and values in a sliding window); the sink tokens
    are shared. ``prompt`` is the number of tokens the first call stored (transformers' schedule counts its blocks
    from there).

    A sliding-window layer (``window``: the model config's ``sliding_window``) forgets, at the end of each call,
    every position older than the ``window`` newest (``evicted`` of them so far), as
    ``kveval.memory.token_split`` bills it: sinks, quantized chunk and residual are cut at ``n - window``; a
    per-channel token block keeps its codes and scales until all of its tokens have left (``block_starts``). What
    attention reads is exactly positions ``[evicted, n)``, which the model's sliding mask limits further.
    """

    def __init__(self, key_q: TensorQuantizer, value_q: TensorQuantizer, policy: KVPolicy, is_sliding: bool = False,
                 module: torch.nn.Module | None = None, implementation: str | None = None,
                 window: int | None = None):
        super().__init__()
        self.key_q, self.value_q, self.policy = key_q, value_q, policy
        self.key_spec, self.value_spec = key_q.spec, value_q.spec
        self.sched_k, self.sched_v = policy.schedule("key"), policy.schedule("value")
        self.is_sliding = is_sliding
        self.window = window if is_sliding else None
        self.evicted = 0  # positions [0, evicted) are forgotten (sliding-window layers only)
        S = policy.sink_tokens
        # per tensor kind: first position of the residual tensor, of the chunk's stored rows and of what it reads,
        # and the start positions of its per-channel token blocks (dynamic channel specs only)
        self.res_from = {"key": S, "value": S}
        self.chunk_from = {"key": S, "value": S}
        self.read_from = {"key": S, "value": S}
        self.block_starts: dict[str, list[int]] = {"key": [], "value": []}
        self.module = module  # the attention module, whose rotary embedding transforms such as pre_rope need
        # the stock attention implementation this layer's ``attend`` wraps; None: no query/output hooks to apply
        self.implementation = implementation
        self.needs_rope = key_q.needs_rope or value_q.needs_rope
        self.n_stored = 0
        self.prompt: int | None = None  # tokens stored by the first call
        # keys (values): tokens [sink_tokens, q_end_k) are quantized, [q_end_k, n_stored) are in res_k
        self.q_end_k = self.q_end_v = policy.sink_tokens
        self.sink_k = self.sink_v = self.res_k = self.res_v = None
        # (cos, sin) [batch, tokens, head_dim] of the sink and residual tokens (only when a transform needs_rope)
        self.sink_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.res_rope_k: tuple[torch.Tensor, torch.Tensor] | None = None
        self.res_rope_v: tuple[torch.Tensor, torch.Tensor] | None = None
        self.chunks_k: list[StoredChunk] = []  # at most one chunk each: new tokens are merged into it
        self.chunks_v: list[StoredChunk] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        empty_k = key_states[:, :, :0]
        empty_v = value_states[:, :, :0]
        self.sink_k, self.sink_v, self.res_k, self.res_v = empty_k, empty_v, empty_k, empty_v
        self.keys, self.values = empty_k, empty_v  # transformers reads dtype/device from these
        self.is_initialized = True

    def _read_one(self, kind: str) -> torch.Tensor:
        """Everything held of ``kind`` (``"key"``/``"value"``), as attention reads it: full-precision sinks and
        residual through ``TensorQuantizer.full_precision`` (themselves unless a transform keeps the tensor in its
        domain), chunks as read back."""
        if kind == "key":
            q, sink, res, res_rope, chunks = self.key_q, self.sink_k, self.res_k, self.res_rope_k, self.chunks_k
        else:
            q, sink, res, res_rope, chunks = self.value_q, self.sink_v, self.res_v, self.res_rope_v, self.chunks_v
        return torch.cat([q.full_precision(sink, self.sink_rope), *[c.read() for c in chunks],
                          q.full_precision(res, res_rope)], dim=-2)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read_one("key"), self._read_one("value")

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
        prefill_fp = self.policy.prefill == "fp" and n_new > 1
        before = self._read() if prefill_fp and self.n_stored > 0 else None

        # sinks first, the rest into the residuals
        room = max(self.policy.sink_tokens - self.n_stored, 0)
        take = min(room, n_new)
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=-2)
        self.res_k = torch.cat([self.res_k, key_states[:, :, take:]], dim=-2)
        self.res_v = torch.cat([self.res_v, value_states[:, :, take:]], dim=-2)
        new_rope = rope_for(self.module, key_states.shape[-1], self.key_q, self.value_q) if self.needs_rope else None
        if new_rope is not None:
            cos, sin = new_rope
            self.sink_rope = self._append_rope(self.sink_rope, (cos[:, :take], sin[:, :take]))
            self.res_rope_k = self._append_rope(self.res_rope_k, (cos[:, take:], sin[:, take:]))
            self.res_rope_v = self._append_rope(self.res_rope_v, (cos[:, take:], sin[:, take:]))
        self.n_stored += n_new
        if self.prompt is None:
            self.prompt = self.n_stored

        # the schedule of kveval.policy.masks (Schedule.read_quantized_end), per tensor: sliding mode stores then
        # reads; the other modes read, then quantize what this call completed (its queries saw it in full precision)
        out: list[torch.Tensor | None] = []
        for kind, sched in (("key", self.sched_k), ("value", self.sched_v)):
            read_first = sched.reads_first and not prefill_fp
            early = self._read_one(kind) if read_first else None
            self._flush(kind)
            out.append(early if early is not None or prefill_fp else self._read_one(kind))

        self._evict()
        if prefill_fp:
            key_states = self.key_q.full_precision(key_states, new_rope)
            value_states = self.value_q.full_precision(value_states, new_rope)
            if before is None:
                return key_states, value_states
            return torch.cat([before[0], key_states], dim=-2), torch.cat([before[1], value_states], dim=-2)
        return out[0], out[1]

    def _token_block(self, q: TensorQuantizer, block: int | None, tokens: int) -> int | None:
        """The token block of a dynamic per-channel spec's statistics (None for every other spec)."""
        if q.is_none or not q.spec.gran.token_blocks or q.spec.granularity != "channel" or block is None:
            return None
        if self.policy.uses_static(q.spec):
            return None
        return q.spec.gran.block(tokens, block)

    def _evict(self) -> None:
        """Forget the positions older than the window's (sliding-window layers; see the class docstring)."""
        if self.window is None:
            return
        lo = self.n_stored - self.window
        if lo <= self.evicted:
            return
        self.evicted = lo
        sink_end = min(self.policy.sink_tokens, self.n_stored)
        drop = min(lo, sink_end) - (sink_end - self.sink_k.shape[-2])
        if drop > 0:
            self.sink_k, self.sink_v = self.sink_k[:, :, drop:], self.sink_v[:, :, drop:]
            if self.sink_rope is not None:
                self.sink_rope = (self.sink_rope[0][:, drop:], self.sink_rope[1][:, drop:])
        for kind in ("key", "value"):
            chunks = self.chunks_k if kind == "key" else self.chunks_v
            q_end = self.q_end_k if kind == "key" else self.q_end_v
            if chunks and lo > self.read_from[kind]:
                if lo >= q_end:
                    chunks.clear()
                    self.chunk_from[kind] = self.read_from[kind] = q_end
                    self.block_starts[kind] = []
                else:
                    starts = self.block_starts[kind]
                    if starts:
                        ends = [*starts[1:], q_end]
                        gone = sum(1 for e in ends if e <= lo)
                        new_from, blocks = starts[gone], gone
                        self.block_starts[kind] = starts[gone:]
                    else:
                        new_from, blocks = lo, 0
                    chunks[0].drop_front(lo - self.read_from[kind], new_from - self.chunk_from[kind], blocks)
                    self.read_from[kind], self.chunk_from[kind] = lo, new_from
            drop = min(lo, self.n_stored) - self.res_from[kind]
            if drop > 0:
                if kind == "key":
                    self.res_k = self.res_k[:, :, drop:]
                    if self.res_rope_k is not None:
                        self.res_rope_k = (self.res_rope_k[0][:, drop:], self.res_rope_k[1][:, drop:])
                else:
                    self.res_v = self.res_v[:, :, drop:]
                    if self.res_rope_v is not None:
                        self.res_rope_v = (self.res_rope_v[0][:, drop:], self.res_rope_v[1][:, drop:])
                self.res_from[kind] += drop

    def _flush(self, kind: str) -> None:
        """Move the tokens of ``kind`` that have left its residual (``Schedule.quantized_end``) into quantized
        storage."""
        sched = self.sched_k if kind == "key" else self.sched_v
        q_end = self.q_end_k if kind == "key" else self.q_end_v
        end = min(sched.quantized_end(self.n_stored, self.prompt or 1), self.n_stored)
        if end <= q_end:
            return
        start = self.res_from[kind]  # positions [q_end, start) left a sliding window before being quantized
        move = max(end - start, 0)
        block = sched.residual if sched.blocks else None
        if kind == "key":
            res, res_rope, q, chunks = self.res_k, self.res_rope_k, self.key_q, self.chunks_k
        else:
            res, res_rope, q, chunks = self.res_v, self.res_rope_v, self.value_q, self.chunks_v
        if move:
            rope = None if res_rope is None else (res_rope[0][:, :move], res_rope[1][:, :move])
            res_rope = None if res_rope is None else (res_rope[0][:, move:], res_rope[1][:, move:])
            if not chunks:
                self.chunk_from[kind] = self.read_from[kind] = start
            self._store(res[:, :, :move], q, chunks, block, rope)
            token_block = self._token_block(q, block, move)
            if token_block is not None:
                self.block_starts[kind].extend(range(start, end, token_block))
            res = res[:, :, move:]
            self.res_from[kind] = end
        if kind == "key":
            self.res_k, self.res_rope_k, self.q_end_k = res, res_rope, end
        else:
            self.res_v, self.res_rope_v, self.q_end_v = res, res_rope, end

    @staticmethod
    def _append_rope(old: tuple[torch.Tensor, torch.Tensor] | None,
                     new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return new if old is None else (torch.cat([old[0], new[0]], dim=1), torch.cat([old[1], new[1]], dim=1))

    @staticmethod
    def _store(x: torch.Tensor, q: TensorQuantizer, chunks: list, block: int | None, rope=None) -> None:
        """Quantize and pack x ``[batch, kv_heads, n, head_dim]`` (``block``: the channel block of a per-channel
        spec) and append it to ``chunks``."""
        r = rope if q.needs_rope else None
        if q.is_none:
            # a layer that keeps this tensor in full precision stores it as a plain chunk (as attention reads it)
            new = _FullPrecisionChunk(q.full_precision(x, r).clone())
        else:
            new = StoredChunk.store(x, q, block if q.spec.granularity == "channel" else None, r)
        if chunks:
            chunks[0] = chunks[0].extend(new)
        else:
            chunks.append(new)

    def get_seq_length(self) -> int:
        return self.n_stored

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(key length, position of the first key) that the next call's attention mask covers: everything held
        plus the ``query_length`` new tokens, from position ``evicted``."""
        return self.n_stored - self.evicted + query_length, self.evicted

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def reset(self) -> None:
        self.__init__(self.key_q, self.value_q, self.policy, self.is_sliding, self.module, self.implementation,
                      self.window)

    def nbytes(self) -> dict:
        """Bytes held: ``codes`` (packed), ``scales`` (scales and zero points), ``residual`` (full-precision tokens:
        sinks, residual windows, and tensors whose spec is ``none``)."""
        out = {"codes": 0, "scales": 0, "residual": 0}
        if not self.is_initialized:
            return {**out, "total": 0}
        for t in (self.sink_k, self.sink_v, self.res_k, self.res_v):
            out["residual"] += t.numel() * t.element_size()
        for chunk in (*self.chunks_k, *self.chunks_v):
            b = chunk.nbytes()
            if isinstance(chunk, _FullPrecisionChunk):
                out["residual"] += b["total"]
            else:
                out["codes"] += b["codes"]
                out["scales"] += b["scales"]
        out["total"] = out["codes"] + out["scales"] + out["residual"]
        return out


@dataclass
class _FullPrecisionChunk:
    x: torch.Tensor

    def read(self) -> torch.Tensor:
        return self.x

    def extend(self, other: _FullPrecisionChunk) -> _FullPrecisionChunk:
        return _FullPrecisionChunk(torch.cat([self.x, other.x], dim=2))

    def drop_front(self, read_tokens: int, stored_tokens: int, blocks: int = 0) -> None:
        self.x = self.x[:, :, read_tokens:]

    def nbytes(self) -> dict:
        n = self.x.numel() * self.x.element_size()
        return {"codes": 0, "scales": 0, "total": n}


def cache_kwargs(model, cache: Cache) -> dict:
    """The keyword that hands a cache to ``model.forward``: ``cache`` in newer transformers 5.x releases,
    ``past_key_values`` before (``generate()`` takes ``past_key_values``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _sliding_layers(model, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding-window layer indices) of the model's config (``kveval.memory.sliding_window_layers``)."""
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    return sliding_window_layers(cfg.to_dict(), n_layers)


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` whose layers store K/V quantized under ``policy``.

    Full-attention layers keep every token; sliding-window layers (the config's ``layer_types`` /
    ``sliding_window``) keep the newest ``window`` tokens, so that ``nbytes()`` equals the memory bill
    (``kveval.memory.kv_bytes`` of ``Arch.from_model``) after every call.

    K/V transforms (``policy.transform_sequence()``) act through the layers' ``TensorQuantizer``s, as in
    ``emulate``. When a transform hooks the query or the attention output (e.g. a rotation that keeps the cache
    rotated, as llama.cpp does), the cache wraps the model's attention function during exactly the forward calls
    of ``model`` that receive this cache (``kveval.patch.attention.patched_while_passed``: forward hooks on
    ``model``, removed when the cache is garbage-collected); the model is restored after each call. Without such
    hooks nothing is wrapped and the model runs its own attention function.
    """

    def __init__(self, model, policy: KVPolicy):
        modules = attention_modules(model)
        n = len(modules)
        window, sliding = _sliding_layers(model, n)
        check_sliding_window(policy, window, sliding, n)
        scales = policy_scales(policy, model)
        if any(t.needs_rope for t in policy.transform_sequence()):
            track_rope(model)
        quantizers = [layer_quantizers(policy, m.layer_idx, n, scales, model.device, model_type_of(model))
                      for m in modules]
        hooked = any(q.hooks_attention for pair in quantizers for q in pair)
        base = attn.base_implementation(model) if hooked else None
        layers = [
            QuantizedKVLayer(k_q, v_q, policy, is_sliding=m.layer_idx in sliding, module=m,
                             implementation=base if k_q.hooks_attention or v_q.hooks_attention else None,
                             window=window)
            for m, (k_q, v_q) in zip(modules, quantizers)
        ]
        super().__init__(layers=layers)
        self.policy = policy
        if hooked:
            attn.patched_while_passed(model, {m: la for m, la in zip(modules, layers) if la.implementation}, self)

    def nbytes(self) -> dict:
        """Bytes held by all layers: ``codes``, ``scales``, ``residual`` and ``total``."""
        total = {"codes": 0, "scales": 0, "residual": 0, "total": 0}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] += v
        return total


@torch.no_grad()
def decode_logits(model, input_ids: torch.Tensor, policy: KVPolicy, prefill_len: int = 1) -> torch.Tensor:
    """Logits of token-by-token decoding through a real ``QuantizedKVCache``: ``prefill_len`` tokens in one call,
    then one token per step. input_ids ``[batch, T]`` -> logits ``[batch, T, vocab]``.

    The second computation path of the emulation contract: ``emulate(model, policy, prefill_len=P)`` gives the
    same logits up to float rounding (with ``prefill_len`` 0 or 1 both mean "every token decoded").
    """
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    first = max(prefill_len, 1)
    out = [model(input_ids[:, :first], use_cache=True, **kw).logits]
    for t in range(first, input_ids.shape[1]):
        out.append(model(input_ids[:, t : t + 1], use_cache=True, **kw).logits)
    return torch.cat(out, dim=1)
