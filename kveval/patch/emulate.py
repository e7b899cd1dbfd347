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

Shapes: query ``[batch, heads, T, head_dim]``, keys/values ``[batch, kv_heads, T, head_dim]``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kveval.errors import KvevalError
from kveval.patch import attention as attn
from kveval.patch.diagnostics import TensorErrorStats
from kveval.patch.quantizers import TensorQuantizer, layer_quantizers, model_type_of, policy_scales
from kveval.patch.rope_capture import rope_for, track_rope
from kveval.policy import KVPolicy
from kveval.policy.masks import Schedule
from kveval.quant import QuantSpec


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


@dataclass
class LayerEmulation:
    """The emulation state attached to one attention module."""

    layer_idx: int
    key_q: TensorQuantizer
    value_q: TensorQuantizer
    policy: KVPolicy
    implementation: str
    prefill_len: int = 0
    diagnostics: bool = False
    calls: int = 0
    key_stats: TensorErrorStats = field(default_factory=TensorErrorStats)
    value_stats: TensorErrorStats = field(default_factory=TensorErrorStats)
    mask_cache: dict = field(default_factory=dict)  # shared by the layers of one emulate() call

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

    def visibility(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Mk, Mv)``, each ``[T, T]``: True where query t sees token j's key (value) in full precision, False for
        ``j > t``; ``Mv`` is None when it equals ``Mk`` (one schedule, or two that agree on every visible pair).
        Cached per length."""
        key = (T, str(device))
        if key not in self.mask_cache:
            self.mask_cache.clear()
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            pol, P = self.policy, self.prefill_len
            fp_k = pol.full_precision_mask(T, T, P, device=device, kind="key") & causal
            fp_v = pol.full_precision_mask(T, T, P, device=device, kind="value") & causal if pol.split_modes else None
            if fp_v is not None and torch.equal(fp_k, fp_v):
                fp_v = None
            self.mask_cache[key] = (fp_k, fp_v)
        return self.mask_cache[key]

    def attend(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls += 1
        stock = attn.stock_attention(module, self.implementation)
        if not self.quantizes and not self.transforms_act:
            return stock(module, query, key, value, attention_mask, *args, **kwargs)
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
        T = key.shape[-2]
        pol, prompt = self.policy, max(self.prefill_len, 1)
        k_hat = quantized_version(key, self.key_q, pol.schedule("key"), rope, key_fp, prompt)
        v_hat = quantized_version(value, self.value_q, pol.schedule("value"), rope, value_fp, prompt)
        key, value = key_fp, value_fp
        if self.diagnostics:
            self.key_stats.update(key, k_hat)
            self.value_stats.update(value, v_hat)
        if not self.policy.has_full_precision_tokens(self.prefill_len):
            return compute(module, query, k_hat, v_hat, attention_mask, *args, **kwargs)
        fp, fp_v = self.visibility(T, key.device)
        # with an FP prefill, the P prompt queries see only full-precision keys: they run the model's own attention
        # over the prompt (its mask, or none: causal) and only the decoded queries attend over [k ; k̂]
        P = self.prefill_len if self.policy.prefill == "fp" and self.prefill_len < T else 0
        if P:
            head = None if attention_mask is None else attention_mask[..., :P, :P]
            out_p, _ = compute(module, query[:, :, :P], key[:, :, :P], value[:, :, :P], head, *args, **kwargs)
        rows = None if attention_mask is None else attention_mask[..., P:, :]
        allowed = attn.allowed_mask(rows, T - P, T, key.device)  # [.., T - P, T]
        if fp_v is None:
            parts = [(key, value, fp[P:]), (k_hat, v_hat, ~fp[P:])]
        else:  # keys and values read on different schedules: one part per (key version, value version)
            mk, mv = fp[P:], fp_v[P:]
            parts = [(key, value, mk & mv), (k_hat, value, ~mk & mv), (key, v_hat, mk & ~mv),
                     (k_hat, v_hat, ~mk & ~mv)]
            causal = torch.ones(T, T, dtype=torch.bool, device=key.device).tril()[P:]
            parts = [p for p in parts if bool((p[2] & causal).any())]
        mask = torch.cat([allowed & m for _, _, m in parts], dim=-1)
        mask = attn.inner_mask(mask, self.implementation, query.dtype)
        keys = torch.cat([k for k, _, _ in parts], dim=-2)
        values = torch.cat([v for _, v, _ in parts], dim=-2)
        positions = torch.arange(T, device=key.device).repeat(len(parts))  # the parts are versions of tokens 0..T-1
        out = compute(module, query[:, :, P:], keys, values, mask, *args, key_positions=positions, **kwargs)
        if not P:
            return out
        return torch.cat([out_p, out[0]], dim=1), None  # outputs are [batch, T, heads, head_dim]


class Emulation:
    """The handle ``emulate()`` yields: per-layer states, counts, and the diagnostics."""

    def __init__(self, states: list[LayerEmulation]):
        self.states = states

    @property
    def layers_quantized(self) -> int:
        """How many attention layers quantize K or V (layers whose specs are both ``none`` are not counted)."""
        return sum(1 for s in self.states if s.quantizes)

    def diagnostics(self) -> list[dict]:
        """Per layer: relative MSE, SQNR (dB), max |error| and the top outlier channels, for K and for V."""
        out = []
        for s in self.states:
            row = {"layer": s.layer_idx}
            for name, stats in (("key", s.key_stats), ("value", s.value_stats)):
                for k, v in stats.summary().items():
                    row[f"{name}_{k}"] = v
            out.append(row)
        return out


@contextmanager
def emulate(model, policy: KVPolicy, *, prefill_len: int = 0, diagnostics: bool = False):
    """Patch ``model`` so that a forward pass over whole sequences emulates ``policy``'s quantized cache.

    ``prefill_len``: how many leading tokens form the prompt (``policy.prefill`` decides whether prompt queries
    see the prompt in full precision); 0 means every token is decoded one at a time (perplexity). The model is
    restored on exit, also after an exception. Raises ``KvevalError`` if the model's attention cannot be patched,
    and ``RuntimeError`` if a forward pass bypasses a patched layer (never a silent full-precision run).
    """
    modules = attn.attention_modules(model)
    if not modules:
        raise KvevalError(f"{type(model).__name__}: no attention modules with a layer index found; cannot patch")
    base = attn.base_implementation(model)
    scales = policy_scales(policy, model)
    if any(t.needs_rope for t in policy.transform_sequence()):
        track_rope(model)
    num_layers = len(modules)
    states = []
    masks: dict = {}
    for module in modules:
        k_q, v_q = layer_quantizers(policy, module.layer_idx, num_layers, scales, model.device,
                                    model_type_of(model))
        states.append(LayerEmulation(
            module.layer_idx, k_q, v_q, policy, base, prefill_len=prefill_len, diagnostics=diagnostics,
            mask_cache=masks,
        ))

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
    try:
        with attn.patched(model, dict(zip(modules, states))):
            yield Emulation(states)
    finally:
        for h in hooks:
            h.remove()
