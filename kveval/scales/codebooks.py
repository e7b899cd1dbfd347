"""KVQuant's calibration of 'nuq' (``kveval.quant.formats.nuq``): outlier thresholds and k-means codebooks.

Source: SqueezeAILab/KVQuant @57a2383, ``quant/kvquant/simquant_module_quantizer.py`` (``SimQuant.quantize``, run by
``quant/llama_simquant.py`` ``llama_calibration`` on every layer's ``k_proj`` / ``v_proj`` output, with
``--nuq --include_sparse --sparsity-threshold 0.99 --fisher DIR`` for nuq4-1%), and ``gradients/run-fisher.py``
(the Fisher information). For one layer and tensor, samples x [N, H, D] seen as rows [N, n], n = H * D, float32, and
an outlier fraction p (t = 1 - p / 2; p = 0: t = 1, the extremes):

1. bounds: ``np.percentile`` (linear) at 100 t and 100 (1 - t): per channel over the N tokens (keys,
   ``qchannel=0``: hi, lo [n]) or per token over the n channels (values: KVQuant calibrates them with
   ``qchannel=-1``; the per-token bounds only serve the fit, values take theirs at run time). `percentile` computes
   numpy's float32 result bit for bit.
2. normalise: s = (x - (hi + lo) / 2) / ((hi - lo) / 2) in float32; the outliers |s| > 1 are left out.
3. k-means of the remaining s (all tokens and channels of the layer together: one codebook per layer and tensor) into
   2^b clusters, each s weighted by its Fisher information (the squared gradient of the loss with respect to that
   K/V element) when given. KVQuant calls scikit-learn ``KMeans(n_clusters=2^b, random_state=0, n_init="auto",
   max_iter=50)`` (one k-means++ start, Lloyd iterations); `kmeans_1d` runs the same Lloyd iterations (at most 50,
   stopping when no assignment changes or the centres move by at most 1e-4 x the variance, scikit-learn's ``tol``)
   from four deterministic starts (the weighted (j + 1/2) / 2^b quantiles of s and three seeded k-means++ starts)
   and keeps the one with the least weighted squared error: both end at a fixed point of Lloyd's map (each centre
   the weighted mean of the points nearest to it), not necessarily the same one (a single start can stop in a
   poor one). Exact in 1-D: the points are sorted once, a cluster is a run of them, its sums come from prefix
   sums (float64).
4. stored: the centres, ascending, float32 [2^b]; for keys also hi and lo [H, D] (float32 here; a spec rounds them
   to its ``scale_dtype``: KVQuant's cache casts them to fp16).

The Fisher information (``kveval.calibration.collect``, ``collect_kv(model, fisher=True)``): each calibration window
runs forward and backward from its mean next-token cross-entropy, and the squared gradient with respect to every
K/V element is kept (pre-RoPE keys: through the transposed rotation), as ``run-fisher.py`` does on ``k_proj`` /
``v_proj`` (``model(input_ids=x, labels=x).loss``, bf16, 16 x 2048 tokens; kveval: the model's dtype, the
calibration slice). ``calibrate(..., fisher=False)`` fits plain k-means. Only the 'nuq' specs of the config's
policies are fitted (``kveval.calibration.calibrate.nuq_requests``).

Tensors of the scales file (``kveval.scales.file``), per layer: ``kvquant.{kind}[@p].channel.hi`` /
``.lo`` [layers, H, D] and ``kvquant.{kind}[@p].{channel|token}.nuq{b}`` [layers, 2^b], kind ``key``,
``key_pre_rope`` (KVQuant's keys: ``k_proj`` comes before RoPE) or ``value``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kveval.quant.formats.nuq import NUQ_BITS, quantile_levels

#: KVQuant's k-means settings (scikit-learn ``KMeans`` with ``max_iter=50`` and its default ``tol``)
MAX_ITER = 50
TOL = 1e-4
#: Lloyd runs per codebook: one from quantiles, the others from k-means++ starts; the least squared error wins
STARTS = 4
#: k-means++ starts are drawn from at most about this many of the sorted values (an evenly strided subset)
SEED_POINTS = 16384
STYLES = ("channel", "token")


def base_name(kind: str, p: float) -> str:
    """``kvquant.{kind}`` or ``kvquant.{kind}@{p}`` (p > 0) : the prefix of a layer's nuq tensors."""
    return f"kvquant.{kind}@{p:g}" if p else f"kvquant.{kind}"


def codebook_name(kind: str, p: float, style: str, bits: int) -> str:
    return f"{base_name(kind, p)}.{style}.nuq{bits}"


def bounds_names(kind: str, p: float) -> tuple[str, str]:
    """(hi, lo) tensor names of the per-channel bounds."""
    base = base_name(kind, p)
    return f"{base}.channel.hi", f"{base}.channel.lo"


def percentile(srt: torch.Tensor, pct: float) -> torch.Tensor:
    """``np.percentile(v, pct, axis=-1)`` (method linear) of float32 rows v given sorted along the last dim, bit for
    bit: index i = (n - 1) (pct / 100) in float64, a = v[floor i], b = v[floor i + 1], g = i - floor i; in float32
    a + (b - a) g, or b - (b - a) (1 - g) when g >= 0.5 (numpy's ``_lerp``, a Python-float weight). [..., n] -> [...].
    Worked: v = [0, 1, 2, 3], pct 50 -> i = 1.5 -> 2 - 1 * 0.5 = 1.5."""
    n = srt.shape[-1]
    index = (n - 1) * (pct / 100)
    if index >= n - 1:
        return srt[..., -1].clone()
    lo = math.floor(index)
    g = index - lo
    a, b = srt[..., lo], srt[..., lo + 1]
    diff = b - a
    if g >= 0.5:
        return b - diff * torch.tensor(1 - g, dtype=srt.dtype)
    return a + diff * torch.tensor(g, dtype=srt.dtype)


def bounds(rows: torch.Tensor, p: float, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """KVQuant's calibration bounds (hi, lo) of rows [N, n] float32: per channel [n] or per token [N] (step 1)."""
    q_lo, q_hi = quantile_levels(p) if p else (0.0, 1.0)
    v = rows.t() if style == "channel" else rows
    srt = v.sort(dim=-1).values
    return percentile(srt, q_hi * 100), percentile(srt, q_lo * 100)


def normalised(rows: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, style: str) -> torch.Tensor:
    """s = (x - (hi + lo) / 2) / ((hi - lo) / 2) in float32 (step 2); a zero range divides by 1."""
    if style == "token":
        hi, lo = hi[:, None], lo[:, None]
    r = (hi - lo) / 2
    return (rows - (hi + lo) / 2) / torch.where(r == 0, 1.0, r)


def _kmeanspp(v: torch.Tensor, w: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """scikit-learn's greedy k-means++ start (``_kmeans_plusplus``) on 1-D float64 values: the first centre drawn
    with probability w, each next one the best (lowest weighted potential) of 2 + floor(ln k) draws with probability
    w * D^2, from ``torch.Generator().manual_seed(seed)``. [k], unsorted."""
    gen = torch.Generator().manual_seed(seed)
    trials = 2 + int(math.log(k))
    centres = [v[torch.multinomial(w / w.sum(), 1, generator=gen)]]
    d2 = (v - centres[0]) ** 2
    for _ in range(1, k):
        p = w * d2
        if float(p.sum()) <= 0:  # fewer distinct values than centres: repeat one
            centres.append(centres[-1])
            continue
        cand = v[torch.multinomial(p / p.sum(), trials, replacement=True, generator=gen)]
        d2c = torch.minimum(d2[None], (v[None] - cand[:, None]) ** 2)
        best = int((w * d2c).sum(1).argmin())
        centres.append(cand[best:best + 1])
        d2 = d2c[best]
    return torch.cat(centres)


def _lloyd(v: torch.Tensor, cw: torch.Tensor, cwx: torch.Tensor, centres: torch.Tensor, max_iter: int,
           limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd iterations on sorted values v with weight / weighted-value prefix sums: (centres, cluster cuts of the
    final assignment; cluster j is v[cuts[j]:cuts[j + 1]])."""

    def assign(c: torch.Tensor) -> torch.Tensor:
        ends = torch.searchsorted(v, (c[:-1] + c[1:]) / 2, right=True)
        return torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), v.numel())])

    centres = centres.sort().values
    previous = None
    for _ in range(max_iter):
        cuts = assign(centres)
        if previous is not None and torch.equal(cuts, previous):
            break
        previous = cuts
        mass = cw[cuts[1:]] - cw[cuts[:-1]]
        moved = torch.where(mass > 0, (cwx[cuts[1:]] - cwx[cuts[:-1]]) / torch.where(mass > 0, mass, 1.0), centres)
        shift = float(((moved - centres) ** 2).sum())
        centres = moved
        if shift <= limit:
            break
    return centres, assign(centres)


def kmeans_1d(values: torch.Tensor, k: int, weights: torch.Tensor | None = None, max_iter: int = MAX_ITER,
              tol: float = TOL, starts: int = STARTS) -> torch.Tensor:
    """Weighted Lloyd k-means of 1-D ``values`` into ``k`` centres (step 3), float32 [k], ascending.

    Lloyd's iterations: assign each value to its nearest centre (a value halfway between two goes to the lower
    one), move each centre to the weighted mean of its values (an empty cluster keeps its centre); stop after
    ``max_iter`` iterations, when no assignment changes, or when the squared centre shifts sum to at most ``tol`` x
    the (unweighted) variance of the values (scikit-learn's rule). They run from the weighted (j + 1/2) / k
    quantiles and from ``starts - 1`` greedy k-means++ starts (seeds 0, 1, ..., drawn from an evenly strided subset
    of about ``SEED_POINTS`` sorted values; KVQuant runs one, scikit-learn's, ``random_state=0``); the result with the
    least weighted squared error over all values is kept. Worked: values [0, 1, 9, 10],
    k = 2 -> [0.5, 9.5], a fixed point.
    """
    if values.numel() == 0:
        raise ValueError("k-means needs at least one value")
    v, order = values.double().flatten().sort()
    w = torch.ones_like(v) if weights is None else weights.double().flatten()[order]
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()) or not bool(torch.isfinite(v).all()):
        raise ValueError("k-means needs finite values and finite non-negative weights")
    if float(w.sum()) <= 0:
        w = torch.ones_like(v)
    zero = v.new_zeros(1)
    cw, cwx = torch.cat([zero, w.cumsum(0)]), torch.cat([zero, (w * v).cumsum(0)])
    limit = tol * float(v.var(unbiased=False)) if v.numel() > 1 else 0.0
    at = torch.searchsorted(cw[1:], cw[-1] * (torch.arange(k, dtype=torch.float64) + 0.5) / k)
    step = max(1, v.numel() // SEED_POINTS)  # k-means++ draws from every step-th sorted value (cost, not result)
    inits = [v[at.clamp_(max=v.numel() - 1)]] + [_kmeanspp(v[::step], w[::step], k, seed) for seed in range(starts - 1)]
    best, best_err = None, math.inf
    for init in inits:
        centres, cuts = _lloyd(v, cw, cwx, init, max_iter, limit)
        cell = torch.repeat_interleave(torch.arange(k), cuts[1:] - cuts[:-1])
        err = float((w * (v - centres[cell]) ** 2).sum())
        if err < best_err:
            best, best_err = centres, err
    assert best is not None
    return best.to(torch.float32).sort().values


def fit_layer(x: torch.Tensor, p: float, style: str, bits: Iterable[int],
              fisher: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One layer's nuq parameters from samples x [N, H, D] (and Fisher weights of x's shape): ``{"hi", "lo"}``
    [H, D] for style channel, and ``nuq{b}`` [2^b] for each b in ``bits`` (steps 1-4)."""
    N, H, D = x.shape
    rows = x.reshape(N, H * D).float()
    hi, lo = bounds(rows, p, style)
    s = normalised(rows, hi, lo, style)
    keep = (s <= 1) & (s >= -1)
    w = None if fisher is None else fisher.reshape(N, H * D)[keep]
    inliers = s[keep]
    out: dict[str, torch.Tensor] = {}
    if style == "channel":
        out["hi"], out["lo"] = hi.reshape(H, D), lo.reshape(H, D)
    for b in bits:
        if b not in NUQ_BITS:
            raise ValueError(f"nuq bits must be one of {NUQ_BITS}; got {b}")
        out[f"nuq{b}"] = kmeans_1d(inliers if inliers.numel() else s.flatten(), 2**b, w if inliers.numel() else None)
    return out
