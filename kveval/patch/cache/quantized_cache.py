"""The real quantized KV cache object (``QuantizedKVCache``, a transformers ``Cache``): one quantized layer per
attention layer of the model, holding the read path it is asked for (``READ_PATHS``), transformers' own layers for
the states; how a model call receives it (``cache_kwargs``), the left padding of a batch (``left_padding_of``), and
the logits of decoding through it token by token (``decode_logits``)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

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
from kveval.patch.cache.flush_batch import FlushBatch
from kveval.patch.cache.hybrid import QuantizedHybridLayer
from kveval.patch.cache.layer import LayerSetup, QuantizedKVLayer, ReadPath
from kveval.patch.cache.measure import state_nbytes
from kveval.patch.cache.read_paths import BufferedReadPath, LeanReadPath
from kveval.patch.layers import model_quantizers
from kveval.policy import KVPolicy

#: the read paths (the package docstring, "Two read paths"): the class of each, whose one object every quantized
#: layer of a cache holds (an attention layer and a layer that also holds a linear-attention / Mamba state alike)
READ_PATHS: dict[str, type[ReadPath]] = {"lean": LeanReadPath, "buffered": BufferedReadPath}

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
    become ``QuantizedKVLayer``s holding the read path (full-attention layers keep every token; sliding-window
    and chunked-attention layers keep the newest ``window`` tokens), a layer holding both K/V and a state
    (Falcon-H1) a ``QuantizedHybridLayer``; linear-attention / Mamba layers keep transformers'
    ``LinearAttentionLayer`` (their state in full precision) and MLP-only layers its ``DummyLayer``. So
    ``nbytes()`` equals the memory bill (``kveval.memory.kv_bytes`` of ``Arch.from_model``) after every call, for a
    batch the sum of its rows' bills, and ``nbytes()["state"]`` the bill's ``state``. An MLA model's layers hold
    what its attention hands the cache, the latent ``c_kv`` (key spec) and ``k_pe`` (value spec).

    ``left_padding``: per row, the padding positions before its first token (the package docstring, "Batches and
    left padding"); None: read from the ``attention_mask`` of the first forward call of ``model`` that receives
    this cache (``model.generate`` passes it), every row starting at position 0 when there is none.
    ``max_length``: positions the buffered read path allocates at the first call (prompt + new tokens; its buffers
    grow by doubling otherwise). ``read``: ``"lean"`` (holds what ``nbytes()`` bills, dequantizes a layer's history
    at each call) or ``"buffered"`` (also keeps every token's read-back value: faster, more memory than a
    DynamicCache); the same numbers (the package docstring).

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
        read_path = READ_PATHS[read](reserve=max_length)  # one strategy object, shared by the layers
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
        flushes = FlushBatch()  # the flushes of one call, quantized together (``kveval.patch.cache.flush_batch``)
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
            setup = LayerSetup(k_q, v_q, policy, read_path, window=window, module=mq.modules[i],
                               implementation=base if k_q.hooks_attention or v_q.hooks_attention else None,
                               plans=plans, flushes=flushes)
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layers.append(QuantizedHybridLayer(setup, left_padding, number_of_states=layer.number_of_states))
            else:
                layers.append(QuantizedKVLayer(setup, left_padding))
        super().__init__(layers=layers)
        flushes.last = next((la for la in reversed(layers) if isinstance(la, QuantizedKVLayer)), None)
        self.policy, self.read = policy, read
        self.left_padding = None if left_padding is None else list(left_padding)
        attending = {mq.modules[i]: la for i, la in enumerate(layers)
                     if isinstance(la, QuantizedKVLayer) and la.implementation}
        if hooked:
            attn.patched_while_passed(model, attending, self)
        if left_padding is None:
            self._watch_first_mask(model)

    def fork(self, model) -> QuantizedKVCache:
        """An independent copy of what this cache holds, for the same ``model`` (a conversation branched at this
        point: updates of either leave the other alone). The model's modules, parameters and buffers are shared,
        not copied; a cache whose transforms hook the attention gets hooks of its own (``copy.deepcopy`` would
        copy the attention modules and leave the copy without hooks)."""
        memo: dict[int, object] = {id(m): m for m in model.modules()}
        memo.update({id(t): t for t in (*model.parameters(), *model.buffers())})
        twin = copy.deepcopy(self, memo)
        attending = {la.module: la for la in twin.layers if isinstance(la, QuantizedKVLayer) and la.implementation}
        if attending:
            attn.patched_while_passed(model, attending, twin)
        return twin

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
        return sum(la.rope.nbytes() for la in self.layers if isinstance(la, QuantizedKVLayer))

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
