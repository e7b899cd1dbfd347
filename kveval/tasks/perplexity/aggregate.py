"""Aggregation of the perplexity task: metrics.json's fields from the records (pure: the same records give the same
metrics), the verdicts against the configured thresholds, the power of the run (the minimum detectable effect and
the tokens a verdict would need), the noise floor's summary and the weight variants' summaries."""

from __future__ import annotations

import math

import numpy as np

from kveval.results.layout import BASELINE
from kveval.schema import is_finite_number
from kveval.stats import (
    add_llama_sums,
    bootstrap_ratio_ci,
    bootstrap_standard_error,
    inconclusive,
    llama_perplexity_stats,
    minimum_detectable_effect,
    predicted_mde_delta_ppl_pct,
    predicted_mde_kld,
    size_to_decide,
    tokens_to_resolve,
)
from kveval.tasks.perplexity.params import Params


def resolution_warnings(scored: int, threshold) -> list[str]:
    """One line per configured threshold that ``scored`` tokens cannot resolve: the minimum detectable effect
    predicted for a policy at the threshold (:func:`kveval.stats.predicted_mde_delta_ppl_pct`,
    :func:`kveval.stats.predicted_mde_kld`) exceeds it; the line says how many scored tokens would."""
    out = []
    checks = [("threshold.delta_ppl_pct", threshold.delta_ppl_pct, predicted_mde_delta_ppl_pct, "%")]
    if threshold.kld is not None:
        checks.append(("threshold.kld", threshold.kld, predicted_mde_kld, ""))
    for name, thr, predict, unit in checks:
        mde = predict(thr, scored)
        if thr > 0 and mde > thr:
            out.append(f"{scored:,} scored tokens cannot resolve {name} {thr:g}{unit}: the smallest effect they "
                       f"detect (alpha 0.05, power 0.8) is about {mde:.3g}{unit} for a policy at the threshold; about "
                       f"{tokens_to_resolve(mde, thr, scored):,} tokens would (raise max_tokens); verdicts near the "
                       "threshold will say inconclusive")
    return out


def _noise_summary(records: list[dict]) -> dict:
    """``noise_floor_ppl_pct`` = |PPL(single pass) - PPL(decoded)| / PPL(single pass) in %, and ``noise_floor_kld``
    = mean KL(single pass || decoded), over the noise windows."""
    if not records:
        return {}
    n = sum(r["n_tokens"] for r in records)
    ppl_single = math.exp(sum(r["nll_single"] for r in records) / n)
    ppl_decoded = math.exp(sum(r["nll_decoded"] for r in records) / n)
    return {
        "noise_floor_ppl_pct": 100.0 * abs(ppl_decoded - ppl_single) / ppl_single,
        "noise_floor_kld": sum(r["kld_paths"] for r in records) / n,
        "noise_ppl_decoded": ppl_decoded,
        "noise_tokens": n,
        "noise_max_abs_logit_gap": max(r["max_abs_logit_gap"] for r in records),
    }


def _layer_summary(records: list[dict]) -> list[dict]:
    """Mean over windows of each per-layer error statistic."""
    per_layer: dict[int, dict[str, list]] = {}
    for rec in records:
        for row in rec.get("layer_errors") or []:
            slot = per_layer.setdefault(row["layer"], {})
            for k, v in row.items():
                if k != "layer" and isinstance(v, (int, float)):
                    slot.setdefault(k, []).append(v)
                elif k != "layer":
                    slot[k] = v
    out = []
    for layer in sorted(per_layer):
        row = {"layer": layer}
        for k, v in per_layer[layer].items():
            row[k] = sum(v) / len(v) if isinstance(v, list) and v and isinstance(v[0], (int, float)) else v
        out.append(row)
    return out


#: how far below 0 a recorded per-token KLD may lie (float rounding of a sum of terms that cancel); a KLD is >= 0
KLD_ROUNDING = 1e-6


def check_window_record(r: dict) -> None:
    """ValueError naming what is wrong with a window record's numbers (a record read back on resume that was
    edited, or written by a broken writer): ``n_tokens`` a positive count, ``nll_sum`` / ``kld_sum`` / ``agree_sum``
    finite, and, when present, ``kld_values`` and ``p_diff_values`` lists of ``n_tokens`` finite numbers (KLD >= 0,
    Δp in [-1, 1]) and ``llama_sums`` finite sums of ``count == n_tokens`` tokens. Fresh records always pass."""
    where = f"window {r.get('window')} of {r.get('policy')}"
    n = r.get("n_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: n_tokens is {n!r}")
    for key in ("nll_sum", "kld_sum", "agree_sum"):
        v = r.get(key)
        if v is not None and not is_finite_number(v):
            raise ValueError(f"{where}: {key} is {v!r}, not a finite number")
    for key, lo, hi in (("kld_values", -KLD_ROUNDING, math.inf), ("p_diff_values", -1.0, 1.0)):
        if key not in r:
            continue
        values = r[key]
        if not isinstance(values, list) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
            raise ValueError(f"{where}: {key} holds {got} for {n} tokens")
        bad = next((v for v in values if not (is_finite_number(v) and lo <= v <= hi)), None)
        if bad is not None:
            raise ValueError(f"{where}: {key} holds {bad!r}, not a {'KLD' if key == 'kld_values' else 'Δp'}")
    sums = r.get("llama_sums")
    if sums is not None:
        if not isinstance(sums, dict) or sums.get("count") != n:
            raise ValueError(f"{where}: llama_sums counts {sums.get('count') if isinstance(sums, dict) else sums!r} "
                             f"tokens, the record {n}")
        if not all(is_finite_number(v) for v in sums.values()):
            raise ValueError(f"{where}: llama_sums holds a value that is not a finite number")


def _summarise(records: list[dict], params: Params, seed: int) -> dict:
    for r in records:
        check_window_record(r)
    records = sorted(records, key=lambda r: r["window"])
    n = sum(r["n_tokens"] for r in records)
    nll = sum(r["nll_sum"] for r in records)
    bins = len(records[0]["bin_count"])
    counts = [sum(r["bin_count"][i] for r in records) for i in range(bins)]
    out = {
        "ppl": math.exp(nll / n),
        "nll_mean": nll / n,
        "tokens": n,
        "windows": len(records),
        "kld_mean": sum(r["kld_sum"] for r in records) / n,
        "kld_ci95": bootstrap_ratio_ci(
            [r["kld_sum"] for r in records], [r["n_tokens"] for r in records], n_resamples=params.bootstrap, seed=seed
        ),
        "top1_agree": sum(r["agree_sum"] for r in records) / n,
        "loss_by_position": [
            sum(r["bin_nll"][i] for r in records) / counts[i] if counts[i] else None for i in range(bins)
        ],
        "kld_by_position": [
            sum(r["bin_kld"][i] for r in records) / counts[i] if counts[i] else None for i in range(bins)
        ],
        "position_bin_edges": [params.seq_len * i // bins for i in range(bins + 1)],
    }
    if all("llama_sums" in r for r in records):  # records of an older kveval have none: the fields are left out
        out["llama_perplexity"] = llama_perplexity_stats(
            add_llama_sums(r["llama_sums"] for r in records),
            [v for r in records for v in r["kld_values"]], [v for r in records for v in r["p_diff_values"]])
    peaks = [r["cuda_peak_bytes"] for r in records if r.get("cuda_peak_bytes") is not None]
    if peaks:  # on CUDA: the largest peak of the passes that computed these records (DeviceMemory)
        out["cuda_peak_memory_bytes"] = max(peaks)
    layers = _layer_summary(records)
    if layers:
        out["layers_quantized"] = records[0].get("layers_quantized")
        out["layer_errors"] = layers
        for t in ("key", "value"):
            vals = [row.get(f"{t}_rel_mse") for row in layers if row.get(f"{t}_rel_mse") is not None]
            if vals:
                out[f"{t}_rel_mse_mean"] = sum(vals) / len(vals)
                out[f"{t}_rel_mse_worst_layer"] = max(layers, key=lambda r: r.get(f"{t}_rel_mse") or 0)["layer"]
    return out


# Floors at or below these are float64 rounding (a policy and its second path agree to ~1e-13): they hide nothing.
ROUNDING_FLOOR_PPL_PCT = 1e-9
ROUNDING_FLOOR_KLD = 1e-12


def _criteria(s: dict, threshold) -> list[tuple[float, float, float | None]]:
    """(measured, threshold, minimum detectable effect) of each configured criterion: ΔPPL %, and the KLD when
    ``threshold.kld`` is set."""
    out = [(s["delta_ppl_pct"], threshold.delta_ppl_pct, s.get("delta_ppl_pct_mde"))]
    if threshold.kld is not None:
        out.append((s["kld_mean"], threshold.kld, s.get("kld_mde")))
    return out


def verdict(s: dict, threshold) -> str:
    """``within_noise`` when |ΔPPL %| is below the path noise floor (or the KLD below the KLD floor); otherwise
    ``fail`` when a criterion exceeds its threshold by more than the run can blur (:func:`kveval.stats.inconclusive`
    is false for it), ``inconclusive`` when a criterion's threshold lies below its minimum detectable effect
    (``delta_ppl_pct_mde``, ``kld_mde``) and the measurement lies within one MDE of it, else ``pass``. Without an
    MDE (none measured) the plain threshold decides. Floors at float64 rounding level (``ROUNDING_FLOOR_*``) count
    as 0."""
    floor_ppl, floor_kld = s.get("noise_floor_ppl_pct"), s.get("noise_floor_kld")
    if floor_ppl is not None:
        fp = floor_ppl if floor_ppl > ROUNDING_FLOOR_PPL_PCT else 0.0
        fk = floor_kld if floor_kld is not None and floor_kld > ROUNDING_FLOOR_KLD else 0.0
        if abs(s["delta_ppl_pct"]) < fp or s["kld_mean"] < fk:
            return "within_noise"
    checks = _criteria(s, threshold)
    undecided = [inconclusive(d, t, m) for d, t, m in checks]
    if any(d > t and not u for (d, t, _), u in zip(checks, undecided)):
        return "fail"
    return "inconclusive" if any(undecided) else "pass"


def _more_tokens(s: dict, threshold) -> int | None:
    """Scored tokens to add so that an ``inconclusive`` verdict is decided (:func:`kveval.stats.size_to_decide`,
    the largest over the undecided criteria), or None."""
    n = s["tokens"]
    need = [size_to_decide(n, d, t, m) for d, t, m in _criteria(s, threshold) if m is not None and inconclusive(d, t, m)]
    need = [x for x in need if x is not None]
    return max(need) - n if need else None


def _larger(windows: float | None, tokens: float | None) -> tuple[float | None, str | None]:
    if windows is None and tokens is None:
        return None, None
    if tokens is None or (windows is not None and windows >= tokens):
        return windows, "bootstrap over windows"
    return tokens, "per-token variance"


def power_fields(s: dict, records: list[dict], base_records: list[dict], params: Params, seed: int) -> dict:
    """The minimum detectable effect (alpha 0.05, power 0.8: :func:`kveval.stats.minimum_detectable_effect`) of
    ΔPPL % and of the KLD at the run's size: ``delta_ppl_pct_mde``, ``kld_mde``, and ``mde_method`` saying which
    standard error set each. The standard error is the larger of two: the bootstrap over windows of the paired
    statistic (the policy's and the baseline's NLL of each window resampled together; correlations between the
    tokens of a window included; ``params.bootstrap`` resamples, seeded), and the per-token variance as
    llama-perplexity forms it (the uncertainty of ``Mean PPL(Q)/PPL(base)`` and of ``Mean KLD`` in
    ``llama_perplexity``: tokens taken as independent; the only one with a single window). Records of an older
    kveval (no per-token sums) with a single window give no MDE (the fields are None)."""
    base_nll = {r["window"]: r["nll_sum"] for r in base_records}
    recs = sorted(records, key=lambda r: r["window"])
    n_tok = [r["n_tokens"] for r in recs]
    boot = {"n_resamples": params.bootstrap, "seed": seed}
    ppl_windows = bootstrap_standard_error([r["nll_sum"] - base_nll[r["window"]] for r in recs], n_tok,
                                           transform=lambda x: 100.0 * np.expm1(x), **boot)
    kld_windows = bootstrap_standard_error([r["kld_sum"] for r in recs], n_tok, **boot)
    lp = s.get("llama_perplexity") or {}
    ppl_tokens = 100.0 * lp["ppl_ratio_unc"] if lp.get("ppl_ratio_unc") else None
    kld_tokens = lp.get("kld_mean_unc") or None
    se_ppl, how_ppl = _larger(ppl_windows, ppl_tokens)
    se_kld, how_kld = _larger(kld_windows, kld_tokens)
    return {"delta_ppl_pct_mde": minimum_detectable_effect(se_ppl), "kld_mde": minimum_detectable_effect(se_kld),
            "mde_method": {"delta_ppl_pct": how_ppl, "kld": how_kld}}


def _decide(s: dict, records: list[dict], base_records: list[dict], params: Params, seed: int, threshold) -> None:
    """``s`` gets its power fields, its verdict and, when ``inconclusive``, ``more_tokens_to_decide``."""
    s.update(power_fields(s, records, base_records, params, seed))
    s["verdict"] = verdict(s, threshold)
    if s["verdict"] == "inconclusive":
        s["more_tokens_to_decide"] = _more_tokens(s, threshold)


def aggregate(records: list[dict], policies: list[str], params: Params, *, seed: int, threshold,
              weights: list[str] | None = None) -> dict:
    """metrics.json's perplexity fields from the records (pure: the same records give the same metrics);
    ``weights``: the weight variants, whose records (``weights: VARIANT``) make ``metrics["weights"]``."""
    by_policy: dict[str, list[dict]] = {}
    by_variant: dict[str, dict[str, list[dict]]] = {}
    noise: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("task") == "perplexity" and rec.get("weights") is not None:
            by_variant.setdefault(rec["weights"], {}).setdefault(rec["policy"], []).append(rec)
        elif rec.get("task") == "perplexity":
            by_policy.setdefault(rec["policy"], []).append(rec)
        elif rec.get("task") == "perplexity_noise":
            noise.setdefault(rec["policy"], []).append(rec)
    base = _summarise(by_policy[BASELINE], params, seed)
    base.update(_noise_summary(noise.get(BASELINE, [])))
    for k in ("kld_mean", "kld_ci95", "top1_agree", "kld_by_position"):
        base.pop(k, None)
    out = {BASELINE: base, "policies": {}}
    for name in policies:
        s = _summarise(by_policy[name], params, seed)
        s["delta_ppl"] = s["ppl"] - base["ppl"]
        s["delta_ppl_pct"] = 100.0 * s["delta_ppl"] / base["ppl"]
        s.update(_noise_summary(noise.get(name, [])))
        _decide(s, by_policy[name], by_policy[BASELINE], params, seed, threshold)
        out["policies"][name] = s
    if weights:
        out["weights"] = {"variants": {
            v: _variant_summary(by_variant.get(v, {}), by_policy, policies, base, params, seed=seed,
                                threshold=threshold) for v in weights}}
    return out


_PER_LAYER = ("layers_quantized", "layer_errors", "key_rel_mse_mean", "value_rel_mse_mean",
              "key_rel_mse_worst_layer", "value_rel_mse_worst_layer")


def _window_sums(records: list[dict], kld_field: str = "kld_sum"):
    from kveval.weights import WindowSums

    records = sorted(records, key=lambda r: r["window"])
    return WindowSums([r["n_tokens"] for r in records], [r["nll_sum"] for r in records],
                      [r.get(kld_field, 0.0) if kld_field else 0.0 for r in records])


def _variant_summary(records: dict[str, list[dict]], by_policy: dict[str, list[dict]], policies: list[str],
                     base: dict, params: Params, *, seed: int, threshold) -> dict:
    """One weight variant's metrics: ``alone`` (quantized weights, full-precision cache, against the FP
    baseline) and ``policies`` (quantized weights and cache, against the FP baseline, with ``kv_on_weights_*``:
    the policy against the variant with the full-precision cache, and the interaction fields)."""
    from kveval.weights import interaction_fields

    def against_base(recs: list[dict]) -> dict:
        s = _summarise(recs, params, seed)
        for k in _PER_LAYER:
            s.pop(k, None)
        s["delta_ppl"] = s["ppl"] - base["ppl"]
        s["delta_ppl_pct"] = 100.0 * s["delta_ppl"] / base["ppl"]
        _decide(s, recs, by_policy[BASELINE], params, seed, threshold)
        return s

    alone = against_base(records[BASELINE])
    out: dict = {"alone": alone, "policies": {}}
    reference = _window_sums(by_policy[BASELINE], "")
    weights_only = _window_sums(records[BASELINE])
    for name in policies:
        recs = records[name]
        s = against_base(recs)
        n = sum(r["n_tokens"] for r in recs)
        s["kv_on_weights_kld_mean"] = sum(r["kld_vs_weights_sum"] for r in recs) / n
        s["kv_on_weights_top1_agree"] = sum(r["agree_vs_weights_sum"] for r in recs) / n
        s["kv_on_weights_delta_ppl_pct"] = 100.0 * (s["ppl"] / alone["ppl"] - 1.0)
        s.update(interaction_fields(reference, _window_sums(by_policy[name]), weights_only, _window_sums(recs),
                                    n_resamples=params.bootstrap, seed=seed))
        out["policies"][name] = s
    return out
