"""Hostile corpora: empty, binary, non-UTF-8, too short, JSONL/parquet text fields that are not strings. Each is
one line (naming the line or row where there is one), at `kveval validate` as at `kveval run`, and never the
text 'None' or '5' scored as if it were data."""

from __future__ import annotations

import os

import pytest

from kveval.data import load_text
from kveval.errors import KvevalError


def _run(h, tmp_path, source, *, text_field="text", command="run", **extra):
    raw = h.tiny_raw(tmp_path / "out", data={"source": str(source), "text_field": text_field}, **extra)
    return h.invoke(command, h.write_config(tmp_path / "c.yaml", raw))


def test_empty_corpus(h, tmp_path):
    (tmp_path / "e.txt").write_text("")
    h.assert_user_error(_run(h, tmp_path, tmp_path / "e.txt"), "holds no text")
    assert not (tmp_path / "out").exists()


def test_blank_corpus(h, tmp_path):
    (tmp_path / "e.txt").write_text("  \n\n\t \n")
    h.assert_user_error(_run(h, tmp_path, tmp_path / "e.txt", command="validate"), "holds no text")


def test_binary_corpus(h, tmp_path):
    (tmp_path / "b.txt").write_bytes(os.urandom(4096) + b"\0")
    h.assert_user_error(_run(h, tmp_path, tmp_path / "b.txt"), "binary")


def test_latin1_corpus(h, tmp_path):
    (tmp_path / "l.txt").write_bytes(("line\n" * 3 + "caf\xe9 au lait\n").encode("latin-1"))
    h.assert_user_error(_run(h, tmp_path, tmp_path / "l.txt"), "not UTF-8", "line 4")


def test_utf16_corpus(h, tmp_path):
    (tmp_path / "u.txt").write_bytes(("hello world " * 100).encode("utf-16"))
    h.assert_user_error(_run(h, tmp_path, tmp_path / "u.txt"), "UTF-16")


def test_corpus_shorter_than_one_window(h, tmp_path):
    (tmp_path / "s.txt").write_text("hi")
    h.assert_user_error(_run(h, tmp_path, tmp_path / "s.txt"), "fewer than one window")
    assert not (tmp_path / "out").exists()


def test_corpus_that_is_a_folder(h, tmp_path):
    (tmp_path / "d.txt").mkdir()
    h.assert_user_error(_run(h, tmp_path, tmp_path / "d.txt"), "is not a file")


def test_jsonl_null_text_names_the_line(h, tmp_path):
    (tmp_path / "j.jsonl").write_text('{"text": "hello world"}\n\n{"text": null}\n')
    h.assert_user_error(_run(h, tmp_path, tmp_path / "j.jsonl"), "j.jsonl:3", "null", "not a string")


def test_jsonl_number_text_names_the_line(h, tmp_path):
    (tmp_path / "j.jsonl").write_text('{"text": "hello world"}\n{"text": 5}\n')
    h.assert_user_error(_run(h, tmp_path, tmp_path / "j.jsonl"), "j.jsonl:2", "a number")


def test_jsonl_list_text(h, tmp_path):
    (tmp_path / "j.jsonl").write_text('{"body": ["a", "b"]}\n')
    h.assert_user_error(_run(h, tmp_path, tmp_path / "j.jsonl", text_field="body"), "j.jsonl:1", "a list")


def test_jsonl_not_utf8(h, tmp_path):
    (tmp_path / "j.jsonl").write_bytes('{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    h.assert_user_error(_run(h, tmp_path, tmp_path / "j.jsonl"), "not UTF-8", "line 2")


def test_jsonl_nested_too_deep(tmp_path):
    (tmp_path / "j.jsonl").write_text('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(KvevalError, match="j.jsonl:1"):
        load_text(str(tmp_path / "j.jsonl"))


def test_parquet_null_text_names_the_row(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"text": ["hello", None, "world"]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(KvevalError, match="row 1 of column 'text' is null"):
        load_text(str(tmp_path / "p.parquet"))


def test_parquet_number_column(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"text": [1, 2]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(KvevalError, match="row 0 of column 'text' is a number"):
        load_text(str(tmp_path / "p.parquet"))


def test_garbage_parquet(h, tmp_path):
    (tmp_path / "p.parquet").write_bytes(os.urandom(2000))
    h.assert_user_error(_run(h, tmp_path, tmp_path / "p.parquet", command="validate"), "cannot read parquet")


def test_needle_haystack_from_a_blank_corpus(h, tmp_path):
    (tmp_path / "e.txt").write_text(" \n")
    raw = h.tiny_raw(tmp_path / "out", data=str(tmp_path / "e.txt"),
                     tasks=[{"needle": {"variant": "needle", "context_lengths": [256], "depths": [0.5], "trials": 1}}])
    h.assert_user_error(h.invoke("run", h.write_config(tmp_path / "c.yaml", raw)), "holds no text")


def test_a_good_jsonl_corpus_still_runs(h, tmp_path):
    (tmp_path / "j.jsonl").write_text("".join(f'{{"text": "line {i} of a small corpus."}}\n' for i in range(40)))
    assert load_text(str(tmp_path / "j.jsonl")).startswith("line 0 of a small corpus.\n\nline 1")


def test_token_cache_with_a_changed_id_is_rebuilt(tmp_path, monkeypatch):
    """A cached id changed in place (same size, still in the vocabulary) is noticed and the corpus re-tokenized."""
    import numpy as np

    from kveval.data import load_tokens
    from kveval.models import byte_tokenizer

    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    tok = byte_tokenizer()
    ids = load_tokens(str(tmp_path / "c.txt"), tok)
    (npy,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    cached = np.load(npy)
    cached[len(cached) // 2] = 5  # a valid id, another byte
    np.save(npy, cached)
    assert load_tokens(str(tmp_path / "c.txt"), tok).tolist() == ids.tolist()
