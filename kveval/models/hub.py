"""Access to the HuggingFace hub: offline when the environment says so or the hub cannot be reached."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any
from urllib.parse import urlparse

from kveval.errors import KvevalError


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


def is_connection_error(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, ConnectionError) or "connect" in text or "offline" in text


#: files that hold a tokenizer, any one of which AutoTokenizer can load from
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_hub_model_cached(name: str) -> None:
    """What ``kveval run`` will need of a hub model, checked without loading it (``kveval validate``): when the hub
    cannot be reached (or the environment says offline), the local HuggingFace cache must hold its config.json, a
    tokenizer file and its safetensors weights (every shard its index names). One KvevalError line naming what is
    missing and how to get it; nothing is checked when the hub can be reached (``kveval run`` downloads it)."""
    with hub_guard() as offline:
        if not offline:
            return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    def cached(filename: str) -> str | None:
        try:
            found = try_to_load_from_cache(name, filename)
        except ValueError:  # not a valid repo id
            return None
        return found if isinstance(found, str) else None

    fetch = f"download it where there is network (hf download {name}) into {HF_HUB_CACHE}, or name a local folder"
    if cached("config.json") is None:
        raise KvevalError(f"model {name!r} is not in the local HuggingFace cache and the hub cannot be reached: "
                          f"{fetch}")
    if not any(cached(f) for f in _TOKENIZER_FILES):
        raise KvevalError(f"model {name!r}: the local HuggingFace cache holds its config but no tokenizer file and "
                          f"the hub cannot be reached: {fetch}")
    if cached("model.safetensors") is not None:
        return
    index = cached("model.safetensors.index.json")
    if index is None:
        raise KvevalError(f"model {name!r}: the local HuggingFace cache holds no safetensors weights and the hub "
                          f"cannot be reached: {fetch}")
    try:
        from kveval.fileio import read_regular_bytes

        shards = sorted(set(json.loads(read_regular_bytes(index).decode("utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise KvevalError(f"model {name!r}: its cached model.safetensors.index.json is not a weight index; "
                          f"{fetch}") from None
    missing = [s for s in shards if not isinstance(s, str) or cached(s) is None]
    if missing:
        raise KvevalError(f"model {name!r}: {len(missing)} of {len(shards)} weight shards are not in the local "
                          f"HuggingFace cache ({missing[0]} first) and the hub cannot be reached: {fetch}")
