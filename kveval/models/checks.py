"""Checks of what a model name, a model folder and loaded weights may be (one KvevalError line each), and the
dtype and device names kveval takes.

What is refused: a local folder whose weights are pickles only (``*.bin``, ``*.pt``: kveval loads safetensors,
never pickle), with no weights, with a config that does not parse, that needs its own Python code (``auto_map``)
without ``trust_remote_code``; a file that is not a GGUF model; weights that hold NaN or infinity (also after
casting to ``dtype``: float16 overflows at 65504).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from kveval.errors import KvevalError
from kveval.fileio import NOT_REGULAR, read_regular_bytes
from kveval.gguf import check_gguf
from kveval.models.hub import check_hub_model_cached
from kveval.models.source import model_source

#: the dtype names kveval takes (configs, ``load_model``)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("cpu", "cuda", "auto")
#: what transformers raises for a folder, checkpoint or cache entry it cannot load (CUDA out of memory is a
#: RuntimeError); each becomes one KvevalError line naming the model
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError, ImportError, IndexError,
               SafetensorError, StrictDataclassError)  # the last: a config class refusing a config.json's values
#: weight files that are pickles (never loaded: they can run code)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def resolve_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a name in :data:`DTYPES` (a torch dtype passes through); KvevalError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in DTYPES:
        raise KvevalError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def resolve_device(device: str) -> torch.device:
    """``cpu`` | ``cuda`` | ``cuda:N`` | ``auto`` (CUDA when available) as a torch device; KvevalError when CUDA
    is asked for and absent, or for an unknown name."""
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


def check_model_source(name: str, trust_remote_code: bool = False) -> None:
    """What can be said about a model name without loading it (``kveval validate``): an unknown builtin, a path that
    does not exist, a local folder's files (:func:`check_model_folder`), a file that is not GGUF, a hub id whose
    files are not cached when the hub cannot be reached (:func:`check_hub_model_cached`)."""
    source = model_source(name)
    if source.kind == "hub":
        check_hub_model_cached(name)
    elif source.kind == "folder" and source.path is not None:
        check_model_folder(source.path, trust_remote_code)
    elif source.kind == "gguf" and source.path is not None:
        check_gguf(source.path)


def check_model_folder(path: Path, trust_remote_code: bool = False) -> None:
    """A local model folder's files before transformers reads them: config.json is a JSON object, the weights are
    safetensors (pickle-only weights are refused, never loaded), and code it names (``auto_map``) is refused
    unless ``trust_remote_code``. One KvevalError line for each."""
    try:
        cfg = json.loads(read_regular_bytes(path / "config.json").decode("utf-8"))
    except OSError as e:
        if e.strerror == NOT_REGULAR:
            raise KvevalError(f"model folder '{path}': config.json is {NOT_REGULAR}; give a folder whose "
                              f"config.json is a file") from None
        raise KvevalError(f"model folder '{path}': config.json is not valid JSON ({type(e).__name__})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise KvevalError(f"model folder '{path}': config.json is not valid JSON ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise KvevalError(f"model folder '{path}': config.json is not a JSON object")
    if "auto_map" in cfg and not trust_remote_code:
        raise KvevalError(f"model folder '{path}' needs its own Python code (auto_map in config.json); kveval runs "
                          "it only with model.trust_remote_code: true and --allow-code")
    check_config_sizes(path, cfg)
    files = [p.name for p in path.iterdir() if p.is_file()]
    if "model.safetensors.index.json" in files and "model.safetensors" not in files:
        _check_index_shards(path)
        return
    if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES) or f.endswith(".bin.index.json"))
    if pickles:
        raise KvevalError(f"model folder '{path}' holds pickle weights only ({', '.join(pickles[:3])}); kveval never "
                          "loads pickles (they can run code): convert them to safetensors")
    raise KvevalError(f"model folder '{path}' has no weights (no *.safetensors file)")


#: config.json sizes that must be whole numbers above 0 when given (a head count of 0 divides by zero in
#: transformers and in kveval's shape reader)
_POSITIVE_SIZES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")


def check_config_sizes(path: Path, cfg: dict) -> None:
    """KvevalError naming the first of :data:`_POSITIVE_SIZES` (in config.json or its ``text_config``) that is
    given but is not a whole number above 0."""
    for where, part in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(part, dict):
            continue
        for key in _POSITIVE_SIZES:
            value = part.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KvevalError(f"model folder '{path}': config.json's {where}{key} is {str(value)[:40]}; it must "
                                  "be a whole number above 0")


def _check_index_shards(path: Path) -> None:
    """KvevalError unless the folder's ``model.safetensors.index.json`` is a weight index whose every shard is a
    file in the folder (what loading the model needs; the hub's cache is checked the same way by
    :func:`kveval.models.hub.check_hub_model_cached`)."""
    index = path / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        if not all(isinstance(s, str) for s in shards):
            raise TypeError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise KvevalError(f"model folder '{path}': model.safetensors.index.json is not a weight index (no "
                          "weight_map of shard file names)") from None
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise KvevalError(f"model folder '{path}': {len(missing)} of {len(shards)} weight shards named by "
                          f"model.safetensors.index.json are missing ({missing[0]} first); copy them into the folder")


def text_config(cfg):
    """The text model's config of a (possibly multimodal) transformers config (``get_text_config``), else itself."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters), for one-line errors."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if "trust_remote_code" in text:
        return ("it needs its own Python code (custom code / auto_map); kveval runs it only with "
                "model.trust_remote_code: true and --allow-code")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


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
