"""Values that passed the checks and then crashed the run (issue 54): a head count of 0, a prompt holding a lone
surrogate, a temperature so small that the scaled logits overflow, lm-eval sampling at temperature 0, Gemma-4's
per-layer head sizes and KV sharing, a plan whose arch was edited by hand. Each is one line and exit status 2,
before anything is written."""

from __future__ import annotations

import json

import pytest


def _gen_raw(h, tmp_path, **params):
    return h.tiny_raw(tmp_path / "out", tasks=[{"generation": {"tasks_per_kind": 1, "continuations": 0,
                                                               "max_new_tokens": 4, **params}}])


# --- a head count of 0 ----------------------------------------------------------------------------------------


def _folder_with_heads(tmp_path, heads):
    from kveval.models import build_tiny_model, byte_tokenizer

    folder = tmp_path / "m"
    build_tiny_model("tiny-llama").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_attention_heads"] = heads
    config.pop("head_dim", None)  # transformers then divides hidden_size by the heads
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("heads", [0, -2])
def test_a_local_config_with_no_attention_heads_is_one_line(h, tmp_path, heads):
    folder = _folder_with_heads(tmp_path, heads)
    raw = h.tiny_raw(tmp_path / "out", model=str(folder))
    path = h.write_config(tmp_path / "c.yaml", raw)
    h.assert_user_error(h.invoke("validate", path), "num_attention_heads", str(heads))
    h.assert_user_error(h.invoke("run", path), "num_attention_heads")
    assert not (tmp_path / "out").exists()
    h.assert_user_error(h.invoke("memory", "--model", folder, "--context", "100"), "num_attention_heads")


def test_the_shape_reader_refuses_a_head_count_of_zero():
    from kveval.errors import KvevalError
    from kveval.memory import Arch

    for key in ("num_attention_heads", "num_hidden_layers", "num_key_value_heads", "head_dim"):
        config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, key: 0}
        if key in ("num_key_value_heads", "head_dim"):
            config[key] = -1  # 0 means "as many as the attention heads", "hidden_size / heads"
        with pytest.raises(KvevalError, match=key):
            Arch.from_model_config(config)


# --- a lone surrogate in a prompt file ----------------------------------------------------------------------------


@pytest.mark.parametrize("line", ['{"prompt": "What is \\ud800?", "answer": "x"}',
                                  '{"prompt": "What is 2 + 2?", "answer": "4\\udfff"}'])
def test_a_prompt_file_with_a_lone_surrogate_is_refused_naming_file_and_line(h, tmp_path, line):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine", "answer": "1"}\n' + line + "\n")
    raw = _gen_raw(h, tmp_path, prompts=str(prompts))
    path = h.write_config(tmp_path / "c.yaml", raw)
    h.assert_user_error(h.invoke("validate", path), f"{prompts}:2:", "lone surrogate")
    h.assert_user_error(h.invoke("run", path), f"{prompts}:2:")
    assert not (tmp_path / "out").exists()


# --- a temperature that overflows the scaled logits ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [5.0e-324, 1e-300, 1e-7])
def test_a_temperature_below_the_floor_is_refused_before_anything_is_written(h, tmp_path, temperature):
    raw = _gen_raw(h, tmp_path, samples=2, temperature=temperature)
    path = h.write_config(tmp_path / "c.yaml", raw)
    h.assert_user_error(h.invoke("validate", path), "temperature")
    h.assert_user_error(h.invoke("run", path), "temperature")
    assert not (tmp_path / "out").exists()


def test_the_lowest_temperature_samples_finite_probabilities():
    """The floor is what keeps them finite: float32's largest logits scaled by 1/MIN_TEMPERATURE stay in float64."""
    import torch

    from kveval.schema import MIN_TEMPERATURE
    from kveval.tasks.common.lockstep import Sampling, sample_token

    scores = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0, 1.0])
    token = sample_token(scores, Sampling(MIN_TEMPERATURE, 0.95, [0]), torch.Generator().manual_seed(0))
    assert token == 0


# --- lm-eval sampling at temperature 0 --------------------------------------------------------------------------


@pytest.mark.parametrize("gen_kwargs,needle", [({"do_sample": True, "temperature": 0}, "temperature 0"),
                                               ({"do_sample": "true", "temperature": "0.0"}, "temperature 0.0"),
                                               ({"do_sample": True, "temperature": 5e-324}, "temperature"),
                                               ({"do_sample": True, "top_p": 0}, "top_p")])
def test_lm_eval_sampling_that_transformers_refuses_is_refused_by_the_config(h, tmp_path, gen_kwargs, needle):
    raw = h.tiny_raw(tmp_path / "out", tasks=[{"lm_eval": {"tasks": ["kveval_qa_sampled"], "repeats": 2,
                                                           "include_path": "tasks/lm_eval",
                                                           "gen_kwargs": gen_kwargs}}])
    path = h.write_config(tmp_path / "c.yaml", raw)
    h.assert_user_error(h.invoke("validate", path), "gen_kwargs", needle)
    assert not (tmp_path / "out").exists()


def test_lm_eval_greedy_temperature_0_is_fine():
    from kveval.tasks.lm_eval.params import Params

    Params(tasks=["x"], gen_kwargs={"do_sample": False, "temperature": 0})


def test_a_task_whose_own_temperature_is_0_is_refused_with_do_sample():
    """The task's yaml gives temperature 0, the config's gen_kwargs do_sample: the merged kwargs are checked
    (kveval's check, before the run folder is opened)."""
    from types import SimpleNamespace

    from kveval.errors import KvevalError
    from kveval.tasks.lm_eval.params import Params
    from kveval.tasks.lm_eval.task import check_repeats

    config = SimpleNamespace(task="t", output_type="generate_until", generation_kwargs={"temperature": 0.0},
                             filter_list=[{"filter": [{"function": "majority_vote"}]}])
    with pytest.raises(KvevalError, match="task 't'.*temperature 0.0"):
        check_repeats(config, Params(tasks=["t"], repeats=2, gen_kwargs={"do_sample": True}))


# --- Gemma-4: per-layer head sizes, KV sharing ---------------------------------------------------------------------

GEMMA4 = {"model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "head_dim": 16, "global_head_dim": 32, "sliding_window": 8, "intermediate_size": 128,
          "vocab_size": 1000}


def _model_folder(tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_memory_on_per_layer_head_sizes_is_one_line(h, tmp_path):
    folder = _model_folder(tmp_path, GEMMA4)
    h.assert_user_error(h.invoke("memory", "--model", folder, "--context", "100", "--kv", "fp16", "--json"),
                        "head_dim differs from layer to layer", "16 on layers 0-4", "32 on layer 5")


def test_memory_on_kv_sharing_is_one_line(h, tmp_path):
    folder = _model_folder(tmp_path, {**GEMMA4, "num_hidden_layers": 12, "num_kv_shared_layers": 6})
    h.assert_user_error(h.invoke("memory", "--model", folder, "--context", "100", "--kv", "fp16", "--json"),
                        "reuse another layer's K/V")


def test_per_layer_head_sizes_that_agree_are_read_through_the_per_layer_configs(h, tmp_path):
    folder = _model_folder(tmp_path, {**GEMMA4, "global_head_dim": 16})
    result = h.invoke("memory", "--model", folder, "--context", "100", "--kv", "fp16", "--json")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


def test_the_raw_config_json_of_per_layer_head_sizes_is_refused_too():
    """validate reads config.json as a dict: its global_head_dim and per_layer_config say the same."""
    from kveval.errors import KvevalError
    from kveval.memory import Arch

    with pytest.raises(KvevalError, match="head_dim differs"):
        Arch.from_model_config({**GEMMA4, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    with pytest.raises(KvevalError, match="num_key_value_heads differs"):
        Arch.from_model_config({**GEMMA4, "global_head_dim": None,
                                "per_layer_config": {"5": {"num_key_value_heads": 1}}})


# --- a plan whose arch was edited by hand ---------------------------------------------------------------------------


@pytest.fixture
def plan_file(tmp_path):
    from test_inputs_deploy import _scan

    from kveval.commands.plan import plan_command

    plan_command(str(_scan(tmp_path / "scan")), "9", str(tmp_path / "plan.yaml"))
    return tmp_path / "plan.plan.json"


@pytest.mark.parametrize("edit,needle", [({"head_dim": "x"}, "head_dim"), ({"layers": "abc"}, "layers"),
                                         ({"kv_heads": -1}, "kv_heads"), ({"mla": "x"}, "not a model shape"),
                                         ({"zzz": 1}, "not a model shape"), ({"sliding_layers": "x"}, "sliding"),
                                         ({"layers": 31}, "31 layers"), ({"layers": 10**9}, "1000000000 layers")])
def test_deploy_of_a_plan_whose_arch_was_edited_is_one_line(h, plan_file, edit, needle):
    side = json.loads(plan_file.read_text())
    side["arch"].update(edit)
    plan_file.write_text(json.dumps(side))
    h.assert_user_error(h.invoke("deploy", plan_file), "plan", needle)
