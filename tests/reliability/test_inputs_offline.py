"""A config naming a hub model or a named HF corpus that cannot be loaded here: with the hub out of reach,
`kveval validate` (and `kveval run`, before anything is written) says in one line what is missing from the local
cache and how to get it; a model whose files the cache holds (config, tokenizer, every weight shard) passes."""

from __future__ import annotations

import json

import pytest

REPO = "someorg/some-model"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HuggingFace hub cache, the hub out of reach (offline by the environment). Returns a function that
    puts files into REPO's snapshot there, as the hub writes them (refs/main naming the snapshot)."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache / "models--someorg--some-model" / "snapshots" / "0123abcd"

    def put(name: str, text: str = "{}") -> None:
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
        (snapshot / name).write_text(text)

    return put


def _validate(h, tmp_path, **extra):
    raw = h.tiny_raw(tmp_path / "out", **extra)
    return h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw))


def test_uncached_hub_model_is_one_line_naming_the_download(h, tmp_path, hub_cache):
    line = h.assert_user_error(_validate(h, tmp_path, model=REPO), "not in the local HuggingFace cache",
                               f"hf download {REPO}")
    assert "hub cannot be reached" in line


def test_cached_config_without_tokenizer_or_weights(h, tmp_path, hub_cache):
    hub_cache("config.json")
    h.assert_user_error(_validate(h, tmp_path, model=REPO), "no tokenizer file")
    hub_cache("tokenizer.json")
    h.assert_user_error(_validate(h, tmp_path, model=REPO), "no safetensors weights")


def test_a_missing_shard_of_an_index_is_named(h, tmp_path, hub_cache):
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"):
        hub_cache(name)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    hub_cache("model.safetensors.index.json", json.dumps(index))
    h.assert_user_error(_validate(h, tmp_path, model=REPO), "1 of 2 weight shards",
                        "model-00002-of-00002.safetensors")
    hub_cache("model.safetensors.index.json", "[1, 2]")
    h.assert_user_error(_validate(h, tmp_path, model=REPO), "not a weight index")


def test_a_fully_cached_hub_model_passes(h, tmp_path, hub_cache):
    from kveval.models.hub import check_hub_model_cached

    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        hub_cache(name)
    check_hub_model_cached(REPO)  # raises KvevalError when anything is missing
    hub_cache("model.safetensors.index.json", json.dumps({"weight_map": {"a": "model.safetensors"}}))
    check_hub_model_cached(REPO)


def test_uncached_named_corpus_is_one_line_at_validate_and_at_run(h, tmp_path, hub_cache):
    h.assert_user_error(_validate(h, tmp_path, data="wikitext2"), "dataset 'wikitext2'",
                        "not in the local HuggingFace datasets cache", "data: builtin")
    raw = h.tiny_raw(tmp_path / "out", data="pg19")
    h.assert_user_error(h.invoke("run", h.write_config(tmp_path / "c.yaml", raw)), "dataset 'pg19'")
    assert not (tmp_path / "out").exists()


def test_the_printed_download_command_is_a_program(monkeypatch):
    """The line the dataset error prints for the user to paste parses as Python (the quoting survived)."""
    import ast
    import re

    from kveval.data import check_corpus_available
    from kveval.errors import KvevalError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KvevalError) as e:
        check_corpus_available("wikitext2")
    code = re.search(r'python -c "([^"]+)"', str(e.value))
    assert code is not None, str(e.value)
    ast.parse(code.group(1))


def test_a_cached_hub_models_shape_is_checked_without_loading_it(h, tmp_path, hub_cache):
    """The cached config.json gives the shape: a group size that does not divide its head_dim is refused at
    validate, as the run would refuse it after loading the weights."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 256, "head_dim": 64, "intermediate_size": 512, "vocab_size": 1000}
    for name, text in (("config.json", json.dumps(config)), ("tokenizer.json", "{}"), ("model.safetensors", "")):
        hub_cache(name, text)
    h.assert_user_error(_validate(h, tmp_path, model=REPO, kv=["int4_g128"]), "group_size 128 does not divide "
                        "head_dim 64")
