"""Guards of the layout (docs/design.md, "Layers"): imports point one way, pure maths imports no model code, and
the light commands (validate, memory, ls) import no transformers.

Every ``import`` in kveval's source is read with ``ast``, function-local (lazy) imports included: a lazy import
still makes one layer depend on another.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kveval"

# Layers, lowest first: a module may import modules of its own layer or below, never above. The most specific
# prefix decides a module's layer (kveval.calibration.ranges is pure maths, kveval.calibration.calibrate a run).
LAYERS: list[tuple[str, ...]] = [
    ("kveval", "kveval.errors", "kveval.paths", "kveval.schema", "kveval.progress", "kveval.stats", "kveval.rope"),
    ("kveval.quant", "kveval.transforms", "kveval.calibration.ranges", "kveval.weights.quantize",
     "kveval.weights.interaction"),
    ("kveval.policy", "kveval.memory.bill", "kveval.memory", "kveval.calibration.scales_file", "kveval.calibration",
     "kveval.weights", "kveval.weights.spec"),
    ("kveval.models", "kveval.data", "kveval.patch", "kveval.calibration.collect", "kveval.memory.table",
     "kveval.weights.apply"),
    ("kveval.tasks", "kveval.results", "kveval.calibration.calibrate", "kveval.parity"),
    ("kveval.report", "kveval.config", "kveval.sweep"),
    ("kveval.commands",),
    ("kveval.cli", "kveval.__main__"),
]

# Pure maths and data: no model code, no plotting, no dataframes, whatever the function.
PURE = ("kveval.quant", "kveval.transforms", "kveval.calibration.ranges", "kveval.policy", "kveval.memory.bill",
        "kveval.stats", "kveval.rope", "kveval.errors")
MODEL_CODE = ("transformers", "lm_eval", "datasets", "accelerate", "matplotlib", "pandas", "kveval.patch",
              "kveval.models", "kveval.tasks", "kveval.report", "kveval.commands", "kveval.results")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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
            out.add(mod)
            # ``from kveval.patch import attention`` imports the submodule kveval.patch.attention
            out.update(f"{mod}.{a.name}" for a in node.names if (PACKAGE.parent / f"{mod}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                       or (PACKAGE.parent / f"{mod}.{a.name}".replace(".", "/")).is_dir())
    return out


def _layer(module: str) -> int | None:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = [_module_name(p) for p in SOURCES if _layer(_module_name(p)) is None]
    assert not missing


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    me = _module_name(path)
    mine = _layer(me)
    upward = sorted(f"{me} (layer {mine}) -> {imp} (layer {_layer(imp)})" for imp in _imports(path)
                    if imp.startswith("kveval") and (_layer(imp) or 0) > mine)
    assert not upward


@pytest.mark.parametrize("path", [p for p in SOURCES if _module_name(p).startswith(PURE)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_maths_imports_no_model_code(path):
    bad = sorted(imp for imp in _imports(path) if imp.startswith(MODEL_CODE))
    assert not bad


def test_the_guard_sees_a_violation(tmp_path):
    """The checks above can fail: a fake module in the pure layer that imports transformers lazily is caught."""
    fake = PACKAGE / "quant" / "_guard_probe.py"
    try:
        fake.write_text("def f():\n    import transformers\n    from kveval.commands import run\n")
        imports = _imports(fake)
        assert "transformers" in imports and "kveval.commands.run" in imports
        assert _layer("kveval.commands.run") > _layer(_module_name(fake))
    finally:
        fake.unlink()


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
