"""The two scores of a prompt with a known answer, shared by the long-context tasks (``needle``, ``ruler``).

* :func:`score_answer`, teacher-forced: the prompt and the reference answer in one pass, under
  ``kveval.patch.emulate`` (prefill as the policy says) or the unpatched model; the answer's log-probabilities and
  argmax accuracy.
* :func:`generate_answer`, free-running: greedy generation through the real quantized cache
  (``kveval.patch.QuantizedKVCache``) or plain ``generate``; the decoded text. :func:`generate_answers` does the
  same for many prompts in left-padded batches (:func:`greedy_tokens`: the token ids), each row exactly as if it
  were generated alone (the cache follows each row's own tokens: ``QuantizedKVCache``, "Batches and left
  padding"), up to the float rounding of a padded batch against a single row.

NaN or infinity in the logits of either stops the run with one :class:`~kveval.errors.KvevalError` line naming the
unit of work (``where``) and whose fault it is (:mod:`kveval.tasks._finite`), never a NaN score nor an answer made
of NaN.

Helpers of the task modules (the leading underscore keeps the task registry from taking this for a task);
``kveval.patch`` is imported inside the functions, so importing this module loads no model code.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch

from kveval.tasks._finite import check_finite_logits, finite_generation, finite_quantizer_inputs


def accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes a parameter ``name`` (``logits_to_keep``)."""
    return name in inspect.signature(model.forward).parameters


def quantized_by(policy) -> str | None:
    """What quantized the cache, for the non-finite check's message: None for the unpatched model."""
    return None if policy is None else f"policy '{policy.name}'"


def score_answer(model, prompt_ids: list[int], answer_ids: list[int], policy=None, *,
                 where: str = "a prompt") -> dict:
    """Teacher-forced: log-probs of ``answer_ids`` after ``prompt_ids`` in one pass (under ``emulate`` with
    ``prefill_len = len(prompt_ids)`` when ``policy`` is given; the unpatched model otherwise).

    Returns ``answer_logprob`` (mean per token), ``answer_logprob_sum``, ``answer_token_acc`` and
    ``answer_tokens``. Only the last ``len(answer)+1`` logits are computed when the model allows it. Logits with
    NaN or infinity raise one :class:`KvevalError` line naming ``where`` and whose fault it is
    (:func:`kveval.tasks._finite.check_finite_logits`), never a NaN score.
    """
    from kveval.patch import emulate

    n = len(answer_ids)
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=model.device)
    kwargs = {"logits_to_keep": n + 1} if accepts(model, "logits_to_keep") else {}
    patch = emulate(model, policy, prefill_len=len(prompt_ids)) if policy is not None else nullcontext()
    who = quantized_by(policy)
    with finite_quantizer_inputs(where, who or "the full-precision model"), patch, torch.no_grad():
        logits = model(ids, **kwargs).logits[0, -(n + 1):-1].float()
    check_finite_logits(logits, where=where, dtype=model.dtype, quantized_by=who)
    target = torch.tensor(answer_ids, device=logits.device)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
    return {
        "answer_logprob": float(logp.mean()),
        "answer_logprob_sum": float(logp.sum()),
        "answer_token_acc": float((logits.argmax(-1) == target).float().mean()),
        "answer_tokens": n,
    }


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
                  pad_id: int | None = None, where: str = "a prompt") -> list[list[int]]:
    """Greedy continuations (token ids, at most ``max_new_tokens`` each, ending at the first end-of-sequence
    token) of ``prompts`` generated as one left-padded batch: through one ``QuantizedKVCache(model, policy,
    left_padding=...)`` when ``policy`` is given (each row quantized as if alone), plain ``generate`` (its
    DynamicCache) otherwise. Logits with NaN or +infinity raise one :class:`KvevalError` line naming ``where``."""
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
    eos = model.generation_config.eos_token_id
    eos_ids = set() if eos is None else set(eos if isinstance(eos, list) else [eos])
    return [_cut_at_eos(row, eos_ids) for row in out[:, ids.shape[1]:].tolist()]


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
    pad = pad_token_id(model, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[str] = [""] * len(prompts)
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        tokens = greedy_tokens(model, [prompts[i] for i in batch], max_new_tokens, policy, pad_id=pad, where=where)
        for i, t in zip(batch, tokens):
            answers[i] = tokenizer.decode(t, skip_special_tokens=True)
    return answers


def generate_answer(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, policy=None, *,
                    where: str = "a prompt") -> str:
    """Greedy continuation of ``prompt_ids`` (through ``QuantizedKVCache(model, policy)`` when ``policy`` is
    given), decoded without special tokens. A generated token's logits with NaN or infinity raise one
    :class:`KvevalError` line (:func:`kveval.tasks._finite.finite_generation`), never a silent answer."""
    return generate_answers(model, tokenizer, [prompt_ids], max_new_tokens, policy, where=where)[0]


__all__ = ["accepts", "generate_answer", "generate_answers", "greedy_tokens", "left_padded", "pad_token_id",
           "quantized_by", "score_answer"]
