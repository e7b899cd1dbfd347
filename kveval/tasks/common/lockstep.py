"""Decoding a left-padded batch through one cache, or two in lockstep: greedy or seeded samples, stop strings.

:func:`lockstep_generate` is the decoding loop of the generation task. With ``measure_kld=False`` (how the task
runs) only the ``driver``'s cache runs: the FP model's ``DynamicCache`` (``driver="fp"``) or a policy's real
``QuantizedKVCache`` (``driver="policy"``), one forward call per step, greedy (argmax) or seeded samples
(:class:`Sampling`), each row ending at an end-of-sequence id or a stop string (:class:`Trajectory`).

With ``measure_kld=True`` it decodes through both caches of the same model at once, the same prefix each step:
the driver chooses the next token, the other cache is fed it (teacher-forced on the driver's trajectory), and the
loop keeps per step KL(P_fp || P_policy) (and, when asked, the policy's log-probabilities). That mode is the test
oracle of the one-pass KLD of :mod:`kveval.tasks.common.teacher` (``tests/test_generation_decode.py``) and of the
GPU check (``bench/gpu_check.py``); the task itself computes the KLD in one teacher-forced pass.

Each forward call copies what ``model.generate`` makes (transformers 5.25's ``generation/utils.py``:
``_prepare_position_ids_for_generation``, ``_update_model_kwargs_for_generation``,
``prepare_inputs_for_generation``; ``tests/test_generation_decode.py`` holds the loop to ``generate``'s tokens on
every tiny attention family, so an upgrade that changes them shows): position ids from the attention
mask's cumulative sum (0 on the padding), the whole 2-D mask each step (dropped when the prompts hold no padding,
as ``generate`` drops an all-ones mask), ``logits_to_keep=1`` when the model takes it, a finished row fed the pad
token with mask 1 (its outputs discarded; attention is per row, so the other rows never see it); the greedy token
is the argmax of the logits cast to float32, as ``generate`` takes it. So ``driver="fp"`` greedy gives
``generate``'s tokens (plain ``DynamicCache``) and ``driver="policy"`` greedy those of
``kveval.tasks.common.decoding.greedy_tokens`` (the real cache through ``generate``). The checkpoint's
``generation_config`` plays no part (no repetition penalty, no forced tokens: the argmax or the sample, nothing
else).

NaN or infinity in either model's logits stops the run with one :class:`~kveval.errors.KvevalError` line
(:mod:`kveval.tasks.common.finite`): the full-precision logits are checked first, so a model that overflows on its
own is named as such, never the policy.

transformers and ``kveval.patch`` are imported inside the function, so importing this module loads no model code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kveval.tasks.common.decoding import left_padded
from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs, quantized_by
from kveval.tasks.common.teacher import accepts, log_probs

#: the drivers: whose logits choose the next token
DRIVERS = ("policy", "fp")


@dataclass(frozen=True)
class Sampling:
    """Seeded sampling: the logits divided by ``temperature``, then the nucleus (the smallest set of the most likely
    tokens whose mass is >= ``top_p``, renormalised), one draw per step from row ``r``'s own CPU
    ``torch.Generator`` seeded with ``seeds[r]`` (so a row's samples do not depend on the batch it is in)."""

    temperature: float
    top_p: float
    seeds: list[int]

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")


@dataclass
class Trajectory:
    """One row's generation.

    ``tokens``: the generated ids, up to and including the first end-of-sequence token, or up to the token after
    which ``stop`` answered True (cutting the stop string out is the caller's business). ``kld``: per generated
    step ``t`` (the distribution that chose ``tokens[t]``), KL(P_fp(. | prefix_t) || P_policy(. | prefix_t)) in
    nats, a float64 sum over the vocabulary of the float32 log-softmax of each (float64 when the model is): exactly
    0 where both logits are equal, within rounding of 0 (possibly a hair below) where they nearly are. ``ended``:
    ``"eos"``, ``"stop"`` or ``"length"`` (``max_new_tokens`` reached). ``logprobs``: with ``record_logprobs``, the
    policy's log-softmax per step (a CPU tensor ``[vocab]``, float32 or float64), else None.
    """

    tokens: list[int] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    ended: str = "length"
    logprobs: list[torch.Tensor] | None = None


def sample_token(scores: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One draw from ``scores`` (one row's logits ``[vocab]``) under ``sampling``: softmax of ``scores /
    temperature`` in float64 on the CPU, the nucleus of ``top_p`` (the most likely tokens, in order, until their
    mass reaches ``top_p``; ties kept in vocabulary order), then the inverse of the kept tokens' cumulative mass
    at one uniform draw of ``generator`` (one ``torch.rand`` per token: the row's stream advances by one per step)."""
    probs = torch.softmax(scores.detach().to("cpu", torch.float64) / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(probs, dim=-1) - probs  # the mass of the more likely tokens
        kept = int((before < sampling.top_p).sum())  # >= 1: the first token's `before` is 0
        probs, order = probs[:kept], order[:kept]
    else:
        order = None
    cumulative = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    j = min(int(torch.searchsorted(cumulative, u * cumulative[-1], right=True)), probs.numel() - 1)
    return j if order is None else int(order[j])


def lockstep_generate(model, prompts: Sequence[Sequence[int]], policy, *, driver: str, max_new_tokens: int,
                      eos_ids: set[int], pad_id: int, sampling: Sampling | None = None,
                      stop: Callable[[list[int]], bool] | None = None, read: str = "buffered",
                      where: str = "a prompt", record_logprobs: bool = False,
                      measure_kld: bool = True) -> list[Trajectory]:
    """Generate ``prompts`` (token ids per row, non-empty) as one left-padded batch through the full-precision
    cache and ``policy``'s real quantized cache in lockstep; one :class:`Trajectory` per row, in order.

    ``driver``: ``"policy"`` (the policy's logits choose each token, the FP model follows) or ``"fp"`` (the FP
    model chooses, the policy's cache follows). ``sampling``: None for greedy (the argmax of the float32 logits,
    as ``generate``), else seeded samples (:class:`Sampling`, one seed per row). ``policy=None``: both caches are
    ``DynamicCache``s (the model against itself: every KLD exactly 0). A row ends at its first token in
    ``eos_ids`` (``"eos"``), after a token for which ``stop(tokens_so_far)`` is True (``"stop"``), or after
    ``max_new_tokens`` (``"length"``); the loop stops when every row has ended. ``stop`` gets the row's own list
    (no copy, so that a long generation costs no quadratic copying): it must not change it. ``read``: the
    quantized cache's read path (``"buffered"``, the faster, by default: the same numbers as ``"lean"``).
    ``where``: the unit of work in words, for the non-finite line. ``record_logprobs``: also keep the policy's
    per-step log-probs. ``measure_kld=False``: only the driver's cache runs (one forward call a step, not two: a
    sample, or the FP model's own output, needs no KLD); ``kld`` stays empty and ``record_logprobs`` keeps the
    driver's log-probs.
    """
    from transformers import DynamicCache

    from kveval.patch import QuantizedKVCache, cache_kwargs

    if driver not in DRIVERS:
        raise ValueError(f"driver must be one of {', '.join(DRIVERS)}; got {driver!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if sampling is not None and len(sampling.seeds) != len(prompts):
        raise ValueError(f"sampling needs one seed per prompt: {len(sampling.seeds)} seeds, {len(prompts)} prompts")

    ids, mask = left_padded(prompts, pad_id, model.device)
    batch, width = ids.shape
    padding = (width - mask.sum(dim=1)).tolist()
    runs_fp = measure_kld or driver == "fp"
    runs_policy = measure_kld or driver == "policy"
    fp_cache = DynamicCache(config=model.config) if runs_fp else None
    policy_cache = None if not runs_policy else (
        DynamicCache(config=model.config) if policy is None else
        QuantizedKVCache(model, policy, left_padding=padding, max_length=width + max_new_tokens, read=read))
    fixed = {"use_cache": True}
    if accepts(model, "logits_to_keep"):
        fixed["logits_to_keep"] = 1
    with_positions = accepts(model, "position_ids")
    # generate's position ids (the cumulative sum of the mask, 0 on the padding) and its mask, dropped when all ones
    positions = (mask.cumsum(dim=-1) - 1).masked_fill(mask == 0, 0)
    attention = mask if any(padding) else None

    def forward(cache, input_ids: torch.Tensor) -> torch.Tensor:
        kwargs = dict(fixed, **cache_kwargs(model, cache))
        if attention is not None:
            kwargs["attention_mask"] = attention
        if with_positions:
            kwargs["position_ids"] = positions
        return model(input_ids, **kwargs).logits[:, -1]

    who = quantized_by(policy)
    generators = None if sampling is None else [torch.Generator(device="cpu").manual_seed(int(s))
                                                for s in sampling.seeds]
    rows = [Trajectory(logprobs=[] if record_logprobs else None) for _ in prompts]
    ended = [False] * batch
    lp_dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
    with finite_quantizer_inputs(where, who or "the full-precision model"), torch.no_grad():
        step_ids = ids
        for step in range(max_new_tokens):
            alive = [r for r in range(batch) if not ended[r]]
            at = f"{where} (generation step {step})"
            index = torch.tensor(alive, device=model.device)
            fp_logits = policy_logits = None
            if runs_fp:
                fp_logits = forward(fp_cache, step_ids)
                check_finite_logits(fp_logits[index], where=at, dtype=model.dtype)
            if runs_policy:
                policy_logits = forward(policy_cache, step_ids)
                check_finite_logits(policy_logits[index], where=at, dtype=model.dtype, quantized_by=who)
            chooser = policy_logits if driver == "policy" else fp_logits
            kld, kept_lp = None, None
            if measure_kld:
                fp_lp, kept_lp = log_probs(fp_logits), log_probs(policy_logits)
                kld = (fp_lp.exp() * (fp_lp - kept_lp)).sum(dim=-1).tolist()
            elif record_logprobs:
                kept_lp = log_probs(chooser)
            if sampling is None:
                chosen = chooser.float().argmax(dim=-1).tolist()
            else:
                chosen = [pad_id] * batch
                for r in alive:
                    chosen[r] = sample_token(chooser[r].float(), sampling, generators[r])
            for r in alive:
                row, token = rows[r], int(chosen[r])
                row.tokens.append(token)
                if kld is not None:
                    row.kld.append(kld[r])
                if record_logprobs:
                    row.logprobs.append(kept_lp[r].to("cpu", lp_dtype))
                if token in eos_ids:
                    row.ended, ended[r] = "eos", True
                elif stop is not None and stop(row.tokens):
                    row.ended, ended[r] = "stop", True
            if all(ended) or step == max_new_tokens - 1:
                break
            # the next call: each row's new token (the pad token for a row that had ended before this step)
            fed = [int(chosen[r]) if r in alive else pad_id for r in range(batch)]
            step_ids = torch.tensor(fed, dtype=ids.dtype, device=ids.device)[:, None]
            positions = positions[:, -1:] + 1
            if attention is not None:
                attention = torch.cat([attention, attention.new_ones((batch, 1))], dim=-1)
    return rows


__all__ = ["DRIVERS", "Sampling", "Trajectory", "lockstep_generate", "sample_token"]
