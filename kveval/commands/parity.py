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


def parity_options(layers: int | None = None, rotation: str | None = None, noise_floor: bool = False) -> dict[str, Any]:
    """The system options the command line gives (only those set): ``layers`` (a positive count), ``rotation``
    (``on``/``off``/``both`` -> True/False/None), ``noise_floor``."""
    options: dict[str, Any] = {}
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
    module = importlib.import_module(SYSTEMS[system])
    accepted = inspect.signature(module.run).parameters
    unknown = sorted(k for k in (options or {}) if k not in accepted)
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        raise KvevalError(f"the {system} parity does not take {flags}; drop it (llamacpp takes --layers, --rotation "
                          "and --noise-floor)")
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
