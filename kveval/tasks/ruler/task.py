"""RULER-style synthetic long-context suite: does a KV format hold up at 8k, 32k, 128k tokens?

Families (:data:`kveval.tasks.ruler.prompts.FAMILIES`, RULER's synthetic tasks by RULER's names): single needles
(``niah_single_1/2/3``), distractor needles (``niah_multikey_1/2/3``), several values (``niah_multivalue``),
several keys asked (``niah_multiquery``), variable tracking (``vt``), common and frequent words extraction
(``cwe``, ``fwe``). Grid: ``families`` × ``lengths``, ``samples`` per cell, each sample with fresh values drawn
from ``seed`` (the config's seed by default); every policy (and the FP baseline) sees the same prompts. A length is
the whole sequence the cache holds at the end, as in RULER: the prompt is exactly ``length - budget`` tokens, where
the budget is ``max_new_tokens`` or, unset, RULER's per family (128 for needles, 30 ``vt``, 120 ``cwe``, 50
``fwe``). ``depths`` places the answer's needles: sample ``s`` at ``depths[s % len(depths)]`` (unset: RULER's
random depths).

Per (family, length, sample, policy), one record (key ``ruler/<family>/L<length>/s<sample>/<policy>``):

- ``score`` (0..1): greedy generation (the budget's tokens) through the real quantized cache
  (``QuantizedKVCache``; plain ``generate`` for the baseline), scored by RULER's string match against the
  references, with the metric RULER gives the family (``all``: the share of references found;
  :mod:`kveval.tasks.ruler.scoring`).
- ``answer_logprob`` (mean per answer token; ``answer_logprob_sum`` too) and ``answer_token_acc``: the prompt
  plus one reference answer in one teacher-forced pass under ``emulate(prefill_len=prompt)``.

metrics.json, per policy (and the baseline): ``ruler_score`` (0..100, the mean over every sample),
``ruler_answer_logprob``, ``ruler_token_acc``, ``ruler_samples``, ``ruler_cells`` ([{family, length, samples,
score, logprob, token_acc}]) and ``ruler_families`` ({family: {score, logprob}}). Policies add, in score points
against the baseline: ``ruler_drop`` and ``ruler_logprob_delta``; per cell ``drop`` and ``logprob_delta``; per
family ``drop``, ``worst_drop`` (the largest drop over the lengths), ``worst_length`` and ``verdict``: ``fail``
when the family's score at some length is more than ``max_drop`` points below the baseline's, else ``pass``; and
``ruler_verdict`` (``fail`` when a family fails) with ``ruler_max_drop`` (the threshold). The task draws nothing:
:func:`kveval.report.task_figures.plot_ruler` draws ``plots/ruler_<policy>.png`` (family × length) from these
metrics.

NaN or infinity in a sample's logits (teacher-forced, or of a generated token) stops the run with one line that
says whose fault it is before that sample's record is written (:mod:`kveval.tasks.common.finite`).
"""

from __future__ import annotations

from kveval.errors import KvevalError
from kveval.messages import print_warning
from kveval.results.layout import BASELINE
from kveval.stats import (
    binomial_sd_points,
    effective_length,
    inconclusive,
    length_area,
    mean_of_present,
    minimum_detectable_effect,
    paired_standard_error,
    samples_to_resolve,
    size_to_decide,
)
from kveval.tasks.common.decoding import answer_scores
from kveval.tasks.common.prompts import SentenceTokens, split_sentences
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.ruler.params import NAME, Params  # noqa: F401 (a task module names its NAME and Params)
from kveval.tasks.ruler.prompts import FAMILIES, Pieces, Sample, build_sample, sample_rng
from kveval.tasks.ruler.scoring import score


def record_key(family: str, length: int, sample: int, policy: str) -> str:
    return f"ruler/{family}/L{length}/s{sample}/{policy}"


def sample_words(family: str, length: int, sample: int) -> str:
    """A sample in words, for messages: ``ruler vt sample 0 (length 1024)``."""
    return f"ruler {family} sample {sample} (length {length})"


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------
def _pieces(ctx) -> Pieces:
    if "ruler/pieces" not in ctx.cache:
        ctx.cache["ruler/pieces"] = Pieces(ctx.tokenizer)
    return ctx.cache["ruler/pieces"]


def _essay(ctx, params: Params) -> SentenceTokens | None:
    """The config's corpus as sentences (tokenized on demand, kept in ``ctx.cache``), for the families whose
    haystack is the essay; None when no family needs it."""
    if not any(FAMILIES[f].haystack == "essay" for f in params.families):
        return None
    if "ruler/essay" not in ctx.cache:
        from kveval.data import load_text

        d = ctx.cfg.data
        ctx.cache["ruler/essay"] = SentenceTokens(
            ctx.tokenizer, split_sentences(load_text(d.source, split=d.split, text_field=d.text_field)))
    return ctx.cache["ruler/essay"]


def make_sample(pieces: Pieces, params: Params, essay: SentenceTokens | None, *, seed: int, family: str,
                length: int, sample: int) -> Sample:
    """The prompt of one sample; the same arguments always give the same prompt. Raises :class:`KvevalError`
    when the prompt cannot hold the family's fixed parts or the reference answer does not fit the budget."""
    budget = params.budget(family)
    if length <= budget:
        raise KvevalError(f"a length of {length} leaves no room for a prompt before the {budget} tokens {family} "
                          "generates; use longer lengths")
    rng = sample_rng(seed=seed, family=family, length=length, sample=sample)
    s = build_sample(pieces, family, rng, prompt_tokens=length - budget, length=length, depth=params.depth(sample),
                     essay=essay, chat_template=params.chat_template)
    if len(s.answer_ids) > budget:
        raise KvevalError(f"the {family} answer takes {len(s.answer_ids)} tokens, more than the {budget} generated; "
                          "raise max_new_tokens")
    return s


def check(ctx, params: Params) -> None:
    """Input errors before anything is written: a length beyond the model's context, a length too short for a
    family's instruction, question and needles (or its answer beyond the generation budget), an unreadable
    corpus."""
    from kveval.models import model_context_limit

    limit = model_context_limit(ctx.model)
    too_long = [n for n in params.lengths if n > limit]
    if too_long:
        raise KvevalError(f"tasks: ruler.lengths {too_long} exceed the model's context ({limit} tokens); lower them")
    pieces, essay = _pieces(ctx), _essay(ctx, params)
    seed = ctx.cfg.seed if params.seed is None else params.seed
    shortest = min(params.lengths)
    for family in params.families:
        for s in range(params.samples):
            try:
                make_sample(pieces, params, essay, seed=seed, family=family, length=shortest, sample=s)
            except KvevalError as exc:
                raise KvevalError(f"tasks: ruler: {exc}") from None
    need = samples_to_resolve(params.max_drop)
    if params.samples < need:  # a warning on stdout, not an error: a small suite still gives anecdotes
        line = (f"ruler: {params.samples} sample(s) per cell cannot resolve max_drop {params.max_drop:g} points: a "
                f"policy at that drop is detected (alpha 0.05, power 0.8) from about {need} samples per cell; "
                "verdicts near it will say inconclusive")
        if ctx.console is not None:
            print_warning(ctx.console, line)
        else:
            print(f"warning: {line}")


# ---------------------------------------------------------------------------------------------------------------
# The scores
# ---------------------------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, samples: list[Sample], max_new_tokens: int, policy=None, *, where: list[str],
             batch_size: int = 8) -> list[dict]:
    """Both scores of ``samples`` under one policy (None: the unpatched model), with their timings
    (:func:`kveval.tasks.common.decoding.answer_scores`: teacher-forced one sample at a time, greedy ``batch_size``
    samples per left-padded batch) and ``score``, the generated text against the sample's answers by its
    family's metric. ``where``: each sample in words, for the one line that NaN or infinity in the logits stops
    the run with (a batch names its first sample)."""
    recs = answer_scores(model, tokenizer, [(s.input_ids, s.answer_ids) for s in samples], max_new_tokens, policy,
                         where=where, batch_size=batch_size)
    for rec, sample in zip(recs, samples):
        rec["score"] = score(rec["generated"], sample.answers, FAMILIES[sample.family].metric)
    return recs


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def run(ctx, params: Params) -> dict:
    """Evaluate every (family, length, sample, policy) not yet recorded and aggregate all ruler records. Per
    (family, length) cell the samples are built once; then per policy its pending samples are generated
    ``batch_size`` at a time (they have the same length: no padding), each record written when its batch is done
    (:func:`kveval.tasks.common.runner.run_units`)."""
    names = [BASELINE, *ctx.policies]
    units = [Unit(record_key(f, n, s, name), (f, n, s), batch=(f, n, name), group=(f, n), amount=n, tally=(f, n, s))
             for f in params.families for n in params.lengths for name in names for s in range(params.samples)]
    pieces, essay = _pieces(ctx), _essay(ctx, params)
    seed = ctx.cfg.seed if params.seed is None else params.seed

    def prepare(group: list[Unit]) -> dict:
        return {(f, n, s): make_sample(pieces, params, essay, seed=seed, family=f, length=n, sample=s)
                for f, n, s in dict.fromkeys(u.item for u in group)}

    def evaluate_batch(batch: list[Unit], samples: dict):
        family, length, name = batch[0].batch
        policy = None if name == BASELINE else ctx.policies[name]
        scored = evaluate(ctx.model, ctx.tokenizer, [samples[u.item] for u in batch], params.budget(family), policy,
                          where=[sample_words(*u.item) for u in batch], batch_size=params.batch_size)
        for u, result in zip(batch, scored):
            sample = samples[u.item]
            rec = {
                "key": u.key, "task": NAME, "family": family, "length": length, "sample": u.item[2], "policy": name,
                "metric": FAMILIES[family].metric, "depth": sample.depth, "answer_depths": list(sample.answer_depths),
                "prompt_tokens": len(sample.input_ids), "max_new_tokens": params.budget(family),
                "answers": list(sample.answers), "reference": sample.reference,
            }
            rec.update(result)
            yield rec

    run_units(ctx, NAME, units, Work(label="ruler", noun="samples", evaluate=evaluate_batch, prepare=prepare,
                                     batch_size=params.batch_size))
    return aggregate(ctx.run.records(), list(ctx.policies), params)


# ---------------------------------------------------------------------------------------------------------------
# Aggregation (pure)
# ---------------------------------------------------------------------------------------------------------------
def _points(records: list[dict]) -> float | None:
    """RULER's score of some samples: the mean sample score in percent."""
    m = mean_of_present([r.get("score") for r in records])
    return None if m is None else 100.0 * m


def _diff(a: float | None, b: float | None) -> float | None:
    """``a - b``, None when either is missing."""
    return None if a is None or b is None else a - b


def _drop(base: float | None, score: float | None) -> float | None:
    """Score points lost against the baseline (``base - score``), rounded to 1e-9 so that the threshold is not
    crossed by float rounding (100 × 0.8 − 100 × 0.75 is 5.000000000000007)."""
    d = _diff(base, score)
    return None if d is None else round(d, 9)


def _summarise(records: list[dict], families: list[str]) -> dict:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["family"], r["length"]), []).append(r)
    rank = {f: i for i, f in enumerate(families)}
    rows = [{"family": f, "length": n, "samples": len(recs), "score": _points(recs),
             "logprob": mean_of_present([r["answer_logprob"] for r in recs]),
             "token_acc": mean_of_present([r["answer_token_acc"] for r in recs])}
            for (f, n), recs in sorted(cells.items(), key=lambda kv: (rank.get(kv[0][0], len(rank)), kv[0]))]
    fams = {}
    for f in dict.fromkeys(row["family"] for row in rows):
        recs = [r for r in records if r["family"] == f]
        fams[f] = {"score": _points(recs), "logprob": mean_of_present([r["answer_logprob"] for r in recs])}
    return {
        "ruler_score": _points(records),
        "ruler_answer_logprob": mean_of_present([r["answer_logprob"] for r in records]),
        "ruler_token_acc": mean_of_present([r["answer_token_acc"] for r in records]),
        "ruler_samples": len(records),
        "ruler_cells": rows,
        "ruler_families": fams,
    }


def _by_length(records: list[dict]) -> dict[int, float | None]:
    """RULER's score (points) per length, over its families and samples."""
    lengths = sorted({r["length"] for r in records})
    return {n: _points([r for r in records if r["length"] == n]) for n in lengths}


def _cell_power(cell: dict, pairs: list[tuple[float, float]], max_drop: float) -> None:
    """A cell's minimum detectable drop (alpha 0.05, power 0.8) and its verdict, in place: ``drop_mde`` from the
    paired per-sample differences (baseline minus policy, score points), their spread floored by the binomial
    spread of a policy at ``max_drop`` (:func:`kveval.stats.binomial_sd_points`: what one sample cannot show);
    ``verdict`` ``fail`` / ``pass`` / ``inconclusive`` (:func:`kveval.stats.inconclusive`) with
    ``more_samples_to_decide`` when inconclusive."""
    diffs = [100.0 * (b - p) for b, p in pairs]
    mde = minimum_detectable_effect(paired_standard_error(diffs, binomial_sd_points(max_drop)))
    cell["drop_mde"] = mde
    if cell.get("drop") is None:
        cell["verdict"] = None
        return
    if inconclusive(cell["drop"], max_drop, mde):
        cell["verdict"] = "inconclusive"
        total = size_to_decide(len(diffs), cell["drop"], max_drop, mde) if mde is not None else None
        cell["more_samples_to_decide"] = None if total is None else total - len(diffs)
    else:
        cell["verdict"] = "fail" if cell["drop"] > max_drop else "pass"


def _family_verdict(cells: list[dict]) -> str | None:
    """``fail`` when a cell fails beyond its MDE, else ``inconclusive`` when a cell is, else ``pass``."""
    verdicts = [c["verdict"] for c in cells if c.get("verdict") is not None]
    if not verdicts:
        return None
    return "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"


def aggregate(records: list[dict], policies: list[str], params: Params) -> dict:
    """metrics.json's ruler fields from the records (pure: the same records give the same metrics). Each cell of a
    policy also gets ``drop_mde``, ``verdict`` and (when inconclusive) ``more_samples_to_decide``
    (:func:`_cell_power`); a family's ``verdict`` is ``fail`` when one of its cells fails beyond the MDE,
    ``inconclusive`` when one is inconclusive (``more_samples_to_decide``: the most its cells need), else
    ``pass``."""
    by_policy: dict[str, list[dict]] = {}
    for r in records:
        if r.get("task") == NAME:
            by_policy.setdefault(r["policy"], []).append(r)
    families = list(params.families)
    base = _summarise(by_policy.get(BASELINE, []), families)
    base_points = _by_length(by_policy.get(BASELINE, []))
    base["ruler_length_area"] = length_area(base_points)
    base_cells = {(c["family"], c["length"]): c for c in base["ruler_cells"]}
    out: dict = {BASELINE: base, "policies": {}}
    for name in policies:
        s = _summarise(by_policy.get(name, []), families)
        s["ruler_drop"] = _drop(base["ruler_score"], s["ruler_score"])
        points = _by_length(by_policy.get(name, []))
        s["ruler_length_area"] = length_area(points)
        s["ruler_effective_length"] = effective_length(points, base_points, params.max_drop)
        s["ruler_logprob_delta"] = _diff(s["ruler_answer_logprob"], base["ruler_answer_logprob"])
        base_score = {(r["family"], r["length"], r["sample"]): r.get("score") for r in by_policy.get(BASELINE, [])}
        for cell in s["ruler_cells"]:
            b = base_cells.get((cell["family"], cell["length"]), {})
            cell["drop"] = _drop(b.get("score"), cell["score"])
            cell["logprob_delta"] = _diff(cell["logprob"], b.get("logprob"))
            pairs = [(base_score.get((r["family"], r["length"], r["sample"])), r.get("score"))
                     for r in by_policy.get(name, []) if (r["family"], r["length"]) == (cell["family"], cell["length"])]
            _cell_power(cell, [(bs, ps) for bs, ps in pairs if bs is not None and ps is not None], params.max_drop)
        for f, fam in s["ruler_families"].items():
            fam["drop"] = _drop(base["ruler_families"].get(f, {}).get("score"), fam["score"])
            cells = [c for c in s["ruler_cells"] if c["family"] == f and c["drop"] is not None]
            worst = max(((c["drop"], c["length"]) for c in cells), default=(None, None), key=lambda d: (d[0], -d[1]))
            fam["worst_drop"], fam["worst_length"] = worst
            fam["verdict"] = _family_verdict(cells)
            if fam["verdict"] == "inconclusive":
                more = [c.get("more_samples_to_decide") for c in cells if c.get("verdict") == "inconclusive"]
                fam["more_samples_to_decide"] = max((m for m in more if m is not None), default=None)
        verdicts = [fam["verdict"] for fam in s["ruler_families"].values() if fam["verdict"] is not None]
        s["ruler_verdict"] = _family_verdict([{"verdict": v} for v in verdicts])
        s["ruler_max_drop"] = params.max_drop
        out["policies"][name] = s
    return out
