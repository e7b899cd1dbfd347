"""Hostile JSONL prompt files of the generation task (kveval/tasks/generation/prompts.py, ``load_jsonl``): each is
refused with one ``KvevalError`` line that names the file (and the line, where there is one) and what to do; a
FIFO is refused without being opened (opening one would block)."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from kveval.errors import KvevalError
from kveval.tasks.generation.prompts import MAX_LINES, Prompt, load_jsonl


def _refused(path, *needles: str) -> str:
    """load_jsonl(path) raises one KvevalError line holding every needle; returns the message."""
    with pytest.raises(KvevalError) as info:
        load_jsonl(str(path))
    message = str(info.value)
    assert "\n" not in message and message.strip() == message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _write(tmp_path, *lines: str, name: str = "p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_good_file(tmp_path):
    path = _write(tmp_path, '{"prompt": "What is 2+2?", "answer": 4, "checker": "last_number"}', "",
                  '{"prompt": "Capital of France?", "answer": "Paris", "id": "geo.1"}',
                  '{"prompt": "Tell me a story."}', '{"prompt": "Half?", "answer": 0.5, "checker": "boxed"}',
                  '{"prompt": "Tiny?", "answer": 1e-7, "checker": "numeric"}',
                  '{"prompt": "Digits?", "answer": "\\\\d+", "checker": "regex"}')
    assert load_jsonl(str(path)) == [
        Prompt(id="p-1", text="What is 2+2?", answer="4", checker="last_number"),
        Prompt(id="geo.1", text="Capital of France?", answer="Paris", checker="exact"),  # exact by default
        Prompt(id="p-4", text="Tell me a story."),  # open-ended; the blank line 2 still counts
        Prompt(id="p-5", text="Half?", answer="0.5", checker="boxed"),
        Prompt(id="p-6", text="Tiny?", answer="0.0000001", checker="numeric"),
        Prompt(id="p-7", text="Digits?", answer="\\d+", checker="regex"),
    ]


def test_a_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n')
    assert load_jsonl(str(path)) == [Prompt(id="p-1", text="hi")]


def test_missing_file(tmp_path):
    _refused(tmp_path / "nope.jsonl", "generation prompts file", "nope.jsonl", "does not exist", "check the path")


def test_folder(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    _refused(tmp_path / "d.jsonl", "d.jsonl", "is a folder", "give the path of a .jsonl file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_jsonl(str(fifo))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # it opened the FIFO: unblock it so the thread ends, then fail
        with open(fifo, "w"):
            pass
        pytest.fail("load_jsonl opened a FIFO and blocked")
    assert isinstance(outcome[0], KvevalError), outcome
    message = str(outcome[0])
    assert "f.jsonl" in message and "not a regular file" in message and "\n" not in message


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = _write(tmp_path, '{"prompt": "hi"}')
    path.chmod(0)
    try:
        _refused(path, "p.jsonl", "cannot be read", "permissions")
    finally:
        path.chmod(0o600)


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "caf\xe9"}\n')
    _refused(path, f"{path}:3:", "not UTF-8", "save the generation prompts file")


@pytest.mark.parametrize(("line", "needles"), [
    ("{not json}", ("not valid JSON", "one JSON object a line")),
    ('{"prompt": "a"', ("not valid JSON",)),
    ('["prompt", "a"]', ("the line is a list, not a JSON object",)),
    ('"just a string"', ("the line is a string, not a JSON object",)),
    ("null", ("the line is null, not a JSON object",)),
    ("[" * 100_000, ("nested too deeply",)),
    ('{"prompt": "a", "answer": 1' + "0" * 5000 + "}", ("number too long",)),
    ('{"answer": "4"}', ("no field 'prompt'", 'give each line a "prompt" string')),
    ('{"prompt": 5}', ("'prompt' is a number, not a string",)),
    ('{"prompt": null}', ("'prompt' is null, not a string",)),
    ('{"prompt": "  \\n\\t "}', ("the prompt is empty", "remove the line")),
    ('{"prompt": "a", "answer": true}', ("the answer is a boolean, not a string or a number",)),
    ('{"prompt": "a", "answer": [4]}', ("the answer is a list, not a string or a number",)),
    ('{"prompt": "a", "answer": {"x": 4}}', ("the answer is an object, not a string or a number",)),
    ('{"prompt": "a", "answer": NaN}', ("the answer nan is not a finite number",)),
    ('{"prompt": "a", "answer": " "}', ("the answer is empty",)),
    ('{"prompt": "a", "answer": null, "checker": "exact"}', ("checker 'exact' without an answer",)),
    ('{"prompt": "a", "checker": "numeric"}', ("checker 'numeric' without an answer",)),
    ('{"prompt": "a", "answer": "4", "checker": 3}', ("'checker' is a number, not a string",)),
    ('{"prompt": "a", "answer": "4", "checker": "numerc"}',
     ("unknown answer checker 'numerc'", "did you mean 'numeric'?")),
    ('{"prompt": "a", "answer": "(unclosed", "checker": "regex"}',
     ("'(unclosed'", "not a valid Python regular expression", "fix the pattern")),
    ('{"prompt": "a", "answer": "four", "checker": "last_number"}', ("'four' is not a number", "can never pass")),
    ('{"prompt": "a", "anwser": "4"}', ("unknown field 'anwser'", "did you mean 'answer'?")),
    ('{"prompt": "a", "id": "has space"}', ("the id 'has space'", "letters, digits", "such as 'q-17'")),
    ('{"prompt": "a", "id": "../../etc"}', ("the id '../../etc'",)),
    ('{"prompt": "a", "id": ""}', ("the id ''",)),
    ('{"prompt": "a", "id": "' + "x" * 65 + '"}', ("'xxxxxxxxxx", "...", "is not 1-64 characters",)),
    ('{"prompt": "a", "id": 7}', ("the id is a number, not a string",)),
])
def test_a_bad_line_is_named(tmp_path, line, needles):
    path = _write(tmp_path, '{"prompt": "fine", "answer": "1", "checker": "numeric"}', "", line)
    _refused(path, f"{path}:3:", *needles)


def test_duplicate_ids(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "id": "q1"}', '{"prompt": "b", "id": "q1"}')
    _refused(path, f"{path}:2:", "duplicate prompt id 'q1'", "give every prompt its own id")


def test_an_explicit_id_that_takes_a_default_one(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "id": "p-2"}', '{"prompt": "b"}')
    _refused(path, f"{path}:2:", "duplicate prompt id 'p-2'")


@pytest.mark.parametrize("text", ["", "\n\n  \n", "\ufeff"])
def test_a_file_without_prompts(tmp_path, text):
    path = tmp_path / "e.jsonl"
    path.write_text(text, encoding="utf-8")
    _refused(path, "e.jsonl", "holds no prompts", "one JSON object a line")


def test_too_many_lines(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text("\n" * MAX_LINES + '{"prompt": "x"}\n', encoding="utf-8")  # blank lines count as lines
    _refused(path, "big.jsonl", "more than 100,000 lines", f"line {MAX_LINES + 1}", "split it")


def test_the_line_limit_counts_prompt_lines(tmp_path, monkeypatch):
    from kveval.tasks.generation import prompts

    monkeypatch.setattr(prompts, "MAX_LINES", 50)
    path = tmp_path / "edge.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x", "id": f"q{i}"}) + "\n" for i in range(50)))
    assert len(load_jsonl(str(path))) == 50  # exactly the limit
    path.write_text('{"prompt": "x"}\n' * 51)
    _refused(path, "edge.jsonl", "more than 50 lines", "line 51")
