"""The generation task's metrics, from its records alone (the same records give the same metrics).

metrics.json, for the baseline and per policy (``policies.<name>``), all prefixed ``gen_``:

* fidelity (a policy): ``gen_survival`` ({steps, survival}: the Kaplan-Meier share of prompts whose greedy output
  is still identical to the FP model's after each decode step), ``gen_divergence_median`` (steps; None when
  fewer than half depart within the run's tokens) and ``gen_divergence_median_ci95``, ``gen_diverged`` (the
  share of prompts that departed); ``gen_kld`` and ``gen_kld_fp`` (the KLD of the FP model's from the policy's
  next-token distribution at each decode step, along the policy's own greedy trajectory and along the FP model's,
  in ``kld_bins`` step bins: {edges, mean, count, slope per 1,000 steps}) and their means ``gen_kld_mean``,
  ``gen_kld_fp_mean``; ``gen_similarity`` (token similarity of the greedy output to the FP model's: 1 - edit
  distance / length);
* degenerate decoding (baseline and policies): ``gen_length_mean`` (tokens), ``gen_eos_rate`` (the share of
  greedy outputs that ended by EOS or a stop string), ``gen_repeat_4gram`` (the mean share of repeated 4-grams);
* accuracy, over the prompts with an answer (``gen_scored``): ``gen_accuracy`` (greedy, %), with ``samples: k``
  ``gen_pass1`` (pass@1 averaged over the k samples, %) and ``gen_pass_at_k`` (the unbiased pass@k, %); for a
  policy ``gen_accuracy_drop`` (points below the baseline), ``gen_accuracy_mde`` (the smallest drop this many
  prompts detect, alpha 0.05, power 0.8), ``gen_verdict`` (``pass``: the drop is within ``max_drop`` and the run
  could have seen a larger one; ``fail``: a drop beyond ``max_drop`` that the run detects; ``inconclusive``
  otherwise, with ``gen_prompts_to_decide``);
* ``gen_examples`` (a policy): the ``examples`` earliest departures, the FP and the policy text from the step
  where they part.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.tasks.generation.metrics import (
    accuracy_mde,
    binned_curve,
    pass_at_k,
    prompts_to_decide,
    repeated_ngram_share,
    survival,
    token_similarity,
)
from kveval.tasks.generation.params import NAME, Params

GREEDY, FP_PATH = "greedy", "fp_path"
Decode = Callable[[list[int]], str]
#: characters of each side of an example shown in the report
EXAMPLE_CHARS = 240


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(sum(values) / len(values)) if values else None


def first_difference(a: list[int], b: list[int]) -> tuple[int | None, int]:
    """(the first index where the two token lists differ, or None; the horizon compared: the shorter length when
    they agree up to it, the index itself otherwise). Outputs of different lengths that agree up to the shorter
    one differ at its length (one ended, the other went on)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, i
    if len(a) != len(b):
        return min(len(a), len(b)), min(len(a), len(b))
    return None, len(a)


def _degeneracy(recs: list[dict]) -> dict:
    return {"gen_length_mean": _mean(len(r["tokens"]) for r in recs),
            "gen_eos_rate": _mean(float(r.get("ended") in ("eos", "stop")) for r in recs),
            "gen_repeat_4gram": _mean(repeated_ngram_share(r["tokens"], 4) for r in recs)}


def _accuracy(by_unit: dict[str, dict[str, dict]], scored: list[str], samples: int) -> dict:
    """Greedy accuracy and, with samples, pass@1 and pass@k, in percent over the scored prompts."""
    if not scored:
        return {}
    greedy = by_unit.get(GREEDY, {})
    out: dict = {"gen_scored": len(scored),
                 "gen_accuracy": _mean(100.0 * bool(greedy[p].get("correct")) for p in scored if p in greedy)}
    if samples:
        correct = {p: sum(bool(by_unit.get(f"s{j}", {}).get(p, {}).get("correct")) for j in range(samples))
                   for p in scored}
        out["gen_pass1"] = _mean(100.0 * c / samples for c in correct.values())
        out["gen_pass_at_k"] = _mean(100.0 * pass_at_k(samples, c, samples) for c in correct.values())
    return out


def _verdict(base_acc: float | None, acc: float | None, n: int, params: Params) -> dict:
    if base_acc is None or acc is None or n == 0:
        return {}
    drop = base_acc - acc
    mde = accuracy_mde(n, base_acc / 100.0)  # inf when no drop is detectable at this size
    out = {"gen_accuracy_drop": drop, "gen_accuracy_mde": mde if math.isfinite(mde) else None}
    if drop > params.max_drop and drop >= mde:
        out["gen_verdict"] = "fail"
    elif drop <= params.max_drop and mde <= params.max_drop:
        out["gen_verdict"] = "pass"
    else:
        out["gen_verdict"] = "inconclusive"
        if params.max_drop <= base_acc:  # a drop of max_drop points is possible at this base accuracy
            out["gen_prompts_to_decide"] = prompts_to_decide(base_acc / 100.0, params.max_drop)
    return out


def _examples(departed: list[tuple[int, str, dict, dict]], count: int, decode: Decode | None) -> list[dict]:
    """The earliest departures: prompt, step, and each side's text from the step where they part."""
    out = []
    for step, pid, fp, pol in sorted(departed, key=lambda e: (e[0], e[1]))[:count]:
        out.append({"prompt": pid, "step": step,
                    "fp": _from_step(fp, step, decode), "policy": _from_step(pol, step, decode)})
    return out


def _from_step(rec: dict, step: int, decode: Decode | None) -> str:
    """The record's text from the given token on (``decode`` of its tokens from there; without a tokenizer, the
    same share of its text's characters)."""
    if decode is not None:
        return decode(rec["tokens"][step:])[:EXAMPLE_CHARS]
    text, n = rec.get("text") or "", max(len(rec["tokens"]), 1)
    start = int(len(text) * min(step, n) / n)
    return text[start:start + EXAMPLE_CHARS]


def aggregate(records: list[dict], prompts, policies: list[str], params: Params, decode: Decode | None = None) -> dict:
    """metrics.json's generation fields from the records (see the module docstring); ``decode`` (token ids ->
    text) cuts the examples at the exact token where the outputs part."""
    recs: dict[str, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))  # who -> unit -> prompt
    for r in records:
        if r.get("task") == NAME:
            check_record(r)
            recs[r["policy"]][r["unit"]][r["prompt"]] = r
    ids = [p.id for p in prompts]
    scored = [p.id for p in prompts if p.answer is not None]
    samples = params.samples or 0
    base = recs.get(BASELINE, {})
    base_greedy = base.get(GREEDY, {})
    out: dict = {BASELINE: {**_degeneracy([base_greedy[p] for p in ids if p in base_greedy]),
                            **_accuracy(base, scored, samples), "gen_prompts": len(ids)},
                 "policies": {}}
    base_acc = out[BASELINE].get("gen_accuracy")
    for name in policies:
        mine = recs.get(name, {})
        greedy, fp_path = mine.get(GREEDY, {}), mine.get(FP_PATH, {})
        pairs = [(p, base_greedy[p], greedy[p]) for p in ids if p in base_greedy and p in greedy]
        firsts = [first_difference(b["tokens"], g["tokens"]) for _, b, g in pairs]
        surv = survival([f for f, _ in firsts], [h for _, h in firsts])
        m: dict = {
            "gen_survival": {"steps": surv["steps"], "survival": surv["survival"]},
            "gen_divergence_median": surv["median"], "gen_divergence_median_ci95": surv["median_ci95"],
            "gen_diverged": surv["diverged"] / surv["n"] if surv["n"] else None,
            "gen_kld": binned_curve([greedy[p]["kld"] for p in ids if p in greedy], params.kld_bins,
                                    params.max_new_tokens),
            "gen_kld_fp": binned_curve([fp_path[p]["kld"] for p in ids if p in fp_path], params.kld_bins,
                                       params.max_new_tokens),
            "gen_kld_mean": _mean(v for p in ids if p in greedy for v in greedy[p]["kld"]),
            "gen_kld_fp_mean": _mean(v for p in ids if p in fp_path for v in fp_path[p]["kld"]),
            "gen_similarity": _mean(token_similarity(b["tokens"], g["tokens"]) for _, b, g in pairs),
            **_degeneracy(list(greedy.values())),
            **_accuracy(mine, scored, samples),
        }
        m.update(_verdict(base_acc, m.get("gen_accuracy"), len(scored), params))
        departed = [(f, p, b, g) for (p, b, g), (f, _) in zip(pairs, firsts) if f is not None]
        m["gen_examples"] = _examples(departed, params.examples, decode)
        out["policies"][name] = m
    _refuse_non_finite(out, "")
    return out


def check_record(r: dict) -> None:
    """One :class:`KvevalError` line naming the record and the field when a generation record's per-step KLD holds
    NaN or infinity (a record read back on resume that was edited, or written by a broken writer; fresh records
    always pass: their logits were checked as they were scored)."""
    values = r.get("kld")
    for step, v in enumerate(values if isinstance(values, list) else ()):
        if isinstance(v, float) and not math.isfinite(v):
            raise KvevalError(f"records.jsonl: generation record '{r.get('key')}': kld is {v!r} at step {step}, not "
                              "a finite number; delete that line to generate it again, or rerun with --overwrite")


def _refuse_non_finite(doc, where: str) -> None:
    """One :class:`KvevalError` line naming the field (``policies.int8.gen_kld_mean``) where the metrics hold NaN
    or infinity, so that none reaches metrics.json (never expected once the records are checked)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, v in items:
        name = f"{where}[{key}]" if isinstance(doc, list) else f"{where}.{key}" if where else str(key)
        if isinstance(v, float) and not math.isfinite(v):
            raise KvevalError(f"generation metrics: {name} is {v!r}, not a finite number (from finite records: "
                              "please report it)")
        _refuse_non_finite(v, name)


__all__ = ["aggregate", "check_record", "first_difference"]
