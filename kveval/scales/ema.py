"""Moving-average min/max ranges: how llm-compressor calibrates static KV-cache scales by default (pure maths).

llm-compressor 0.14.0.1 (with compressed-tensors 0.19.0, the version it pins) observes each attention layer's
post-RoPE keys and values once per calibration batch (``modifiers/quantization/calibration.py``
``initialize_observer``: the observer of a ``kv_cache_scheme`` without ``observer`` is ``"minmax"``) and keeps a
moving average of the batch minima and maxima (``observers/min_max.py`` ``MinMaxObserver``, ``helpers.py`` ``lerp``):

    batch 1:      mn, mx = min(x_1), max(x_1)
    batch b > 1:  mn = (mn * (1 - c)) + (min(x_b) * c)      c = averaging_constant, 0.01 by default
                  mx = (mx * (1 - c)) + (max(x_b) * c)      (c = 1: the last batch alone)

in the tensors' own dtype (the model's: each product and sum rounds to it), the extremes taken per tensor or per
KV head (``_flatten_attention``: strategy ``tensor`` reduces everything, ``attn_head`` all but the heads). The
scale is then ``calculate_qparams`` (compressed-tensors ``quantization/utils/helpers.py`` L51-139): ``mn =
min(mn, 0)``, ``mx = max(mx, 0)``, ``amax = max(|mn|, |mx|)``, FP8 ``scale = amax / 448`` (``bit_range / 2``,
cast to amax's dtype), stored in the model's dtype; a zero scale becomes the dtype's eps.

:func:`ema_ranges` returns those ``mn`` / ``mx`` (as ``lo`` / ``hi``, clamped to include 0) and ``amax`` (as
``absmax``) for kveval's static granularities (``tensor``, ``head``, and ``channel``, which llm-compressor does not
offer for the KV cache), from the samples of each batch ``[tokens, kv_heads, head_dim]`` in batch order. The
ranges come back as float32 (exact for bf16, fp16 and float32 models); ``kveval.quant.qparams_from_range`` then
divides by 448 in float32, where llm-compressor divides in the model's dtype: the scales are equal for a float32
model and within half an ulp of the model's dtype otherwise (at most 2^-8 relative for bf16).

``kveval.calibration.calibrate`` collects the samples of this method with eager attention, as llm-compressor's
``calibration_forward_context`` does: the same kernels, the same keys and values (under SDPA a float32 model's
later layers differ in the last bits, and so do the scales, by a few ulps).

With one batch, or ``c = 1``, this is the last batch's absmax; with N batches the first batch keeps the weight
(1 - c)^(N - 1) and later ones less: not the global maximum (``static_minmax`` would be, which is kveval's
``absmax`` method). Worked (float32, c = 0.5): batch maxima 2 then 4 -> mx = 2 * 0.5 + 4 * 0.5 = 3.
"""

from __future__ import annotations

import torch

from kveval.scales.ranges import Ranges, group_values

DEFAULT_AVERAGING_CONSTANT = 0.01


def batch_minmax(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of one batch's samples ``x [N, H, D]`` per group: ``[]`` (tensor), ``[H]`` (head), ``[H, D]``
    (channel), in x's dtype."""
    v = group_values(x, granularity)
    return v.amin(-1), v.amax(-1)


def ema_ranges(batches: list[torch.Tensor], granularity: str, constant: float = DEFAULT_AVERAGING_CONSTANT,
               dtype: torch.dtype = torch.float32) -> Ranges:
    """llm-compressor's ``minmax`` observer over ``batches`` (each ``[N, H, D]``, in order), computed in ``dtype``
    (the model's), then ``calculate_qparams``' clamp to include 0 (module docstring); float32 Ranges."""
    if not batches:
        raise ValueError("no calibration batches")
    if not 0 < constant <= 1:
        raise ValueError(f"averaging_constant must be in (0, 1]; got {constant}")
    mn = mx = None
    for x in batches:
        bmn, bmx = batch_minmax(x.to(dtype), granularity)
        if mn is None or mx is None or constant == 1.0:
            mn, mx = bmn, bmx
        else:
            mn = (mn * (1.0 - constant)) + (bmn * constant)
            mx = (mx * (1.0 - constant)) + (bmx * constant)
    assert mn is not None and mx is not None
    lo = torch.minimum(mn, torch.zeros_like(mn))
    hi = torch.maximum(mx, torch.zeros_like(mx))
    absmax = torch.maximum(lo.abs(), hi.abs())
    return Ranges(absmax.float(), lo.float(), hi.float())
