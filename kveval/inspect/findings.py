"""The findings in words, each with the evidence that triggered it and the change it suggests (pure: plain data in,
plain data out).

The rules follow the decision procedure of docs/inspect.md ("start symmetric; offset values: asymmetric; one or two
outlier channels: smaller groups or a rotation; keys and values differ: spend the bits where the error is; a few
layers cannot take low precision: keep them higher; a sink token: keep it in full precision"). A rule fires on the
distributions (``kveval.inspect.distributions``), then its change is judged on the measured errors
(``kveval.inspect.measure``): a change is suggested only when it lowers the candidate's summed relative
attention-output error, and the finding says by how much. Every suggestion carries the policy in config form; ``kveval inspect``
turns it into a ``kveval run`` line.

Inputs: ``profiles[layer][kind]`` (``kind`` ``key``, ``key_pre_rope``, ``value``: a list of head profiles),
``mass[layer]`` (``[heads, n]`` first-token attention as nested lists), ``massive`` (dominant residual-stream
tokens by position: ``{"position", "windows", "all_windows", "channel", "ratio", "layers", "texts"}``), ``totals[variant name]`` (the summed
relative attention-output error), ``layer_errors[variant name][layer]`` (``output_rel``), ``candidates`` (name -> config
form).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kveval.policy.selectors import layer_ranges

OFFSET = 0.2  # mean |mean| / range of a tensor's per-token groups
SINK_MASS = 0.3  # attention mass on token 0, averaged over heads and query rows
SINK_LAYER_SHARE = 0.25  # of the layers
KV_RATIO = 3.0  # one kind's error over the other's
FRAGILE = 5.0  # a layer's error over the median layer's
IMPROVES = 0.9  # a change is suggested when it brings the error below this fraction of the candidate's


@dataclass
class Suggestion:
    """A change to ``base`` (a candidate policy): ``policy`` (its name in the run line), ``config`` (config form),
    ``error`` and ``base_error`` (summed relative attention-output errors measured on the captured tensors: the
    screen), then ``kld`` and ``base_kld`` (the mean KLD of one emulated pass a window under each: the
    confirmation, ``confirm``)."""

    base: str
    policy: str
    config: Any
    base_error: float
    error: float
    kld: float | None = None
    base_kld: float | None = None

    @property
    def factor(self) -> float | None:
        return None if self.base_error <= 0 else self.error / self.base_error

    @property
    def kld_factor(self) -> float | None:
        return None if self.kld is None or not self.base_kld else self.kld / self.base_kld

    def to_dict(self) -> dict:
        return {"base": self.base, "policy": self.policy, "config": self.config, "base_error": self.base_error,
                "error": self.error, "error_factor": self.factor, "kld": self.kld, "base_kld": self.base_kld,
                "kld_factor": self.kld_factor}


@dataclass
class Finding:
    """``kind`` (``offset``, ``outlier_channels``, ``sink``, ``massive_activation``, ``keys_vs_values``,
    ``fragile_layers``), ``statement`` (what was seen, one sentence), ``evidence`` (the numbers that triggered
    it), ``layers``, ``advice`` (the kind of change that answers it) and ``suggestions`` (possibly none: a fact
    with nothing that helped)."""

    kind: str
    statement: str
    evidence: dict
    layers: list[int] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    advice: str = ""

    @property
    def text(self) -> str:
        if not self.suggestions:
            return self.statement
        return f"{self.statement}; {self.advice}: " + "; ".join(say(s) for s in self.suggestions)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "layers": self.layers, "evidence": self.evidence,
                "suggestions": [s.to_dict() for s in self.suggestions]}


def confirm(findings: list[Finding], kld: dict[str, float]) -> None:
    """Keep the suggestions whose measured KLD (``kld[policy name]``, one emulated pass) is below ``IMPROVES``
    times their candidate's: the attention-output error screens, the model's own output decides."""
    for f in findings:
        kept = []
        for s in f.suggestions:
            s.kld, s.base_kld = kld.get(s.policy), kld.get(s.base)
            if s.kld is not None and s.base_kld is not None and s.kld < IMPROVES * s.base_kld:
                kept.append(s)
        f.suggestions = kept


def ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``; ``[3]`` -> ``"layer 3"``."""
    return ("layer " if len(layers) == 1 else "layers ") + layer_ranges(layers)


def judged(base: str, change: str, totals: dict[str, float], configs: dict[str, Any]) -> Suggestion | None:
    """The suggestion of ``change`` on ``base`` when it was measured and lowers the error enough, else None."""
    name = f"{base}+{change}"
    if name not in totals or base not in totals:
        return None
    s = Suggestion(base, name, configs[name], totals[base], totals[name])
    return s if s.factor is not None and s.factor < IMPROVES else None


def say(s: Suggestion) -> str:
    """``int4_g64+rotate (KLD 0.041 against 0.094 for int4_g64, 0.44x)``, or the error factor before the KLD."""
    if s.kld_factor is not None:
        return f"{s.policy} (KLD {s.kld:.3g} against {s.base_kld:.3g} for {s.base}, {s.kld_factor:.2g}x)"
    return f"{s.policy} ({s.factor:.2g}x the attention-output error of {s.base})"


def offset_findings(profiles: dict, totals: dict, configs: dict, candidates: list[str]) -> list[Finding]:
    out = []
    for kind in ("value", "key"):
        offsets = {i: statistics.fmean(h["offset"] for h in p[kind]) for i, p in profiles.items() if kind in p}
        layers = [i for i, o in offsets.items() if o >= OFFSET]
        if not layers:
            continue
        worst = max(layers, key=lambda i: offsets[i])
        sugg = [s for b in candidates if (s := judged(b, f"asymmetric_{kind}", totals, configs))]
        text = (f"{kind}s of {ranges(layers)} are offset (mean {offsets[worst]:.2f} of their range at "
                f"layer {worst}): a symmetric format wastes part of its range")
        if not any(f"{b}+asymmetric_{kind}" in totals for b in candidates):
            text += "; no candidate is a symmetric INT format there"
        out.append(Finding("offset", text, {"tensor": kind, "offset": {i: offsets[i] for i in layers},
                                            "threshold": OFFSET}, layers, sugg, "asymmetric"))
    return out


def outlier_findings(profiles: dict, totals: dict, configs: dict, candidates: list[str]) -> list[Finding]:
    out = []
    for kind in ("key_pre_rope", "key", "value"):
        where = {i: [(h, p[kind][h]["outlier_channels"], p[kind][h]["channel_ratio"])
                     for h in range(len(p[kind])) if p[kind][h]["outlier_channels"]]
                 for i, p in profiles.items() if kind in p}
        where = {i: w for i, w in where.items() if w}
        if not where or (kind == "key" and any("key_pre_rope" in p for p in profiles.values())):
            continue  # keys are named before RoPE where the model has it (RoPE spreads a channel over its pair)
        tensor = "value" if kind == "value" else "key"
        layers = sorted(where)
        ratio = max(r for w in where.values() for _, _, r in w)
        named = "; ".join(f"layer {i} head {h}: channels {', '.join(map(str, ch))}" for i in layers[:4]
                          for h, ch, _ in where[i][:2])
        changes = [f"group_{tensor}", "rotate"] + (["channel_key"] if tensor == "key" else [])
        sugg = [s for b in candidates for c in changes if (s := judged(b, c, totals, configs))]
        label = "keys (before RoPE)" if kind == "key_pre_rope" else f"{tensor}s"
        text = (f"{label} of {ranges(layers)} have outlier channels (up to {ratio:.0f}x the median "
                f"channel's mean magnitude; {named})")
        out.append(Finding("outlier_channels", text, {
            "tensor": kind, "max_ratio": ratio,
            "channels": {i: [{"head": h, "channels": ch, "ratio": r} for h, ch, r in w] for i, w in where.items()}},
            layers, sugg, "smaller groups, a rotation" + (" or keys per channel" if tensor == "key" else "")))
    return out


def sink_findings(mass: dict, totals: dict, configs: dict, candidates: list[str]) -> list[Finding]:
    first = {i: statistics.fmean(row[0] for row in m) for i, m in mass.items() if m and m[0]}
    layers = [i for i, v in first.items() if v >= SINK_MASS]
    if not first or len(layers) < max(1, SINK_LAYER_SHARE * len(first)):
        return []
    peak = max(layers, key=lambda i: first[i])
    sugg = [s for b in candidates if (s := judged(b, "sinks", totals, configs))]
    text = (f"token 0 takes {100 * statistics.fmean(first[i] for i in layers):.0f}% of the attention in "
            f"{len(layers)} of {len(first)} layers ({ranges(layers)}; up to {100 * first[peak]:.0f}% at layer {peak}): an attention "
            "sink")
    return [Finding("sink", text, {"mass_on_token_0": {i: first[i] for i in layers}, "threshold": SINK_MASS},
                    layers, sugg, "keep 4 sink tokens in full precision")]


def massive_findings(massive: list[dict], totals: dict, configs: dict, candidates: list[str]) -> list[Finding]:
    out = []
    for m in massive:
        early = m["position"] < 4
        sugg = [s for b in candidates if early and (s := judged(b, "sinks", totals, configs))]
        texts = ", ".join(repr(t) for t in m["texts"][:3])
        where = "every window" if m["all_windows"] else f"window{'s' if len(m['windows']) > 1 else ''} " + \
            ", ".join(map(str, m["windows"][:4]))
        text = (f"token {m['position']} of {where} ({texts}) carries a massive activation (channel "
                f"{m['channel']}, {m['ratio']:.0f}x the median token's largest value) in {ranges(m['layers'])}")
        out.append(Finding("massive_activation", text, dict(m), list(m["layers"]), sugg,
                           "keep it in full precision as a sink"))
    return out


def kv_findings(totals: dict, configs: dict, candidates: list[str]) -> list[Finding]:
    out = []
    for b in candidates:
        k, v = totals.get(f"{b}+keys_only"), totals.get(f"{b}+values_only")
        if not k or not v:
            continue
        ratio = k / v
        if ratio >= KV_RATIO:
            more, change, fix = "keys", "key_int8", "spend the bits on keys"
        elif ratio <= 1 / KV_RATIO:
            more, change, fix = "values", "value_int8", "spend the bits on values"
        else:
            continue
        sugg = [s for s in [judged(b, change, totals, configs)] if s]
        x = ratio if more == "keys" else 1 / ratio
        text = f"under {b}, {more} cause {x:.1f}x the attention-output error of {'values' if more == 'keys' else 'keys'}"
        out.append(Finding("keys_vs_values", text, {"policy": b, "key_error": k, "value_error": v,
                                                    "ratio_key_over_value": ratio}, [], sugg, fix))
    return out


def fragile_findings(layer_errors: dict, candidates: list[str]) -> list[tuple[Finding, str, list[int]]]:
    """The layers whose error under a candidate is ``FRAGILE`` times the median layer's: (finding without its
    suggestion, candidate, layers). The suggestion (those layers at INT8) is measured afterwards."""
    out = []
    for b in candidates:
        errs = {i: e for i, e in layer_errors.get(b, {}).items() if e is not None}
        if len(errs) < 3:
            continue
        median = statistics.median(errs.values())
        layers = sorted(i for i, e in errs.items() if median > 0 and e >= FRAGILE * median)
        if not layers or len(layers) > len(errs) // 2:
            continue
        text = (f"under {b}, {ranges(layers)} {'takes' if len(layers) == 1 else 'take'} "
                f"{max(errs[i] for i in layers) / median:.0f}x the median layer's error")
        out.append((Finding("fragile_layers", text, {"policy": b, "median": median,
                                                     "errors": {i: errs[i] for i in layers}, "threshold": FRAGILE},
                            layers, advice="keep them at INT8"), b, layers))
    return out
