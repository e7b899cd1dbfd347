"""notebooks/analysis.ipynb runs headless (nbclient) against a results folder written in the test, and is
committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_runs import write_synthetic_run

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "analysis.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None


def test_notebook_runs_headless(tmp_path, monkeypatch):
    run = write_synthetic_run(tmp_path / "nbrun", needle=True, sensitivity=True)
    monkeypatch.setenv("KVEVAL_RUN", str(run))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # quality, bars, positions, memory, layers, needle, sensitivity, bits per layer
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


def test_a_fresh_clone_opens_the_reference_run(tmp_path, monkeypatch):
    """Without KVEVAL_RUN and without results/int4_g64 (a fresh clone), the notebook opens the committed
    results/reference; with a results/int4_g64 it opens that."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "KVEVAL_RUN" in c.source)
    monkeypatch.delenv("KVEVAL_RUN", raising=False)
    (tmp_path / "results" / "reference").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    scope: dict = {}
    exec(cell, scope)
    assert Path(scope["RUN"]) == Path("..") / "results" / "reference"
    (tmp_path / "results" / "int4_g64").mkdir()
    exec(cell, scope)
    assert Path(scope["RUN"]) == Path("..") / "results" / "int4_g64"
