"""The memory feature, pure arithmetic: the shape of a model's KV cache (``arch``: the value object; read from a
HF config by ``config_reader``, with the layer kinds, MLA latents and recurrent states of ``layer_kinds``), the
exact bill of a policy (``bill``), and the rows of ``kveval memory`` and the memory fields of a run (``rows``).
``from kveval.memory import Arch, kv_bytes`` is the public entry point."""

from kveval.memory.arch import NAMED_SHAPES, Arch, sliding_window_layers
from kveval.memory.bill import (
    DEFAULT_BLOCK_SIZE,
    FP16_BYTES,
    MAX_CONTEXT,
    Bill,
    Paging,
    Part,
    as_policy,
    block_bytes,
    fp16_bytes,
    kv_budget,
    kv_bytes,
    kv_elements,
    max_batch,
    max_context,
    paging,
    token_split,
)
from kveval.memory.fit import check_design, check_policy, model_designs
from kveval.units import format_bytes

__all__ = [
    "DEFAULT_BLOCK_SIZE", "FP16_BYTES", "NAMED_SHAPES", "Arch", "Bill", "Paging", "Part", "as_policy", "block_bytes",
    "format_bytes", "fp16_bytes", "kv_budget", "kv_bytes", "kv_elements", "max_batch", "max_context", "paging", "token_split",
    "sliding_window_layers", "MAX_CONTEXT", "check_design", "check_policy", "model_designs",
]
