"""Sizes in bytes and counts: reading ``80GiB`` and ``32k``, writing ``1.50 GiB`` (a foundation: no kveval import
but the error type).

    parse_size("80GiB") == 80 * 2**30        parse_size("24GB") == 24 * 10**9       parse_size(4096) == 4096
    parse_count("32k") == 32768              parse_count("128Ki") == 131072        parse_count("4096") == 4096
    format_bytes(3 * 2**29) == "1.50 GiB"     format_bytes(256) == "256 B"
"""

from __future__ import annotations

import math
import re

from kveval.errors import KvevalError

#: The largest size :func:`parse_size` takes (1 EiB): a bigger "GPU" or budget is a typo, and larger numbers
#: would only overflow the arithmetic that uses them.
MAX_SIZE = 2**60

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")
_HINT = "write e.g. 80GiB, 24GB, 512MiB or a number of bytes"


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"80GiB"`` (binary), ``"80GB"`` (decimal), ``"512MiB"``, ``"1.5 GiB"``, ``"4096"`` (bytes);
    bare ``G``/``M``/``K`` are binary. KvevalError (one line) for a malformed, zero, negative or non-finite size
    and for one above :data:`MAX_SIZE` (1 EiB)."""
    if isinstance(text, bool):
        raise KvevalError(f"bad memory size {text!r}; {_HINT}")
    if isinstance(text, (int, float)):
        value, unit = float(text) if isinstance(text, float) else text, ""
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise KvevalError(f"bad memory size {text!r}; {_HINT}")
        value, unit = float(m.group(1)), m.group(2).lower()
    if isinstance(value, float) and not math.isfinite(value):
        raise KvevalError(f"memory size {text!r} is not a finite size; {_HINT}")
    total = value * _UNITS[unit]
    if total > MAX_SIZE:
        raise KvevalError(f"memory size {text!r} is larger than any GPU or host memory (at most 1EiB)")
    n = int(total)
    if n <= 0:
        raise KvevalError(f"memory size must be positive; got {text!r}")
    return n


#: token and row counts: ``32k`` is 32,768 (as model cards write contexts: 128k = 131,072), ``1M`` is 2**20
_COUNT_UNITS = {"": 1, "k": 2**10, "ki": 2**10, "m": 2**20, "mi": 2**20}
#: the largest count :func:`parse_count` takes (2**40): a bigger context or batch is a typo
MAX_COUNT = 2**40


def parse_count(text: str | int, what: str = "count") -> int:
    """A positive whole count of tokens or rows: ``"32k"`` and ``"32Ki"`` (32,768), ``"1M"`` (1,048,576),
    ``"1.5k"`` (1,536), ``"4096"``; case-insensitive. KvevalError (one line, naming ``what``) for anything else: a
    malformed count, a unit that is not ``k``/``Ki``/``M``/``Mi``, a fraction of a token, zero or below, or more than
    :data:`MAX_COUNT`."""
    hint = f"{what}: write a whole number, or one with k/Ki (x1024) or M/Mi (x1048576), e.g. 32k"
    if isinstance(text, bool):
        raise KvevalError(f"bad {hint}")
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.fullmatch(str(text).removeprefix("-"))
        if not m or m.group(2).lower() not in _COUNT_UNITS:
            raise KvevalError(f"{what} {text} is not a count; {hint}")
        sign = -1.0 if str(text).startswith("-") else 1.0
        value, unit = sign * float(m.group(1)), m.group(2).lower()
    total = value * _COUNT_UNITS[unit]
    if not math.isfinite(total) or total > MAX_COUNT:
        raise KvevalError(f"{what} {text} is too large (at most {MAX_COUNT:,})")
    if total < 1:
        raise KvevalError(f"{what} {text}: must be at least 1")
    if total != int(total):
        raise KvevalError(f"{what} {text} is not a whole number ({total:g})")
    return int(total)


def format_bytes(n: float) -> str:
    """Binary units: ``format_bytes(3 * 2**29) == '1.50 GiB'``, ``format_bytes(256) == '256 B'``."""
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


__all__ = ["MAX_COUNT", "MAX_SIZE", "format_bytes", "parse_count", "parse_size"]
