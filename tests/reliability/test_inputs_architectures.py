"""Hostile inputs around attention designs: configs of designs kveval does not model, hand-edited shapes and
policy keys, each one line with exit status 2 (real processes where a user would meet them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kveval.errors import KvevalError
from kveval.memory import Arch
from kveval.policy import KVPolicy

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kveval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=os.environ.copy())


def _one_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "deepseek_v32", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
      "layer_types": ["indexed_attention", "full_attention"]}, "'indexed_attention' are not modelled"),
    ({"model_type": "gemma4_text", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
      "kv_sharing_modes": ["own", "reuse"]}, "reuse another layer's K/V"),
    ({"model_type": "qwen3_next", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
      "layer_types": ["linear_attention"]}, "layer types name 1 of its 2 layers"),
])
def test_memory_refuses_designs_it_does_not_model(tmp_path, config, needle):
    """The refusal comes from kveval when transformers reads the config, from transformers' config class (one line
    too) when it refuses the values itself (Gemma-4's kv_sharing_modes is a read-only property there)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvevalError, match=needle):
        Arch.from_model_config(config)
    proc = _cli("memory", "--model", str(folder), "--context", "16")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr or "could not be read" in proc.stderr, proc.stderr


def test_arch_refuses_state_layers_of_an_unknown_family():
    with pytest.raises(KvevalError, match="family kveval does not bill"):
        Arch.from_model_config({"model_type": "mystery_ssm", "num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 64, "layer_types": ["mamba", "full_attention"]})
    with pytest.raises(KvevalError, match="needs qk_rope_head_dim"):
        Arch.from_model_config({"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 64, "kv_lora_rank": 32})


def test_memory_defaults_leave_out_what_does_not_fit(tmp_path):
    """An MLA model with a 32-wide latent: the default int4_g64 cannot group it; the table leaves it out and says
    so, while naming it explicitly is one error line."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "hidden_size": 256, "kv_lora_rank": 32, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32}))
    proc = _cli("memory", "--model", str(folder), "--context", "1000")
    assert proc.returncode == 0, proc.stderr
    assert "left out (they do not fit this model): int4_g64" in proc.stdout and " 384 │" in proc.stdout
    _one_line(_cli("memory", "--model", str(folder), "--kv", "int4_g64"), "the latent c_kv, 32 wide")
    _one_line(_cli("memory", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--shape", "x"),
              "give exactly one of")


def test_a_hand_edited_shape_is_one_line():
    good = Arch.named("deepseek-v3").to_dict()
    assert Arch.from_dict(good) == Arch.named("deepseek-v3").__class__.from_dict(good)
    for bad, needle in (({**good, "mla": "512"}, "not a model shape"),
                        ({**good, "state": {"family": "mamba2"}}, "not a model shape"),
                        ({**good, "layer_kinds": ["full", "warp"]}, "layer_kinds must name"),
                        ({**good, "colour": "red"}, "not a model shape")):
        with pytest.raises(KvevalError, match=needle):
            Arch.from_dict(bad)


@pytest.mark.parametrize("cfg,needle", [({"spec": "int8", "mla": "sideways"}, "mla: expected one of latent"),
                                        ({"spec": "int8", "designs": ["gqa", "warp"]}, "designs: expected a list"),
                                        ({"spec": "int8", "designs": "gqa"}, "designs: expected a list"),
                                        ({"spec": "int8", "designs": ["mla:512"]}, "designs: expected a list")])
def test_policy_keys_of_designs_are_checked(cfg, needle):
    with pytest.raises(KvevalError, match=needle):
        KVPolicy.from_config(cfg)
