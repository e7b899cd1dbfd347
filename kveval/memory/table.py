"""`kveval memory`: the memory bill as rows, a stable JSON document and a table; the fields a run adds to metrics.

    text = memory_command(shape="llama-7b-mha", context=2048, kv="fp16,int8,int4_g64", gpu_memory="80GiB")

JSON schema (``memory_json``; field names are a contract, bytes are integers, binary units)::

    {"arch": {"name", "layers", "kv_heads", "head_dim", "params", "weight_bytes_per_param",
              "weight_bytes" (only for quantized weights: their exact bytes, see ``Arch.with_quantized_weights``)},
     "context": L, "batch": B,
     "rows": [{"policy": NAME,
               "total": bytes, "codes": bytes, "scales": bytes (zero points included), "residual": bytes
                 (full-precision sinks, residual window and unquantized tensors),
               "bytes_per_token": total / (batch * context) (float),
               "saving_vs_fp16": 1 - total / FP16 total (float, 0.75 = four times smaller),
               "max_batch": int, or null without --gpu-memory,
               "blocks": batch * ceil(context / block_size)}]}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError
from kveval.memory import (
    DEFAULT_BLOCK_SIZE,
    FP16_BYTES,
    Arch,
    as_policy,
    format_bytes,
    fp16_bytes,
    kv_budget,
    kv_bytes,
    paging,
)
from kveval.policy import KVPolicy

DEFAULT_POLICIES = ("fp16", "int8", "int4_g64", "k4v8", "kivi2")

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"80GiB"`` (binary), ``"80GB"`` (decimal), ``"512MiB"``, ``"1.5 GiB"``, ``"4096"`` (bytes);
    bare ``G``/``M``/``K`` are binary. Zero, negative or malformed sizes raise KvevalError."""
    if isinstance(text, bool):
        raise KvevalError(f"bad memory size {text!r}; write e.g. 80GiB, 24GB, 512MiB or a number of bytes")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise KvevalError(f"bad memory size {text!r}; write e.g. 80GiB, 24GB, 512MiB or a number of bytes")
        value, unit = float(m.group(1)), m.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise KvevalError(f"memory size must be positive; got {text!r}")
    return n


def resolve_arch(model: str | None = None, shape: str | None = None, layers: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None) -> Arch:
    """The architecture from exactly one of: ``model`` (``builtin:...``, hub id, local folder or .gguf file; only
    the config is read, never the weights), ``shape`` (a named shape, see ``Arch.named``) or the three numbers."""
    explicit = [v is not None for v in (layers, kv_heads, head_dim)]
    given = [model is not None, shape is not None, any(explicit)]
    if sum(given) != 1:
        raise KvevalError("give exactly one of --model, --shape, or --layers --kv-heads --head-dim")
    if shape is not None:
        return Arch.named(shape)
    if any(explicit):
        if layers is None or kv_heads is None or head_dim is None:
            missing = [n for n, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim))
                       if v is None]
            raise KvevalError(f"an explicit shape needs --layers --kv-heads --head-dim; missing {' '.join(missing)}")
        return Arch(layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    return _arch_from_model(str(model))


def _arch_from_model(name: str) -> Arch:
    from dataclasses import replace

    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key == "smollm2-135m":
            return replace(Arch.named(key), name=name)  # known shape: no need to read the GGUF
        from kveval.models import tiny_model_config

        return Arch.from_model_config(tiny_model_config(name), name=name)
    from transformers import AutoConfig

    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            return Arch.from_model_config(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), name=name)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise KvevalError(f"model folder '{path}' has no config.json")
            return Arch.from_model_config(AutoConfig.from_pretrained(str(path)), name=name)
        if path.exists() or name.startswith(("/", "./", "../", "~")):
            raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
        from kveval.models import hub_guard

        with hub_guard() as offline:
            try:
                cfg = AutoConfig.from_pretrained(name)
            except (OSError, ValueError) as exc:
                if offline:
                    raise KvevalError(f"the config of {name!r} is not in the local HuggingFace cache and the hub "
                                      "cannot be reached; use --shape or --layers --kv-heads --head-dim") from None
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise KvevalError(f"the config of {name!r} could not be read: {first}") from None
        return Arch.from_model_config(cfg, name=name)
    except KvevalError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvevalError(f"the config of {name!r} could not be read: {first}") from None


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
        per_seq = bill.total if batch == 1 else kv_bytes(arch, pol, context, 1, fp_bytes).total
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
        })
    return rows


def memory_json(arch: Arch, policies: Any, context: int, batch: int = 1, gpu_memory: int | str | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, fp_bytes: int = FP16_BYTES, model_bytes: int | None = None,
                activation_bytes: int = 0) -> dict:
    """The ``kveval memory --json`` document (see the module docstring for the schema)."""
    rows = memory_rows(arch, policies, context, batch, gpu_memory, block_size, fp_bytes, model_bytes,
                       activation_bytes)
    return {"arch": arch.to_dict(), "context": context, "batch": batch, "rows": rows}


def render_table(rows: list[dict], title: str | None = None):
    """A rich Table: policy, bytes/token, total, saving vs FP16, scale overhead share, max batch, blocks."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("policy", "bytes/token", "total", "saving vs FP16", "scales share", "max batch", "blocks"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        share = r["scales"] / r["total"] if r["total"] else 0.0
        table.add_row(
            r["policy"],
            f"{r['bytes_per_token']:,.1f}",
            format_bytes(r["total"]),
            f"{100 * r['saving_vs_fp16']:.1f}%",
            f"{100 * share:.1f}%",
            "-" if r["max_batch"] is None else f"{r['max_batch']:,}",
            f"{r['blocks']:,}",
        )
    return table


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
        mb = int(kv_budget(arch, parse_size(gpu_memory), model_bytes, activation_bytes) // bill.total)
    return {
        "bytes_per_token": bill.bytes_per_token,
        "compression_vs_fp16": fp16_bytes(arch, context, 1) / bill.total,
        "max_batch": mb,
        "bits_per_element": bill.bits_per_element,
    }


__all__ = ["parse_size", "resolve_arch", "memory_rows", "memory_json", "render_table", "policy_memory_fields",
           "DEFAULT_POLICIES"]
