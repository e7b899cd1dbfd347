"""Perplexity, KL divergence and top-1 agreement of each policy against the full-precision model.

Windows of ``seq_len`` tokens over the corpus (non-overlapping, or sliding with ``stride``: only the tokens not
scored by the previous window are scored). For each window the FP baseline runs once; each policy runs once
under ``emulate`` (every token decoded through the quantized cache unless ``prefill_tokens`` > 0). Metrics are
reduced on the fly: one record per (window, policy) in ``records.jsonl``, full logits are never stored.

NaN or infinity in the logits stops the run with one line before that window's records are written (metrics are
never NaN): in the baseline's logits it is the model's fault (overflowing weights or activations, e.g. float16),
in a policy's logits (or in the keys/values its quantizer is given) the quantizer's or the emulation's. The noise
floor's decoded logits are checked the same way (:mod:`kveval.tasks._finite`, the check every task shares).
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator

from kveval.data import token_windows
from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.results.layout import BASELINE
from kveval.schema import Strict
from kveval.stats import bin_sums, bootstrap_ratio_ci, compare_logits
from kveval.tasks._finite import check_finite_logits, finite_quantizer_inputs

NAME = "perplexity"


class Params(Strict):
    """Perplexity, KL divergence and top-1 agreement against the full-precision model."""

    seq_len: int = Field(512, gt=1)
    stride: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(4096, gt=0)
    start_token: int = Field(0, ge=0)
    prefill_tokens: int = Field(0, ge=0)
    position_bins: int = Field(8, gt=0)
    bootstrap: int = Field(1000, ge=0)
    diagnostics: bool = True
    noise_windows: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _stride_fits(self):
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"stride {self.stride} is larger than seq_len {self.seq_len}")
        if self.prefill_tokens >= self.seq_len:
            raise ValueError(f"prefill_tokens {self.prefill_tokens} must be smaller than seq_len {self.seq_len}")
        return self


def _metric(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the metrics: float64 stays float64 (a float64 run's noise floor is not float32 rounding),
    everything else in float32."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _record_key(window: int, policy: str) -> str:
    return f"perplexity/w{window}/{policy}"


def _noise_key(window: int, policy: str) -> str:
    return f"perplexity/noise/w{window}/{policy}"


def _window_record(window, policy: str, metrics: dict, positions: torch.Tensor, params: Params) -> dict:
    rec = {
        "key": _record_key(window.index, policy),
        "task": "perplexity",
        "window": window.index,
        "policy": policy,
        "start": int(window.start) + params.start_token,  # corpus position
        "n_tokens": int(positions.numel()),
    }
    for name in ("nll", "kld", "agree"):
        rec[f"{name}_sum"] = float(metrics[name].sum())
    for name in ("nll", "kld"):
        rec[f"bin_{name}"], rec["bin_count"] = bin_sums(metrics[name], positions, params.position_bins, params.seq_len)
    return rec


def check(ctx, params: Params) -> None:
    """Input errors: a window longer than the model's context, a corpus shorter than one window."""
    from kveval.models import model_context_limit

    limit = model_context_limit(ctx.model)
    if params.seq_len > limit:
        raise KvevalError(
            f"tasks: perplexity.seq_len {params.seq_len} is longer than the model's context ({limit} tokens); lower it"
        )
    tokens = ctx.tokens()[params.start_token:]
    if tokens.numel() < params.seq_len:
        raise KvevalError(f"the corpus has {tokens.numel()} tokens from start_token {params.start_token}, fewer than "
                          f"one window of seq_len {params.seq_len}")


def _where(window, offset: int) -> str:
    return f"window {window.index} (corpus tokens {window.start + offset}-{window.end + offset})"


def _check_finite(logits: torch.Tensor, window, name: str, dtype: str, offset: int = 0) -> None:
    """One line, naming whose fault it is, when the scored logits of a window hold NaN or infinity (``offset``:
    the corpus position of the window's token 0, i.e. ``start_token``): :func:`kveval.tasks._finite.check_finite_logits`."""
    check_finite_logits(logits, where=_where(window, offset), dtype=dtype,
                        quantized_by=None if name == BASELINE else f"policy '{name}'")


def run(ctx, params: Params) -> dict:
    """Evaluate every (window, policy) not yet recorded, then aggregate all records into metrics."""
    from kveval.patch import emulate

    tokens = ctx.tokens()[params.start_token:]
    windows = list(token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens))
    names = [BASELINE, *ctx.policies]
    done = ctx.run.done_keys()
    todo = [w for w in windows if any(_record_key(w.index, n) not in done for n in names)]
    if len(todo) < len(windows):
        ctx.progress.log(f"perplexity: resuming, {len(windows) - len(todo)} of {len(windows)} windows already recorded")

    model = ctx.model
    with ctx.progress.task("perplexity", total=len(todo) * len(names), unit="tok") as advance:
        for w in todo:
            ids = w.input_ids.to(model.device)
            targets = ids[1:]
            # logits positions whose next token is scored (window.score_from indexes the first scored target)
            scored = torch.arange(w.score_from - 1, len(ids) - 1, device=ids.device)
            with torch.no_grad():
                base = _metric(model(ids[None]).logits[0, :-1])
            base_scored = base[scored]
            _check_finite(base_scored, w, BASELINE, ctx.cfg.model.dtype, params.start_token)
            tgt = targets[scored]
            for name in names:
                key = _record_key(w.index, name)
                if key in done:
                    advance(0)
                    continue
                diag = None
                if name == BASELINE:
                    metrics = compare_logits(base_scored, base_scored, tgt)
                else:
                    policy = ctx.policies[name]
                    with finite_quantizer_inputs(_where(w, params.start_token), f"policy '{name}'"):
                        with emulate(model, policy, prefill_len=params.prefill_tokens,
                                     diagnostics=params.diagnostics) as emu, torch.no_grad():
                            logits = _metric(model(ids[None]).logits[0, :-1])
                    _check_finite(logits[scored], w, name, ctx.cfg.model.dtype, params.start_token)
                    metrics = compare_logits(base_scored, logits[scored], tgt)
                    diag = emu.diagnostics() if params.diagnostics else None
                    layers_quantized = emu.layers_quantized
                rec = _window_record(w, name, {k: v.cpu() for k, v in metrics.items()}, scored.cpu(), params)
                if diag is not None:
                    rec["layers_quantized"] = layers_quantized
                    rec["layer_errors"] = diag
                ctx.run.append(rec)
                advance(len(ids))
    _noise_floor(ctx, params, windows[: params.noise_windows], names)
    return aggregate(ctx.run.records(), list(ctx.policies), params, seed=ctx.cfg.seed, threshold=ctx.cfg.threshold)


def _noise_floor(ctx, params: Params, windows: list, names: list[str]) -> None:
    """The path noise: the same semantics computed a second way (token-by-token decoding through the real cache)
    on the first ``noise_windows`` windows, for every policy and for the FP baseline (single pass vs decoding)."""
    from kveval.patch import decode_logits, emulate

    done = ctx.run.done_keys()
    todo = [(w, n) for w in windows for n in names if _noise_key(w.index, n) not in done]
    if not todo:
        return
    model = ctx.model
    with ctx.progress.task("noise floor (decoding)", total=len(todo), unit="tok") as advance:
        for w, name in todo:
            ids = w.input_ids.to(model.device)[None]
            policy = KVPolicy.preset("fp16") if name == BASELINE else ctx.policies[name]
            prefill = max(params.prefill_tokens, 1)
            where = _where(w, params.start_token)
            who = None if name == BASELINE else f"policy '{name}'"
            with torch.no_grad(), finite_quantizer_inputs(where, who or "the full-precision cache"):
                if name == BASELINE:
                    single = _metric(model(ids).logits[0, :-1])
                else:
                    with emulate(model, policy, prefill_len=params.prefill_tokens):
                        single = _metric(model(ids).logits[0, :-1])
                decoded = _metric(decode_logits(model, ids, policy, prefill_len=prefill)[0, :-1])
            scored = torch.arange(w.score_from - 1, ids.shape[1] - 1, device=ids.device)
            dtype = ctx.cfg.model.dtype
            check_finite_logits(single[scored], where=where, dtype=dtype, quantized_by=who)
            check_finite_logits(decoded[scored], where=f"{where}, decoded token by token through the real cache",
                                dtype=dtype, quantized_by=who or "the full-precision cache")
            tgt = ids[0, 1:][scored]
            a = compare_logits(single[scored], single[scored], tgt)
            b = compare_logits(single[scored], decoded[scored], tgt)
            ctx.run.append({
                "key": _noise_key(w.index, name), "task": "perplexity_noise", "window": w.index, "policy": name,
                "n_tokens": int(scored.numel()), "nll_single": float(a["nll"].sum()),
                "nll_decoded": float(b["nll"].sum()), "kld_paths": float(b["kld"].sum()),
                "max_abs_logit_gap": float((single[scored] - decoded[scored]).abs().max()),
            })
            advance(ids.shape[1])


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


def _summarise(records: list[dict], params: Params, seed: int) -> dict:
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


def verdict(s: dict, threshold) -> str:
    """``within_noise`` when |ΔPPL %| is below the path noise floor (or the KLD below the KLD floor); otherwise
    ``pass`` / ``fail`` against the threshold. Floors at float64 rounding level (``ROUNDING_FLOOR_*``) count as 0."""
    floor_ppl, floor_kld = s.get("noise_floor_ppl_pct"), s.get("noise_floor_kld")
    if floor_ppl is not None:
        fp = floor_ppl if floor_ppl > ROUNDING_FLOOR_PPL_PCT else 0.0
        fk = floor_kld if floor_kld is not None and floor_kld > ROUNDING_FLOOR_KLD else 0.0
        if abs(s["delta_ppl_pct"]) < fp or s["kld_mean"] < fk:
            return "within_noise"
    ok = s["delta_ppl_pct"] <= threshold.delta_ppl_pct
    if threshold.kld is not None:
        ok = ok and s["kld_mean"] <= threshold.kld
    return "pass" if ok else "fail"


def aggregate(records: list[dict], policies: list[str], params: Params, *, seed: int, threshold) -> dict:
    """metrics.json's perplexity fields from the records (pure: the same records give the same metrics)."""
    by_policy: dict[str, list[dict]] = {}
    noise: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("task") == "perplexity":
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
        s["verdict"] = verdict(s, threshold)
        out["policies"][name] = s
    return out
