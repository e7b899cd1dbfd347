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
floor's decoded logits are checked the same way (:mod:`kveval.tasks.common.finite`, the check every task shares).

The code: :mod:`~kveval.tasks.perplexity.scorer` (the forward passes, comparisons, records and CUDA memory),
:mod:`~kveval.tasks.perplexity.noise` (the noise floor's decoding), :mod:`~kveval.tasks.perplexity.aggregate`
(metrics, verdicts, power); this module runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

from kveval.data import token_windows
from kveval.errors import KvevalError
from kveval.messages import print_warning
from kveval.results.layout import BASELINE
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.perplexity.aggregate import aggregate, resolution_warnings, verdict  # noqa: F401 (verdict: tests)
from kveval.tasks.perplexity.noise import score_noise_floor
from kveval.tasks.perplexity.params import NAME, Params  # noqa: F401 (a task module names its NAME and Params)
from kveval.tasks.perplexity.scorer import (
    Batch,
    DeviceMemory,
    Scoring,
    Weights,
    _record_key,
    _weights_key,
    score_batch,
)


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
            print_warning(ctx.console, f"perplexity: {line}")
        else:
            print(f"warning: perplexity: {line}")


def run(ctx, params: Params) -> dict:
    """Evaluate every (window, policy) not yet recorded, ``batch_size`` windows per forward pass (on the
    checkpoint's weights, then on each weight variant), then the noise floor, then aggregate all records into
    metrics (:func:`kveval.tasks.common.runner.run_units`: one unit per record)."""
    tokens = ctx.tokens()[params.start_token:]
    windows = list(token_windows(tokens, params.seq_len, stride=params.stride, max_tokens=params.max_tokens))
    names = [BASELINE, *ctx.policies]
    variants = getattr(ctx, "weights", None) or {}
    units = [Unit(key, w, amount=len(w.input_ids), tally=w.index)
             for w in windows
             for key in [_record_key(w.index, n) for n in names] +
             [_weights_key(w.index, v, n) for v in variants for n in names]]
    memory = DeviceMemory(ctx.model)
    scoring = Scoring(ctx, params, names, memory)

    def by_window(pending: list[Unit]) -> Iterator[list[Unit]]:
        """The pending units of ``batch_size`` windows of one length at a time (:func:`_batches`)."""
        mine: dict[int, list[Unit]] = {}
        for u in pending:
            mine.setdefault(u.item.index, []).append(u)
        todo = list(dict.fromkeys(u.item for u in pending))
        for group in _batches(todo, params.batch_size):
            yield [u for w in group for u in mine[w.index]]

    def evaluate(units: list[Unit], _prepared) -> Iterator[dict]:
        group = list(dict.fromkeys(u.item for u in units))
        pending = {u.key for u in units}
        batch = Batch.of(group, ctx.model.device)
        yield from score_batch(scoring, batch, pending)
        for name, variant in variants.items():
            yield from score_batch(scoring, batch, pending, Weights(name, variant))

    run_units(ctx, NAME, units, Work(label="perplexity", noun="windows", evaluate=evaluate, batches=by_window))
    memory.free()  # the last batch's baseline logits
    score_noise_floor(ctx, params, windows[: params.noise_windows], names)
    return aggregate(ctx.run.records(), list(ctx.policies), params, seed=ctx.cfg.seed, threshold=ctx.cfg.threshold,
                     weights=list(variants))


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
