"""``kveval parity SYSTEM``: run kveval's presets and the real system (or the reference implementation written
from its source) on the same token ids, per cache type; write ``parity.json``, ``parity.md`` and a figure of the
divergence by position into the output folder, and print the table."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError, did_you_mean
from kveval.fileio import atomic_write_json, atomic_write_text
from kveval.parity import SYSTEMS, ParityRow

ROTATION = {"on": True, "off": False, "both": None}
#: ``--tool``: which program of the system runs (``library``: the default, the system's library in process)
TOOLS = {"llamacpp": {"library": "kveval.parity.llamacpp", "perplexity": "kveval.parity.llama_perplexity"}}


def parity_options(layers: int | None = None, rotation: str | None = None, noise_floor: bool = False,
                   tool: str | None = None, ctx: int | None = None,
                   kl_divergence_base: str | None = None) -> dict[str, Any]:
    """The system options the command line gives (only those set): ``layers`` (a positive count), ``rotation``
    (``on``/``off``/``both`` -> True/False/None), ``noise_floor``, ``tool`` (``library``/``perplexity``), ``ctx``
    and ``kl_divergence_base`` (``--tool perplexity``)."""
    options: dict[str, Any] = {}
    if tool is not None:
        known = sorted({t for tools in TOOLS.values() for t in tools})
        if tool not in known:
            raise KvevalError(f"--tool must be one of {', '.join(known)}; got {tool!r}")
        options["tool"] = tool
    if ctx is not None:
        options["ctx"] = ctx
    if kl_divergence_base is not None:
        options["kl_divergence_base"] = kl_divergence_base
    if layers is not None:
        if layers <= 0:
            raise KvevalError(f"--layers must be a positive number of layers; got {layers}")
        options["layers"] = layers
    if rotation is not None:
        if rotation not in ROTATION:
            raise KvevalError(f"--rotation must be one of on, off, both; got {rotation!r}")
        options["rotation"] = ROTATION[rotation]
    if noise_floor:
        options["noise_floor"] = True
    return options


def parity_command(system: str, *, model: str = "builtin:smollm2-135m", types: list[str] | None = None,
                   tokens: int | None = None, out: str | None = None, options: dict[str, Any] | None = None) -> Path:
    """Run one system's parity; returns the output folder (default ``results/parity/<system>``)."""
    if system not in SYSTEMS:
        raise KvevalError(f"unknown system '{system}'{did_you_mean(system, SYSTEMS)} "
                          f"(known: {', '.join(sorted(SYSTEMS)) or 'none installed'})")
    options = dict(options or {})
    tool = options.pop("tool", None)
    tool = None if tool == "library" else tool
    if tool is not None and tool not in TOOLS.get(system, {}):
        raise KvevalError(f"the {system} parity has no --tool {tool} (only llamacpp takes --tool perplexity)")
    module = importlib.import_module(TOOLS[system][tool] if tool else SYSTEMS[system])
    accepted = inspect.signature(module.run).parameters
    unknown = sorted(k for k in options if k not in accepted)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        where = f"the {system} parity" + (f" with --tool {tool}" if tool else "")
        raise KvevalError(f"{where} does not take {flags}; drop it (llamacpp takes --layers, --rotation and "
                          "--noise-floor; with --tool perplexity --ctx and --kl-divergence-base instead of "
                          "--noise-floor)")
    kwargs: dict[str, Any] = {"model_name": model, **options}
    if types:
        kwargs["types"] = types
    if tokens is not None:
        if tokens < 2:
            raise KvevalError(f"--tokens must be at least 2; got {tokens}")
        kwargs["tokens"] = tokens
    folder = Path(out) if out else Path("results") / "parity" / (f"{system}_{tool}" if tool else system)
    if tool == "perplexity":
        return _tool_report(module, module.run(**kwargs), folder, model)
    rows: list[ParityRow] = module.run(**kwargs)
    data = [r.to_dict() for r in rows]

    from kveval.report.parity import by_position, markdown_table
    from kveval.report.plots import save

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "parity.json", {"system": system, "model": model, "rows": data})
    table = markdown_table(data)
    atomic_write_text(folder / "parity.md", f"# kveval parity {system} ({model})\n\n{table}\n")
    fig = by_position(data, system)
    if fig is not None:
        save(fig, folder / "plots" / f"parity_{system}.png")
    print(table)
    print(f"parity: {folder / 'parity.json'}")
    return folder


def _tool_report(module, rows: list, folder: Path, model: str) -> Path:
    """``kveval parity llamacpp --tool perplexity``: ``parity.json`` (every statistic of both sides per cache type),
    ``parity.md`` (the headline figures side by side, then each cache type's full llama-perplexity summary: the
    tool beside kveval) and the printed tables."""
    import pandas as pd

    from kveval.report.document import Block, to_markdown
    from kveval.report.tables import llama_stats_table

    def table(df) -> str:  # one table as report.md renders it, without the document's final newline
        return to_markdown([Block("table", df)]).removesuffix("\n")

    tool = module.TOOL
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "parity.json", {"system": module.SYSTEM, "tool": tool, "model": model,
                                               "rows": [r.to_dict() for r in rows]})
    head = table(pd.DataFrame(module.summary_rows(rows)))
    parts = [f"# kveval parity {module.SYSTEM} --tool perplexity ({model})", "", head]
    for r in rows:
        sides = {tool: r.system, "kveval": r.kveval} if r.system else {"kveval": r.kveval}
        parts += ["", f"## {r.cache_type} (kveval: {r.preset}; {r.tokens} scored tokens)", "", r.notes, ""]
        if r.command:
            parts += ["```", r.command, "```", ""]
        parts.append(table(llama_stats_table(sides)))
    atomic_write_text(folder / "parity.md", "\n".join(parts) + "\n")
    for r in rows:
        print(f"\n{r.cache_type} (kveval {r.preset}, {r.tokens} tokens)")
        print(table(llama_stats_table({tool: r.system, "kveval": r.kveval} if r.system else {"kveval": r.kveval})))
    print(f"parity: {folder / 'parity.json'}")
    return folder
