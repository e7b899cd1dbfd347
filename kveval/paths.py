"""Where kveval keeps its caches (converted models, tokenized corpora).

The root is ``$KVEVAL_CACHE`` when set, otherwise ``$XDG_CACHE_HOME/kveval``, otherwise ``~/.cache/kveval``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache root (or a sub-folder of it), created on demand."""
    root = os.environ.get("KVEVAL_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "kveval"
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
