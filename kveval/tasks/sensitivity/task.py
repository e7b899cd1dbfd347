"""Per-layer, per-K/V sensitivity: quantize one tensor of one layer, measure KL divergence from the baseline.

Cells: every selected layer x {key, value} x spec. Each cell quantizes only that tensor (residual 0, no sinks),
everything else full precision, on a calibration slice (windows of ``seq_len`` over the first ``max_tokens``
tokens). One record per (window, cell) and one per window for the baseline, so a killed scan resumes.
By default layers before the quantized one are not recomputed (``kveval.tasks.sensitivity.scan``: prefix reuse); ``naive: true``
runs the full model per cell and gives the same numbers.

metrics.json: ``sensitivity: {cells: [{layer, tensor, spec, kld, delta_ppl_pct, nll_delta, top1_agree}],
ranking: {spec: [cells, most sensitive first]}, layer_ranking: {spec: [layers by K+V KLD]},
k_vs_v: {spec: {key_kld_sum, value_kld_sum, ratio_key_over_value, layers_key_worse, more_sensitive}}, ...}``.
The task draws nothing: with ``plots: true`` (the default) the report draws ``plots/sensitivity_heatmap.png`` and
``plots/sensitivity_ranked.png`` from these metrics (:mod:`kveval.report.task_figures`).

NaN or infinity in a window's baseline logits (the model's fault) or in a cell's logits (the quantizer's or the
emulation's) stops the scan with one line before that record is written (:mod:`kveval.tasks._finite`): no cell's
KLD is ever NaN.
"""

from __future__ import annotations

import math

import torch

from kveval.data import token_windows
from kveval.errors import KvevalError
from kveval.policy.selectors import layers_of
from kveval.stats import top_index
from kveval.tasks._finite import check_finite_logits, finite_quantizer_inputs
from kveval.tasks.sensitivity.params import NAME, Params  # noqa: F401 (a task module names its NAME and Params)


def _key(window: int, cell: tuple | None = None) -> str:
    if cell is None:
        return f"sensitivity/w{window}/baseline"
    layer, tensor, spec = cell
    return f"sensitivity/w{window}/L{layer}/{tensor}/{spec}"


def scanned_layers(selector: str, info: dict) -> list[int]:
    """The layers a scan visits: those of ``selector`` that hold K/V (``info["kv_layers"]``: a hybrid's attention
    layers, by their model index). KvevalError when an explicit selector names a layer without K/V (a
    linear-attention or Mamba layer has no cache to quantize) or selects none."""
    chosen = layers_of(selector, info["num_layers"])
    kv = info["kv_layers"]
    held = [i for i in chosen if i in kv]
    if str(selector).strip() != "all" and len(held) != len(chosen):
        others = [i for i in chosen if i not in kv]
        raise KvevalError(f"tasks: sensitivity.layers selects layers {', '.join(map(str, others[:8]))} that hold no "
                          f"K/V (linear-attention, Mamba or MLP-only layers); the model's K/V layers are "
                          f"{', '.join(map(str, kv[:16]))}{', ...' if len(kv) > 16 else ''}")
    if not held:
        raise KvevalError(f"tasks: sensitivity.layers '{selector}' selects no layer that holds K/V")
    return held


def check(ctx, params: Params) -> None:
    from kveval.memory.fit import check_policy
    from kveval.models import model_arch, model_context_limit
    from kveval.tasks.sensitivity.scan import cell_policy, check_reusable

    layers = scanned_layers(params.layers, ctx.info)
    arch = model_arch(ctx.model)
    for spec in params.specs:
        check_policy(arch, cell_policy(layers[0], "key", spec))  # group sizes (of what the spec quantizes)
        check_policy(arch, cell_policy(layers[0], "value", spec))
    limit = model_context_limit(ctx.model)
    if params.seq_len > limit:
        raise KvevalError(f"tasks: sensitivity.seq_len {params.seq_len} is longer than the model's context ({limit})")
    if ctx.tokens().numel() < params.seq_len:
        raise KvevalError(f"the corpus has {ctx.tokens().numel()} tokens, fewer than one window of {params.seq_len}")
    if not params.naive:
        check_reusable(ctx.model)


def baseline_terms(base_logits: torch.Tensor) -> dict:
    """What every cell of a window compares against, computed once: p_base ``[n, vocab]`` (float64),
    Σ_v p_base log p_base ``[n]`` and the baseline's argmax ``[n]``."""
    logp = torch.log_softmax(base_logits.double(), dim=-1)
    p = logp.exp()
    return {"p": p, "neg_entropy": torch.linalg.vecdot(p, logp), "argmax": top_index(base_logits)}


def compare(base: dict, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Sums over positions of KL(P_base || P), NLL and top-1 agreement; logits ``[n, vocab]``, targets ``[n]``.

    The maths of ``stats.compare_logits`` in float64, rearranged so that a cell costs one log-sum-exp and one
    dot product: with log p = z - lse(z), KL = Σ p_base log p_base - Σ p_base z + lse(z).
    """
    z = logits.double()
    lse = torch.logsumexp(z, dim=-1)
    kld = (base["neg_entropy"] - torch.linalg.vecdot(base["p"], z) + lse).clamp(min=0.0)
    nll = lse - z.gather(-1, targets[:, None]).squeeze(-1)
    agree = top_index(logits) == base["argmax"]
    return {"kld_sum": float(kld.sum()), "nll_sum": float(nll.sum()), "agree_sum": float(agree.sum())}


def run(ctx, params: Params) -> dict:
    from kveval.tasks.sensitivity.scan import baseline_prefix, cell_policy, naive_logits, replay, verify_replay

    layers = scanned_layers(params.layers, ctx.info)
    cells = [(i, t, s) for s in params.specs for i in layers for t in params.tensors]
    windows = list(token_windows(ctx.tokens(), params.seq_len, max_tokens=params.max_tokens))
    token_end = max(w.end for w in windows)
    done = ctx.run.done_keys()
    todo = [(w, [c for c in cells if _key(w.index, c) not in done]) for w in windows]
    todo = [(w, cs) for w, cs in todo if cs or _key(w.index) not in done]
    skipped = sum(len(cells) - len(cs) for _, cs in todo) + (len(windows) - len(todo)) * len(cells)
    if skipped:
        ctx.progress.log(f"sensitivity: resuming, {skipped} of {len(windows) * len(cells)} cells already recorded")
    mode = "naive" if params.naive else "reuse"
    model, verified = ctx.model, False
    dtype = ctx.cfg.model.dtype
    with ctx.progress.task(f"sensitivity ({mode})", total=sum(len(cs) for _, cs in todo), unit="cell") as advance:
        for w, cs in todo:
            ids = w.input_ids.to(model.device)[None]
            where = f"scan window {w.index} (corpus tokens {w.start}-{w.end})"
            prefix = baseline_prefix(model, ids, capture=not params.naive)
            sl = w.logits_slice
            targets = ids[0, w.score_from:]
            check_finite_logits(prefix.logits[0, sl], where=where, dtype=dtype)
            base = baseline_terms(prefix.logits[0, sl])
            if not params.naive and not verified:
                verify_replay(model, prefix)
                verified = True
            if _key(w.index) not in done:
                fp = compare(base, prefix.logits[0, sl], targets)
                ctx.run.append({"key": _key(w.index), "task": NAME, "window": w.index, "n_tokens": w.n_scored,
                                "nll_sum": fp["nll_sum"]})
            for layer, tensor, spec in cs:
                policy = cell_policy(layer, tensor, spec)
                cell = f"scan cell layer {layer} {tensor}s under {spec}"
                with finite_quantizer_inputs(where, cell):
                    logits = naive_logits(model, ids, policy) if params.naive else replay(model, prefix, layer, policy)
                check_finite_logits(logits[0, sl], where=where, dtype=dtype, quantized_by=cell)
                rec = {"key": _key(w.index, (layer, tensor, spec)), "task": NAME, "window": w.index,
                       "layer": layer, "tensor": tensor, "spec": spec, "n_tokens": w.n_scored, "mode": mode}
                rec.update(compare(base, logits[0, sl], targets))
                ctx.run.append(rec)
                advance(1)
    out = aggregate(ctx.run.records(), params)
    out["sensitivity"]["token_end"] = token_end  # the scan read corpus tokens [0, token_end)
    return out


def aggregate(records: list[dict], params: Params) -> dict:
    """metrics.json's ``sensitivity`` section from the records (pure)."""
    base_n = base_nll = 0.0
    sums: dict[tuple, list[float]] = {}
    for rec in records:
        if rec.get("task") != NAME:
            continue
        if "layer" not in rec:
            base_n, base_nll = base_n + rec["n_tokens"], base_nll + rec["nll_sum"]
            continue
        s = sums.setdefault((rec["layer"], rec["tensor"], rec["spec"]), [0.0, 0.0, 0.0, 0.0])
        for j, k in enumerate(("n_tokens", "kld_sum", "nll_sum", "agree_sum")):
            s[j] += rec[k]
    base_nll_mean = base_nll / base_n if base_n else math.nan
    cells = []
    for (layer, tensor, spec), (n, kld, nll, agree) in sorted(
        sums.items(), key=lambda kv: (params.specs.index(kv[0][2]) if kv[0][2] in params.specs else 99, kv[0][0],
                                      kv[0][1])
    ):
        delta = nll / n - base_nll_mean
        cells.append({"layer": layer, "tensor": tensor, "spec": spec, "kld": kld / n, "nll_delta": delta,
                      "delta_ppl_pct": 100.0 * math.expm1(delta), "top1_agree": agree / n, "tokens": int(n)})
    specs = [s for s in params.specs if any(c["spec"] == s for c in cells)]
    ranking, layer_ranking, k_vs_v = {}, {}, {}
    for spec in specs:
        mine = [c for c in cells if c["spec"] == spec]
        ranking[spec] = [{k: c[k] for k in ("layer", "tensor", "kld", "delta_ppl_pct")}
                         for c in sorted(mine, key=lambda c: -c["kld"])]
        per_layer: dict[int, float] = {}
        for c in mine:
            per_layer[c["layer"]] = per_layer.get(c["layer"], 0.0) + c["kld"]
        layer_ranking[spec] = sorted(per_layer, key=lambda i: -per_layer[i])
        k = {c["layer"]: c["kld"] for c in mine if c["tensor"] == "key"}
        v = {c["layer"]: c["kld"] for c in mine if c["tensor"] == "value"}
        if k and v:
            ks, vs = sum(k.values()), sum(v.values())
            both = [i for i in k if i in v]
            k_vs_v[spec] = {
                "key_kld_sum": ks, "value_kld_sum": vs,
                "ratio_key_over_value": ks / vs if vs > 0 else math.inf,
                "layers_key_worse": sum(1 for i in both if k[i] > v[i]), "layers_compared": len(both),
                "more_sensitive": "key" if ks > vs else "value",
            }
    base_ppl = math.exp(base_nll_mean) if base_n else None
    return {"sensitivity": {
        "mode": "naive" if params.naive else "reuse", "specs": specs, "seq_len": params.seq_len,
        "tokens": int(base_n), "baseline": {"ppl": base_ppl, "nll_mean": base_nll_mean},
        "cells": cells, "ranking": ranking, "layer_ranking": layer_ranking, "k_vs_v": k_vs_v,
    }}
