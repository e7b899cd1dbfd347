"""One chunk of the emulation's queries as two softmaxes merged by their log-sum-exp, as split-KV decoding kernels
merge the parts of a long cache (used by ``kveval.patch.emulate.LayerEmulation._versions``).

Under a policy whose tokens have two versions over time (full precision in a residual window or as sinks,
quantized once flushed), the queries ``[start, stop)`` of a chunk all read the tokens ``[sink_tokens, lo)``
quantized, keys and values alike, where ``lo`` is the smallest quantized end over the chunk's rows (never past
``start``: causal). That **bulk** is attended to in one call with no mask, over views of ``k̂`` and ``v̂`` (no
copy). The **rest** (the sinks and the tokens ``[lo, stop)``: the windows, the blocks not yet flushed, the
quantized tokens some rows still read in full precision) is a few hundred tokens with the versions and the mask
the emulation's chunk plan would give them, attended to in a second call. Each call returns its output and the
log-sum-exp of its rows' scores, and

    out = (exp(lse_bulk - m) * out_bulk + exp(lse_rest - m) * out_rest) / (exp(lse_bulk - m) + exp(lse_rest - m))

with ``m`` the larger of the two, is the softmax over both parts: the same attention up to float rounding (float64
equality with the real cache: tests/test_lse_merge.py), at the price of one attention over the keys (the bare
pass's) instead of a masked one over every version, a mask over all of them and a copy of every kept key per
chunk (kivi2 at 16k tokens on tiny-llama: 10 s of 20 s built masks, 3 s copied keys; docs/scale.md).

It runs where the call it replaces is transformers' SDPA function on the CPU over a causal pass (no mask: no
padding, no sliding window), with equal key and value head sizes and nothing the plain call does not take
(soft-capping, sinks, a position bias, dropout); the CPU's flash kernel (``_FLASH``) gives the log-sum-exp, which
the public ``scaled_dot_product_attention`` does not. Every other call keeps the chunk plans.

Shapes: query ``[batch, heads, rows, head_dim]``, keys and values ``[batch, kv_heads, tokens, head_dim]``,
outputs ``[batch, rows, heads, head_dim]`` (the attention functions' layout).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from kveval.patch import attention as attn
from kveval.patch.workspace import version_pairs, version_reads

#: the fewest bulk tokens for which a chunk splits: a smaller bulk does not pay for the second call (and the first
#: chunks of a pass, whose keys are mostly in the window, keep the chunk plan)
BULK_MIN = 1024
#: the queries of one split chunk: its rest (``ROWS`` plus a window's tokens) is attended to with a mask, its bulk
#: without; larger chunks make fewer calls and read more of the keys through the masked call
ROWS = 256
#: the rest plans (``rest_plan``: bool masks) one forward pass keeps for its other layers
PLAN_BYTES = 64 * 2**20
#: the CPU's flash attention kernel, which returns the rows' log-sum-exp beside the output (absent from a torch
#: built without it: then no chunk splits)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def applies(stock, replaces_attention: bool, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask, args: tuple, kwargs: dict) -> bool:
    """Whether the chunks of this attention call may split: ``stock`` is transformers' SDPA function and no
    transform replaces attention, on the CPU, causal with no mask, equal key and value head sizes, query heads a
    multiple of the key heads, no dropout, no positional ``args`` and none of ``attn.STOCK_ONLY_KWARGS``."""
    if _FLASH is None or stock is not sdpa_attention_forward or replaces_attention or args:
        return False
    if attention_mask is not None or not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return False
    if query.device.type != "cpu" or kwargs.get("dropout") or key.shape[-1] != value.shape[-1]:
        return False
    if query.shape[1] % key.shape[1] or any(kwargs.get(k) is not None and kwargs.get(k) is not False
                                            for k in attn.STOCK_ONLY_KWARGS):
        return False
    return not (module.training and getattr(module, "attention_dropout", 0.0))


def attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                  allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` ``[B, H, L, d]`` over ``key``/``value`` ``[B, Hkv, S, d]`` (query head ``h``
    reads key head ``h // (H / Hkv)``, as ``repeat_kv``), every key or where ``allowed`` ``[L, S]`` (bool) says:
    (output ``[B, H, L, d]``, log-sum-exp of each row's scaled scores ``[B, H, L]``, ``-inf`` for a row that
    reads no key). Without a mask the query heads of one key head are folded into its rows (the keys are never
    copied per query head); with one, the keys (a few hundred: the rest) are expanded to every query head and the
    mask is shared by all heads."""
    B, H, L, d = query.shape
    kv_heads = key.shape[1]
    groups = H // kv_heads
    assert _FLASH is not None
    if allowed is None:
        out, lse = _FLASH(query.reshape(B, kv_heads, groups * L, d), key, value, 0.0, False, scale=scale)
        return out.reshape(B, H, L, value.shape[-1]), lse.reshape(B, H, L)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, -torch.inf)
    out, lse = _FLASH(query, key, value, 0.0, False, attn_mask=mask[None, None], scale=scale)
    empty = ~allowed.any(dim=-1)  # [L]: the kernel gives a row that reads nothing 0, not -inf
    if bool(empty.any()):
        lse = lse.masked_fill(empty, -torch.inf)
    return out, lse


def merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over the union of the parts' keys from each part's (output ``[B, H, L, d]``, log-sum-exp
    ``[B, H, L]``): their outputs weighted by ``exp(lse - max lse)``, normalized; ``[B, H, L, d]``. Every row
    must read a key in some part."""
    top = parts[0][1]
    for _, lse in parts[1:]:
        top = torch.maximum(top, lse)
    total = weighted = None
    for out, lse in parts:
        w = torch.exp((lse - top).to(torch.float64 if out.dtype == torch.float64 else torch.float32))
        term = out.to(w.dtype) * w[..., None]
        weighted = term if weighted is None else weighted + term
        total = w if total is None else total + w
    assert weighted is not None and total is not None
    return (weighted / total[..., None]).to(parts[0][0].dtype)


def rest_plan(state, T: int, start: int, stop: int, device) -> tuple[int, int, list, torch.Tensor, bool] | None:
    """What the queries ``[start, stop)`` of a ``T``-token causal pass attend to apart from their bulk: ``(first,
    sinks, parts, allowed, four)``, the bulk being ``[sinks, first)``; ``parts`` the ``(version index, tokens)``
    each version part keeps (versions in the chunk plan's order: ``(k, v), (k̂, v̂)``, or the four ``(key
    version, value version)`` pairs when keys and values follow different schedules, ``four``), ``allowed`` the
    bool mask ``[stop - start, kept tokens]``; None when the bulk is under ``BULK_MIN``.
    The same for every layer under one policy: kept in ``state.mask_cache`` while the plans total at most
    ``PLAN_BYTES``."""
    plans = state.mask_cache.setdefault("split plans", {})
    key = (T, start, stop, str(device))
    if key in plans:
        return plans[key]
    end_k, end_v, own_from = state.read_thresholds(T, device)
    plans = state.mask_cache.setdefault("split plans", {})  # read_thresholds clears the cache for a new length
    rows = slice(start, stop)
    first = min(int(end_k[rows].min()), int(own_from[rows].min()), start)
    if end_v is not None:
        first = min(first, int(end_v[rows].min()))
    sinks = min(state.policy.sink_tokens, T)
    plan = None
    if first - sinks >= BULK_MIN:
        cols = torch.cat([torch.arange(sinks, device=device), torch.arange(first, stop, device=device)])
        mk, mv = state.full_precision_rows(T, start, stop, device, cols)
        causal = cols[None, :] <= torch.arange(start, stop, device=device)[:, None]
        parts, masks = [], []
        for i, m in enumerate(version_reads(mk, mv)):
            m = m & causal
            used = m.any(dim=0)
            if bool(used.any()):
                parts.append((i, cols[used]))
                masks.append(m[:, used])
        plan = (first, sinks, parts, torch.cat(masks, dim=1), mv is not None)
    held = state.mask_cache.get("split plan bytes", 0) + (0 if plan is None else plan[3].numel())
    if held <= PLAN_BYTES:
        plans[key] = plan
        state.mask_cache["split plan bytes"] = held
    return plan


def split_chunk(state, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_hat: torch.Tensor,
                v_hat: torch.Tensor, T: int, start: int, stop: int, scale: float | None) -> torch.Tensor | None:
    """Queries ``[start, stop)`` of a ``T``-token causal pass over one version of each token ``j < stop``, as the
    bulk and the rest merged (the module docstring; ``rest_plan``); ``state``: the layer's ``QueryVersions``.
    Output ``[batch, stop - start, heads, head_dim]``, or None when the bulk is under ``BULK_MIN`` tokens (the
    caller runs its chunk plan)."""
    plan = rest_plan(state, T, start, stop, key.device)
    if plan is None:
        return None
    first, sinks, parts, allowed, split_modes = plan
    q = query[:, :, start:stop]
    bulk = attention_lse(q, k_hat[:, :, sinks:first], v_hat[:, :, sinks:first], scale)
    versions = version_pairs(key, value, k_hat, v_hat, four=split_modes)
    keys = torch.cat([versions[i][0].index_select(2, idx) for i, idx in parts], dim=2)
    values = torch.cat([versions[i][1].index_select(2, idx) for i, idx in parts], dim=2)
    rest = attention_lse(q, keys, values, scale, allowed)
    return merged([bulk, rest]).transpose(1, 2).contiguous()


__all__ = ["BULK_MIN", "PLAN_BYTES", "ROWS", "applies", "attention_lse", "merged", "rest_plan", "split_chunk"]
