"""Calibrated scales end to end on tiny models: the scales file, static/outlier/pre-RoPE policies against the real
cache (float64), their memory against the bill, `scales: auto` in a run, and the overlap refusal."""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kveval.calibration.calibrate import calibrate
from kveval.cli import app
from kveval.commands.run import run_experiment
from kveval.config import validate
from kveval.data import load_tokens
from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.patch import QuantizedKVCache, cache_kwargs, emulate
from kveval.policy import KVPolicy
from kveval.quant import QuantSpec, qparams_from_range
from kveval.scales.file import load_scales

CAL = {"tokens": 96, "seq_len": 48}


def cfg_for(model_name: str, out, **extra) -> dict:
    return {
        "name": "cal", "model": model_name, "data": "builtin", "kv": ["int8"],
        "tasks": [{"perplexity": {"seq_len": 64, "max_tokens": 256, "bootstrap": 50, "diagnostics": False}}],
        "calibration": {**CAL, **extra.pop("calibration", {})}, "output": str(out), **extra,
    }


def scales_for(model, tokenizer, model_name, path, **cal):
    cfg = validate(cfg_for(model_name, path.parent / "unused", calibration=cal))
    tokens = load_tokens("builtin", tokenizer)
    return calibrate(model, tokenizer, tokens, cfg, path)


@pytest.fixture(scope="module")
def llama_scales(tiny_llama64, tmp_path_factory):
    model, tok = tiny_llama64
    return scales_for(model, tok, "builtin:tiny-llama", tmp_path_factory.mktemp("s") / "llama.safetensors",
                      outliers=[0.1])


@pytest.fixture(scope="module")
def gemma_scales(tiny_gemma3_64, tmp_path_factory):
    model, tok = tiny_gemma3_64
    return scales_for(model, tok, "builtin:tiny-gemma3", tmp_path_factory.mktemp("s") / "gemma.safetensors",
                      outliers=[0.1])


def test_scales_file_round_trip_and_header(tiny_llama64, llama_scales, tmp_path):
    model, tok = tiny_llama64
    sf = load_scales(llama_scales)
    h = sf.header
    n = len(load_tokens("builtin", tok))
    assert (h["model"], h["layers"], h["kv_heads"], h["head_dim"]) == ("builtin:tiny-llama", 4, 2, 32)
    assert (h["token_start"], h["token_end"], h["tokens"], h["method"]) == (n - 96, n, 96, "absmax")
    assert set(sf.kinds) == {"key", "key_pre_rope", "value"}
    assert sf.tensors["key.tensor.absmax"].shape == (4,)
    assert sf.tensors["value.head.lo"].shape == (4, 2)
    assert sf.tensors["key_pre_rope.channel.hi"].shape == (4, 2, 32)
    # the per-tensor absmax is the largest per-channel absmax, and parameters follow from the stored ranges
    torch.testing.assert_close(sf.tensors["key.tensor.absmax"], sf.tensors["key.channel.absmax"].amax((1, 2)))
    spec = QuantSpec(bits=8, granularity="channel", scale_dtype="float32")
    r = sf.ranges(2, "value", "channel")
    assert torch.equal(sf.qparams(2, "value", spec).scale, qparams_from_range(-r.absmax, r.absmax, spec).scale)
    # ranges of the dense part (outliers taken out, as a spec with outliers: 0.1 stores it) are tighter
    assert h["outliers"] == [0.1]
    assert (sf.tensors["key_pre_rope@0.1.channel.absmax"] <= sf.tensors["key_pre_rope.channel.absmax"]).all()
    assert (sf.tensors["value@0.1.tensor.absmax"] < sf.tensors["value.tensor.absmax"]).all()
    with pytest.raises(KvevalError, match=r"calibration.outliers: \[0.05\]"):
        sf.qparams(0, "key", QuantSpec(bits=4, granularity="channel", outliers=0.05))
    # deterministic: a second calibration writes the same numbers
    again = load_scales(scales_for(model, tok, "builtin:tiny-llama", tmp_path / "again.safetensors", outliers=[0.1]))
    for name, t in sf.tensors.items():
        assert torch.equal(t, again.tensors[name]), name


def test_percentile_file_is_tighter_than_absmax(tiny_llama64, llama_scales, tmp_path):
    model, tok = tiny_llama64
    pct = load_scales(scales_for(model, tok, "builtin:tiny-llama", tmp_path / "p.safetensors", method="percentile",
                                 percentile=99.0))
    full = load_scales(llama_scales)
    assert pct.header["method"] == "percentile" and pct.header["percentile"] == 99.0
    assert (pct.tensors["key.tensor.absmax"] < full.tensors["key.tensor.absmax"]).all()


def _static(model_fixture_scales, **kw):
    return KVPolicy(scales=str(model_fixture_scales), **kw)


INT4_CH = QuantSpec(bits=4, mapping="asymmetric", granularity="channel")
POLICIES = {
    "static_int8_tensor_head": lambda s: _static(s, key=QuantSpec(bits=8, granularity="tensor", scale_dtype="float32"),
                                                 value=QuantSpec(format="fp8_e4m3", granularity="head",
                                                                 scale_dtype="float32")),
    "static_int4_channel_sinks": lambda s: _static(s, key=INT4_CH, value=QuantSpec(bits=4, granularity="channel"),
                                                   sink_tokens=2, residual=3),
    "outliers_group_residual": lambda s: KVPolicy(
        key=QuantSpec(bits=3, mapping="asymmetric", granularity="group", group_size=8, outliers=0.1),
        value=QuantSpec(bits=2, mapping="asymmetric", outliers=0.05), residual=4),
    "pre_rope_kivi_block": lambda s: KVPolicy(key=QuantSpec(bits=2, mapping="asymmetric", granularity="channel"),
                                              value=QuantSpec(bits=2, mapping="asymmetric"), residual=8,
                                              residual_mode="block", pre_rope=True),
    "kvquant_like": lambda s: _static(s, key=QuantSpec(**{**INT4_CH.to_dict(), "outliers": 0.1}),
                                      value=QuantSpec(bits=4, mapping="asymmetric", outliers=0.1), pre_rope=True),
}


@torch.no_grad()
def _emulated_and_decoded(model, policy, n=40, prefill=1):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (1, n), generator=g)
    with emulate(model, policy, prefill_len=prefill if prefill > 1 else 0):
        emulated = model(ids).logits
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    out = [model(ids[:, :prefill], use_cache=True, **kw).logits]
    for t in range(prefill, n):
        out.append(model(ids[:, t:t + 1], use_cache=True, **kw).logits)
    return emulated, torch.cat(out, 1), model(ids).logits


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_emulation_equals_real_cache_float64(name, which, request):
    model, _ = request.getfixturevalue("tiny_llama64" if which == "llama" else "tiny_gemma3_64")
    scales = request.getfixturevalue(f"{which}_scales")
    policy = POLICIES[name](scales)
    emulated, decoded, baseline = _emulated_and_decoded(model, policy)
    assert (emulated - baseline).abs().max() > 1e-6, "the policy must change something"
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


def test_pre_rope_with_prefill_matches_decoding(tiny_llama64, llama_scales):
    policy = POLICIES["kvquant_like"](llama_scales)
    emulated, decoded, _ = _emulated_and_decoded(tiny_llama64[0], policy, prefill=11)
    torch.testing.assert_close(emulated, decoded, rtol=0, atol=1e-9)


@torch.no_grad()
def test_pre_rope_with_none_spec_is_the_identity(tiny_llama64):
    model, _ = tiny_llama64
    ids = torch.randint(4, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    value_only = KVPolicy(value=QuantSpec(bits=4))
    with emulate(model, value_only):
        plain = model(ids).logits
    with emulate(model, KVPolicy(value=QuantSpec(bits=4), pre_rope=True)):
        pre = model(ids).logits
    assert torch.equal(plain, pre)
    with emulate(model, KVPolicy(pre_rope=True)):
        assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", ["static_int4_channel_sinks", "outliers_group_residual", "kvquant_like"])
@torch.no_grad()
def test_real_cache_bytes_equal_the_bill(name, tiny_llama, tmp_path):
    model, tok = tiny_llama
    scales = scales_for(model, tok, "builtin:tiny-llama", tmp_path / "f32.safetensors", outliers=[0.1])
    policy = POLICIES[name](scales)
    arch = Arch.from_model(model)
    ids = torch.randint(4, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    cache = QuantizedKVCache(model, policy)
    kw = cache_kwargs(model, cache)
    model(ids[:, :7], use_cache=True, **kw)
    for t in range(7, 20):
        model(ids[:, t:t + 1], use_cache=True, **kw)
        bill = kv_bytes(arch, policy, t + 1, 1, 4)
        got = cache.nbytes()
        assert (got["codes"], got["scales"], got["residual"]) == (bill.codes, bill.scales, bill.residual), t


def test_scales_for_another_model_is_a_clear_error(tiny_gemma3_64, llama_scales):
    model, _ = tiny_gemma3_64
    with pytest.raises(KvevalError, match="calibrate for this model"):
        with emulate(model, POLICIES["static_int8_tensor_head"](llama_scales)):
            pass


def test_run_with_auto_scales_calibrates_once_and_compares(tmp_path):
    out = tmp_path / "run"
    cfg = cfg_for("builtin:tiny-llama", out)
    cfg["kv"] = {"policies": {"dynamic": "int8", "trtllm_int8": "trtllm_int8", "kvquant": "kvquant4_1pct"}}
    metrics = run_experiment(validate(cfg), quiet=True)
    assert (out / "scales.safetensors").is_file()
    pol = metrics["policies"]
    for name in ("dynamic", "trtllm_int8", "kvquant"):
        assert pol[name]["kld_mean"] > 0
    # by hand (KVQuant nuq4-1%), 2 kv heads x head_dim 32 (n = 64 per token: one outlier slot per side), 64-token
    # context (4096 elements per layer and tensor), fp16 full precision: the first token in fp16 (64 * 16 bits);
    # 63 tokens of 4-bit codes + 2 slots (2 B value + 1 B index: 6 B per token); keys: fp16 hi and lo per channel
    # and head (2 * 32 * 4 B) + a float32 16-entry codebook (64 B); values: fp32 hi and lo per token (8 B) + 64 B
    keys = (63 * (64 * 4 + 6 * 8) + 64 * 16 + (256 + 64) * 8) / 4096
    values = (63 * (64 * 4 + 6 * 8 + 8 * 8) + 64 * 16 + 64 * 8) / 4096
    assert pol["kvquant"]["bits_per_element"] == pytest.approx((keys + values) / 2)
    mtime = (out / "scales.safetensors").stat().st_mtime_ns
    again = run_experiment(validate(cfg), quiet=True)  # resume: nothing recomputed, same scales
    assert (out / "scales.safetensors").stat().st_mtime_ns == mtime
    assert again["policies"]["kvquant"]["kld_mean"] == pol["kvquant"]["kld_mean"]


def test_overlapping_calibration_is_refused_before_any_write(tmp_path):
    out = tmp_path / "run"
    cfg = cfg_for("builtin:tiny-llama", out, calibration={"tokens": 10**9})
    cfg["kv"] = ["trtllm_int8"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "more than the corpus holds" in result.output
    # a scales file calibrated on the evaluated tokens: refused unless allowed
    model_cfg = validate(cfg_for("builtin:tiny-llama", out))
    from kveval.models import load_model

    model, tok = load_model("builtin:tiny-llama")
    tokens = load_tokens("builtin", tok)[:200]  # a corpus prefix: these are the perplexity tokens
    scales = calibrate(model, tok, tokens, model_cfg, tmp_path / "overlap.safetensors")
    cfg = cfg_for("builtin:tiny-llama", out, calibration={})
    cfg["kv"] = {"policies": {"static": {"preset": "trtllm_int8", "scales": str(scales)}}}
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "overlap the perplexity tokens" in result.output
    assert "Traceback" not in result.output
    assert sum(line.startswith("error:") for line in result.output.splitlines()) == 1
    assert not out.exists(), "nothing written before the check"
    cfg["calibration"]["allow_overlap"] = True
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "metrics.json").read_text())["policies"]["static"]["kld_mean"] > 0


def test_cli_calibrate_writes_a_file_and_bad_input_is_one_line(tmp_path):
    cfg = cfg_for("builtin:tiny-llama", tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    target = tmp_path / "s.safetensors"
    result = CliRunner().invoke(app, ["calibrate", str(path), "--out", str(target), "-q"])
    assert result.exit_code == 0, result.output
    assert load_scales(target).header["tokens"] == 96
    cfg["calibration"] = {"method": "mse"}
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["calibrate", str(path)])
    assert result.exit_code == 2 and "target" in result.output
    cfg["calibration"] = {}
    cfg["kv"] = {"policies": {"p": {"preset": "trtllm_int8", "scales": str(tmp_path / "missing.safetensors")}}}
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_pre_rope_refuses_a_rotary_form_it_cannot_invert(monkeypatch):
    import sys

    from kveval.models import load_model
    from kveval.patch.attention import attention_modules

    model, _ = load_model("builtin:tiny-llama")  # a fresh model: its layers have not been checked yet
    modeling = sys.modules[type(attention_modules(model)[0]).__module__]

    def other_form(q, k, cos, sin, unsqueeze_dim=1):  # pairs of neighbours instead of halves
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + torch.roll(q, 1, -1) * s, k * c + torch.roll(k, 1, -1) * s

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", other_form)
    ids = torch.randint(4, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(KvevalError, match="rotate-half"):
        with emulate(model, KVPolicy(key=QuantSpec(bits=4), pre_rope=True)), torch.no_grad():
            model(ids)


def test_a_scales_file_changed_under_a_resumed_run_is_refused(tmp_path):
    from kveval.models import load_model

    model, tok = load_model("builtin:tiny-llama")
    scales = scales_for(model, tok, "builtin:tiny-llama", tmp_path / "s.safetensors")
    out = tmp_path / "run"
    cfg = cfg_for("builtin:tiny-llama", out)
    cfg["kv"] = {"policies": {"static": {"preset": "trtllm_int8", "scales": str(scales)}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert CliRunner().invoke(app, ["run", str(path), "-q"]).exit_code == 0
    before = (out / "records.jsonl").read_text()
    scales_for(model, tok, "builtin:tiny-llama", scales, method="percentile", percentile=99.0)  # recalibrated
    result = CliRunner().invoke(app, ["run", str(path), "-q"])
    assert result.exit_code == 2 and "changed since this run's records" in result.output
    assert (out / "records.jsonl").read_text() == before, "nothing recorded is lost"
    result = CliRunner().invoke(app, ["run", str(path), "-q", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (out / "records.jsonl").read_text() != before  # recomputed with the new scales


def test_calibrate_fits_kvquant_codebooks_only_for_nuq_policies(tiny_llama, tmp_path):
    """``kveval calibrate``: a config with a kvquant policy gets its per-channel bounds and Fisher-weighted codebooks
    (tests/test_kvquant.py checks their numbers); a config without 'nuq' specs gets none."""
    cfg = cfg_for("builtin:tiny-llama", tmp_path / "run")
    cfg["kv"] = ["int8", "kvquant3_1pct"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["calibrate", str(path), "--out", str(tmp_path / "s.safetensors")])
    assert result.exit_code == 0, result.output
    sf = load_scales(tmp_path / "s.safetensors")
    assert sf.header["nuq"]["fisher"] is True
    assert {n for n in sf.tensors if n.startswith("kvquant.")} == {
        "kvquant.key_pre_rope@0.01.channel.hi", "kvquant.key_pre_rope@0.01.channel.lo",
        "kvquant.key_pre_rope@0.01.channel.nuq3", "kvquant.value@0.01.token.nuq3"}
    model, tok = tiny_llama
    plain = load_scales(scales_for(model, tok, "builtin:tiny-llama", tmp_path / "plain.safetensors"))
    assert plain.header["nuq"] is None and not any(n.startswith("kvquant.") for n in plain.tensors)
