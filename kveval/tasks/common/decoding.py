"""Decoding through one cache: greedy answers of many prompts in left-padded batches, the ids they pad and stop
with, and the two scores of a prompt with a known answer that the long-context tasks (``needle``, ``ruler``) give.

* :func:`greedy_tokens`: greedy generation through the real quantized cache (``kveval.patch.QuantizedKVCache``)
  or plain ``generate``; :func:`generate_answers` decodes the text of many prompts, sorted by length into
  left-padded batches, each row exactly as if it were generated alone (the cache follows each row's own tokens:
  ``QuantizedKVCache``, "Batches and left padding"), up to the float rounding of a padded batch against a single
  row. A row ends at the first of :func:`eos_token_ids` (the model's and the tokenizer's end-of-sequence ids,
  collected here once for every task).
* :func:`answer_scores`: per prompt, the teacher-forced score of its reference answer
  (:func:`kveval.tasks.common.teacher.score_answer`) and, in batches, its greedy answer, with their timings.

The seeded samples, stop strings and the two-cache lockstep loop of the generation task are
:mod:`kveval.tasks.common.lockstep`'s. NaN or infinity in the logits stops the run with one
:class:`~kveval.errors.KvevalError` line naming the unit of work (``where``) and whose fault it is
(:mod:`kveval.tasks.common.finite`), never a NaN score nor an answer made of NaN. ``kveval.patch`` is imported
inside the functions, so importing this module loads no model code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from kveval.tasks.common.finite import finite_generation, finite_quantizer_inputs, quantized_by
from kveval.tasks.common.teacher import score_answer


def pad_token_id(model, tokenizer=None) -> int:
    """The id generation pads with: the model's, else the tokenizer's pad, else its end-of-sequence token."""
    gen = model.generation_config
    if gen.pad_token_id is not None:
        return gen.pad_token_id
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is not None:
            return pad
    eos = gen.eos_token_id
    return (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The ids a generated row ends at: the model's ``generation_config.eos_token_id`` (one or a list) and, given a
    tokenizer, its ``eos_token_id``."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both ``[len(prompts), longest]``: each prompt right-aligned after ``pad_id``
    padding (attention mask 0 there, 1 on its tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("an empty prompt cannot be generated from")
        ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token (what a row generated alone stops at;
    in a batch, a finished row is padded while the others go on)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def greedy_tokens(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, policy=None, *,
                  pad_id: int | None = None, eos_ids: set[int] | None = None,
                  where: str = "a prompt") -> list[list[int]]:
    """Greedy continuations (token ids, at most ``max_new_tokens`` each, ending at the first end-of-sequence
    token) of ``prompts`` generated as one left-padded batch: through one ``QuantizedKVCache(model, policy,
    left_padding=...)`` when ``policy`` is given (each row quantized as if alone), plain ``generate`` (its
    DynamicCache) otherwise. ``eos_ids``: where a row ends (:func:`eos_token_ids` of the model by default). Logits with NaN or +infinity raise one :class:`KvevalError` line naming ``where``."""
    from kveval.patch import QuantizedKVCache, cache_kwargs

    pad = pad_token_id(model) if pad_id is None else pad_id
    ids, mask = left_padded(prompts, pad, model.device)
    who = quantized_by(policy)
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=False, attention_mask=mask, pad_token_id=pad,
        logits_processor=finite_generation(where=f"{where} (generation)", dtype=model.dtype, quantized_by=who),
    )
    if policy is not None:
        padding = (mask.shape[1] - mask.sum(dim=1)).tolist()
        # the buffered read path: the same tokens as the lean default, faster; the tasks measure accuracy, not memory
        cache = QuantizedKVCache(model, policy, left_padding=padding, max_length=ids.shape[1] + max_new_tokens,
                                 read="buffered")
        kwargs.update(cache_kwargs(model, cache))
    with finite_quantizer_inputs(where, who or "the full-precision model"), torch.no_grad(), plain_greedy(model):
        out = model.generate(ids, **kwargs)
    stops = eos_token_ids(model) if eos_ids is None else eos_ids
    return [_cut_at_eos(row, stops) for row in out[:, ids.shape[1]:].tolist()]


@contextmanager
def plain_greedy(model):
    """During the block, ``model.generation_config`` holds only the model's bos/eos/pad token ids, so that
    ``generate`` is the argmax of the model's logits: a checkpoint's ``generation_config.json`` may ask for beam
    search (``num_beams``, which the real quantized cache refuses), a repetition penalty (Qwen2.5's 1.05),
    ``no_repeat_ngram_size`` or forced tokens, which would change the baseline's and the policies' answers alike
    and make them something other than greedy. Restored afterwards, also on error."""
    from transformers import GenerationConfig

    kept = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=kept.bos_token_id, eos_token_id=kept.eos_token_id,
                                               pad_token_id=kept.pad_token_id)
    try:
        yield
    finally:
        model.generation_config = kept


def generate_answers(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, policy=None, *,
                     where: str = "a prompt", batch_size: int = 8) -> list[str]:
    """Greedy continuations of ``prompts`` (through the real quantized cache when ``policy`` is given), decoded
    without special tokens, in the order given. Prompts are generated ``batch_size`` at a time, sorted by length
    so that a batch pads little (each row's answer does not depend on its batch: :func:`greedy_tokens`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    pad, eos = pad_token_id(model, tokenizer), eos_token_ids(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        tokens = greedy_tokens(model, [prompts[i] for i in batch], max_new_tokens, policy, pad_id=pad, eos_ids=eos,
                               where=where)
        for i, t in zip(batch, tokens):
            answers[i] = tokenizer.decode(t, skip_special_tokens=True)
    return answers


def generate_answer(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, policy=None, *,
                    where: str = "a prompt") -> str:
    """Greedy continuation of ``prompt_ids`` (through ``QuantizedKVCache(model, policy)`` when ``policy`` is
    given), decoded without special tokens. A generated token's logits with NaN or infinity raise one
    :class:`KvevalError` line (:func:`kveval.tasks.common.finite.finite_generation`), never a silent answer."""
    return generate_answers(model, tokenizer, [prompt_ids], max_new_tokens, policy, where=where)[0]


def answer_scores(model, tokenizer, prompts: Sequence[tuple[Sequence[int], Sequence[int]]], max_new_tokens: int,
                  policy=None, *, where: Sequence[str], batch_size: int, generate: bool = True) -> list[dict]:
    """Both scores of each ``(prompt_ids, answer_ids)`` under one policy (None: the unpatched model), with their
    timings: the teacher-forced score (:func:`~kveval.tasks.common.teacher.score_answer`: ``answer_logprob``,
    ``answer_logprob_sum``, ``answer_token_acc``, ``answer_tokens``, then ``seconds_score``) one prompt at a time,
    and with ``generate`` the greedy answer (``seconds_generate``, a batch's time divided by its rows, and
    ``generated``, the text) ``batch_size`` prompts per left-padded batch (:func:`generate_answers`). ``where``:
    each prompt in words, for the one line that NaN or infinity in the logits stops the run with (a batch names
    its first prompt)."""
    recs = []
    for (prompt_ids, answer_ids), w in zip(prompts, where):
        t0 = time.perf_counter()
        rec = score_answer(model, list(prompt_ids), list(answer_ids), policy, where=w)
        rec["seconds_score"] = time.perf_counter() - t0
        recs.append(rec)
    if not generate:
        return recs
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        t0 = time.perf_counter()
        texts = generate_answers(model, tokenizer, [p for p, _ in batch], max_new_tokens, policy,
                                 where=where[first] if len(batch) == 1 else f"{where[first]} and its batch",
                                 batch_size=batch_size)
        seconds = (time.perf_counter() - t0) / len(batch)
        for rec, text in zip(recs[first:first + batch_size], texts):
            rec["seconds_generate"] = seconds
            rec["generated"] = text
    return recs


__all__ = ["answer_scores", "eos_token_ids", "generate_answer", "generate_answers", "greedy_tokens", "left_padded", "pad_token_id",
           "plain_greedy"]
