"""The checks before a run folder is opened: read only, each refusal one line (docs/design.md section 4).

What a folder is to kveval (:func:`folder_kind`: absent, empty, kveval's own, or the user's), whether a config may
use it (:func:`check_folder`: ownership, damage, the same config) and whether its records were computed on the same
corpus tokens (:func:`check_tokens`, from the marker :func:`read_marker` reads). The caller holds the folder's lock
(:mod:`kveval.results.lock`); :class:`kveval.results.store.RunDir` writes the folder once these have passed.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import yaml

from kveval.errors import KvevalError
from kveval.results.layout import (
    CONFIG_FILE,
    ENV_FILE,
    LOCK_FILE,
    MARKER_FILE,
    METRICS_FILE,
    OWN_FILES,
    RECORDS_FILE,
    SCALES_FILE,
    SCALES_USED_FILE,
)


def is_own_name(name: str) -> bool:
    """Whether kveval writes a file of this name in a run folder (its files, the lock, and the hidden temporary
    siblings ``.<file>.<random>`` that an interrupted atomic write leaves)."""
    if name in OWN_FILES or name == LOCK_FILE:
        return True
    return name.startswith(".") and any(name.startswith(f".{own}.") for own in OWN_FILES)


def folder_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` is to kveval: ``"absent"``, ``"file"`` (not a folder), ``"empty"`` (a folder holding at most
    a lock file), ``"marked"`` (it holds kveval's marker: kveval made it as a run folder), ``"legacy"`` (a run
    folder of a kveval older than the marker: nothing but kveval's own names)
    or ``"foreign"`` (anything else: the user's own files)."""
    p = Path(path)
    if not os.path.lexists(p):
        return "absent"
    if not p.is_dir():
        return "file"
    try:
        names = [n for n in os.listdir(p) if n != LOCK_FILE]
    except OSError as exc:
        raise KvevalError(f"cannot read the folder {p}: {exc.strerror or exc}") from None
    if not names:
        return "empty"
    if MARKER_FILE in names and stat.S_ISREG(os.lstat(p / MARKER_FILE).st_mode):
        return "marked"
    if all(is_own_name(n) for n in names):
        return "legacy"
    return "foreign"


def not_regular(path: Path) -> str | None:
    """Why ``path`` cannot be a file kveval reads and writes in place ("a folder", "a symbolic link"...), or None
    (absent, or a regular file)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def check_folder(path: Path, resolved_config: dict, *, overwrite: bool = False) -> bool:
    """Whether the run folder ``path`` must be started afresh (True: only with ``overwrite``), after the checks
    that need nothing but the folder; reads, never writes.

    One-line :class:`KvevalError` when ``path`` is a file, holds files that are not a kveval run's (never
    replaced, whatever ``overwrite`` says), holds a run of another config, or is damaged (its config not a
    readable YAML file, its records not a regular file, records without a config) and ``overwrite`` is off.
    """
    path = Path(path)
    kind = folder_kind(path)
    if kind == "file":
        raise KvevalError(f"{path} is a file, not a folder; set output: to a folder (new, or a kveval run folder)")
    if kind == "foreign":
        try:
            example = sorted(n for n in os.listdir(path) if not is_own_name(n))[:2]
        except OSError:
            example = []
        raise KvevalError(
            f"{path} holds files that are not a kveval run's ({', '.join(map(repr, example))}); kveval writes "
            "only into a new or empty folder or a run folder of its own, and never deletes a foreign one: "
            "set output: to another folder"
        )
    if kind in ("absent", "empty"):
        return False
    damage = folder_damage(path)
    if damage is not None:
        if overwrite:
            return True
        raise KvevalError(f"{path} is a damaged run folder: {damage}; rerun with --overwrite to start it "
                          "afresh, or set output: to another folder")
    config_path = path / CONFIG_FILE
    if not config_path.exists():
        return False
    same = yaml.safe_load(config_path.read_text()) == yaml.safe_load(yaml.safe_dump(resolved_config, sort_keys=False))
    if not same and not overwrite:
        raise KvevalError(
            f"{path} holds a run of a different config; rerun with --overwrite to replace it, "
            "or set output: to another folder"
        )
    return not same


def folder_damage(path: Path) -> str | None:
    """What makes a run folder unusable without starting afresh, in words, or None."""
    config_path, records_path = path / CONFIG_FILE, path / RECORDS_FILE
    why = not_regular(config_path)
    if why:
        return f"{CONFIG_FILE} is {why}"
    if config_path.exists():
        try:
            yaml.safe_load(config_path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            return f"{CONFIG_FILE} cannot be read ({getattr(exc, 'strerror', None) or exc})"
        except yaml.YAMLError:
            return f"{CONFIG_FILE} is not valid YAML"
    elif os.path.lexists(records_path):
        return f"it has {RECORDS_FILE} but no {CONFIG_FILE} (which config made them is unknown)"
    why = not_regular(records_path)
    if why:
        return f"{RECORDS_FILE} is {why}"
    why = not_regular(path / MARKER_FILE)
    if why:
        return f"{MARKER_FILE} is {why}"
    for name in (ENV_FILE, METRICS_FILE, SCALES_FILE, SCALES_USED_FILE):  # replaced atomically: a link is fine
        p = path / name
        if p.is_dir() and not p.is_symlink():
            return f"{name} is a folder"
    return None


def read_marker(path: Path) -> dict:
    """The marker's content (``{}`` when absent or unreadable)."""
    p = Path(path) / MARKER_FILE
    if not_regular(p) is not None or not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_tokens(path: Path, digest: dict) -> None:
    """Refuse (one-line :class:`KvevalError`) to resume the run folder ``path`` on token ids other than those
    its records were computed on (``digest``: :func:`kveval.results.store.tokens_digest`). A folder that recorded none (new, or
    made by an older kveval) passes."""
    before = read_marker(path).get("tokens")
    if not isinstance(before, dict) or before.get("sha256") in (None, digest["sha256"]):
        return
    raise KvevalError(
        f"{path}: its records were computed on other corpus tokens ({before.get('count')} tokens, sha256 "
        f"{str(before.get('sha256'))[:12]}; now {digest['count']} tokens, sha256 {digest['sha256'][:12]}): the "
        "corpus or the tokenizer changed since; rerun with --overwrite to start afresh, or set output: to "
        "another folder"
    )


def check_inputs_unchanged(path: Path, digests: dict) -> None:
    """Refuse (one-line :class:`KvevalError`) to resume the run folder ``path`` when an input file its records
    were computed from changed since (``digests``: ``{label: {"path", "sha256", "bytes"}}`` from
    :func:`kveval.results.store.input_digests`, e.g. ``tasks[0].generation.prompts``): a prompt file edited in
    place, same ids and new answers, would otherwise be scored by records of the old answers. A folder that
    recorded no inputs (new, or made by an older kveval), and an input it did not record, pass."""
    before = read_marker(path).get("inputs")
    if not isinstance(before, dict):
        return
    for label, now in digests.items():
        was = before.get(label)
        if not isinstance(was, dict) or was.get("sha256") in (None, now["sha256"]):
            continue
        raise KvevalError(
            f"{path}: {label} '{now['path']}' changed since this run's records were written (sha256 "
            f"{str(was.get('sha256'))[:12]}, now {now['sha256'][:12]}); rerun with --overwrite to start afresh, or "
            "set output: to another folder"
        )
