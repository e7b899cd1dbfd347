"""An lm-eval include folder: where a config's ``include_path`` points (:func:`resolve_include_path`) and whether it
holds code lm-eval would run (:func:`check_include_path`); the rules are in :mod:`kveval.tasks.lm_eval.task`'s
docstring. Light (no lm-eval import): the config's input check (this task's ``params.check_inputs``) and the
evaluator both use it.
"""

from __future__ import annotations

from pathlib import Path

from kveval.errors import KvevalError
from kveval.fileio import NOT_REGULAR, check_regular, read_regular_bytes
from kveval.task_definitions import DEFINITIONS_DIR, LM_EVAL_DIR

REPO_ROOT = Path(__file__).resolve().parents[3]  # the checkout: kveval/tasks/lm_eval/task.py -> the folder of kveval/
SHIPPED_TASKS = LM_EVAL_DIR.resolve()  # kveval's own example tasks (its own code)


def resolve_include_path(path: str | None) -> str | None:
    """The include folder as an absolute path (see the module docstring), or a one-line error."""
    if path is None:
        return None
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    if not p.is_absolute() and p.parts[:1] == ("tasks",):  # kveval's task definitions, wherever installed
        candidates.append(DEFINITIONS_DIR.joinpath(*p.parts[1:]))
    for c in candidates:
        if c.is_dir():
            return str(c.resolve())
    raise KvevalError(f"tasks: lm_eval.include_path {path!r} is not a folder (relative paths: from the working directory)")


MAX_INCLUDE_FILES = 10_000
_CODE_SIGNS = ("!function", "trust_remote_code")


def include_code(folder: str | Path) -> str | None:
    """The first sign of code in an lm-eval include folder, as a short phrase (``"utils.py"``, ``"t.yaml: !function"``),
    or None: a ``.py`` file anywhere under it, or a YAML under it (or included by one, wherever it lives) with a
    ``!function`` tag or ``trust_remote_code`` (a comment that mentions them counts too: the check reads text).
    KvevalError for a folder too large to be a task folder (``MAX_INCLUDE_FILES``)."""
    import os

    root = Path(folder)
    seen: set[Path] = set()
    todo: list[Path] = []
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            count += 1
            if count > MAX_INCLUDE_FILES:
                raise KvevalError(f"include_path '{folder}' holds more than {MAX_INCLUDE_FILES} files; point it at a "
                                  "folder of task YAMLs")
            path = Path(dirpath) / fname
            if fname.endswith((".py", ".pyc", ".pyw", ".so")):
                return str(path.relative_to(root))
            if fname.endswith((".yaml", ".yml")):
                todo.append(path)
    while todo:
        path = todo.pop()
        real = path.resolve()
        if real in seen or len(seen) > MAX_INCLUDE_FILES:
            continue
        seen.add(real)
        where = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        try:
            text = read_regular_bytes(real).decode("utf-8", errors="replace")
        except OSError as exc:
            if exc.strerror == NOT_REGULAR:  # lm-eval would open it and block
                raise _special(folder, where) from None
            continue  # lm-eval cannot read it either
        for sign in _CODE_SIGNS:
            if sign in text:
                return f"{where}: {sign}"
        todo.extend(_yaml_includes(text, real.parent))
    return None


def _special(folder: str | Path, where: str) -> KvevalError:
    return KvevalError(f"tasks: lm_eval.include_path '{folder}': {where} is {NOT_REGULAR}, which lm-eval would open "
                       f"and wait on forever; remove it or give a folder of task YAML files")


def special_include_file(folder: str | Path) -> str | None:
    """The first task YAML under ``folder`` (as :func:`include_code` walks it) that is not a regular file: a FIFO,
    socket or device, which lm-eval would open and block on; or None."""
    import os

    root, count = Path(folder), 0
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            count += 1
            if count > MAX_INCLUDE_FILES:
                return None  # include_code refuses the folder
            if fname.endswith((".yaml", ".yml")):
                path = Path(dirpath) / fname
                try:
                    check_regular(path)
                except OSError as exc:
                    if exc.strerror == NOT_REGULAR:
                        return str(path.relative_to(root))
    return None


def _yaml_includes(text: str, base: Path) -> list[Path]:
    """The files a task YAML includes (``include: other.yaml`` or a list), resolved as lm-eval resolves them."""
    import re

    out = []
    for m in re.finditer(r"^include\s*:\s*(.*)$((?:\n[ \t]*-.*$)*)", text, flags=re.MULTILINE):
        values = [m.group(1)] + re.findall(r"^[ \t]*-\s*(.*)$", m.group(2), flags=re.MULTILINE)
        for v in values:
            v = v.split(" #")[0].strip().strip("'\"[]")
            for item in (x.strip().strip("'\"") for x in v.split(",")):
                if item:
                    p = Path(item).expanduser()
                    out.append(p if p.is_absolute() else base / p)
    return out


def check_include_path(path: str | None, *, allow_code: bool) -> str | None:
    """The include folder, resolved (:func:`resolve_include_path`), after refusing one that holds code unless
    ``allow_code`` (or it is kveval's own :data:`SHIPPED_TASKS`): a one-line KvevalError that names the code and
    the opt-in."""
    resolved = resolve_include_path(path)
    special = special_include_file(resolved) if resolved is not None else None
    if special is not None:
        raise _special(path or "", special)
    if resolved is not None and not allow_code and Path(resolved).resolve() != SHIPPED_TASKS:
        found = include_code(resolved)
        if found is not None:
            raise KvevalError(
                f"tasks: lm_eval.include_path {path!r} holds code that lm-eval would run ({found}); a config is "
                "pure data: pass --allow-code to kveval run/validate if you trust that folder"
            )
    return resolved


__all__ = ["MAX_INCLUDE_FILES", "REPO_ROOT", "SHIPPED_TASKS", "check_include_path", "include_code",
           "resolve_include_path", "special_include_file"]
