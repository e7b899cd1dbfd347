"""Quantizer formats as plug-ins: one module per format, registered by name.

    from kveval.quant.formats import QuantFormat, register_format, get_format, format_names

Built in (in registration order): 'int' (`integer.py`), 'fp8_e4m3', 'fp8_e5m2' (`fp8.py`), 'none' (`none.py`),
the ggml block types 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1' (`ggml.py`, named by `QuantSpec.ggml`), then the
others by module name (fp4, hqq, iq4_nl, nuq, per_token_head, q8_0_x86, turboquant).

- ``base``: the protocol every format implements (`TensorFormat`), `QParams`, `TensorParts`, the `Spec` view;
- ``segment``: `QuantFormat`, the base of the per-segment formats (all but 'nuq');
- ``registry``: the registry (`register_format`, `get_format`, `format_names`, `unregister_format`).

A new built-in format is one module here defining ``FORMATS = (MyFormat(),)`` (a `QuantFormat` subclass; every
module of this package is imported and its FORMATS registered) plus a preset entry in `kveval/quant/presets.py`.
From outside kveval: `register_format(MyFormat())`.
"""

from .base import QParams, TensorFormat
from .fp8 import FP8Format
from .ggml import GGML_BLOCK, GGML_TYPES, GgmlFormat
from .integer import IntFormat
from .none import NoneFormat
from .registry import format_names, get_format, register_format, unregister_format
from .segment import QuantFormat

__all__ = [
    "QuantFormat", "TensorFormat", "QParams", "register_format", "unregister_format", "get_format", "format_names",
    "IntFormat", "FP8Format", "GgmlFormat", "NoneFormat", "GGML_TYPES", "GGML_BLOCK",
]
