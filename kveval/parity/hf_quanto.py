"""Parity with transformers' ``QuantizedCache(backend="quanto")``: kveval's ``hf_quanto_int4`` / ``hf_quanto_int2``
presets against the real cache (transformers 5.24, optimum-quanto 0.2.7) on the same model and token ids.

    rows = run("builtin:smollm2-135m", ["int4/p1", "int4/p128"], tokens=260)

A cache type is ``int{nbits}/p{P}``: ``nbits`` 4 or 2 (the cache's other arguments at transformers' defaults:
``q_group_size=64``, ``residual_length=128``, ``axis_key = axis_value = 0``), a prompt of ``P`` tokens in one call,
then one token per call up to ``tokens``.

What runs:

- **transformers** (``reference_logits``): ``QuantizedCache(backend="quanto", config=model.config, nbits=...)``
  handed to the model's forward, the prompt in one call, then one token per call; the logits of every call are
  kept (``[T, vocab]``). What it does (``cache_utils.py`` ``QuantizedLayer.update``, ``QuantoQuantizedLayer``): the
  first call quantizes its keys and values and returns the originals; a later call returns the dequantized states
  + the residual + the new token, and when the residual plus the new token reaches ``residual_length`` it
  re-quantizes all of that (old tokens dequantized and quantized again) and empties the residual. optimum-quanto
  (``MaxOptimizer``, ``quantize_weight`` with ``axis=0``, ``grouped.group``): contiguous groups of 64 along the
  flattened tensor, i.e. per token and head groups of 64 channels of head_dim; scale ``(max - min) / (2^b - 1)``
  and shift ``-min`` in the K/V dtype; codes ``clamp(round((x + shift) / scale), 0, 2^b - 1)``; ``x̂ = scale * q -
  shift``.
- **its baseline** (``ref_fp``): the same calls through transformers' ``DynamicCache``.
- **kveval**: the preset through ``kveval.patch.emulate`` over all ids in one pass with ``prefill_len = P``
  (``kv``), and the unquantized model in one pass (``kv_fp``).
- Scored: the decoded positions ``P .. T-2`` (the prompt's queries read the prompt in full precision on both
  sides).

What is not reproduced: transformers re-quantizes the already-quantized tokens at every flush; kveval quantizes
each token once. For these per-token groups the codes do not change (a group's min keeps code 0 and its max code
2^b - 1, so the new scale equals the old one up to rounding), only the scale and min are recomputed from
dequantized values, which moves them by a few ulps. ``tests/parity/test_hf_quanto.py`` measures what that leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kveval.errors import KvevalError
from kveval.parity import ParityRow, compare, model_and_ids, parse_cache_type
from kveval.policy import KVPolicy

SYSTEM = "hf_quanto"
DEFAULT_TYPES = ["int4/p1", "int4/p128", "int2/p1", "int2/p128"]
DEFAULT_TOKENS = 260
#: the ids start here in the builtin corpus (past its first lines)
DEFAULT_START = 1000
PRESETS = {4: "hf_quanto_int4", 2: "hf_quanto_int2"}
VERSION = "transformers {transformers} QuantizedCache(backend='quanto'), optimum-quanto {quanto}"


@dataclass(frozen=True)
class CacheType:
    """``int{nbits}/p{prompt}``: the cache's ``nbits`` and the prompt length."""

    nbits: int
    prompt: int

    @classmethod
    def parse(cls, text: str) -> CacheType:
        """``int4/p128`` -> CacheType(4, 128)."""
        return cls(*parse_cache_type(text, SYSTEM, "int", PRESETS))

    @property
    def label(self) -> str:
        return f"int{self.nbits}/p{self.prompt}"


def versions() -> str:
    """The versions of transformers and optimum-quanto in use."""
    import optimum.quanto
    import transformers

    return VERSION.format(transformers=transformers.__version__, quanto=optimum.quanto.__version__)


@torch.no_grad()
def decode_with(model, ids: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    """Logits ``[T, vocab]`` of ``ids [T]`` decoded through ``cache`` (any transformers Cache): the first ``prompt``
    ids in one call, then one id per call."""
    from kveval.patch.cache import cache_kwargs

    kw = cache_kwargs(model, cache)
    x = ids[None]
    out = [model(x[:, :prompt], use_cache=True, **kw).logits[0]]
    for t in range(prompt, x.shape[1]):
        out.append(model(x[:, t:t + 1], use_cache=True, **kw).logits[0])
    return torch.cat(out, dim=0)


def reference_cache(model, nbits: int, **kwargs):
    """transformers' ``QuantizedCache(backend="quanto")`` for ``model`` (``kwargs``: q_group_size, residual_length,
    axis_key, axis_value; transformers' defaults otherwise)."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=model.config, nbits=nbits, **kwargs)


def reference_logits(model, ids: torch.Tensor, nbits: int, prompt: int, **kwargs) -> torch.Tensor:
    """Logits ``[T, vocab]`` of transformers' quanto cache (``reference_cache``) on ``ids [T]``."""
    return decode_with(model, ids, reference_cache(model, nbits, **kwargs), prompt)


def fp_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits ``[T, vocab]`` of the same calls through transformers' ``DynamicCache`` (the system's baseline)."""
    from transformers import DynamicCache

    return decode_with(model, ids, DynamicCache(config=model.config), prompt)


@torch.no_grad()
def emulated_logits(model, ids: torch.Tensor, policy: KVPolicy, prompt: int) -> torch.Tensor:
    """kveval's logits ``[T, vocab]``: one pass under ``emulate(model, policy, prefill_len=prompt)``."""
    from kveval.patch import emulate

    with emulate(model, policy, prefill_len=prompt):
        return model(ids[None]).logits[0]


def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int = DEFAULT_TOKENS,
        start: int = DEFAULT_START, policies: dict[int, KVPolicy] | None = None, model=None, ids=None,
        fp_baseline: str = "decode", timings: dict[str, float] | None = None) -> list[ParityRow]:
    """Per cache type (``int4/p1`` ...; default ``DEFAULT_TYPES``): transformers' quanto cache against kveval's
    preset on ``tokens`` ids of the builtin corpus from ``start`` (see the module docstring). ``policies``: nbits ->
    the kveval policy to compare (default: the ``hf_quanto_int*`` presets). ``model``/``ids``: an already loaded
    model and ids ``[T]`` (then ``model_name`` only labels). The model runs in float32 unless given.
    ``fp_baseline``: ``"decode"`` (the same calls through ``DynamicCache``) or ``"pass"`` (kveval's one-pass logits:
    float32 path noise only, half the time). ``timings``: filled with wall seconds per step when given."""
    cts = [CacheType.parse(t) for t in (types or DEFAULT_TYPES)]
    clock = time.perf_counter()
    model, ids = model_and_ids(SYSTEM, model_name, model, ids, start, tokens)
    for ct in cts:
        if ct.prompt >= ids.numel():
            raise KvevalError(f"hf_quanto cache type {ct.label}: the prompt must be shorter than the {ids.numel()} ids")
    version = versions()
    return compare_types(SYSTEM, model, ids, cts, clock=clock, fp_baseline=fp_baseline, timings=timings,
                         reference=lambda ct: reference_logits(model, ids, ct.nbits, ct.prompt),
                         policy=lambda ct: (policies or {}).get(ct.nbits) or KVPolicy.preset(PRESETS[ct.nbits]),
                         version=lambda ct: version)


def compare_types(system: str, model, ids: torch.Tensor, cts: list, *, clock: float, fp_baseline: str,
                  timings: dict[str, float] | None, reference: Callable, policy: Callable,
                  version: Callable) -> list[ParityRow]:
    """One :class:`ParityRow` per cache type ``ct`` of ``cts`` (each with ``label`` and ``prompt``): transformers'
    cache (``reference(ct)``: logits ``[T, vocab]``) against kveval's ``policy(ct)`` under emulation, both against
    their own full-precision logits (``fp_baseline``: ``"decode"``, the same calls through DynamicCache, once per
    prompt length, or ``"pass"``, kveval's one pass); ``version(ct)`` opens the row's notes. ``timings`` (when
    given) gets the seconds since ``clock`` to the first pass (``load``), per type, and in all."""
    stamp = {"load": time.perf_counter() - clock}
    with torch.no_grad():
        kv_fp = model(ids[None]).logits[0]
    rows: list[ParityRow] = []
    ref_fp_by_prompt: dict[int, torch.Tensor] = {}
    for ct in cts:
        t0 = time.perf_counter()
        if ct.prompt not in ref_fp_by_prompt:
            ref_fp_by_prompt[ct.prompt] = fp_logits(model, ids, ct.prompt) if fp_baseline == "decode" else kv_fp
        t1 = time.perf_counter()
        ref = reference(ct)
        t2 = time.perf_counter()
        pol = policy(ct)
        kv = emulated_logits(model, ids, pol, ct.prompt)
        t3 = time.perf_counter()
        rows.append(compare(system, ct.label, pol.name, ids, ref_fp=ref_fp_by_prompt[ct.prompt].float(),
                            ref=ref.float(), kv_fp=kv_fp.float(), kv=kv.float(), start=ct.prompt,
                            notes=f"{version(ct)}; prompt {ct.prompt} then {ids.numel() - ct.prompt} single-token "
                                  f"calls; {model.dtype}; transformers {t2 - t1:.1f} s, kveval {t3 - t2:.2f} s"))
        stamp[ct.label] = t3 - t0
    if timings is not None:
        timings.update(stamp)
        timings["total"] = time.perf_counter() - clock
    return rows
