"""Pure metric maths: per-token losses and divergences, binning, bootstrap confidence intervals."""

from __future__ import annotations

import math

import numpy as np
import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per position. logits ``[n, vocab]``, targets ``[n]`` -> ``[n]`` (float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets[:, None]).squeeze(-1)


def compare_logits(base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position metrics of ``logits`` against the baseline's: all ``[n]`` float64 tensors.

    ``nll``: -log p(target); ``kld``: KL(P_base || P) = Σ_v p_base(v) (log p_base(v) - log p(v));
    ``agree``: 1.0 where the argmax tokens agree. Inputs ``[n, vocab]``, targets ``[n]``.
    """
    base_logp = torch.log_softmax(base_logits.double(), dim=-1)
    logp = torch.log_softmax(logits.double(), dim=-1)
    kld = (base_logp.exp() * (base_logp - logp)).sum(-1).clamp(min=0.0)
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)
    agree = (base_logits.argmax(-1) == logits.argmax(-1)).double()
    return {"nll": nll, "kld": kld, "agree": agree}


def bin_sums(values: torch.Tensor, positions: torch.Tensor, n_bins: int, length: int) -> tuple[list[float], list[int]]:
    """Sum of ``values`` and count per position bin; bins split ``[0, length)`` into ``n_bins`` equal ranges."""
    bins = (positions * n_bins // length).clamp(max=n_bins - 1)
    sums = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, values.double().cpu())
    counts = torch.bincount(bins, minlength=n_bins)
    return sums.tolist(), counts.tolist()


def bootstrap_ratio_ci(numerators, denominators, *, n_resamples: int = 1000, seed: int = 0, level: float = 0.95):
    """A percentile bootstrap CI of ``Σ numerators / Σ denominators``, resampling the units (windows).

    With a single unit (or ``n_resamples == 0``) the interval collapses to the point estimate.
    """
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    point = float(num.sum() / den.sum()) if den.sum() > 0 else math.nan
    if len(num) < 2 or n_resamples == 0:
        return [point, point]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_resamples, len(num)))
    ratios = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)
    alpha = (1 - level) / 2
    return [float(np.quantile(ratios, alpha)), float(np.quantile(ratios, 1 - alpha))]
