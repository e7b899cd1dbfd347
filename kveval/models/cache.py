"""The conversion cache of GGUF models: a GGUF file is dequantized by transformers once (about 20 s) and kept as
safetensors under ``cache_dir("models", "<stem>-<key>")`` (:func:`gguf_cache_path`); later loads take well under a
second.

A cache entry is only used when its ``kveval-complete.json`` marker matches the files on disk: the same files, of
the same sizes, with the same xxh3-128 digest of their whole content (written when the entry was built; a flipped
block in the weights or an edited config.json or tokenizer.json is caught); otherwise it is deleted and rebuilt.
An entry that verified and then fails to load (out of memory, an interrupted load) is not damaged: the error goes
to the caller as one line and the entry stays. A conversion holds a lock beside its temporary folder while it
writes it, so that a later load removes the folder at once if the conversion's process died
(:mod:`kveval.models.temporaries`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.fileio import atomic_path, open_regular
from kveval.gguf import check_gguf
from kveval.models.checks import LOAD_ERRORS, check_finite_weights, first_line, text_config
from kveval.models.placement import Placement, pretrained_placement
from kveval.models.temporaries import clean_stale_temporaries, holding_lock
from kveval.paths import cache_dir

log = logging.getLogger(__name__)

MARKER = "kveval-complete.json"
_CACHE_FORMAT = 1  # part of the entry's folder name (gguf_cache_path): a new value orphans old entries
_MARKER_FORMAT = 2  # 2: whole-file xxh3-128 digests of every file (1: sizes and the weights' first/last MiB)


def gguf_cache_path(gguf_file: str | os.PathLike) -> Path:
    """The cache folder for a GGUF file's float32 conversion (it may not exist yet).

    ``<cache>/models/<stem>-<key>`` where key = sha256(file name, size, first MiB, transformers version)[:16].
    Contents: ``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files and the
    ``kveval-complete.json`` marker (file sizes + a checksum of the weights' size, first and last MiB).
    """
    import transformers

    path = Path(gguf_file)
    st = path.stat()
    h = hashlib.sha256()
    h.update(f"{_CACHE_FORMAT}|{path.name}|{st.st_size}|{transformers.__version__}|".encode())
    with open_regular(path) as f:
        h.update(f.read(1 << 20))
    return cache_dir("models") / f"{path.stem}-{h.hexdigest()[:16]}"


def load_gguf(path: Path, dtype: torch.dtype, placement: Placement | None = None):
    """Load a GGUF file through the conversion cache, rebuilding a missing or damaged entry (module docstring).
    An entry that verifies is never deleted: if it then fails to load (out of memory, say), the error is one
    KvevalError line and the entry stays for the next attempt."""
    check_gguf(path)
    try:
        entry = gguf_cache_path(path)
    except OSError as e:
        raise KvevalError(f"GGUF file '{path}' cannot be read ({e.strerror or type(e).__name__})") from None
    clean_stale_temporaries(entry.parent)
    if entry.exists():
        problem = _verify_entry(entry)
        if problem is None:
            try:
                return _load_entry(entry, dtype, verified=True, placement=placement)
            except LOAD_ERRORS as e:
                raise KvevalError(f"model cache entry '{entry}' verified but could not be loaded: {first_line(e)} "
                                  "(the entry is kept)") from None
        log.warning("kveval: model cache entry %s is unusable (%s); rebuilding it", entry, problem)
        shutil.rmtree(entry, ignore_errors=True)
    try:
        _convert_gguf(path, entry)
    except KvevalError:
        raise
    except (*LOAD_ERRORS, struct.error) as e:  # the gguf reader and transformers on a file they cannot convert
        raise KvevalError(f"'{path}' is not a GGUF model that transformers can convert ({first_line(e)})") from None
    return _load_entry(entry, dtype, verified=True, placement=placement)


def _load_entry(entry: Path, dtype: torch.dtype, verified: bool = False, placement: Placement | None = None):
    """Model and tokenizer of a cache entry; ``verified``: its digests matched, and entries are only written with
    finite weights, so the model is marked ``kveval_weights_finite`` (the warm load skips that check)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, attn_implementation="sdpa", use_safetensors=True,
                                                 **pretrained_placement(placement, dtype))
    tok = AutoTokenizer.from_pretrained(entry)
    if verified:
        if torch.finfo(dtype).max < torch.finfo(torch.float32).max:  # stored in float32, loaded narrower
            check_finite_weights(model, str(entry), cast_from=torch.float32)
        model.kveval_weights_finite = True
    return model, tok


def _convert_gguf(path: Path, entry: Path) -> None:
    """Dequantize ``path`` with transformers (slow) and write the cache entry atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("kveval: converting %s to float32 safetensors once (about 20 s) into %s", path.name, entry)
    folder, fname = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # transformers 5.x refuses save_pretrained on a GGUF-loaded model: drop its gguf quantizer first
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for cfg in (model.config, text_config(model.config)):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    check_finite_weights(model, str(path))  # an entry is only written with finite weights (see _load_entry)
    # a lock beside the temporary folder, held while it is written: a later load removes it if this process dies
    with atomic_path(entry, folder=True, replace=_install_entry, suffix=f".pid{os.getpid()}") as tmp, \
            holding_lock(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        write_marker(tmp, path)  # before the rename, so an entry that appears is complete


def write_marker(folder: Path, source: Path) -> None:
    """The ``kveval-complete.json`` of a cache entry: every file's size and xxh3-128 digest (what
    :func:`_verify_entry` checks at each load) and the GGUF file it was converted from."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)
    marker = {"format": _MARKER_FORMAT, "source": str(source), "source_size": source.stat().st_size,
              "files": {n: (folder / n).stat().st_size for n in names}, "digest": "xxh3_128",
              "digests": {n: file_digest(folder / n) for n in names}}
    (folder / MARKER).write_text(json.dumps(marker, indent=1))


def _install_entry(tmp: Path, entry: Path) -> None:
    """Rename a complete cache folder into place; when another process won the race, keep its entry if it
    verifies, else replace it."""
    try:
        os.replace(tmp, entry)
    except OSError:  # another process won the race: use its entry if it verifies
        if _verify_entry(entry) is not None:
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's whole content, hex (the file is mapped, not copied: ~0.1 s for the builtin model's
    540 MB on one core). A digest against corruption and stray edits: whoever can write the cache can also
    rewrite its marker, so a cryptographic hash would add nothing but time."""
    import xxhash

    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128(m).hexdigest()


def _verify_entry(entry: Path) -> str | None:
    """None when the entry is complete and unchanged since it was built; otherwise what is wrong with it."""
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return "missing or unreadable marker"
    files, digests = marker.get("files"), marker.get("digests")
    if (marker.get("format") != _MARKER_FORMAT or marker.get("digest") != "xxh3_128" or not isinstance(files, dict)
            or not isinstance(digests, dict) or set(files) != set(digests)):
        return "marker of another format"
    present = {p.name for p in entry.iterdir()} - {MARKER}
    extra = sorted(present - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for fname, size in files.items():
        p = entry / fname
        if not p.is_file() or p.stat().st_size != size:
            return f"{fname} missing or of the wrong size"
    if not any(f.endswith(".safetensors") for f in files):
        return "no weights listed"
    for fname, digest in digests.items():
        if file_digest(entry / fname) != digest:
            return f"{fname} changed since the entry was built (digest mismatch)"
    return None
