"""The memory bill as rows: the stable JSON document of ``kveval memory`` and the memory fields a run adds to its
metrics (pure arithmetic; the table and the model lookup are the command's, ``kveval.commands.memory``).

    doc = memory_json(Arch.named("llama-7b-mha"), "fp16,int8,int4_g64", context=2048, gpu_memory="80GiB")

JSON schema (``memory_json``; field names are a contract, bytes are integers, binary units)::

    {"arch": {"name", "layers", "kv_heads", "head_dim", "params", "weight_bytes_per_param",
              "weight_bytes" (only for quantized weights: their exact bytes, see ``Arch.with_quantized_weights``)},
     "context": L, "batch": B,
     "rows": [{"policy": NAME,
               "total": bytes, "codes": bytes, "scales": bytes (zero points included), "residual": bytes
                 (full-precision sinks, residual window and unquantized tensors),
               "bytes_per_token": total / (batch * context) (float),
               "saving_vs_fp16": 1 - total / FP16 total (float, 0.75 = four times smaller),
               "max_batch": int, or null without --gpu-memory (a sequence needs its KV bytes plus "state"),
               "blocks": batch * ceil(context / block_size),
               "state": bytes of the fixed state of the batch's sequences in linear-attention / Mamba layers
                 (0 for a model without such layers; not in "total")}]}

An MLA model's rows count what its cache layout stores (``Arch.kv_shapes``: the latent unless the policy says
``mla: decompressed``); ``saving_vs_fp16`` compares with the FP16 latent cache, as engines store it.
"""

from __future__ import annotations

from typing import Any

from kveval.errors import KvevalError
from kveval.memory.arch import Arch
from kveval.memory.bill import (
    DEFAULT_BLOCK_SIZE,
    FP16_BYTES,
    as_policy,
    fp16_bytes,
    kv_budget,
    kv_bytes,
    paging,
)
from kveval.policy import KVPolicy
from kveval.units import parse_size

DEFAULT_POLICIES = ("fp16", "int8", "int4_g64", "k4v8", "kivi2")


def _policies(policies: Any) -> list[str | KVPolicy]:
    if policies is None:
        return list(DEFAULT_POLICIES)
    if isinstance(policies, (str, KVPolicy)):
        policies = [policies]
    out: list[str | KVPolicy] = []
    for p in policies:
        if isinstance(p, str):
            out.extend(x.strip() for x in p.split(",") if x.strip())
        else:
            out.append(p)
    if not out:
        raise KvevalError("no KV policy given; e.g. --kv fp16,int8,int4_g64")
    return out


def memory_rows(arch: Arch, policies: Any, context: int, batch: int = 1, gpu_memory: int | str | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, fp_bytes: int = FP16_BYTES, model_bytes: int | None = None,
                activation_bytes: int = 0) -> list[dict]:
    """One dict per policy (names or KVPolicy objects; ``"a,b"`` strings are split) with the JSON row fields."""
    fp16 = fp16_bytes(arch, context, batch)
    budget = None
    if gpu_memory is not None:
        budget = kv_budget(arch, parse_size(gpu_memory), model_bytes, activation_bytes)
    rows = []
    for p in _policies(policies):
        pol = as_policy(p)
        bill = kv_bytes(arch, pol, context, batch, fp_bytes)
        per_seq = bill.total_with_state if batch == 1 else kv_bytes(arch, pol, context, 1, fp_bytes).total_with_state
        rows.append({
            "policy": pol.name,
            "total": bill.total,
            "codes": bill.codes,
            "scales": bill.scales,
            "residual": bill.residual,
            "bytes_per_token": bill.bytes_per_token,
            "saving_vs_fp16": 1 - bill.total / fp16,
            "max_batch": None if budget is None else int(budget // per_seq),
            "blocks": paging(arch, pol, context, batch, block_size, fp_bytes).blocks,
            "state": bill.state,
        })
    return rows


def memory_json(arch: Arch, policies: Any, context: int, batch: int = 1, gpu_memory: int | str | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, fp_bytes: int = FP16_BYTES, model_bytes: int | None = None,
                activation_bytes: int = 0) -> dict:
    """The ``kveval memory --json`` document (see the module docstring for the schema)."""
    rows = memory_rows(arch, policies, context, batch, gpu_memory, block_size, fp_bytes, model_bytes,
                       activation_bytes)
    return {"arch": arch.to_dict(), "context": context, "batch": batch, "rows": rows}


def policy_memory_fields(arch: Arch, policy: KVPolicy | str, context: int, gpu_memory: int | str | None = None,
                         fp_bytes: int = FP16_BYTES, model_bytes: int | None = None,
                         activation_bytes: int = 0) -> dict:
    """The memory columns of one policy in ``metrics.json``: ``bytes_per_token`` (amortised over ``context``),
    ``compression_vs_fp16`` (FP16 bytes / policy bytes, 3.56 for INT4 g64 with fp16 scale + min),
    ``max_batch`` (None without ``gpu_memory``) and ``bits_per_element`` (scales and windows included).

    ``max_batch`` leaves room for the weights: ``model_bytes`` when given, else ``arch.model_bytes``, which is the
    exact size of quantized weights (codes + scales) for an arch made by ``Arch.with_quantized_weights``, so the
    same KV policy fits a larger batch beside INT4 weights than beside FP16 ones."""
    bill = kv_bytes(arch, policy, context, 1, fp_bytes)
    mb = None
    if gpu_memory is not None:
        mb = int(kv_budget(arch, parse_size(gpu_memory), model_bytes, activation_bytes) // bill.total_with_state)
    return {
        "bytes_per_token": bill.bytes_per_token,
        "compression_vs_fp16": fp16_bytes(arch, context, 1) / bill.total,
        "max_batch": mb,
        "bits_per_element": bill.bits_per_element,
    }


__all__ = ["memory_rows", "memory_json", "policy_memory_fields", "DEFAULT_POLICIES"]
