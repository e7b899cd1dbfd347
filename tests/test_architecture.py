"""Guards of the layout (docs/design.md, "Layers"): folders are layered and imports point down the layers, no two
modules (and no two folders) import each other in a circle, pure maths imports no model code, and the light
commands (validate, memory, ls) import no transformers.

Every ``import`` in kveval's source is read with ``ast``, function-local (lazy) imports and ``TYPE_CHECKING``
imports included: a lazy import still makes one module depend on another. The unit of the layering is the folder
(a package directly under ``kveval/``, or a module there): every module of a folder is in the folder's layer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kveval"

# Folders (and top-level modules) by layer, lowest first: a module may import modules of its own layer or below,
# never above; inside a layer, folders may import each other only one way (no circle, checked below).
LAYERS: list[tuple[str, ...]] = [
    ("kveval", "kveval.errors", "kveval.units", "kveval.paths", "kveval.fileio", "kveval.schema", "kveval.progress",
     "kveval.stats", "kveval.rope", "kveval.gguf", "kveval.task_definitions", "kveval.native",
     "kveval.plugins", "kveval.messages"),  # foundations
    ("kveval.quant",),  # pure maths: formats, granularities, specs, rotations
    ("kveval.transforms",),  # K/V transforms on top of the quantizers
    ("kveval.policy",),  # what a policy is and when a token is quantized
    ("kveval.memory", "kveval.scales"),  # the memory bill (pure arithmetic); calibrated parameters as data
    ("kveval.models", "kveval.data"),  # loading models and corpora
    ("kveval.engines",),  # what each serving engine runs, a policy in its syntax, its costs
    ("kveval.patch", "kveval.weights", "kveval.results"),  # model plumbing; weight variants; run folders
    ("kveval.report",),  # tables, figures, reports; the tasks' reporting plug-ins build on it
    ("kveval.tasks", "kveval.calibration", "kveval.parity", "kveval.inspect"),  # evaluators; calibration; parity; inspect
    ("kveval.config",),  # the closed experiment schema (built from the tasks' parameters)
    ("kveval.sweep",),  # many runs
    ("kveval.commands",),  # the body of each verb
    ("kveval.cli", "kveval.__main__"),  # argument parsing only
]

# Pure maths and data: no model code, no plotting, no dataframes, whatever the function.
PURE = ("kveval.quant", "kveval.transforms", "kveval.scales.ranges", "kveval.scales.codebooks", "kveval.policy",
        "kveval.memory", "kveval.stats", "kveval.rope", "kveval.errors", "kveval.units", "kveval.gguf")
MODEL_CODE = ("transformers", "lm_eval", "datasets", "accelerate", "matplotlib", "pandas", "kveval.patch",
              "kveval.models", "kveval.tasks", "kveval.report", "kveval.commands", "kveval.results")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "tasks":  # the top-level task definitions are installed as kveval.task_definitions
        parts[0:1] = ["kveval", "task_definitions"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in the file (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from kveval.patch import attention`` imports the submodule kveval.patch.attention (and nothing
            # that the package's face defines)
            subs = {f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")}
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return out


def _folder(module: str) -> str:
    """The folder a module belongs to: ``kveval.patch.cache`` -> ``kveval.patch``, ``kveval.cli`` -> itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer(module: str) -> int | None:
    folder = _folder(module)
    for i, folders in enumerate(LAYERS):
        if folder in folders:
            return i
    return None


SOURCES = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tasks").glob("__init__.py")])
GRAPH = {_module_name(p): {i for i in _imports(p) if i.startswith("kveval.") or i == "kveval"} for p in SOURCES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (``[a, b, ..., a]``), or None: a depth-first search for an edge back to the path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _folder_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, imps in GRAPH.items():
        out.setdefault(_folder(mod), set()).update(_folder(i) for i in imps if _folder(i) != _folder(mod))
    return out


def test_every_module_has_a_layer():
    missing = [m for m in GRAPH if _layer(m) is None]
    assert not missing


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    me = _module_name(path)
    mine = _layer(me)
    upward = sorted(f"{me} (layer {mine}) -> {imp} (layer {_layer(imp)})" for imp in GRAPH[me]
                    if (_layer(imp) or 0) > mine)
    assert not upward


def test_no_two_modules_import_each_other_in_a_circle():
    internal = {m: {i for i in imps if i in GRAPH and i != m} for m, imps in GRAPH.items()}
    assert _cycle(internal) is None


def test_no_two_folders_import_each_other_in_a_circle():
    assert _cycle(_folder_graph()) is None


@pytest.mark.parametrize("path", [p for p in SOURCES if _module_name(p).startswith(PURE)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_maths_imports_no_model_code(path):
    bad = sorted(imp for imp in _imports(path) if imp.startswith(MODEL_CODE))
    assert not bad


def test_the_guards_see_a_violation():
    """The checks above can fail: a fake module in the pure layer that imports transformers and the verbs lazily
    is caught, and the circle search finds a circle of three and passes a chain."""
    fake = PACKAGE / "quant" / "_guard_probe.py"
    try:
        fake.write_text("def f():\n    import transformers\n    from kveval.commands import run\n")
        imports = _imports(fake)
        assert "transformers" in imports and "kveval.commands.run" in imports
        assert _layer("kveval.commands.run") > _layer(_module_name(fake))
    finally:
        fake.unlink()
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


LIGHT = """
import sys
from kveval.cli import app  # the CLI module itself
from kveval.config import load_config
from kveval.commands.memory import memory_command
load_config("configs/int4_g64.yaml")
memory_command(shape="llama-7b-mha", context=2048, kv="int8,int4_g64")
heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("transformers", "matplotlib", "lm_eval")})
print(",".join(heavy))
"""


def test_validate_and_memory_import_no_model_code():
    out = subprocess.run([sys.executable, "-c", LIGHT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_config_imports_no_evaluator():
    """The config schema is built from the tasks' parameter modules alone (``kveval.tasks.task_params``)."""
    code = ("import sys, kveval.config; print(sorted(m for m in sys.modules if m.startswith('kveval.tasks.') "
            "and m.endswith(('.task', '.decoding', '.finite', '.runner'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


#: The size of a unit a contributor must hold in mind: a class, a module (docs/design.md, "Layers").
MAX_CLASS_LINES, MAX_MODULE_LINES = 250, 600


def _sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, module) of every module of kveval/ and (lines, module:Class) of every class, largest first."""
    modules, classes = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        modules.append((len(text.splitlines()), name))
        classes += [(node.end_lineno - node.lineno + 1, f"{name}:{node.name}") for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.ClassDef) and node.end_lineno is not None]
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def test_no_class_or_module_outgrows_its_bound():
    modules, classes = _sizes()
    assert [m for m in modules if m[0] > MAX_MODULE_LINES] == []
    assert [c for c in classes if c[0] > MAX_CLASS_LINES] == []
    assert classes and classes[0][0] > 100  # the measure sees classes at all
