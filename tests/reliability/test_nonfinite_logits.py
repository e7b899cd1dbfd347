"""NaN or infinity in what the needle task, the sensitivity scan and the lm-eval task score: every task stops with
one line (exit status 2) that says whose fault it is, and writes no NaN record, metric or scan cell.

Two ways to make logits non-finite, both on tiny random models: the model's own (finite weights whose activations
overflow float16: the baseline's logits are NaN), or a policy's (a forward hook that poisons the LM head while a
quantized cache is emulated or decoded; the baseline stays finite). The perplexity task's own cases are in
test_inputs_models.py; the check itself (``kveval.tasks.common.finite``) is shared by all tasks.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch

from kveval.models import build_tiny_model, byte_tokenizer

NEEDLE = {"context_lengths": [400], "depths": [0.5], "trials": 1, "max_new_tokens": 8, "chat_template": False}
SCAN = {"specs": ["int8"], "layers": "0-1", "seq_len": 32, "max_tokens": 64}


@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory) -> str:
    """A tiny Llama folder with finite weights whose MLP activations overflow float16 (its logits are NaN there)."""
    folder = tmp_path_factory.mktemp("overflow") / "m"
    model = build_tiny_model("tiny-llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.mul_(1000.0)
            layer.mlp.gate_proj.weight.mul_(1000.0)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


@contextlib.contextmanager
def _nan_head(model):
    handle = model.lm_head.register_forward_hook(lambda m, i, o: o * float("nan"))
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture
def nan_under_policies(monkeypatch):
    """Every forward pass under a quantized cache (emulated, or the real cache while generating) gives NaN logits;
    the unpatched model (the baseline) stays finite."""
    import kveval.patch as patch

    real_emulate = patch.emulate

    @contextlib.contextmanager
    def poisoned(model, policy, **kw):
        with real_emulate(model, policy, **kw) as emu:
            if policy.is_none:
                yield emu  # an all-none policy (the lm-eval bridge's baseline): the model's own logits
                return
            with _nan_head(model):
                yield emu

    monkeypatch.setattr(patch, "emulate", poisoned)
    return poisoned


def _run(h, tmp_path, task: dict, *, model="builtin:tiny-llama", command="run"):
    raw = h.tiny_raw(tmp_path / "out", model=model, tasks=[task])
    return h.invoke(command, h.write_config(tmp_path / "c.yaml", raw))


def _records(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [value] if isinstance(value, float) else []


def _assert_nothing_non_finite(out: Path) -> None:
    """No metrics.json, and no non-finite number in any record that was written before the stop."""
    assert not (out / "metrics.json").exists(), "no metrics from a run that stopped"
    for rec in _records(out):
        assert all(math.isfinite(x) for x in _numbers(rec)), rec


# --- needle -------------------------------------------------------------------------------------------------------


def test_needle_with_a_model_that_overflows_float16(h, tmp_path, overflowing_model):
    result = _run(h, tmp_path, {"needle": NEEDLE}, model={"name": overflowing_model, "dtype": "float16"})
    h.assert_user_error(result, "the model's own logits hold NaN", "needle trial 0 (context 400, depth 0.5)",
                        "float16", "model.dtype float32")
    _assert_nothing_non_finite(tmp_path / "out")
    assert _records(tmp_path / "out") == [], "the baseline's trial is not recorded"


def test_needle_with_a_policy_whose_logits_are_nan(h, tmp_path, nan_under_policies):
    result = _run(h, tmp_path, {"needle": NEEDLE})
    h.assert_user_error(result, "policy 'int8'", "hold NaN", "needle trial 0", "quantizer", "emulation")
    recs = _records(tmp_path / "out")
    assert [r["policy"] for r in recs] == ["baseline"], "the baseline's trial is kept, the policy's never written"
    _assert_nothing_non_finite(tmp_path / "out")


def test_needle_generation_with_nan_logits_is_not_an_answer(h, tmp_path, monkeypatch):
    """The teacher-forced score is finite, but generating through the real quantized cache gives NaN logits: the
    trial stops with the line instead of recording whatever greedy decoding made of NaN."""
    import kveval.patch as patch

    real_cache_kwargs = patch.cache_kwargs
    hooks = []

    def poisoned_cache_kwargs(model, cache):
        hooks.append(model.lm_head.register_forward_hook(lambda m, i, o: o * float("nan")))
        return real_cache_kwargs(model, cache)

    monkeypatch.setattr(patch, "cache_kwargs", poisoned_cache_kwargs)
    try:
        result = _run(h, tmp_path, {"needle": NEEDLE})
    finally:
        for hook in hooks:
            hook.remove()
    h.assert_user_error(result, "policy 'int8'", "needle trial 0 (context 400, depth 0.5) (generation)")
    assert [r["policy"] for r in _records(tmp_path / "out")] == ["baseline"]


# --- the sensitivity scan -----------------------------------------------------------------------------------------


def test_scan_with_a_model_that_overflows_float16(h, tmp_path, overflowing_model):
    result = _run(h, tmp_path, {"sensitivity": SCAN}, model={"name": overflowing_model, "dtype": "float16"},
                  command="scan")
    h.assert_user_error(result, "the model's own logits hold NaN", "scan window 0", "float16")
    assert _records(tmp_path / "out") == []
    _assert_nothing_non_finite(tmp_path / "out")


def test_scan_cell_whose_logits_are_nan(h, tmp_path, monkeypatch):
    import kveval.tasks.sensitivity.scan as scan

    real_replay = scan.replay

    def nan_for_layer_1(model, prefix, start, policy):
        logits = real_replay(model, prefix, start, policy)
        return logits * float("nan") if start == 1 else logits

    monkeypatch.setattr(scan, "replay", nan_for_layer_1)
    result = _run(h, tmp_path, {"sensitivity": SCAN}, command="scan")
    h.assert_user_error(result, "scan cell layer 1 keys under int8", "hold NaN", "scan window 0", "quantizer")
    recs = _records(tmp_path / "out")
    assert {r.get("layer") for r in recs} == {None, 0}, "the baseline and layer 0's cells are kept, layer 1's never"
    _assert_nothing_non_finite(tmp_path / "out")


def test_scan_cell_whose_quantizer_gets_nan(h, tmp_path, monkeypatch):
    import kveval.tasks.sensitivity.scan as scan

    real_replay = scan.replay

    def refusing(model, prefix, start, policy):
        if policy.is_none:  # the replay's self-check at full precision
            return real_replay(model, prefix, start, policy)
        raise ValueError("non-finite values in input to quantize")

    monkeypatch.setattr(scan, "replay", refusing)
    result = _run(h, tmp_path, {"sensitivity": SCAN}, command="scan")
    h.assert_user_error(result, "scan cell layer 0 keys under int8", "keys or values given to its quantizer",
                        "NaN or infinity")


# --- lm-eval ------------------------------------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[2] / "tasks" / "lm_eval"
LM_EVAL = {"tasks": ["kveval_facts_mc"], "include_path": str(SHIPPED), "limit": 2}


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_lm_eval_with_a_model_that_overflows_float16(h, tmp_path, overflowing_model, offline):
    result = _run(h, tmp_path, {"lm_eval": LM_EVAL}, model={"name": overflowing_model, "dtype": "float16"})
    h.assert_user_error(result, "lm-eval task 'kveval_facts_mc'", "the model's own logits hold NaN",
                        "log-likelihood request", "float16")
    assert _records(tmp_path / "out") == []
    _assert_nothing_non_finite(tmp_path / "out")


def test_lm_eval_with_a_policy_whose_logits_are_nan(h, tmp_path, offline, nan_under_policies, monkeypatch):
    import kveval.tasks.lm_eval.bridge as bridge

    monkeypatch.setattr(bridge, "emulate", nan_under_policies)  # the bridge imported emulate by name
    result = _run(h, tmp_path, {"lm_eval": LM_EVAL})
    h.assert_user_error(result, "lm-eval task 'kveval_facts_mc'", "policy 'int8'", "hold NaN", "quantizer")
    recs = _records(tmp_path / "out")
    assert [r["policy"] for r in recs] == ["baseline"], "the baseline is recorded, the policy never"
    _assert_nothing_non_finite(tmp_path / "out")


def test_lm_eval_nan_metric_is_refused_and_nan_stderr_is_null():
    from kveval.errors import KvevalError
    from kveval.tasks.lm_eval.task import check_finite_metrics

    results = {"t": {"acc": 0.5, "acc_stderr": float("nan"), "n": 2}}
    check_finite_metrics(results, "t", "baseline")
    assert results == {"t": {"acc": 0.5, "acc_stderr": None, "n": 2}}
    with pytest.raises(KvevalError, match=r"lm-eval task 't' \(t\) under policy 'int8': metric 'acc' is nan"):
        check_finite_metrics({"t": {"acc": float("nan")}}, "t", "policy 'int8'")



def test_non_finite_kind_by_hand():
    """The check's shortcut (a finite sum proves every element finite) and its fall-through: large finite logits
    whose float32 sum overflows are finite; one NaN, or +inf beside -inf (a NaN sum), is named by its kind."""
    from kveval.tasks.common.finite import non_finite_kind

    x = torch.randn(4, 100)
    assert non_finite_kind(x) is None
    big = torch.full((4, 100), 3e38)  # finite, sum overflows to inf
    assert not torch.isfinite(big.sum()) and non_finite_kind(big) is None
    for bad, kind in ((float("nan"), "NaN"), (float("inf"), "infinity"), (-float("inf"), "infinity")):
        y = x.clone()
        y[2, 7] = bad
        assert non_finite_kind(y) == kind
    y = x.clone()
    y[0, 0], y[1, 1] = float("inf"), -float("inf")
    assert non_finite_kind(y) == "infinity"
    assert non_finite_kind(torch.tensor([1, 2], dtype=torch.int64)) is None
