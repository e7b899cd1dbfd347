"""Quantized weights beside a quantized KV cache: the weights feature (``model.weights`` in a config).

* ``quantize`` (pure maths): a weight matrix ``[out, in]`` as the quantizer core's ``[1, 1, out, in]``,
  ``fake_quantize_weight``, ``matrix_nbytes``;
* ``spec`` (data): ``WeightVariant`` (name, QuantSpec, module groups), ``GgufVariant`` (a GGUF file's own
  quantized tensors), the weight presets, the config forms;
  and the checks on a GGUF variant's file (what its header says: :mod:`kveval.gguf`);
* ``interaction`` (pure arithmetic): the KV effect, the weight effect, the combined effect and the excess of the
  combination over the sum of the two;
* ``apply`` (plumbing): which matrices of a loaded model a variant covers (a GGUF variant: the file's tensors,
  loaded through transformers' GGUF loader), and swapping them in and out.

``from kveval.weights import WeightVariant, fake_quantize_weight`` imports only the pure and data parts; the
plumbing is imported by name where a model is at hand (``from kveval.weights.apply import prepare``), so that a
config never loads it.
"""

from __future__ import annotations

from .interaction import WindowSums, interaction_fields
from .quantize import check_matrix, check_weight_spec, fake_quantize_weight, matrix_nbytes
from .spec import (
    DEFAULT_MODULES,
    MODULE_GROUPS,
    REFERENCE,
    WEIGHT_PRESETS,
    GgufVariant,
    WeightVariant,
    parse_variants,
    parse_weight_spec,
)

__all__ = ["DEFAULT_MODULES", "MODULE_GROUPS", "REFERENCE", "WEIGHT_PRESETS", "GgufVariant", "WeightVariant",
           "WindowSums", "check_matrix", "check_weight_spec", "fake_quantize_weight", "interaction_fields",
           "matrix_nbytes", "parse_variants", "parse_weight_spec"]
