"""A real quantized KV cache for ``model.generate()`` and step-by-step decoding.

Each layer holds, in position order: the sink tokens in full precision, the quantized middle as packed integer
codes (or FP8 bytes) with scales/zero points in their storage dtype, and the full-precision residual window.
Reads dequantize everything that is stored. ``nbytes()`` reports the bytes actually held.

Usage::

    cache = QuantizedKVCache(model, KVPolicy.preset("int4_g64"))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20)

Semantics (the same as ``emulate``): a token is quantized when it leaves the residual window (``sliding``) or
when its block of ``residual`` tokens is complete (``block``); sinks never are. A call that brings more than one
token (the prefill) answers, with ``prefill: fp``, the new tokens in full precision (what serving engines do);
with ``prefill: quantized`` and for single-token decode steps it answers the stored versions.

Limitation: with batch > 1 and left padding, sink tokens count from the first stored position of the row
(padding included), and per-channel blocks take statistics over the padded positions too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kveval.patch.attention import attention_modules
from kveval.patch.quantizers import TensorQuantizer, layer_quantizers, policy_scales
from kveval.patch.rope_capture import rope_of, track_rope
from kveval.policy import KVPolicy
from kveval.quant import QuantizedTensor, dequantize, pack, unpack


@dataclass
class StoredChunk:
    """A run of quantized tokens: packed codes plus the QuantizedTensor's scales/zero points.

    ``decoded`` holds the values read back from that storage (unpacked and dequantized once, when the tokens are
    stored: a decode step then costs O(new tokens), not O(context)); a kernel would dequantize on every read and
    get the same numbers. It is a compute cache, not counted in ``nbytes``.
    """

    qt: QuantizedTensor
    packed: torch.Tensor | None  # uint8 rows along head_dim, None when the codes are stored as they are (FP8)
    n_codes: int
    decoded: torch.Tensor | None = None

    @classmethod
    def store(cls, x: torch.Tensor, quantizer: TensorQuantizer, channel_block: int | None, rope=None) -> StoredChunk:
        """Quantize x ``[batch, kv_heads, n, head_dim]`` (``rope``: its ``(cos, sin)`` for pre-RoPE keys)."""
        spec = quantizer.spec
        qt = quantizer.quantize(x, channel_block, rope)
        if qt.codes.dtype in (torch.int8, torch.uint8) and spec.format == "int" and spec.bits < 8:
            n = qt.codes.shape[-1]
            packed = pack(qt.codes, spec.bits)
            qt = QuantizedTensor(**{**qt.__dict__, "codes": torch.empty(0, dtype=qt.codes.dtype)})  # dtype kept: signedness
            chunk = cls(qt=qt, packed=packed, n_codes=n)
        else:
            chunk = cls(qt=qt, packed=None, n_codes=qt.codes.shape[-1])
        chunk.decoded = quantizer.read_back(chunk.read_storage(), rope)
        return chunk

    def extend(self, other: StoredChunk) -> StoredChunk:
        """One chunk holding this chunk's tokens followed by ``other``'s (so that a read is one dequantize call).

        Codes, packed rows, scales, zero points and outliers all carry tokens (or token blocks) on dim 2;
        per-tensor, per-head and calibrated scales are static, the same in both chunks, and kept once."""
        a, b = self.qt, other.qt
        static = a.static or (a.spec.granularity in ("tensor", "head") and a.spec.ggml is None)

        def cat(x, y, keep_once=static):
            if x is None:
                return None
            if keep_once:
                return x
            return torch.cat([x, y], dim=2)

        shape = torch.Size([*a.shape[:2], a.shape[2] + b.shape[2], a.shape[3]])
        qt = QuantizedTensor(**{
            **a.__dict__, "codes": torch.cat([a.codes, b.codes], dim=2) if self.packed is None else a.codes,
            "scale": cat(a.scale, b.scale), "zero_point": cat(a.zero_point, b.zero_point), "shape": shape,
            "outlier_values": cat(a.outlier_values, b.outlier_values, False),
            "outlier_index": cat(a.outlier_index, b.outlier_index, False),
        })
        packed = None if self.packed is None else torch.cat([self.packed, other.packed], dim=2)
        return StoredChunk(qt=qt, packed=packed, n_codes=self.n_codes,
                           decoded=torch.cat([self.decoded, other.decoded], dim=2))

    def read_storage(self) -> torch.Tensor:
        """Unpack and dequantize everything stored: ``[batch, kv_heads, tokens, head_dim]``."""
        if self.packed is None:
            return dequantize(self.qt)
        codes = unpack(self.packed, self.qt.spec.bits, self.n_codes, signed=self.qt.codes.dtype == torch.int8)
        return dequantize(QuantizedTensor(**{**self.qt.__dict__, "codes": codes}))

    def read(self) -> torch.Tensor:
        return self.decoded

    def nbytes(self) -> dict:
        """Bytes held: the packed code bytes as stored, plus scales and zero points in their storage dtype and the
        outliers (values + indices), counted with the scales as side data."""
        side = (self.qt.scale, self.qt.zero_point, self.qt.outlier_values, self.qt.outlier_index)
        scales = sum(t.numel() * t.element_size() for t in side if t is not None)
        if self.packed is None:
            codes = self.qt.nbytes()["codes"]
        else:
            codes = self.packed.numel() * self.packed.element_size()
        return {"codes": codes, "scales": scales, "total": codes + scales}


class QuantizedKVLayer(DynamicLayer):
    """One layer's quantized cache. Tensors are ``[batch, kv_heads, seq, head_dim]``."""

    def __init__(self, key_q: TensorQuantizer, value_q: TensorQuantizer, policy: KVPolicy, is_sliding: bool = False,
                 module: torch.nn.Module | None = None):
        super().__init__()
        self.key_q, self.value_q, self.policy = key_q, value_q, policy
        self.key_spec, self.value_spec = key_q.spec, value_q.spec
        self.is_sliding = is_sliding
        self.module = module  # the attention module, whose rotary embedding pre-RoPE keys need
        self.n_stored = 0
        self.q_end = policy.sink_tokens  # tokens [sink_tokens, q_end) are quantized
        self.sink_k = self.sink_v = self.res_k = self.res_v = None
        self.res_rope = None  # (cos, sin) [batch, residual tokens, head_dim] of the residual keys (pre_rope only)
        self.chunks_k: list[StoredChunk] = []  # at most one chunk each: new tokens are merged into it
        self.chunks_v: list[StoredChunk] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        empty_k = key_states[:, :, :0]
        empty_v = value_states[:, :, :0]
        self.sink_k, self.sink_v, self.res_k, self.res_v = empty_k, empty_v, empty_k, empty_v
        self.keys, self.values = empty_k, empty_v  # transformers reads dtype/device from these
        self.is_initialized = True

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self.sink_k, *[c.read() for c in self.chunks_k], self.res_k], dim=-2)
        values = torch.cat([self.sink_v, *[c.read() for c in self.chunks_v], self.res_v], dim=-2)
        return keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        prefill_fp = self.policy.prefill == "fp" and n_new > 1
        before = self._read() if prefill_fp and self.n_stored > 0 else None

        # sinks first, the rest into the residual
        room = max(self.policy.sink_tokens - self.sink_k.shape[-2], 0)
        take = min(room, n_new)
        if take:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :take]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :take]], dim=-2)
        self.res_k = torch.cat([self.res_k, key_states[:, :, take:]], dim=-2)
        self.res_v = torch.cat([self.res_v, value_states[:, :, take:]], dim=-2)
        if self.key_q.pre_rope:
            cos, sin = rope_of(self.module, key_states.shape[-1])
            new = (cos[:, take:], sin[:, take:])
            self.res_rope = new if self.res_rope is None else tuple(
                torch.cat([old, n], dim=1) for old, n in zip(self.res_rope, new))
        self.n_stored += n_new

        end = min(self.policy.quantized_block_end(self.n_stored), self.n_stored)
        if end > self.q_end:
            move = end - self.q_end
            block = self.policy.residual if self.policy.residual_mode == "block" else None
            rope = None if self.res_rope is None else tuple(t[:, :move] for t in self.res_rope)
            self._store(self.res_k[:, :, :move], self.res_v[:, :, :move], block, rope)
            self.res_k, self.res_v = self.res_k[:, :, move:], self.res_v[:, :, move:]
            if self.res_rope is not None:
                self.res_rope = tuple(t[:, move:] for t in self.res_rope)
            self.q_end = end

        if prefill_fp:
            if before is None:
                return key_states, value_states
            return torch.cat([before[0], key_states], dim=-2), torch.cat([before[1], value_states], dim=-2)
        return self._read()

    def _store(self, k: torch.Tensor, v: torch.Tensor, block: int | None, rope=None) -> None:
        for x, q, chunks, r in ((k, self.key_q, self.chunks_k, rope), (v, self.value_q, self.chunks_v, None)):
            if q.is_none:
                # a layer that keeps this tensor in full precision stores it as a plain chunk
                new = _FullPrecisionChunk(x.clone())
            else:
                new = StoredChunk.store(x, q, block if q.spec.granularity == "channel" else None, r)
            if chunks:
                chunks[0] = chunks[0].extend(new)
            else:
                chunks.append(new)

    def get_seq_length(self) -> int:
        return self.n_stored

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_stored + query_length, 0

    def reset(self) -> None:
        self.__init__(self.key_q, self.value_q, self.policy, self.is_sliding, self.module)

    def nbytes(self) -> dict:
        """Bytes held: ``codes`` (packed), ``scales`` (scales and zero points), ``residual`` (full-precision tokens:
        sinks, residual window, and tensors whose spec is ``none``)."""
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

    def nbytes(self) -> dict:
        n = self.x.numel() * self.x.element_size()
        return {"codes": 0, "scales": 0, "total": n}


def cache_kwargs(model, cache: Cache) -> dict:
    """The keyword that hands a cache to ``model.forward``: ``cache`` in newer transformers 5.x releases,
    ``past_key_values`` before (``generate()`` takes ``past_key_values``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _sliding_layers(model) -> set[int]:
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    types = getattr(cfg, "layer_types", None) or []
    return {i for i, t in enumerate(types) if t == "sliding_attention"}


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` whose layers store K/V quantized under ``policy``.

    All tokens are kept (sliding-window layers included; their mask limits what they see), so that the memory
    bill of a full-attention model is exact.
    """

    def __init__(self, model, policy: KVPolicy):
        modules = attention_modules(model)
        n = len(modules)
        sliding = _sliding_layers(model)
        scales = policy_scales(policy, model)
        if policy.pre_rope:
            track_rope(model)
        layers = [
            QuantizedKVLayer(*layer_quantizers(policy, m.layer_idx, n, scales, model.device), policy,
                             is_sliding=m.layer_idx in sliding, module=m)
            for m in modules
        ]
        super().__init__(layers=layers)
        self.policy = policy

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
