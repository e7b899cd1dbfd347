"""The predicted per-layer, per-K/V sensitivity, in the form of a scan's ``sensitivity`` section (so that
``kveval plan --from-inspect`` plans from it), and its rank correlation with a measured scan.

A cell ``(layer, tensor, spec)`` is predicted from the relative error that quantizing only that tensor, uniformly
at ``spec``, causes in that layer's attention output (``output_rel`` of the ``keys_only`` / ``values_only``
variants, ``kveval.inspect.measure``), scaled so that the cells of one spec add up to the KLD (and ΔNLL) of one
emulated pass with every layer at that spec, measured on the same windows (``calibration``). Each layer's error
is computed from its captured inputs alone, so a cell ignores how the layers before it changed them: that is what
makes it a prediction (``predicted: true``), not a scan.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kveval.inspect.capture import Window
from kveval.inspect.measure import Measurements
from kveval.inspect.variants import Variant, variants
from kveval.policy import KVPolicy
from kveval.stats import llama_token_values, spearman

TENSORS = ("key", "value")
ROWS = 128  # logit rows compared at a time


def spec_variants(specs: list[str], measured: list[Variant]) -> tuple[list[Variant], dict[str, str]]:
    """The ``keys_only`` / ``values_only`` variants of each uniform ``spec`` policy not measured already (a
    candidate that is exactly the spec's policy is reused), and spec -> the base name its variants go by."""
    have = {(v.base, v.change): v for v in measured}
    out, names = [], {}
    for spec in specs:
        policy = KVPolicy.preset(spec)
        same = [v.base for (b, c), v in have.items() if c == "as_is" and replace(v.policy, name=spec) == policy]
        if same:
            names[spec] = same[0]
            continue
        names[spec] = f"scan:{spec}"
        out += [v for v in variants(names[spec], spec, policy)[0] if v.change in ("keys_only", "values_only")]
    return out, names


@torch.no_grad()
def effect(model, windows: list[Window], policy: KVPolicy) -> dict:
    """The mean KLD and ΔNLL per scored token of one emulated pass per window under ``policy``, against the
    windows' full-precision logits."""
    from kveval.patch import emulate

    kld = nll = 0.0
    n = 0
    for w in windows:
        with emulate(model, policy):
            logits = model(w.ids, use_cache=False).logits[0]
        assert w.logits is not None
        T = logits.shape[0] - 1
        for a in range(0, T, ROWS):  # rows at a time: the float64 softmaxes of a window at once are GBs
            b = min(a + ROWS, T)
            m = llama_token_values(w.logits[a:b], logits[a:b], w.ids[0, a + 1:b + 1])
            kld += float(m["kld"].sum())
            nll += float((m["nll"] - m["nll_base"]).sum())
        n += T
    return {"kld": kld / n, "nll_delta": nll / n, "tokens": n}


def sensitivity_section(meas: Measurements, specs: list[str], names: dict[str, str], effects: dict[str, dict],
                        seq_len: int, tokens: int, token_end: int) -> dict:
    """A scan's ``sensitivity`` section (``kveval.tasks.sensitivity.task.aggregate``'s fields the planner reads)
    holding the predicted cells, with ``predicted: true``, each cell's ``output_rel`` and each spec's
    ``calibration`` (the uniform pass and the factor from the summed ``output_rel`` to its KLD)."""
    cells: list[dict] = []
    calibration: dict[str, dict] = {}
    for spec in specs:
        proxies = {(i, t): s.output_rel for (v, i), s in meas.sums.items() for t in TENSORS
                   if v == f"{names[spec]}+{t}s_only"}
        total = sum(proxies.values())
        eff = effects[spec]
        k_factor = eff["kld"] / total if total > 0 else 0.0
        n_factor = eff["nll_delta"] / total if total > 0 else 0.0
        calibration[spec] = {**eff, "output_rel_sum": total, "kld_per_output_rel": k_factor}
        for (i, t), p in sorted(proxies.items()):
            kld = p * k_factor
            cells.append({"layer": i, "tensor": t, "spec": spec, "kld": kld, "nll_delta": p * n_factor,
                          "delta_ppl_pct": 100.0 * math.expm1(p * n_factor), "output_rel": p, "tokens": tokens})
    ranking = {s: [{k: c[k] for k in ("layer", "tensor", "kld", "delta_ppl_pct")}
                   for c in sorted((c for c in cells if c["spec"] == s), key=lambda c: -c["kld"])] for s in specs}
    return {"mode": "predicted", "predicted": True, "specs": list(specs), "seq_len": seq_len, "tokens": tokens,
            "token_end": token_end, "cells": cells, "ranking": ranking, "calibration": calibration}


def against_scan(predicted: dict, scan: dict) -> dict:
    """Per spec present in both: Spearman's rank correlation between the predicted cells and a scan's measured
    ones (``scan``: a scan's metrics.json), over every (layer, tensor), over keys and over values, and how many of
    the scan's 5 most sensitive cells the prediction's 5 hold."""
    measured = {(c["layer"], c["tensor"], c["spec"]): c["kld"] for c in scan["sensitivity"]["cells"]}
    out = {}
    for spec in predicted["specs"]:
        pairs = [(c["kld"], measured[(c["layer"], c["tensor"], spec)], c["tensor"], c["layer"])
                 for c in predicted["cells"] if c["spec"] == spec and (c["layer"], c["tensor"], spec) in measured]
        if len(pairs) < 3:
            continue
        top = {(t, i) for _, _, t, i in sorted(pairs, key=lambda p: -p[1])[:5]}
        mine = {(t, i) for _, _, t, i in sorted(pairs, key=lambda p: -p[0])[:5]}
        out[spec] = {"cells": len(pairs), "spearman": spearman([p[0] for p in pairs], [p[1] for p in pairs]),
                     **{f"spearman_{t}": spearman([p[0] for p in pairs if p[2] == t], [p[1] for p in pairs if p[2] == t])
                        for t in TENSORS},
                     "top5_shared": len(top & mine)}
    return out
