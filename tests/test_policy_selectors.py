"""The layer selector grammar (kveval/policy/selectors.py) and its use in per-layer overrides."""

from __future__ import annotations

import pytest

from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.policy.selectors import check_syntax, layers_of


@pytest.mark.parametrize(("selector", "want"), [
    (5, [5]),
    ("5", [5]),
    ("-1", [29]),
    ("0-3", [0, 1, 2, 3]),
    ("0 - 1, last 2", [0, 1, 28, 29]),
    ("first 2", [0, 1]),
    ("last 4", [26, 27, 28, 29]),
    ("0,2,7", [0, 2, 7]),
    ("3, 3, 1-3", [1, 2, 3]),
    ("all", list(range(30))),
    ("First 40", list(range(30))),
])
def test_layers_of(selector, want):
    assert layers_of(selector, 30) == want


@pytest.mark.parametrize(("selector", "message"), [
    ("3-1", "reversed; write it as '1-3'"),
    ("0,,2", "not understood"),
    ("top 2", "not understood"),
    ("", "not understood"),
    ("1.5", "not understood"),
])
def test_bad_syntax_is_refused_without_the_model(selector, message):
    with pytest.raises(KvevalError, match=message):
        check_syntax(selector)


@pytest.mark.parametrize("selector", ["30", "-31", "28-30"])
def test_layers_outside_the_model(selector):
    with pytest.raises(KvevalError, match="the model has 30 layers"):
        layers_of(selector, 30)


def test_overrides_use_the_grammar():
    policy = KVPolicy.from_config({"spec": "int4_g64", "layers": {"0-1": "int8", "last 1": {"value": "int2_g32"}}})
    names = [tuple(s.describe() for s in policy.specs_for_layer(i, 4)) for i in range(4)]
    int8, int4, int2 = (KVPolicy.preset(n).key.describe() for n in ("int8", "int4_g64", "int2_g32"))
    assert names == [(int8, int8), (int8, int8), (int4, int4), (int4, int2)]
    with pytest.raises(KvevalError, match="reversed"):
        KVPolicy.from_config({"spec": "int8", "layers": {"3-1": "int4_g64"}})
    with pytest.raises(KvevalError, match="names layer 9"):
        KVPolicy.from_config({"spec": "int8", "layers": {"9": "int4_g64"}}).check_model(num_layers=4, head_dim=64)
