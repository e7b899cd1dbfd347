"""llama.cpp's channel order of Q and K for Llama-family GGUF files.

``convert_hf_to_gguf.py`` (``LlamaModel.permute``, applied to ``q_proj``/``k_proj`` weights and biases in
``LlamaModel.modify_tensors``) permutes the rows of each head so that HF's rotate-half pairs ``(i, i + d/2)``
become adjacent: GGUF channel ``2i + j`` holds HF channel ``j*d/2 + i`` (i < d/2, j in {0, 1}); llama.cpp then
applies RoPE to adjacent pairs (``LLAMA_ROPE_TYPE_NORM``, ``llama_model_rope_type`` in src/llama-model.cpp). The
keys in llama.cpp's cache are therefore in this interleaved order: a 32-element ggml block of a head_dim-64 key
holds HF channels {16b .. 16b+15} and {32+16b .. 32+16b+15}, and the Hadamard groups (``hadamard``) act on this
order. V and O are not permuted.

This transform moves Q and K into that order together (``key_in(k) = k[..., perm]``, ``query(q) = q[..., perm]``,
q·k unchanged) and keeps the cache in it (``key_out`` is the identity): put it first in a llama.cpp policy, before
``hadamard`` and ``query_quant``. Shapes: ``[batch, heads, T, head_dim]``, head_dim even.

Only for models whose GGUF conversion permutes: the HF model types that llama.cpp converts to its ``llama``
architecture (``PERMUTED_MODEL_TYPES``: Llama, Mistral, Mixtral, SmolLM2; the architecture whose Q/K rows
transformers' own GGUF loader un-permutes, ``TENSOR_PROCESSORS["llama"]`` in transformers 5.24
``modeling_gguf_pytorch_utils.py``). Qwen2/3, Gemma, Phi-3 and others are converted without the permutation and
use NEOX RoPE in llama.cpp: their GGUF order equals HF's, so ``applies_to`` leaves this transform out of their
chains (a llama.cpp preset then acts on them without it); an unknown model type (None) keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kveval import gguf
from kveval.gguf import gguf_permutation, to_gguf_order
from kveval.transforms.base import KVTransform, TransformContext
from kveval.transforms.registry import register


@register
@dataclass(frozen=True)
class GgufOrder(KVTransform):
    """Q and K in the channel order of a Llama GGUF file (see the module docstring); the cache stays in it."""

    name: ClassVar[str] = "gguf_order"

    @property
    def keeps_keys_transformed(self) -> bool:
        return True

    def applies_to(self, model_type: str | None) -> bool:
        return model_type is None or model_type in gguf.PERMUTED_MODEL_TYPES

    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return to_gguf_order(k)

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return to_gguf_order(q)


__all__ = ["GgufOrder", "gguf_permutation", "to_gguf_order"]
