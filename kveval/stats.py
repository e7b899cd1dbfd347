"""Pure metric maths: per-token losses and divergences, binning, bootstrap confidence intervals, the statistics
llama-perplexity prints, and the minimum detectable effect of a run."""

from __future__ import annotations

import math

import numpy as np
import torch


def top_index(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum: ``logits.argmax(-1)`` (``[n, vocab]`` -> ``[n]`` int64), the same
    indices, ties included (both documented to return the first maximal value: argmax is the second value
    ``torch.max`` returns), by ``torch.max(dim)``, whose CPU kernel is 2.6x faster than argmax's (``[64, 49152]``
    float32, 2 threads, torch 2.13: 0.75 ms against 1.98 ms): a perplexity comparison's top-1 term spent a third
    of its time in argmax."""
    return logits.max(-1).indices


def compare_logits(base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position metrics of ``logits`` against the baseline's: all ``[n]`` float64 tensors.

    ``nll``: -log p(target); ``kld``: KL(P_base || P) = Σ_v p_base(v) (log p_base(v) - log p(v));
    ``agree``: 1.0 where the argmax tokens agree. Inputs ``[n, vocab]``, targets ``[n]``.
    """
    v = llama_token_values(base_logits, logits, targets)
    return {"nll": v["nll"], "kld": v["kld"], "agree": v["same_top"]}


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
    ratios = _resampled_ratios(num, den, n_resamples, seed)
    alpha = (1 - level) / 2
    return [float(np.quantile(ratios, alpha)), float(np.quantile(ratios, 1 - alpha))]


def _resampled_ratios(num: np.ndarray, den: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """``Σ num / Σ den`` over ``n_resamples`` resamples of the units (with replacement), seeded: ``[n_resamples]``."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_resamples, len(num)))
    return num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-300)


# ------------------------------------------------------------------------------------------- llama-perplexity
# The statistics `llama-perplexity --kl-divergence` prints, computed as llama.cpp 0c1e570 computes them
# (tools/perplexity/perplexity.cpp: the per-token sums of `kl_divergence_result`, l. 175-189; the per-token values
# of the KL `log_softmax`, l. 191-252; `mean_and_uncertainty` / `covariance` and the summary, l. 1750-1982).
# llama.cpp keeps running sums over its scored tokens; kveval keeps the same sums per window (``llama_sums``) and
# adds them up, and keeps each token's KLD and Δp (float32, as llama.cpp's sorted arrays hold them) for the
# percentiles.

#: the sums llama.cpp accumulates per scored token (``kl_divergence_result``), by kveval's name
LLAMA_SUMS = ("count", "nll", "nll_sq", "nll_base", "nll_base_sq", "nll_cross", "kld", "kld_sq", "p_diff",
              "p_diff_sq", "p_diff_4", "same_top")

#: the percentiles llama-perplexity prints (fractions), KLD and Δp; the medians are printed on their own
KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DELTA_P_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


def _pname(fraction: float) -> str:
    """0.999 -> ``p99_9``, 0.99 -> ``p99``, 0.05 -> ``p5``, 0.001 -> ``p0_1``."""
    return "p" + f"{100 * fraction:.1f}".removesuffix(".0").replace(".", "_")


def _plabel(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


#: (key, llama-perplexity's label with its spaces collapsed, has an uncertainty ``key + "_unc"``), in the order
#: llama-perplexity prints them: the keys of :func:`llama_perplexity_stats` and of metrics.json's
#: ``llama_perplexity`` (Δp and "same top p" in percent, as printed: ``*_pct``)
LLAMA_STATS: tuple[tuple[str, str, bool], ...] = (
    ("ppl", "Mean PPL(Q)", True),
    ("ppl_base", "Mean PPL(base)", True),
    ("cor_ln_ppl_pct", "Cor(ln(PPL(Q)), ln(PPL(base)))", False),
    ("ln_ppl_ratio", "Mean ln(PPL(Q)/PPL(base))", True),
    ("ppl_ratio", "Mean PPL(Q)/PPL(base)", True),
    ("ppl_diff", "Mean PPL(Q)-PPL(base)", True),
    ("kld_mean", "Mean KLD", True),
    ("kld_max", "Maximum KLD", False),
    *((f"kld_{_pname(f)}", f"{_plabel(f)} KLD", False) for f in KLD_PERCENTILES[:4]),
    ("kld_median", "Median KLD", False),
    *((f"kld_{_pname(f)}", f"{_plabel(f)} KLD", False) for f in KLD_PERCENTILES[4:]),
    ("kld_min", "Minimum KLD", False),
    ("delta_p_mean_pct", "Mean Δp", True),
    ("delta_p_max_pct", "Maximum Δp", False),
    *((f"delta_p_{_pname(f)}_pct", f"{_plabel(f)} Δp", False) for f in DELTA_P_PERCENTILES[:5]),
    ("delta_p_median_pct", "Median Δp", False),
    *((f"delta_p_{_pname(f)}_pct", f"{_plabel(f)} Δp", False) for f in DELTA_P_PERCENTILES[5:]),
    ("delta_p_min_pct", "Minimum Δp", False),
    ("delta_p_rms_pct", "RMS Δp", True),
    ("same_top_p_pct", "Same top p", True),
)


def base_token_terms(base_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """What :func:`llama_token_values` computes from the baseline alone (``[n, vocab]`` logits): ``logp`` (float64
    log-softmax), ``p`` (its exp) and ``top`` (argmax, ``[n]``). Computed once per window and passed to every
    policy's comparison, the numbers are the same as recomputing them."""
    logp = torch.log_softmax(base_logits.double(), dim=-1)
    return {"logp": logp, "p": logp.exp(), "top": top_index(base_logits)}


class LogSoftmaxScratch:
    """Two float64 ``[rows, vocab]`` buffers reused by the comparisons of a run (:func:`llama_token_values`): the
    float64 copy of a policy's logits and its log-softmax, written in place. On the CPU a fresh tensor of that size
    costs its page faults on every comparison, more than the arithmetic (bench/bench_run_overhead.py on
    configs/formats_2026.yaml: comparisons 24 s of a 256 s run). On CUDA the caching allocator already reuses
    memory and held buffers would count in every pass's peak: nothing is kept there. The same numbers either way:
    the same kernels on the same values."""

    def __init__(self) -> None:
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``torch.log_softmax(logits.double(), -1)`` of ``[n, vocab]`` logits (off CUDA into the second buffer,
        valid until the next call)."""
        if logits.device.type == "cuda":
            return torch.log_softmax(logits.double(), dim=-1)
        n, vocab = logits.shape
        if self._x is None or self._out is None or self._x.shape[0] < n or self._x.shape[1] != vocab \
                or self._x.device != logits.device:
            self._x = torch.empty(n, vocab, dtype=torch.float64, device=logits.device)
            self._out = torch.empty_like(self._x)
        x, out = self._x[:n], self._out[:n]
        x.copy_(logits)
        # the out= form of the op torch.log_softmax calls (the public function takes no out)
        return torch.ops.aten._log_softmax.out(x, -1, False, out=out)


def llama_token_values(base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                       base_terms: dict[str, torch.Tensor] | None = None,
                       scratch: LogSoftmaxScratch | None = None) -> dict[str, torch.Tensor]:
    """Per scored token, what llama-perplexity's KL pass computes (``[n]`` float64 each): ``nll`` (the model under
    test), ``nll_base``, ``kld`` = KL(P_base ‖ P), ``p_diff`` = p(target) - p_base(target) (Δp, Q minus base) and
    ``same_top`` (1.0 where the argmax tokens agree: both take the first maximum, as llama.cpp's scans do).
    Inputs ``[n, vocab]``, targets ``[n]``; exact softmaxes in float64 (llama.cpp reads the base from its 16-bit
    file: :mod:`kveval.parity.kld_base` computes that version). ``base_terms``: :func:`base_token_terms` of
    ``base_logits``, when the caller keeps them for several comparisons; ``scratch``: buffers reused across
    comparisons (:class:`LogSoftmaxScratch`)."""
    base = base_token_terms(base_logits) if base_terms is None else base_terms
    base_logp = base["logp"]
    logp = torch.log_softmax(logits.double(), dim=-1) if scratch is None else scratch.log_softmax(logits)
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)
    nll_base = -base_logp.gather(-1, targets[:, None]).squeeze(-1)
    # p_base * (logp_base - logp), in place on logp's buffer (the same elementwise values, summed in the same
    # order): no further [n, vocab] float64 temporaries
    kld = torch.sub(base_logp, logp, out=logp).mul_(base["p"]).sum(-1).clamp(min=0.0)
    same = (base["top"] == top_index(logits)).double()
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "p_diff": torch.exp(-nll) - torch.exp(-nll_base),
            "same_top": same}


def llama_sums(nll, nll_base, kld, p_diff, same_top) -> dict[str, float]:
    """llama.cpp's running sums (``LLAMA_SUMS``) over some tokens: per-token arrays ``[n]`` (tensors or arrays) ->
    float64 sums; ``count`` is n. Sums of several windows add up key by key (:func:`add_llama_sums`)."""
    a = {k: np.asarray(torch.as_tensor(v).double().cpu() if not isinstance(v, np.ndarray) else v, dtype=np.float64)
         for k, v in (("nll", nll), ("nll_base", nll_base), ("kld", kld), ("p_diff", p_diff), ("same", same_top))}
    pd2 = a["p_diff"] ** 2
    return {"count": int(a["nll"].size), "nll": float(a["nll"].sum()), "nll_sq": float((a["nll"] ** 2).sum()),
            "nll_base": float(a["nll_base"].sum()), "nll_base_sq": float((a["nll_base"] ** 2).sum()),
            "nll_cross": float((a["nll"] * a["nll_base"]).sum()), "kld": float(a["kld"].sum()),
            "kld_sq": float((a["kld"] ** 2).sum()), "p_diff": float(a["p_diff"].sum()), "p_diff_sq": float(pd2.sum()),
            "p_diff_4": float((pd2 ** 2).sum()), "same_top": float(a["same"].sum())}


def add_llama_sums(parts) -> dict[str, float]:
    """The sums of several windows (``llama_sums`` dicts), added key by key in the given order."""
    out = dict.fromkeys(LLAMA_SUMS, 0.0)
    for p in parts:
        for k in LLAMA_SUMS:
            out[k] += p[k]
    out["count"] = int(out["count"])
    return out


def float32_values(values) -> list[float]:
    """Values ``[n]`` rounded to float32, as JSON-ready floats whose shortest decimal form round-trips that float32
    (``0.0012345678``, not ``0.0012345678359270096``): a record written and read back holds the same numbers."""
    return [float(s) for s in np.asarray(torch.as_tensor(values).cpu() if not isinstance(values, np.ndarray)
                                         else values, dtype=np.float32).astype(str)]


def mean_of_present(values) -> float | None:
    """The mean of the values that are not None (``math.fsum``: the same whatever their order); None when none
    is. The per-task summaries (needle, RULER, generation) average their records with it."""
    present = [v for v in values if v is not None]
    return math.fsum(present) / len(present) if present else None


def length_area(scores: dict[int, float | None]) -> float | None:
    """The area under a score-by-length curve, normalised to the score's own scale: the mean of the scores of the
    lengths that have one (each length weighs the same, as MRCR's area over its length buckets); None for none."""
    return mean_of_present(list(scores.values()))


def effective_length(scores: dict[int, float | None], base: dict[int, float | None], max_drop: float) -> int | None:
    """RULER's effective length against the baseline: the longest length up to which every length's score is at
    most ``max_drop`` below the baseline's at that length (lengths in rising order; a length either side lacks is
    skipped); None when the shortest already drops more."""
    longest = None
    for length in sorted(scores):
        mine, ref = scores[length], base.get(length)
        if mine is None or ref is None:
            continue
        if ref - mine > max_drop + 1e-9:
            break
        longest = length
    return longest


def mean_and_uncertainty(total: float, total_sq: float, n: int) -> tuple[float, float]:
    """llama-perplexity's mean of a per-token quantity and its uncertainty, from the sums ``Σx``, ``Σx²`` over
    ``n`` tokens: ``Σx/n`` and the standard error ``sqrt((Σx²/n - mean²) / (n - 1))``, taken as 0 unless that
    variance is positive and ``n > 10`` (perplexity.cpp l. 1750-1758). (0, 0) for ``n < 1``."""
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    var = total_sq / n - mean * mean
    return mean, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance_of_means(sum_a: float, sum_b: float, sum_ab: float, n: int) -> float:
    """The covariance of two per-token means, as llama-perplexity forms it: ``(Σab/n - (Σa/n)(Σb/n)) / (n - 1)``,
    0 for ``n < 10`` (perplexity.cpp l. 1760-1766)."""
    if n < 10:
        return 0.0
    return (sum_ab / n - (sum_a / n) * (sum_b / n)) / (n - 1)


def llama_percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of ascending float32 values: linear interpolation at ``fraction * (n - 1)``,
    everything in float32 (the position too), the first value for ``fraction <= 0`` and the last for ``>= 1``
    (perplexity.cpp l. 1930-1936). ``sorted_values``: float32 ``[n]``, n >= 1."""
    v = np.asarray(sorted_values, dtype=np.float32)
    f = np.float32(fraction)
    if f <= 0:
        return float(v[0])
    if f >= 1:
        return float(v[-1])
    pos = np.float32(f * np.float32(v.size - 1))
    lo = int(np.floor(pos))
    w = np.float32(pos - np.float32(lo))
    hi = v[min(lo + 1, v.size - 1)]
    return float(np.float32(np.float32(1) - w) * v[lo] + w * hi)


def llama_median(sorted_values: np.ndarray) -> float:
    """llama-perplexity's median of ascending float32 values: the middle value, or for an even count the float32
    ``0.5 * (v[n/2] + v[n/2 - 1])`` (perplexity.cpp l. 1927-1928)."""
    v = np.asarray(sorted_values, dtype=np.float32)
    n = v.size
    if n % 2:
        return float(v[n // 2])
    return float(np.float32(0.5) * (v[n // 2] + v[n // 2 - 1]))


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def llama_perplexity_stats(sums: dict, kld_values, p_diff_values) -> dict:
    """Every statistic of llama-perplexity's summary (``LLAMA_STATS`` keys, ``*_unc`` their uncertainties, and
    ``tokens``) from the running sums ``sums`` (:func:`llama_sums`, added over windows) and the per-token KLD and Δp
    values (any order; float32). As llama.cpp: ``PPL = exp(mean nll)`` with uncertainty ``PPL·σ``; Cor is Pearson's
    r of the per-token nll of the two models (in %); ln(PPL_Q/PPL_base) = ``μ - μ_base`` with uncertainty
    ``sqrt(σ² + σ_base² - 2 cov)``; the ratio and the difference by error propagation; KLD and Δp percentiles of
    the sorted values; RMS Δp = ``sqrt(mean Δp²)`` with uncertainty ``0.5/rms · σ(Δp²)``; same top p = the share
    of agreeing argmaxes with the binomial ``sqrt(f(1-f)/(n-1))``. Δp and same top p in percent. A number that
    llama.cpp would print as nan or inf (a zero variance under Cor, one token) is None. Empty for no tokens."""
    n = int(sums["count"])
    kld = np.sort(np.asarray(kld_values, dtype=np.float32))
    pdiff = np.sort(np.asarray(p_diff_values, dtype=np.float32))
    if n < 1 or kld.size == 0 or pdiff.size == 0:
        return {}
    mu, sig = mean_and_uncertainty(sums["nll"], sums["nll_sq"], n)
    mub, sigb = mean_and_uncertainty(sums["nll_base"], sums["nll_base_sq"], n)
    cov = covariance_of_means(sums["nll"], sums["nll_base"], sums["nll_cross"], n)
    ppl, pplb = math.exp(mu), math.exp(mub)
    ratio_unc = math.sqrt(max(sig * sig + sigb * sigb - 2 * cov, 0.0))
    ratio = mu - mub
    diff_var = (ppl * sig) ** 2 + (pplb * sigb) ** 2 - 2 * ppl * pplb * cov
    kld_mean, kld_unc = mean_and_uncertainty(sums["kld"], sums["kld_sq"], n)
    dp_mean, dp_unc = mean_and_uncertainty(sums["p_diff"], sums["p_diff_sq"], n)
    msq, msq_unc = mean_and_uncertainty(sums["p_diff_sq"], sums["p_diff_4"], n)
    rms = math.sqrt(max(msq, 0.0))
    top = sums["same_top"] / n
    out: dict = {
        "tokens": n,
        "ppl": ppl, "ppl_unc": ppl * sig, "ppl_base": pplb, "ppl_base_unc": pplb * sigb,
        "cor_ln_ppl_pct": _finite(100 * cov / (sig * sigb)) if sig > 0 and sigb > 0 else None,
        "ln_ppl_ratio": ratio, "ln_ppl_ratio_unc": ratio_unc,
        "ppl_ratio": math.exp(ratio), "ppl_ratio_unc": math.exp(ratio) * ratio_unc,
        "ppl_diff": ppl - pplb, "ppl_diff_unc": math.sqrt(max(diff_var, 0.0)),
        "kld_mean": kld_mean, "kld_mean_unc": kld_unc,
        "kld_max": float(kld[-1]), "kld_median": llama_median(kld), "kld_min": float(kld[0]),
        "delta_p_mean_pct": 100 * dp_mean, "delta_p_mean_pct_unc": 100 * dp_unc,
        "delta_p_max_pct": 100 * float(pdiff[-1]), "delta_p_median_pct": 100 * llama_median(pdiff),
        "delta_p_min_pct": 100 * float(pdiff[0]),
        "delta_p_rms_pct": 100 * rms, "delta_p_rms_pct_unc": _finite(100 * 0.5 / rms * msq_unc) if rms > 0 else None,
        "same_top_p_pct": 100 * top,
        "same_top_p_pct_unc": 100 * math.sqrt(max(top * (1 - top), 0.0) / (n - 1)) if n > 1 else None,
    }
    for f in KLD_PERCENTILES:
        out[f"kld_{_pname(f)}"] = llama_percentile(kld, f)
    for f in DELTA_P_PERCENTILES:
        out[f"delta_p_{_pname(f)}_pct"] = 100 * llama_percentile(pdiff, f)
    order = ["tokens"] + [k for key, _, unc in LLAMA_STATS for k in ((key, f"{key}_unc") if unc else (key,))]
    return {k: out.get(k) for k in order}


# ------------------------------------------------------------------------------------------- power
#: two-sided alpha 0.05 and power 0.8: the minimum detectable effect is (z_{1-α/2} + z_{1-β}) standard errors
ALPHA = 0.05
POWER = 0.8
Z_ALPHA = 1.959963984540054  # the 97.5th percentile of the standard normal
Z_POWER = 0.8416212335729143  # its 80th percentile
MDE_FACTOR = Z_ALPHA + Z_POWER


def minimum_detectable_effect(standard_error: float | None) -> float | None:
    """The smallest true effect that a two-sided test at alpha 0.05 detects with power 0.8, for an estimate of
    that ``standard_error``: ``(z_0.975 + z_0.8) · SE`` = 2.80 SE (normal approximation). None for None."""
    return None if standard_error is None or not math.isfinite(standard_error) else MDE_FACTOR * standard_error


def bootstrap_standard_error(numerators, denominators, *, n_resamples: int = 1000, seed: int = 0,
                             transform=None) -> float | None:
    """The standard error of ``transform(Σ numerators / Σ denominators)`` by a bootstrap over the units (windows):
    the standard deviation of the resampled statistic (seeded; the resamples of :func:`bootstrap_ratio_ci`).
    None for fewer than 2 units or ``n_resamples < 2``."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if len(num) < 2 or n_resamples < 2:
        return None
    stat = _resampled_ratios(num, den, n_resamples, seed)
    if transform is not None:
        stat = transform(stat)
    return float(np.std(stat, ddof=1))


def inconclusive(delta: float, threshold: float, mde: float | None) -> bool:
    """Whether a verdict of ``delta`` against ``threshold`` (pass: ``delta <= threshold``) cannot be trusted at
    the run's size: the threshold lies below the minimum detectable effect ``mde`` and the measurement lies within
    one MDE of the threshold (a measurement farther from it than the MDE is decided whatever the threshold)."""
    return mde is not None and threshold < mde and abs(delta - threshold) <= mde


def size_to_decide(n: int, delta: float, threshold: float, mde: float) -> int | None:
    """How many units (tokens, samples) in all would decide an :func:`inconclusive` verdict: the MDE shrinks as
    ``1/sqrt(n)``, and the verdict is decided once it falls below ``max(threshold, |delta - threshold|)``, so
    ``ceil(n · (mde / margin)²)``; None when that margin is 0 (no size decides a measurement exactly at a threshold
    of 0)."""
    margin = max(threshold, abs(delta - threshold))
    if margin <= 0 or n <= 0:
        return None
    return int(math.ceil(n * (mde / margin) ** 2))


# The minimum detectable effect a run of N scored tokens will have, predicted before it starts for a policy that
# sits exactly at the threshold (the hardest case a verdict has to resolve). For small perturbations of the
# next-token distribution, KL(P‖Q) ≈ ½ Var_P(log P/Q), so the per-token NLL difference of two models has mean ≈ KLD
# and variance ≈ 2·KLD; on the builtin model (configs/int4_g64.yaml, 4,095 tokens) the variance is 2.56·KLD (int8)
# and 2.67·KLD (int4_g64), per-token KLDs have a coefficient of variation of 1.5-1.7, and the bootstrap over
# 512-token windows gives 1.09-1.25 times the per-token standard error of ΔPPL and 1.5-2.0 times that of the KLD
# (tokens of a window are correlated). The prediction takes the larger figures.
PRIOR_VAR_PER_KLD = 2.7
PRIOR_KLD_CV = 1.7
PRIOR_WINDOW_FACTOR_PPL = 1.25
PRIOR_WINDOW_FACTOR_KLD = 2.0


def predicted_mde_delta_ppl_pct(threshold_pct: float, n_tokens: int) -> float:
    """The MDE of ΔPPL % (points) predicted for a policy at ``threshold_pct`` on ``n_tokens`` scored tokens: mean
    NLL difference ``δ = ln(1 + t/100)``, per-token variance ``PRIOR_VAR_PER_KLD · δ``, the window factor."""
    delta = math.log1p(max(threshold_pct, 0.0) / 100.0)
    se = 100.0 * math.exp(delta) * math.sqrt(PRIOR_VAR_PER_KLD * delta / max(n_tokens, 1)) * PRIOR_WINDOW_FACTOR_PPL
    return MDE_FACTOR * se


def predicted_mde_kld(threshold: float, n_tokens: int) -> float:
    """The MDE of the mean KLD predicted for a policy at KLD ``threshold`` on ``n_tokens`` scored tokens."""
    return MDE_FACTOR * PRIOR_KLD_CV * threshold / math.sqrt(max(n_tokens, 1)) * PRIOR_WINDOW_FACTOR_KLD


def tokens_to_resolve(predicted_mde: float, threshold: float, n_tokens: int) -> int:
    """The scored tokens at which a predicted MDE (which shrinks as ``1/sqrt(n)``) falls to the threshold."""
    return int(math.ceil(n_tokens * (predicted_mde / threshold) ** 2)) if threshold > 0 else 0


def paired_standard_error(differences, floor_sd: float = 0.0) -> float | None:
    """The standard error of the mean of paired differences (a policy's score minus the baseline's on the same
    samples): ``max(sd, floor_sd) / sqrt(n)`` with ``sd`` the sample standard deviation (n - 1); ``floor_sd``
    stands in where the sample cannot show its spread (one sample, or every difference equal). None for no
    differences, or for fewer than 2 without a floor."""
    d = np.asarray(list(differences), dtype=np.float64)
    if d.size == 0 or (d.size < 2 and floor_sd <= 0):
        return None
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    return max(sd, floor_sd) / math.sqrt(d.size)


def binomial_sd_points(drop_points: float) -> float:
    """The per-sample standard deviation (score points, 0..100) of the paired difference of a policy that loses
    ``drop_points`` points against the baseline only by failing samples the baseline passes (each difference 0 or
    100, with probability q = drop/100 of 100): ``100 sqrt(q (1 - q))``, the least spread a policy at that drop
    can have on pass/fail samples."""
    q = min(max(drop_points / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(q * (1.0 - q))


def samples_to_resolve(threshold_points: float) -> int:
    """Samples per cell at which a policy at ``threshold_points`` of drop is detected (alpha 0.05, power 0.8) with
    the binomial spread of :func:`binomial_sd_points`: ``ceil((2.80 · sd / threshold)²)``; 0 for a threshold of 0."""
    if threshold_points <= 0:
        return 0
    return int(math.ceil((MDE_FACTOR * binomial_sd_points(threshold_points) / threshold_points) ** 2))


def average_ranks(values) -> np.ndarray:
    """Ranks 1..n of ``values``, ties given the mean of the ranks they span (as Spearman's correlation needs)."""
    x = np.asarray(values, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a, b) -> float | None:
    """Spearman's rank correlation of two equally long sequences (Pearson's correlation of their average ranks);
    None with fewer than 3 pairs or when either side is constant."""
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} values against {len(b)}")
    if len(a) < 3:
        return None
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else None
