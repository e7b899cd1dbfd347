"""Access to the HuggingFace hub: offline when the environment says so or the hub cannot be reached."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any
from urllib.parse import urlparse


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
