"""Teacher-forced scoring: given tokens scored in one pass. :func:`score_answer`, a reference answer's
log-probabilities after its prompt; :func:`path_kld`, the KLD along a given trajectory (the FP model's own greedy
output) under each policy, by kveval's emulation.

The emulation contract (:func:`kveval.patch.emulate`, tested for the generation loop in
``tests/test_generation_decode.py``) says that one pass over a whole sequence under ``emulate(prefill_len=len(
prompt))`` gives the logits that decoding the same tokens one at a time through the real quantized cache gives.
So the policy's next-token distributions along the FP model's trajectory need no decoding loop: one forward pass
of the FP model over ``prompt + tokens[:-1]`` and one emulated pass per policy give, at every generated step, both
distributions on the same prefix; the lockstep loop would compute the same numbers with two forward calls per step.

transformers and ``kveval.patch`` are imported inside the function, so importing this module loads no model code.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch

from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs, quantized_by

#: decode steps whose log-softmaxes are formed at once (bounds the float64 temporaries of a long generation)
CHUNK = 1024


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax in float32 (float64 when the logits are), as float64 for the KLD's sum (the lockstep loop's and this module's)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(dtype), dim=-1).to(torch.float64)


def _kld(fp: torch.Tensor, policy: torch.Tensor) -> list[float]:
    """KL(P_fp || P_policy) per row of two logits tensors ``[steps, vocab]``, in chunks of :data:`CHUNK` rows."""
    out: list[float] = []
    for first in range(0, fp.shape[0], CHUNK):
        f, q = log_probs(fp[first:first + CHUNK]), log_probs(policy[first:first + CHUNK])
        out += (f.exp() * (f - q)).sum(dim=-1).tolist()
    return out


def path_kld(model, prompt: Sequence[int], tokens: Sequence[int], policies: Mapping[str, object], *,
             where: str = "a prompt") -> dict[str, list[float]]:
    """Per policy name, the KLD KL(P_fp || P_policy) at every step of the trajectory ``tokens`` generated after
    ``prompt`` (``len(tokens)`` values: step ``t`` is the distribution that chose ``tokens[t]``): one FP pass over
    ``prompt + tokens[:-1]`` (shared by the policies) and one pass under ``emulate`` per policy, the prompt as its
    prefill. The logits hold ``len(prompt) + len(tokens)`` positions of the vocabulary (the model's dtype) at once;
    the log-softmaxes are formed :data:`CHUNK` steps at a time. NaN or infinity in either pass is one
    :class:`~kveval.errors.KvevalError` line (the FP pass checked first)."""
    from kveval.patch import emulate

    if not prompt or not tokens:
        raise ValueError(f"path_kld needs a prompt and a trajectory; got {len(prompt)} and {len(tokens)} tokens")
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=model.device)
    start = len(prompt) - 1  # the logits at the prompt's last token chose tokens[0]
    out: dict[str, list[float]] = {}
    with torch.no_grad():
        fp = model(ids, use_cache=False).logits[0, start:]
        check_finite_logits(fp, where=f"{where} (the FP path)", dtype=model.dtype)
        for name, policy in policies.items():
            who = quantized_by(policy)
            with finite_quantizer_inputs(where, who or "the full-precision model"), \
                    emulate(model, policy, prefill_len=len(prompt)):
                emulated = model(ids, use_cache=False).logits[0, start:]
            check_finite_logits(emulated, where=f"{where} (the FP path)", dtype=model.dtype, quantized_by=who)
            out[name] = _kld(fp, emulated)
    return out


def accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes a parameter ``name`` (``logits_to_keep``)."""
    return name in inspect.signature(model.forward).parameters


def score_answer(model, prompt_ids: list[int], answer_ids: list[int], policy=None, *,
                 where: str = "a prompt") -> dict:
    """Teacher-forced: log-probs of ``answer_ids`` after ``prompt_ids`` in one pass (under ``emulate`` with
    ``prefill_len = len(prompt_ids)`` when ``policy`` is given; the unpatched model otherwise).

    Returns ``answer_logprob`` (mean per token), ``answer_logprob_sum``, ``answer_token_acc`` and
    ``answer_tokens``. Only the last ``len(answer)+1`` logits are computed when the model allows it. Logits with
    NaN or infinity raise one :class:`KvevalError` line naming ``where`` and whose fault it is
    (:func:`kveval.tasks.common.finite.check_finite_logits`), never a NaN score.
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


__all__ = ["CHUNK", "accepts", "log_probs", "path_kld", "score_answer"]
