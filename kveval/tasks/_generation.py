"""The two scores of a prompt with a known answer, shared by the long-context tasks (``needle``, ``ruler``).

* :func:`score_answer`, teacher-forced: the prompt and the reference answer in one pass, under
  ``kveval.patch.emulate`` (prefill as the policy says) or the unpatched model; the answer's log-probabilities and
  argmax accuracy.
* :func:`generate_answer`, free-running: greedy generation through the real quantized cache
  (``kveval.patch.QuantizedKVCache``) or plain ``generate``; the decoded text.

NaN or infinity in the logits of either stops the run with one :class:`~kveval.errors.KvevalError` line naming the
unit of work (``where``) and whose fault it is (:mod:`kveval.tasks._finite`), never a NaN score nor an answer made
of NaN.

Helpers of the task modules (the leading underscore keeps the task registry from taking this for a task);
``kveval.patch`` is imported inside the functions, so importing this module loads no model code.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

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


def generate_answer(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, policy=None, *,
                    where: str = "a prompt") -> str:
    """Greedy continuation of ``prompt_ids`` (through ``QuantizedKVCache(model, policy)`` when ``policy`` is
    given), decoded without special tokens. A generated token's logits with NaN or infinity raise one
    :class:`KvevalError` line (:func:`kveval.tasks._finite.finite_generation`), never a silent answer."""
    from kveval.patch import QuantizedKVCache, cache_kwargs

    ids = torch.tensor([list(prompt_ids)], device=model.device)
    who = quantized_by(policy)
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
        pad_token_id=model.generation_config.pad_token_id or tokenizer.pad_token_id or tokenizer.eos_token_id,
        logits_processor=finite_generation(where=f"{where} (generation)", dtype=model.dtype, quantized_by=who),
    )
    if policy is not None:
        kwargs.update(cache_kwargs(model, QuantizedKVCache(model, policy)))
    with finite_quantizer_inputs(where, who or "the full-precision model"), torch.no_grad():
        out = model.generate(ids, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


__all__ = ["accepts", "generate_answer", "quantized_by", "score_answer"]
