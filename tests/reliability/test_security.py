"""Security review as a test: kveval's source holds none of the calls that turn input into code, except the
justified exceptions named in ALLOWED.

Rules (read from the syntax tree of every module under kveval/, so comments and docstrings do not count):

- ``pickle``: importing pickle, cPickle, dill, cloudpickle, joblib, marshal or shelve; ``pandas.read_pickle``;
  ``numpy.load(..., allow_pickle=True)``; ``torch.load`` without ``weights_only=True``; ``torch.jit.load``.
- ``yaml``: ``yaml.load``, ``yaml.load_all``, ``yaml.full_load``, ``yaml.unsafe_load`` (``safe_load`` and kveval's
  strict loader are fine).
- ``eval``: the builtins ``eval``, ``exec`` and ``compile`` (``model.eval()`` is a method, not the builtin).
- ``remote_code``: ``trust_remote_code=True`` in a call, or ``True`` as the default of a ``trust_remote_code``
  parameter or field.
- ``shell``: ``os.system``, ``os.popen``, ``os.exec*``, ``os.spawn*``, any call with ``shell=True``, and a
  ``subprocess`` call whose command is not a literal list of literal strings (a command built from values).
- ``dynamic_import``: ``importlib.import_module`` or ``__import__`` of a name that is not a literal.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kveval"

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
SUBPROCESS_CALLS = {"run", "call", "check_call", "check_output", "Popen", "getoutput", "getstatusoutput"}

#: (module path relative to the repository, rule) -> why it is safe. Each entry must still match something.
ALLOWED: dict[tuple[str, str], str] = {
    ("kveval/tasks/__init__.py", "dynamic_import"):
        "task modules by name from pkgutil's listing of kveval/tasks/ itself; a config can only pick one of them",
    ("kveval/report/sections.py", "dynamic_import"):
        "the tasks' reporting plug-ins by name from pkgutil's listing of kveval/tasks/ itself (a package's "
        "reporting module, found with find_spec); nothing a config or a run folder names",
    ("kveval/report/__init__.py", "dynamic_import"):
        "lazy exports: module names from the constant _EXPORTS table of the package",
    ("kveval/results/__init__.py", "dynamic_import"):
        "lazy exports: module names from the constant _EXPORTS table of the package",
    ("kveval/quant/formats/registry.py", "dynamic_import"):
        "format plugins by name from pkgutil's listing of kveval/quant/formats/ itself",
    ("kveval/commands/parity.py", "dynamic_import"):
        "the parity module of a system from the constant SYSTEMS table (an unknown name is refused first)",
    ("kveval/sweep/runner.py", "shell"):
        "each sweep run is [sys.executable, '-m', 'kveval', 'run', CONFIG, '--quiet', *flags]: a list (no shell), "
        "the interpreter's own path, a config file the sweep wrote, and the flags --overwrite / --allow-code",
    ("kveval/parity/llama_perplexity.py", "shell"):
        "llama.cpp's own llama-perplexity, built by scripts/build_llama_perplexity.sh into kveval's cache: argv lists "
        "(no shell) of that binary's path, kveval's GGUF and base-file paths, integers and llama.cpp cache types "
        "from its fixed table; and bash running that build script from kveval's own scripts/ folder",
    ("kveval/native/__init__.py", "shell"):
        "the C compiler ($CC, or cc / gcc / clang on PATH: the user's environment, never a config) compiling "
        "kveval's own native/dequant.c and native/quant.c into kveval's cache: an argv list (no shell) of the compiler, "
        "the constant FLAGS and OPENMP, the package's source paths and the cache target",
}


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _literal_command(node) -> bool:
    return isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def findings(source: str) -> list[tuple[int, str, str]]:
    """(line, rule, what) for every dangerous construct in one module's source."""
    out: list[tuple[int, str, str]] = []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> module it stands for (import pickle as pk; from os import system)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in PICKLE_MODULES:
                    out.append((node.lineno, "pickle", f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            for a in node.names:
                aliases[a.asname or a.name] = f"{mod}.{a.name}"
            if mod.split(".")[0] in PICKLE_MODULES:
                out.append((node.lineno, "pickle", f"from {mod} import ..."))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                if arg.arg == "trust_remote_code" and _is_true(default):
                    out.append((node.lineno, "remote_code", "trust_remote_code defaults to True"))
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if arg.arg == "trust_remote_code" and _is_true(default):
                    out.append((node.lineno, "remote_code", "trust_remote_code defaults to True"))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == "trust_remote_code" and _is_true(node.value):
                out.append((node.lineno, "remote_code", "field trust_remote_code defaults to True"))
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        line = node.lineno
        if full in ("eval", "exec", "compile", "builtins.eval", "builtins.exec", "builtins.compile"):
            out.append((line, "eval", full))
        if full in ("yaml.load", "yaml.load_all", "yaml.full_load", "yaml.full_load_all", "yaml.unsafe_load",
                    "yaml.unsafe_load_all"):
            out.append((line, "yaml", full))
        if full.split(".")[0] in PICKLE_MODULES and full.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler", "open"):
            out.append((line, "pickle", full))
        if full in ("pandas.read_pickle", "pd.read_pickle", "torch.jit.load") or full.endswith(".read_pickle"):
            out.append((line, "pickle", full))
        if full in ("numpy.load", "np.load") and _is_true(_kw(node, "allow_pickle")):
            out.append((line, "pickle", "numpy.load(allow_pickle=True)"))
        if full == "torch.load" and not _is_true(_kw(node, "weights_only")):
            out.append((line, "pickle", "torch.load without weights_only=True"))
        if _is_true(_kw(node, "trust_remote_code")):
            out.append((line, "remote_code", f"{full}(trust_remote_code=True)"))
        if _is_true(_kw(node, "shell")):
            out.append((line, "shell", f"{full}(shell=True)"))
        if full in ("os.system", "os.popen") or full.startswith(("os.exec", "os.spawn", "os.posix_spawn")):
            out.append((line, "shell", full))
        if full.startswith("subprocess.") and full.split(".")[-1] in SUBPROCESS_CALLS:
            command = node.args[0] if node.args else _kw(node, "args")
            if not _literal_command(command):
                out.append((line, "shell", f"{full} with a command built from values"))
        if full in ("importlib.import_module", "__import__") and not (
                node.args and isinstance(node.args[0], ast.Constant)):
            out.append((line, "dynamic_import", full))
    return out


def scan(root: Path) -> dict[tuple[str, str], list[str]]:
    """(path relative to the repository, rule) -> what was found, for every module under ``root``."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        for line, rule, what in findings(path.read_text(encoding="utf-8")):
            out.setdefault((rel, rule), []).append(f"line {line}: {what}")
    return out


def test_no_dangerous_calls_in_kveval():
    found = scan(PACKAGE)
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unexpected, f"dangerous constructs (justify them in ALLOWED or remove them): {unexpected}"


def test_every_allowed_exception_is_still_needed():
    found = scan(PACKAGE)
    stale = [k for k in ALLOWED if k not in found]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


PLANTED = '''
import pickle
import yaml, torch, subprocess, os, importlib
import numpy as np
from dill import loads

def f(path, cfg, trust_remote_code=True):
    pickle.loads(b"")
    yaml.load(open(path), Loader=yaml.Loader)
    torch.load(path)
    torch.load(path, weights_only=False)
    np.load(path, allow_pickle=True)
    eval(cfg["expr"])
    exec(cfg["code"])
    os.system("echo " + cfg["name"])
    subprocess.run(f"ls {cfg['dir']}", shell=True)
    subprocess.run(["git", cfg["arg"]])
    importlib.import_module(cfg["module"])
    AutoModel.from_pretrained(path, trust_remote_code=True)

class C:
    trust_remote_code: bool = True
'''

SAFE = '''
import yaml, torch, subprocess, importlib
import numpy as np

def g(path, model, trust_remote_code=False):
    yaml.safe_load(open(path))
    torch.load(path, weights_only=True)
    np.load(path, allow_pickle=False)
    model.eval()
    subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True)
    importlib.import_module("kveval.models")
    "eval(x) in a string is not a call"
'''


def test_the_scanner_finds_planted_examples(tmp_path):
    """Self-check: a planted module with each dangerous construct is caught, rule by rule, line by line."""
    pkg = tmp_path / "kveval"
    pkg.mkdir()
    (pkg / "planted.py").write_text(PLANTED)
    (pkg / "safe.py").write_text(SAFE)
    found = scan(pkg)
    assert set(found) == {("kveval/planted.py", r) for r in ("pickle", "yaml", "eval", "shell", "remote_code",
                                                              "dynamic_import")}
    whats = [w for v in found.values() for w in v]
    for needle in ("import pickle", "from dill import", "pickle.loads", "yaml.load", "torch.load without",
                   "allow_pickle=True", ": eval", ": exec", "os.system", "shell=True", "command built from values",
                   "importlib.import_module", "defaults to True", "from_pretrained(trust_remote_code=True)",
                   "field trust_remote_code"):
        assert any(needle in w for w in whats), needle
    assert sum("torch.load without" in w for w in whats) == 2
    assert not any(k[0] == "kveval/safe.py" for k in found)


def test_a_planted_call_in_a_real_module_is_caught(tmp_path):
    """Self-check on real code: kveval/models/load.py plus one planted torch.load is reported, at that line."""
    source = (PACKAGE / "models" / "load.py").read_text()
    baseline = findings(source)
    planted = source + "\n\ndef _planted(p):\n    import torch\n    return torch.load(p)\n"
    extra = [f for f in findings(planted) if f not in baseline]
    assert [(rule, what) for _, rule, what in extra] == [("pickle", "torch.load without weights_only=True")]
    assert extra[0][0] == planted.count("\n", 0, planted.index("return torch.load")) + 1


def test_trust_remote_code_is_off_by_default_everywhere():
    """The config field, load_model and the lm-eval bridge all default to False."""
    import inspect

    from kveval.config import ModelConfig
    from kveval.models import load_model

    assert ModelConfig().trust_remote_code is False
    assert inspect.signature(load_model).parameters["trust_remote_code"].default is False
    bridge = (PACKAGE / "tasks" / "lm_eval" / "bridge.py").read_text()
    assert "trust_remote_code: bool = False" in bridge
