"""The unit a report is built of (:class:`Block`): the report (:mod:`kveval.report.render`) and the tasks'
reporting plug-ins (:mod:`kveval.report.sections`) make blocks; :mod:`kveval.report.document` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    """One unit of a report. ``kind``: ``"h"`` (``content`` the heading, ``level`` its depth), ``"p"`` (a
    paragraph), ``"ul"`` (a list of items), ``"table"`` (a DataFrame, with ``caption``), ``"img"`` (``(path
    relative to the report's folder, alt text)``, with ``caption``) or ``"code"`` (shell lines)."""

    kind: str  # "h" | "p" | "ul" | "table" | "img" | "code"
    content: object
    level: int = 2
    caption: str = ""


__all__ = ["Block"]
