from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import kveval.data as kd
from kveval.data import builtin_corpora, load_text, load_tokens, token_windows
from kveval.errors import KvevalError
from kveval.models import byte_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVEVAL_CACHE", str(root))
    return root


# ------------------------------------------------------------------ text


def test_builtin_text_deterministic():
    a, b = load_text("builtin"), load_text("builtin")
    assert a == b
    assert 300_000 < len(a) < 1_000_000
    assert "\n\n" in a and "assert" in a
    assert "builtin" in builtin_corpora() and "wikitext2" in builtin_corpora()


def test_txt(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello\n\nworld ü", encoding="utf-8")
    assert load_text(str(p)) == "hello\n\nworld ü"


def test_jsonl(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one", "two", "three"])) + "\n")
    assert load_text(str(p)) == "one\n\ntwo\n\nthree"
    q = tmp_path / "b.jsonl"
    q.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    assert load_text(str(q), text_field="body") == "x"
    with pytest.raises(KvevalError, match=r"'text'.*found: body, id"):
        load_text(str(q))


def test_parquet(tmp_path):
    p = tmp_path / "a.parquet"
    pd.DataFrame({"text": ["alpha", "beta"], "n": [1, 2]}).to_parquet(p)
    assert load_text(str(p)) == "alpha\n\nbeta"
    with pytest.raises(KvevalError, match=r"'content'.*found: text, n"):
        load_text(str(p), text_field="content")


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(KvevalError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"))
    with pytest.raises(KvevalError) as e:
        load_text("wikitext103")
    for name in builtin_corpora():
        assert name in str(e.value)


def test_wikitext2_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(KvevalError) as e:
        load_text("wikitext2")
    assert str(e.value) == ("dataset 'wikitext2' is not in the local HuggingFace cache and the hub cannot be "
                            "reached; use data: builtin or a local .txt/.jsonl/.parquet file")


# ------------------------------------------------------------------ tokens


def test_load_tokens_bos_and_cache(cache, tmp_path, monkeypatch):
    tok = byte_tokenizer()
    p = tmp_path / "c.txt"
    p.write_text("abc déf", encoding="utf-8")
    ids = load_tokens(str(p), tok)
    assert ids.dtype == torch.int64 and ids.ndim == 1
    assert ids[0].item() == tok.bos_token_id and ids[1:].tolist() == tok("abc déf", add_special_tokens=False).input_ids
    assert load_tokens(str(p), tok, add_bos=False).tolist() == ids[1:].tolist()
    assert load_tokens(str(p), tok, max_tokens=3).tolist() == ids[:3].tolist()
    files = sorted((cache / "tokens").glob("*.npy"))
    assert len(files) == 2  # with and without BOS

    # a hit does not tokenize again and returns the identical tensor
    monkeypatch.setattr(kd, "tokenize_text", lambda *a: pytest.fail("tokenized despite a cache hit"))
    assert torch.equal(load_tokens(str(p), tok), ids)

    # a corrupt file is rebuilt
    monkeypatch.undo()
    monkeypatch.setenv("KVEVAL_CACHE", str(cache))
    for f in files:
        f.write_bytes(f.read_bytes()[:-3])
    assert torch.equal(load_tokens(str(p), tok), ids)

    # different text -> different key
    p.write_text("abc déf!", encoding="utf-8")
    assert len(load_tokens(str(p), tok)) == len(ids) + 1


def test_load_tokens_builtin_fast_hit(cache):
    import time

    tok = byte_tokenizer()
    a = load_tokens("builtin", tok)
    t = time.perf_counter()
    b = load_tokens("builtin", tok)
    assert time.perf_counter() - t < 2.0
    assert torch.equal(a, b) and len(a) == len(load_text("builtin").encode("utf-8")) + 1


# ------------------------------------------------------------------ windows


def _scored(windows):
    pos = []
    for w in windows:
        assert w.score_from >= 1 and w.n_scored >= 1
        assert len(w.targets) == w.n_scored
        assert len(range(len(w.input_ids))[w.logits_slice]) == w.n_scored
        pos += list(range(w.start + w.score_from, w.end))
    return pos


@pytest.mark.parametrize("n", [2, 5, 100, 511, 512, 513, 1000, 1023, 1024, 1025, 3001])
@pytest.mark.parametrize("seq_len,stride", [(512, None), (512, 256), (512, 1), (512, 511), (512, 512), (64, 7),
                                            (2, None)])
def test_windows_score_every_token_once(n, seq_len, stride):
    if stride == 1 and n > 1100:
        pytest.skip("slow combination")
    tokens = torch.arange(n)
    ws = list(token_windows(tokens, seq_len, stride=stride))
    assert sorted(_scored(ws)) == list(range(1, n))
    assert [w.index for w in ws] == list(range(len(ws)))
    for w in ws:
        assert len(w.input_ids) == min(seq_len, n)
        assert torch.equal(w.input_ids, tokens[w.start:w.end])


def test_windows_default_and_stride_layout():
    tokens = torch.arange(2000)
    ws = list(token_windows(tokens, 512))
    assert [w.start for w in ws] == [0, 511, 1022, 1488]
    assert [w.score_from for w in ws] == [1, 1, 1, 1534 - 1488]
    ws = list(token_windows(tokens, 512, stride=256))
    assert [w.start for w in ws[:3]] == [0, 256, 512]
    assert [w.score_from for w in ws[:3]] == [1, 256, 256]


def test_windows_max_tokens():
    ws = list(token_windows(torch.arange(5000), 512, stride=128, max_tokens=1500))
    assert max(w.end for w in ws) == 1500
    assert sorted(_scored(ws)) == list(range(1, 1500))
    assert list(token_windows(torch.arange(5000), 512, max_tokens=1)) == []


def test_windows_bad_args():
    with pytest.raises(KvevalError):
        list(token_windows(torch.arange(10), 1))
    with pytest.raises(KvevalError):
        list(token_windows(torch.arange(10), 4, stride=0))
