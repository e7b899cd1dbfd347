"""Corpora for perplexity and haystacks: text, cached token ids, and evaluation windows.

    text = load_text("builtin")                               # offline, ships with CPython
    ids = load_tokens("wikitext2", tokenizer, max_tokens=8192)  # [n_tokens] LongTensor, cached on disk
    for w in token_windows(ids, 512, stride=256): ...

Sources: ``builtin`` (the standard library's ``pydoc_data.topics``, ~465k chars of English reference prose),
``wikitext2`` and ``pg19`` (HuggingFace ``datasets``, local cache or hub), or a local ``.txt``, ``.jsonl`` or
``.parquet`` file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import KvevalError
from .fileio import atomic_path
from .paths import cache_dir
from .schema import read_text_file

log = logging.getLogger(__name__)

PG19_BOOKS = 3  # pg19: the first PG19_BOOKS books of the split (each is a whole novel, ~100k tokens or more)
_TOKEN_CACHE_FORMAT = 1

_CORPORA: dict[str, str] = {
    "builtin": "the CPython standard library's pydoc_data.topics (~465k chars, ~113k SmolLM2 tokens of English "
    "reference prose), offline",
    "wikitext2": "WikiText-2 raw test split (HF datasets 'wikitext', 'wikitext-2-raw-v1'), rows joined by blank lines",
    "pg19": f"PG-19 test split (HF datasets 'deepmind/pg19'), first {PG19_BOOKS} books, joined by blank lines",
}
_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


def builtin_corpora() -> dict[str, str]:
    """``{name: one-line description}`` of the named corpora (``kveval ls``); local files are also accepted."""
    return dict(_CORPORA)


def load_text(source: str, *, split: str | None = None, text_field: str = "text") -> str:
    """The whole text of a corpus.

    source: ``builtin`` | ``wikitext2`` | ``pg19`` | a path to a ``.txt`` (UTF-8), ``.jsonl`` (one JSON object
        a line, text in ``text_field``; records joined by "\\n\\n") or ``.parquet`` file (column ``text_field``,
        rows joined by "\\n\\n").
    split: for the HF datasets (default ``test``); ignored for builtin and files.

    Files must be UTF-8 text (a byte order mark is dropped); a ``.jsonl`` or ``.parquet`` text field must hold
    strings (a null or a number is an error naming its line or row, never the text ``'None'`` or ``'5'``), and
    the corpus must hold some non-blank text.
    ``builtin`` is ``pydoc_data.topics.topics`` values joined with "\\n\\n" in sorted key order (deterministic).
    ``wikitext2`` joins the rows of the split with "\\n\\n" (the HF perplexity guide / lm-eval convention).
    Raises :class:`KvevalError` for a missing, unreadable, non-UTF-8 or empty file, a missing or non-string
    field, an unknown source, or a dataset that is neither cached locally nor downloadable.
    """
    source = str(source)
    if source == "builtin":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if source == "wikitext2":
        rows = _hf_dataset(source, *_HF_CORPORA[source], split or "test", text_field="text")
        return "\n\n".join(rows)
    if source == "pg19":
        rows = _hf_dataset(source, *_HF_CORPORA[source], split or "test", text_field="text", limit=PG19_BOOKS)
        return "\n\n".join(rows)
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in _FILE_SUFFIXES:
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"
            raise KvevalError(f"corpus file '{source}' {what}")
        if suffix == ".txt":
            text = read_text_file(path, "corpus file")
        elif suffix == ".jsonl":
            text = "\n\n".join(_jsonl_texts(path, text_field))
        else:
            text = "\n\n".join(_parquet_texts(path, text_field))
        if not text.strip():
            raise KvevalError(f"corpus file '{source}' holds no text")
        return text
    valid = ", ".join(_CORPORA) + ", or a path to a .txt/.jsonl/.parquet file"
    raise KvevalError(f"unknown corpus {source!r}; valid: {valid}")


def _jsonl_texts(path: Path, field: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(read_text_file(path, "corpus file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise KvevalError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise KvevalError(f"{path}:{lineno}: JSON nested too deeply") from None
        if not isinstance(obj, dict) or field not in obj:
            found = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
            raise KvevalError(f"{path}:{lineno}: no field {field!r} (found: {found[:200]}); set text_field")
        value = obj[field]
        if not isinstance(value, str):
            raise KvevalError(f"{path}:{lineno}: field {field!r} is {_json_kind(value)}, not a string of text")
        texts.append(value)
    return texts


def _json_kind(value: object) -> str:
    """``null``, ``a number``, ``a list``... : what a JSON value is, for messages."""
    if value is None or (isinstance(value, float) and value != value):
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _parquet_texts(path: Path, field: str) -> list[str]:
    import pandas as pd

    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError, ImportError, TypeError, MemoryError) as e:  # pyarrow's errors derive from these
        raise KvevalError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None
    if field not in df.columns:
        raise KvevalError(f"{path}: no column {field!r} (found: {', '.join(map(str, df.columns))}); set text_field")
    values = df[field].tolist()
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise KvevalError(f"{path}: row {row} of column {field!r} is {_json_kind(value)}, not a string of text")
    return values


#: the HF datasets behind the named corpora: (repo, config)
_HF_CORPORA = {"wikitext2": ("wikitext", "wikitext-2-raw-v1"), "pg19": ("deepmind/pg19", None)}


def check_corpus_available(source: str) -> None:
    """A named HF corpus (``wikitext2``, ``pg19``) that ``kveval run`` could not load here: when the hub cannot be
    reached, the ``datasets`` cache must hold it (its builder resolves offline). One KvevalError line; nothing is
    checked for other sources or when the hub can be reached."""
    if source not in _HF_CORPORA:
        return
    import datasets

    from .models import hub_guard

    repo, config = _HF_CORPORA[source]
    with hub_guard() as offline:
        if not offline:
            return
        try:
            datasets.load_dataset_builder(repo, config)
        except Exception:  # datasets raises a zoo of types (ConnectionError, FileNotFoundError, ...)
            raise KvevalError(f"dataset {source!r} is not in the local HuggingFace datasets cache and the hub cannot "
                              f"be reached: load it once where there is network (python -c \"import datasets; "
                              f"datasets.load_dataset({repo!r}, {config!r})\"), or use data: builtin or a local "
                              ".txt/.jsonl/.parquet file") from None


def _hf_dataset(source: str, repo: str, config: str | None, split: str, *, text_field: str,
                limit: int | None = None) -> list[str]:
    import datasets

    from .models import hub_guard

    with hub_guard() as offline:
        try:
            if limit is None:
                ds = datasets.load_dataset(repo, config, split=split)
                return [str(t) for t in ds[text_field]]
            ds = datasets.load_dataset(repo, config, split=split, streaming=not offline)
            return [str(row[text_field]) for row in itertools.islice(ds, limit)]
        except Exception as e:  # datasets raises a zoo of types (ConnectionError, FileNotFoundError, ...)
            if offline or isinstance(e, (ConnectionError, OSError)):
                raise KvevalError(f"dataset {source!r} is not in the local HuggingFace cache and the hub cannot "
                                  "be reached; use data: builtin or a local .txt/.jsonl/.parquet file") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KvevalError(f"dataset {source!r} could not be loaded: {first}") from None


# --------------------------------------------------------------------------------------------- tokens


def load_tokens(source: str, tokenizer, *, max_tokens: int | None = None, add_bos: bool = True,
                **kw) -> torch.LongTensor:
    """Token ids of a whole corpus, shape [n_tokens], int64; the first ``max_tokens`` when given.

    The text (``load_text(source, **kw)``) is tokenized once, in one call, without special tokens; one BOS id
    is prepended when ``add_bos`` and the tokenizer has a ``bos_token``. (The builtin corpus, 465k chars,
    tokenizes in ~0.3 s with a fast tokenizer, so no chunking is done and merges are never cut.)
    Ids are cached as ``cache_dir("tokens")/<key>.npy`` where key hashes the tokenizer fingerprint (class,
    len, bos id and sha256 of ``backend_tokenizer.to_str()``; for slow tokenizers, name_or_path and the ids of a
    probe string), the text's sha256 and ``add_bos``. Writes are atomic; an unreadable file, or one whose ids
    differ from the digest written beside it (``<key>.npy.xxh3``), is rebuilt.
    """
    text = load_text(source, **kw)
    bos = tokenizer.bos_token_id if (add_bos and getattr(tokenizer, "bos_token", None)) else None
    key_src = json.dumps({"format": _TOKEN_CACHE_FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer),
                          "text": hashlib.sha256(text.encode("utf-8")).hexdigest(), "bos": bos})
    path = cache_dir("tokens") / f"{hashlib.sha256(key_src.encode()).hexdigest()[:32]}.npy"
    ids = _read_ids(path, len(tokenizer))
    if ids is None:
        ids = np.asarray(([bos] if bos is not None else []) + tokenize_text(text, tokenizer), dtype=np.int64)
        _write_ids(path, ids)
    out = torch.from_numpy(ids).long()
    return out[:max_tokens] if max_tokens is not None else out


def tokenize_text(text: str, tokenizer) -> list[int]:
    """Ids of ``text`` without special tokens (uses the fast backend directly when there is one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def tokenizer_fingerprint(tokenizer) -> str:
    """A sha256 that changes whenever the tokenizer would produce different ids."""
    h = hashlib.sha256()
    h.update(f"{type(tokenizer).__name__}|{len(tokenizer)}|{tokenizer.bos_token_id}|".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        probe = "The quick brown fox, 12345 ÄÖÜ ß 中文 \n\n\tdef f(x): return x**2  # kveval probe"
        h.update(f"{tokenizer.name_or_path}|{tokenizer.encode(probe, add_special_tokens=False)[:100]}".encode())
    return h.hexdigest()


def _ids_digest(ids: np.ndarray) -> str:
    import xxhash

    return xxhash.xxh3_128(np.ascontiguousarray(ids).tobytes()).hexdigest()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".xxh3")


def _read_ids(path: Path, vocab: int) -> np.ndarray | None:
    """The cached ids, or None (and the files removed) when they are missing, unreadable, out of the vocabulary or
    not the ids written (their xxh3-128 digest, kept beside them, differs: a changed id is never used silently)."""
    if not path.exists():
        return None
    try:
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 1 or ids.dtype != np.int64 or (ids.size and (ids.min() < 0 or ids.max() >= vocab)):
            raise ValueError("unexpected contents")
        digest = _digest_path(path)
        if not digest.is_file() or digest.read_text().strip() != _ids_digest(ids):
            raise ValueError("digest missing or different")
        return ids
    except (OSError, ValueError, EOFError) as e:  # np.load: missing, truncated, not an .npy, pickled
        log.warning("kveval: token cache file %s is unreadable (%s); rebuilding it", path, e)
        path.unlink(missing_ok=True)
        _digest_path(path).unlink(missing_ok=True)
        return None


def _write_ids(path: Path, ids: np.ndarray) -> None:
    """The ids and then their digest, each atomically (a crash between the two leaves ids without a digest: rebuilt)."""
    with atomic_path(path, suffix=".npy") as tmp, open(tmp, "wb") as f:
        np.save(f, ids, allow_pickle=False)
    with atomic_path(_digest_path(path)) as tmp:
        tmp.write_text(_ids_digest(ids) + "\n")


# --------------------------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """One evaluation window: ``input_ids = tokens[start:start + len]`` ([seq_len], shorter only when the
    corpus is).

    Scored targets are ``input_ids[score_from:]`` (corpus positions ``start + score_from`` .. ``end - 1``),
    predicted by ``logits[score_from - 1 : -1]`` (logits at position p predict token p + 1).
    ``score_from >= 1``: position 0 of a window is only context.
    """

    index: int
    start: int
    input_ids: torch.Tensor
    score_from: int

    @property
    def end(self) -> int:
        return self.start + len(self.input_ids)

    @property
    def n_scored(self) -> int:
        return len(self.input_ids) - self.score_from

    @property
    def targets(self) -> torch.Tensor:
        """The scored target ids, [n_scored]."""
        return self.input_ids[self.score_from:]

    @property
    def logits_slice(self) -> slice:
        """Index the window's logits (seq axis) with this to get the [n_scored] predictions of ``targets``."""
        return slice(self.score_from - 1, len(self.input_ids) - 1)


def token_windows(tokens: torch.Tensor, seq_len: int, *, stride: int | None = None,
                  max_tokens: int | None = None) -> Iterator[Window]:
    """Evaluation windows over ``tokens[:max_tokens]``; every token after the first is scored exactly once.

    Default (``stride=None``, or any stride >= seq_len): windows start every ``seq_len - 1`` tokens, so that
    consecutive windows share one token: the last token of one window is the first (context-only) token of the
    next and every window scores its ``seq_len - 1`` next-token predictions (lm-eval's rolling windows). A stride
    of ``seq_len`` in the HF sense would never score each window's first token.
    With ``1 <= stride < seq_len - 1``: sliding windows starting every ``stride`` tokens (the HF perplexity
    guide); window 0 scores all its predictions, later windows score only targets that no earlier window scored
    (the last ``stride`` ones), the rest is context.
    All windows are ``seq_len`` long: the last one is moved back to end at the corpus end (it then has extra
    context and scores only the new tail). A corpus shorter than ``seq_len`` gives one window of its length;
    fewer than 2 tokens give none.
    """
    if seq_len < 2:
        raise KvevalError(f"seq_len must be at least 2, got {seq_len}")
    if stride is not None and stride < 1:
        raise KvevalError(f"stride must be at least 1, got {stride}")
    tokens = tokens[:max_tokens] if max_tokens is not None else tokens
    n = len(tokens)
    if n < 2:
        return
    length = min(seq_len, n)
    step = length - 1 if stride is None else min(stride, length - 1)
    start, scored_end, index = 0, 1, 0  # corpus positions < scored_end are scored (position 0 never is)
    while True:
        if start + length > n:
            start = n - length
        end = start + length
        yield Window(index, start, tokens[start:end], max(1, scored_end - start))
        if end == n:
            return
        scored_end, index, start = end, index + 1, start + step
