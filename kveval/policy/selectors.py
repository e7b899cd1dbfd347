"""The layer selector grammar of per-layer overrides (``layers: {"0-3": ..., "last 2": ...}``).

One selector is a comma-separated list of parts: ``5`` (negative counts from the end: ``-1`` is the last layer),
``0-3`` (inclusive), ``first N``, ``last N``, ``all``. ``check_syntax`` validates a selector without knowing the
model (config time); ``layers_of`` resolves it against a layer count (model time). Both go through ``_parts``, the
one parser of the grammar.

Worked: ``layers_of("0-1, last 2", 30) == [0, 1, 28, 29]``; ``layers_of("-1", 30) == [29]``.
"""

from __future__ import annotations

import re

from kveval.errors import KvevalError

_PART = re.compile(r"(?P<all>all)|(?P<edge>first|last)\s+(?P<n>\d+)|(?P<lo>\d+)\s*-\s*(?P<hi>\d+)|(?P<one>-?\d+)")
_HELP = "use an index, '0-3', '0,2,5', 'first N', 'last N' or 'all'"


def _parts(selector: str | int) -> list[re.Match]:
    """The parsed parts of a selector; KvevalError for a selector outside the grammar, a reversed range or a part
    that selects nothing (``last 0``)."""
    matches: list[re.Match] = []
    for part in str(selector).strip().lower().split(","):
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise KvevalError(f"layer selector '{selector}' is not understood; {_HELP}")
        if m["lo"] is not None and int(m["lo"]) > int(m["hi"]):
            raise KvevalError(f"layer range '{m[0]}' is reversed; write it as '{m['hi']}-{m['lo']}'")
        if m["edge"] is not None and int(m["n"]) == 0:
            raise KvevalError(f"layer selector '{m[0]}' selects no layer; N in '{m['edge']} N' is at least 1")
        matches.append(m)
    return matches


def check_syntax(selector: str | int) -> None:
    """KvevalError unless ``selector`` is in the grammar (the layer range is checked later, by ``layers_of``)."""
    _parts(selector)


def layers_of(selector: str | int, num_layers: int) -> list[int]:
    """Sorted layer indices named by ``selector`` in a model of ``num_layers`` layers; KvevalError for a layer
    outside ``0..num_layers-1``."""
    indices: list[int] = []
    for m in _parts(selector):
        if m["all"]:
            part = list(range(num_layers))
        elif m["edge"]:
            n = int(m["n"])
            part = list(range(min(n, num_layers))) if m["edge"] == "first" else \
                list(range(max(num_layers - n, 0), num_layers))
        elif m["lo"] is not None:
            part = list(range(int(m["lo"]), min(int(m["hi"]), num_layers) + 1))  # no list of 10^20 layers
            if int(m["hi"]) >= num_layers:
                part.append(int(m["hi"]))  # reported below as out of range
        else:
            i = int(m["one"])
            part = [i + num_layers if i < 0 else i]
        indices.extend(part)
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise KvevalError(f"layer selector '{selector}' names layer {bad[0]}, but the model has {num_layers} layers "
                          f"(0-{num_layers - 1})")
    return sorted(set(indices))


def layer_ranges(layers) -> str:
    """Layer indices as runs, the inverse of a selector's ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
