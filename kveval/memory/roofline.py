"""Decode throughput on paper: a bandwidth roofline of one decode step (pure arithmetic, no measurement).

Decoding is bound by memory bandwidth: each step reads every weight once (shared by the batch) and every
sequence's whole KV cache (scales and full-precision windows included) once. So one step of a batch of ``B``
sequences at context ``L`` reads

    step_bytes = weights as stored + B * cache_bytes(policy, L)

and no GPU of bandwidth ``W`` (bytes/s) decodes faster than ``B * W / step_bytes`` tokens per second. A smaller
cache raises that ceiling, more so the larger the batch: the cache dominates the step from the batch where
``B * cache_bytes >= weights``. The ceiling ignores compute, kernel efficiency (real decoding reaches a fraction
of peak bandwidth), activations, dequantization cost and the attention kernel's own reads; it is a bound, and
its ratio between policies is what a smaller cache can buy at best.

    row = decode_roofline(Arch.named("llama-3.1-8b"), "int8", context=32768, batch=16, gpu="h100")
    row["tokens_per_s"], row["speedup_vs_fp16"]

``gpu``: a name of :data:`GPUS` (peak memory bandwidth and memory from the vendor's datasheet, ``source``), or a
bandwidth such as ``3.35TB/s`` or ``2000GB/s`` (decimal units: datasheets quote TB/s = 10^12 bytes/s).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kveval.errors import KvevalError
from kveval.memory.arch import Arch
from kveval.memory.bill import as_policy, kv_bytes


@dataclass(frozen=True)
class Gpu:
    """A GPU's peak memory bandwidth (bytes/s), its memory (bytes) and where both come from."""

    name: str
    bandwidth: float
    memory: int | None
    source: str


#: peak HBM/GDDR bandwidth and memory of common inference GPUs, from NVIDIA's datasheets
GPUS: dict[str, Gpu] = {
    "h200": Gpu("H200 SXM 141GB", 4.8e12, 141 * 10**9, "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s, 141 GB HBM3e"),
    "h100": Gpu("H100 SXM 80GB", 3.35e12, 80 * 10**9, "NVIDIA H100 Tensor Core GPU datasheet (SXM): 3.35 TB/s, 80 GB"),
    "a100": Gpu("A100 SXM 80GB", 2.039e12, 80 * 10**9, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 2,039 GB/s"),
    "l40s": Gpu("L40S 48GB", 864e9, 48 * 10**9, "NVIDIA L40S datasheet: 864 GB/s, 48 GB GDDR6"),
    "rtx4090": Gpu("GeForce RTX 4090 24GB", 1008e9, 24 * 10**9, "NVIDIA GeForce RTX 4090 specifications: 1,008 GB/s, "
                   "24 GB GDDR6X"),
}

_BANDWIDTH = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kMGT]?)B/s", re.IGNORECASE)
_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_gpu(text: str) -> Gpu:
    """A GPU of :data:`GPUS` by name (any case), or a bandwidth ``3.35TB/s`` / ``2000GB/s`` (memory unknown).
    KvevalError (one line) for anything else."""
    key = str(text).strip().lower()
    if key in GPUS:
        return GPUS[key]
    m = _BANDWIDTH.fullmatch(str(text).strip())
    if m:
        bandwidth = float(m.group(1)) * _DECIMAL[m.group(2).lower()]
        if not math.isfinite(bandwidth) or bandwidth <= 0:
            raise KvevalError(f"--gpu {text}: the bandwidth must be a positive number of bytes per second")
        return Gpu(f"{text.strip()} (given)", bandwidth, None, "given on the command line")
    raise KvevalError(f"--gpu {text}: name one of {', '.join(GPUS)} or give a bandwidth such as 3.35TB/s")


def decode_roofline(arch: Arch, policy, context: int, batch: int, gpu: Gpu | str) -> dict:
    """One decode step of ``batch`` sequences at ``context`` tokens under ``policy`` on ``gpu``:
    ``step_bytes`` (weights as stored + the batch's caches), ``tokens_per_s`` (the bandwidth ceiling),
    ``speedup_vs_fp16`` (its ratio to the FP16 cache's ceiling at the same batch and context) and
    ``cache_dominates_batch`` (the smallest batch whose caches outweigh the weights), ``fits`` (weights and caches
    within the GPU's memory, activations aside; True when the memory is unknown). KvevalError when the model's
    weight bytes are unknown (an explicit shape without a parameter count)."""
    g = parse_gpu(gpu) if isinstance(gpu, str) else gpu
    weights = arch.model_bytes
    if weights is None:
        raise KvevalError("--gpu needs the model's weight bytes: name a model or a named shape (an explicit shape "
                          "has no parameter count)")
    per_seq = kv_bytes(arch, as_policy(policy), context, 1).total_with_state
    fp16_seq = kv_bytes(arch, "fp16", context, 1).total_with_state
    step = weights + batch * per_seq
    fp16_step = weights + batch * fp16_seq
    tokens = batch * g.bandwidth / step
    return {"step_bytes": int(step), "tokens_per_s": tokens, "speedup_vs_fp16": fp16_step / step,
            "cache_dominates_batch": max(1, math.ceil(weights / per_seq)) if per_seq else None,
            "fits": g.memory is None or step <= g.memory}


__all__ = ["GPUS", "Gpu", "decode_roofline", "parse_gpu"]
