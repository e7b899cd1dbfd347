"""The whole inspection of one model: capture each window, measure every variant on it, gather the distributions,
predict the sensitivity, find. ``inspect_model`` returns ``inspect.json``'s document (plain data) and the
predicted ``sensitivity`` section; ``kveval.commands.inspect`` loads the model and writes the files.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.inspect import distributions as dist
from kveval.inspect import findings as fnd
from kveval.inspect.capture import Window, capture_window
from kveval.inspect.measure import Measurements, measure_window, scaling_of
from kveval.inspect.predict import effect, sensitivity_section, spec_variants
from kveval.inspect.variants import Variant, protect_layers, variants
from kveval.policy import KVPolicy

FIRST = 4  # the first tokens whose attention mass is reported


@dataclass
class Inputs:
    """What one inspection reads: ``candidates`` (name -> config form, the config's policies), ``specs`` (the
    QuantSpec presets whose sensitivity is predicted), ``windows`` (token ids ``[1, seq_len]`` each)."""

    candidates: dict[str, Any]
    specs: list[str]
    windows: list[torch.Tensor]


def _refuse_unmodelled(model) -> None:
    from kveval.models import model_arch

    arch = model_arch(model)
    if arch.mla is not None:
        raise KvevalError("kveval inspect does not capture an MLA model's latent cache yet; measure its layers with "
                          "kveval scan")


class _Gathered:
    """The distributions of every window, per layer: keys (post- and pre-RoPE) and values side by side, the
    first-token attention mass, the massive activations."""

    def __init__(self):
        self.kv: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.mass: dict[int, list[torch.Tensor]] = {}
        self.massive: dict[int, dict] = {}  # by position in the window
        self.windows = 0
        self.ids: list[torch.Tensor] = []

    def add(self, w: int, window: Window, scaling: Callable) -> None:
        self.windows += 1
        self.ids.append(window.ids[0])
        for i, call in window.calls.items():
            parts = self.kv.setdefault(i, {"key": [], "key_pre_rope": [], "value": []})
            parts["key"].append(call.key[0].float())
            parts["value"].append(call.value[0].float())
            if call.key_pre_rope is not None:
                parts["key_pre_rope"].append(call.key_pre_rope[0].float())
            self.mass.setdefault(i, []).append(dist.first_mass(call.query[0], call.key[0], scaling(call), FIRST))
        for i, h in window.residual.items():
            for t in dist.massive_activations(h)["tokens"]:
                entry = self.massive.setdefault(t["position"], {
                    "position": t["position"], "windows": [], "channel": t["channel"], "ratio": 0.0, "layers": [],
                    "token_ids": []})
                if w not in entry["windows"]:
                    entry["windows"].append(w)
                    entry["token_ids"].append(int(window.ids[0, t["position"]]))
                if i not in entry["layers"]:
                    entry["layers"].append(i)
                if t["ratio"] > entry["ratio"]:
                    entry.update(ratio=t["ratio"], channel=t["channel"])

    def profiles(self, tokenizer) -> dict[int, dict[str, list[dict]]]:
        """Each layer's head profiles, their dominant tokens named by window, position and text."""
        out = {i: {k: dist.tensor_profile(torch.cat(v, dim=1)) for k, v in parts.items() if v}
               for i, parts in sorted(self.kv.items())}
        starts = [0]
        for ids in self.ids:
            starts.append(starts[-1] + int(ids.shape[0]))
        for heads in (h for kinds in out.values() for hs in kinds.values() for h in hs):
            named = []
            for t in heads["dominant_tokens"]:
                w = max(j for j in range(len(self.ids)) if starts[j] <= t)
                token = int(self.ids[w][t - starts[w]])
                named.append({"window": w, "position": t - starts[w],
                              "text": tokenizer.decode([token]) if tokenizer is not None else str(token)})
            heads["dominant_tokens"] = named
        return out

    def first_mass(self) -> dict[int, list[list[float]]]:
        return {i: torch.stack(m).mean(0).tolist() for i, m in sorted(self.mass.items())}


def _measure(model, inputs: Inputs, todo: list[Variant], meas: Measurements, gather: _Gathered | None,
             step: Callable[[int], None]) -> list[Window]:
    kept = []
    for w, ids in enumerate(inputs.windows):
        window = capture_window(model, ids)
        if gather is not None:
            gather.add(w, window, scaling_of)
        measure_window(model, window, todo, meas)
        kept.append(Window(window.ids, window.logits))  # ids and logits only: the uniform passes need them
        step(ids.shape[-1])
    return kept


def _fragile(model, inputs: Inputs, todo: list[Variant], meas: Measurements, totals: dict, configs: dict,
             log: Callable[[str], None]) -> tuple[list[fnd.Finding], list[Variant]]:
    """The fragile-layer findings, each with its suggestion (those layers at INT8) when it lowers the error: one
    more capture of each window measures them. A candidate at 8 bits or more gets the finding alone. Returns the
    findings and the variants measured for them."""
    layer_errors = {b: {i: s.output_rel for (v, i), s in meas.sums.items() if v == b} for b in inputs.candidates}
    policies = {v.base: v.policy for v in todo if v.change == "as_is"}
    out, guard = [], []
    for finding, base, layers in fnd.fragile_findings(layer_errors, list(inputs.candidates)):
        if all(spec.is_none or spec.bits >= 8 for spec in policies[base].all_specs()):
            out.append(finding)
            continue
        form = protect_layers(inputs.candidates[base], layers)
        policy = KVPolicy.from_config(form, name=f"{base}+int8_layers")
        guard.append((finding, Variant(base, "int8_layers", form, policy)))
    if guard:
        log(f"measuring {len(guard)} per-layer override(s) for the fragile layers")
        _measure(model, inputs, [v for _, v in guard], meas, None, lambda n: None)
    for finding, v in guard:
        totals[v.name], configs[v.name] = meas.total(v.name), v.config
        s = fnd.judged(v.base, "int8_layers", totals, configs)
        if s is not None:
            finding.suggestions.append(s)
        out.append(finding)
    return out, [v for _, v in guard]


def inspect_model(model, tokenizer, inputs: Inputs, step: Callable[[int], None] = lambda n: None,
                  log: Callable[[str], None] = lambda s: None) -> tuple[dict, dict]:
    """(``inspect.json``'s document, the predicted ``sensitivity`` section) of ``model`` on ``inputs``."""
    _refuse_unmodelled(model)
    from kveval.patch.layers import model_quantizers

    todo: list[Variant] = []
    refused: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}  # candidates inspect cannot measure (scales: auto, a shape that does not fit)
    for name, form in inputs.candidates.items():
        vs, why = variants(name, form, KVPolicy.from_config(form, name=name))
        fits = []
        for v in vs:  # a change that does not fit the model is dropped with its reason; the candidate is skipped
            try:
                model_quantizers(model, v.policy)
            except KvevalError as exc:
                if v.change == "as_is":
                    skipped[name] = str(exc).splitlines()[0]
                    break
                why[v.change] = str(exc).splitlines()[0]
                continue
            fits.append(v)
        if name in skipped:
            continue
        todo += fits
        if why:
            refused[name] = why
    if len(skipped) == len(inputs.candidates):
        raise KvevalError(next(iter(skipped.values())))
    if skipped:
        log("skipped " + "; ".join(f"policy {n}: {r}" for n, r in skipped.items()))
        inputs = replace(inputs, candidates={n: f for n, f in inputs.candidates.items() if n not in skipped})
    extra, names = spec_variants(inputs.specs, todo)
    todo += extra
    meas, gather = Measurements(), _Gathered()
    kept = _measure(model, inputs, todo, meas, gather, step)
    profiles, mass = gather.profiles(tokenizer), gather.first_mass()
    massive = []
    for m in gather.massive.values():
        m["texts"] = [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in m["token_ids"]]
        m["all_windows"] = len(m["windows"]) == gather.windows > 1
        m["layers"].sort()
        massive.append(m)
    configs = {v.name: v.config for v in todo}
    totals = {v.name: meas.total(v.name) for v in todo}
    names_ = list(inputs.candidates)
    found = [*fnd.outlier_findings(profiles, totals, configs, names_),
             *fnd.offset_findings(profiles, totals, configs, names_),
             *fnd.sink_findings(mass, totals, configs, names_),
             *fnd.massive_findings(sorted(massive, key=lambda m: -m["ratio"])[:4], totals, configs, names_),
             *fnd.kv_findings(totals, configs, names_)]
    fragile, guarded = _fragile(model, inputs, todo, meas, totals, configs, log)
    found += fragile
    policies = {v.name: v.policy for v in todo + guarded}
    suggested = list(dict.fromkeys(s.policy for f in found for s in f.suggestions))
    log(f"one emulated pass a window for each of the {len(inputs.candidates)} candidates and {len(suggested)} "
        "suggested changes (their KLD)")
    effects = {n: effect(model, kept, policies[n]) for n in [*inputs.candidates, *suggested]}
    fnd.confirm(found, {n: e["kld"] for n, e in effects.items()})
    spec_effects = {s: effects.get(names[s]) or effect(model, kept, KVPolicy.preset(s)) for s in inputs.specs}
    n_tokens = sum(int(w.shape[-1]) for w in inputs.windows)
    seq_len = int(inputs.windows[0].shape[-1]) if inputs.windows else 0
    section = sensitivity_section(meas, inputs.specs, names, spec_effects, seq_len, n_tokens, n_tokens)
    doc = {
        "tokens": n_tokens, "windows": len(inputs.windows), "seq_len": seq_len,
        "candidates": inputs.candidates, "skipped_candidates": skipped, "refused_changes": refused,
        "kld": {n: e["kld"] for n, e in effects.items()},
        "findings": [f.to_dict() for f in found],
        "variants": {v.name: {"base": v.base, "change": v.change, "config": v.config, "total_output_rel": totals[v.name],
                              "layers": meas.summary(v.name)} for v in todo},
        "distributions": {str(i): {"heads": p, "first_token_mass": mass.get(i),
                                   "mean_first_token_mass": statistics.fmean(r[0] for r in mass[i]) if mass.get(i)
                                   else None} for i, p in profiles.items()},
        "massive_activations": massive,
    }
    return doc, section
