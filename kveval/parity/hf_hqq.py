"""Parity with transformers' ``QuantizedCache(backend="hqq")``: kveval's ``hf_hqq_int4`` / ``hf_hqq_int2`` presets
against the real cache (transformers 5.24, hqq 0.2.8.post1) on the same model and token ids.

    rows = run("builtin:smollm2-135m", ["int4/p4", "int4/p128"], tokens=260)

A cache type is ``int{nbits}/p{P}``: ``nbits`` 4 or 2, the cache built with ``axis_key = axis_value = 1`` (what
transformers' docs recommend for HQQ, and what the presets claim) and its other arguments at transformers' defaults
(``q_group_size=64``, ``residual_length=128``), a prompt of ``P`` tokens in one call, then one token per call up to
``tokens``. ``int4/p128:axis0`` runs the cache at transformers' default axis 0 instead, against the same preset: a
measurement of what the presets do not reproduce, not a parity claim.

What runs:

- **transformers** (``reference_logits``): ``QuantizedCache(backend="hqq", config=model.config, nbits=...,
  axis_key=1, axis_value=1)`` handed to the model's forward, the prompt in one call, then one token per call; the
  logits of every call are kept (``[T, vocab]``). What it does (``cache_utils.py`` ``QuantizedLayer.update``,
  ``HQQQuantizedLayer``): the first call quantizes its keys and values and returns the originals; a later call
  returns the dequantized states + the residual + the new token, and when the residual plus the new token reaches
  ``residual_length`` it re-quantizes all of that (old tokens dequantized and quantized again) in one
  ``hqq.core.quantize.Quantizer.quantize(tensor, axis, device, compute_dtype=model dtype, nbits, group_size)`` call
  and empties the residual; scale and zero are then cast to the model's dtype (``Quantizer.cuda``). With axis 1, hqq
  groups ``tensor.reshape(-1, 64)``: per token and head, groups of 64 channels of head_dim
  (``kveval/quant/formats/hqq.py`` has the quantizer).
- **its baseline** (``ref_fp``): the same calls through transformers' ``DynamicCache``.
- **kveval**: the preset through ``kveval.patch.emulate`` over all ids in one pass with ``prefill_len = P``
  (``kv``), and the unquantized model in one pass (``kv_fp``).
- Scored: the decoded positions ``P .. T-2``.

What is not reproduced: (1) transformers re-quantizes the already-quantized tokens at every flush, kveval
quantizes each token once; (2) hqq's solver stops for all groups of a call at the first step where the call's mean
error does not fall, kveval runs each group's 20 steps (the format's module docstring); ``tests/parity/
test_hf_hqq.py`` measures both. Measured on the builtin model (float32, ids 1000-1259, the default types), KL(P_tf ‖
P_kveval) / KL(P_tf FP ‖ P_tf): 0.0030 (int4/p4), 3.9e-7 (int4/p128), 0.039 (int2/p4), 2.4e-11 (int2/p128); with
hqq's early stop removed from transformers' side (hqq's own step function, 20 times) the 4-token prompts give
8.5e-5 and 1.0e-7: (2) on the prompt's call of 12 groups is what remains, (1) leaves float32 noise. Axis 0 (transformers' default) groups every 64th element of the flattened history
``[batch, heads, T, head_dim]`` (hqq's ``W.reshape(64, -1)``, reduced over dim 0: 64 elements strided by
``numel / 64``, mixing heads, tokens and, unless 64 divides ``heads * T``, channels), and regroups all of it at every
flush: a token's stored value depends on the whole history, which a per-token cache cannot hold.

hqq's bit packing (``BitPack.pack_4bit_u8``, ``pack_2bit_u8``) splits the rows of the reshaped tensor into
``8 / nbits`` equal parts; with axis 1 that needs ``batch * heads * T * head_dim / 64`` divisible by 2 (4 bits)
or 4 (2 bits) at every quantizing call, or transformers' cache fails on its first read (on the builtin model,
3 KV heads: an even prompt for int4, a multiple of 4 for int2). ``run`` refuses such prompts up front.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kveval.errors import KvevalError
from kveval.parity import ParityRow, model_and_ids, parse_cache_type
from kveval.parity.hf_quanto import compare_types, decode_with
from kveval.policy import KVPolicy

SYSTEM = "hf_hqq"
DEFAULT_TYPES = ["int4/p4", "int4/p128", "int2/p4", "int2/p128"]
DEFAULT_TOKENS = 260
#: the ids start here in the builtin corpus (past its first lines)
DEFAULT_START = 1000
PRESETS = {4: "hf_hqq_int4", 2: "hf_hqq_int2"}
#: the axis the presets reproduce (``axis_key = axis_value``); ``:axis0`` in a cache type selects transformers' default
AXIS = 1
GROUP = 64
RESIDUAL = 128
VERSION = "transformers {transformers} QuantizedCache(backend='hqq', axis_key={axis}, axis_value={axis}), hqq {hqq}"


@dataclass(frozen=True)
class CacheType:
    """``int{nbits}/p{prompt}`` (optionally ``:axis0``): the cache's ``nbits``, the prompt length and the axis."""

    nbits: int
    prompt: int
    axis: int = AXIS

    @classmethod
    def parse(cls, text: str) -> CacheType:
        """``int4/p128`` -> CacheType(4, 128, 1); ``int2/p4:axis0`` -> CacheType(2, 4, 0)."""
        body, _, suffix = text.strip().partition(":")
        if suffix not in ("", "axis0", "axis1"):
            raise KvevalError(f"{SYSTEM} cache type '{text}': the suffix may be ':axis0' or ':axis1'; got ':{suffix}'")
        return cls(*parse_cache_type(body, SYSTEM, "int", PRESETS), axis=0 if suffix == "axis0" else AXIS)

    @property
    def label(self) -> str:
        return f"int{self.nbits}/p{self.prompt}" + ("" if self.axis == AXIS else f":axis{self.axis}")


def versions(axis: int = AXIS) -> str:
    """The versions of transformers and hqq in use."""
    import hqq
    import transformers

    return VERSION.format(transformers=transformers.__version__, hqq=hqq.__version__, axis=axis)


def check_packable(batch: int, kv_heads: int, head_dim: int, ct: CacheType, n: int,
                   group: int = GROUP, residual: int = RESIDUAL) -> None:
    """KvevalError unless every quantizing call of ``ct``'s cache over ``n`` ids (at ``T = P, P + residual, ...``)
    has a number of hqq rows (``batch * kv_heads * T * head_dim / group`` with axis 1; ``group`` with axis 0) that
    hqq's packing can split into ``8 / nbits`` equal parts (see the module docstring)."""
    parts = 8 // ct.nbits
    if ct.axis != 1 or parts == 1:
        return
    t = ct.prompt
    while t <= n:
        rows = batch * kv_heads * t * head_dim // group
        if rows % parts:
            raise KvevalError(f"{SYSTEM} cache type {ct.label}: hqq packs {ct.nbits}-bit codes {parts} rows to a byte, "
                              f"and a call quantizing {t} tokens has {rows} rows of {group} ({kv_heads} KV heads); "
                              f"transformers' cache would fail: pick a prompt that makes the rows a multiple of {parts}")
        t += residual


def reference_cache(model, nbits: int, axis: int = AXIS, **kwargs):
    """transformers' ``QuantizedCache(backend="hqq")`` for ``model`` with ``axis_key = axis_value = axis``
    (``kwargs``: q_group_size, residual_length; transformers' defaults otherwise)."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="hqq", config=model.config, nbits=nbits, axis_key=axis, axis_value=axis, **kwargs)


def reference_logits(model, ids: torch.Tensor, nbits: int, prompt: int, axis: int = AXIS, **kwargs) -> torch.Tensor:
    """Logits ``[T, vocab]`` of transformers' HQQ cache (``reference_cache``) on ``ids [T]``."""
    return decode_with(model, ids, reference_cache(model, nbits, axis, **kwargs), prompt)


def _kv_shape(model) -> tuple[int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(heads), int(head_dim)


def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int = DEFAULT_TOKENS,
        start: int = DEFAULT_START, policies: dict[int, KVPolicy] | None = None, model=None, ids=None,
        fp_baseline: str = "decode", timings: dict[str, float] | None = None) -> list[ParityRow]:
    """Per cache type (``int4/p4`` ...; default ``DEFAULT_TYPES``): transformers' HQQ cache against kveval's preset
    on ``tokens`` ids of the builtin corpus from ``start`` (see the module docstring). ``policies``: nbits -> the
    kveval policy to compare (default: the ``hf_hqq_int*`` presets). ``model``/``ids``: an already loaded model and
    ids ``[T]`` (then ``model_name`` only labels). The model runs in float32 unless given. ``fp_baseline``:
    ``"decode"`` (the same calls through ``DynamicCache``) or ``"pass"`` (kveval's one-pass logits: float32 path
    noise only, half the time). ``timings``: filled with wall seconds per step when given."""
    cts = [CacheType.parse(t) for t in (types or DEFAULT_TYPES)]
    clock = time.perf_counter()
    model, ids = model_and_ids(SYSTEM, model_name, model, ids, start, tokens)
    heads, head_dim = _kv_shape(model)
    for ct in cts:
        if ct.prompt >= ids.numel():
            raise KvevalError(f"{SYSTEM} cache type {ct.label}: the prompt must be shorter than the {ids.numel()} ids")
        check_packable(1, heads, head_dim, ct, ids.numel())
    return compare_types(SYSTEM, model, ids, cts, clock=clock, fp_baseline=fp_baseline, timings=timings,
                         reference=lambda ct: reference_logits(model, ids, ct.nbits, ct.prompt, ct.axis),
                         policy=lambda ct: (policies or {}).get(ct.nbits) or KVPolicy.preset(PRESETS[ct.nbits]),
                         version=lambda ct: versions(ct.axis))
