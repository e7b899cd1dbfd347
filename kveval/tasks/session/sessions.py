"""Sessions: a system prompt, an optional document, and user turns with checkable answers (pure: no torch).

:func:`builtin_sessions` makes seeded procedural sessions: a document of facts (box codes, a meeting city) hidden in
corpus sentences of ``context_tokens`` tokens, then seven turns, each of a kind of :data:`TURN_KINDS`:

- ``retrieve_context``: a value stated in the document (a box's code; asked twice, of two boxes);
- ``remember_user`` / ``retrieve_user``: the user states a number, a later turn asks for it back;
- ``tool_call``: a JSON tool call whose argument comes from the document, checked by parsing, against the tool's
  JSON schema and for exact arguments;
- ``arithmetic``: the user's number plus a constant;
- ``recall_own``: the number the model itself answered in its first turn (its own history, read back);

and the system prompt's instruction that every answer ends with a fixed suffix (``persist``: instruction
persistence, scored on every turn apart from correctness).

:func:`load_sessions` reads the user's own sessions from a JSONL file, one session a line::

    {"id": "s1", "system": "...", "suffix": "Done.", "turns": [
        {"user": "...", "answer": "42", "checker": "number"},
        {"user": "...", "checker": "json_tool", "name": "get_weather", "arguments": {"city": "Paris"},
         "schema": {...}}]}

Checkers (:data:`CHECKERS`): ``number`` (the first integer of the answer), ``contains`` (the answer anywhere,
case-insensitive), ``exact`` (the whole answer, suffix and surrounding space aside), ``json_tool`` (the first JSON
object of the answer: parsed, valid under ``schema``, and ``{"name", "arguments"}`` exactly), ``own_number`` (the
number of the model's own answer of turn ``own_from``). Anything malformed is one line naming the file and line.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kveval.errors import KvevalError

TURN_KINDS = ("retrieve_context", "remember_user", "tool_call", "retrieve_user", "arithmetic", "recall_own")
CHECKERS = ("number", "contains", "exact", "json_tool", "own_number")
SESSION_FIELDS = ("id", "system", "suffix", "sentences", "context", "turns")
TURN_FIELDS = ("user", "prefix", "answer", "checker", "name", "arguments", "schema", "own_from", "kind")
#: the most sessions, turns per session and bytes of a session file kveval reads
MAX_SESSIONS, MAX_TURNS, MAX_FILE_BYTES = 10_000, 200, 64 * 2**20
#: where a document goes in the first user turn
DOCUMENT = "<<<KVEVAL-DOCUMENT>>>"
ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_INTEGER = re.compile(r"-?\d{1,18}")
#: the most characters of an answer searched for a JSON object (an answer is at most max_new_tokens tokens)
MAX_JSON_SCAN = 20_000

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
#: what the builtin system prompt asks of every answer: at most this many sentences
SENTENCES = 1
#: the most sentences a session may ask for
MAX_SENTENCES = 1000
COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Prague", "Dublin", "Oslo", "Warsaw")
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"], "additionalProperties": False}},
    "required": ["name", "arguments"],
}


@dataclass(frozen=True)
class Turn:
    """One user turn and how its answer is checked. ``answer``: the expected text (None for ``own_number``, whose
    answer is the model's own earlier one, and ``json_tool``, checked by ``name``/``arguments``); ``kind``: a
    builtin kind of :data:`TURN_KINDS`, or ``"jsonl"``. ``prefix``: the start of the assistant's answer, fed with
    the turn's ids (an assistant prefill, as ``continue_final_message`` and guided decoding start an answer);
    the checker reads the prefix and the generated text together."""

    user: str
    checker: str
    answer: str | None = None
    kind: str = "jsonl"
    prefix: str = ""
    name: str | None = None
    arguments: dict | None = None
    schema: dict | None = None
    own_from: int | None = None


@dataclass(frozen=True)
class Session:
    """A session: ``id`` (part of record keys), ``system`` prompt, the ``suffix`` every answer must end with and
    the most ``sentences`` it may have (instruction persistence; None: not checked), ``context`` (a document put
    before the first user turn's text; "" for none) and the turns."""

    id: str
    system: str
    turns: tuple[Turn, ...]
    suffix: str | None = None
    sentences: int | None = None
    context: str = ""
    meta: dict = field(default_factory=dict, compare=False)


# ---------------------------------------------------------------------------------------------------------------
# Builtin sessions
# ---------------------------------------------------------------------------------------------------------------
def builtin_sessions(n: int, filler: list[str], context_sentences: list[int], seed: int, *,
                     prefills: bool = True) -> list[Session]:
    """``n`` sessions per entry of ``context_sentences`` (each: how many corpus sentences of ``filler`` the
    document holds around its facts: the history depth), ids ``c<sentences>-<i>``, drawn from a generator seeded
    by ``seed``, the size and the index: the same arguments give the same sessions. ``prefills`` False: no turn
    opens its answer with a prefill (a chat model that answers the turns without them)."""
    out = []
    for size in context_sentences:
        for i in range(n):
            rng = random.Random(f"kveval-session/{seed}/{size}/{i}")
            session = _builtin_session(f"c{size}-{i}", rng, filler, size)
            if not prefills:
                session = replace(session, turns=tuple(replace(t, prefix="") for t in session.turns))
            out.append(session)
    return out


def _builtin_session(sid: str, rng: random.Random, filler: list[str], size: int) -> Session:
    colors = rng.sample(COLORS, 3)
    codes = [rng.randrange(1000, 10000) for _ in colors]
    city = rng.choice(CITIES)
    facts = [f"The {c} box holds the code {code}." for c, code in zip(colors, codes)]
    facts.append(f"The team meeting takes place in {city}.")
    body = [filler[(rng.randrange(len(filler)) + j) % len(filler)] for j in range(size)] if filler else []
    for fact in facts:  # each fact at a random place of the document
        body.insert(rng.randrange(len(body) + 1), fact)
    asked = rng.randrange(len(colors))
    other = (asked + 1) % len(colors)
    locker = rng.randrange(10, 90)
    desk, room = rng.sample([d for d in range(10, 90) if d != locker], 2)
    apples, bought = rng.randrange(2, 9), rng.randrange(2, 9)
    code = "The code is "
    turns = (
        Turn(f"{DOCUMENT}\n\nWhat code does the {colors[asked]} box hold?", "number", str(codes[asked]),
             kind="retrieve_context", prefix=code),
        Turn(f"My locker number is {locker}, my desk number is {desk} and my room number is {room}. What is my "
             "desk number?", "number", str(desk), kind="remember_user", prefix="It is "),
        Turn("Call the tool get_weather for the city where the team meeting takes place.", "json_tool",
             kind="tool_call", name="get_weather", arguments={"city": city}, schema=TOOL_SCHEMA,
             prefix='{"name": "get_weather", "arguments": {"city": "'),
        Turn(f"What code does the {colors[other]} box hold?", "number", str(codes[other]), kind="retrieve_context",
             prefix=code),
        Turn(f"I have {apples} apples and buy {bought} more. How many apples do I have now?", "number",
             str(apples + bought), kind="arithmetic", prefix=f"{apples} + {bought} = "),
        Turn("What was my locker number?", "number", str(locker), kind="retrieve_user",
             prefix="Your locker number is "),
        Turn("Which code did you give in your first answer?", "own_number", kind="recall_own", own_from=0,
             prefix="In my first answer I gave the code "),
    )
    return Session(id=sid, system=SYSTEM, turns=turns, sentences=SENTENCES, context=" ".join(body),
                   meta={"context_sentences": size})


# ---------------------------------------------------------------------------------------------------------------
# Checking an answer
# ---------------------------------------------------------------------------------------------------------------
def strip_suffix(text: str, suffix: str | None) -> str:
    """The answer without the session's suffix (and surrounding space)."""
    text = text.strip()
    if suffix and text.endswith(suffix):
        text = text[: -len(suffix)].strip()
    return text


def first_integer(text: str) -> int | None:
    """The first integer written in ``text`` (digits, optionally after a minus sign), None when there is none."""
    m = _INTEGER.search(text)
    return int(m.group()) if m else None


def first_json_object(text: str) -> Any:
    """The first balanced ``{...}`` of ``text`` that parses as JSON (scanning at most :data:`MAX_JSON_SCAN`
    characters; no regex), else None."""
    text = text[:MAX_JSON_SCAN]
    start = text.find("{")
    while start != -1:
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                escaped = not escaped and ch == "\\"
                if ch == '"' and not escaped:
                    in_string = False
                continue
            if ch == '"':
                in_string, escaped = True, False
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    try:
                        return json.loads(text[start:i + 1])
                    except ValueError:
                        break
        start = text.find("{", start + 1)
    return None


def check_tool_call(text: str, turn: Turn) -> dict[str, bool]:
    """``{"parsed", "schema", "exact"}``: the answer holds a JSON object; it is valid under the turn's schema (no
    schema: any object); it is exactly ``{"name": turn.name, "arguments": turn.arguments}``."""
    import jsonschema

    obj = first_json_object(text)
    parsed = isinstance(obj, dict)
    valid = parsed and (turn.schema is None or jsonschema.Draft202012Validator(turn.schema).is_valid(obj))
    exact = parsed and obj == {"name": turn.name, "arguments": turn.arguments}
    return {"parsed": parsed, "schema": bool(valid), "exact": bool(exact)}


def sentence_count(text: str) -> int:
    """Sentences of ``text``: runs of '.', '!' or '?' followed by a space or the end (no regex)."""
    n = 0
    for i, ch in enumerate(text):
        if ch in ".!?" and (i + 1 == len(text) or text[i + 1].isspace()):
            n += 1
    return n


def keeps_format(text: str, suffix: str | None, sentences: int | None) -> bool | None:
    """Whether an answer kept the system prompt's instruction: it ends with ``suffix``, and it ends a sentence and
    holds at most ``sentences`` of them (None: the session asks neither)."""
    if not suffix and sentences is None:
        return None
    body = text.strip()
    ok = True
    if suffix:
        ok = body.endswith(suffix)
    if sentences is not None:
        ok = ok and body[-1:] in (".", "!", "?") and sentence_count(body) <= sentences
    return ok


def score_turn(turn: Turn, text: str, own_answers: list[str], *, suffix: str | None = None,
               sentences: int | None = None) -> dict:
    """The scores of one answer, ``text`` being what the model generated after the turn's prefix: ``correct``
    (bool), ``persist`` (:func:`keeps_format` of the whole answer: prefix and text), ``tool``
    (:func:`check_tool_call` of the whole answer for a ``json_tool`` turn, whose prefix may open the JSON; else
    None), ``expected`` (what was checked against). The other checkers read the generated text alone (a prefix
    such as ``"7 + 3 = "`` holds numbers of its own). ``own_answers``: the generated texts of the conversation's
    earlier answers (whoever gave them: the history)."""
    body = strip_suffix(text, suffix)
    persist = keeps_format(turn.prefix + text, suffix, sentences)
    tool = None
    expected: str | None = turn.answer
    if turn.checker == "json_tool":
        tool = check_tool_call(strip_suffix(turn.prefix + text, suffix), turn)
        correct = tool["exact"]
        expected = json.dumps({"name": turn.name, "arguments": turn.arguments}, sort_keys=True)
    elif turn.checker == "own_number":
        earlier = own_answers[turn.own_from] if turn.own_from is not None and turn.own_from < len(own_answers) else ""
        own = first_integer(strip_suffix(earlier, suffix))
        expected = None if own is None else str(own)
        correct = own is not None and first_integer(body) == own
    elif turn.checker == "number":
        correct = first_integer(body) == int(turn.answer or "0")
    elif turn.checker == "contains":
        correct = (turn.answer or "").casefold() in body.casefold()
    else:  # exact
        correct = body == (turn.answer or "").strip()
    return {"correct": bool(correct), "persist": persist, "tool": tool, "expected": expected}


# ---------------------------------------------------------------------------------------------------------------
# The user's sessions (JSONL)
# ---------------------------------------------------------------------------------------------------------------
def read_user_file(path: str, what: str) -> bytes:
    """The bytes of a user's file (:func:`kveval.fileio.read_regular_bytes`: a folder, a FIFO or a device refused
    before it is read, so a FIFO cannot block), at most :data:`MAX_FILE_BYTES`; one line naming ``what`` and the
    path."""
    from kveval.fileio import read_regular_bytes

    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise KvevalError(f"{what} '{path}' is over {MAX_FILE_BYTES // 2**20} MiB; split it")
        return read_regular_bytes(path)
    except FileNotFoundError:
        raise KvevalError(f"{what} '{path}' does not exist; give the path of a .jsonl file") from None
    except IsADirectoryError:
        raise KvevalError(f"{what} '{path}' is a folder; give the path of a .jsonl file") from None
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise KvevalError(f"{what} '{path}' is a folder; give the path of a .jsonl file") from None
        if exc.errno == errno.EINVAL:
            raise KvevalError(f"{what} '{path}' is not a regular file (a FIFO or a device); give the path of a "
                              ".jsonl file") from None
        raise KvevalError(f"{what} '{path}' cannot be read ({exc.strerror or exc}); check the path") from None


def load_sessions(path: str) -> list[Session]:
    """The sessions of a JSONL file (see the module docstring); a :class:`KvevalError` line naming ``path:line``
    for anything malformed: not JSON, unknown or missing fields, no turns, an answer without a checker or a
    checker without what it checks, an invalid JSON schema, an ``own_from`` that is not an earlier turn, a
    duplicate id, no session at all."""
    what = "session file"
    raw = read_user_file(path, what)
    sessions: list[Session] = []
    seen: set[str] = set()
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        at = f"{path}:{lineno}:"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise KvevalError(f"{at} not UTF-8 text; save the {what} as UTF-8") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            raise KvevalError(f"{at} not a valid JSON line; write one JSON object a line") from None
        session = _session_of(obj, at, lineno)
        if session.id in seen:
            raise KvevalError(f"{at} the id {session.id!r} is used twice; give each session its own id")
        seen.add(session.id)
        sessions.append(session)
        if len(sessions) > MAX_SESSIONS:
            raise KvevalError(f"{at} more than {MAX_SESSIONS:,} sessions; split the file")
    if not sessions:
        raise KvevalError(f"{what} '{path}' holds no session; write one JSON object a line")
    return sessions


def _text_field(obj: dict, key: str, at: str, *, required: bool) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise KvevalError(f"{at} {key!r} is missing or not a string; give it as text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise KvevalError(f"{at} {key!r} holds a lone surrogate (not text); fix the file's escapes") from None
    return value


def _session_of(obj: Any, at: str, lineno: int) -> Session:
    if not isinstance(obj, dict):
        raise KvevalError(f"{at} the line is not a JSON object; write one session object a line")
    unknown = [k for k in obj if k not in SESSION_FIELDS]
    if unknown:
        raise KvevalError(f"{at} unknown field {str(unknown[0])[:40]!r}; a session's fields are "
                          f"{', '.join(SESSION_FIELDS)}")
    sid = obj.get("id", f"s-{lineno}")
    if not isinstance(sid, str) or not ID_PATTERN.fullmatch(sid):
        raise KvevalError(f"{at} the id is not 1-64 characters of letters, digits, '_', '.' and '-'")
    system = _text_field(obj, "system", at, required=False) or ""
    suffix = _text_field(obj, "suffix", at, required=False)
    sentences = obj.get("sentences")
    if sentences is not None and (type(sentences) is not int or not 1 <= sentences <= MAX_SENTENCES):
        raise KvevalError(f"{at} 'sentences' is not a whole number from 1 to {MAX_SENTENCES}")
    context = _text_field(obj, "context", at, required=False) or ""
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise KvevalError(f"{at} session {sid!r} has no turns; give \"turns\": a list of {{\"user\": ...}} objects")
    if len(turns) > MAX_TURNS:
        raise KvevalError(f"{at} session {sid!r} has more than {MAX_TURNS} turns; split it")
    return Session(id=sid, system=system, suffix=suffix or None, sentences=sentences, context=context,
                   turns=tuple(_turn_of(t, f"{at} turn {j}:", j) for j, t in enumerate(turns)))


def _turn_of(obj: Any, at: str, index: int) -> Turn:
    import jsonschema

    if not isinstance(obj, dict):
        raise KvevalError(f"{at} not a JSON object; write {{\"user\": ..., \"answer\": ..., \"checker\": ...}}")
    unknown = [k for k in obj if k not in TURN_FIELDS]
    if unknown:
        raise KvevalError(f"{at} unknown field {str(unknown[0])[:40]!r}; a turn's fields are {', '.join(TURN_FIELDS)}")
    user = _text_field(obj, "user", at, required=True)
    assert user is not None
    if not user.strip():
        raise KvevalError(f"{at} the user text is empty")
    prefix = _text_field(obj, "prefix", at, required=False) or ""
    checker = obj.get("checker")
    answer = obj.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is not None and not isinstance(answer, str):
        raise KvevalError(f"{at} 'answer' is not a string or a number")
    if checker is None:
        raise KvevalError(f"{at} no checker; every turn needs one of {', '.join(CHECKERS)}")
    if checker not in CHECKERS:
        raise KvevalError(f"{at} unknown checker {str(checker)[:40]!r}; the checkers are {', '.join(CHECKERS)}")
    if checker in ("number", "contains", "exact") and not (answer or "").strip():
        raise KvevalError(f"{at} checker {checker!r} needs an \"answer\"")
    if checker == "number" and first_integer(answer or "") is None:
        raise KvevalError(f"{at} the answer {answer!r} holds no integer, so checker 'number' can never pass")
    name, arguments, schema, own_from = obj.get("name"), obj.get("arguments"), obj.get("schema"), obj.get("own_from")
    if checker == "json_tool":
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise KvevalError(f"{at} checker 'json_tool' needs \"name\" (a string) and \"arguments\" (an object)")
        if schema is not None:
            if not isinstance(schema, dict):
                raise KvevalError(f"{at} 'schema' is not a JSON object")
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise KvevalError(f"{at} 'schema' is not a valid JSON schema ({str(exc.message)[:80]})") from None
    if checker == "own_number":
        if type(own_from) is not int or not 0 <= own_from < index:
            raise KvevalError(f"{at} checker 'own_number' needs \"own_from\": the index of an earlier turn")
    return Turn(user=user, checker=checker, answer=answer, name=name, arguments=arguments, schema=schema,
                own_from=own_from, prefix=prefix)


__all__ = ["CHECKERS", "DOCUMENT", "Session", "TURN_KINDS", "Turn", "builtin_sessions", "check_tool_call",
           "first_integer", "first_json_object", "keeps_format", "load_sessions", "read_user_file", "score_turn",
           "sentence_count", "strip_suffix"]
