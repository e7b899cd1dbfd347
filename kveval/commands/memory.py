"""``kveval memory``: the memory bill of one or more policies for a model or a shape, as a table or JSON."""

from __future__ import annotations

import json

from kveval.memory.bill import DEFAULT_BLOCK_SIZE, format_bytes, fp16_bytes
from kveval.memory.table import memory_json, parse_size, render_table, resolve_arch


def memory_command(model: str | None = None, shape: str | None = None, layers: int | None = None,
                   kv_heads: int | None = None, head_dim: int | None = None, context: int = 2048, batch: int = 1,
                   kv: str | list[str] | None = None, gpu_memory: str | int | None = None,
                   block_size: int = DEFAULT_BLOCK_SIZE, json_output: bool = False) -> str:
    """What ``kveval memory`` prints: the JSON document (``json_output``) or the rendered table with a heading."""
    arch = resolve_arch(model=model, shape=shape, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    doc = memory_json(arch, kv, context, batch, gpu_memory, block_size)
    if json_output:
        return json.dumps(doc, indent=2)
    import io

    from rich.console import Console

    heading = (f"{arch.name}: {arch.layers} layers x {arch.kv_heads} KV heads x head_dim {arch.head_dim}; "
               f"context {context:,}, batch {batch}, FP16 cache {format_bytes(fp16_bytes(arch, context, batch))}")
    if arch.sliding_layers:
        heading += (f"; sliding-window layers {', '.join(map(str, arch.sliding_layers))} hold "
                    f"min(context, {arch.sliding_window:,}) tokens")
    if gpu_memory is not None:
        weights = arch.model_bytes
        heading += f"; GPU {format_bytes(parse_size(gpu_memory))}"
        heading += (f", weights {format_bytes(weights)}" if weights is not None else ", weights unknown (not counted)")
    buf = io.StringIO()
    console = Console(file=buf, width=max(100, len(heading)), color_system=None, force_terminal=False)
    console.print(heading, highlight=False, markup=False, soft_wrap=True)
    console.print(render_table(doc["rows"]))
    return buf.getvalue().rstrip() + "\n"
