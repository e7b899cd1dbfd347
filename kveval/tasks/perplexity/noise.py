"""The path noise floor of the perplexity task: the first ``noise_windows`` windows scored a second way, decoded
token by token through the real cache, against the single pass (one window at a time whatever ``batch_size``
says). Its summary: ``_noise_summary`` in :mod:`kveval.tasks.perplexity.aggregate`."""

from __future__ import annotations

import torch

from kveval.policy import KVPolicy
from kveval.results.layout import BASELINE
from kveval.stats import compare_logits
from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.perplexity.params import Params
from kveval.tasks.perplexity.scorer import _metric, _where


def _noise_key(window: int, policy: str) -> str:
    return f"perplexity/noise/w{window}/{policy}"


def score_noise_floor(ctx, params: Params, windows: list, names: list[str]) -> None:
    """The path noise: the same semantics computed a second way (token-by-token decoding through the real cache)
    on the first ``noise_windows`` windows, for every policy and for the FP baseline (single pass vs decoding), one
    unit per (window, policy) (:func:`kveval.tasks.common.runner.run_units`)."""
    units = [Unit(_noise_key(w.index, n), (w, n), amount=len(w.input_ids)) for w in windows for n in names]
    run_units(ctx, "perplexity", units, Work(label="noise floor (decoding)", noun="noise-floor decodings",
                                             evaluate=lambda batch, _: [_noise_record(ctx, params, *u.item)
                                                                        for u in batch]))


def _noise_record(ctx, params: Params, w, name: str) -> dict:
    """The noise record of window ``w`` under ``name`` (``baseline``: the FP cache)."""
    from kveval.patch import decode_logits, emulate

    model = ctx.model
    ids = w.input_ids.to(model.device)[None]
    policy = KVPolicy.preset("fp16") if name == BASELINE else ctx.policies[name]
    prefill = max(params.prefill_tokens, 1)
    where = _where(w, params.start_token)
    who = None if name == BASELINE else f"policy '{name}'"
    with torch.no_grad(), finite_quantizer_inputs(where, who or "the full-precision cache"):
        if name == BASELINE:
            single = _metric(model(ids).logits[0, :-1])
        else:
            with emulate(model, policy, prefill_len=params.prefill_tokens):
                single = _metric(model(ids).logits[0, :-1])
        decoded = _metric(decode_logits(model, ids, policy, prefill_len=prefill)[0, :-1])
    scored = torch.arange(w.score_from - 1, ids.shape[1] - 1, device=ids.device)
    dtype = ctx.cfg.model.dtype
    check_finite_logits(single[scored], where=where, dtype=dtype, quantized_by=who)
    check_finite_logits(decoded[scored], where=f"{where}, decoded token by token through the real cache",
                        dtype=dtype, quantized_by=who or "the full-precision cache")
    tgt = ids[0, 1:][scored]
    a = compare_logits(single[scored], single[scored], tgt)
    b = compare_logits(single[scored], decoded[scored], tgt)
    return {
        "key": _noise_key(w.index, name), "task": "perplexity_noise", "window": w.index, "policy": name,
        "n_tokens": int(scored.numel()), "nll_single": float(a["nll"].sum()),
        "nll_decoded": float(b["nll"].sum()), "kld_paths": float(b["kld"].sum()),
        "max_abs_logit_gap": float((single[scored] - decoded[scored]).abs().max()),
    }
