"""Per-layer quantization error statistics, accumulated over forward passes (pure tensor maths)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class TensorErrorStats:
    """Running error statistics of a quantized tensor ``x̂`` against ``x`` (both ``[batch, kv_heads, T, head_dim]``).

    ``rel_mse = Σ(x - x̂)² / Σx²``; ``sqnr_db = -10·log10(rel_mse)`` (e.g. rel_mse 0.01 -> 20 dB);
    ``max_abs_err = max |x - x̂|``; outlier channels: the head_dim channels with the largest mean |x|, with their
    ratio to the median channel's mean |x|.
    """

    sum_sq_err: float = 0.0
    sum_sq: float = 0.0
    max_abs_err: float = 0.0
    channel_abs_sum: torch.Tensor | None = None
    count: int = 0
    top_k: int = 4
    _n_updates: int = field(default=0, repr=False)

    def update(self, x: torch.Tensor, x_hat: torch.Tensor) -> None:
        x64 = x.detach().to(torch.float64)
        err = x64 - x_hat.detach().to(torch.float64)
        self.sum_sq_err += float((err * err).sum())
        self.sum_sq += float((x64 * x64).sum())
        self.max_abs_err = max(self.max_abs_err, float(err.abs().max()) if err.numel() else 0.0)
        per_channel = x64.abs().sum(dim=(0, 1, 2)).cpu()
        self.channel_abs_sum = per_channel if self.channel_abs_sum is None else self.channel_abs_sum + per_channel
        self.count += x.shape[0] * x.shape[1] * x.shape[2]
        self._n_updates += 1

    def summary(self) -> dict:
        if self._n_updates == 0:
            return {}
        rel = self.sum_sq_err / self.sum_sq if self.sum_sq > 0 else 0.0
        mean_abs = self.channel_abs_sum / max(self.count, 1)
        median = float(mean_abs.median()) or 1e-30
        top = torch.topk(mean_abs, min(self.top_k, mean_abs.numel()))
        return {
            "rel_mse": rel,
            "sqnr_db": (-10.0 * math.log10(rel)) if rel > 0 else math.inf,
            "max_abs_err": self.max_abs_err,
            "outlier_channels": [int(i) for i in top.indices],
            "outlier_ratio": [float(v) / median for v in top.values],
        }
