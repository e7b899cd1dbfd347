"""The config schema: valid and invalid files, shorthands, overrides, one-line errors, every shipped file."""

from pathlib import Path

import pytest
import yaml

from kveval.config import TASK_TYPES, load_config, task_presets, validate
from kveval.errors import KvevalError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def base(**extra):
    cfg = {"name": "t", "kv": ["int4_g64"], "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256}}]}
    cfg.update(extra)
    return cfg


def error_of(raw, overrides=None) -> str:
    with pytest.raises(KvevalError) as info:
        validate(raw, "c.yaml", overrides)
    msg = str(info.value)
    assert "\n" not in msg, "errors are one line"
    return msg


def test_shorthands_normalise_to_one_form():
    cfg = validate(base(model="builtin:tiny-llama", data="builtin"))
    assert cfg.model.name == "builtin:tiny-llama" and cfg.model.dtype == "float32" and cfg.model.device == "cpu"
    assert cfg.data.source == "builtin"
    assert list(cfg.policies()) == ["int4_g64"]
    assert cfg.tasks[0].kind == "perplexity" and cfg.tasks[0].params.seq_len == 64
    assert cfg.output_dir() == Path("results/t")


def test_kv_forms():
    assert list(validate(base(kv="int8")).policies()) == ["int8"]
    named = validate(base(kv={"policies": {"mine": {"key": "int4_g64", "value": "int8", "residual": 32}}}))
    p = named.policies()["mine"]
    assert p.key.bits == 4 and p.value.bits == 8 and p.residual == 32
    single = validate(base(kv={"preset": "kivi2", "residual": 64}))
    assert single.policies()["kivi2"].residual == 64
    listed = validate(base(kv=["int8", {"k4": {"key": "int4_g64", "value": "none"}}]))
    assert list(listed.policies()) == ["int8", "k4"]


def test_unknown_key_names_path_and_suggests():
    msg = error_of(base(tasks=[{"perplexity": {"seq_lenn": 64}}]))
    assert msg == "c.yaml: tasks[0].perplexity.seq_lenn: unknown key; did you mean 'seq_len'?"
    msg = error_of({**base(), "modle": "x"})
    assert "modle" in msg and "did you mean 'model'" in msg
    msg = error_of(base(model={"name": "x", "dtyp": "float32"}))
    assert "model.dtyp" in msg and "'dtype'" in msg


def test_wrong_types_and_impossible_values():
    assert "tasks[0].perplexity.seq_len" in error_of(base(tasks=[{"perplexity": {"seq_len": "long"}}]))
    assert "tasks[0].perplexity.seq_len" in error_of(base(tasks=[{"perplexity": {"seq_len": -4}}]))
    assert "model.dtype" in error_of(base(model={"dtype": "float8"}))
    assert "bits" in error_of(base(kv={"policies": {"p": {"spec": {"format": "int", "bits": 9}}}}))
    assert "residual" in error_of(base(kv={"policies": {"p": {"spec": "int8", "residual": -1}}}))
    assert "stride" in error_of(base(tasks=[{"perplexity": {"seq_len": 64, "stride": 128}}]))


def test_unknown_preset_suggests():
    msg = error_of(base(kv=["int4_g46"]))
    assert "int4_g46" in msg and "did you mean" in msg


def test_unknown_task_suggests():
    msg = error_of(base(tasks=["perplexty"]))
    assert "did you mean 'perplexity'" in msg


def test_group_size_must_divide_head_dim():
    policy = validate(base(kv={"policies": {"p": {"spec": {"format": "int", "bits": 4, "granularity": "group",
                                                           "group_size": 48}}}})).policies()["p"]
    with pytest.raises(KvevalError, match="group_size 48 does not divide head_dim 64"):
        policy.check_model(num_layers=30, head_dim=64)


def test_overrides_go_through_validation():
    cfg = validate(base(), overrides=["tasks[0].perplexity.seq_len=128", "model.dtype=float64", "seed=3"])
    assert cfg.tasks[0].params.seq_len == 128 and cfg.model.dtype == "float64" and cfg.seed == 3
    cfg = validate(base(model="builtin:tiny-llama"), overrides=["model.device=auto"])
    assert cfg.model.name == "builtin:tiny-llama" and cfg.model.device == "auto"
    assert "unknown key" in error_of(base(), overrides=["tasks[0].perplexity.seqlen=5"])
    assert "key.path=value" in error_of(base(), overrides=["seed"])
    assert "seq_len" in error_of(base(), overrides=["tasks[0].perplexity.seq_len=abc"])


def test_configs_are_pure_data(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("name: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(KvevalError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips():
    cfg = validate(base(kv=["kivi2", "k4v8"]))
    again = validate(yaml.safe_load(yaml.safe_dump(cfg.resolved())))
    assert again.policies() == {n: p for n, p in cfg.policies().items()}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    first = path.read_text().splitlines()[0]
    if first == f"# kveval sweep configs/{path.name}":  # a sweep file: every run it expands to validates
        from kveval.sweep.load import load_sweep

        assert load_sweep(path).runs
        return
    assert first == f"# kveval run configs/{path.name}", "each config opens with the command that runs it"
    cfg = load_config(path, check=False)
    if "/" in cfg.model.name and not cfg.model.name.startswith(("/", ".")):  # a hub model: runs where it is cached
        from kveval.models.hub import hub_guard

        with hub_guard() as offline:
            pass
        if offline:
            with pytest.raises(KvevalError, match="not in the local HuggingFace cache"):
                load_config(path)
            return
    load_config(path)


@pytest.mark.parametrize("name", sorted(task_presets()))
def test_every_task_preset_loads(name):
    cfg = validate(base(tasks=[name]))
    assert cfg.tasks[0].kind in TASK_TYPES


def test_task_preset_with_overrides():
    cfg = validate(base(tasks=[{"preset": "ppl_quick", "max_tokens": 1024}]))
    assert cfg.tasks[0].params.seq_len == 512 and cfg.tasks[0].params.max_tokens == 1024
