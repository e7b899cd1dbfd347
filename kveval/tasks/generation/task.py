"""The generation task: the model's own long generations through the real quantized cache.

Once the cache is quantized, every later step attends to lossy keys and values, and the error is not spent once but
accumulates while the cache grows; text handed to the model (perplexity) does not show it. This task continues
every prompt with the full-precision (FP) model (transformers' ``DynamicCache``) and with each policy through
kveval's real quantized cache, one cache per decoding run (:mod:`kveval.tasks.common.lockstep` with
``measure_kld=False``); the distributions of both models along a path come from one teacher-forced pass
(:mod:`kveval.tasks.common.teacher`), which the emulation contract makes those the real cache gave while decoding:

* ``greedy``, per policy: the policy's own greedy output, its KLD from the FP model along that trajectory, and (against the baseline's greedy output) the first step where it
  departs from the FP model's text;
* ``fp_path``, per policy: the KLD along the FP model's own greedy output (the baseline's), so that the report can
  tell the cache's share of the drift from the changed path's: one teacher-forced pass per prompt under the
  emulation, whose logits are those of the policy's cache following the FP model token by token (the emulation
  contract; :mod:`kveval.tasks.common.teacher`);
* ``s<j>`` (``samples: k``): k seeded samples per prompt with an answer, for the baseline and each policy with the
  same seeds (common random numbers), for pass@1 averaged over the samples and the unbiased pass@k.

Prompts (:mod:`kveval.tasks.generation.prompts`): the builtin set (procedural tasks with checkable answers the
builtin model can do, and open-ended corpus continuations) or a JSONL file; a prompt with an answer is scored by its
checker (:mod:`kveval.tasks.generation.checkers`), a reasoning model's ``<think>`` part kept for the fidelity
metrics and stripped before the check. The model's chat template wraps a task prompt when it has one
(``chat_template``); continuations are raw text.

One record per (prompt, policy or baseline, unit) with the generated ids; a resumed run skips recorded units, and
the metrics come from the records alone (:mod:`kveval.tasks.generation.aggregate`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.tasks.common.lockstep import Trajectory
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.generation.aggregate import aggregate
from kveval.tasks.generation.params import NAME, Params
from kveval.tasks.generation.prompts import Prompt, builtin_prompts, load_jsonl

__all__ = ["NAME", "Params", "aggregate", "check", "run"]

GREEDY, FP_PATH = "greedy", "fp_path"


def record_key(prompt_id: str, who: str, unit: str) -> str:
    """``generation/<prompt>/<policy or baseline>/<greedy | fp_path | s<j>>``."""
    return f"{NAME}/{prompt_id}/{who}/{unit}"


def sample_seed(run_seed: int, prompt_id: str, sample: int) -> int:
    """The seed of sample ``sample`` of a prompt: the same for the baseline and every policy (so that their
    samples differ by the cache alone), stable across runs and batches (a hash, not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{run_seed}/{prompt_id}/{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def prompt_set(ctx, params: Params) -> list[Prompt]:
    """The run's prompts: the builtin set (its continuations cut from the run's corpus) or the JSONL file."""
    if params.prompts != "builtin":
        return load_jsonl(params.prompts)
    tokens = ctx.tokens() if params.continuations else None
    texts = []
    for i in range(params.continuations):
        piece = tokens[i * params.continuation_tokens:(i + 1) * params.continuation_tokens]
        texts.append(ctx.tokenizer.decode(piece.tolist(), skip_special_tokens=True))
    return builtin_prompts(params.tasks_per_kind, texts, seed=ctx.cfg.seed)


def prompt_ids(tokenizer, prompt: Prompt, params: Params) -> list[int]:
    """A prompt's token ids: a task prompt in the model's chat template (when it has one and ``chat_template``;
    ``thinking`` switches a reasoning model's thinking mode), a continuation as raw text."""
    if prompt.kind != "continuation" and params.chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                            tokenize=True, enable_thinking=params.thinking)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding on newer tokenizers
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])


def check(ctx, params: Params) -> None:
    """Input errors before anything is written: a prompt file kveval cannot use, a corpus too short for the
    continuations, prompts plus ``max_new_tokens`` beyond the model's context, thinking without a chat template."""
    from kveval.models import model_context_limit

    if params.thinking and not params.chat_template:
        raise KvevalError("tasks: generation.thinking needs chat_template: true (the thinking mode is the chat "
                          "template's); set chat_template: true or thinking: false")
    if params.thinking and not getattr(ctx.tokenizer, "chat_template", None):
        raise KvevalError(f"tasks: generation.thinking: the tokenizer of {ctx.cfg.model.name} has no chat template, "
                          "so there is no thinking mode to switch on; set thinking: false, or use a model with one")
    if params.prompts == "builtin" and params.continuations:
        need, have = params.continuations * params.continuation_tokens, ctx.tokens().numel()
        if have < need:
            raise KvevalError(f"tasks: generation: the corpus has {have} tokens, fewer than continuations x "
                              f"continuation_tokens = {need}; lower them")
    prompts = prompt_set(ctx, params)
    if not prompts:
        raise KvevalError("tasks: generation has no prompts (tasks_per_kind and continuations give none); raise one")
    limit = model_context_limit(ctx.model)
    widths = {p.id: len(prompt_ids(ctx.tokenizer, p, params)) for p in prompts}  # each prompt tokenized once
    longest = max(prompts, key=lambda p: widths[p.id])
    width = widths[longest.id]
    if width + params.max_new_tokens > limit:
        raise KvevalError(f"tasks: generation: prompt '{longest.id}' ({width} tokens) plus max_new_tokens "
                          f"{params.max_new_tokens} exceeds the model's context ({limit} tokens); lower "
                          "max_new_tokens or shorten the prompt")


def _stop_test(tokenizer, stops: list[str]) -> Callable[[list[int]], bool] | None:
    """Whether a row's generated ids now hold one of the stop strings (its decoded tail is read)."""
    if not stops:
        return None
    tail_tokens = max(8, max(len(s) for s in stops) + 4)

    def stopped(tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-tail_tokens:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    return stopped


def run(ctx, params: Params) -> dict:
    """Generate every unit that is not recorded yet, then aggregate every record.

    The tokens come from decoding through one cache a step (the FP model's ``DynamicCache`` for the baseline, the
    policy's real ``QuantizedKVCache`` for a policy; :func:`kveval.tasks.common.lockstep.lockstep_generate` with
    ``measure_kld=False``): the baseline's greedy output first (the FP path), then per policy its greedy output
    with its KLD along its own path, then every policy's KLD along the FP path, both from teacher-forced passes
    (:mod:`kveval.tasks.common.teacher`: the emulation contract makes them the distributions the real cache gave
    while decoding; the FP pass over the FP path is shared by the policies of a prompt), then the samples of every
    (prompt with an answer, sample) of the baseline and each policy, batched together. One unit per record
    (:func:`kveval.tasks.common.runner.run_units`); greedy outputs and samples are decoded ``batch_size`` rows at
    a time, sorted by prompt length (the least left padding)."""
    prompts = prompt_set(ctx, params)
    ids = {p.id: prompt_ids(ctx.tokenizer, p, params) for p in prompts}
    scored = [p for p in prompts if p.answer is not None]  # the samples serve pass@k: prompts with an answer
    whos = (BASELINE, *ctx.policies)

    def decoded(kind: str, who: str, rows: list[Row]) -> list[Unit]:
        rows = sorted(rows, key=lambda r: len(ids[r[0].id]))
        return [Unit(_key(r, who), (r, who), batch=(kind, who), group=kind, steps=params.max_new_tokens)
                for r in rows]

    units = [u for who in whos for u in decoded(GREEDY, who, [(p, GREEDY, None) for p in prompts])]
    units += [Unit(record_key(p.id, n, FP_PATH), ((p, FP_PATH, None), n), batch=(FP_PATH, p.id), group=FP_PATH,
                   steps=params.max_new_tokens) for p in prompts for n in ctx.policies]
    units += [u for who in whos
              for u in decoded("samples", who, [(p, f"s{j}", j) for j in range(params.samples or 0) for p in scored])]

    def prepare(group: list[Unit]) -> dict | None:
        """For the FP-path units: the baseline's greedy record of each of their prompts, every one checked first."""
        if group[0].group != FP_PATH:
            return None
        return _fp_paths(ctx, list(dict.fromkeys(u.item[0][0] for u in group)))

    def evaluate(batch: list[Unit], base: dict | None) -> Iterator[dict]:
        kind, who = batch[0].batch
        if kind == FP_PATH:
            yield from _score_fp_path(ctx, params, [u.item for u in batch], ids, base)
            return
        rows = [u.item[0] for u in batch]
        for (p, unit, _), t in zip(rows, _decode(ctx, params, rows, ids, who)):
            if who != BASELINE and unit == GREEDY:
                t.kld = _path_kld(ctx, ids[p.id], t.tokens, who, "")
            yield _record(ctx.tokenizer, params, p, who, unit, t)

    run_units(ctx, NAME, units, Work(label="generation", noun="outputs", evaluate=evaluate, prepare=prepare,
                                     batch_size=lambda b: None if b[0] == FP_PATH else params.batch_size,
                                     amount=lambda unit, record: len(record["tokens"])))
    return aggregate(ctx.run.records(), prompts, list(ctx.policies), params,
                     decode=lambda t: ctx.tokenizer.decode(t, skip_special_tokens=True))


#: one row of a decoding batch: (prompt, unit: "greedy", "fp_path" or "s<j>", sample j or None)
Row = tuple[Prompt, str, "int | None"]


def _key(row: Row, who: str) -> str:
    return record_key(row[0].id, who, row[1])


def _fp_paths(ctx, prompts: list[Prompt]) -> dict[str, dict]:
    """The baseline's greedy record of each prompt (the FP path its policies are scored along), each checked to
    hold valid token ids before any is scored (they are the baseline's records, written first)."""
    base = {r["prompt"]: r for r in ctx.run.records()
            if r.get("task") == NAME and r.get("policy") == BASELINE and r.get("unit") == GREEDY}
    vocab = ctx.model.get_output_embeddings().weight.shape[0]
    for p in prompts:
        tokens = base.get(p.id, {}).get("tokens")
        if not (isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < vocab for t in tokens)):
            raise KvevalError(f"records.jsonl: the baseline's greedy record of prompt '{p.id}' holds no valid token "
                              f"ids (the FP path the policies are scored on); delete the line of key "
                              f"'{record_key(p.id, BASELINE, GREEDY)}' to generate it again")
    return base


def _score_fp_path(ctx, params: Params, items: list, ids: dict[str, list[int]], base: dict) -> Iterator[dict]:
    """The ``fp_path`` records of one prompt: each pending policy's KLD along the baseline's greedy output, from one
    FP pass shared by the policies and one emulated pass per policy."""
    from kveval.tasks.common.teacher import path_kld

    p = items[0][0][0]
    tokens = base[p.id]["tokens"]
    klds = path_kld(ctx.model, ids[p.id], tokens, {n: ctx.policies[n] for _, n in items},
                    where=f"generation {FP_PATH}")
    for name, kld in klds.items():
        fp = Trajectory(tokens=list(tokens), kld=kld, ended=base[p.id]["ended"])
        yield _record(ctx.tokenizer, params, p, name, FP_PATH, fp)


def _decode(ctx, params: Params, batch: list[Row], ids: dict[str, list[int]], who: str):
    """One batch through one cache (the FP model's for the baseline, the policy's real quantized cache for a
    policy): greedy rows, or seeded samples (each row's own seed: the same for the baseline and every policy)."""
    from kveval.tasks.common.decoding import eos_token_ids, pad_token_id
    from kveval.tasks.common.lockstep import Sampling, lockstep_generate

    model, tokenizer = ctx.model, ctx.tokenizer
    samples = [j for _, _, j in batch]
    if any(j is None for j in samples) and any(j is not None for j in samples):
        raise ValueError("a batch mixes greedy rows and samples")
    sampling = None if samples[0] is None else Sampling(
        temperature=params.temperature, top_p=params.top_p,
        seeds=[sample_seed(ctx.cfg.seed, p.id, j) for p, _, j in batch])
    return lockstep_generate(
        model, [ids[p.id] for p, _, _ in batch], None if who == BASELINE else ctx.policies[who],
        driver="fp" if who == BASELINE else "policy", max_new_tokens=params.max_new_tokens,
        eos_ids=eos_token_ids(model, tokenizer), pad_id=pad_token_id(model, tokenizer), sampling=sampling,
        stop=_stop_test(tokenizer, params.stop), where=f"generation of {who}", measure_kld=False)


def _path_kld(ctx, prompt_ids: list[int], tokens: list[int], who: str, unit: str) -> list[float]:
    """The KLD of policy ``who`` at every step of ``tokens`` after the prompt, in one teacher-forced pass."""
    from kveval.tasks.common.teacher import path_kld

    where = f"generation {unit + ' ' if unit else ''}of {who}"
    return path_kld(ctx.model, prompt_ids, tokens, {who: ctx.policies[who]}, where=where)[who]


def _record(tokenizer, params: Params, prompt: Prompt, who: str, unit: str, trajectory) -> dict:
    """One unit's record: the generated ids, how they ended, the KLD per step (FP || policy; zeros for the
    baseline), and for a prompt with an answer whether the (thinking-stripped) text passes its checker."""
    from kveval.tasks.generation.checkers import check_answer, strip_thinking

    rec = {"key": record_key(prompt.id, who, unit), "task": NAME, "prompt": prompt.id, "policy": who, "unit": unit,
           "tokens": list(trajectory.tokens), "ended": trajectory.ended,
           "kld": [float(v) for v in trajectory.kld]}
    if unit == FP_PATH:
        return rec  # the FP model's own tokens (the baseline's greedy record holds them): only the KLD is new
    text = tokenizer.decode(trajectory.tokens, skip_special_tokens=True)
    for s in params.stop:
        text = text.split(s, 1)[0]
    rec["text"] = text
    if prompt.answer is not None and prompt.checker is not None:
        answer_text = strip_thinking(text) if params.thinking else text
        rec["correct"] = bool(check_answer(answer_text, prompt.answer, prompt.checker, prompt=prompt.id))
    return rec
