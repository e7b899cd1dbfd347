"""Patching a model: single-pass emulation and the real quantized cache."""

from kveval.patch.cache import QuantizedKVCache, cache_kwargs, decode_logits, resident_nbytes, watch_peak
from kveval.patch.emulate import emulate

__all__ = ["QuantizedKVCache", "cache_kwargs", "decode_logits", "emulate", "resident_nbytes", "watch_peak"]
