"""Answer checkers of the generation task: does a decoded generation hold the expected answer?

Pure text functions (no model). ``check_answer(output, answer, checker)`` never raises, whatever the output (a
truncated ``\\boxed{``, a 10,000-digit number, a binary blob): a generation that cannot be read is a wrong answer.
``check_checker(checker, answer)`` is the input check (a config's or a JSONL file's), one ``KvevalError`` line.

The checkers (``CHECKERS``):

* ``exact``: the output's first non-empty line against the answer, both normalised (:func:`normalise_text`:
  whitespace collapsed, case folded, surrounding quotes / Markdown emphasis and trailing ``. ! ? , ; :`` removed).
  It passes when the normalised line equals the normalised answer, or when the line's first or last words are the
  answer's words (as many words as the answer has, each with its surrounding quotes and punctuation removed): a
  small model restates the question, so ``Paris.``, ``Paris is the capital of France.`` and ``The capital of France
  is "Paris".`` all answer ``paris``; ``I think Paris or Rome.`` does not, nor does anything on a later line. An
  empty answer never passes.
* ``numeric``: the FIRST number in the output equals the answer as a number.
* ``last_number``: the LAST number in the output equals the answer as a number (``3 + 4 = 7`` answers 7).
* ``boxed``: the content of the last ``\\boxed{...}`` (braces balanced; an unclosed one holds no answer) equals the
  answer: as numbers when both read as numbers (``\\frac{1}{2}``, ``1/2``, ``0.5`` are one number), else as text
  with spaces, ``$`` and ``\\left`` / ``\\right`` removed and ``\\dfrac`` / ``\\tfrac`` read as ``\\frac``.
* ``gsm8k``: the number right after the last ``####`` equals the answer (GSM8K's answer line, ``#### 1,234``).
* ``regex``: the answer, a Python regular expression, is found in the output (``re.search``; the answer IS the
  pattern; case-sensitive unless the pattern says ``(?i)``). It is matched by the ``regex`` module (``re``'s syntax)
  under a time bound, :data:`REGEX_TIMEOUT_S` per search: a pattern that backtracks without end (``(a|aa)+$``) is
  refused when the file is read if it is slow on a few probe texts (:func:`check_checker`), and at any output by
  :class:`RegexTimeout`, one line naming the prompt, never a hang.

Numbers: an optional ``-`` (not a hyphen after a word: ``3-4`` reads 3 and 4), digits with optional ``,``
thousands groups (``1,000``; ``1,2,3`` is three numbers) and an optional decimal part (``-0.5``, ``.5``); a ``$``
or ``%`` around them is ignored. Two numbers are equal within a relative tolerance of 1e-6 (absolute 1e-9 near 0),
except two whole numbers, which must be equal.
An answer that does not read as a number fails every numeric comparison (``check_checker`` does not refuse it).
"""

from __future__ import annotations

import functools
import math
import re

import regex as _regex

from kveval.errors import KvevalError, did_you_mean

CHECKERS: tuple[str, ...] = ("exact", "numeric", "regex", "last_number", "boxed", "gsm8k")

#: relative and absolute tolerance of a numeric comparison
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-9

_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_WRAPPERS = "\"'`*_“”‘’"
_TRAILING = ".!?,;:"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER.pattern + ")")
_FRACTION = re.compile(r"\\frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}|(-?[\d.,]+)/(-?[\d.,]+)")

#: seconds one search of a ``regex`` answer may take (a search of a generation takes microseconds; a pattern that
#: backtracks without end never returns)
REGEX_TIMEOUT_S = 1.0
#: texts a ``regex`` answer is searched in when the prompt file is read: runs of one kind of character ending in
#: another, where nested repetition (``(a|aa)+$``, ``(\d+)*x``) backtracks exponentially
_PROBES: tuple[str, ...] = tuple(c * 95 + end for c in ("a", "0", " ", ".") for end in ("!", "\n")) + ("ab" * 48,)


class RegexTimeout(KvevalError):
    """A ``regex`` answer whose search of one output took longer than :data:`REGEX_TIMEOUT_S`."""


def strip_thinking(text: str) -> str:
    """The answer part of a reasoning model's output: every ``<think>...</think>`` block removed; an unterminated
    ``<think>`` removes everything after it (the model never answered: ``""``); a ``</think>`` without its opening
    tag (templates that open the block in the prompt) removes everything before it. Whitespace stripped."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rpartition("</think>")[2]
    return text.partition("<think>")[0].strip()


def normalise_text(text: str) -> str:
    """Text as the ``exact`` checker compares it: whitespace collapsed to single spaces, case folded, quotes and
    Markdown emphasis (``" ' ` * _``) around it and trailing ``. ! ? , ; :`` removed (repeatedly)."""
    text = " ".join(text.split()).casefold()
    previous = None
    while text != previous:
        previous = text
        text = text.strip(_WRAPPERS).rstrip(_TRAILING).strip()
    return text


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is exactly one (``-1,234.5``, ``$12``, ``40%``, surrounding spaces allowed),
    else None. Non-finite values (a 400-digit number) are None."""
    text = text.strip().removeprefix("$").removesuffix("%").strip()
    return _to_float(text) if _NUMBER.fullmatch(text) else None


def numbers_in(text: str) -> list[float]:
    """Every number in ``text`` in reading order (see the module docstring; non-finite ones left out)."""
    values = (_to_float(m.group(0)) for m in _NUMBER.finditer(text))
    return [v for v in values if v is not None]


def same_number(a: float, b: float) -> bool:
    """``a == b`` within :data:`RELATIVE_TOLERANCE` (:data:`ABSOLUTE_TOLERANCE` near zero); two whole numbers must
    be equal (1,000,001 is not 1,000,000)."""
    if a.is_integer() and b.is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (``\\boxed {`` too) with balanced braces, or None when there is
    none or it is never closed (a truncated generation)."""
    start = text.rfind("\\boxed")
    while start >= 0:
        brace = start + len("\\boxed")
        while brace < len(text) and text[brace] == " ":
            brace += 1
        if brace < len(text) and text[brace] == "{":
            return _balanced(text, brace)
        start = text.rfind("\\boxed", 0, start)
    return None


def check_answer(output: str, answer: str, checker: str, *, prompt: str | None = None) -> bool:
    """Whether ``output`` (the decoded generation, thinking already stripped) holds ``answer`` by ``checker``
    (one of :data:`CHECKERS`; the module docstring says how each reads). False for an unknown checker or a
    pattern that does not compile (``check_checker`` refuses both up front). Never raises, but for a ``regex``
    answer whose search takes longer than :data:`REGEX_TIMEOUT_S`: :class:`RegexTimeout`, one line naming
    ``prompt`` (the prompt's id)."""
    try:
        return _CHECKS[checker](str(output), str(answer)) if checker in _CHECKS else False
    except TimeoutError:
        named = f"generation prompt {_short(prompt, 70)}: " if prompt is not None else ""
        raise RegexTimeout(f"{named}its answer regex {_short(answer)} took longer than {REGEX_TIMEOUT_S:g} s to "
                           f"search a {len(str(output)):,}-character output (nested repetition such as (.+)+ "
                           f"backtracks without end); simplify the pattern or use checker 'exact'") from None
    except (re.error, _regex.error, ValueError, OverflowError, RecursionError, MemoryError):
        return False


def check_checker(checker: str, answer: str) -> None:
    """Refuse, in one ``KvevalError`` line, an unknown ``checker`` (with a did-you-mean) or, for ``regex``, an
    ``answer`` that is not a regular expression Python compiles, or one whose search of a probe text (a run of one
    character, 96 characters) takes longer than :data:`REGEX_TIMEOUT_S`. Numeric answers are not checked here."""
    if checker not in CHECKERS:
        raise KvevalError(f"unknown answer checker {str(checker)[:64]!r}; the checkers are {', '.join(CHECKERS)}"
                          f"{did_you_mean(checker, CHECKERS)}")
    if checker == "regex":
        try:
            pattern = _compiled(answer)
        except (re.error, _regex.error, TypeError, ValueError, RecursionError, OverflowError) as exc:
            reason = " ".join(str(exc).split())
            raise KvevalError(f"the answer {_short(answer)} of checker 'regex' is not a valid Python regular "
                              f"expression ({reason}); fix the pattern or use checker 'exact'") from None
        for probe in _PROBES:
            try:
                pattern.search(probe, timeout=REGEX_TIMEOUT_S)
            except TimeoutError:
                raise KvevalError(f"the answer {_short(answer)} of checker 'regex' takes longer than "
                                  f"{REGEX_TIMEOUT_S:g} s to search the {len(probe)}-character text {_short(probe, 24)} "
                                  f"(nested repetition such as (a|aa)+ backtracks without end); simplify the pattern "
                                  f"or use checker 'exact'") from None
            except (_regex.error, ValueError, OverflowError, RecursionError, MemoryError):
                break


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_float(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _balanced(text: str, brace: int) -> str | None:
    """The text between ``text[brace] == "{"`` and its matching ``}``, or None when it never closes."""
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


def _check_exact(output: str, answer: str) -> bool:
    expected = normalise_text(answer)
    if not expected:
        return False
    first_line = next((line for line in output.splitlines() if line.strip()), "")
    got = normalise_text(first_line)
    if got == expected:
        return True
    words = [normalise_text(w) for w in expected.split()]
    line = [normalise_text(w) for w in got.split()]
    return line[: len(words)] == words or line[-len(words) :] == words


def _check_first_number(output: str, answer: str) -> bool:
    expected, found = parse_number(answer), numbers_in(output)
    return expected is not None and bool(found) and same_number(found[0], expected)


def _check_last_number(output: str, answer: str) -> bool:
    expected, found = parse_number(answer), numbers_in(output)
    return expected is not None and bool(found) and same_number(found[-1], expected)


def _check_gsm8k(output: str, answer: str) -> bool:
    expected = parse_number(answer)
    marker = output.rfind("####")
    if expected is None or marker < 0:
        return False
    match = _GSM8K_ANSWER.match(output, marker)
    value = _to_float(match.group(1)) if match else None
    return value is not None and same_number(value, expected)


def _latex_text(text: str) -> str:
    """Boxed content as text: no whitespace, ``$``, ``\\left``/``\\right``, ``\\!``/``\\,``; ``\\dfrac`` and
    ``\\tfrac`` as ``\\frac``; case kept (LaTeX is case-sensitive)."""
    text = "".join(text.split()).replace("$", "")
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac")):
        text = text.replace(old, new)
    return text


def _latex_number(text: str) -> float | None:
    """A number, or a fraction of two numbers (``\\frac{1}{2}``, ``-1/2``), else None."""
    value = parse_number(text)
    if value is not None:
        return value
    if text.startswith("-") and not text.startswith("--"):
        negated = _latex_number(text[1:])
        return None if negated is None else -negated
    match = _FRACTION.fullmatch(text)
    if match is None:
        return None
    top, bottom = (parse_number(g) for g in (match.groups()[:2] if match.group(1) else match.groups()[2:]))
    return None if top is None or not bottom else top / bottom


def _check_boxed(output: str, answer: str) -> bool:
    content = last_boxed(output)
    if content is None:
        return False
    got, expected = _latex_text(content), _latex_text(answer)
    got_value, expected_value = _latex_number(got), _latex_number(expected)
    if got_value is not None and expected_value is not None:
        return same_number(got_value, expected_value)
    return bool(expected) and got == expected


@functools.lru_cache(maxsize=256)
def _compiled(answer: str):
    """``answer`` compiled by the ``regex`` module, in ``re``'s syntax (VERSION0)."""
    if not isinstance(answer, str):
        raise TypeError(f"a pattern is a string, not {type(answer).__name__}")
    return _regex.compile(answer, _regex.VERSION0)


def _check_regex(output: str, answer: str) -> bool:
    return _compiled(answer).search(output, timeout=REGEX_TIMEOUT_S) is not None


_CHECKS = {"exact": _check_exact, "numeric": _check_first_number, "regex": _check_regex,
           "last_number": _check_last_number, "boxed": _check_boxed, "gsm8k": _check_gsm8k}
