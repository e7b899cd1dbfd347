"""Pure-maths KV-cache quantizers: QuantSpec (what), formats and granularities (the maths, as plug-ins: a new
format is one module registered with `register_format`), primitives (how), presets (named specs).

Tensors are K or V states [batch, kv_heads, seq, head_dim]. Imports nothing from transformers or the rest of kveval.
"""

from .formats import QuantFormat, format_names, get_format, register_format, unregister_format
from .granularity import Granularity, granularity_of
from .presets import preset, preset_names
from .primitives import (
    QParams,
    QuantizedTensor,
    choose_qparams,
    dequantize,
    dequantize_into,
    fake_quantize,
    pack,
    packed_nbytes,
    qparams_from_range,
    quantize,
    split_outliers,
    unpack,
)
from .spec import QuantSpec

__all__ = [
    "QuantSpec",
    "QParams",
    "QuantizedTensor",
    "choose_qparams",
    "quantize",
    "dequantize",
    "dequantize_into",
    "fake_quantize",
    "pack",
    "unpack",
    "packed_nbytes",
    "qparams_from_range",
    "split_outliers",
    "preset",
    "preset_names",
    "QuantFormat",
    "register_format",
    "unregister_format",
    "get_format",
    "format_names",
    "Granularity",
    "granularity_of",
]
