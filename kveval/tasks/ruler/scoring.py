"""RULER's two string-match scores of one generated answer against its references.

From NVIDIA/RULER ``scripts/eval/synthetic/constants.py`` (commit c3f5e3b), per sample (RULER averages them over
the samples of a task and reports percent):

* ``all`` (``string_match_all``): the share of the references that appear in the prediction, case-insensitive
  substring match. RULER scores every synthetic task with it (needles, variable tracking, common and frequent
  words extraction).
* ``any`` (``string_match_part``): 1 when at least one reference appears, else 0. RULER scores its QA tasks with
  it (they need datasets, which this suite does not download).

The prediction is first cleaned as RULER's ``scripts/eval/evaluate.py`` does (``postprocess_pred``): stripped,
control characters replaced by newlines, stripped again. Substring match is RULER's rule, with its leniency:
``"1234567"`` is found in ``"12345678"``, ``"art"`` in ``"start"``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's cleaning of a prediction: strip, control characters (``\\x00``-``\\x1f``) to newlines, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[bool]:
    if not references:
        raise ValueError("a RULER sample needs at least one reference")
    text = postprocess(prediction).lower()
    return [ref.lower() in text for ref in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """The share of ``references`` found in ``prediction`` (0..1; case-insensitive substrings)."""
    found = _found(prediction, references)
    return sum(found) / len(found)


def string_match_any(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is found in ``prediction``, else 0.0 (case-insensitive substrings)."""
    return 1.0 if any(_found(prediction, references)) else 0.0


METRICS = {"all": string_match_all, "any": string_match_any}
"""RULER's metric names (``string_match_all``, ``string_match_part``) as kveval names them."""


def score(prediction: str, references: Sequence[str], metric: str) -> float:
    """The score (0..1) of one sample by ``metric`` (``"all"`` or ``"any"``)."""
    return METRICS[metric](prediction, references)


__all__ = ["METRICS", "postprocess", "score", "string_match_all", "string_match_any"]
