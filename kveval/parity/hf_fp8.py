"""Parity with transformers' ``QuantizedCache(backend="fp8")``: kveval's ``hf_fp8`` preset against the real cache
(transformers 5.24 ``Fp8QuantizedLayer``, ``cache_utils.py`` L1009-1076) on the same model and token ids.

    rows = run("builtin:smollm2-135m", ["fp8/p128"], tokens=200)

A cache type is ``fp8/p{P}``: a prompt of ``P`` tokens in one call, then one token per call.

What transformers does: the first ``update`` of each layer takes per-tensor scales ``(|x|.amax().float() / 448)
.clamp(min=tiny)`` over the prompt's whole ``[batch, heads, P, head_dim]`` keys and, separately, values, quantizes
the prompt with them (``(x.float() / scale).to(float8_e4m3fn)``, a saturating cast on the CPU) and returns the
originals (the prompt reads full precision); every later call quantizes its token with the frozen scales,
appends it and returns the whole cache dequantized (``q.float() * scale``, cast to the K/V dtype): the token
reads itself quantized. No residual window.

What kveval runs: the ``hf_fp8`` preset (``fp8_e4m3_tensor``, ``prefill: fp``, residual 0) with its scales
calibrated on exactly the prompt (``prompt_scales``: the per-layer absmax of the prompt's post-RoPE keys and
values, written as a scales file; a run calibrates on the corpus tail instead, ``scales: auto``), through
``emulate`` over all ids with ``prefill_len = P``. The two compute the same numbers in float32:
``store(absmax / 448, float32)`` is transformers' scale and kveval's saturating cast is ``clamp(±448)`` then
the same E4M3 rounding (``tests/parity/test_hf_fp8.py`` measures what is left).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.parity import ParityRow, model_and_ids, parse_cache_type
from kveval.policy import KVPolicy

SYSTEM = "hf_fp8"
PRESET = "hf_fp8"
DEFAULT_TYPES = ["fp8/p2", "fp8/p128"]
DEFAULT_TOKENS = 200
DEFAULT_START = 1000


@dataclass(frozen=True)
class CacheType:
    prompt: int

    @classmethod
    def parse(cls, text: str) -> CacheType:
        """``fp8/p128`` -> CacheType(128)."""
        return cls(parse_cache_type(text, SYSTEM, "fp", (8,))[1])

    @property
    def label(self) -> str:
        return f"fp8/p{self.prompt}"


def versions() -> str:
    import transformers

    return f"transformers {transformers.__version__} QuantizedCache(backend='fp8')"


def reference_cache(model):
    """transformers' ``QuantizedCache(backend="fp8")`` for ``model``."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="fp8", config=model.config)


@torch.no_grad()
def prompt_scales(model, ids: torch.Tensor, prompt: int, path: str | Path, name: str) -> Path:
    """A scales file holding, per layer, the absmax of the prompt's keys and values (``ids[:prompt]``, post-RoPE,
    as the cache sees them): the scales transformers' fp8 cache takes from its first call."""
    from kveval.calibration.collect import collect_kv
    from kveval.models import model_info
    from kveval.scales.file import save_scales
    from kveval.scales.ranges import STATIC_GRANULARITIES, calibrate_ranges

    with collect_kv(model) as kv:
        model(ids[None, :prompt])
    info = model_info(model)
    ranges = {(kind, gran): [calibrate_ranges(kv.samples(i)[kind], gran) for i in range(info["num_layers"])]
              for kind in ("key", "value") for gran in STATIC_GRANULARITIES}
    header = {"model": name, "layers": info["num_layers"], "kv_heads": info["num_kv_heads"],
              "head_dim": info["head_dim"], "method": "absmax", "corpus": None,
              "note": f"the first {prompt} ids: transformers' fp8 cache scales"}
    return save_scales(path, ranges, header)


def prompt_policy(model, ids: torch.Tensor, prompt: int, folder: str | Path, policy: KVPolicy | None = None) -> KVPolicy:
    """``hf_fp8`` (or ``policy``) with the scales of the prompt (``prompt_scales``) written into ``folder``."""
    from kveval.models import model_info

    base = policy or KVPolicy.preset(PRESET)
    name = model_info(model)["name"]
    path = prompt_scales(model, ids, prompt, Path(folder) / f"hf_fp8_p{prompt}.safetensors", name)
    return replace(base, scales=str(path))


def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int = DEFAULT_TOKENS,
        start: int = DEFAULT_START, model=None, ids=None, fp_baseline: str = "decode",
        timings: dict[str, float] | None = None, path: str = "cache") -> list[ParityRow]:
    """Per cache type (``fp8/p2`` ...; default ``DEFAULT_TYPES``): transformers' fp8 cache against ``hf_fp8`` with
    the prompt's scales, on ``tokens`` ids of the builtin corpus from ``start`` (module docstring). ``path``:
    kveval's side decoded token by token through its real cache (``cache``, the calls transformers makes: float32
    agrees to the bit) or its one-pass emulation (``emulate``: float32 path noise, which FP8's many rounding
    boundaries turn into a KLD of a few percent of the cache's own on the builtin model)."""
    from kveval.parity import compare
    from kveval.parity.hf_quanto import decode_with, fp_logits
    from kveval.patch import QuantizedKVCache

    if path not in ("cache", "emulate"):
        raise KvevalError(f"hf_fp8 parity path must be cache or emulate; got {path!r}")
    cts = [CacheType.parse(t) for t in (types or DEFAULT_TYPES)]
    clock = time.perf_counter()
    model, ids = model_and_ids(SYSTEM, model_name, model, ids, start, tokens)
    for ct in cts:
        if not 2 <= ct.prompt < ids.numel():
            raise KvevalError(f"hf_fp8 cache type {ct.label}: the prompt needs at least 2 ids and fewer than the "
                              f"{ids.numel()} ids (kveval's cache reads a one-token first call quantized, "
                              "transformers in full precision)")
    version = versions()
    rows = []
    with torch.no_grad():
        kv_fp = model(ids[None]).logits[0].float()
    with tempfile.TemporaryDirectory(prefix="kveval-hf-fp8-") as tmp:
        for ct in cts:
            t0 = time.perf_counter()
            policy = prompt_policy(model, ids, ct.prompt, tmp)
            ref_fp = fp_logits(model, ids, ct.prompt).float() if fp_baseline == "decode" else kv_fp
            ref = decode_with(model, ids, reference_cache(model), ct.prompt).float()
            t1 = time.perf_counter()
            if path == "cache":
                kv = decode_with(model, ids, QuantizedKVCache(model, policy), ct.prompt).float()
            else:
                from kveval.parity.hf_quanto import emulated_logits

                kv = emulated_logits(model, ids, policy, ct.prompt).float()
            t2 = time.perf_counter()
            rows.append(compare(SYSTEM, ct.label, PRESET, ids, ref_fp=ref_fp, ref=ref, kv_fp=kv_fp, kv=kv,
                                start=ct.prompt,
                                notes=f"{version}; prompt {ct.prompt} then {ids.numel() - ct.prompt} single-token "
                                      f"calls; kveval {path}; {model.dtype}; scales from the prompt; transformers "
                                      f"{t1 - t0:.1f} s, kveval {t2 - t1:.1f} s"))
    if timings is not None:
        timings["total"] = time.perf_counter() - clock
    return rows
