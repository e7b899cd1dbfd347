"""Perplexity, KL divergence and top-1 agreement of each policy against the full-precision model.

Windows of ``seq_len`` tokens over the corpus (non-overlapping, or sliding with ``stride``: only the tokens not
scored by the previous window are scored). For each window the FP baseline runs once; each policy runs once
under ``emulate`` (every token decoded through the quantized cache unless ``prefill_tokens`` > 0). Metrics are
reduced on the fly: one record per (window, policy) in ``records.jsonl``, full logits are never stored.

Error against context length: ``loss_by_position`` / ``kld_by_position`` are the mean NLL / KLD in
``position_bins`` equal bins of absolute positions in the window, edges ``position_bin_edges`` over
``[0, seq_len)``: the logits at position ``t`` predict token ``t + 1`` with ``t + 1`` tokens in the cache (every
window starts an empty cache), so a policy whose error grows with the number of cached tokens shows a rising
``kld_by_position``. Windows up to the model's context are supported (8192 tokens on the builtin model); the
logits are compared ``COMPARE_ROWS`` rows at a time and emulation builds no ``[T, T]`` mask.

Weight variants (``model.weights``: ``ctx.weights``, prepared by :mod:`kveval.weights.apply`): each window is also
scored with each variant's quantized weights, with the full-precision cache and under every policy, all against the
same FP baseline (the checkpoint's weights, full-precision cache). Their records carry ``weights: VARIANT`` and the
key ``perplexity/w{window}/weights/{VARIANT}/{policy}`` (``policy`` ``baseline``: the variant with the
full-precision cache), so they resume like the others; a combined record also holds the KLD and top-1 agreement of
the policy against the variant's own full-precision-cache logits (the KV effect measured on quantized weights).
``aggregate`` adds ``metrics["weights"]``: per variant the weight effect alone and, per policy, the combined effect
with the interaction fields of :func:`kveval.weights.interaction_fields`. The noise floor and the per-layer
diagnostics are measured on the checkpoint's weights only.

Throughput (``batch_size``, default 1): ``batch_size`` windows run in one forward pass, for the baseline, under
each policy (``emulate`` takes a batch: every row reads the same versions, see :mod:`kveval.patch.emulate`) and
under each weight variant; a batch runs a policy only over its windows that miss that policy's record, so a resumed
batch recomputes only what is missing. The records are the same, one per (window, policy), whatever the batch
size, and so are the numbers up to float rounding (float64: ~1e-12). The noise floor decodes one window at a time
whatever ``batch_size`` says (its cost is the token-by-token decoding). The logits held at once grow with the
batch: ``batch_size x seq_len x vocab`` floats for the baseline and again for a policy's pass (docs/scale.md).
On CUDA, each record carries ``cuda_peak_bytes``, the peak of ``torch.cuda.max_memory_allocated`` over the model's
GPUs during the pass that computed it (the statistics reset before each pass; the allocator's cache emptied after
each); metrics give ``cuda_peak_memory_bytes`` per policy (and for the baseline): the largest over its records.
Off CUDA nothing is recorded and nothing is called.

NaN or infinity in the logits stops the run with one line before that window's records are written (metrics are
never NaN): in the baseline's logits it is the model's fault (overflowing weights or activations, e.g. float16),
in a policy's logits (or in the keys/values its quantizer is given) the quantizer's or the emulation's. The noise
floor's decoded logits are checked the same way (:mod:`kveval.tasks._finite`, the check every task shares).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from kveval.data import token_windows
from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.results.layout import BASELINE
from kveval.stats import (
    LogSoftmaxScratch,
    add_llama_sums,
    base_token_terms,
    bin_sums,
    bootstrap_ratio_ci,
    bootstrap_standard_error,
    compare_logits,
    float32_values,
    inconclusive,
    llama_perplexity_stats,
    llama_sums,
    llama_token_values,
    minimum_detectable_effect,
    predicted_mde_delta_ppl_pct,
    predicted_mde_kld,
    size_to_decide,
    tokens_to_resolve,
)
from kveval.tasks._finite import check_finite_logits, finite_quantizer_inputs
from kveval.tasks.perplexity.params import NAME, Params  # noqa: F401 (a task module names its NAME and Params)


def _metric(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the metrics: float64 stays float64 (a float64 run's noise floor is not float32 rounding),
    everything else in float32."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _record_key(window: int, policy: str) -> str:
    return f"perplexity/w{window}/{policy}"


def _noise_key(window: int, policy: str) -> str:
    return f"perplexity/noise/w{window}/{policy}"


def _weights_key(window: int, variant: str, policy: str) -> str:
    """The record of ``policy`` (``baseline``: the full-precision cache) on weight variant ``variant``."""
    return f"perplexity/w{window}/weights/{variant}/{policy}"


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


def check(ctx, params: Params) -> None:
    """Input errors: a window longer than the model's context, a corpus shorter than one window."""
    from kveval.models import model_context_limit

    limit = model_context_limit(ctx.model)
    if params.seq_len > limit:
        raise KvevalError(
            f"tasks: perplexity.seq_len {params.seq_len} is longer than the model's context ({limit} tokens); lower it"
        )
    tokens = ctx.tokens()[params.start_token:]
    if tokens.numel() < params.seq_len:
        raise KvevalError(f"the corpus has {tokens.numel()} tokens from start_token {params.start_token}, fewer than "
                          f"one window of seq_len {params.seq_len}")
    windows = token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens)
    scored = sum(len(w.input_ids) - w.score_from for w in windows)
    for line in resolution_warnings(scored, ctx.cfg.threshold):  # on stdout: stderr is kept for the error line
        if ctx.console is not None:
            ctx.console.print(f"[yellow]warning:[/] perplexity: {line}", highlight=False)
        else:
            print(f"warning: perplexity: {line}")


def resolution_warnings(scored: int, threshold) -> list[str]:
    """One line per configured threshold that ``scored`` tokens cannot resolve: the minimum detectable effect
    predicted for a policy at the threshold (:func:`kveval.stats.predicted_mde_delta_ppl_pct`,
    :func:`kveval.stats.predicted_mde_kld`) exceeds it; the line says how many scored tokens would."""
    out = []
    checks = [("threshold.delta_ppl_pct", threshold.delta_ppl_pct, predicted_mde_delta_ppl_pct, "%")]
    if threshold.kld is not None:
        checks.append(("threshold.kld", threshold.kld, predicted_mde_kld, ""))
    for name, thr, predict, unit in checks:
        mde = predict(thr, scored)
        if thr > 0 and mde > thr:
            out.append(f"{scored:,} scored tokens cannot resolve {name} {thr:g}{unit}: the smallest effect they "
                       f"detect (alpha 0.05, power 0.8) is about {mde:.3g}{unit} for a policy at the threshold; about "
                       f"{tokens_to_resolve(mde, thr, scored):,} tokens would (raise max_tokens); verdicts near the "
                       "threshold will say inconclusive")
    return out


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


def _where(window, offset: int) -> str:
    return f"window {window.index} (corpus tokens {window.start + offset}-{window.end + offset})"


def _check_finite(logits: torch.Tensor, window, name: str, dtype: str, offset: int = 0) -> None:
    """One line, naming whose fault it is, when the scored logits of a window hold NaN or infinity (``offset``:
    the corpus position of the window's token 0, i.e. ``start_token``): :func:`kveval.tasks._finite.check_finite_logits`."""
    check_finite_logits(logits, where=_where(window, offset), dtype=dtype,
                        quantized_by=None if name == BASELINE else f"policy '{name}'")


def _batches(windows: list, size: int) -> Iterator[list]:
    """``windows`` in groups of at most ``size`` of one length (every window of ``token_windows`` has the same
    length; a group never mixes lengths, so a batch needs no padding), in order; the last group may be shorter."""
    group: list = []
    for w in windows:
        if group and (len(group) == size or len(w.input_ids) != len(group[0].input_ids)):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The metric logits (:func:`_metric`) of every position but the last, ``[batch, T - 1, vocab]``, of one forward
    pass over ``ids`` ``[batch, T]`` (under whatever patch the caller holds)."""
    return _metric(model(ids).logits[:, :-1])


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


def _where_batch(batch: list, offset: int) -> str:
    """The windows of one forward pass in words (one window: :func:`_where`)."""
    if len(batch) == 1:
        return _where(batch[0], offset)
    return (f"windows {', '.join(str(w.index) for w in batch)} (one batch; corpus tokens "
            f"{batch[0].start + offset}-{batch[-1].end + offset})")


def run(ctx, params: Params) -> dict:
    """Evaluate every (window, policy) not yet recorded, ``batch_size`` windows per forward pass, then aggregate
    all records into metrics."""
    tokens = ctx.tokens()[params.start_token:]
    windows = list(token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens))
    names = [BASELINE, *ctx.policies]
    variants = getattr(ctx, "weights", None) or {}
    done = ctx.run.done_keys()

    def window_keys(index: int) -> list[str]:
        return [_record_key(index, n) for n in names] + [_weights_key(index, v, n) for v in variants for n in names]

    todo = [w for w in windows if any(k not in done for k in window_keys(w.index))]
    if len(todo) < len(windows):
        ctx.progress.log(f"perplexity: resuming, {len(windows) - len(todo)} of {len(windows)} windows already recorded")

    memory = DeviceMemory(ctx.model)
    total = len(todo) * len(names) * (1 + len(variants))
    with ctx.progress.task("perplexity", total=total, unit="tok") as advance:
        for batch in _batches(todo, params.batch_size):
            _score_batch(ctx, params, batch, names, done, advance, memory)
    memory.free()  # the last batch's baseline logits
    _noise_floor(ctx, params, windows[: params.noise_windows], names)
    return aggregate(ctx.run.records(), list(ctx.policies), params, seed=ctx.cfg.seed, threshold=ctx.cfg.threshold,
                     weights=list(variants))


class _Scored:
    """What one window of a batch scores: the logits rows ``rows`` (a slice: positions ``score_from - 1`` ..
    ``T - 2``, a view, no copy of ``[n, vocab]`` logits), the same positions as a tensor ``positions`` (the position
    in the window, i.e. the tokens the cache holds before the prediction, minus one) and the targets ``tgt``."""

    def __init__(self, w, ids: torch.Tensor):
        T = ids.shape[-1]
        self.rows = slice(w.score_from - 1, T - 1)
        self.positions = torch.arange(w.score_from - 1, T - 1)
        self.tgt = ids[1:][self.rows]


def _score_batch(ctx, params: Params, batch: list, names: list[str], done, advance, memory: DeviceMemory) -> None:
    """The windows ``batch`` (of one length): the FP baseline once over the whole batch, then each policy over the
    windows that miss its record (a resumed batch recomputes only those rows; a policy every window of the batch
    has recorded does not run), then each weight variant; records not yet in ``done`` are appended."""
    from kveval.patch import emulate

    model = ctx.model
    dtype = ctx.cfg.model.dtype
    ids = torch.stack([w.input_ids for w in batch]).to(model.device)  # [B, T]
    scored = [_Scored(w, ids[i]) for i, w in enumerate(batch)]
    memory.start()
    with torch.no_grad():
        base = _logits(model, ids)  # [B, T - 1, vocab], kept for every policy of the batch
    base_peak = memory.peak()
    for i, w in enumerate(batch):
        _check_finite(base[i, scored[i].rows], w, BASELINE, dtype, params.start_token)
    memory.free()
    # kept off CUDA only: there they would count in every policy pass's peak memory, and a comparison is cheap
    keep = not _is_cuda(base.device) and sum(len(s.tgt) for s in scored) * base.shape[-1] * 16 <= BASE_TERMS_BUDGET
    terms = [BaseTerms(keep) for _ in batch]
    scratch = LogSoftmaxScratch()
    for name in names:
        need = [i for i, w in enumerate(batch) if _record_key(w.index, name) not in done]
        for _ in range(len(batch) - len(need)):
            advance(0)
        if not need:
            continue
        if name == BASELINE:
            for i in need:
                s = scored[i]
                metrics = _compare(base[i, s.rows], base[i, s.rows], s.tgt, terms[i], scratch)
                ctx.run.append(_with_peak(_window_record(batch[i], name, _cpu(metrics), s.positions, params,
                                                         per_token=False), base_peak))
                advance(ids.shape[1])
            continue
        part = [batch[i] for i in need]
        memory.start()
        with finite_quantizer_inputs(_where_batch(part, params.start_token), f"policy '{name}'"):
            with emulate(model, ctx.policies[name], prefill_len=params.prefill_tokens,
                         diagnostics=params.diagnostics) as emu, torch.no_grad():
                logits = _logits(model, ids if len(need) == len(batch) else ids[need])
        peak = memory.peak()
        for j, i in enumerate(need):
            _check_finite(logits[j, scored[i].rows], batch[i], name, dtype, params.start_token)
        for j, i in enumerate(need):
            s = scored[i]
            metrics = _compare(base[i, s.rows], logits[j, s.rows], s.tgt, terms[i], scratch)
            rec = _with_peak(_window_record(batch[i], name, _cpu(metrics), s.positions, params), peak)
            if params.diagnostics:
                rec["layers_quantized"] = emu.layers_quantized
                rec["layer_errors"] = emu.diagnostics(row=j)
            ctx.run.append(rec)
            advance(ids.shape[1])
        del logits, emu
        memory.free()
    for vname, variant in (getattr(ctx, "weights", None) or {}).items():
        _weight_variant_batch(ctx, params, batch, ids, vname, variant, base, scored, names, done, advance, memory)


def _cpu(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in metrics.items()}


def _weight_variant_batch(ctx, params: Params, batch: list, ids: torch.Tensor, vname: str, variant,
                          base: torch.Tensor, scored: list[_Scored], names: list[str], done, advance,
                          memory: DeviceMemory) -> None:
    """The windows ``batch`` (``ids`` ``[B, T]``) under weight variant ``vname``: the variant with the
    full-precision cache, then with each policy, every one against the FP baseline's logits ``base`` ``[B, T - 1,
    vocab]``, over the windows that miss the record; records not yet in ``done`` are appended (the variant's
    weights are swapped in once for the batch and restored on exit)."""
    from kveval.patch import emulate

    keys = [{n: _weights_key(w.index, vname, n) for n in names} for w in batch]
    rows = [i for i in range(len(batch)) if any(k not in done for k in keys[i].values())]
    for _ in range(len(batch) - len(rows)):
        advance(0)
    if not rows:
        return
    model = ctx.model
    dtype = ctx.cfg.model.dtype
    vids = ids if len(rows) == len(batch) else ids[rows]
    who = f"weight variant '{vname}'"
    scratch = LogSoftmaxScratch()
    with variant.applied(model), torch.no_grad():
        memory.start()
        with finite_quantizer_inputs(_where_batch([batch[i] for i in rows], params.start_token), who):
            wlogits = _logits(model, vids)  # [len(rows), T - 1, vocab]
        wpeak = memory.peak()
        for r, i in enumerate(rows):
            check_finite_logits(wlogits[r, scored[i].rows], where=_where(batch[i], params.start_token), dtype=dtype,
                                quantized_by=who)
        memory.free()
        for name in names:
            need = [r for r, i in enumerate(rows) if keys[i][name] not in done]
            for _ in range(len(rows) - len(need)):
                advance(0)
            if not need:
                continue
            if name == BASELINE:
                for r in need:
                    i, s = rows[r], scored[rows[r]]
                    metrics = _compare(base[i, s.rows], wlogits[r, s.rows], s.tgt, scratch=scratch)
                    rec = _window_record(batch[i], name, _cpu(metrics), s.positions, params)
                    rec.update(key=keys[i][name], weights=vname)
                    ctx.run.append(_with_peak(rec, wpeak))
                    advance(ids.shape[1])
                continue
            who_both = f"weight variant '{vname}' with policy '{name}'"
            part = [batch[rows[r]] for r in need]
            memory.start()
            with finite_quantizer_inputs(_where_batch(part, params.start_token), who_both):
                with emulate(model, ctx.policies[name], prefill_len=params.prefill_tokens):
                    logits = _logits(model, vids if len(need) == len(rows) else vids[need])
            peak = memory.peak()
            for j, r in enumerate(need):
                check_finite_logits(logits[j, scored[rows[r]].rows], where=_where(batch[rows[r]], params.start_token),
                                    dtype=dtype, quantized_by=who_both)
            for j, r in enumerate(need):
                i, s = rows[r], scored[rows[r]]
                metrics = _compare(base[i, s.rows], logits[j, s.rows], s.tgt, scratch=scratch)
                on_weights = _compare(wlogits[r, s.rows], logits[j, s.rows], s.tgt, scratch=scratch)  # the KV effect on Ŵ
                rec = _window_record(batch[i], name, _cpu(metrics), s.positions, params)
                rec.update(key=keys[i][name], weights=vname, kld_vs_weights_sum=float(on_weights["kld"].sum()),
                           agree_vs_weights_sum=float(on_weights["agree"].sum()))
                ctx.run.append(_with_peak(rec, peak))
                advance(ids.shape[1])
            del logits
            memory.free()


def _noise_floor(ctx, params: Params, windows: list, names: list[str]) -> None:
    """The path noise: the same semantics computed a second way (token-by-token decoding through the real cache)
    on the first ``noise_windows`` windows, for every policy and for the FP baseline (single pass vs decoding)."""
    from kveval.patch import decode_logits, emulate

    done = ctx.run.done_keys()
    todo = [(w, n) for w in windows for n in names if _noise_key(w.index, n) not in done]
    if not todo:
        return
    model = ctx.model
    with ctx.progress.task("noise floor (decoding)", total=len(todo), unit="tok") as advance:
        for w, name in todo:
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
            ctx.run.append({
                "key": _noise_key(w.index, name), "task": "perplexity_noise", "window": w.index, "policy": name,
                "n_tokens": int(scored.numel()), "nll_single": float(a["nll"].sum()),
                "nll_decoded": float(b["nll"].sum()), "kld_paths": float(b["kld"].sum()),
                "max_abs_logit_gap": float((single[scored] - decoded[scored]).abs().max()),
            })
            advance(ids.shape[1])


def _noise_summary(records: list[dict]) -> dict:
    """``noise_floor_ppl_pct`` = |PPL(single pass) - PPL(decoded)| / PPL(single pass) in %, and ``noise_floor_kld``
    = mean KL(single pass || decoded), over the noise windows."""
    if not records:
        return {}
    n = sum(r["n_tokens"] for r in records)
    ppl_single = math.exp(sum(r["nll_single"] for r in records) / n)
    ppl_decoded = math.exp(sum(r["nll_decoded"] for r in records) / n)
    return {
        "noise_floor_ppl_pct": 100.0 * abs(ppl_decoded - ppl_single) / ppl_single,
        "noise_floor_kld": sum(r["kld_paths"] for r in records) / n,
        "noise_ppl_decoded": ppl_decoded,
        "noise_tokens": n,
        "noise_max_abs_logit_gap": max(r["max_abs_logit_gap"] for r in records),
    }


def _layer_summary(records: list[dict]) -> list[dict]:
    """Mean over windows of each per-layer error statistic."""
    per_layer: dict[int, dict[str, list]] = {}
    for rec in records:
        for row in rec.get("layer_errors") or []:
            slot = per_layer.setdefault(row["layer"], {})
            for k, v in row.items():
                if k != "layer" and isinstance(v, (int, float)):
                    slot.setdefault(k, []).append(v)
                elif k != "layer":
                    slot[k] = v
    out = []
    for layer in sorted(per_layer):
        row = {"layer": layer}
        for k, v in per_layer[layer].items():
            row[k] = sum(v) / len(v) if isinstance(v, list) and v and isinstance(v[0], (int, float)) else v
        out.append(row)
    return out


def _summarise(records: list[dict], params: Params, seed: int) -> dict:
    records = sorted(records, key=lambda r: r["window"])
    n = sum(r["n_tokens"] for r in records)
    nll = sum(r["nll_sum"] for r in records)
    bins = len(records[0]["bin_count"])
    counts = [sum(r["bin_count"][i] for r in records) for i in range(bins)]
    out = {
        "ppl": math.exp(nll / n),
        "nll_mean": nll / n,
        "tokens": n,
        "windows": len(records),
        "kld_mean": sum(r["kld_sum"] for r in records) / n,
        "kld_ci95": bootstrap_ratio_ci(
            [r["kld_sum"] for r in records], [r["n_tokens"] for r in records], n_resamples=params.bootstrap, seed=seed
        ),
        "top1_agree": sum(r["agree_sum"] for r in records) / n,
        "loss_by_position": [
            sum(r["bin_nll"][i] for r in records) / counts[i] if counts[i] else None for i in range(bins)
        ],
        "kld_by_position": [
            sum(r["bin_kld"][i] for r in records) / counts[i] if counts[i] else None for i in range(bins)
        ],
        "position_bin_edges": [params.seq_len * i // bins for i in range(bins + 1)],
    }
    if all("llama_sums" in r for r in records):  # records of an older kveval have none: the fields are left out
        out["llama_perplexity"] = llama_perplexity_stats(
            add_llama_sums(r["llama_sums"] for r in records),
            [v for r in records for v in r["kld_values"]], [v for r in records for v in r["p_diff_values"]])
    peaks = [r["cuda_peak_bytes"] for r in records if r.get("cuda_peak_bytes") is not None]
    if peaks:  # on CUDA: the largest peak of the passes that computed these records (DeviceMemory)
        out["cuda_peak_memory_bytes"] = max(peaks)
    layers = _layer_summary(records)
    if layers:
        out["layers_quantized"] = records[0].get("layers_quantized")
        out["layer_errors"] = layers
        for t in ("key", "value"):
            vals = [row.get(f"{t}_rel_mse") for row in layers if row.get(f"{t}_rel_mse") is not None]
            if vals:
                out[f"{t}_rel_mse_mean"] = sum(vals) / len(vals)
                out[f"{t}_rel_mse_worst_layer"] = max(layers, key=lambda r: r.get(f"{t}_rel_mse") or 0)["layer"]
    return out


# Floors at or below these are float64 rounding (a policy and its second path agree to ~1e-13): they hide nothing.
ROUNDING_FLOOR_PPL_PCT = 1e-9
ROUNDING_FLOOR_KLD = 1e-12


def _criteria(s: dict, threshold) -> list[tuple[float, float, float | None]]:
    """(measured, threshold, minimum detectable effect) of each configured criterion: ΔPPL %, and the KLD when
    ``threshold.kld`` is set."""
    out = [(s["delta_ppl_pct"], threshold.delta_ppl_pct, s.get("delta_ppl_pct_mde"))]
    if threshold.kld is not None:
        out.append((s["kld_mean"], threshold.kld, s.get("kld_mde")))
    return out


def verdict(s: dict, threshold) -> str:
    """``within_noise`` when |ΔPPL %| is below the path noise floor (or the KLD below the KLD floor); otherwise
    ``fail`` when a criterion exceeds its threshold by more than the run can blur (:func:`kveval.stats.inconclusive`
    is false for it), ``inconclusive`` when a criterion's threshold lies below its minimum detectable effect
    (``delta_ppl_pct_mde``, ``kld_mde``) and the measurement lies within one MDE of it, else ``pass``. Without an
    MDE (none measured) the plain threshold decides. Floors at float64 rounding level (``ROUNDING_FLOOR_*``) count
    as 0."""
    floor_ppl, floor_kld = s.get("noise_floor_ppl_pct"), s.get("noise_floor_kld")
    if floor_ppl is not None:
        fp = floor_ppl if floor_ppl > ROUNDING_FLOOR_PPL_PCT else 0.0
        fk = floor_kld if floor_kld is not None and floor_kld > ROUNDING_FLOOR_KLD else 0.0
        if abs(s["delta_ppl_pct"]) < fp or s["kld_mean"] < fk:
            return "within_noise"
    checks = _criteria(s, threshold)
    undecided = [inconclusive(d, t, m) for d, t, m in checks]
    if any(d > t and not u for (d, t, _), u in zip(checks, undecided)):
        return "fail"
    return "inconclusive" if any(undecided) else "pass"


def _more_tokens(s: dict, threshold) -> int | None:
    """Scored tokens to add so that an ``inconclusive`` verdict is decided (:func:`kveval.stats.size_to_decide`,
    the largest over the undecided criteria), or None."""
    n = s["tokens"]
    need = [size_to_decide(n, d, t, m) for d, t, m in _criteria(s, threshold) if m is not None and inconclusive(d, t, m)]
    need = [x for x in need if x is not None]
    return max(need) - n if need else None


def _larger(windows: float | None, tokens: float | None) -> tuple[float | None, str | None]:
    if windows is None and tokens is None:
        return None, None
    if tokens is None or (windows is not None and windows >= tokens):
        return windows, "bootstrap over windows"
    return tokens, "per-token variance"


def power_fields(s: dict, records: list[dict], base_records: list[dict], params: Params, seed: int) -> dict:
    """The minimum detectable effect (alpha 0.05, power 0.8: :func:`kveval.stats.minimum_detectable_effect`) of
    ΔPPL % and of the KLD at the run's size: ``delta_ppl_pct_mde``, ``kld_mde``, and ``mde_method`` saying which
    standard error set each. The standard error is the larger of two: the bootstrap over windows of the paired
    statistic (the policy's and the baseline's NLL of each window resampled together; correlations between the
    tokens of a window included; ``params.bootstrap`` resamples, seeded), and the per-token variance as
    llama-perplexity forms it (the uncertainty of ``Mean PPL(Q)/PPL(base)`` and of ``Mean KLD`` in
    ``llama_perplexity``: tokens taken as independent; the only one with a single window). Records of an older
    kveval (no per-token sums) with a single window give no MDE (the fields are None)."""
    base_nll = {r["window"]: r["nll_sum"] for r in base_records}
    recs = sorted(records, key=lambda r: r["window"])
    n_tok = [r["n_tokens"] for r in recs]
    boot = {"n_resamples": params.bootstrap, "seed": seed}
    ppl_windows = bootstrap_standard_error([r["nll_sum"] - base_nll[r["window"]] for r in recs], n_tok,
                                           transform=lambda x: 100.0 * np.expm1(x), **boot)
    kld_windows = bootstrap_standard_error([r["kld_sum"] for r in recs], n_tok, **boot)
    lp = s.get("llama_perplexity") or {}
    ppl_tokens = 100.0 * lp["ppl_ratio_unc"] if lp.get("ppl_ratio_unc") else None
    kld_tokens = lp.get("kld_mean_unc") or None
    se_ppl, how_ppl = _larger(ppl_windows, ppl_tokens)
    se_kld, how_kld = _larger(kld_windows, kld_tokens)
    return {"delta_ppl_pct_mde": minimum_detectable_effect(se_ppl), "kld_mde": minimum_detectable_effect(se_kld),
            "mde_method": {"delta_ppl_pct": how_ppl, "kld": how_kld}}


def _decide(s: dict, records: list[dict], base_records: list[dict], params: Params, seed: int, threshold) -> None:
    """``s`` gets its power fields, its verdict and, when ``inconclusive``, ``more_tokens_to_decide``."""
    s.update(power_fields(s, records, base_records, params, seed))
    s["verdict"] = verdict(s, threshold)
    if s["verdict"] == "inconclusive":
        s["more_tokens_to_decide"] = _more_tokens(s, threshold)


def aggregate(records: list[dict], policies: list[str], params: Params, *, seed: int, threshold,
              weights: list[str] | None = None) -> dict:
    """metrics.json's perplexity fields from the records (pure: the same records give the same metrics);
    ``weights``: the weight variants, whose records (``weights: VARIANT``) make ``metrics["weights"]``."""
    by_policy: dict[str, list[dict]] = {}
    by_variant: dict[str, dict[str, list[dict]]] = {}
    noise: dict[str, list[dict]] = {}
    for rec in records:
        if rec.get("task") == "perplexity" and rec.get("weights") is not None:
            by_variant.setdefault(rec["weights"], {}).setdefault(rec["policy"], []).append(rec)
        elif rec.get("task") == "perplexity":
            by_policy.setdefault(rec["policy"], []).append(rec)
        elif rec.get("task") == "perplexity_noise":
            noise.setdefault(rec["policy"], []).append(rec)
    base = _summarise(by_policy[BASELINE], params, seed)
    base.update(_noise_summary(noise.get(BASELINE, [])))
    for k in ("kld_mean", "kld_ci95", "top1_agree", "kld_by_position"):
        base.pop(k, None)
    out = {BASELINE: base, "policies": {}}
    for name in policies:
        s = _summarise(by_policy[name], params, seed)
        s["delta_ppl"] = s["ppl"] - base["ppl"]
        s["delta_ppl_pct"] = 100.0 * s["delta_ppl"] / base["ppl"]
        s.update(_noise_summary(noise.get(name, [])))
        _decide(s, by_policy[name], by_policy[BASELINE], params, seed, threshold)
        out["policies"][name] = s
    if weights:
        out["weights"] = {"variants": {
            v: _variant_summary(by_variant.get(v, {}), by_policy, policies, base, params, seed=seed,
                                threshold=threshold) for v in weights}}
    return out


_PER_LAYER = ("layers_quantized", "layer_errors", "key_rel_mse_mean", "value_rel_mse_mean",
              "key_rel_mse_worst_layer", "value_rel_mse_worst_layer")


def _window_sums(records: list[dict], kld_field: str = "kld_sum"):
    from kveval.weights import WindowSums

    records = sorted(records, key=lambda r: r["window"])
    return WindowSums([r["n_tokens"] for r in records], [r["nll_sum"] for r in records],
                      [r.get(kld_field, 0.0) if kld_field else 0.0 for r in records])


def _variant_summary(records: dict[str, list[dict]], by_policy: dict[str, list[dict]], policies: list[str],
                     base: dict, params: Params, *, seed: int, threshold) -> dict:
    """One weight variant's metrics: ``alone`` (quantized weights, full-precision cache, against the FP
    baseline) and ``policies`` (quantized weights and cache, against the FP baseline, with ``kv_on_weights_*``:
    the policy against the variant with the full-precision cache, and the interaction fields)."""
    from kveval.weights import interaction_fields

    def against_base(recs: list[dict]) -> dict:
        s = _summarise(recs, params, seed)
        for k in _PER_LAYER:
            s.pop(k, None)
        s["delta_ppl"] = s["ppl"] - base["ppl"]
        s["delta_ppl_pct"] = 100.0 * s["delta_ppl"] / base["ppl"]
        _decide(s, recs, by_policy[BASELINE], params, seed, threshold)
        return s

    alone = against_base(records[BASELINE])
    out: dict = {"alone": alone, "policies": {}}
    reference = _window_sums(by_policy[BASELINE], "")
    weights_only = _window_sums(records[BASELINE])
    for name in policies:
        recs = records[name]
        s = against_base(recs)
        n = sum(r["n_tokens"] for r in recs)
        s["kv_on_weights_kld_mean"] = sum(r["kld_vs_weights_sum"] for r in recs) / n
        s["kv_on_weights_top1_agree"] = sum(r["agree_vs_weights_sum"] for r in recs) / n
        s["kv_on_weights_delta_ppl_pct"] = 100.0 * (s["ppl"] / alone["ppl"] - 1.0)
        s.update(interaction_fields(reference, _window_sums(by_policy[name]), weights_only, _window_sums(recs),
                                    n_resamples=params.bootstrap, seed=seed))
        out["policies"][name] = s
    return out
