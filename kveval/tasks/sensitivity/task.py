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
emulation's) stops the scan with one line before that record is written (:mod:`kveval.tasks.common.finite`): no cell's
KLD is ever NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kveval.data import token_windows
from kveval.errors import KvevalError
from kveval.policy.selectors import layers_of
from kveval.stats import top_index
from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs
from kveval.tasks.common.runner import Unit, Work, run_units
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
    """Per window: the FP pass (kept, for the reuse mode, as the prefix every cell replays from) and its baseline
    record, then one record per (layer, tensor, spec) cell not yet recorded
    (:func:`kveval.tasks.common.runner.run_units`); then the ``sensitivity`` metrics from every record."""
    from kveval.tasks.sensitivity.scan import baseline_prefix, cell_policy, naive_logits, replay, verify_replay

    layers = scanned_layers(params.layers, ctx.info)
    cells = [(i, t, s) for s in params.specs for i in layers for t in params.tensors]
    windows = list(token_windows(ctx.tokens(), params.seq_len, max_tokens=params.max_tokens))
    token_end = max(w.end for w in windows)
    units = [Unit(_key(w.index, cell), (w, cell), group=w.index, steps=0 if cell is None else 1,
                  amount=0 if cell is None else 1, tally=None if cell is None else (w.index, cell))
             for w in windows for cell in (None, *cells)]
    mode = "naive" if params.naive else "reuse"
    model, dtype = ctx.model, ctx.cfg.model.dtype
    verified = []

    def prepare(group: list[Unit]) -> dict:
        """The window's FP pass, its logits checked finite, and the baseline's terms every cell is compared with."""
        w = group[0].item[0]
        ids = w.input_ids.to(model.device)[None]
        prefix = baseline_prefix(model, ids, capture=not params.naive)
        check_finite_logits(prefix.logits[0, w.logits_slice], where=_where(w), dtype=dtype)
        if not params.naive and not verified:
            verify_replay(model, prefix)
            verified.append(True)
        return {"ids": ids, "prefix": prefix, "base": baseline_terms(prefix.logits[0, w.logits_slice]),
                "targets": ids[0, w.score_from:]}

    def evaluate(batch: list[Unit], state: dict) -> Iterator[dict]:
        for unit in batch:
            w, cell = unit.item
            sl = w.logits_slice
            if cell is None:
                fp = compare(state["base"], state["prefix"].logits[0, sl], state["targets"])
                yield {"key": unit.key, "task": NAME, "window": w.index, "n_tokens": w.n_scored,
                       "nll_sum": fp["nll_sum"]}
                continue
            layer, tensor, spec = cell
            policy = cell_policy(layer, tensor, spec)
            named = f"scan cell layer {layer} {tensor}s under {spec}"
            with finite_quantizer_inputs(_where(w), named):
                logits = naive_logits(model, state["ids"], policy) if params.naive else \
                    replay(model, state["prefix"], layer, policy)
            check_finite_logits(logits[0, sl], where=_where(w), dtype=dtype, quantized_by=named)
            rec = {"key": unit.key, "task": NAME, "window": w.index, "layer": layer, "tensor": tensor, "spec": spec,
                   "n_tokens": w.n_scored, "mode": mode}
            rec.update(compare(state["base"], logits[0, sl], state["targets"]))
            yield rec

    run_units(ctx, NAME, units, Work(label=f"sensitivity ({mode})", noun="cells", evaluate=evaluate, prepare=prepare,
                                     rate_unit="cell"))
    out = aggregate(ctx.run.records(), params)
    out["sensitivity"]["token_end"] = token_end  # the scan read corpus tokens [0, token_end)
    return out


def _where(w) -> str:
    """A window in words, for the non-finite line."""
    return f"scan window {w.index} (corpus tokens {w.start}-{w.end})"


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
