"""A reference of llm-compressor's KV-cache calibration written from its source, independent of kveval's code, for
tests/test_llmcompressor_parity.py (where llm-compressor itself cannot run).

Written from llmcompressor 0.14.0.1 (PyPI wheel; the same code as 0.14.0):
``observers/min_max.py`` (``MinMaxObserver.update_statistics_from_observed``, ``_get_min_max``),
``observers/helpers.py`` (``_flatten_attention``, ``lerp``), ``observers/base.py`` (``Observer.forward`` ->
``get_qparams``), ``modifiers/quantization/calibration.py`` (``initialize_observer``: ``"minmax"`` for a
``kv_cache_scheme`` without ``observer``, ``averaging_constant`` 0.01), and compressed-tensors 0.19.0
``quantization/utils/helpers.py`` ``calculate_qparams`` (L51-139). The states are llm-compressor's
``(batch, kv_heads, seq, head_dim)`` keys or values of one layer, one call per calibration batch.
"""

from __future__ import annotations

import torch


def flatten_attention(value: torch.Tensor, strategy: str) -> torch.Tensor:
    """``_flatten_attention``: tensor -> ``(B*S, 1, H*D)``; attn_head -> ``(B*S, H, 1, 1, D)``."""
    if strategy == "tensor":
        return value.transpose(1, 2).flatten(0, 1).flatten(-2, -1).unsqueeze(-2)
    if strategy == "attn_head":
        return value.transpose(1, 2).flatten(0, 1).unsqueeze(-2).unsqueeze(-2)
    raise ValueError(strategy)


def lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    return (start * (1.0 - weight)) + (end * weight)


class MinMaxObserver:
    """``MinMaxObserver`` (``"minmax"``): moving average of the batch minima and maxima."""

    def __init__(self, strategy: str, averaging_constant: float = 0.01):
        self.strategy, self.avg_constant = strategy, averaging_constant
        self.min_vals = self.max_vals = None

    def __call__(self, observed: torch.Tensor) -> None:
        flat = flatten_attention(observed, self.strategy)
        min_vals, max_vals = torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))
        if self.min_vals is not None and self.avg_constant != 1.0:
            min_vals = lerp(self.min_vals, min_vals, self.avg_constant)
            max_vals = lerp(self.max_vals, max_vals, self.avg_constant)
        self.min_vals, self.max_vals = min_vals, max_vals

    def scale(self) -> torch.Tensor:
        """``calculate_qparams`` for FP8 E4M3 (num_bits 8, type float, symmetric): shape (1,) or (H, 1, 1)."""
        assert self.min_vals is not None and self.max_vals is not None
        mn = torch.min(self.min_vals, torch.zeros_like(self.min_vals))
        mx = torch.max(self.max_vals, torch.zeros_like(self.max_vals))
        bit_range = torch.tensor(448.0) - torch.tensor(-448.0)  # float8_e4m3fn's max - min
        max_val_pos = torch.max(torch.abs(mn), torch.abs(mx))
        scales = max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)
        eps = torch.finfo(scales.dtype).eps
        scales = torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype), scales)
        return scales.reshape(1) if scales.ndim == 0 else scales
