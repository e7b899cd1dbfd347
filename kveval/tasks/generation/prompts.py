"""The generation task's prompts: seeded procedural tasks with checkable answers, corpus continuations, or a
user's JSONL file.

Pure data (no model). ``builtin_prompts`` draws ``tasks_per_kind`` prompts of each kind of :data:`KINDS`, then one
open-ended prompt per corpus continuation text; ``load_jsonl`` reads a user's file, refusing anything it cannot
score with one ``KvevalError`` line naming the file and line.

The builtin kinds are ones the builtin model can do often but not always, so that a policy that damages the
model has accuracy to lose. Full-precision greedy accuracy of SmolLM2-135M-Instruct (``builtin:smollm2-135m``),
each prompt alone through its chat template, greedy ``generate`` up to 64 new tokens, checked with the kind's
checker, on 30 prompts per kind at seed 0 and 30 at seed 1 (measured with ``.venv/bin/python
scripts/generation_kind_accuracy.py 30 0`` and ``... 30 1``, transformers 5, CPU, float32):

* ``addition`` (``What is 4 + 8? Answer with a number.``, single digits, ``last_number``): 70% and 70%, 42/60;
* ``multiplication`` (``What is 7 times 6?``, 2-9, ``last_number``): 70% and 63%, 40/60;
* ``capital`` (``What is the capital of Spain? Answer with one word.``, 40 countries, ``exact``): 83% and 83%,
  50/60 (it says Istanbul for Turkey, Lagos for Nigeria);
* ``opposite`` (``What is the opposite of 'cold'? Answer with one word.``, 28 unambiguous pairs, ``exact``): 50%
  and 30%, 24/60.

Kinds measured and left out (seed 0, 20 prompts, batched): two-digit addition 25%, which of two numbers is
larger 35% (mostly by luck: it rambles), the day after a weekday 30% and the month after a month 35% (7 and 12
distinct questions only), repeating three words 20%, reversing three words 0% (first words only), counting a
word's letters 0%, the next number of an arithmetic sequence 0%. The model restates the question (``The capital
of Spain is Madrid.``, ``4 + 8 = 12``), which is why the checkers are ``last_number`` and ``exact`` on the first
or last words of the first line (kveval/tasks/generation/checkers.py).
"""

from __future__ import annotations

import decimal
import json
import os
import random
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass

from kveval.errors import KvevalError, did_you_mean
from kveval.fileio import open_regular
from kveval.tasks.generation.checkers import check_checker, parse_number

#: what a prompt id may hold (it is part of record keys)
ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
MAX_ID_LENGTH = 64
#: the most lines a JSONL prompt file may have
MAX_LINES = 100_000
#: checkers whose answer must read as a number (``load_jsonl`` refuses one that does not: it could never pass)
NUMERIC_CHECKERS = ("numeric", "last_number", "gsm8k")
FIELDS = ("prompt", "answer", "checker", "id")


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``id`` (stable, unique within a set, only ``[A-Za-z0-9_.-]``: it is part of record keys),
    ``text`` (what the model is asked; the chat template is the task's), ``answer`` and ``checker`` (None for an
    open-ended prompt, scored for fidelity only), ``kind`` (a builtin kind of :data:`KINDS`, ``"continuation"``
    or ``"jsonl"``)."""

    id: str
    text: str
    answer: str | None = None
    checker: str | None = None
    kind: str = "jsonl"


# ------------------------------------------------------------------------------------------- builtin kinds
# Each kind draws (text, answer, checker) from a seeded random.Random.

_CAPITALS = (("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
             ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
             ("Canada", "Ottawa"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"),
             ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
             ("England", "London"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"),
             ("Australia", "Canberra"), ("Turkey", "Ankara"), ("Switzerland", "Bern"), ("Nigeria", "Abuja"),
             ("Pakistan", "Islamabad"), ("Morocco", "Rabat"), ("New Zealand", "Wellington"), ("Vietnam", "Hanoi"),
             ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Finland", "Helsinki"),
             ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("South Korea", "Seoul"),
             ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Mexico", "Mexico City"), ("Scotland", "Edinburgh"))
_OPPOSITES = (("hot", "cold"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("day", "night"), ("wet", "dry"),
              ("full", "empty"), ("rich", "poor"), ("early", "late"), ("strong", "weak"), ("loud", "quiet"),
              ("true", "false"), ("black", "white"), ("north", "south"), ("east", "west"), ("push", "pull"),
              ("above", "below"), ("buy", "sell"), ("inside", "outside"), ("before", "after"), ("love", "hate"),
              ("increase", "decrease"), ("war", "peace"), ("wide", "narrow"), ("cheap", "expensive"),
              ("clean", "dirty"), ("win", "lose"), ("first", "last"))


def _addition(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}? Answer with a number.", str(a + b), "last_number"


def _multiplication(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} times {b}? Answer with a number.", str(a * b), "last_number"


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country, city = rng.choice(_CAPITALS)
    return f"What is the capital of {country}? Answer with one word.", city, "exact"


def _opposite(rng: random.Random) -> tuple[str, str, str]:
    word, opposite = rng.choice(_OPPOSITES)
    if rng.random() < 0.5:
        word, opposite = opposite, word
    return f"What is the opposite of '{word}'? Answer with one word.", opposite, "exact"


KINDS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "addition": _addition, "multiplication": _multiplication, "capital": _capital, "opposite": _opposite,
}


def builtin_prompts(tasks_per_kind: int, continuations: list[str], seed: int) -> list[Prompt]:
    """``tasks_per_kind`` prompts of every kind of :data:`KINDS` (ids ``<kind>-<i>``, drawn from a generator
    seeded by ``seed`` and the kind: the same seed gives the same prompts), then one open-ended prompt per text of
    ``continuations`` (id ``cont-<i>``, kind ``"continuation"``, no answer)."""
    out = []
    for kind, draw in KINDS.items():
        rng = random.Random(f"kveval-generation:{seed}:{kind}")
        for i in range(tasks_per_kind):
            text, answer, checker = draw(rng)
            out.append(Prompt(id=f"{kind}-{i}", text=text, answer=answer, checker=checker, kind=kind))
    out += [Prompt(id=f"cont-{i}", text=text, kind="continuation") for i, text in enumerate(continuations)]
    return out


# ------------------------------------------------------------------------------------------------- JSONL


def resolve_prompts_path(path: str) -> str:
    """A prompt file's path as a config names it: relative to the working directory, and a path under ``tasks/``
    that is not there from kveval's task definitions wherever kveval is installed (``tasks/generation/``: its
    example files), like an lm-eval ``include_path``."""
    from pathlib import Path

    from kveval.task_definitions import DEFINITIONS_DIR

    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or p.parts[:1] != ("tasks",):
        return str(p)
    shipped = DEFINITIONS_DIR.joinpath(*p.parts[1:])
    return str(shipped) if shipped.exists() else str(p)


def load_jsonl(path: str) -> list[Prompt]:
    """The prompts of a JSONL file: one JSON object a line, ``{"prompt": str, "answer"?: str | number,
    "checker"?: str, "id"?: str}``; blank lines skipped.

    A numeric answer becomes its decimal string (``3`` -> ``"3"``, ``0.5`` -> ``"0.5"``); ``checker`` defaults to
    ``"exact"`` when there is an answer; ``id`` defaults to ``p-<line number>`` (1-based). A prompt without an
    answer is open-ended (fidelity only). Anything else is refused with one ``KvevalError`` line naming the file
    and line: a path that is not a regular file (a FIFO or device is never opened) or cannot be read, text that is
    not UTF-8, a line that is not a JSON object, an unknown field, a missing, non-string or blank prompt, a prompt,
    answer or checker holding a lone surrogate (``"\\ud800"``: no character, a tokenizer cannot encode it), an answer
    that is not a string or a finite number (or is blank), a checker without an answer, an unknown checker, a
    ``regex`` answer that does not compile, a ``numeric`` / ``last_number`` / ``gsm8k`` answer that is not a
    number, an id that is not a string of 1-64 characters of ``[A-Za-z0-9_.-]``, a duplicate id, a file without
    prompts, more than :data:`MAX_LINES` lines. ``path`` is resolved by :func:`resolve_prompts_path`."""
    where = f"generation prompts file '{path}'"
    path = resolve_prompts_path(path)
    _check_regular_file(path, where)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    try:
        with open_regular(path) as handle:  # checked above; refused again if swapped for a FIFO since
            for lineno, raw in enumerate(handle, start=1):
                if lineno > MAX_LINES:
                    raise KvevalError(f"{where} has more than {MAX_LINES:,} lines (line {lineno}); split it into "
                                      f"smaller files")
                prompt = _read_line(raw, lineno, where, path)
                if prompt is None:
                    continue
                if prompt.id in seen:
                    raise KvevalError(f"{path}:{lineno}: duplicate prompt id {_short(prompt.id, 64)} in the {where}; give "
                                      f"every prompt its own id")
                seen.add(prompt.id)
                prompts.append(prompt)
    except OSError as exc:
        raise KvevalError(f"{where} cannot be read ({exc.strerror or type(exc).__name__}); check the path and its "
                          f"permissions") from None
    if not prompts:
        raise KvevalError(f"{where} holds no prompts; write one JSON object a line: "
                          '{"prompt": "...", "answer": "..."}')
    return prompts


def _check_regular_file(path: str, where: str) -> None:
    """Refuse a path that does not exist, cannot be stat'ed or is not a regular file, before opening it (opening
    a FIFO would block)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise KvevalError(f"{where} does not exist; check the path (or use prompts: builtin)") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise KvevalError(f"{where} cannot be read ({reason}); check the path and its permissions") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise KvevalError(f"{where} is {what}; give the path of a .jsonl file")


def _read_line(raw: bytes, lineno: int, where: str, path: str) -> Prompt | None:
    """One line as a Prompt, None for a blank line; a KvevalError naming ``path:lineno`` for anything else."""
    at = f"{path}:{lineno}:"
    if lineno == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KvevalError(f"{at} not UTF-8 text; save the {where} as UTF-8") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvevalError(f"{at} not valid JSON ({exc.msg}); write one JSON object a line") from None
    except (ValueError, RecursionError):
        raise KvevalError(f"{at} JSON that Python cannot read (nested too deeply or a number too long); write "
                          f"one flat JSON object a line") from None
    if not isinstance(obj, dict):
        raise KvevalError(f"{at} the line is {_json_kind(obj)}, not a JSON object; write "
                          '{"prompt": "...", "answer": "..."} on each line')
    return _prompt_of(obj, lineno, at)


def _prompt_of(obj: dict, lineno: int, at: str) -> Prompt:
    for key in obj:
        if key not in FIELDS:
            raise KvevalError(f"{at} unknown field {str(key)[:40]!r}; the fields are {', '.join(FIELDS)}"
                              f"{did_you_mean(key, FIELDS)}")
    text = obj.get("prompt")
    if not isinstance(text, str):
        what = "no field 'prompt'" if "prompt" not in obj else f"'prompt' is {_json_kind(text)}, not a string"
        raise KvevalError(f"{at} {what}; give each line a \"prompt\" string")
    if not text.strip():
        raise KvevalError(f"{at} the prompt is empty; give it some text or remove the line")
    for field in ("prompt", "answer", "checker"):
        _check_no_surrogates(obj.get(field), field, at)
    answer = _answer_of(obj.get("answer"), at)
    checker = obj.get("checker")
    if checker is not None and not isinstance(checker, str):
        raise KvevalError(f"{at} 'checker' is {_json_kind(checker)}, not a string; name one checker")
    if answer is None and checker is not None:
        raise KvevalError(f"{at} checker {_short(checker)} without an answer; add an \"answer\" or drop the checker "
                          f"(a prompt without an answer is scored for fidelity only)")
    if answer is not None:
        checker = checker or "exact"
        try:
            check_checker(checker, answer)
        except KvevalError as exc:
            raise KvevalError(f"{at} {exc}") from None
        if checker in NUMERIC_CHECKERS and parse_number(answer) is None:
            raise KvevalError(f"{at} the answer {_short(answer)} is not a number, so checker {checker!r} can never "
                              f"pass; give a number or use checker 'exact'")
    prompt_id = obj.get("id", f"p-{lineno}")
    if not isinstance(prompt_id, str):
        raise KvevalError(f"{at} the id is {_json_kind(prompt_id)}, not a string; give an id such as \"q-17\"")
    if not ID_PATTERN.fullmatch(prompt_id) or len(prompt_id) > MAX_ID_LENGTH:
        raise KvevalError(f"{at} the id {_short(prompt_id)} is not 1-{MAX_ID_LENGTH} characters of letters, "
                          f"digits, '_', '.' and '-'; give an id such as 'q-17'")
    return Prompt(id=prompt_id, text=text, answer=answer, checker=checker, kind="jsonl")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_no_surrogates(value: object, field: str, at: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape): Python reads it, but it is
    no character, so a tokenizer cannot encode it (and the run would fail at its first prompt)."""
    if isinstance(value, str) and (found := _SURROGATE.search(value)):
        raise KvevalError(f"{at} the {field} holds a lone surrogate (\\u{ord(found.group()):04x} at character "
                          f"{found.start() + 1}), which is not a character; write the text it stands for")


def _answer_of(value: object, at: str) -> str | None:
    """The answer as text: a string as is, a finite number as its decimal string, None for none; else refused."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise KvevalError(f"{at} the answer is empty; give the expected answer or drop the field")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvevalError(f"{at} the answer is {_json_kind(value)}, not a string or a number; give the expected "
                          f"answer as text")
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        raise KvevalError(f"{at} the answer {value} is not a finite number; give the expected answer as text")
    return format(decimal.Decimal(repr(value)).normalize(), "f") if isinstance(value, float) else str(value)


def _short(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to about ``limit`` characters (an error line stays short)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _json_kind(value: object) -> str:
    """How JSON names a value's type: ``null``, ``a boolean``, ``a number``, ``a list``, ``an object``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"
