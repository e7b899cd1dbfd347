"""Single-pass exact emulation of a quantized KV cache (teacher forcing).

``with emulate(model, policy): logits = model(input_ids).logits`` runs the whole sequence in one forward pass
and gives the logits that token-by-token decoding through ``QuantizedKVCache`` would give under the same policy,
up to float rounding. Each query ``t`` attends to the version of every key/value ``j <= t`` that the real cache
holds at the step that decodes ``t``: full precision inside the residual window, for sinks and (with
``prefill: fp``) for prompt queries; quantized otherwise; per-channel blocks only once complete.

How mixed visibility stays exact and cheap: quantization of a token (or of a complete block) does not depend on
the step at which it happens, so every key has exactly two versions, ``k`` and ``k̂``. Attention runs once over
the concatenation ``[k ; k̂]`` (``[v ; v̂]``) with a mask ``[M ∧ causal , ¬M ∧ causal]`` where ``M[t, j]`` says
"query t sees token j in full precision" (``KVPolicy.full_precision_mask``). The softmax then covers exactly one
version of each visible token. Cost: one attention call over 2T keys; when ``M`` is empty (no residual, no sinks,
no FP prefill) it is one call over ``k̂`` alone. With ``prefill: fp`` and a prompt of P tokens, the P prompt
queries see only full-precision keys: they run as a plain attention over the prompt, and only the T - P decoded
queries attend over ``[k ; k̂]``.

When keys and values follow different schedules (KIVI: keys in blocks, values in a sliding window), a query may
read a token's key in full precision and its value quantized, or the reverse. Attention then runs over
``[k ; k̂ ; k ; k̂]`` with values ``[v ; v ; v̂ ; v̂]`` and the masks ``[Mk ∧ Mv, ¬Mk ∧ Mv, Mk ∧ ¬Mv, ¬Mk ∧ ¬Mv]``
(each ∧ causal): again exactly one (key, value) pair per visible token. Parts that no query selects are dropped
(for KIVI, a key read in full precision always comes with its value in full precision: 3T keys); when the two
masks agree on every visible pair, the two-part path above runs unchanged.

K/V transforms (``kveval.transforms``, through ``TensorQuantizer``): ``k̂`` is ``key_out(Q(key_in(k)))`` and ``k``
stands for the full-precision key as attention reads it (``TensorQuantizer.full_precision``: ``k`` itself unless a
transform keeps keys in its domain); the query goes through the query hooks and the attention output through the
output hooks, exactly as around the real cache (``QuantizedKVCache``). A transform with an attention hook
(``kveval.patch.attention.attention_call``) computes every attention call in the stock function's place; it is
told each key's token position, since the concatenated ``[k ; k̂]`` holds every token twice.

Memory: no ``[T, T]`` mask is ever built. Which version query ``t`` reads is a threshold per query,
``M[t, j] = j < sink_tokens or j >= end(t)`` (or the query is in a full-precision prefill), with ``end(t) =
Schedule.read_quantized_end`` of the call that decodes ``t`` (the function the real cache quantizes by). The
decoded queries run in chunks of rows ``[i, e)`` that attend to the tokens ``[0, e)`` only (the later ones are
causally masked anyway), each version part keeping only the tokens some row of the chunk reads in that version
(the full-precision part: sinks and residual window), with masks built from the thresholds: chunks hold at most
``CHUNK_ROWS`` rows and ``MASK_ELEMENTS`` mask entries, so the extra memory is O(T) per query row, not O(T^2), a
chunk attends to about ``e`` keys rather than ``2e``, and its softmax is exactly the softmax of its rows over one
version of each visible token (chunking only reorders float rounding). The chunks of one attention call copy the
keys and values they keep into one pair of buffers (``KeyWorkspace``) rather than concatenating a new, longer
tensor per chunk, which the C allocator keeps after it is freed (kivi2 at 32k tokens on tiny-llama: 2.9 GB of RSS
growth with the concatenations, 0.7 GB with the buffers; docs/scale.md). Where transformers' SDPA function would
run the chunk on the CPU with no mask (a causal pass), a chunk whose rows all read at least ``lse_merge.BULK_MIN``
tokens quantized splits instead (``kveval.patch.lse_merge``): those tokens in one unmasked call over views of
``k̂``/``v̂``, the few others with the chunk's versions and mask, the two softmaxes merged by their log-sum-exp
(kivi2 at 32k tokens: 4.3x a bare pass with the plans, 1.4x split).

Shapes: query ``[batch, heads, T, head_dim]``, keys/values ``[batch, kv_heads, T, head_dim]``.

Multi-head latent attention (``kveval.memory.arch``): in the ``latent`` layout the quantized tensors are the
latent ``c_kv`` and the RoPE'd ``k_pe`` that the cache stores, not the per-head keys attention sees. The two
versions are made where the latent is decompressed: the attention module's ``expand_kv(c_kv, k_pe)`` (every MLA
model of transformers 5 calls it right after the cache) gets ``[c ; ĉ]`` and ``[p ; p̂]`` and the model's own
``kv_b_proj`` decompresses both; the attention call then splits what it receives into the two versions. The
``decompressed`` layout quantizes the per-head K/V at the attention call, as for any other model.

Batches: a batch of sequences of one length (no padding) is emulated in one pass, row by row the same as each row
alone up to float rounding: the schedule depends on positions only, so every row reads the same versions (the
masks are built once and broadcast over the batch); dynamic quantizer statistics are taken per token, group or
channel block inside a row (the granularities that span a whole tensor or head take static scales only), and the
diagnostics are kept per row (``Emulation.diagnostics(row=b)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch import lse_merge
from kveval.patch.diagnostics import TensorErrorStats
from kveval.patch.layers import model_quantizers
from kveval.patch.quantizers import TensorQuantizer
from kveval.patch.rope_capture import rope_for
from kveval.patch.workspace import KeyWorkspace, version_pairs, version_reads
from kveval.policy import KVPolicy
from kveval.policy.masks import Schedule
from kveval.quant import QuantSpec

#: The largest attention mask of one chunk of decoded queries, in entries (bool here; the attention function may
#: widen it to the query dtype): queries are chunked so that ``chunk rows x key versions x keys`` stays below this.
MASK_ELEMENTS = 1 << 22
#: The most decoded queries of one chunk: a chunk attends to the keys up to its last row, so smaller chunks skip
#: more of the causally masked keys (the way ``is_causal`` does); 256 rows: bench/bench_presets.py
CHUNK_ROWS = 256
#: the masks of the chunk plans (``LayerEmulation._chunk_plan``) one forward pass keeps for its other layers, and
#: the attention masks it keeps plans for at once (a pass of a model with sliding-window layers brings two)
PLAN_CACHE_BYTES = 64 * 2**20
MASKS_PLANNED = 4


def calls_of(T: int, prefill_len: int, chunks: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Per query ``t < T``, the forward call of the real cache that brings it: ``(start, end)`` token positions.
    The prompt ``[0, prefill_len)`` is the first call, each of ``chunks`` (later multi-token calls: a session's
    turns) is one, every other token is a call of its own (``t -> t + 1``)."""
    calls = [(0, prefill_len) if t < prefill_len else (t, t + 1) for t in range(T)]
    for start, end in chunks:
        for t in range(max(start, 0), min(end, T)):
            calls[t] = (start, end)
    return calls


def read_ends(schedule: Schedule, T: int, prefill_len: int, chunks: Sequence[tuple[int, int]] = (),
              own_fp: bool = False) -> list[int]:
    """Per query ``t < T``: tokens ``[sink_tokens, end)`` are read quantized by the call that brings ``t``
    (:func:`calls_of`), ``Schedule.read_quantized_end``. Query ``t`` reads token ``j <= t`` in full precision iff
    ``j < sink_tokens`` or ``j >= end`` (or ``j`` is in ``t``'s own multi-token call under a ``prefill: fp``
    policy, ``own_fp``): ``Schedule.full_precision_mask`` row by row, without the ``[T, T]`` mask. Such a call
    reads the tokens before it as the cache held them before the call (``Schedule.quantized_end`` of its start,
    in every mode: what it stores is read in full precision)."""
    prompt = max(prefill_len, 1)
    return [schedule.quantized_end(a, prompt) if own_fp and b - a > 1 else schedule.read_quantized_end(a, b, prompt)
            for a, b in calls_of(T, prefill_len, chunks)]


def check_chunks(chunks: Sequence[tuple[int, int]], prefill_len: int) -> tuple[tuple[int, int], ...]:
    """``chunks`` as a tuple, checked: rising, non-overlapping ``(start, end)`` ranges of at least one token after
    the prompt (a ``ValueError`` otherwise)."""
    out = tuple((int(a), int(b)) for a, b in chunks)
    last = max(prefill_len, 1) if out else 0
    for a, b in out:
        if a < last or b <= a:
            raise ValueError(f"chunks must be rising, non-overlapping (start, end) ranges after the prompt of "
                             f"{prefill_len} tokens; got {list(out)}")
        last = b
    return out


def quantized_version(x: torch.Tensor, quantizer: TensorQuantizer, schedule: Schedule, rope=None,
                      fp: torch.Tensor | None = None, prompt: int = 1) -> torch.Tensor:
    """The quantized version ``x̂`` of every token that the real cache would ever quantize, as attention reads it.

    x: ``[batch, kv_heads, T, head_dim]``; ``schedule``: this tensor's (``KVPolicy.schedule(kind)``); ``prompt``:
    the tokens of the first call (``max(prefill_len, 1)``); ``rope = (cos, sin)`` ``[batch, T, head_dim]`` when the
    quantizer's transforms need it (pre-RoPE keys). ``fp``: x as attention reads it in full precision
    (``quantizer.full_precision(x)``; default x). Sink tokens and, in the block modes, the tokens of the last
    incomplete block are never quantized; they are returned as ``fp`` (the mask never selects their quantized
    version). Per-channel specs without calibrated scales take statistics over each block of ``residual`` tokens
    after the sinks (or over groups of the spec's ``group_size`` tokens inside them).
    """
    fp = x if fp is None else fp
    if quantizer.is_none:
        return fp
    T = x.shape[-2]
    start = min(schedule.sink_tokens, T)
    end = min(schedule.quantized_end(T, prompt), T) if schedule.blocks else T
    if end <= start:
        return fp
    block = schedule.residual if quantizer.spec.granularity == "channel" else None
    part = None if rope is None else (rope[0][:, start:end], rope[1][:, start:end])
    region = quantizer.fake(x[:, :, start:end], block, part)
    if start == 0 and end == T:
        return region
    return torch.cat([fp[:, :, :start], region, fp[:, :, end:]], dim=-2)


class QueryVersions:
    """Which version of each token, full precision or quantized, each query of one layer reads under the policy's
    schedule (the module docstring, "Memory"): per query the thresholds (``read_thresholds``), for a chunk of
    queries the full-precision masks (``full_precision_rows``) and what it attends to (``_chunk_plan``: the mask and
    the tokens each version part keeps, shared by the layers of one forward pass through ``mask_cache``). The base
    of ``LayerEmulation``, which holds the attributes below."""

    policy: KVPolicy
    implementation: str
    prefill_len: int
    mask_cache: dict
    chunks: tuple[tuple[int, int], ...]

    def reads_full_precision(self) -> bool:
        """Whether any query reads any token in full precision (else every read is quantized): the policy's sinks
        or window, or a multi-token call (the prompt, a chunk) whose own tokens a ``prefill: fp`` policy reads in
        full precision."""
        own = self.policy.prefill == "fp" and any(b - a > 1 for a, b in self.chunks)
        return own or self.policy.has_full_precision_tokens(self.prefill_len)

    def read_thresholds(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(end_k, end_v, own_from)``, each ``[T]``: per query, where the quantized keys (values) it reads end
        (``read_ends``; ``end_v`` None when the values share the keys' schedule) and the first token it reads in
        full precision as part of its own call (the call's start for a multi-token call under ``prefill: fp``: the
        prompt's queries read everything so; ``T`` otherwise). Cached per length for the layers of one call."""
        key = (T, str(device))
        if key not in self.mask_cache:
            self.mask_cache.clear()
            pol, P = self.policy, self.prefill_len
            own_fp = pol.prefill == "fp"
            ends = {kind: torch.tensor(read_ends(pol.schedule(kind), T, P, self.chunks, own_fp), device=device)
                    for kind in ("key", "value")}
            end_v = ends["value"] if pol.split_modes and pol.schedule("value") != pol.schedule("key") else None
            own = [a if pol.prefill == "fp" and b - a > 1 else T for a, b in calls_of(T, P, self.chunks)]
            self.mask_cache[key] = (ends["key"], end_v, torch.tensor(own, device=device, dtype=torch.long))
        return self.mask_cache[key]

    def full_precision_rows(self, T: int, start: int, stop: int, device, cols: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Mk, Mv)``, each ``[stop - start, stop]``, for a sequence of ``T`` tokens: True where query ``t`` in
        ``[start, stop)`` reads token ``j < stop``'s key (value) in full precision (rows ``start..stop-1`` of
        ``KVPolicy.full_precision_mask``, columns ``0..stop-1``, or the tokens ``cols`` ``[n]`` only; entries
        ``j > t`` are not causal-masked here); ``Mv`` None when the values share the keys' schedule."""
        end_k, end_v, own_from = self.read_thresholds(T, device)
        j = (torch.arange(stop, device=device) if cols is None else cols)[None, :]
        sinks = j < self.policy.sink_tokens
        everything = j >= own_from[start:stop, None]
        mk = sinks | (j >= end_k[start:stop, None]) | everything
        if end_v is None:
            return mk, None
        mv = sinks | (j >= end_v[start:stop, None]) | everything
        return mk, mv

    def _chunk_plan(self, attention_mask, T: int, start: int, stop: int, dtype: torch.dtype, device):
        """What ``_chunk`` attends to for queries ``[start, stop)``: (the mask ``[batch or 1, 1, stop - start, kept
        keys]`` in the implementation's form, per version part the tokens kept (a slice, an index tensor, or None
        for a part no query reads), the kept keys' positions). The same for every layer that receives the same
        ``attention_mask`` (the policy's schedule is the model's), so it is built once per forward pass and mask
        and shared through ``mask_cache``; the cache holds the mask it was built for, so a new mask (the next
        window, a sliding-window layer's mask) never meets a stale plan. Plans are kept while their masks total at
        most ``PLAN_CACHE_BYTES`` (the masks of a whole pass grow as T^2 / 2); beyond that each layer builds its
        own, as before."""
        self.read_thresholds(T, device)  # a new length clears mask_cache first, plans included
        # per attention mask (a model with sliding-window layers passes two in every pass): (the mask itself, its
        # plans by chunk); keyed by id(): the entry keeps the mask alive, so its id cannot pass to another object
        plans_of = self.mask_cache.setdefault("chunk plans", {})
        entry = plans_of.get(id(attention_mask))
        if entry is None:
            if len(plans_of) >= MASKS_PLANNED:  # an earlier pass's masks
                plans_of.clear()
                self.mask_cache["chunk plan bytes"] = 0
            entry = plans_of[id(attention_mask)] = (attention_mask, {})
        plan_key = (T, start, stop, dtype, str(device), self.implementation)
        plan = entry[1].get(plan_key)
        if plan is None:
            plan = self._build_chunk_plan(attention_mask, T, start, stop, dtype, device)
            held = self.mask_cache.get("chunk plan bytes", 0) + plan[0].numel() * plan[0].element_size()
            if held <= PLAN_CACHE_BYTES:
                entry[1][plan_key] = plan
                self.mask_cache["chunk plan bytes"] = held
        return plan

    def _build_chunk_plan(self, attention_mask, T: int, start: int, stop: int, dtype: torch.dtype, device):
        if attention_mask is None:  # causal: query t sees j <= t
            allowed = (torch.arange(stop, device=device)[None, :]
                       <= torch.arange(start, stop, device=device)[:, None])[None, None]
        else:
            allowed = attn.allowed_mask(attention_mask[..., start:stop, :], stop - start, stop, device)
        reads = version_reads(*self.full_precision_rows(T, start, stop, device))
        selections: list[slice | torch.Tensor | None] = []
        masks, positions = [], []
        for m in reads:
            m = allowed & m  # [.., stop - start, stop]
            used = m.reshape(-1, stop).any(dim=0)  # tokens some query of the chunk reads in this version
            if bool(used.all()):
                selections.append(slice(0, stop))
                masks.append(m)
                positions.append(torch.arange(stop, device=device))
                continue
            cols = used.nonzero().squeeze(1)
            if cols.numel() == 0:
                selections.append(None)
                continue
            first, n = int(cols[0]), len(cols)
            if int(cols[-1]) - first + 1 == n:  # one run of tokens (the quantized part, a window)
                selections.append(slice(first, first + n))
                masks.append(m[..., first:first + n])
            else:
                selections.append(cols)
                masks.append(m.index_select(-1, cols))
            positions.append(cols)
        mask = attn.inner_mask(torch.cat(masks, dim=-1), self.implementation, dtype)
        return mask, selections, torch.cat(positions)


@dataclass
class LayerEmulation(QueryVersions):
    """The emulation state attached to one attention module: its quantizers and the attention call that reads one
    version of each token (``QueryVersions`` says which), and the error statistics per batch row."""

    layer_idx: int
    key_q: TensorQuantizer
    value_q: TensorQuantizer
    policy: KVPolicy
    implementation: str
    prefill_len: int = 0
    diagnostics: bool = False
    calls: int = 0
    chunks: tuple[tuple[int, int], ...] = ()  # later multi-token calls (``emulate``'s ``chunks``)
    #: diagnostics per batch row (one entry per row of the largest batch seen): row ``b`` holds exactly what a
    #: batch of that row alone would hold, so a batch of windows reports each window's own statistics
    key_rows: list[TensorErrorStats] = field(default_factory=list)
    value_rows: list[TensorErrorStats] = field(default_factory=list)
    mask_cache: dict = field(default_factory=dict)  # shared by the layers of one emulate() call
    #: an MLA layer in the latent layout: the quantizers act on the latent in ``expand``, before ``kv_b_proj``;
    #: ``attend`` then receives the keys and values of both versions, ``[k ; k̂]``
    latent: bool = False

    @property
    def key_stats(self) -> TensorErrorStats:
        """The key error statistics over every batch row."""
        return merged_stats(self.key_rows)

    @property
    def value_stats(self) -> TensorErrorStats:
        """The value error statistics over every batch row."""
        return merged_stats(self.value_rows)

    def _update_stats(self, key, k_hat, value, v_hat) -> None:
        """Accumulate the error of ``k_hat`` / ``v_hat`` ``[batch, kv_heads, T, head_dim]`` per batch row."""
        for rows in (self.key_rows, self.value_rows):
            rows.extend(TensorErrorStats() for _ in range(key.shape[0] - len(rows)))
        for b in range(key.shape[0]):
            self.key_rows[b].update(key[b:b + 1], k_hat[b:b + 1])
            self.value_rows[b].update(value[b:b + 1], v_hat[b:b + 1])

    @property
    def key_spec(self) -> QuantSpec:
        return self.key_q.spec

    @property
    def value_spec(self) -> QuantSpec:
        return self.value_q.spec

    @property
    def quantizes(self) -> bool:
        return not (self.key_spec.is_none and self.value_spec.is_none)

    @property
    def transforms_act(self) -> bool:
        """Whether a transform acts on this layer's attention although nothing is quantized (a domain or a hook)."""
        return any(q.reads_transformed or q.hooks_attention for q in (self.key_q, self.value_q))

    def expand(self, expand_kv, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """An MLA layer's ``expand_kv`` in the latent layout: ``c_kv`` ``[batch, 1, T, kv_lora_rank]`` (the key
        spec's) and ``k_pe`` ``[batch, 1, T, qk_rope_head_dim]`` (the value spec's) get their quantized versions
        exactly as the real cache stores them (``quantized_version``), and the model's own ``expand_kv``
        decompresses both versions at once: keys ``[batch, heads, 2T, qk_head_dim]`` and values ``[batch, heads,
        2T, v_head_dim]``, the full-precision version first (only the quantized one, ``T`` tokens, when no query
        reads a token in full precision)."""
        pol, prompt = self.policy, max(self.prefill_len, 1)
        c_hat = quantized_version(c_kv, self.key_q, pol.schedule("key"), prompt=prompt)
        p_hat = quantized_version(k_pe, self.value_q, pol.schedule("value"), prompt=prompt)
        if self.diagnostics:
            self._update_stats(c_kv, c_hat, k_pe, p_hat)
        if not self.reads_full_precision():
            return expand_kv(c_hat, p_hat)
        return expand_kv(torch.cat([c_kv, c_hat], dim=-2), torch.cat([k_pe, p_hat], dim=-2))

    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls += 1
        stock = attn.stock_attention(module, self.implementation)
        if not self.quantizes and not self.transforms_act:
            return stock(module, query, key, value, attention_mask, *args, **kwargs)
        if self.latent:  # the versions come from ``expand`` (no transforms act on an MLA model)
            T = query.shape[-2]
            if key.shape[-2] == T:
                return stock(module, query, key, value, attention_mask, *args, **kwargs)
            if key.shape[-2] != 2 * T:
                raise KvevalError(
                    "emulate() evaluates whole sequences in one pass; do not pass past_key_values (use QuantizedKVCache to decode)"
                )
            compute = attn.attention_call(stock, self.value_q)
            return self._versions(compute, module, query, key[:, :, :T], value[:, :, :T], key[:, :, T:],
                                  value[:, :, T:], attention_mask, *args, **kwargs)
        T = key.shape[-2]
        if query.shape[-2] != T:
            raise KvevalError(
                "emulate() evaluates whole sequences in one pass; do not pass past_key_values (use QuantizedKVCache to decode)"
            )
        kq, vq = self.key_q, self.value_q
        rope = rope_for(module, key.shape[-1], kq, vq)
        compute = attn.attention_call(stock, vq, rope)  # stock, or the transforms' own attention
        query = kq.query(query, rope)  # each of these returns its input when no transform acts
        key_fp, value_fp = kq.full_precision(key, rope), vq.full_precision(value, rope)
        if not self.quantizes:
            out, weights = compute(module, query, key_fp, value_fp, attention_mask, *args, **kwargs)
            return vq.output(out, rope), weights
        out, weights = self._mixed(compute, module, query, key, value, key_fp, value_fp, rope, attention_mask,
                                   *args, **kwargs)
        return vq.output(out, rope), weights

    def _mixed(self, compute, module, query, key, value, key_fp, value_fp, rope, attention_mask, *args, **kwargs):
        """Attention of ``query`` (after the query hooks) over the full-precision (``key_fp``, ``value_fp``: as
        attention reads them) and quantized versions of the model's ``key``/``value``; (output, weights).
        ``compute``: ``attn.attention_call``'s function (``key_positions``: each key's token position)."""
        pol, prompt = self.policy, max(self.prefill_len, 1)
        k_hat = quantized_version(key, self.key_q, pol.schedule("key"), rope, key_fp, prompt)
        v_hat = quantized_version(value, self.value_q, pol.schedule("value"), rope, value_fp, prompt)
        if self.diagnostics:
            self._update_stats(key_fp, k_hat, value_fp, v_hat)
        return self._versions(compute, module, query, key_fp, value_fp, k_hat, v_hat, attention_mask, *args,
                              **kwargs)

    def _versions(self, compute, module, query, key, value, k_hat, v_hat, attention_mask, *args, **kwargs):
        """Attention of ``query`` over one version of each visible token: the full-precision ``key``/``value`` (as
        attention reads them) or the quantized ``k_hat``/``v_hat``, all ``[batch, kv_heads, T, dim]``, as the
        policy's schedule says; (output, weights)."""
        T = key.shape[-2]
        pol = self.policy
        if not self.reads_full_precision():
            return self._one_version(compute, module, query, k_hat, v_hat, attention_mask, *args, **kwargs)
        # with an FP prefill, the P prompt queries see only full-precision keys: they run the model's own attention
        # over the prompt (its mask, or none: causal) and only the decoded queries attend over [k ; k̂]
        P = self.prefill_len if self.policy.prefill == "fp" and self.prefill_len < T else 0
        outs, weights = [], None
        if P:
            head = None if attention_mask is None else attention_mask[..., :P, :P]
            outs.append(self._one_version(compute, module, query[:, :, :P], key[:, :, :P], value[:, :, :P], head,
                                          *args, **kwargs)[0])
        versions = 4 if pol.split_modes else 2
        rows = max(1, min(CHUNK_ROWS, MASK_ELEMENTS // (versions * T)))
        space = KeyWorkspace(key, value)
        stock = attn.stock_attention(module, self.implementation)
        split = lse_merge.applies(stock, self.value_q.replaces_attention, module, query, key, value, attention_mask,
                                  args, kwargs)
        step = lse_merge.ROWS if split else rows  # a split chunk's mask is over its rest only
        for first in range(P, T, step):
            last = min(first + step, T)
            out = (lse_merge.split_chunk(self, query, key, value, k_hat, v_hat, T, first, last, kwargs.get("scaling"))
                   if split else None)
            if out is not None:
                outs.append(out)
                weights = None
                continue
            for start in range(first, last, rows):
                stop = min(start + rows, last)
                out, weights = self._chunk(compute, module, query, key, value, k_hat, v_hat, attention_mask, T,
                                           start, stop, space, *args, **kwargs)
                outs.append(out)
        if len(outs) == 1:
            return outs[0], weights
        return torch.cat(outs, dim=1), None  # outputs are [batch, T, heads, head_dim]

    def _one_version(self, compute, module, query, key, value, attention_mask, *args, **kwargs):
        """Causal attention of ``query`` over one version of each token (``key``/``value`` ``[batch, kv_heads, T,
        dim]``, as many as the queries); (output, weights). The model's own attention runs whole (its kernels need
        no ``T x T`` mask); an attention hook (``replaces_attention``: FA3's FP8 attention...) builds a bool mask
        of its queries x keys, so it runs ``MASK_ELEMENTS / T`` query rows at a time over the keys up to the
        chunk's last row (the same rows, the same numbers: a row's attention reads no other row): memory linear
        in T, never a ``T x T`` matrix."""
        T = key.shape[-2]
        rows = max(1, min(CHUNK_ROWS, MASK_ELEMENTS // max(T, 1)))
        if (not self.value_q.replaces_attention or T <= rows or query.shape[-2] != T
                or (attention_mask is None and kwargs.get("is_causal") is False)):
            return compute(module, query, key, value, attention_mask, *args, **kwargs)
        kwargs.pop("key_positions", None)
        outs = []
        for start in range(0, T, rows):
            stop = min(start + rows, T)
            mask = None if attention_mask is None else attention_mask[..., start:stop, :stop]
            outs.append(compute(module, query[:, :, start:stop], key[:, :, :stop], value[:, :, :stop], mask, *args,
                                key_positions=torch.arange(stop, device=key.device), **kwargs)[0])
        return torch.cat(outs, dim=1), None  # outputs are [batch, T, heads, head_dim]

    def _chunk(self, compute, module, query, key, value, k_hat, v_hat, attention_mask, T: int, start: int,
               stop: int, space: KeyWorkspace, *args, **kwargs):
        """Queries ``[start, stop)`` over one version of each token ``j < stop``: keys ``[k ; k̂]`` (values
        ``[v ; v̂]``), or the 4 (key version, value version) parts when the schedules differ. Each part keeps only
        the tokens some query of the chunk reads in that version (a full-precision part: the sinks and the
        residual window; a part no query selects is dropped), so a chunk attends to about ``stop`` keys, not
        ``parts * stop``; the mask is ``[batch or 1, 1, stop - start, kept keys]``. The kept keys and values are
        written side by side into ``space`` (one buffer for all the chunks of the call). (output ``[batch, stop -
        start, heads, head_dim]``, weights)."""
        mask, selections, positions = self._chunk_plan(attention_mask, T, start, stop, query.dtype, key.device)
        versions = version_pairs(key, value, k_hat, v_hat, four=len(selections) == 4)  # ``_build_chunk_plan``'s
        kept = [(k, v, sel) for (k, v), sel in zip(versions, selections) if sel is not None]
        if len(kept) == 1 and isinstance(kept[0][2], slice):  # one part, every token up to stop: views, no copy
            k, v, sel = kept[0]
            keys, values = k[:, :, sel], v[:, :, sel]
        else:
            keys, values = space.filled(kept)
        return compute(module, query[:, :, start:stop], keys, values, mask, *args, key_positions=positions,
                       **kwargs)


def merged_stats(rows: list[TensorErrorStats]) -> TensorErrorStats:
    """The statistics of several batch rows as one (sums added, maxima taken); one row is returned as it is."""
    if len(rows) == 1:
        return rows[0]
    out = TensorErrorStats()
    for r in rows:
        if r._n_updates == 0:
            continue
        out.sum_sq_err += r.sum_sq_err
        out.sum_sq += r.sum_sq
        out.max_abs_err = max(out.max_abs_err, r.max_abs_err)
        if r.channel_abs_sum is not None:
            out.channel_abs_sum = (r.channel_abs_sum.clone() if out.channel_abs_sum is None
                                   else out.channel_abs_sum + r.channel_abs_sum)
        out.count += r.count
        out._n_updates += r._n_updates
    return out


class Emulation:
    """The handle ``emulate()`` yields: per-layer states, counts, and the diagnostics."""

    def __init__(self, states: list[LayerEmulation]):
        self.states = states

    @property
    def layers_quantized(self) -> int:
        """How many attention layers quantize K or V (layers whose specs are both ``none`` are not counted)."""
        return sum(1 for s in self.states if s.quantizes)

    def diagnostics(self, row: int | None = None) -> list[dict]:
        """Per layer: relative MSE, SQNR (dB), max |error| and the top outlier channels, for K and for V; over
        every batch row (``row`` None), or of batch row ``row`` alone (a batch of windows: each window's own)."""
        out = []
        for s in self.states:
            entry = {"layer": s.layer_idx}
            for name, rows in (("key", s.key_rows), ("value", s.value_rows)):
                stats = merged_stats(rows) if row is None else rows[row] if row < len(rows) else TensorErrorStats()
                for k, v in stats.summary().items():
                    entry[f"{name}_{k}"] = v
            out.append(entry)
        return out


@contextmanager
def emulate(model, policy: KVPolicy, *, prefill_len: int = 0, chunks: Sequence[tuple[int, int]] = (),
            diagnostics: bool = False):
    """Patch ``model`` so that a forward pass over whole sequences emulates ``policy``'s quantized cache.

    ``prefill_len``: how many leading tokens form the prompt (``policy.prefill`` decides whether prompt queries
    see the prompt in full precision); 0 means every token is decoded one at a time (perplexity). ``chunks``:
    later calls that bring several tokens at once, ``(start, end)`` ranges after the prompt (a session's later
    turns, each prefilled onto the history; ``policy.prefill`` decides whether their queries read their own
    call's tokens in full precision); every other token is decoded alone. The model is
    restored on exit, also after an exception. Raises ``KvevalError`` if the model's attention cannot be patched,
    and ``RuntimeError`` if a forward pass bypasses a patched layer (never a silent full-precision run).
    """
    mq = model_quantizers(model, policy)
    base = attn.base_implementation(model)
    latent = mq.mla and policy.mla == "latent"
    masks: dict = {}
    calls = check_chunks(chunks, prefill_len)
    states = [LayerEmulation(i, k_q, v_q, policy, base, prefill_len=prefill_len, diagnostics=diagnostics,
                             mask_cache=masks, latent=latent, chunks=calls)
              for i, (k_q, v_q) in mq.quantizers.items()]
    modules = [mq.modules[s.layer_idx] for s in states]

    def before(_module, _args):
        for s in states:
            s.calls = 0

    def after(_module, _args, _output):
        missed = [s.layer_idx for s in states if s.calls == 0]
        if missed:
            raise RuntimeError(
                f"kveval: attention layers {missed} were not reached through the patched attention; "
                "this model cannot be emulated faithfully"
            )

    hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    expanding = [(m, s) for m, s in zip(modules, states) if s.latent and s.quantizes]
    for m, s in expanding:  # an instance attribute over the class's method, removed on exit
        m.expand_kv = partial(s.expand, m.expand_kv)
    try:
        with attn.patched(model, dict(zip(modules, states))):
            yield Emulation(states)
    finally:
        for m, _ in expanding:
            del m.expand_kv
        for h in hooks:
            h.remove()
