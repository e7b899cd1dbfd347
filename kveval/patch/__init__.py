"""Patching a model: single-pass emulation and the real quantized cache."""

from kveval.patch.cache import QuantizedKVCache, cache_kwargs
from kveval.patch.emulate import emulate

__all__ = ["QuantizedKVCache", "cache_kwargs", "emulate"]
