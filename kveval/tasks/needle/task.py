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
written (:mod:`kveval.tasks._finite`): no score is ever NaN.
"""

from __future__ import annotations

import time

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.stats import minimum_detectable_effect, paired_standard_error
from kveval.tasks._generation import generate_answers, score_answer
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
# The two scores (score_answer, teacher-forced, and generate_answers, greedy: kveval.tasks._generation)
# ---------------------------------------------------------------------------------------------------------------
def trial_words(context: int, depth: float, trial: int) -> str:
    """A trial in words, for messages: ``needle trial 0 (context 64, depth 0.5)``."""
    return f"needle trial {trial} (context {context}, depth {depth:g})"


def evaluate(model, tokenizer, trials: list, params: Params, policy=None, *, where: list[str]) -> list[dict]:
    """Both scores of ``trials`` (``(spec, prompt)`` pairs) under one policy (None: the unpatched model), with
    their timings: the teacher-forced score one trial at a time, the greedy generation ``params.batch_size``
    trials per left-padded batch (:func:`kveval.tasks._generation.generate_answers`; each row as if alone, up to
    a batch's float rounding; ``seconds_generate`` is a batch's time divided by its rows). ``where``: each trial
    in words, for the one line that NaN or infinity in the logits stops the run with."""
    recs = []
    for (_, prompt), w in zip(trials, where):
        t0 = time.perf_counter()
        rec = score_answer(model, prompt.input_ids, prompt.answer_ids, policy, where=w)
        rec["seconds_score"] = time.perf_counter() - t0
        recs.append(rec)
    if not params.generate:
        return recs
    size = params.batch_size
    for first in range(0, len(trials), size):
        batch = trials[first:first + size]
        t0 = time.perf_counter()
        texts = generate_answers(model, tokenizer, [p.input_ids for _, p in batch], params.max_new_tokens, policy,
                                 where=where[first] if len(batch) == 1 else f"{where[first]} and its batch",
                                 batch_size=size)
        seconds = (time.perf_counter() - t0) / len(batch)
        for rec, (spec, _), text in zip(recs[first:first + size], batch, texts):
            rec["seconds_generate"] = seconds
            rec["generated"] = text
            rec["exact_match"] = int(exact_match(text, spec.answer))
    return recs


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def run(ctx, params: Params) -> dict:
    """Evaluate every (cell, trial, policy) not yet recorded and aggregate all needle records (the report draws
    the heatmaps from the result). The trials of one context length are generated together, ``batch_size`` per
    batch (their prompts have the same length); their records are written when their batch is done."""
    names = [BASELINE, *ctx.policies]
    trials = [(c, d, t) for c in params.context_lengths for d in params.depths for t in range(params.trials)]
    done = ctx.run.done_keys()
    todo = [x for x in trials if any(record_key(params.variant, *x, n) not in done for n in names)]
    if len(todo) < len(trials):
        ctx.progress.log(f"needle: resuming, {len(trials) - len(todo)} of {len(trials)} trials already recorded")
    sentences = haystack(ctx, params)
    model, tok = ctx.model, ctx.tokenizer
    by_context: dict[int, list[tuple[float, int]]] = {}
    for context, depth, trial in todo:
        by_context.setdefault(context, []).append((depth, trial))
    with ctx.progress.task(f"needle ({params.variant})", total=len(todo) * len(names), unit="tok") as advance:
        for context, cells in by_context.items():
            made = {c: trial_prompt(tok, params, sentences, seed=ctx.cfg.seed, context=context, depth=c[0],
                                    trial=c[1]) for c in cells}
            for name in names:
                pending = [c for c in cells if record_key(params.variant, context, *c, name) not in done]
                for _ in range(len(cells) - len(pending)):
                    advance(0)
                policy = None if name == BASELINE else ctx.policies[name]
                for first in range(0, len(pending), params.batch_size):
                    chunk = pending[first:first + params.batch_size]
                    scored = evaluate(model, tok, [made[c] for c in chunk], params, policy,
                                      where=[trial_words(context, *c) for c in chunk])
                    for (depth, trial), result in zip(chunk, scored):
                        spec, prompt = made[(depth, trial)]
                        rec = {
                            "key": record_key(params.variant, context, depth, trial, name), "task": NAME,
                            "variant": params.variant, "context": context, "depth": depth, "trial": trial,
                            "policy": name, "answer": spec.answer, "prompt_tokens": len(prompt.input_ids),
                            "needle_start": prompt.needle_start,
                            "needle_depth_tokens": prompt.needle_start - prompt.haystack_start,
                        }
                        rec.update(result)
                        ctx.run.append(rec)
                        advance(context)
    return aggregate(ctx.run.records(), list(ctx.policies))


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summarise(records: list[dict]) -> dict:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["variant"], r["context"], r["depth"]), []).append(r)
    rows = []
    for (variant, context, depth), recs in sorted(cells.items()):
        rows.append({
            "variant": variant, "context": context, "depth": depth, "trials": len(recs),
            "accuracy": _mean([r.get("exact_match") for r in recs]),
            "logprob": _mean([r["answer_logprob"] for r in recs]),
            "token_acc": _mean([r["answer_token_acc"] for r in recs]),
        })
    return {
        "needle_accuracy": _mean([r.get("exact_match") for r in records]),
        "needle_answer_logprob": _mean([r["answer_logprob"] for r in records]),
        "needle_token_acc": _mean([r["answer_token_acc"] for r in records]),
        "needle_trials": len(records),
        "needle_cells": rows,
    }


def _trial_id(r: dict) -> tuple:
    return (r["variant"], r["context"], r["depth"], r["trial"])


def aggregate(records: list[dict], policies: list[str]) -> dict:
    """metrics.json's needle fields from the records (pure: the same records give the same metrics)."""
    by_policy: dict[str, list[dict]] = {}
    for r in records:
        if r.get("task") == NAME:
            by_policy.setdefault(r["policy"], []).append(r)
    base_recs = by_policy.get(BASELINE, [])
    base = _summarise(base_recs)
    base_hit = {_trial_id(r): r.get("exact_match") for r in base_recs}
    out = {BASELINE: base, "policies": {}}
    for name in policies:
        recs = by_policy.get(name, [])
        s = _summarise(recs)
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

