"""The one path of kveval's own lines on a console (errors, usage errors, warnings, progress log lines): a styled
prefix, then the message printed as text, never parsed as rich markup, on one line.

A message carries user text (a file name, a ``--grep`` word, a prompt's checker, an unknown command): parsed as
markup, ``[/]`` in it raised rich's MarkupError (a traceback instead of the error line) and ``[word]`` vanished
(``pip install 'kveval[sweep]'`` printed as ``pip install 'kveval'``). Control characters in it (a newline, a
carriage return, an escape sequence) are shown escaped, as Python writes them in a string (``\\n``, ``\\x1b``),
so that an error stays one line and a terminal never acts on them.

    print_error(console, exc)                    # error: <message>        (bold red prefix)
    print_warning(console, "perplexity: ...")    # warning: <message>      (yellow prefix)
    print_line(console, "calibration: reusing ...")
"""

from __future__ import annotations

import unicodedata

from rich.console import Console
from rich.text import Text

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: object) -> str:
    """``str(text)`` with every control or line-separating character escaped as Python writes it in a string
    (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``), so that it prints as one line and as what it holds."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif ch.isprintable() or unicodedata.category(ch) == "Zs":
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


def styled_line(prefix: str, style: str, message: object) -> Text:
    """``prefix`` in ``style``, a space, then ``message`` as plain text on one line (:func:`one_line`)."""
    return Text.assemble((prefix, style), " ", one_line(message))


def print_error(console: Console, message: object, prefix: str = "error:") -> None:
    """kveval's error line: ``error: <message>``, the message printed literally on one line."""
    console.print(styled_line(prefix, "bold red", message), highlight=False, soft_wrap=True)


def print_warning(console: Console, message: object, prefix: str = "warning:") -> None:
    """kveval's warning line: ``warning: <message>``, the message printed literally on one line."""
    console.print(styled_line(prefix, "yellow", message), highlight=False, soft_wrap=True)


def print_line(console: Console, message: object) -> None:
    """A plain line of kveval's (a log or status line): printed literally, never as markup."""
    console.print(Text(str(message)), highlight=False)


__all__ = ["one_line", "print_error", "print_line", "print_warning", "styled_line"]
