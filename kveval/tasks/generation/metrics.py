"""The generation task's metric maths, pure (numpy and the standard library; no model, no torch).

* :func:`pass_at_k`: the unbiased pass@k of Chen et al. 2021 from n samples with c correct.
* :func:`survival`: the Kaplan-Meier curve of "the policy's greedy output is still identical to the FP model's"
  over decode steps, with its median and a 95% confidence interval of the median.
* :func:`repeated_ngram_share`: degenerate decoding (loops) as the share of n-grams seen earlier in the output.
* :func:`token_similarity`: 1 - normalised Levenshtein distance of two token sequences.
* :func:`binned_curve`: a per-step value (KLD along the trajectory) averaged in decode-step bins, with its slope.
* :func:`accuracy_mde` / :func:`prompts_to_decide`: the accuracy drop a run of n prompts can detect, and the
  prompts a given drop needs.

Steps are 0-based decode steps: step t is the t-th generated token.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

#: the longest sequence :func:`token_similarity` compares (the task's ``MAX_NEW_TOKENS``)
MAX_SIMILARITY_TOKENS = 32768


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    eq. 1): the probability that at least one of k samples drawn without replacement from n samples, c of them
    correct, is correct: ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no large
    binomials); 1.0 when ``n - c < k``. ValueError when a count is negative, ``c > n`` or ``k > n``."""
    if n < 0 or c < 0 or k < 0:
        raise ValueError(f"pass_at_k needs non-negative counts, got n={n}, c={c}, k={k}")
    if c > n or k > n:
        raise ValueError(f"pass_at_k needs c <= n and k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def survival(first_diff: list[int | None], horizons: list[int], level: float = 0.95) -> dict:
    """The Kaplan-Meier survival curve of "still identical to the FP output", over decode steps.

    ``first_diff[i]``: the step (0-based) of prompt i's first token that differs from the FP model's, or None when
    none differs within ``horizons[i]`` generated tokens (the shorter of the two outputs): prompt i is then
    censored, known identical at steps ``0 .. horizons[i] - 1`` only. Convention: a divergence at step t means the
    prompt survives the steps before t and not step t, so ``S(t) = P(first_diff > t)``, the probability that
    tokens ``0..t`` are all identical. A prompt is at risk at step t when it has not diverged before t and (if
    censored) ``t < horizon``; a censored horizon of 0 contributes nothing. ``first_diff[i]`` is not checked
    against ``horizons[i]`` (a policy's output may end, EOS, where the FP one goes on: the caller decides what that
    is).

    Returns ``{"steps": [t, ...]`` the steps with a divergence, ascending (S(t) = 1 before the first, constant
    between them), ``"survival": [S(t), ...]`` (after that step's divergences), ``"at_risk": [n_t, ...]``,
    ``"median"``: the first step with ``S(t) <= 0.5`` (None if never), ``"median_ci95": [lo, hi]``,
    ``"n"``: prompts, ``"diverged"``: prompts with a divergence, ``"end"``: the last step observed (None for
    none)}``.

    The median's interval is Brookmeyer and Crowley's construction with the log-log transform (as R's
    ``survfit(conf.type = "log-log")`` reports it): the pointwise ``level`` band of S(t) with Greenwood's
    variance, ``S(t) ** exp(∓z · sqrt(Σ d/(n(n-d))) / |log S(t)|)``, and ``lo`` / ``hi`` the first step where the
    band's lower / upper curve is <= 0.5; None where a curve never falls that low (``hi`` is None when too few
    prompts diverge to bound the median from above)."""
    if len(first_diff) != len(horizons):
        raise ValueError(f"survival needs one horizon per prompt, got {len(first_diff)} and {len(horizons)}")
    for d, h in zip(first_diff, horizons):
        if (d is not None and d < 0) or h < 0:
            raise ValueError(f"survival needs steps and horizons >= 0, got first_diff={d}, horizon={h}")
    events = np.array([d for d in first_diff if d is not None], dtype=np.int64)
    censored = np.array([h for d, h in zip(first_diff, horizons) if d is None], dtype=np.int64)
    steps = np.unique(events)
    at_risk = np.array([int((events >= t).sum() + (censored > t).sum()) for t in steps], dtype=np.int64)
    deaths = np.array([int((events == t).sum()) for t in steps], dtype=np.int64)
    curve = np.cumprod(1.0 - deaths / np.maximum(at_risk, 1)) if len(steps) else np.zeros(0)
    lower, upper = _loglog_band(curve, at_risk, deaths, level)
    observed = [int(t) for t in events] + [int(h) - 1 for h in censored if h > 0]
    return {
        "steps": steps.tolist(),
        "survival": curve.tolist(),
        "at_risk": at_risk.tolist(),
        "median": _first_at_or_below(steps, curve, 0.5),
        "median_ci95": [_first_at_or_below(steps, lower, 0.5), _first_at_or_below(steps, upper, 0.5)],
        "n": len(first_diff),
        "diverged": int(len(events)),
        "end": max(observed) if observed else None,
    }


def _loglog_band(curve: np.ndarray, at_risk: np.ndarray, deaths: np.ndarray, level: float):
    """The pointwise ``level`` band of a Kaplan-Meier curve on the log-log scale, Greenwood's variance:
    ``(lower, upper)`` arrays like ``curve``; where S = 0 the band is [0, 0]."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(at_risk > deaths, deaths / (at_risk * (at_risk - deaths)), np.inf)
        greenwood = np.cumsum(terms)
        log_s = np.log(curve)
        se = np.sqrt(greenwood) / np.abs(log_s)
        lower = np.where(curve > 0, curve ** np.exp(z * se), 0.0)  # S < 1: a larger power is a smaller value
        upper = np.where(curve > 0, curve ** np.exp(-z * se), 0.0)
    lower = np.where(curve >= 1.0, 1.0, np.nan_to_num(lower, nan=0.0))
    upper = np.where(curve >= 1.0, 1.0, np.nan_to_num(upper, nan=1.0))
    return lower, upper


def _first_at_or_below(steps: np.ndarray, values: np.ndarray, threshold: float) -> float | None:
    """The first step whose value is <= threshold (float), None if none."""
    hits = np.flatnonzero(values <= threshold + 1e-12)
    return float(steps[hits[0]]) if len(hits) else None


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """The share of a sequence's n-grams (all ``len - n + 1`` of them, overlapping) that already occurred at an
    earlier position of the same sequence: 0 for a sequence without repetition, ``(len - n) / (len - n + 1)`` for
    one token repeated; 0.0 for sequences shorter than ``n + 1`` tokens. ValueError for ``n < 1``."""
    if n < 1:
        raise ValueError(f"repeated_ngram_share needs n >= 1, got {n}")
    if len(tokens) < n + 1:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / (len(tokens) - n + 1)


def token_similarity(a: list[int], b: list[int]) -> float:
    """``1 - Levenshtein(a, b) / max(len(a), len(b))`` in [0, 1] (unit costs for insertion, deletion and
    substitution; 1.0 for two empty lists). The common prefix and suffix are dropped first (a policy's output
    often shares a long prefix with the FP one), then a two-row dynamic programme, one numpy pass per token of
    the shorter rest: O(len(a) · len(b)) time (1.5 s for two unrelated 8,192-token sequences on one busy core),
    O(len) memory. ValueError for a sequence longer than :data:`MAX_SIMILARITY_TOKENS`."""
    longest = max(len(a), len(b))
    if longest > MAX_SIMILARITY_TOKENS:
        raise ValueError(f"token_similarity compares at most {MAX_SIMILARITY_TOKENS} tokens, got {longest}")
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(a, b) / longest


def levenshtein(a: list[int], b: list[int]) -> int:
    """The edit distance of two token sequences (unit costs), as :func:`token_similarity` computes it."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    prefix = _common_prefix(x, y)
    x, y = x[prefix:], y[prefix:]
    suffix = _common_prefix(x[::-1], y[::-1])
    x, y = x[: len(x) - suffix], y[: len(y) - suffix]
    if len(x) > len(y):
        x, y = y, x
    if len(x) == 0:
        return int(len(y))
    ramp = np.arange(len(y) + 1, dtype=np.int64)
    previous = ramp.copy()
    current = np.empty_like(previous)
    for i, token in enumerate(x, start=1):
        current[0] = i
        np.minimum(previous[:-1] + (y != token), previous[1:] + 1, out=current[1:])
        # insertions: current[j] = min over k <= j of current[k] + (j - k)
        current = np.minimum.accumulate(current - ramp) + ramp
        previous, current = current, previous
    return int(previous[-1])


def _common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    m = min(len(x), len(y))
    differ = np.flatnonzero(x[:m] != y[:m])
    return int(differ[0]) if len(differ) else m


def binned_curve(per_step: list[list[float]], bins: int, horizon: int) -> dict:
    """A per-step value along the trajectory (the KLD at decode step 0, 1, ...), one list per prompt, averaged in
    ``bins`` equal-width step bins over ``[0, horizon)``: step t falls in bin ``min(t · bins // horizon, bins -
    1)`` (as ``kveval.stats.bin_sums``); steps >= horizon and None values are left out.

    Returns ``{"edges": [bins + 1 step boundaries, 0 .. horizon], "mean": [the mean of every (prompt, step) value
    in the bin, or None for an empty bin], "count": [values per bin], "slope": the least-squares slope of value
    against step over every value kept (not the bin means), per 1,000 steps (value units per 1,000 tokens; None
    with fewer than 2 distinct steps)}``. ValueError for ``bins < 1``, ``horizon < 1`` or a non-finite value."""
    if bins < 1 or horizon < 1:
        raise ValueError(f"binned_curve needs bins >= 1 and horizon >= 1, got bins={bins}, horizon={horizon}")
    steps_kept: list[np.ndarray] = []
    values_kept: list[np.ndarray] = []
    for prompt_values in per_step:
        pairs = [(t, v) for t, v in enumerate(prompt_values[:horizon]) if v is not None]
        if pairs:
            steps_kept.append(np.array([t for t, _ in pairs], dtype=np.int64))
            values_kept.append(np.array([v for _, v in pairs], dtype=np.float64))
    steps = np.concatenate(steps_kept) if steps_kept else np.zeros(0, dtype=np.int64)
    values = np.concatenate(values_kept) if values_kept else np.zeros(0)
    if not np.isfinite(values).all():
        raise ValueError("binned_curve needs finite values (a NaN or inf reached the curve)")
    index = np.minimum(steps * bins // horizon, bins - 1)
    count = np.bincount(index, minlength=bins)
    sums = np.bincount(index, weights=values, minlength=bins)
    mean = [float(s / c) if c else None for s, c in zip(sums, count)]
    slope = None
    if len(np.unique(steps)) >= 2:
        centred = steps - steps.mean()
        slope = float((centred * (values - values.mean())).sum() / (centred**2).sum() * 1000.0)
    return {"edges": [horizon * i / bins for i in range(bins + 1)], "mean": mean, "count": count.tolist(),
            "slope": slope}


def _z_factor(alpha: float, power: float) -> float:
    """``z_{1-alpha/2} + z_{power}``: 2.80 at alpha 0.05 and power 0.8 (``kveval.stats.MDE_FACTOR``)."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1), got alpha={alpha}, power={power}")
    return NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)


def _difference_sd(p: float, drop: float) -> float:
    """The per-prompt standard deviation of the difference of two proportions, p and p - drop (fractions), as if
    independent: ``sqrt(p(1-p) + q(1-q))``."""
    q = p - drop
    return math.sqrt(p * (1 - p) + q * (1 - q))


def accuracy_mde(n: int, p: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest accuracy drop (points, 0-100) that a comparison of the same ``n`` prompts at base accuracy
    ``p`` (a fraction, 0-1) detects with a two-sided test at ``alpha`` and ``power``: the drop d solving ``d = (z_
    {1-alpha/2} + z_power) · sqrt((p(1-p) + q(1-q)) / n)`` with ``q = p - d`` (normal approximation for the
    difference of two proportions, unpooled).

    The variance is that of two INDEPENDENT proportions: a paired comparison (the same prompts) has the
    covariance of the two runs subtracted, which is positive for a policy that mostly agrees with the FP model, so
    this MDE is an upper bound (conservative). ``kveval.stats.samples_to_resolve`` takes the other extreme (a
    policy that only loses prompts). ``math.inf`` when no drop up to ``p`` itself (accuracy 0) is detectable.
    ValueError for ``n < 1`` or ``p`` outside [0, 1]."""
    if n < 1 or not 0 <= p <= 1:
        raise ValueError(f"accuracy_mde needs n >= 1 and 0 <= p <= 1, got n={n}, p={p}")
    z = _z_factor(alpha, power)

    def excess(drop: float) -> float:  # increasing in drop on [0, p]; its root is the MDE
        return drop - z * _difference_sd(p, drop) / math.sqrt(n)

    if excess(p) < 0:
        return math.inf
    low, high = 0.0, p
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) < 0 else (low, middle)
    return 100.0 * high


def prompts_to_decide(p: float, drop: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The prompts at which an accuracy drop of ``drop`` points (0-100) from base accuracy ``p`` (a fraction) is
    detected (the inverse of :func:`accuracy_mde`): ``ceil(z² (p(1-p) + q(1-q)) / d²)`` with ``d = drop / 100``
    and ``q = p - d``, at least 1. ValueError for ``drop`` outside ``(0, 100 p]`` or ``p`` outside [0, 1]."""
    if not 0 <= p <= 1:
        raise ValueError(f"prompts_to_decide needs 0 <= p <= 1, got p={p}")
    d = drop / 100.0
    if not 0 < d <= p + 1e-12:
        raise ValueError(f"prompts_to_decide needs 0 < drop <= 100 p (= {100 * p:g} points), got drop={drop}")
    z = _z_factor(alpha, power)
    return max(1, math.ceil((z * _difference_sd(p, min(d, p)) / d) ** 2 - 1e-9))
