"""Model configs kveval cannot model, and policies written for another design: one line naming the config field or
the design, at `kveval memory` and at `kveval validate` as `kveval run` refuses them, never billed as another
design and never a traceback."""

from __future__ import annotations

import json

import pytest

MLA = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
       "hidden_size": 512, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
       "intermediate_size": 1024, "vocab_size": 1000}


def _folder(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("rank", [0, -1])
def test_an_mla_rank_of_zero_or_below_is_refused_not_billed_as_per_head_kv(h, tmp_path, rank):
    folder = _folder(tmp_path, {**MLA, "kv_lora_rank": rank})
    h.assert_user_error(h.invoke("memory", "--model", folder), "kv_lora_rank", str(rank))


def test_an_mla_config_without_its_rope_part_is_refused(h, tmp_path):
    """(A missing qk_rope_head_dim is transformers' default, 64, which the model then has: only an empty one is
    missing.)"""
    folder = _folder(tmp_path, {**MLA, "qk_rope_head_dim": 0})
    h.assert_user_error(h.invoke("memory", "--model", folder), "qk_rope_head_dim")


def test_a_per_layer_head_dim_is_one_line(h, tmp_path):
    folder = _folder(tmp_path, {**MLA, "model_type": "llama", "kv_lora_rank": None, "head_dim": [64, 64, 128, 128]})
    h.assert_user_error(h.invoke("memory", "--model", folder), "head_dim")


def test_validate_applies_the_mla_width_checks_of_run(h, tmp_path):
    """int4_g128 on DeepSeek's latent: c_kv (512) divides, k_pe (64) does not; the run refuses it, so validate does."""
    raw = h.tiny_raw(tmp_path / "o", model="builtin:tiny-deepseek-v3", kv=["int4_g128"])
    h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)), "group_size 128",
                        "k_pe, 64 wide")


def test_a_ds_mla_preset_on_a_gqa_model_is_refused_everywhere(h, tmp_path):
    raw = h.tiny_raw(tmp_path / "o", kv=["vllm_fp8_ds_mla"])
    h.assert_user_error(h.invoke("validate", h.write_config(tmp_path / "c.yaml", raw)), "vllm_fp8_ds_mla",
                        "MLA latent cache only", "per-head K/V")
    h.assert_user_error(h.invoke("memory", "--shape", "llama-3.1-8b", "--kv", "int8,vllm_fp8_ds_mla"),
                        "MLA latent cache only")
    out = h.invoke("memory", "--model", "builtin:tiny-deepseek-v3", "--kv", "vllm_fp8_ds_mla")
    assert out.exit_code == 0 and "vllm_fp8_ds_mla" in out.output


def test_every_shipped_config_fits_its_model():
    """The check that found configs/int4_g128.yaml (groups of 128 on SmolLM2's head_dim 64, which the run refused):
    every shipped config on a builtin model passes the width and design checks."""
    from pathlib import Path

    from kveval.config import load_config
    from kveval.config.checks import _check_policies_fit

    for path in sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")):
        if path.read_text().startswith("# kveval sweep "):
            continue
        cfg = load_config(path, check=False)
        if cfg.model.name.startswith("builtin:"):
            _check_policies_fit(cfg)
