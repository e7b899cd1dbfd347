"""The general rotation transform (``rotate``) and the policies' ``rotate:`` key: matrices by hand, hooks, both
modes (kept in the cache with Q/output hooks; undone on read after pre_rope), emulation equal to real-cache
decoding in float64, the memory bill unchanged, and bad input in one line."""

from __future__ import annotations

import math

import pytest
import torch
from twopaths import decoded_logits, emulated_logits, ids_for

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy
from kveval.quant.rotation import random_matrix, rotation_matrix
from kveval.transforms import Rotate, TransformContext

CTX = TransformContext(layer=0, head_dim=2)


def test_hadamard_worked_example_and_round_trip():
    r = Rotate(kind="hadamard", keep=False)
    k = torch.tensor([[[[3.0, 1.0]]]], dtype=torch.float64)
    stored = r.key_in(k, CTX)
    torch.testing.assert_close(stored, torch.tensor([[[[4.0, 2.0]]]], dtype=torch.float64) / math.sqrt(2))
    torch.testing.assert_close(r.key_out(stored, CTX), k)
    assert not r.has_query_hook and not r.keeps_keys_transformed


def test_matrices_by_hand():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / math.sqrt(2)
    # block 2 on head_dim 4: two copies of H_2 on the diagonal
    expected = torch.zeros(4, 4, dtype=torch.float64)
    expected[:2, :2] = h2
    expected[2:, 2:] = h2
    torch.testing.assert_close(rotation_matrix("hadamard", 2, 0, 4), expected)
    # random signs then the Hadamard matrix: diag(s) H with s from the seeded generator
    signs = random_matrix("signs", 7, 4)
    torch.testing.assert_close(rotation_matrix("hadamard_signs", 0, 7, 4), signs @ rotation_matrix("hadamard", 0, 0, 4))
    assert set(torch.diagonal(signs).tolist()) <= {-1.0, 1.0}
    for kind in ("hadamard", "hadamard_signs", "orthogonal"):
        m = rotation_matrix(kind, 0, 3, 16)
        torch.testing.assert_close(m @ m.T, torch.eye(16, dtype=torch.float64), atol=1e-12, rtol=0)
    # each layer draws its own random matrix
    k = torch.randn(1, 1, 3, 16, dtype=torch.float64)
    r = Rotate(kind="orthogonal", seed=5)
    a = r.key_in(k, TransformContext(layer=0, head_dim=16))
    b = r.key_in(k, TransformContext(layer=1, head_dim=16))
    torch.testing.assert_close(a, k @ random_matrix("orthogonal", 5, 16))
    torch.testing.assert_close(b, k @ random_matrix("orthogonal", 6, 16))


@pytest.mark.parametrize("kind", ["hadamard", "hadamard_signs", "orthogonal"])
def test_kept_rotation_preserves_scores_and_output(kind):
    ctx = TransformContext(layer=2, head_dim=8)
    r = Rotate(kind=kind, seed=1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(r.query(q, ctx) @ r.key_in(k, ctx).transpose(-1, -2), q @ k.transpose(-1, -2))
    torch.testing.assert_close(r.output(r.value_in(v, ctx), ctx), v)
    assert r.keeps_keys_transformed and r.keeps_values_transformed
    assert torch.equal(r.key_out(k, ctx), k)  # the cache stays rotated


def test_policy_rotate_key_places_the_transform():
    kept = KVPolicy.from_config({"spec": "int4_g32", "rotate": "hadamard", "transforms": [{"name": "query_fp8"}]})
    assert [t.name for t in kept.transforms] == ["rotate", "query_fp8"]
    undone = KVPolicy.from_config({"spec": "int4_g32", "pre_rope": True, "rotate": {"kind": "orthogonal"}})
    assert undone.transforms == (Rotate(kind="orthogonal", keep=False),)
    assert [t.name for t in undone.transform_sequence()] == ["pre_rope", "rotate"]
    assert KVPolicy.from_config(undone.to_config()) == undone  # the resolved form round-trips
    assert KVPolicy.from_config({"preset": "int4_g32", "rotate": "none"}).transforms == ()


@pytest.mark.parametrize(("rotate", "message"), [
    ("hadamrd", "unknown rotation 'hadamrd'; did you mean 'hadamard'?"),
    ({"kind": "hadamard", "blok": 4}, "unknown key 'blok'; did you mean 'block'?"),
    ({"block": 3}, "'block' must be 0 (the whole head_dim) or a power of two; got 3"),
    ({"seed": -1, "kind": "orthogonal"}, "'seed' must be a non-negative integer"),
    (5, "expected a rotation kind"),
])
def test_bad_rotate_is_one_line(rotate, message):
    with pytest.raises(KvevalError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        KVPolicy.from_config({"spec": "int4_g32", "rotate": rotate})


def test_kept_rotation_with_pre_rope_and_odd_head_dim_are_refused():
    with pytest.raises(KvevalError, match="must come before 'pre_rope'"):
        KVPolicy.from_config({"spec": "int4_g32", "pre_rope": True, "rotate": {"keep": True}})
    policy = KVPolicy.from_config({"spec": "int8", "rotate": "hadamard"})
    with pytest.raises(KvevalError, match="power-of-two block dividing head_dim 48"):
        policy.check_model(4, 48)
    with pytest.raises(KvevalError, match="power-of-two block dividing head_dim 48"):
        kv_bytes(Arch(layers=2, kv_heads=2, head_dim=48), policy, 100)


POLICIES = {
    "kept_hadamard": {"spec": "int4_g32", "rotate": "hadamard", "residual": 3, "sink_tokens": 1},
    "kept_signs_keys": {"key": "int2_g32", "value": "int8", "rotate": {"kind": "hadamard_signs", "on": "key"}},
    "pre_rope_orthogonal": {"spec": "int4_g32", "pre_rope": True, "rotate": {"kind": "orthogonal", "seed": 3},
                            "residual": 2},
    "undone_values_block": {"spec": "int2_g32", "rotate": {"block": 8, "keep": False, "on": "value"}},
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_emulation_equals_decoding(name, fixture, request):
    model, _ = request.getfixturevalue(fixture)
    policy = KVPolicy.from_config(POLICIES[name])
    ids = ids_for(model, 24)
    decoded, cache = decoded_logits(model, ids, policy, prefill_len=5)
    torch.testing.assert_close(emulated_logits(model, ids, policy, prefill_len=5), decoded, rtol=0, atol=1e-9)
    # a rotation stores nothing: the bill is the unrotated policy's, and the real cache holds it
    plain = {k: v for k, v in POLICIES[name].items() if k != "rotate"}
    arch = Arch.from_model(model)
    bill = kv_bytes(arch, KVPolicy.from_config(plain), 24, fp_bytes=8, prompt=5)
    assert cache.nbytes()["total"] == bill.total
    # and it changes the quantized result
    assert (emulated_logits(model, ids, KVPolicy.from_config(plain), prefill_len=5) - decoded).abs().max() > 1e-6


@pytest.mark.parametrize("rotate", ["hadamard", {"kind": "orthogonal", "keep": False}])
def test_full_precision_rotation_leaves_logits_unchanged(tiny_llama64, rotate):
    model, _ = tiny_llama64
    ids = ids_for(model, 16)
    policy = KVPolicy.from_config({"spec": "none", "rotate": rotate})
    plain = emulated_logits(model, ids, KVPolicy.from_config({"spec": "none"}))  # the same (float64) norms
    torch.testing.assert_close(emulated_logits(model, ids, policy), plain, rtol=0, atol=1e-10)
    torch.testing.assert_close(decoded_logits(model, ids, policy)[0], plain, rtol=0, atol=1e-10)
