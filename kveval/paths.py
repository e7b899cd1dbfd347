"""Where kveval keeps its caches (converted models, tokenized corpora).

The root is ``$KVEVAL_CACHE`` when set, otherwise ``$XDG_CACHE_HOME/kveval``, otherwise ``~/.cache/kveval``.
A root that is a file, sits under a file or cannot be created is one :class:`KvevalError` line naming the
variable to fix, never an ``OSError`` from deep inside a load.
"""

from __future__ import annotations

import os
from pathlib import Path

from kveval.errors import KvevalError


def cache_root() -> Path:
    """The cache root (not created): ``$KVEVAL_CACHE``, else ``$XDG_CACHE_HOME/kveval``, else ``~/.cache/kveval``."""
    root = os.environ.get("KVEVAL_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kveval"


def _where() -> str:
    return "KVEVAL_CACHE" if os.environ.get("KVEVAL_CACHE") else "the cache folder (set KVEVAL_CACHE to move it)"


def check_cache_root() -> Path:
    """The cache root, or a KvevalError when it could not be used: a file in its place or among its parents, or
    a folder that is not writable. Creates nothing."""
    base = cache_root()
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise KvevalError(f"{_where()} '{base}': '{probe}' is a file, not a folder; point KVEVAL_CACHE at a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise KvevalError(f"{_where()} '{base}': '{probe}' is not writable; point KVEVAL_CACHE at a writable folder")
    return base


def cache_dir(*parts: str) -> Path:
    """The cache root (or a sub-folder of it), created on demand; KvevalError when it cannot be."""
    base = cache_root()
    path = base.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        check_cache_root()  # the clearer message when the root itself is the problem
        raise KvevalError(f"{_where()}: cannot create '{path}' ({exc.strerror or type(exc).__name__}); point "
                          "KVEVAL_CACHE at a writable folder") from None
    if not path.is_dir():  # pragma: no cover - mkdir(exist_ok) raises for a file in the way
        raise KvevalError(f"{_where()}: '{path}' is not a folder; point KVEVAL_CACHE at a folder")
    return path
