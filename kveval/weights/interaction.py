"""Weights x KV cache: is the damage of both together worse than the sum of the two alone? (pure arithmetic)

Four models are scored on the same windows: the reference R (the checkpoint's weights, full-precision cache), K (the
checkpoint's weights, quantized cache: the KV effect), W (quantized weights, full-precision cache: the weight
effect) and C (quantized weights and quantized cache: the combined effect). Each effect is measured against R:

* ``delta_ppl_pct(X) = 100 * (PPL_X / PPL_R - 1)``, ``PPL_X = exp(sum NLL_X / tokens)``;
* ``kld(X) = sum KL(P_R || P_X) / tokens`` (mean per token, nats).

The interaction is the combined effect less the sum of the two single effects::

    kld_excess         = kld(C) - (kld(K) + kld(W))
    delta_ppl_pct_excess = delta_ppl_pct(C) - (delta_ppl_pct(K) + delta_ppl_pct(W))

and the combination is "worse than the sum" when the excess is positive. Additivity is the natural null for the
KLD: for small independent logit perturbations a and b, KL(a + b) ~ KL(a) + KL(b) + a cross term whose mean is
zero. Each excess gets a 95% percentile bootstrap interval over windows (the four models resampled together, the
same windows for all), and a word: ``superadditive`` when the interval lies above 0, ``subadditive`` below 0,
``additive`` when it contains 0.

Worked: tokens [10, 10]; NLL sums R [10, 10], K [11, 10], W [10, 12], C [12, 13]; KLD sums K [0.1, 0.1],
W [0.2, 0.2], C [0.5, 0.5]: kld K 0.01, W 0.02, C 0.05 -> excess 0.02; PPL_R = e^1, PPL_K = e^1.05,
PPL_W = e^1.1, PPL_C = e^1.25 -> ΔPPL % 5.127, 10.517, 28.403 -> excess 12.758.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowSums:
    """Per-window sums of one model's scores, aligned by window: ``tokens`` scored, ``nll`` (sum of -log p of the
    targets) and ``kld`` (sum of KL(P_R || P_X); zeros for the reference itself)."""

    tokens: Sequence[float]
    nll: Sequence[float]
    kld: Sequence[float]


def _ppl(nll: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.exp(nll / tokens)


def _effects(ref: np.ndarray, kv: np.ndarray, w: np.ndarray, comb: np.ndarray, kld: np.ndarray,
             tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ΔPPL % excess, KLD excess) from sums over windows (the last axis): ``ref`` etc. are NLL sums, ``kld``
    stacks the KLD sums of K, W, C on the first axis."""
    base = _ppl(ref, tokens)
    d = [100.0 * (_ppl(x, tokens) / base - 1.0) for x in (kv, w, comb)]
    k = kld / tokens
    return d[2] - (d[0] + d[1]), k[2] - (k[0] + k[1])


def _word(ci: list[float]) -> str:
    lo, hi = ci
    return "superadditive" if lo > 0 else "subadditive" if hi < 0 else "additive"


def interaction_fields(reference: WindowSums, kv: WindowSums, weights: WindowSums, combined: WindowSums, *,
                       n_resamples: int = 1000, seed: int = 0) -> dict:
    """The interaction columns of one (weight variant, KV policy) pair (see the module docstring):

    ``kv_delta_ppl_pct``, ``kv_kld_mean`` (K), ``weights_delta_ppl_pct``, ``weights_kld_mean`` (W),
    ``delta_ppl_pct_sum``, ``kld_sum`` (K + W), ``delta_ppl_pct_excess``, ``kld_excess`` (C - (K + W)),
    ``delta_ppl_pct_excess_ci95``, ``kld_excess_ci95`` ([lo, hi]; the point twice with one window or
    ``n_resamples`` 0), ``delta_ppl_interaction``, ``kld_interaction`` (the words), ``delta_ppl_worse_than_sum``,
    ``kld_worse_than_sum`` (excess > 0). The four series must hold the same windows with the same token counts.
    """
    tokens = np.asarray(reference.tokens, dtype=np.float64)
    for name, s in (("kv", kv), ("weights", weights), ("combined", combined)):
        if len(s.tokens) != len(tokens) or not np.array_equal(np.asarray(s.tokens, dtype=np.float64), tokens):
            raise ValueError(f"interaction: the {name} scores cover other windows than the reference's")
    if not len(tokens) or tokens.sum() <= 0:
        raise ValueError("interaction: no scored tokens")
    nll = {k: np.asarray(s.nll, dtype=np.float64) for k, s in
           (("ref", reference), ("kv", kv), ("w", weights), ("comb", combined))}
    kld = np.stack([np.asarray(s.kld, dtype=np.float64) for s in (kv, weights, combined)])
    n = tokens.sum()
    base = math.exp(nll["ref"].sum() / n)

    def dppl(x: np.ndarray) -> float:
        return 100.0 * (math.exp(x.sum() / n) / base - 1.0)

    k_kv, k_w, k_c = (float(v) for v in kld.sum(axis=1) / n)
    d_kv, d_w, d_c = dppl(nll["kv"]), dppl(nll["w"]), dppl(nll["comb"])
    d_excess, k_excess = d_c - (d_kv + d_w), k_c - (k_kv + k_w)
    if len(tokens) < 2 or n_resamples == 0:
        d_ci, k_ci = [d_excess, d_excess], [k_excess, k_excess]
    else:
        idx = np.random.default_rng(seed).integers(0, len(tokens), size=(n_resamples, len(tokens)))
        d_b, k_b = _effects(nll["ref"][idx].sum(1), nll["kv"][idx].sum(1), nll["w"][idx].sum(1),
                            nll["comb"][idx].sum(1), kld[:, idx].sum(2), tokens[idx].sum(1))
        d_ci = [float(np.quantile(d_b, 0.025)), float(np.quantile(d_b, 0.975))]
        k_ci = [float(np.quantile(k_b, 0.025)), float(np.quantile(k_b, 0.975))]
    return {
        "kv_delta_ppl_pct": d_kv, "kv_kld_mean": k_kv,
        "weights_delta_ppl_pct": d_w, "weights_kld_mean": k_w,
        "delta_ppl_pct_sum": d_kv + d_w, "kld_sum": k_kv + k_w,
        "delta_ppl_pct_excess": d_excess, "kld_excess": k_excess,
        "delta_ppl_pct_excess_ci95": d_ci, "kld_excess_ci95": k_ci,
        "delta_ppl_interaction": _word(d_ci), "kld_interaction": _word(k_ci),
        "delta_ppl_worse_than_sum": bool(d_excess > 0), "kld_worse_than_sum": bool(k_excess > 0),
    }


__all__ = ["WindowSums", "interaction_fields"]
