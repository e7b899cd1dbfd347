"""Scoring of the perplexity task: the forward passes over a batch of windows and their records.

:func:`score_batch` is the one batch scorer: the reference pass (the FP baseline on the checkpoint's weights, or a
weight variant with the full-precision cache, :class:`Weights`), then each policy over the windows that miss its
record, every comparison against the FP baseline's logits (the logits compared ``COMPARE_ROWS`` rows at a time).
:class:`DeviceMemory`: the CUDA peak memory of each pass (nothing off CUDA). The task as a whole:
:mod:`kveval.tasks.perplexity.task`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kveval.results.layout import BASELINE
from kveval.stats import (
    LogSoftmaxScratch,
    base_token_terms,
    bin_sums,
    float32_values,
    llama_sums,
    llama_token_values,
)
from kveval.tasks.common.finite import check_finite_logits, finite_quantizer_inputs
from kveval.tasks.perplexity.params import Params


def _metric(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the metrics: float64 stays float64 (a float64 run's noise floor is not float32 rounding),
    everything else in float32."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The metric logits (:func:`_metric`) of every position but the last, ``[batch, T - 1, vocab]``, of one forward
    pass over ``ids`` ``[batch, T]`` (under whatever patch the caller holds)."""
    return _metric(model(ids).logits[:, :-1])


def _record_key(window: int, policy: str) -> str:
    return f"perplexity/w{window}/{policy}"


def _weights_key(window: int, variant: str, policy: str) -> str:
    """The record of ``policy`` (``baseline``: the full-precision cache) on weight variant ``variant``."""
    return f"perplexity/w{window}/weights/{variant}/{policy}"


#: rows of logits compared at once: compare_logits holds a few float64 copies of its [rows, vocab] inputs, so an
#: 8k-token window of a 49k vocabulary is compared in slices (the same numbers, row by row) instead of ~13 GB at once.
#: 128 rows of a 49k vocabulary (50 MB per float64 copy) stay closer to the CPU's caches than 512: a 512-token
#: comparison took 87 -> 73 ms (2 threads). Each row's reductions run whole in one thread while the slice has at
#: least as many rows as threads (torch splits a reduction across threads along its rows first), so any slicing
#: gives the same numbers there.
COMPARE_ROWS = 128


#: bytes of the baseline's float64 log-softmax and softmax (16 per logit) a batch keeps for all its policies'
#: comparisons (``BaseTerms``, off CUDA); a larger batch recomputes them per comparison (the same numbers)
BASE_TERMS_BUDGET = 2 << 30


class BaseTerms:
    """The baseline's side of a window's comparisons (:func:`kveval.stats.base_token_terms` per ``COMPARE_ROWS``
    slice), computed at the first comparison and reused by every policy's (``keep``: within
    ``BASE_TERMS_BUDGET``; else recomputed each time). Without it, each policy recomputed the baseline's float64
    softmax (bench/bench_run_overhead.py on configs/formats_2026.yaml: comparisons 128 s -> 106 s of a 475 s run)."""

    def __init__(self, keep: bool):
        self.keep = keep
        self.slices: list[dict[str, torch.Tensor]] | None = None

    def get(self, base: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        if self.slices is not None:
            return self.slices
        slices = [base_token_terms(base[i:i + COMPARE_ROWS]) for i in range(0, base.shape[0], COMPARE_ROWS)]
        if self.keep:
            self.slices = slices
        return slices


def _compare(base: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
             terms: BaseTerms | None = None, scratch: LogSoftmaxScratch | None = None) -> dict[str, torch.Tensor]:
    """:func:`kveval.stats.llama_token_values` over ``[n, vocab]`` inputs, ``COMPARE_ROWS`` rows at a time
    (per-row metrics: identical to one call), with ``agree`` (= ``same_top``, :func:`compare_logits`'s name).
    ``terms``: the baseline's terms of ``base``, kept across the comparisons of one window; ``scratch``: the
    float64 buffers reused across comparisons."""
    base_slices = (terms or BaseTerms(keep=False)).get(base)
    parts = [llama_token_values(base[i:i + COMPARE_ROWS], logits[i:i + COMPARE_ROWS], targets[i:i + COMPARE_ROWS],
                                base_slices[k], scratch)
             for k, i in enumerate(range(0, base.shape[0], COMPARE_ROWS))]
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    out["agree"] = out["same_top"]
    return out


def _cpu(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in metrics.items()}


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


class DeviceMemory:
    """Peak memory of each forward pass and freeing between passes, on CUDA; nothing on other devices.

    ``start()`` before a pass resets the peak statistics of the model's GPUs; ``peak()`` after it is the largest
    ``torch.cuda.max_memory_allocated`` among them since (None off CUDA); ``free()`` after the pass's tensors are
    dropped returns the allocator's cached blocks (``torch.cuda.empty_cache``), so that one policy's pass does not
    keep memory reserved for the next one."""

    def __init__(self, model):
        devices = {p.device for p in model.parameters()} or {torch.device(model.device)}
        self.devices = sorted((d for d in devices if _is_cuda(d)), key=str)

    def start(self) -> None:
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)

    def peak(self) -> int | None:
        return max(int(torch.cuda.max_memory_allocated(d)) for d in self.devices) if self.devices else None

    def free(self) -> None:
        if self.devices:
            torch.cuda.empty_cache()


def _with_peak(rec: dict, peak: int | None) -> dict:
    """``rec`` with ``cuda_peak_bytes`` (the pass's peak on CUDA; off CUDA the record is left as it is)."""
    if peak is not None:
        rec["cuda_peak_bytes"] = peak
    return rec


def _where(window, offset: int) -> str:
    return f"window {window.index} (corpus tokens {window.start + offset}-{window.end + offset})"


def _where_batch(batch: list, offset: int) -> str:
    """The windows of one forward pass in words (one window: :func:`_where`)."""
    if len(batch) == 1:
        return _where(batch[0], offset)
    return (f"windows {', '.join(str(w.index) for w in batch)} (one batch; corpus tokens "
            f"{batch[0].start + offset}-{batch[-1].end + offset})")


def _window_record(window, policy: str, metrics: dict, positions: torch.Tensor, params: Params,
                   per_token: bool = True) -> dict:
    """One (window, policy) record: the sums of NLL, KLD and top-1 agreement, their position bins and, with
    ``per_token`` (every comparison but the FP baseline against itself), llama-perplexity's running sums of the
    window (``llama_sums``) and each scored token's KLD and Δp rounded to float32 (``kld_values``,
    ``p_diff_values``, in position order): what the percentiles of ``llama_perplexity`` need."""
    rec = {
        "key": _record_key(window.index, policy),
        "task": "perplexity",
        "window": window.index,
        "policy": policy,
        "start": int(window.start) + params.start_token,  # corpus position
        "n_tokens": int(positions.numel()),
    }
    for name in ("nll", "kld", "agree"):
        rec[f"{name}_sum"] = float(metrics[name].sum())
    for name in ("nll", "kld"):
        rec[f"bin_{name}"], rec["bin_count"] = bin_sums(metrics[name], positions, params.position_bins, params.seq_len)
    if per_token:
        rec["llama_sums"] = llama_sums(metrics["nll"], metrics["nll_base"], metrics["kld"], metrics["p_diff"],
                                       metrics["same_top"])
        rec["kld_values"] = float32_values(metrics["kld"])
        rec["p_diff_values"] = float32_values(metrics["p_diff"])
    return rec


class _Scored:
    """What one window of a batch scores: the logits rows ``rows`` (a slice: positions ``score_from - 1`` ..
    ``T - 2``, a view, no copy of ``[n, vocab]`` logits), the same positions as a tensor ``positions`` (the position
    in the window, i.e. the tokens the cache holds before the prediction, minus one) and the targets ``tgt``."""

    def __init__(self, w, ids: torch.Tensor):
        T = ids.shape[-1]
        self.rows = slice(w.score_from - 1, T - 1)
        self.positions = torch.arange(w.score_from - 1, T - 1)
        self.tgt = ids[1:][self.rows]


@dataclass
class Scoring:
    """What every batch of a run shares: the task's context and parameters, the names scored (``baseline`` first,
    then the policies) and the CUDA memory bookkeeping."""

    ctx: Any
    params: Params
    names: list[str]
    memory: DeviceMemory


@dataclass
class Batch:
    """The windows of one forward pass (of one length, ``ids`` ``[B, T]``) and the FP baseline's side of their
    comparisons: its logits ``base`` ``[B, T - 1, vocab]`` (set by the pass on the checkpoint's weights, kept for
    every policy and weight variant of the batch), its terms per window and the comparisons' float64 buffers."""

    windows: list
    ids: torch.Tensor
    scored: list[_Scored]
    base: torch.Tensor | None = None
    terms: list[BaseTerms] = field(default_factory=list)
    scratch: LogSoftmaxScratch = field(default_factory=LogSoftmaxScratch)

    @classmethod
    def of(cls, windows: list, device) -> Batch:
        ids = torch.stack([w.input_ids for w in windows]).to(device)  # [B, T]
        return cls(windows, ids, [_Scored(w, ids[i]) for i, w in enumerate(windows)])

    def set_base(self, base: torch.Tensor) -> None:
        # kept off CUDA only: there they would count in every policy pass's peak memory, and a comparison is cheap
        keep = not _is_cuda(base.device) and sum(len(s.tgt) for s in self.scored) * base.shape[-1] * 16 \
            <= BASE_TERMS_BUDGET
        self.base, self.terms = base, [BaseTerms(keep) for _ in self.windows]


@dataclass(frozen=True)
class Weights:
    """The option of :func:`score_batch`: score weight variant ``name`` (``variant``: prepared by
    :mod:`kveval.weights.apply`, swapped in by ``variant.applied(model)``) instead of the checkpoint's weights."""

    name: str
    variant: Any

    def key(self, window: int, policy: str) -> str:
        return _weights_key(window, self.name, policy)


def _who(weights: Weights | None, policy: str | None) -> str | None:
    """Whose fault non-finite logits of a pass are (None: the model's own, the FP baseline's)."""
    if weights is None:
        return None if policy is None else f"policy '{policy}'"
    variant = f"weight variant '{weights.name}'"
    return variant if policy is None else f"{variant} with policy '{policy}'"


def score_batch(scoring: Scoring, batch: Batch, pending: Collection[str],
                weights: Weights | None = None) -> Iterator[dict]:
    """Score the windows of ``batch``: the reference pass (without ``weights``: the FP baseline, once over the whole
    batch, which sets ``batch.base``; with them: the variant with the full-precision cache, over the windows that
    miss one of its records), then each policy over the windows that miss its record (a resumed batch recomputes
    only those rows; a policy every window has recorded does not run), every one against the FP baseline's logits.
    Yields the record of each key in ``pending`` as soon as it is computed (the unit runner appends it); a
    variant's weights are swapped in once for the batch."""
    ctx = scoring.ctx
    keys = [{n: weights.key(w.index, n) if weights else _record_key(w.index, n) for n in scoring.names}
            for w in batch.windows]
    rows = [i for i in range(len(batch.windows)) if weights is None or any(k in pending for k in keys[i].values())]
    if not rows:
        return
    with weights.variant.applied(ctx.model) if weights else nullcontext(), torch.no_grad():
        ref, ref_peak, _ = _forward(scoring, batch, rows, weights)
        if weights is None:
            batch.set_base(ref)
        scoring.memory.free()
        for name in scoring.names:
            need = [(r, i) for r, i in enumerate(rows) if keys[i][name] in pending]
            if not need:
                continue
            if name == BASELINE:
                for r, i in need:
                    yield _with_peak(_record(scoring, batch, i, name, ref[r], weights=weights), ref_peak)
                continue
            logits, peak, emu = _forward(scoring, batch, [i for _, i in need], weights, name)
            for j, (r, i) in enumerate(need):
                rec = _with_peak(_record(scoring, batch, i, name, logits[j], ref[r], weights), peak)
                if weights is None and scoring.params.diagnostics:
                    rec["layers_quantized"] = emu.layers_quantized
                    rec["layer_errors"] = emu.diagnostics(row=j)
                yield rec
            del logits, emu
            scoring.memory.free()


def _forward(scoring: Scoring, batch: Batch, rows: list[int], weights: Weights | None,
             policy: str | None = None) -> tuple[torch.Tensor, int | None, Any]:
    """One forward pass over the windows ``rows`` of ``batch`` (under the caller's weights; under ``emulate`` of
    ``policy`` when given): the metric logits ``[len(rows), T - 1, vocab]`` (their scored rows checked finite),
    the pass's CUDA peak and the emulation (None without ``policy``)."""
    from kveval.patch import emulate

    ctx, params = scoring.ctx, scoring.params
    who = _who(weights, policy)
    part = [batch.windows[i] for i in rows]
    emu = None
    scoring.memory.start()
    with finite_quantizer_inputs(_where_batch(part, params.start_token), who) if who else nullcontext():
        ids = batch.ids if len(rows) == len(batch.windows) else batch.ids[rows]
        if policy is None:
            logits = _logits(ctx.model, ids)
        else:
            diagnostics = params.diagnostics and weights is None
            with emulate(ctx.model, ctx.policies[policy], prefill_len=params.prefill_tokens,
                         diagnostics=diagnostics) as emu:
                logits = _logits(ctx.model, ids)
    peak = scoring.memory.peak()
    for j, i in enumerate(rows):
        check_finite_logits(logits[j, batch.scored[i].rows], where=_where(batch.windows[i], params.start_token),
                            dtype=ctx.cfg.model.dtype, quantized_by=who)
    return logits, peak, emu


def _record(scoring: Scoring, batch: Batch, i: int, name: str, logits: torch.Tensor,
            ref: torch.Tensor | None = None, weights: Weights | None = None) -> dict:
    """The record of window ``i`` of ``batch`` under ``name`` from its logits ``[T - 1, vocab]``, against the FP
    baseline; with ``weights``, keyed as the variant's and, given ``ref`` (the variant's full-precision-cache
    logits), with the KLD and top-1 agreement against them too (the KV effect measured on the variant)."""
    assert batch.base is not None
    s = batch.scored[i]
    metrics = _compare(batch.base[i, s.rows], logits[s.rows], s.tgt, batch.terms[i], batch.scratch)
    rec = _window_record(batch.windows[i], name, _cpu(metrics), s.positions, scoring.params,
                         per_token=weights is not None or name != BASELINE)
    if weights is not None:
        rec.update(key=weights.key(batch.windows[i].index, name), weights=weights.name)
        if ref is not None:
            on_weights = _compare(ref[s.rows], logits[s.rows], s.tgt, scratch=batch.scratch)  # the KV effect on Ŵ
            rec.update(kld_vs_weights_sum=float(on_weights["kld"].sum()),
                       agree_vs_weights_sum=float(on_weights["agree"].sum()))
    return rec
