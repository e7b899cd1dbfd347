"""The emulation's key workspace (``kveval.patch.emulate.KeyWorkspace``): the chunks of one attention call copy
their keys and values into one pair of buffers instead of concatenating new tensors, so the C allocator is not
left holding a freed tensor per chunk (docs/scale.md, "Memory the process gives back"). The logits are the bits
of the concatenation, and the buffers are allocated at most twice per call."""

from __future__ import annotations

import importlib

import pytest
import torch

from kveval.patch import emulate
from kveval.policy import KVPolicy

em = importlib.import_module("kveval.patch.emulate")

#: KIVI-2's schedules on a window of 4 tokens (4 parts of keys), and sinks with a window (2 parts, index-selected)
POLICIES = {
    "kivi": {"key": {"preset": "int2_channel", "group_size": 4}, "value": "int2_g32", "residual": 4,
             "residual_mode": {"key": "block", "value": "sliding_lag"}},
    "sinks": {"spec": "int4_g32", "sink_tokens": 3, "residual": 5},
}


def _concatenated(self, parts):
    """What ``_chunk`` did before the workspace: a new tensor per chunk."""
    keys, values = [], []
    for k, v, sel in parts:
        keys.append(k[:, :, sel] if isinstance(sel, slice) else k.index_select(2, sel))
        values.append(v[:, :, sel] if isinstance(sel, slice) else v.index_select(2, sel))
    return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama64"])
def test_the_workspace_gives_the_bits_of_the_concatenation(name, fixture, request, monkeypatch):
    model, _ = request.getfixturevalue(fixture)
    monkeypatch.setattr(em, "CHUNK_ROWS", 7)  # many chunks of a 60-token pass
    ids = torch.randint(4, model.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(8))
    policy = KVPolicy.from_config(POLICIES[name])
    spaces = []
    init = em.KeyWorkspace.__init__

    def kept(self, *args):
        init(self, *args)
        spaces.append(self)

    monkeypatch.setattr(em.KeyWorkspace, "__init__", kept)
    with torch.no_grad(), emulate(model, policy):
        got = model(ids).logits
    assert spaces and all(1 <= s.allocations <= 2 for s in spaces)  # one per attention call, grown at most once
    assert all(s.keys.shape[2] <= 2 * ids.shape[1] for s in spaces)
    monkeypatch.setattr(em.KeyWorkspace, "filled", _concatenated)
    with torch.no_grad(), emulate(model, policy):
        want = model(ids).logits
    assert torch.equal(got, want)
