"""Parity with KIVI: kveval's ``kivi2`` / ``kivi4`` presets against a reference implementation of KIVI's cache on
the same model and token ids.

    rows = run("builtin:smollm2-135m", ["kivi2/p128"], tokens=260)

KIVI (jy-yuan/KIVI @876b4d2) needs CUDA (Triton and its ``kivi_gemv`` kernels) and a patched Llama class, so the
reference is ``tests/parity/kivi_reference.py``: a transformers ``Cache`` written from KIVI's
``models/llama_kivi.py`` (the schedule) and ``quant/new_pack.py`` / ``quant/csrc/gemv_cuda.cu`` (the arithmetic,
fp16 like KIVI's), independent of kveval. ``run`` loads it from the repository checkout (``reference=``: a module
or object with the same ``kivi_logits`` function, for an installed kveval).

A cache type is ``kivi{bits}/p{P}``: ``bits`` 2 or 4 for keys and values (KIVI's ``k_bits = v_bits``), group size
32 and residual length 128 (the paper's R; KIVI's ``example.py`` uses 32), a prompt of ``P`` tokens in one call
(KIVI's prefill), then one token per call up to ``tokens``.

- **KIVI** (``ref``): the reference cache through the model's own attention; **its baseline** (``ref_fp``):
  transformers' ``DynamicCache`` with the same calls.
- **kveval**: the preset through ``kveval.patch.emulate`` in one pass with ``prefill_len = P`` (``kv``), and the
  unquantized model in one pass (``kv_fp``).
- Scored: the decoded positions ``P .. T-2``.

What is left between the two: KIVI quantizes in fp16 (the K/V rounded to fp16, min, max, scale and ``(x - min) /
scale`` fp16 operations); kveval computes in float32 and rounds the scale and min to fp16. A value near a rounding
boundary can land on the neighbouring code. With ``quant_dtype=torch.float32`` in the reference and float32 scales
in the policy, the two caches give the same logits bit for bit (``tests/parity/test_kivi.py``).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.parity import ParityRow, compare, model_and_ids, parse_cache_type
from kveval.policy import KVPolicy

SYSTEM = "kivi"
KIVI_VERSION = "jy-yuan/KIVI @876b4d2 (reference implementation: tests/parity/kivi_reference.py)"
DEFAULT_TYPES = ["kivi2/p128", "kivi4/p128"]
DEFAULT_TOKENS = 260
DEFAULT_START = 1000
GROUP_SIZE = 32
RESIDUAL_LENGTH = 128
PRESETS = {2: "kivi2", 4: "kivi4"}
#: where the reference lives in a checkout of kveval
REFERENCE_PATH = Path(__file__).resolve().parents[2] / "tests" / "parity" / "kivi_reference.py"


@dataclass(frozen=True)
class CacheType:
    """``kivi{bits}/p{prompt}``."""

    bits: int
    prompt: int

    @classmethod
    def parse(cls, text: str) -> CacheType:
        return cls(*parse_cache_type(text, "kivi", "kivi", PRESETS))

    @property
    def label(self) -> str:
        return f"kivi{self.bits}/p{self.prompt}"


def load_reference(path: Path = REFERENCE_PATH) -> Any:
    """The reference module (``kivi_logits``, ``KiviCache``) from ``path``; KvevalError when it is not there."""
    if not path.is_file():
        raise KvevalError(f"the KIVI reference implementation is not at {path}; run from a kveval checkout or pass "
                          "reference=")
    spec = importlib.util.spec_from_file_location("kveval_kivi_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def _decode_fp(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    from transformers import DynamicCache

    from kveval.parity.hf_quanto import decode_with

    return decode_with(model, ids, DynamicCache(config=model.config), prompt)


def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int = DEFAULT_TOKENS,
        start: int = DEFAULT_START, policies: dict[int, KVPolicy] | None = None, model=None, ids=None,
        reference: Any = None, quant_dtype: torch.dtype = torch.float16, fp_baseline: str = "decode",
        timings: dict[str, float] | None = None) -> list[ParityRow]:
    """Per cache type (default ``DEFAULT_TYPES``): KIVI's cache (the reference) against kveval's preset on
    ``tokens`` ids of the builtin corpus from ``start``. ``policies``: bits -> the kveval policy (default: the
    ``kivi2``/``kivi4`` presets). ``model``/``ids``: an already loaded model and ids ``[T]``. ``quant_dtype``: the
    reference's quantizer arithmetic (KIVI's fp16 by default). ``fp_baseline``: ``"decode"`` (the same calls through
    ``DynamicCache``) or ``"pass"`` (kveval's one-pass logits; float32 path noise only, half the time)."""
    from kveval.parity.hf_quanto import emulated_logits

    cts = [CacheType.parse(t) for t in (types or DEFAULT_TYPES)]
    ref_module = reference or load_reference()
    clock = time.perf_counter()
    model, ids = model_and_ids(SYSTEM, model_name, model, ids, start, tokens)
    stamp = {"load": time.perf_counter() - clock}
    with torch.no_grad():
        kv_fp = model(ids[None]).logits[0]
    rows: list[ParityRow] = []
    ref_fps: dict[int, torch.Tensor] = {}
    for ct in cts:
        t0 = time.perf_counter()
        if ct.prompt not in ref_fps:
            ref_fps[ct.prompt] = _decode_fp(model, ids, ct.prompt) if fp_baseline == "decode" else kv_fp
        t1 = time.perf_counter()
        ref = ref_module.kivi_logits(model, ids, ct.prompt, bits=ct.bits, group_size=GROUP_SIZE,
                                     residual_length=RESIDUAL_LENGTH, quant_dtype=quant_dtype)
        t2 = time.perf_counter()
        policy = (policies or {}).get(ct.bits) or KVPolicy.preset(PRESETS[ct.bits])
        kv = emulated_logits(model, ids, policy, ct.prompt)
        t3 = time.perf_counter()
        rows.append(compare(SYSTEM, ct.label, policy.name, ids, ref_fp=ref_fps[ct.prompt].float(), ref=ref.float(),
                            kv_fp=kv_fp.float(), kv=kv.float(), start=ct.prompt,
                            notes=f"{KIVI_VERSION}; G {GROUP_SIZE}, R {RESIDUAL_LENGTH}, quantizer in {quant_dtype}; "
                                  f"prompt {ct.prompt} then {ids.numel() - ct.prompt} single-token calls; "
                                  f"{model.dtype}; reference {t2 - t1:.1f} s, kveval {t3 - t2:.2f} s"))
        stamp[ct.label] = t3 - t0
    if timings is not None:
        timings.update(stamp)
        timings["total"] = time.perf_counter() - clock
    return rows
