"""The report's figures, from loaded results (:func:`kveval.results.load`); matplotlib, no pyplot state.

Every function takes one :class:`RunResults` (or a list, for the cross-run plot) and returns a
``matplotlib.figure.Figure``, or ``None`` when the run holds nothing to draw (a task that did not run). In a
notebook the figure displays itself; :func:`save` writes it as a PNG. Colours are the Okabe-Ito palette (safe for
the common colour-vision deficiencies) and every series also has its own marker or line style, so the figures
read in greyscale print too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kveval.report.style import (
    BASELINE_COLOR,
    KIB,
    OKABE_ITO,
    bytes_label,
    color,
    log_scale_ok,
    marker,
    pareto_front,
    place_labels,
    policy_styles,
    readable_linthresh,
    save,
    scale_note,
    symlog_axis,
    use_symlog,
)
from kveval.results import BASELINE, RunResults

# ------------------------------------------------------------------------------------------- quality vs memory


def quality_vs_memory(runs: RunResults | Sequence[RunResults]) -> Figure | None:
    """ΔPPL % and KLD against KV bytes per token, one point per policy (the FP16 baseline at ΔPPL 0), the Pareto
    front (cheapest policy for each level of damage) as a dashed step line, the configured threshold as a red
    line and, when measured, the noise floor as a grey band. Several runs: colour and marker per run, policy
    names written beside the points."""
    runs = [runs] if isinstance(runs, RunResults) else list(runs)
    frames = [r.summary for r in runs if not r.summary.empty]
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    df = df[df["bytes_per_token"].notna() & df["delta_ppl_pct"].notna()]
    if not (df["policy"] != BASELINE).any():
        return None
    multi = len(runs) > 1
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_p, ax_k = fig.subplots(1, 2)
    style = policy_styles(list(df["policy"]))
    run_names = list(dict.fromkeys(df["run"]))
    jobs = []
    for ax, col, label in ((ax_p, "delta_ppl_pct", "ΔPPL vs FP16 baseline (%)"),
                           (ax_k, "kld_mean", "KL divergence from baseline (nats/token)")):
        sub = df if col == "delta_ppl_pct" else df[(df["policy"] != BASELINE) & df[col].notna()]
        if sub.empty:
            ax.set_visible(False)
            continue
        labels = []
        for _, row in sub.iterrows():
            if multi:
                k = run_names.index(row["run"])
                c, m = (BASELINE_COLOR, marker(k)) if row["policy"] == BASELINE else (color(k), marker(k))
            else:
                c, m = style[row["policy"]]
            yerr = None
            if col == "kld_mean" and np.isfinite(row["kld_ci95_lo"]) and np.isfinite(row["kld_ci95_hi"]):
                yerr = [[max(row[col] - row["kld_ci95_lo"], 0)], [max(row["kld_ci95_hi"] - row[col], 0)]]
            ax.errorbar(row["bytes_per_token"] / KIB, row[col], yerr=yerr, fmt=m, color=c, ms=8, mec="black",
                        mew=0.6, capsize=3, zorder=3)
            labels.append((row["bytes_per_token"] / KIB, row[col], row["policy"], row["run"]))
        jobs.append((ax, labels))
        front = pareto_front(list(sub["bytes_per_token"]), list(sub[col]))
        if len(front) > 1:
            fx = [sub["bytes_per_token"].iloc[i] / KIB for i in front]
            fy = [sub[col].iloc[i] for i in front]
            ax.step(fx, fy, where="post", ls="--", color="#444444", lw=1, zorder=2, label="Pareto front")
        thr_key = "delta_ppl_pct" if col == "delta_ppl_pct" else "kld"
        thrs = {r.threshold.get(thr_key) for r in runs if r.threshold.get(thr_key) is not None}
        for t in sorted(thrs):
            ax.axhline(t, color="#D55E00", lw=1.2, ls="-", zorder=1,
                       label=f"threshold {t:g}{'%' if col == 'delta_ppl_pct' else ''}")
        noise_col = "noise_floor_ppl_pct" if col == "delta_ppl_pct" else "noise_floor_kld"
        noise = df[noise_col].dropna()
        if len(noise):
            hi = float(noise.max())
            lo = -hi if col == "delta_ppl_pct" else 0
            ax.axhspan(lo, hi, color="#999999", alpha=0.25, lw=0, zorder=0, label=f"noise floor (±{hi:.3g})")
        vals = list(sub[col])
        if col == "kld_mean":
            if log_scale_ok(vals):
                ax.set_yscale("log")
            base = df[df["policy"] == BASELINE]["bytes_per_token"].dropna()
            if len(base) and not multi:  # KLD 0 has no place on a log axis: say where the baseline is
                ax.text(0.98, 0.03, f"FP16 baseline: KLD 0 at {float(base.iloc[0]) / KIB:.1f} KiB/token",
                        transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="#444444")
        elif use_symlog(vals, readable_linthresh(vals, max(thrs) if thrs else 1.0)):
            symlog_axis(ax, vals, readable_linthresh(vals, max(thrs) if thrs else 1.0))
        ax.set_xlabel("KV cache per token (KiB; all layers, K+V, scales included)")
        ax.set_ylabel(label + scale_note(ax))
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.15, y=0.12)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    if multi:  # one legend entry per run
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], ls="", marker=marker(k), color=color(k), mec="black", label=n)
                   for k, n in enumerate(run_names)]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8,
                   title="run")
    models = list(dict.fromkeys(_model(r) for r in runs))
    fig.suptitle(f"{', '.join(models)}: quality vs KV memory per token (lower left is better)")
    place_labels(fig, jobs, multi)
    return fig


def _model(res: RunResults) -> str:
    """The model a run evaluated, for plot titles (the run's name names a policy as often as not)."""
    model = (res.metrics or {}).get("model")
    return str(model) if model else res.name


# ------------------------------------------------------------------------------------------- per-policy bars


def policy_bars(res: RunResults) -> Figure | None:
    """ΔPPL % and mean KLD per policy, KLD with its 95% bootstrap CI, the threshold as a line, bars coloured by
    verdict (hatched when failing)."""
    df = res.summary[(res.summary["policy"] != BASELINE) & res.summary["delta_ppl_pct"].notna()]
    if df.empty:
        return None
    fig = Figure(figsize=(max(6.5, 1.2 * len(df) + 3.5), 4.2), layout="constrained")
    ax_p, ax_k = fig.subplots(1, 2)
    x = np.arange(len(df))
    names = list(df["policy"])
    vcol = {"pass": "#009E73", "fail": "#D55E00", "within_noise": "#56B4E9", "inconclusive": "#F0E442"}
    colors = [vcol.get(v, "#999999") for v in df["verdict"]]
    hatches = ["//" if v == "fail" else "" for v in df["verdict"]]
    bars = ax_p.bar(x, df["delta_ppl_pct"], color=colors, edgecolor="black", lw=0.6)
    for b, h in zip(bars, hatches):
        b.set_hatch(h)
    thr = res.threshold.get("delta_ppl_pct")
    if thr is not None:
        ax_p.axhline(thr, color="black", ls="--", lw=1, label=f"threshold {thr:g}%")
    noise = df["noise_floor_ppl_pct"].dropna()
    if len(noise):
        ax_p.axhspan(-float(noise.max()), float(noise.max()), color="#999999", alpha=0.25, lw=0,
                     label="noise floor")
    for xi, v in zip(x, df["delta_ppl_pct"]):
        ax_p.annotate(f"{v:+.2f}%", (xi, v), xytext=(0, 3 if v >= 0 else -11), textcoords="offset points",
                      ha="center", fontsize=8)
    linthresh = readable_linthresh(list(df["delta_ppl_pct"]), thr or 1.0)
    if use_symlog(list(df["delta_ppl_pct"]), linthresh):
        symlog_axis(ax_p, list(df["delta_ppl_pct"]), linthresh)
    ax_p.margins(y=0.12)
    ax_p.set_ylabel("ΔPPL vs FP16 baseline (%)" + scale_note(ax_p))
    ax_p.set_title("Perplexity increase")
    ax_k.set_title("KL divergence, 95% CI")
    kd = df[df["kld_mean"].notna()]
    if not kd.empty:
        xk = np.array([names.index(p) for p in kd["policy"]])
        lo = (kd["kld_mean"] - kd["kld_ci95_lo"]).clip(lower=0).fillna(0)
        hi = (kd["kld_ci95_hi"] - kd["kld_mean"]).clip(lower=0).fillna(0)
        bars = ax_k.bar(xk, kd["kld_mean"], color=[colors[i] for i in xk], edgecolor="black", lw=0.6,
                        yerr=[lo, hi], capsize=4)
        for b, i in zip(bars, xk):
            b.set_hatch(hatches[i])
        kthr = res.threshold.get("kld")
        if kthr is not None:
            ax_k.axhline(kthr, color="black", ls="--", lw=1, label=f"threshold {kthr:g}")
        if log_scale_ok(list(kd["kld_mean"])):
            ax_k.set_yscale("log")
    ax_k.set_ylabel("mean KLD (nats/token)")
    ax_k.margins(y=0.1)
    from matplotlib.patches import Patch

    legend = [Patch(facecolor=c, edgecolor="black", hatch="//" if v == "fail" else "", label=v)
              for v, c in vcol.items() if v in set(df["verdict"])]
    for ax in (ax_p, ax_k):
        ax.set_xticks(x, names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlabel("policy")
    ax_p.legend(handles=legend + ax_p.get_legend_handles_labels()[0], fontsize=8)
    fig.suptitle(f"{_model(res)}: ΔPPL and KLD per policy", fontsize=11)
    return fig


# ------------------------------------------------------------------------------------------- by position


def by_position(res: RunResults) -> Figure | None:
    """Loss increase over the baseline and KLD per token-position bin, one line per policy: does the damage
    grow with context?"""
    pos = res.positions[(res.positions["policy"] != BASELINE)]
    if pos.empty:
        return None
    style = policy_styles([BASELINE, *res.policies])
    fig = Figure(figsize=(11, 4.7), layout="constrained")
    ax_l, ax_k = fig.subplots(1, 2)
    for i, (pname, g) in enumerate(pos.groupby("policy", sort=False)):
        c, m = style.get(pname, (color(i), marker(i)))
        ls = ["-", "--", "-.", ":"][i % 4]
        ax_l.plot(g["center"], g["delta_loss"], marker=m, color=c, ls=ls, label=pname, mec="black", mew=0.5)
        if g["kld"].notna().any():
            ax_k.plot(g["center"], g["kld"], marker=m, color=c, ls=ls, label=pname, mec="black", mew=0.5)
    ax_l.axhline(0, color=BASELINE_COLOR, lw=1)
    ax_l.set_ylabel("Δ loss vs baseline (nats/token)")
    ax_l.set_title("Loss increase by position")
    ax_k.set_ylabel("mean KLD (nats/token)")
    ax_k.set_title("KL divergence by position")
    if log_scale_ok(list(pos["kld"])):
        ax_k.set_yscale("log")
    for ax in (ax_l, ax_k):
        ax.set_xlabel("token position in the window (bin centre)")
        ax.grid(True, alpha=0.3)
    handles, labels = ax_l.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8)
    fig.suptitle(f"{_model(res)}: error by token position")
    return fig


# ------------------------------------------------------------------------------------------- memory


def memory_bars(res: RunResults) -> Figure | None:
    """KV bytes per token of each policy (FP16 baseline first), stacked: codes, scales (+ zero points),
    full-precision residual (windows, sinks, unquantized tensors); compression vs FP16 written on top."""
    mem = res.memory
    if mem.empty:
        return None
    fig = Figure(figsize=(max(6, 0.9 * len(mem) + 3), 4.2), layout="constrained")
    ax = fig.subplots()
    ctx = int(mem["context"].iloc[0])
    x = np.arange(len(mem))
    bottom = np.zeros(len(mem))
    for part, c, h in (("codes", "#0072B2", ""), ("scales", "#E69F00", ".."), ("residual", "#999999", "//")):
        vals = (mem[part] / ctx / KIB).to_numpy(dtype=float)
        ax.bar(x, vals, bottom=bottom, color=c, hatch=h, edgecolor="black", lw=0.6,
               label={"scales": "scales + zero points (+ outliers)", "residual": "full precision"}.get(part, part))
        bottom += vals
    fp16 = mem.loc[mem["policy"] == BASELINE, "total"]
    for xi, tot in zip(x, mem["total"]):
        lab = bytes_label(tot / ctx)
        if len(fp16):
            lab += f"\n{float(fp16.iloc[0]) / tot:.2f}×"
        ax.annotate(lab, (xi, tot / ctx / KIB), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    names = ["FP16" if p == BASELINE else p for p in mem["policy"]]
    ax.set_xticks(x, names, rotation=30 if len(names) > 5 else 0, ha="right" if len(names) > 5 else "center")
    ax.set_ylabel("KV cache per token (KiB; all layers, K+V)")
    ax.set_xlabel("policy")
    ax.set_ylim(0, bottom.max() * 1.2)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"{_model(res)}: KV memory per token at {ctx} tokens\n(labels: size, compression vs FP16)",
                 fontsize=10)
    return fig


# ------------------------------------------------------------------------------------------- layers


def layer_errors(res: RunResults) -> Figure | None:
    """Relative MSE of the quantized keys and values per layer (log scale), one panel per tensor, one line per
    policy: which layers break first."""
    lay = res.layers
    if lay.empty or "key_rel_mse" not in lay:
        return None
    style = policy_styles([BASELINE, *res.policies])
    fig = Figure(figsize=(11, 4.7), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, tensor in zip(axes, ("key", "value")):
        col = f"{tensor}_rel_mse"
        if col not in lay:
            continue
        for i, (pname, g) in enumerate(lay.groupby("policy", sort=False)):
            c, m = style.get(pname, (color(i), marker(i)))
            g = g.sort_values("layer")
            ax.plot(g["layer"], g[col], marker=m, ms=4, color=c, label=pname, mec="black", mew=0.4)
        ax.set_title(f"{'Keys' if tensor == 'key' else 'Values'}")
        ax.set_xlabel("layer")
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8)
    vals = pd.concat([lay[c] for c in ("key_rel_mse", "value_rel_mse") if c in lay])
    if (vals.dropna() > 0).all() and len(vals.dropna()):
        axes[0].set_yscale("log")
    axes[0].set_ylabel("relative MSE  ‖x̂ − x‖² / ‖x‖²")
    fig.suptitle(f"{_model(res)}: quantization error per layer")
    return fig


def bits_per_layer(res: RunResults) -> Figure | None:
    """Stored bits per element of K and V in each layer, for policies with per-layer overrides (mixed precision,
    e.g. the planner's output); None when every policy is uniform."""
    from kveval.policy import KVPolicy
    from kveval.results.read import CONFIG_ERRORS

    n_layers = None
    arch = (res.metrics.get("memory") or {}).get("arch") or {}
    if isinstance(arch.get("layers"), int):
        n_layers = arch["layers"]
    elif not res.layers.empty:
        n_layers = int(res.layers["layer"].max()) + 1
    if not n_layers:
        return None
    sliding = tuple(arch.get("sliding_layers") or ())  # the run's model's sliding-window layers (memory.arch)
    mixed = {}
    for p in res.policies:
        cfg = res.policy_config(p)
        try:
            pol = KVPolicy.from_config(cfg, name=p)
        except CONFIG_ERRORS:  # a policy this kveval cannot read (the run's summary says so): not drawn here
            continue
        if pol.layers or pol.skip_sliding:
            mixed[p] = pol
    if not mixed:
        return None
    fig = Figure(figsize=(max(7, 0.25 * n_layers + 3), 1.5 + 1.6 * len(mixed)), layout="constrained")
    axes = fig.subplots(len(mixed), 1, squeeze=False)[:, 0]
    for ax, (p, pol) in zip(axes, mixed.items()):
        kb, vb = [], []
        for i in range(n_layers):
            ks, vs = pol.specs_for_layer(i, n_layers, sliding)
            kb.append(ks.code_bits)
            vb.append(vs.code_bits)
        x = np.arange(n_layers)
        ax.bar(x - 0.2, kb, 0.4, color="#0072B2", label="keys")
        ax.bar(x + 0.2, vb, 0.4, color="#E69F00", hatch="..", edgecolor="black", lw=0.3, label="values")
        ax.set_ylabel("bits")
        ax.set_title(p, fontsize=9)
        ax.set_yticks([2, 4, 8, 16])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, ncol=2)
    axes[-1].set_xlabel("layer")
    fig.suptitle(f"{_model(res)}: bits per layer of mixed-precision policies")
    return fig


# ------------------------------------------------------------------------------------------- weights x KV


def weights_x_kv(res: RunResults) -> Figure | None:
    """Weights x KV cache, one point per (weight variant, KV policy), every effect against the FP model. Left and
    middle: the combined effect (y) against the sum of the two single effects (x: weights alone + KV alone), KLD
    (log-log when every value is positive) and ΔPPL %, with the diagonal y = x: above it, the combination is worse
    than the sum. Right: the KLD excess (combined - sum) relative to the sum, with its 95% bootstrap interval.
    Colour: weight variant; marker: KV policy. None when the run had no weight variants."""
    from kveval.report.tables import weights_frame

    df = weights_frame(res)
    df = df[(df["policy"] != BASELINE) & df["kld_mean"].notna()].reset_index(drop=True)
    if df.empty:
        return None
    fig = Figure(figsize=(15, 5.0), layout="constrained")
    ax_k, ax_p, ax_e = fig.subplots(1, 3)
    variants = list(dict.fromkeys(df["weights"]))
    policies = list(dict.fromkeys(df["policy"]))
    for ax, x_col, y_col, title, unit in (
        (ax_k, "kld_sum", "kld_mean", "KLD", "mean KLD (nats/token)"),
        (ax_p, "delta_ppl_pct_sum", "delta_ppl_pct", "ΔPPL", "ΔPPL vs FP model (%)"),
    ):
        xs, ys = df[x_col].astype(float), df[y_col].astype(float)
        for _, r in df.iterrows():
            vi, pi = variants.index(r["weights"]), policies.index(r["policy"])
            ax.scatter(float(r[x_col]), float(r[y_col]), color=color(vi), marker=marker(pi), s=55,
                       edgecolors="black", linewidths=0.6, zorder=3)
        lo = float(min(xs.min(), ys.min()))
        hi = float(max(xs.max(), ys.max()))
        if ax is ax_k and log_scale_ok(list(xs) + list(ys)):
            ax.set_xscale("log")
            ax.set_yscale("log")
            lo, hi = lo / 1.5, hi * 1.5
        else:
            pad = 0.08 * (hi - lo or 1.0)
            lo, hi = lo - pad, hi + pad
        ax.plot([lo, hi], [lo, hi], color=BASELINE_COLOR, ls="--", lw=1, label="both = W + KV (additive)")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"weights alone + KV alone: {unit}")
        ax.set_ylabel(f"weights and KV together: {unit}")
        ax.set_title(f"{title}: above the diagonal = worse than the sum", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    # the KLD excess relative to the sum, with its interval: > 0 is worse than the sum
    sums = df["kld_sum"].astype(float).where(df["kld_sum"].astype(float) > 0)
    rel = 100 * df["kld_excess"].astype(float) / sums
    lo_e = 100 * df["kld_excess_ci95_lo"].astype(float) / sums
    hi_e = 100 * df["kld_excess_ci95_hi"].astype(float) / sums
    y = np.arange(len(df))[::-1]
    for i, r in df.iterrows():
        if not np.isfinite(rel[i]):
            continue
        vi, pi = variants.index(r["weights"]), policies.index(r["policy"])
        err = [[max(rel[i] - lo_e[i], 0)], [max(hi_e[i] - rel[i], 0)]] if np.isfinite(lo_e[i]) else None
        ax_e.errorbar(rel[i], y[i], xerr=err, fmt=marker(pi), color=color(vi), mec="black", mew=0.6, ms=7,
                      capsize=3, zorder=3)
    ax_e.axvline(0, color=BASELINE_COLOR, ls="--", lw=1)
    ax_e.set_yticks(y, [f"{w} × {p}" for w, p in zip(df["weights"], df["policy"])], fontsize=8)
    ax_e.set_xlabel("KLD excess: (both − (W + KV)) / (W + KV), %")
    ax_e.set_title("KLD excess, 95% interval: > 0 = worse than the sum", fontsize=10)
    ax_e.grid(True, axis="x", alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color(i), marker="o", ls="", mec="black", label=f"weights {v}")
               for i, v in enumerate(variants)]
    handles += [Line2D([], [], color="#BBBBBB", marker=marker(i), ls="", mec="black", label=f"KV {p}")
                for i, p in enumerate(policies)]
    handles += ax_k.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8)
    fig.suptitle(f"{_model(res)}: quantized weights × quantized KV cache, every effect against the FP model")
    return fig


# ------------------------------------------------------------------------------------------- per-token KLD


def token_klds(res: RunResults) -> dict[str, np.ndarray]:
    """Per policy, every scored token's KLD against the baseline (float32, the ``kld_values`` of the window
    records of the first task entry that writes them: ``<task>/w<i>/<policy>``, checkpoint weights), in window
    order; policies whose records have none (an older kveval) are left out."""
    rec = res.records
    if rec.empty or "kld_values" not in rec or "key" not in rec or "task" not in rec:
        return {}
    keys = rec["key"].astype(str)
    windows = keys.str.fullmatch(r"[^/]+/w\d+/[^/]+") & (keys.str.split("/").str[0] == rec["task"].astype(str))
    writers = rec.loc[windows & rec["kld_values"].map(lambda v: isinstance(v, list)), "task"]
    if writers.empty:
        return {}
    mine = rec[windows & (rec["task"] == writers.iloc[0])]
    if "weights" in mine:
        mine = mine[mine["weights"].isna()]
    out = {}
    for name in res.policies:
        g = mine[mine["policy"] == name]
        if g.empty or not all(isinstance(v, list) for v in g["kld_values"]):
            continue
        g = g.sort_values("window")
        try:
            values = np.concatenate([np.asarray(v, dtype=np.float32) for v in g["kld_values"]])
        except (TypeError, ValueError):  # a hand-edited record (strings, nested lists): no plot of its policy
            continue
        if np.isfinite(values).all():  # a NaN or an infinity there is damage, not a KLD
            out[name] = values
    return out


def kld_distribution(res: RunResults) -> Figure | None:
    """The distribution of the per-token KLD of each policy: a histogram on logarithmic bins (share of tokens per
    bin) and the tail of the cumulative distribution (the share of tokens above each KLD, logarithmic: where the
    rare bad tokens show), with each policy's 99th percentile marked (llama-perplexity's ``99.0% KLD``, from
    metrics.json) where the tail crosses 1%. Tokens at KLD 0 (identical distributions) sit at the lowest bin."""
    klds = token_klds(res)
    if not klds:
        return None
    style = policy_styles([BASELINE, *res.policies])
    positive = np.concatenate([v[v > 0] for v in klds.values()])
    if positive.size == 0:
        return None
    lo = max(float(positive.min()), 1e-9)
    hi = max(float(positive.max()), lo * 10)
    edges = np.logspace(math.log10(lo), math.log10(hi), 60)
    fig = Figure(figsize=(11, 4.7), layout="constrained")
    ax_h, ax_c = fig.subplots(1, 2)
    policies = (res.metrics or {}).get("policies") or {}
    for i, (name, v) in enumerate(klds.items()):
        c, m = style.get(name, (color(i), marker(i)))
        ls = ["-", "--", "-.", ":"][i % 4]
        x = np.clip(v.astype(np.float64), lo, hi)
        share, _ = np.histogram(x, bins=edges)
        centers = np.sqrt(edges[:-1] * edges[1:])
        ax_h.plot(centers, share / max(len(x), 1), color=c, ls=ls, marker=m, markevery=6, mec="black", mew=0.5,
                  label=name)
        srt = np.sort(x)
        above = 1.0 - np.arange(1, len(srt) + 1) / len(srt)  # share of tokens with a larger KLD
        keep = above > 0
        ax_c.plot(srt[keep], above[keep], color=c, ls=ls, label=name)
        p99 = ((policies.get(name) or {}).get("llama_perplexity") or {}).get("kld_p99")
        if p99 is not None and p99 > 0:
            ax_c.axvline(p99, color=c, ls=":", lw=1)
            ax_c.plot([p99], [0.01], marker=m, color=c, mec="black", mew=0.5)
    for ax in (ax_h, ax_c):
        ax.set_xscale("log")
        ax.set_xlabel("per-token KL(P_baseline ‖ P_policy) (nats)")
        ax.grid(True, which="major", alpha=0.3)
    ax_h.set_ylabel("share of tokens per bin")
    ax_h.set_title("Histogram (logarithmic bins)")
    ax_c.set_ylabel("share of tokens with KLD > x")
    ax_c.set_yscale("log")
    ax_c.axhline(0.01, color=BASELINE_COLOR, lw=0.8, ls="--")
    ax_c.set_title("Tail (dotted: 99th percentile, where the tail crosses 1%)")
    handles, labels = ax_h.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8)
    fig.suptitle(f"{_model(res)}: per-token KL divergence")
    return fig


#: The per-run figures of the report: file stem -> function.
RUN_PLOTS = {
    "quality_vs_memory": quality_vs_memory,
    "policy_quality": policy_bars,
    "by_position": by_position,
    "kld_distribution": kld_distribution,
    "memory": memory_bars,
    "layer_errors": layer_errors,
    "bits_per_layer": bits_per_layer,
}

__all__ = [
    "quality_vs_memory", "policy_bars", "by_position", "memory_bars", "layer_errors",
    "bits_per_layer", "weights_x_kv", "kld_distribution", "token_klds", "pareto_front", "save",
    "RUN_PLOTS", "OKABE_ITO",
]
