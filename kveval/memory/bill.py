"""The memory bill of a KV cache: exact bytes for a policy, an architecture, a context and a batch.

Pure arithmetic (no transformers import). Every quantized byte count comes from
:func:`kveval.quant.packed_nbytes`, the same function that sizes the real cache's tensors, so the bill and
:class:`kveval.patch.cache.QuantizedKVCache` cannot drift apart.

    from kveval.memory import Arch, kv_bytes
    bill = kv_bytes(Arch.named("llama-7b-mha"), "int4_g64", context=2048)
    bill.total, bill.codes, bill.scales, bill.residual          # bytes

What is counted, per layer ``l`` with key spec ``Ks`` and value spec ``Vs`` (``specs_for_layer``), for ``n`` stored
tokens of ``batch`` sequences (K/V tensors ``[batch, kv_heads, n, head_dim]``):

* ``sinks = min(sink_tokens, n)`` and the residual window (tokens not yet quantized) in full precision,
  ``fp_bytes`` per element (default 2, FP16). A tensor whose spec is ``none`` is full precision for all ``n``.
* the quantized middle ``[sink_tokens, end)`` with ``end = policy.quantized_block_end(n, kind, prompt)``, per
  tensor (keys and values may follow different schedules: KIVI): sliding modes ``max(n - R, S)``; block mode
  ``S + floor((n - S) / R) * R`` (only complete blocks are quantized); transformers' ``prompt_block``: the prompt,
  then complete blocks counted from its end (``prompt``: the tokens the first call stored; default ``n``, a cache
  filled by one prompt).
  Codes are ``spec.fmt.row_nbytes(spec, head_dim)`` bytes per token row, as the format packs them (INT b:
  ``ceil(head_dim * b / 8)``, FP8 1 byte per element); scales and zero points in their storage dtype per
  statistics group: token (per token and head), group (per ``group_size`` of head_dim), channel (per channel and
  head per block of ``R`` tokens, or per group of the spec's ``group_size`` tokens: KIVI's keys, one scale and min
  per channel per 32 tokens; with calibrated scales one per channel and head per layer), head /
  tensor (static: one per head / one per layer and tensor, whatever the batch and context). Outliers
  (``spec.outliers``) are counted with the scales: ``k`` values per token row in ``fp_bytes`` plus a 1-byte index
  each.
* a sliding-window layer (``Arch.sliding_layers``, read from the model config's ``layer_types`` /
  ``sliding_window``) holds only the newest ``min(n, window)`` tokens, as engines keep them (transformers'
  ``DynamicSlidingWindowLayer`` keeps ``window - 1`` between calls and reads them with the new token; vLLM's
  hybrid allocator frees the blocks that left the window): its sinks, quantized middle and residual are cut at
  position ``n - window`` (``token_split``); a per-channel block keeps its codes and scales until its last token
  has left the window. A chunked-attention layer (Llama-4's local layers, ``Arch.chunked_layers``) is held the
  same way with ``window = attention_chunk_size`` (transformers keeps it in the same sliding layer; the mask then
  limits attention to the current chunk).
* per layer, the shapes ``Arch.kv_shapes(policy.mla)`` store: ``[kv_heads, head_dim]`` for keys and values, or,
  for multi-head latent attention, the latent ``c_kv`` ``[1, kv_lora_rank]`` (the key spec) and ``k_pe``
  ``[1, qk_rope_head_dim]`` (the value spec) in the ``latent`` layout engines use. Layers without K/V
  (linear-attention, Mamba, MLP-only) hold nothing here; their fixed-size state is ``Bill.state``, per sequence,
  outside ``total`` (``Arch.state_bytes``: conv state in ``fp_bytes``, recurrent state in float32). Capacity
  counts it: a sequence needs its KV bytes plus its state.

Worked (the published figures, binary units, symmetric, float32 scales, no zero point), ``llama-7b-mha``
(32 layers, 32 KV heads, head_dim 128), batch 1, 2048 tokens: FP16 = 2 * 32 * 32 * 2048 * 128 * 2 B = 1 GiB;
INT8 per-tensor = 512 MiB of codes + 32 layers * 2 tensors * 4 B = 512 MiB + 256 B; INT4 g64 = 256 MiB of codes
+ 2 groups * 4 B per token row (32 MiB) = 288 MiB.

Capacity: ``max_batch = floor((gpu_memory - model_bytes - activation_bytes) / kv_bytes_per_sequence)``, with
``model_bytes = Arch.model_bytes``: ``params * weight_bytes_per_param`` (FP16 weights: 2), or, for quantized
weights, the exact ``Arch.weight_bytes`` (codes + scales of the quantized matrices, the rest in FP16:
``Arch.with_quantized_weights``).
Paging (vLLM PagedAttention): ``ceil(L / block_size)`` blocks per sequence; the paged bill is the bill at
``blocks * block_size`` tokens (the last block's waste included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.memory.arch import KV_KINDS, Arch, positive_int
from kveval.memory.fit import check_policy
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, packed_nbytes
from kveval.units import format_bytes  # the capacity errors' sizes

FP16_BYTES = 2
_FP_DTYPES = {1: torch.float8_e4m3fn, 2: torch.float16, 4: torch.float32, 8: torch.float64}
DEFAULT_BLOCK_SIZE = 16
MAX_CONTEXT = 2**31


# ------------------------------------------------------------------------------------------------- the bill


@dataclass(frozen=True)
class Part:
    """Bytes of one tensor kind (or a sum): ``scales`` includes zero points; ``residual`` is full precision."""

    codes: int = 0
    scales: int = 0
    residual: int = 0

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.residual

    def __add__(self, other: Part) -> Part:
        return Part(self.codes + other.codes, self.scales + other.scales, self.residual + other.residual)

    def to_dict(self) -> dict:
        return {"codes": self.codes, "scales": self.scales, "residual": self.residual, "total": self.total}


@dataclass(frozen=True)
class Bill:
    """The bytes of a KV cache holding ``context`` tokens of ``batch`` sequences.

    ``total = codes + scales + residual``; ``key`` / ``value`` split the sums by tensor; ``per_layer[i]`` is
    ``(key Part, value Part)`` of layer i; ``quantized_tokens`` / ``fp_tokens`` are per sequence, for the keys of
    a full-attention layer whose specs quantize (sinks + residual window are ``fp_tokens``); ``value_tokens`` is the values'
    ``(fp_tokens, quantized_tokens)`` (the same split unless keys and values follow different schedules).
    ``state``: the fixed state of the ``batch`` sequences in the state layers (bytes, not in ``total``: no KV
    policy changes it); ``layout``: an MLA model's cache layout (``latent`` / ``decompressed``), else None.
    """

    policy: str
    context: int
    batch: int
    key: Part
    value: Part
    per_layer: tuple[tuple[Part, Part], ...] = field(repr=False)
    quantized_tokens: int
    fp_tokens: int
    elements: int  # K and V elements held (2 * sum over layers of held tokens * batch * kv_heads * head_dim)
    value_tokens: tuple[int, int] = (0, 0)
    window: int | None = None  # the sliding window of ``sliding_layers`` (they hold min(context, window) tokens)
    sliding_layers: tuple[int, ...] = ()
    state: int = 0
    layout: str | None = None

    @property
    def codes(self) -> int:
        return self.key.codes + self.value.codes

    @property
    def scales(self) -> int:
        return self.key.scales + self.value.scales

    @property
    def residual(self) -> int:
        return self.key.residual + self.value.residual

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.residual

    @property
    def total_with_state(self) -> int:
        """What the ``batch`` sequences need in all: the KV bytes plus the state layers' fixed state."""
        return self.total + self.state

    @property
    def bytes_per_token(self) -> float:
        """Total bytes per token of one sequence, amortised over the context (scales and windows included)."""
        return self.total / (self.batch * self.context)

    @property
    def bits_per_element(self) -> float:
        """Average stored bits per K/V element, scales, zero points and full-precision tokens included."""
        return 8 * self.total / self.elements

    def to_dict(self) -> dict:
        return {"policy": self.policy, "context": self.context, "batch": self.batch, "total": self.total,
                "codes": self.codes, "scales": self.scales, "residual": self.residual,
                "bytes_per_token": self.bytes_per_token, "key": self.key.to_dict(), "value": self.value.to_dict(),
                "sliding_window": self.window, "sliding_layers": list(self.sliding_layers), "state": self.state,
                **({"mla_layout": self.layout} if self.layout else {})}


def as_policy(policy: KVPolicy | str) -> KVPolicy:
    """A KVPolicy from a policy or a preset name (``KVPolicy.preset``); ``fp16``/``none`` are full precision."""
    if isinstance(policy, KVPolicy):
        return policy
    if isinstance(policy, str):
        return KVPolicy.preset(policy.strip())
    raise KvevalError(f"expected a KV policy or a preset name; got {policy!r}")


def token_split(policy: KVPolicy, n: int, kind: str = "key", prompt: int | None = None,
                window: int | None = None, block: int | None = None) -> tuple[int, int]:
    """(full-precision tokens, quantized tokens) of ``kind`` held for one sequence after ``n`` tokens are stored,
    the first call having stored ``prompt`` of them (default ``n``), exactly as the real cache holds them: sinks
    ``min(S, n)``, quantized ``[S, min(quantized_block_end(n), n))``, the rest residual.

    ``window``: a sliding-window layer keeps only positions ``[n - window, n)`` (all three parts are cut there);
    ``block``: the token block of per-channel statistics (a dynamic channel spec), whose codes and scales are
    dropped only when the whole block has left the window, so the quantized part then starts at the first
    block that still holds a token of the window (blocks tile ``[S, origin)`` and then ``[origin, ...)``, origin
    ``Schedule.origin(prompt)``: the chunks the cache stores). Worked: S = 0, R = block = 4, block mode,
    n = 13, window 6: positions 7..12 are held; quantized end 12, block start of 7 is 4: quantized [4, 12) = 8
    tokens (4..6 kept with their block), full precision [12, 13) = 1.
    """
    p = n if prompt is None else min(max(prompt, 1), n)
    end = min(policy.quantized_block_end(n, kind, p), n)
    S = policy.sink_tokens
    lo = 0 if window is None else max(n - window, 0)
    sinks = max(min(S, n) - lo, 0)
    fp = sinks + n - max(end, lo)
    if lo >= end:
        return fp, 0
    start = max(S, lo)
    if block is not None and lo > S:
        origin = max(policy.schedule(kind).origin(p), S)
        base = S if lo < origin else origin
        start = base + (lo - base) // block * block
    return fp, max(end - start, 0)


def _tensor_part(spec: QuantSpec, policy: KVPolicy, arch: Arch, layer: int, batch: int, n: int, fp_bytes: int,
                 kind: str, prompt: int | None, shape: tuple[int, int]) -> Part:
    """Bytes of one tensor kind of layer ``layer``, whose token rows are ``shape = (heads, dim)``."""
    B, (H, D) = batch, shape
    window = arch.window(layer)
    if spec.is_none:
        return Part(residual=B * H * arch.held_tokens(layer, n) * D * fp_bytes)
    cb = policy.residual if spec.gran.token_blocks else None
    static = policy.uses_static(spec)
    block = spec.gran.block(n, cb) if spec.gran.token_blocks and not static else None
    n_fp, n_q = token_split(policy, n, kind, prompt, window, block)
    residual = B * H * n_fp * D * fp_bytes
    if n_q == 0:
        return Part(residual=residual)
    nb = packed_nbytes(spec, (B, H, n_q, D), channel_block=cb, dtype=_FP_DTYPES[fp_bytes], static=static)
    return Part(codes=nb["codes"], scales=nb["scales"] + nb["outliers"], residual=residual)


def _check_sizes(context: Any, batch: Any, fp_bytes: Any) -> None:
    positive_int(context, "context")
    positive_int(batch, "batch")
    positive_int(fp_bytes, "fp_bytes")
    if fp_bytes not in _FP_DTYPES:
        raise KvevalError(f"fp_bytes must be one of {sorted(_FP_DTYPES)}; got {fp_bytes}")


def kv_bytes(arch: Arch, policy: KVPolicy | str, context: int, batch: int = 1, fp_bytes: int = FP16_BYTES,
             prompt: int | None = None) -> Bill:
    """The bill of ``batch`` sequences of ``context`` tokens under ``policy`` (a KVPolicy or a preset name).

    ``fp_bytes``: bytes per full-precision element (residual window, sinks, ``none`` specs): 2 for FP16/BF16
    serving, 4 for a float32 model; a ``model`` scale dtype takes the same size. ``prompt``: the tokens the first
    call stored (default ``context``: one prompt filled the cache); only transformers' ``prompt_block`` schedule
    depends on it. Raises KvevalError for sizes <= 0 or a policy that cannot act on this model
    (``kveval.memory.fit.check_policy``: a group size that does not divide what a spec quantizes, ...).
    """
    _check_sizes(context, batch, fp_bytes)
    pol = as_policy(policy)
    check_policy(arch, pol)
    shapes = arch.kv_shapes(pol.mla)
    per_layer = []
    key = value = Part()
    for i in range(arch.layers):
        if arch.kind(i) not in KV_KINDS:
            per_layer.append((Part(), Part()))
            continue
        ks, vs = pol.specs_for_layer(i, arch.layers, arch.sliding_layers)
        k = _tensor_part(ks, pol, arch, i, batch, context, fp_bytes, "key", prompt, shapes[0])
        v = _tensor_part(vs, pol, arch, i, batch, context, fp_bytes, "value", prompt, shapes[1])
        per_layer.append((k, v))
        key, value = key + k, value + v
    n_fp, n_q = token_split(pol, context, "key", prompt)
    return Bill(policy=pol.name, context=context, batch=batch, key=key, value=value, per_layer=tuple(per_layer),
                quantized_tokens=n_q, fp_tokens=n_fp,
                elements=kv_elements(arch, context, batch, pol.mla),
                value_tokens=token_split(pol, context, "value", prompt),
                window=arch.sliding_window, sliding_layers=arch.sliding_layers,
                state=batch * arch.state_bytes(fp_bytes), layout=None if arch.mla is None else pol.mla)


def _held(arch: Arch, context: int) -> int:
    """Token rows held across layers: ``sum_l held_tokens(l, context)`` (``layers * context`` when every layer
    holds K/V of every token)."""
    return sum(arch.held_tokens(i, context) for i in range(arch.layers))


def _row_elements(arch: Arch, layout: str) -> int:
    """K and V elements of one token row of one layer: ``2 * kv_heads * head_dim``, or with MLA
    ``kv_lora_rank + qk_rope_head_dim`` (latent) / ``heads * (qk_head_dim + v_head_dim)`` (decompressed)."""
    (hk, dk), (hv, dv) = arch.kv_shapes(layout)
    return hk * dk + hv * dv


def kv_elements(arch: Arch, context: int, batch: int = 1, layout: str = "latent") -> int:
    """K and V elements the cache holds for ``batch`` sequences of ``context`` tokens (the denominator of bits per
    element): ``2 * layers * batch * kv_heads * context * head_dim`` for a model whose every layer caches K/V of
    every token; windows, layers without K/V and MLA's latent as in :func:`fp16_bytes`."""
    return _held(arch, context) * batch * _row_elements(arch, layout)


def fp16_bytes(arch: Arch, context: int, batch: int = 1, layout: str = "latent") -> int:
    """Bytes of the unquantized FP16 cache: ``2 (K, V) * layers * batch * kv_heads * context * head_dim * 2``
    (a sliding-window or chunked layer counts ``min(context, window)`` tokens, a layer without K/V none; an MLA
    model stores ``(kv_lora_rank + qk_rope_head_dim) * 2`` bytes per token and layer in the ``latent``
    ``layout``). The state layers' state is not in it (``Arch.state_bytes``)."""
    _check_sizes(context, batch, 1)
    return kv_elements(arch, context, batch, layout) * FP16_BYTES


# ------------------------------------------------------------------------------------------------- capacity


def kv_budget(arch: Arch, gpu_memory: int, model_bytes: int | None = None, activation_bytes: int = 0) -> int:
    """Bytes left for the KV cache: ``gpu_memory - model_bytes - activation_bytes`` (model bytes unless given:
    ``arch.model_bytes``, the quantized weights' ``weight_bytes`` when set, else the parameter count times the
    weight dtype's size). A GPU too small to hold the model raises KvevalError."""
    if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float)) or gpu_memory <= 0:
        raise KvevalError(f"gpu_memory must be a positive number of bytes; got {gpu_memory!r}")
    if activation_bytes < 0:
        raise KvevalError(f"activation_bytes must be >= 0; got {activation_bytes!r}")
    weights = arch.model_bytes if model_bytes is None else model_bytes
    if weights is None:
        weights = 0  # parameter count unknown (explicit shape): the whole GPU is for the cache
    if weights < 0:
        raise KvevalError(f"model_bytes must be >= 0; got {model_bytes!r}")
    left = gpu_memory - weights - activation_bytes
    if left <= 0:
        raise KvevalError(
            f"GPU memory {format_bytes(gpu_memory)} is too small to hold the model "
            f"({format_bytes(weights)} of weights + {format_bytes(activation_bytes)} of activations)"
        )
    return left


def max_batch(arch: Arch, policy: KVPolicy | str, context: int, gpu_memory: int, model_bytes: int | None = None,
              activation_bytes: int = 0, fp_bytes: int = FP16_BYTES) -> int:
    """``floor((gpu_memory - model_bytes - activation_bytes) / bytes_per_sequence)`` (may be 0), a sequence's
    bytes being its KV bill plus the state layers' fixed state (``Bill.total_with_state``).

    Worked: llama-7b-mha, FP16 at 2048 tokens (1 GiB per sequence) on 80 GiB with 6,738,415,616 * 2 B of weights
    (12.55 GiB): floor(67.45) = 67.
    """
    budget = kv_budget(arch, gpu_memory, model_bytes, activation_bytes)
    per_seq = kv_bytes(arch, policy, context, 1, fp_bytes).total_with_state
    return int(budget // per_seq)


def max_context(arch: Arch, policy: KVPolicy | str, gpu_memory: int, batch: int = 1,
                model_bytes: int | None = None, activation_bytes: int = 0, fp_bytes: int = FP16_BYTES) -> int:
    """The longest context L such that ``kv_bytes(arch, policy, L, batch).total_with_state`` fits the budget (0 if none;
    ``MAX_CONTEXT`` = 2**31 when memory sets no limit below it: a model whose every layer slides)."""
    budget = kv_budget(arch, gpu_memory, model_bytes, activation_bytes)
    pol = as_policy(policy)

    def fits(n: int) -> bool:
        return kv_bytes(arch, pol, n, batch, fp_bytes).total_with_state <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        if hi >= MAX_CONTEXT:  # every layer slides: the bill stops growing at the window
            return MAX_CONTEXT
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi); bytes grow with n
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ------------------------------------------------------------------------------------------------- paging


@dataclass(frozen=True)
class Paging:
    """vLLM-style paged storage of ``batch`` sequences of ``context`` tokens in blocks of ``block_size`` tokens.

    ``blocks_per_sequence = ceil(context / block_size)``; ``blocks = batch * blocks_per_sequence``;
    ``total`` = the bill at ``blocks_per_sequence * block_size`` tokens (the last block's waste included);
    ``waste = total - bill.total``; ``block_bytes`` = bytes of one block of quantized tokens across all layers,
    K and V (steady state: scales per token/group, per-channel scales amortised over their token block; per-layer
    tensor/head scales, full-precision windows, sliding-window and chunked layers, which hold a fixed window, and
    state layers are not per block).
    """

    block_size: int
    blocks_per_sequence: int
    blocks: int
    total: int
    waste: int
    block_bytes: float

    def tokens_for(self, budget: int) -> int:
        """Tokens that ``budget`` bytes of blocks hold: ``floor(budget / block_bytes) * block_size``."""
        return int(budget // self.block_bytes) * self.block_size if self.block_bytes else 0

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "blocks_per_sequence": self.blocks_per_sequence,
                "blocks": self.blocks, "total": self.total, "waste": self.waste, "block_bytes": self.block_bytes}


def block_bytes(arch: Arch, policy: KVPolicy | str, block_size: int = DEFAULT_BLOCK_SIZE,
                fp_bytes: int = FP16_BYTES) -> float:
    """Bytes of one block of ``block_size`` quantized tokens (one sequence, all layers, K and V).

    Worked: llama-7b-mha, INT4 g64 symmetric with float32 scales, 16 tokens: 32 layers * 2 * 32 heads * 16 *
    (64 B codes + 8 B scales) = 2,359,296 B (2.25 MiB; FP16: 4 MiB).
    """
    positive_int(block_size, "block_size")
    pol = as_policy(policy)
    check_policy(arch, pol)
    shapes = arch.kv_shapes(pol.mla)
    total = Fraction(0)
    for i in arch.kv_layers:
        if arch.window(i) is not None:
            continue
        for (H, D), spec in zip(shapes, pol.specs_for_layer(i, arch.layers, arch.sliding_layers)):
            nb = packed_nbytes(spec, (1, H, block_size, D), dtype=_FP_DTYPES[fp_bytes])
            if spec.is_none:
                total += H * block_size * D * fp_bytes
            elif spec.gran.static_only or (pol.uses_static(spec) and spec.gran.calibratable):
                total += nb["codes"] + nb["outliers"]  # (a calibrated per-token spec, nuq values: the else branch)
            elif spec.gran.token_blocks:
                r = pol.residual
                per_r = packed_nbytes(spec, (1, H, r, D), channel_block=r, dtype=_FP_DTYPES[fp_bytes])
                total += Fraction(per_r["total"] * block_size, r)
            else:
                total += nb["total"]
    return int(total) if total.denominator == 1 else float(total)


def paging(arch: Arch, policy: KVPolicy | str, context: int, batch: int = 1,
           block_size: int = DEFAULT_BLOCK_SIZE, fp_bytes: int = FP16_BYTES) -> Paging:
    """Paged-block figures (see :class:`Paging`). Worked: 2050 tokens in blocks of 16 -> 129 blocks, the last
    holding 2 tokens and wasting 14 tokens' bytes."""
    positive_int(block_size, "block_size")
    _check_sizes(context, batch, fp_bytes)
    per_seq = -(-context // block_size)
    paged = kv_bytes(arch, policy, per_seq * block_size, batch, fp_bytes).total
    exact = kv_bytes(arch, policy, context, batch, fp_bytes).total
    return Paging(block_size=block_size, blocks_per_sequence=per_seq, blocks=batch * per_seq, total=paged,
                  waste=paged - exact, block_bytes=block_bytes(arch, policy, block_size, fp_bytes))


__all__ = [
    "Bill", "Part", "Paging", "kv_bytes", "kv_elements", "fp16_bytes", "max_batch", "max_context", "kv_budget", "paging",
    "block_bytes", "token_split", "as_policy", "MAX_CONTEXT",
]
