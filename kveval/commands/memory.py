"""``kveval memory``: the memory bill of one or more policies for a model or a shape, as a table or JSON.

    text = memory_command(shape="llama-7b-mha", context=2048, kv="fp16,int8,int4_g64", gpu_memory="80GiB")
    text = memory_command(shape="llama-3.1-8b", context=32768, batch=[1, 16, 64], kv="fp16,int8", gpu="h100")

With one batch the JSON is :func:`kveval.memory.rows.memory_json`'s document (``decode`` in each row with
``--gpu``); with several, ``{"batches": [B, ...], "by_batch": [that document for each batch]}``.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace

from kveval.errors import KvevalError
from kveval.memory.arch import Arch
from kveval.memory.bill import DEFAULT_BLOCK_SIZE, fp16_bytes
from kveval.memory.rows import DEFAULT_POLICIES, memory_json
from kveval.units import format_bytes, parse_size


def resolve_arch(model: str | None = None, shape: str | None = None, layers: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None) -> Arch:
    """The architecture from exactly one of: ``model`` (``builtin:...``, hub id, local folder or .gguf file; only
    the config is read, never the weights: :func:`kveval.models.model_config`), ``shape`` (a named shape, see
    ``Arch.named``) or the three numbers."""
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
    name = str(model)
    if name == "builtin:smollm2-135m":
        return replace(Arch.named("smollm2-135m"), name=name)  # known shape: no need to read the GGUF
    from kveval.models import model_config

    return Arch.from_model_config(model_config(name), name=name)


DEFAULT_CONTEXT = 2048  # billed when neither --context nor the model names one


def own_context(model: str | None, shape: str | None) -> tuple[int, str]:
    """The context ``kveval memory`` bills when ``--context`` is not given, and the words that say where it comes
    from: the model's own (``max_position_embeddings`` of a named shape, a builtin, a local folder's or a hub
    id's config.json) as ``kveval run`` uses it, else :data:`DEFAULT_CONTEXT`."""
    own = None
    if shape is not None:
        from kveval.memory.shapes import NAMED_SHAPES

        entry = NAMED_SHAPES.get(shape)
        own = entry["config"].get("max_position_embeddings") if entry else None
    elif model is not None:
        from kveval.models.info import config_context_limit, context_limit_of

        own = context_limit_of(model)
        if own is None and not str(model).startswith("builtin:"):
            from kveval.models import model_config

            own = config_context_limit(model_config(str(model)))  # as kveval run reads it (model_context_limit)
    if own is None:
        return DEFAULT_CONTEXT, " (the default: the model names no context of its own; --context N for another)"
    from kveval.units import MAX_COUNT

    if own > MAX_COUNT:  # a config's number, not a context anyone serves: a bill of it would mislead
        raise KvevalError(f"the model's config names a context of {own:,} tokens (max_position_embeddings), more "
                          f"than kveval bills ({MAX_COUNT:,}); give --context N")
    return int(own), " (the model's own; --context N for another)"


def _fitting(arch: Arch, names) -> tuple[list[str], list[str]]:
    """(the policies of ``names`` that can be laid out on ``arch``, those that cannot)."""
    from kveval.memory.bill import as_policy
    from kveval.memory.fit import check_design, check_policy

    fit, left = [], []
    for name in names:
        try:
            check_policy(arch, as_policy(name))
            check_design(arch, as_policy(name))
            fit.append(name)
        except KvevalError:
            left.append(name)
    return fit, left


def shape_words(arch: Arch) -> str:
    """``32 layers x 8 KV heads x head_dim 128``, or for MLA ``61 layers, MLA latent 512 + RoPE 64``."""
    n_kv = len(arch.kv_layers)
    layers = f"{arch.layers} layers" if n_kv == arch.layers else f"{arch.layers} layers ({n_kv} with K/V)"
    if arch.mla is not None:
        return f"{layers}, MLA latent {arch.mla.kv_lora_rank} + RoPE {arch.mla.qk_rope_head_dim} per token"
    return f"{layers} x {arch.kv_heads} KV heads x head_dim {arch.head_dim}"


def render_table(rows: list[dict], title: str | None = None, batches: list[int] | None = None):
    """A rich Table: policy, bytes/token, total, saving vs FP16, scale overhead share, max batch, blocks (``total``
    and ``blocks`` may be lists, one per batch, printed ``a / b / c``)."""
    from rich.table import Table

    table = Table(title=title)
    per = f" (batch {_joined(batches, '{:,}')})" if batches and len(batches) > 1 else ""
    for col in ("policy", "bytes/token", f"total{per}", "saving vs FP16", "scales share", "max batch", f"blocks{per}"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        first_total = r["total"][0] if isinstance(r["total"], list) else r["total"]
        share = r["scales"] / first_total if first_total else 0.0
        table.add_row(
            r["policy"],
            _count(r["bytes_per_token"]),
            _joined(r["total"], format_bytes) if isinstance(r["total"], list) else format_bytes(r["total"]),
            f"{100 * r['saving_vs_fp16']:.1f}%",
            f"{100 * share:.1f}%",
            "-" if r["max_batch"] is None else f"{r['max_batch']:,}",
            _joined(r["blocks"], "{:,}") if isinstance(r["blocks"], list) else f"{r['blocks']:,}",
        )
    return table


def parse_batches(text: str) -> int | list[int]:
    """``--batch``: one count (``64``, ``1k``) or several separated by commas (``1,16,64``)."""
    from kveval.units import parse_count

    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 1 and not all(parts):
        raise KvevalError(f"--batch {text}: an empty entry; write counts separated by commas, e.g. 1,16,64")
    values = [parse_count(p, "--batch") for p in parts]
    return values[0] if len(values) == 1 else values


def memory_command(model: str | None = None, shape: str | None = None, layers: int | None = None,
                   kv_heads: int | None = None, head_dim: int | None = None, context: int | None = None,
                   batch: int | list[int] = 1, kv: str | list[str] | None = None, gpu_memory: str | int | None = None,
                   block_size: int = DEFAULT_BLOCK_SIZE, json_output: bool = False, gpu: str | None = None) -> str:
    """What ``kveval memory`` prints: the JSON document (``json_output``) or the rendered table with a heading.
    ``gpu``: add the decode roofline (:mod:`kveval.memory.roofline`) per policy at each batch and the context; a
    named GPU's memory is the max batch's unless ``gpu_memory`` is given. ``batch``: one, or several (the bill's
    totals and blocks per batch, the roofline's rows per policy and batch). ``context``: None bills the model's
    own context (:func:`own_context`, as ``kveval run`` defaults to it), and the heading says so."""
    context_said = ""
    if context is None:
        context, context_said = own_context(model, shape)
    batches = [batch] if isinstance(batch, int) else list(batch)
    roofline_gpu = None
    if gpu is not None:
        from kveval.memory.roofline import parse_gpu

        roofline_gpu = parse_gpu(gpu)
        if gpu_memory is None and roofline_gpu.memory is not None:
            gpu_memory = roofline_gpu.memory
    arch = resolve_arch(model=model, shape=shape, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    skipped: list[str] = []
    if kv is None:  # the default policies: those that cannot be laid out on this model are left out, and said so
        kv, skipped = _fitting(arch, DEFAULT_POLICIES)
    else:  # a policy asked for by name is billed only on a design it models (never vLLM's fp8_ds_mla on GQA)
        from kveval.memory.bill import as_policy
        from kveval.memory.fit import check_design

        for name in ([n.strip() for n in kv.split(",") if n.strip()] if isinstance(kv, str) else kv):
            check_design(arch, as_policy(name))
    docs = [memory_json(arch, kv, context, b, gpu_memory, block_size) for b in batches]
    if roofline_gpu is not None:
        from kveval.memory.roofline import decode_roofline

        for doc in docs:
            for row, name in zip(doc["rows"], _names(kv)):
                row["decode"] = decode_roofline(arch, name, context, doc["batch"], roofline_gpu)
            doc["gpu"] = {"name": roofline_gpu.name, "bandwidth_bytes_per_s": roofline_gpu.bandwidth,
                          "memory_bytes": roofline_gpu.memory, "source": roofline_gpu.source,
                          "model": "bandwidth roofline: tokens/s <= batch * bandwidth / (weights + batch * cache)"}
    if json_output:
        return json.dumps(docs[0] if len(docs) == 1 else {"batches": batches, "by_batch": docs}, indent=2)
    from rich.console import Console

    heading = f"{arch.name}: {shape_words(arch)}; context {context:,}{context_said}, batch {_joined(batches, '{:,}')}, FP16 " \
              f"cache {_joined([fp16_bytes(arch, context, b) for b in batches], format_bytes)}"
    if shape is not None:
        from kveval.memory.shapes import NAMED_SHAPES

        entry = NAMED_SHAPES[arch.name]
        heading += f"; values from {entry['source']} (checked: {entry['checked']})"
    layers_line = arch.describe_layers()
    if layers_line:
        heading += f"; {layers_line}"
    if arch.state is not None:
        heading += (f"; fixed state {_joined([b * arch.state_bytes() for b in batches], format_bytes)} (not in the "
                    "rows' totals)")
    if skipped:
        heading += f"; left out (they do not fit this model): {', '.join(skipped)}"
    if gpu_memory is not None:
        weights = arch.model_bytes
        heading += f"; GPU {format_bytes(parse_size(gpu_memory))}"
        heading += (f", weights {format_bytes(weights)}" if weights is not None else ", weights unknown (not counted)")
    buf = io.StringIO()
    console = Console(file=buf, width=max(100, len(heading)), color_system=None, force_terminal=False)
    console.print(heading, highlight=False, markup=False, soft_wrap=True)
    console.print(render_table([_rows_across(docs, i) for i in range(len(docs[0]["rows"]))], batches=batches))
    if gpu_memory is None:
        console.print("max batch: give --gpu-memory SIZE (80GiB) or --gpu NAME (h100) to size it", highlight=False,
                      markup=False, soft_wrap=True)
    if roofline_gpu is not None:
        console.print(render_roofline(docs, roofline_gpu), highlight=False, markup=False, soft_wrap=True)
    return buf.getvalue().rstrip() + "\n"


def _count(v: float) -> str:
    """``131,072`` for a whole number of bytes, ``27,904.5`` otherwise (never ``131,072.0``)."""
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.1f}"


def _joined(values: list, fmt) -> str:
    """``1 / 16 / 64``: each value formatted (``fmt``: a format string or a function)."""
    return " / ".join(fmt.format(v) if isinstance(fmt, str) else fmt(v) for v in values)


def _rows_across(docs: list[dict], i: int) -> dict:
    """Row ``i`` of the first batch's document, its ``total`` and ``blocks`` as the list over every batch."""
    row = dict(docs[0]["rows"][i])
    if len(docs) > 1:
        row["total"] = [d["rows"][i]["total"] for d in docs]
        row["blocks"] = [d["rows"][i]["blocks"] for d in docs]
    return row


def _names(kv) -> list:
    return [n.strip() for n in kv.split(",") if n.strip()] if isinstance(kv, str) else list(kv)


def render_roofline(docs: list[dict], gpu):
    """The decode roofline table (the rows of each batch's document, with ``decode``; a ``batch`` column when there
    are several) under a heading that says what the numbers are."""
    from rich.console import Group
    from rich.table import Table

    several = len(docs) > 1
    whose = "every sequence's cache" if several else f"the {docs[0]['batch']} sequence(s)' caches"
    heading = (f"Decode roofline on {gpu.name} ({gpu.bandwidth / 1e12:.3g} TB/s; {gpu.source}): a bound, not a "
               f"measurement. Each step reads the weights once and {whose}; tokens/s <= batch x bandwidth / bytes "
               "read.")
    table = Table()
    columns = ("batch",) * several + ("policy", "bytes read per step", "tokens/s ceiling", "vs FP16",
                                      "cache outweighs weights from batch")
    for col in columns:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for doc in docs:
        for r in doc["rows"]:
            d = r["decode"]
            table.add_row(*([f"{doc['batch']:,}"] if several else []), r["policy"], format_bytes(d["step_bytes"]),
                          f"{d['tokens_per_s']:,.0f}" + ("" if d["fits"] else " (does not fit)"),
                          f"{d['speedup_vs_fp16']:.2f}x",
                          "-" if d["cache_dominates_batch"] is None else f"{d['cache_dominates_batch']:,}")
        if several and doc is not docs[-1]:
            table.add_section()
    return Group(heading, table)
