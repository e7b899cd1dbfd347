"""Fake quantization of weight matrices with kveval's quantizer core: pure maths (torch and ``kveval.quant`` only).

The layout. ``kveval.quant`` quantizes K/V tensors ``x [B, H, T, D]`` and takes its statistics along the last
dimension D (token, group) or over everything (tensor). A weight matrix ``W [out_features, in_features]``
(``torch.nn.Linear.weight``; an ``nn.Embedding`` table ``[num_embeddings, embedding_dim]`` alike) is viewed as::

    x = W.reshape(1, 1, out_features, in_features)      # B = 1, H = 1, T = out_features, D = in_features

one "token" row per output channel, so that a QuantSpec means for weights:

* ``granularity: token`` -> one scale (and zero point) per output channel, over all of its in_features inputs
  (round-to-nearest "per-channel" weights; the preset ``int8_channel``);
* ``granularity: group, group_size: g`` -> one scale per output channel and per g consecutive inputs ("int4 g128":
  groups along the input dimension, as GPTQ/AWQ checkpoints store them); g must divide in_features;
* ``granularity: tensor`` -> one scale for the whole matrix;
* ggml block types (``q4_0``, ``q8_0``, ``q4_1``...) -> blocks of 32 consecutive inputs of each row: exactly the
  blocks llama.cpp quantizes a weight row into (a GGUF tensor's ``ne0`` is in_features);
* ``channel`` (per element of D over blocks of T) and ``head`` are K/V notions and are refused.

The quantized matrix is ``fake_quantize(x, spec).reshape(out_features, in_features)``: no rounding code lives here,
so weights get the numbers of ``kveval.quant`` bit for bit (scales rounded to their storage dtype before use, round
half to even, zero scales dividing by 1). The bytes of a stored matrix are ``packed_nbytes(spec, [1, 1, out, in])``
(codes packed along in_features, plus scales and zero points).
"""

from __future__ import annotations

import torch

from kveval.quant import QuantSpec, fake_quantize, packed_nbytes

#: The QuantSpec granularities that mean something for a weight matrix viewed as [1, 1, out, in].
WEIGHT_GRANULARITIES = ("token", "group", "tensor")


def check_weight_spec(spec: QuantSpec) -> None:
    """Raise ValueError (one line) for a spec that cannot quantize weight rows: the K/V-only granularities
    ``channel`` (per element of head_dim over token blocks) and ``head`` (one scale per KV head)."""
    if not spec.is_none and spec.granularity not in WEIGHT_GRANULARITIES:
        raise ValueError(f"granularity {spec.granularity!r} is a K/V-cache granularity; weights take 'token' (one "
                         "scale per output channel), 'group' (groups along the input dimension) or 'tensor'")


def check_matrix(spec: QuantSpec, in_features: int) -> None:
    """Raise ValueError (one line, in the weights' words) unless ``spec`` can quantize rows of ``in_features``
    inputs: a group size that divides it, a block format whose blocks tile it. Worked: int4 g128 on a
    576-wide projection -> 'group_size 128 does not divide in_features 576'."""
    check_weight_spec(spec)
    if spec.is_none:
        return
    if spec.granularity == "group" and spec.group_size and in_features % spec.group_size:
        raise ValueError(f"group_size {spec.group_size} does not divide in_features {in_features}")
    try:
        spec.check_head_dim(in_features)
    except ValueError as exc:  # the quantizer core speaks of K/V rows: D = in_features here
        raise ValueError(str(exc).replace("head_dim", "in_features")) from None


def as_rows(weight: torch.Tensor) -> torch.Tensor:
    """``W [out, in]`` as the quantizer core's ``x [1, 1, out, in]`` (a view, no copy)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a weight matrix [out_features, in_features]; got shape {tuple(weight.shape)}")
    return weight.reshape(1, 1, *weight.shape)


def fake_quantize_weight(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Ŵ ``[out, in]``: ``W [out, in]`` quantized and dequantized by ``spec`` in the layout of the module docstring,
    in W's dtype (arithmetic in float32, float64 for a float64 W, as ``fake_quantize``). ``none`` returns W itself.

    Worked (int4 symmetric per output channel, fp16 scales): rows ``[7, -3.4, 2.5, 0.2]`` and ``[14, 3, -5, 1]``
    have absmax 7 and 14 -> scales 1 and 2 -> codes ``[7, -3, 2, 0]`` and ``[7, 2, -2, 0]`` (half to even) ->
    Ŵ rows ``[7, -3, 2, 0]`` and ``[14, 4, -4, 0]``.
    """
    if spec.is_none:
        return weight
    check_matrix(spec, weight.shape[-1] if weight.dim() == 2 else 0)
    return fake_quantize(as_rows(weight), spec).reshape(weight.shape)


def matrix_nbytes(spec: QuantSpec, out_features: int, in_features: int,
                  dtype: torch.dtype = torch.float16) -> dict[str, int]:
    """Bytes of one stored matrix ``[out, in]`` under ``spec``: ``{"codes", "scales", "total"}`` (scales include
    zero points and outliers), from ``packed_nbytes(spec, [1, 1, out, in])``; ``dtype``: the serving dtype (the
    element size of a ``none`` spec and of a ``model`` scale dtype; FP16 by default). Worked: int4 g64 asymmetric
    (fp16 scale + min), 576 x 576: codes 576 * 288 B = 165,888; scales 576 * 9 groups * 4 B = 20,736."""
    nb = packed_nbytes(spec, (1, 1, out_features, in_features), dtype=dtype)
    return {"codes": nb["codes"], "scales": nb["scales"] + nb["outliers"], "total": nb["total"]}


__all__ = ["WEIGHT_GRANULARITIES", "as_rows", "check_matrix", "check_weight_spec", "fake_quantize_weight",
           "matrix_nbytes"]
