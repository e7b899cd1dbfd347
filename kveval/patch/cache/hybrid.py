"""Layers that hold both a quantized K/V cache and a full-precision linear-attention / Mamba state (Falcon-H1's
parallel attention + Mamba layers): ``QuantizedHybridLayer`` joins transformers' ``LinearAttentionLayer`` (the
state part) to ``QuantizedKVLayer`` (the attention part, on the read path of its setup)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers.cache_utils import LinearAttentionLayer

from kveval.patch.cache.layer import LayerSetup, QuantizedKVLayer


class QuantizedHybridLayer(LinearAttentionLayer, QuantizedKVLayer):
    """transformers' ``LinearAttentionAndFullAttentionLayer`` with ``QuantizedKVLayer`` as its attention part. The
    conv and recurrent states are kept exactly as transformers keeps them (``LinearAttentionLayer``: the live
    tensors, updated in place by the model)."""

    is_compileable = False

    def __init__(self, setup: LayerSetup, left_padding: Sequence[int] | None = None, *, number_of_states: int = 1):
        QuantizedKVLayer.__init__(self, setup, left_padding)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
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
        QuantizedKVLayer.reset(self)
