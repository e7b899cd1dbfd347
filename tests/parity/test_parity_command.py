"""kveval.parity.compare and the ``kveval parity`` command, on crafted logits and a stand-in system."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from kveval.cli import app
from kveval.parity import SYSTEMS, compare


def _logits(T: int, V: int, seed: int) -> torch.Tensor:
    return torch.randn(T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_compare_identical_sides():
    ids = torch.tensor([1, 2, 3, 0, 1, 2])
    fp, q = _logits(6, 4, 0), _logits(6, 4, 1)
    row = compare("sys", "q/q", "preset", ids, ref_fp=fp, ref=q, kv_fp=fp, kv=q)
    assert row.tokens == 5
    assert row.kld_between == 0.0 and row.ratio == 0.0 and row.max_abs_logit_gap == 0.0
    assert row.ref_kld == pytest.approx(row.kv_kld) and row.ref_kld > 0


def test_compare_against_a_hand_computed_kld():
    """Two positions, vocabulary 2: P_ref = softmax([0, 0]) = (1/2, 1/2), P_kv = softmax([0, ln 3]) = (1/4, 3/4):
    KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3) at both positions."""
    ids = torch.tensor([0, 1, 1])
    ref = torch.zeros(3, 2, dtype=torch.float64)
    kv = torch.tensor([[0.0, math.log(3)]] * 3, dtype=torch.float64)
    row = compare("sys", "t", "p", ids, ref_fp=ref, ref=ref, kv_fp=ref, kv=kv)
    assert row.kld_between == pytest.approx(0.5 * math.log(4 / 3), abs=1e-15)
    assert row.kld_between_by_position == pytest.approx([0.5 * math.log(4 / 3)] * 2, abs=1e-15)
    assert row.ref_kld == 0.0 and row.ratio == math.inf
    # kveval's own side: KL(P_fp || P_kv) against its baseline, and the ΔPPL of target 1 (p 1/2 -> 3/4)
    assert row.kv_kld == pytest.approx(0.5 * math.log(4 / 3), abs=1e-15)
    # targets [1, 1]: p goes from 1/2 to 3/4, so PPL goes from 2 to 4/3
    assert row.kv_delta_ppl_pct == pytest.approx(100 * ((4 / 3) / 2 - 1), abs=1e-12)


@pytest.fixture
def fake_system(monkeypatch):
    module = types.ModuleType("kveval_fake_parity_system")

    def run(model_name, types=None, tokens=8):
        ids = torch.arange(tokens) % 3
        rows = []
        for i, t in enumerate(types or ["a", "b"]):
            fp, q = _logits(tokens, 3, 0), _logits(tokens, 3, 10 + i)
            rows.append(compare("fake", t, f"preset_{t}", ids, ref_fp=fp, ref=q, kv_fp=fp, kv=q * (1 + 0.1 * i)))
        return rows

    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SYSTEMS, "fake", module.__name__)
    return module


def test_parity_command_writes_the_report(fake_system, tmp_path):
    out = tmp_path / "p"
    result = CliRunner().invoke(app, ["parity", "fake", "--types", "a,b,c", "--tokens", "12", "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "parity.json").read_text())
    assert [r["cache_type"] for r in doc["rows"]] == ["a", "b", "c"]
    assert doc["rows"][0]["kld_between"] == 0.0 and doc["rows"][1]["kld_between"] > 0
    assert "| a | preset_a |" in (out / "parity.md").read_text()
    assert (out / "plots" / "parity_fake.png").stat().st_size > 1000


def test_unknown_system_is_one_line(fake_system, tmp_path):
    result = CliRunner().invoke(app, ["parity", "fak", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown system 'fak'; did you mean 'fake'?" in result.output
    assert not (tmp_path / "x").exists()


@pytest.fixture
def fake_llamacpp_like(monkeypatch):
    """A stand-in system whose run takes llama.cpp's options and records what it was given."""
    module = types.ModuleType("kveval_fake_parity_options")
    seen: dict = {}

    def run(model_name, types=None, tokens=8, rotation=True, layers=None, noise_floor=False):
        seen.update(rotation=rotation, layers=layers, noise_floor=noise_floor)
        ids = torch.arange(tokens) % 3
        fp = _logits(tokens, 3, 0)
        return [compare("opts", "q", "preset_q", ids, ref_fp=fp, ref=fp, kv_fp=fp, kv=fp)]

    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SYSTEMS, "opts", module.__name__)
    return seen


@pytest.mark.parametrize(("args", "expected"), [
    ([], {"rotation": True, "layers": None, "noise_floor": False}),
    (["--rotation", "off", "--layers", "2"], {"rotation": False, "layers": 2, "noise_floor": False}),
    (["--rotation", "both", "--noise-floor"], {"rotation": None, "layers": None, "noise_floor": True}),
])
def test_parity_options_reach_the_system(fake_llamacpp_like, tmp_path, args, expected):
    result = CliRunner().invoke(app, ["parity", "opts", "--tokens", "6", "-o", str(tmp_path / "o"), *args])
    assert result.exit_code == 0, result.output
    assert fake_llamacpp_like == expected


@pytest.mark.parametrize(("system", "args", "message"), [
    ("opts", ["--rotation", "sideways"], "--rotation must be one of on, off, both; got 'sideways'"),
    ("opts", ["--layers", "0"], "--layers must be a positive number of layers; got 0"),
    ("fake", ["--rotation", "off"], "the fake parity does not take --rotation"),
    ("fake", ["--layers", "2", "--noise-floor"], "the fake parity does not take --layers, --noise-floor"),
])
def test_parity_option_errors_are_one_line(fake_system, fake_llamacpp_like, tmp_path, system, args, message):
    result = CliRunner().invoke(app, ["parity", system, "-o", str(tmp_path / "x"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
