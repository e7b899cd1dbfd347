"""The memory feature: the exact bill of a KV cache (``bill``, pure arithmetic) and the ``kveval memory`` table
(``table``). ``from kveval.memory import Arch, kv_bytes`` is the public entry point."""

from kveval.memory.bill import (
    DEFAULT_BLOCK_SIZE,
    FP16_BYTES,
    MAX_CONTEXT,
    NAMED_SHAPES,
    Arch,
    Bill,
    Paging,
    Part,
    as_policy,
    block_bytes,
    format_bytes,
    fp16_bytes,
    kv_budget,
    kv_bytes,
    max_batch,
    max_context,
    paging,
    sliding_window_layers,
    token_split,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "FP16_BYTES", "NAMED_SHAPES", "Arch", "Bill", "Paging", "Part", "as_policy", "block_bytes",
    "format_bytes", "fp16_bytes", "kv_budget", "kv_bytes", "max_batch", "max_context", "paging", "token_split",
    "sliding_window_layers", "MAX_CONTEXT",
]
