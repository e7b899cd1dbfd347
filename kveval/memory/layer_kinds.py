"""The kinds of layer a model's cache has (:data:`LAYER_KINDS`), and what the two stores that are not plain K/V
hold: multi-head latent attention's latent (:class:`Mla`) and a state layer's fixed state (:class:`StateShape`).

Shared by the model shape (:class:`kveval.memory.arch.Arch`, whose module docstring describes each kind and
layout) and the config reader that fills it (:mod:`kveval.memory.config_reader`). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kveval.errors import KvevalError
from kveval.policy.parse import MLA_LAYOUTS

LayerKind = Literal["full", "sliding", "chunked", "state", "hybrid", "hybrid_sliding", "none"]
LAYER_KINDS: tuple[str, ...] = ("full", "sliding", "chunked", "state", "hybrid", "hybrid_sliding", "none")
#: the kinds that hold K/V, and the kinds that hold a fixed-size state
KV_KINDS = frozenset({"full", "sliding", "chunked", "hybrid", "hybrid_sliding"})
STATE_KINDS = frozenset({"state", "hybrid", "hybrid_sliding"})
#: bytes per element of the recurrent (SSM) state as transformers 5.24 holds it (float32 on every backend it has)
RECURRENT_BYTES = 4


def positive_int(value: Any, what: str) -> int:
    """``value`` when it is a positive int (not a bool); KvevalError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvevalError(f"{what} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention's dimensions: the latent ``kv_lora_rank``, the RoPE part ``qk_rope_head_dim``,
    the per-head ``qk_nope_head_dim`` and ``v_head_dim`` that ``kv_b_proj`` decompresses to, and the query
    ``heads``."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    heads: int

    def kv_shapes(self, mla_layout: str = "latent") -> tuple[tuple[int, int], tuple[int, int]]:
        """``((key heads, key dim), (value heads, value dim))`` stored per token: ``(1, kv_lora_rank)`` and ``(1,
        qk_rope_head_dim)`` in the ``latent`` layout (c_kv and k_pe), ``(heads, qk_nope_head_dim +
        qk_rope_head_dim)`` and ``(heads, v_head_dim)`` in the ``decompressed`` one."""
        if mla_layout == "decompressed":
            return (self.heads, self.qk_nope_head_dim + self.qk_rope_head_dim), (self.heads, self.v_head_dim)
        if mla_layout != "latent":
            raise KvevalError(f"MLA layout must be one of {', '.join(MLA_LAYOUTS)}; got {mla_layout!r}")
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)

    def to_dict(self) -> dict:
        return {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                "qk_nope_head_dim": self.qk_nope_head_dim, "v_head_dim": self.v_head_dim, "heads": self.heads}


@dataclass(frozen=True)
class StateShape:
    """The fixed-size state of one state layer, per sequence: ``conv`` elements (the model's dtype) and
    ``recurrent`` elements (float32), of the ``family`` (``gated_delta_net``, ``mamba2``, ``mamba``)."""

    family: str
    conv: int
    recurrent: int

    def nbytes(self, fp_bytes: int) -> int:
        """Bytes per sequence: the conv state at ``fp_bytes`` per element, the recurrent state in float32."""
        return self.conv * fp_bytes + self.recurrent * RECURRENT_BYTES

    def to_dict(self) -> dict:
        return {"family": self.family, "conv_elements": self.conv, "recurrent_elements": self.recurrent}


__all__ = ["KV_KINDS", "LAYER_KINDS", "RECURRENT_BYTES", "STATE_KINDS", "LayerKind", "Mla", "StateShape",
           "positive_int"]
