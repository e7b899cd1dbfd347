"""The report's "Reading": a few sentences read off a run's numbers (:func:`reading_of`), and the tables they
cite (:func:`worst_layers_table`).
"""

from __future__ import annotations

import pandas as pd

from kveval.report import tables
from kveval.report.sections import task_reporting
from kveval.report.tables import format_general as _g
from kveval.report.tables import is_number as _ok
from kveval.results import BASELINE, RunResults


def _spec_rank(spec) -> float:
    if spec.is_none:
        return 16
    return 8 if spec.format.startswith("fp8") else float(spec.bits or 16)


def kv_pairs(r: RunResults) -> list[tuple[str, str]]:
    """Pairs (low-bit-keys policy, low-bit-values policy) that differ only by swapping the K and V specs
    (e.g. k4v8 and k8v4)."""
    from kveval.policy import KVPolicy
    from kveval.results.read import CONFIG_ERRORS

    pols = {}
    for p in r.policies:
        try:
            pols[p] = KVPolicy.from_config(r.policy_config(p), name=p)
        except CONFIG_ERRORS:  # a policy this kveval cannot read (the run's summary says so): in no pair
            continue
    out = []
    names = list(pols)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = pols[a], pols[b]
            if pa.layers or pb.layers or pa.key == pa.value:
                continue
            same_windows = (pa.residual, pa.residual_mode, pa.sink_tokens, pa.prefill) == (
                pb.residual, pb.residual_mode, pb.sink_tokens, pb.prefill)
            if pa.key == pb.value and pa.value == pb.key and same_windows:
                if _spec_rank(pa.key) < _spec_rank(pa.value):
                    out.append((a, b))
                elif _spec_rank(pb.key) < _spec_rank(pb.value):
                    out.append((b, a))
    return out


def reading_of(r: RunResults) -> list[str]:
    """A few sentences read off the numbers: K vs V sensitivity (only when the run holds K/V-swapped policies),
    the cheapest policy within the threshold, error by position, worst layers, the weights x KV interaction, then
    each task's own sentences (its reporting plug-in's ``reading``)."""
    out: list[str] = []
    s = r.summary.set_index("policy")
    from kveval.policy import KVPolicy

    for lowk, lowv in kv_pairs(r):
        if lowk not in s.index or lowv not in s.index:
            continue
        a, b = s.loc[lowk], s.loc[lowv]
        pk = KVPolicy.from_config(r.policy_config(lowk), name=lowk)
        lab_k = f"K{pk.key.bits_label}/V{pk.value.bits_label}"
        lab_v = f"K{pk.value.bits_label}/V{pk.key.bits_label}"
        da, db = a["delta_ppl_pct"], b["delta_ppl_pct"]
        if not (_ok(da) and _ok(db)):
            continue
        overlap = (_ok(a["kld_ci95_lo"]) and _ok(b["kld_ci95_lo"])
                   and a["kld_ci95_lo"] <= b["kld_ci95_hi"] and b["kld_ci95_lo"] <= a["kld_ci95_hi"])
        costs = (f"{lab_k} ({lowk}) costs {da:+.2f}% ΔPPL (KLD {_g(a['kld_mean'])}), "
                 f"{lab_v} ({lowv}) {db:+.2f}% (KLD {_g(b['kld_mean'])})")
        if overlap:
            out.append(f"Keys and values are about equally sensitive on this model (the KLD intervals overlap): "
                       f"{costs}.")
        else:
            which = "Keys are more sensitive than values" if da > db else "Values are more sensitive than keys"
            out.append(f"{which} on this model: {costs}.")
    thr = r.threshold.get("delta_ppl_pct")
    q = s.drop(index=BASELINE, errors="ignore")
    if len(q) and "verdict" in q:
        ok = q[q["verdict"].isin(["pass", "within_noise"])]
        crit = f"ΔPPL ≤ {thr:g}%" if thr is not None else "the threshold"
        cost_col = "bytes_per_token" if q["bytes_per_token"].notna().any() else "bits_per_element"
        if len(ok):
            best = ok.sort_values([cost_col, "delta_ppl_pct"]).index[0]
            row = ok.loc[best]
            mem = _mem_words(row)
            out.append(f"The cheapest policy within {crit}: {best}{mem}, ΔPPL {row['delta_ppl_pct']:+.2f}%"
                       + (f", KLD {_g(row['kld_mean'])}" if _ok(row["kld_mean"]) else "") + ".")
            cheaper = q[(q[cost_col] < row[cost_col]) & ~q.index.isin(ok.index)] if _ok(row[cost_col]) else q.iloc[:0]
            if len(cheaper):
                nxt = cheaper.sort_values(cost_col, ascending=False).index[0]
                verdict = str(cheaper.loc[nxt, "verdict"] or "")
                said = {"fail": "fails", "inconclusive": "is inconclusive at this run's size"}.get(verdict,
                                                                                                  "is not within it")
                out.append(f"The next cheaper policy, {nxt}{_mem_words(cheaper.loc[nxt])}, {said} with ΔPPL "
                           f"{cheaper.loc[nxt, 'delta_ppl_pct']:+.2f}% (its verdict: {verdict or 'none'}).")
        elif q["delta_ppl_pct"].notna().any():
            best = q["delta_ppl_pct"].idxmin()
            out.append(f"No policy stays within {crit}; the least damaging is {best} "
                       f"(ΔPPL {q.loc[best, 'delta_ppl_pct']:+.2f}%).")
    # error by position, for the most damaging policy
    pos = r.positions[(r.positions["policy"] != BASELINE) & r.positions["kld"].notna()]
    if not pos.empty and len(q) and q["kld_mean"].notna().any():
        worst = q["kld_mean"].idxmax()
        g = pos[pos["policy"] == worst].sort_values("bin")
        if len(g) >= 2 and g["kld"].iloc[0] > 0:
            first, last = g["kld"].iloc[0], g["kld"].iloc[-1]
            ratio = last / first
            trend = "grows" if ratio > 1.25 else "shrinks" if ratio < 0.8 else "stays about flat"
            out.append(f"Along the window, the KLD of {worst} {trend} from {_g(first)} (positions "
                       f"{_span(g.iloc[0])}) to {_g(last)} (positions {_span(g.iloc[-1])}), ×{ratio:.2f}.")
    worst_tab = worst_layers_table(r, n=3)
    if not worst_tab.empty and len(q) and q["delta_ppl_pct"].notna().any():
        worst = q["delta_ppl_pct"].idxmax()
        hit = worst_tab[worst_tab["policy"] == worst]
        if len(hit):
            w = hit.iloc[0]
            out.append(f"Worst layers under {worst} (the most damaging policy): keys {w['worst key layers']}, "
                       f"values {w['worst value layers']} (relative MSE averaged over layers: keys "
                       f"{w['mean key rel MSE']}, values {w['mean value rel MSE']}; the table below lists every "
                       "policy).")
    out.extend(_weights_reading(r))
    for plugin in task_reporting().values():  # each task's own sentences (kveval.report.sections)
        if plugin.reading is not None:
            out.extend(plugin.reading(r))
    return out


def _weights_reading(r: RunResults) -> list[str]:
    """One sentence per weight variant: its effect alone, and for how many KV policies the combination's KLD is
    worse than the sum of the two single effects (significantly: the 95% interval of the excess above 0)."""
    df = tables.weights_frame(r)
    out = []
    for vname, g in df.groupby("weights", sort=False):
        alone = g[g["policy"] == BASELINE]
        pairs = g[(g["policy"] != BASELINE) & g["kld_excess"].notna()]
        if alone.empty or pairs.empty:
            continue
        a = alone.iloc[0]
        worse = pairs[pairs["kld_worse_than_sum"] == True]  # noqa: E712 - an object column of bools
        sure = worse[worse["kld_interaction"] == "superadditive"]
        top = pairs.loc[pairs["kld_excess"].astype(float).idxmax()]
        out.append(f"Weights {vname} alone cost ΔPPL {a['delta_ppl_pct']:+.2f}% (KLD {_g(a['kld_mean'])}); with a "
                   f"quantized cache the KLD is worse than the sum of the two effects for {len(worse)} of "
                   f"{len(pairs)} policies ({len(sure)} beyond the 95% interval); the largest excess is "
                   f"{top['policy']}'s, {float(top['kld_excess']):+.3g} ({_g(top['kld_sum'])} expected, "
                   f"{_g(top['kld_mean'])} measured).")
    return out


def worst_layers_table(r: RunResults, n: int = 3) -> pd.DataFrame:
    """Per policy: the ``n`` layers with the largest key and value relative MSE, and the means."""
    lay = r.layers
    rows = []
    if lay.empty or "key_rel_mse" not in lay or "value_rel_mse" not in lay:
        return pd.DataFrame()
    for p, g in lay.groupby("policy", sort=False):
        k = g.nlargest(n, "key_rel_mse")
        v = g.nlargest(n, "value_rel_mse")
        rows.append({
            "policy": p,
            "worst key layers": ", ".join(str(int(x)) for x in k["layer"]),
            "key rel MSE": ", ".join(_g(x) for x in k["key_rel_mse"]),
            "worst value layers": ", ".join(str(int(x)) for x in v["layer"]),
            "value rel MSE": ", ".join(_g(x) for x in v["value_rel_mse"]),
            "mean key rel MSE": _g(g["key_rel_mse"].mean()),
            "mean value rel MSE": _g(g["value_rel_mse"].mean()),
        })
    return pd.DataFrame(rows)


def _mem_words(row) -> str:
    parts = []
    if _ok(row.get("bits_per_element")):
        parts.append(f"{row['bits_per_element']:.2f} bits/element")
    if _ok(row.get("compression_vs_fp16")):
        parts.append(f"{row['compression_vs_fp16']:.2f}× smaller than FP16")
    return f" ({', '.join(parts)})" if parts else ""


def _span(row) -> str:
    return f"{int(row['start'])}-{int(row['end'])}" if _ok(row["start"]) and _ok(row["end"]) else f"bin {row['bin']}"


__all__ = ["kv_pairs", "reading_of", "worst_layers_table"]
