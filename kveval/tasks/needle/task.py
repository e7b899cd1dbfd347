"""Long-context retrieval: a passkey or a fact hidden at a depth of a context, scored two ways, per policy.

Grid: ``context_lengths`` × ``depths`` cells, ``trials`` per cell, each trial with fresh seeded values
(``kveval.tasks.needle.prompts``). Every policy (and the FP baseline) sees the same prompts. A context length is the
whole sequence the cache holds at the end: the prompt is exactly ``context - max_new_tokens`` tokens, so
prompt + answer never exceeds it (the RULER convention; an 8192-token context fits an 8192-token model).

Per (trial, policy), one record:
- ``exact_match``: greedy generation (``max_new_tokens``) through the real quantized cache (``QuantizedKVCache``,
  prefill as the policy says; plain ``generate`` for the baseline), the answer anywhere in the output.
- ``answer_logprob`` (mean per answer token; ``answer_logprob_sum`` too) and ``answer_token_acc`` (argmax ==
  answer token): the prompt plus the answer in one teacher-forced pass under ``emulate(prefill_len=prompt)``.

metrics.json, per policy (and baseline): ``needle_accuracy``, ``needle_answer_logprob``, ``needle_token_acc``,
``needle_trials``, ``needle_cells`` ([{variant, context, depth, trials, accuracy, logprob, token_acc}]); policies
add ``needle_accuracy_delta``, ``needle_logprob_delta`` and ``needle_lost`` (share of trials the baseline answers
and the policy does not). The task draws nothing: with ``plots: true`` (the default) the report draws
``plots/needle_<policy>.png`` and ``plots/needle_<policy>_diff.png`` from these metrics
(:mod:`kveval.report.task_figures`).

NaN or infinity in a trial's logits (teacher-forced, or of a generated token) stops the run with one line that
says whose fault it is (the model's, or the policy's quantizer or emulation) before that trial's record is
written (:mod:`kveval.tasks.common.finite`): no score is ever NaN.
"""

from __future__ import annotations

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.stats import (
    effective_length,
    length_area,
    mean_of_present,
    minimum_detectable_effect,
    paired_standard_error,
)
from kveval.tasks.common.decoding import answer_scores
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.needle.params import NAME, Params  # noqa: F401 (a task module names its NAME and Params)
from kveval.tasks.needle.prompts import (
    PASSKEY_FILLER,
    SentenceTokens,
    build_prompt,
    exact_match,
    make_spec,
    split_sentences,
    trial_rng,
)


def record_key(variant: str, context: int, depth: float, trial: int, policy: str) -> str:
    return f"needle/{variant}/c{context}/d{depth:g}/t{trial}/{policy}"


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------
def haystack(ctx, params: Params) -> SentenceTokens:
    """Filler sentences (tokenized on demand, cached in ``ctx.cache``): repetitive text for passkey, the
    config's corpus (``data``) for needle."""
    key = f"needle_haystack/{params.variant}"
    if key not in ctx.cache:
        if params.variant == "passkey":
            sentences = list(PASSKEY_FILLER)
        else:
            from kveval.data import load_text

            d = ctx.cfg.data
            sentences = split_sentences(load_text(d.source, split=d.split, text_field=d.text_field))
        ctx.cache[key] = SentenceTokens(ctx.tokenizer, sentences)
    return ctx.cache[key]


def trial_prompt(tokenizer, params: Params, sentences: SentenceTokens, *, seed: int, context: int, depth: float,
                 trial: int):
    """The (spec, prompt) of one trial; the same arguments always give the same prompt."""
    rng = trial_rng(seed=seed, variant=params.variant, context=context, depth=depth, trial=trial)
    spec = make_spec(params.variant, rng)
    start = rng.randrange(len(sentences))
    prompt = build_prompt(
        tokenizer, spec, prompt_tokens=context - params.max_new_tokens, depth=depth, sentences=sentences,
        start=start, chat_template=params.chat_template,
    )
    if len(prompt.answer_ids) > params.max_new_tokens:
        raise KvevalError(
            f"needle: the answer takes {len(prompt.answer_ids)} tokens, more than max_new_tokens "
            f"{params.max_new_tokens}; raise max_new_tokens"
        )
    return spec, prompt


def check(ctx, params: Params) -> None:
    """Input errors before anything is written: a context beyond the model's, a context too short for the
    instruction + needle + answer, an unreadable corpus."""
    from kveval.models import model_context_limit

    limit = model_context_limit(ctx.model)
    too_long = [c for c in params.context_lengths if c > limit]
    if too_long:
        raise KvevalError(
            f"tasks: needle.context_lengths {too_long} exceed the model's context ({limit} tokens); lower them"
        )
    sentences = haystack(ctx, params)
    shortest = min(params.context_lengths)
    if shortest <= params.max_new_tokens:
        raise KvevalError(f"tasks: needle.context_lengths {shortest} leaves no room for a prompt before "
                          f"max_new_tokens {params.max_new_tokens}")
    for depth in params.depths:
        for trial in range(params.trials):
            try:
                trial_prompt(ctx.tokenizer, params, sentences, seed=ctx.cfg.seed, context=shortest, depth=depth,
                             trial=trial)
            except KvevalError as exc:
                raise KvevalError(f"tasks: needle: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# The two scores (score_answer, teacher-forced, and generate_answers, greedy: kveval.tasks.common.decoding)
# ---------------------------------------------------------------------------------------------------------------
def trial_words(context: int, depth: float, trial: int) -> str:
    """A trial in words, for messages: ``needle trial 0 (context 64, depth 0.5)``."""
    return f"needle trial {trial} (context {context}, depth {depth:g})"


def evaluate(model, tokenizer, trials: list, params: Params, policy=None, *, where: list[str]) -> list[dict]:
    """Both scores of ``trials`` (``(spec, prompt)`` pairs) under one policy (None: the unpatched model), with
    their timings (:func:`kveval.tasks.common.decoding.answer_scores`: teacher-forced one trial at a time, greedy
    ``params.batch_size`` trials per left-padded batch) and, when generated, ``exact_match``: the answer anywhere
    in the output. ``where``: each trial in words, for the one line that NaN or infinity in the logits stops the
    run with."""
    recs = answer_scores(model, tokenizer, [(p.input_ids, p.answer_ids) for _, p in trials], params.max_new_tokens,
                         policy, where=where, batch_size=params.batch_size, generate=params.generate)
    if params.generate:
        for rec, (spec, _) in zip(recs, trials):
            rec["exact_match"] = int(exact_match(rec["generated"], spec.answer))
    return recs


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def run(ctx, params: Params) -> dict:
    """Evaluate every (cell, trial, policy) not yet recorded and aggregate all needle records (the report draws
    the heatmaps from the result). Per context length, the prompts are built once; then per policy its pending
    trials are scored ``batch_size`` at a time (their prompts have the same length), each record written when its
    batch is done (:func:`kveval.tasks.common.runner.run_units`)."""
    names = [BASELINE, *ctx.policies]
    units = [Unit(record_key(params.variant, c, d, t, name), (c, d, t), batch=(c, name), group=c, amount=c,
                  tally=(c, d, t))
             for c in params.context_lengths for name in names for d in params.depths for t in range(params.trials)]
    sentences = haystack(ctx, params)
    model, tok = ctx.model, ctx.tokenizer

    def prepare(group: list[Unit]) -> dict:
        cells = dict.fromkeys(u.item for u in group)
        return {x: trial_prompt(tok, params, sentences, seed=ctx.cfg.seed, context=x[0], depth=x[1], trial=x[2])
                for x in cells}

    def evaluate_batch(batch: list[Unit], made: dict):
        name = batch[0].batch[1]
        policy = None if name == BASELINE else ctx.policies[name]
        scored = evaluate(model, tok, [made[u.item] for u in batch], params, policy,
                          where=[trial_words(*u.item) for u in batch])
        for u, result in zip(batch, scored):
            context, depth, trial = u.item
            spec, prompt = made[u.item]
            rec = {
                "key": u.key, "task": NAME, "variant": params.variant, "context": context, "depth": depth,
                "trial": trial, "policy": name, "answer": spec.answer, "prompt_tokens": len(prompt.input_ids),
                "needle_start": prompt.needle_start,
                "needle_depth_tokens": prompt.needle_start - prompt.haystack_start,
            }
            rec.update(result)
            yield rec

    run_units(ctx, NAME, units, Work(label=f"needle ({params.variant})", noun="trials", evaluate=evaluate_batch,
                                     prepare=prepare, batch_size=params.batch_size))
    return aggregate(ctx.run.records(), list(ctx.policies), max_drop=params.max_drop)


def _summarise(records: list[dict]) -> dict:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["variant"], r["context"], r["depth"]), []).append(r)
    rows = []
    for (variant, context, depth), recs in sorted(cells.items()):
        rows.append({
            "variant": variant, "context": context, "depth": depth, "trials": len(recs),
            "accuracy": mean_of_present([r.get("exact_match") for r in recs]),
            "logprob": mean_of_present([r["answer_logprob"] for r in recs]),
            "token_acc": mean_of_present([r["answer_token_acc"] for r in recs]),
        })
    return {
        "needle_accuracy": mean_of_present([r.get("exact_match") for r in records]),
        "needle_answer_logprob": mean_of_present([r["answer_logprob"] for r in records]),
        "needle_token_acc": mean_of_present([r["answer_token_acc"] for r in records]),
        "needle_trials": len(records),
        "needle_cells": rows,
    }


def _trial_id(r: dict) -> tuple:
    return (r["variant"], r["context"], r["depth"], r["trial"])


def _by_context(summary: dict) -> dict[int, float | None]:
    """Exact-match accuracy (points) per context length, over its depths and trials."""
    cells: dict[int, list] = {}
    for row in summary["needle_cells"]:
        if row["accuracy"] is not None:
            cells.setdefault(row["context"], []).extend([row["accuracy"]] * row["trials"])
    return {c: 100.0 * v for c, vals in cells.items() if (v := mean_of_present(vals)) is not None}


def aggregate(records: list[dict], policies: list[str], *, max_drop: float = 5.0) -> dict:
    """metrics.json's needle fields from the records (pure: the same records give the same metrics). Besides the
    grid: ``needle_length_area`` (the mean accuracy in points over the context lengths, MRCR's area) and, per
    policy, ``needle_effective_length`` (the longest context up to which every context is within ``max_drop``
    points of the baseline's accuracy: RULER's effective length)."""
    by_policy: dict[str, list[dict]] = {}
    for r in records:
        if r.get("task") == NAME:
            by_policy.setdefault(r["policy"], []).append(r)
    base_recs = by_policy.get(BASELINE, [])
    base = _summarise(base_recs)
    base_points = _by_context(base)
    base["needle_length_area"] = length_area(base_points)
    base_hit = {_trial_id(r): r.get("exact_match") for r in base_recs}
    out = {BASELINE: base, "policies": {}}
    for name in policies:
        recs = by_policy.get(name, [])
        s = _summarise(recs)
        points = _by_context(s)
        s["needle_length_area"] = length_area(points)
        s["needle_effective_length"] = effective_length(points, base_points, max_drop)
        for field, delta in (("needle_accuracy", "needle_accuracy_delta"), ("needle_answer_logprob", "needle_logprob_delta")):
            s[delta] = None if s[field] is None or base[field] is None else s[field] - base[field]
        pairs = [(base_hit.get(_trial_id(r)), r.get("exact_match")) for r in recs]
        pairs = [(b, p) for b, p in pairs if b is not None and p is not None]
        s["needle_lost"] = sum(1 for b, p in pairs if b and not p) / len(pairs) if pairs else None
        # the smallest accuracy change the trials detect (alpha 0.05, power 0.8), from the paired differences of
        # exact match (policy minus baseline, trial by trial); None below 2 paired trials. No threshold: no verdict
        s["needle_accuracy_delta_mde"] = minimum_detectable_effect(
            paired_standard_error(float(bool(p)) - float(bool(b)) for b, p in pairs))
        out["policies"][name] = s
    return out

