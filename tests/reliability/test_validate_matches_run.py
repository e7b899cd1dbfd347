"""`kveval validate` says what `kveval run` will say (issue 54): a local model folder whose weight index names a
missing shard is refused by both; a prompt file's short prompts with a long generation are accepted by both (the
config check added continuation_tokens, which a prompt file never uses, and named a key that does not exist)."""

from __future__ import annotations

import json

import pytest

from kveval.models import build_tiny_model, byte_tokenizer


def _sharded_folder(tmp_path, **config):
    folder = tmp_path / "m"
    model = build_tiny_model("tiny-llama")
    for key, value in config.items():
        setattr(model.config, key, value)
    model.save_pretrained(folder, max_shard_size="40KB")
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_a_local_index_naming_a_missing_shard_is_refused_by_validate_as_by_run(h, tmp_path):
    folder = _sharded_folder(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (folder / shards[-1]).unlink()
    raw = h.tiny_raw(tmp_path / "out", model=str(folder))
    path = h.write_config(tmp_path / "c.yaml", raw)
    h.assert_user_error(h.invoke("validate", path), "missing", shards[-1])
    h.assert_user_error(h.invoke("run", path), shards[-1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", ["{garbage", '{"weight_map": [1]}', '{"weight_map": {"a": 5}}'])
def test_a_local_index_that_is_not_one_is_refused(h, tmp_path, index):
    folder = _sharded_folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text(index)
    raw = h.tiny_raw(tmp_path / "out", model=str(folder))
    h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)), "not a weight index")


def test_a_complete_sharded_folder_passes_validate(h, tmp_path):
    folder = _sharded_folder(tmp_path)
    raw = h.tiny_raw(tmp_path / "out", model=str(folder))
    result = h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw))
    assert result.exit_code == 0, result.output


def _generation(prompts, max_new_tokens, **extra):
    return [{"generation": {"prompts": prompts, "max_new_tokens": max_new_tokens, "examples": 0, "plots": False,
                            **extra}}]


def test_short_prompts_with_a_long_generation_pass_validate_on_a_2048_token_model(h, tmp_path):
    folder = _sharded_folder(tmp_path, max_position_embeddings=2048)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc", "answer": "x"}\n')
    raw = h.tiny_raw(tmp_path / "out", model=str(folder), tasks=_generation(str(prompts), 2000))
    result = h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw))
    assert result.exit_code == 0, result.output


def test_continuations_past_the_context_name_the_keys_that_exist(h, tmp_path):
    folder = _sharded_folder(tmp_path, max_position_embeddings=2048)
    raw = h.tiny_raw(tmp_path / "out", model=str(folder), tasks=_generation("builtin", 2000, continuations=1))
    line = h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)),
                               "continuation_tokens + max_new_tokens = 2128", "2048")
    assert "seq_len" not in line
    raw = h.tiny_raw(tmp_path / "out", model=str(folder), tasks=_generation("builtin", 2100, continuations=0))
    line = h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)),
                               "max_new_tokens = 2100")
    assert "continuation_tokens" not in line


def test_thinking_on_a_model_without_a_chat_template_is_refused(h, tmp_path):
    """(issue 54, silently wrong: thinking was accepted and ignored)"""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc", "answer": "x"}\n')
    raw = h.tiny_raw(tmp_path / "out", tasks=_generation(str(prompts), 4, thinking=True))
    h.assert_user_error(h.invoke("run", h.write_config(tmp_path / "c.yaml", raw)), "thinking", "no chat template")
    assert not (tmp_path / "out").exists()
