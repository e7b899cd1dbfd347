"""``kveval parity SYSTEM``: run kveval's presets and the real system (or the reference implementation written
from its source) on the same token ids, per cache type; write ``parity.json``, ``parity.md`` and a figure of the
divergence by position into the output folder, and print the table."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError, did_you_mean
from kveval.fileio import atomic_write_json, atomic_write_text
from kveval.parity import SYSTEMS, ParityRow


def parity_command(system: str, *, model: str = "builtin:smollm2-135m", types: list[str] | None = None,
                   tokens: int | None = None, out: str | None = None, options: dict[str, Any] | None = None) -> Path:
    """Run one system's parity; returns the output folder (default ``results/parity/<system>``)."""
    if system not in SYSTEMS:
        raise KvevalError(f"unknown system '{system}'{did_you_mean(system, SYSTEMS)} "
                          f"(known: {', '.join(sorted(SYSTEMS)) or 'none installed'})")
    module = importlib.import_module(SYSTEMS[system])
    kwargs: dict[str, Any] = {"model_name": model, **(options or {})}
    if types:
        kwargs["types"] = types
    if tokens is not None:
        if tokens < 2:
            raise KvevalError(f"--tokens must be at least 2; got {tokens}")
        kwargs["tokens"] = tokens
    rows: list[ParityRow] = module.run(**kwargs)
    folder = Path(out) if out else Path("results") / "parity" / system
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
