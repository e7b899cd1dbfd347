"""The design check (``kveval.memory.fit.check_design``) runs once per model, policy and kind of evaluation
(``kveval.patch.layers.checked_design``): a run calls ``emulate`` once per batch and policy, and only the first call
of each (model, policy, real_cache) checks; a design the check refuses is refused at every call."""

from __future__ import annotations

import weakref

import pytest
import torch
from twopaths import ids_for

from kveval.errors import KvevalError
from kveval.models import build_tiny_model
from kveval.patch import QuantizedKVCache, emulate, layers
from kveval.policy import KVPolicy


@pytest.fixture
def checks(monkeypatch) -> list[tuple[str, bool]]:
    """``(policy name, real_cache)`` of every ``check_design`` call the test makes, from a memo of its own."""
    calls: list[tuple[str, bool]] = []
    real = layers.check_design

    def counted(arch, policy, real_cache=False):
        calls.append((policy.name, real_cache))
        return real(arch, policy, real_cache=real_cache)

    monkeypatch.setattr(layers, "check_design", counted)
    monkeypatch.setattr(layers, "_PASSED", weakref.WeakKeyDictionary())
    return calls


@torch.no_grad()
def test_emulate_checks_each_design_once(checks):
    model = build_tiny_model("tiny-llama")
    batches = [ids_for(model, 12, seed) for seed in range(3)]
    logits = {}
    for ids in batches:  # as a run does: every batch under every policy
        for name in ("int8", "kivi2"):
            with emulate(model, KVPolicy.preset(name), prefill_len=4):
                logits.setdefault(name, []).append(model(ids).logits)
    assert checks == [("int8", False), ("kivi2", False)]
    # the check skipped, the emulation is the same: a fresh memo computes the same logits
    layers._PASSED.clear()
    with emulate(model, KVPolicy.preset("kivi2"), prefill_len=4):
        assert torch.equal(model(batches[-1]).logits, logits["kivi2"][-1])
    assert checks[-1] == ("kivi2", False)

    # the real cache has checks of its own (real_cache=True): once too
    n = len(checks)
    for _ in range(2):
        QuantizedKVCache(model, KVPolicy.preset("int8"))
    assert checks[n:] == [("int8", True)]
    # another model is checked for itself
    other = build_tiny_model("tiny-llama")
    with emulate(other, KVPolicy.preset("int8")):
        pass
    assert checks[-1] == ("int8", False) and len(checks) == n + 2


def test_a_refused_design_is_refused_at_every_call(checks):
    model = build_tiny_model("tiny-llama")
    policy = KVPolicy.preset("vllm_fp8_ds_mla")  # an MLA latent format, on a model with per-head K/V
    for _ in range(3):
        with pytest.raises(KvevalError, match="supports an MLA latent cache only; this model has per-head K/V"):
            with emulate(model, policy):
                pass
    with pytest.raises(KvevalError, match="supports an MLA latent cache only"):
        QuantizedKVCache(model, policy)
    assert checks == [(policy.name, False)] * 3 + [(policy.name, True)]
    # a design that passes on the same model is remembered beside it
    for _ in range(2):
        with emulate(model, KVPolicy.preset("int8")):
            pass
    assert checks[4:] == [("int8", False)]
