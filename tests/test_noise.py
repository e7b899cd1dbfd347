"""The numerical noise floor: a second computation path (token-by-token decoding) beside every difference."""

import json

from kveval.commands.run import run_experiment
from kveval.config import Threshold, validate
from kveval.tasks.perplexity.task import verdict


def cfg(out, dtype="float64", kv=("fp16", "int4_g32"), noise_windows=1):
    return validate({
        "name": "noise", "model": {"name": "builtin:tiny-llama", "dtype": dtype}, "data": "builtin",
        "kv": list(kv), "output": str(out),
        "tasks": [{"perplexity": {"seq_len": 48, "max_tokens": 240, "bootstrap": 50, "noise_windows": noise_windows}}],
    })


def test_floor_is_zero_for_none_policy_in_float64(tmp_path):
    metrics = run_experiment(cfg(tmp_path / "r"), quiet=True)
    for entry in (metrics["baseline"], metrics["policies"]["fp16"]):
        assert entry["noise_floor_ppl_pct"] < 1e-9
        assert entry["noise_floor_kld"] < 1e-9
        assert entry["noise_tokens"] == 47
    q = metrics["policies"]["int4_g32"]
    assert q["noise_floor_ppl_pct"] < 1e-9 and q["noise_max_abs_logit_gap"] < 1e-9  # float64: paths agree
    # the metrics keep float64 logits: no float32 rounding of the logits hides in a float64 floor
    assert metrics["baseline"]["noise_max_abs_logit_gap"] < 1e-11
    assert q["kld_mean"] > 1e-6 and q["verdict"] in ("pass", "fail")
    assert metrics["policies"]["fp16"]["verdict"] == "pass"  # no effect, and no noise to hide one


def test_verdict_within_noise_when_effect_below_floor():
    thr = Threshold(delta_ppl_pct=1.0)
    below = {"delta_ppl_pct": 0.08, "kld_mean": 2e-4, "noise_floor_ppl_pct": 0.19, "noise_floor_kld": 1e-3}
    assert verdict(below, thr) == "within_noise"
    above = {"delta_ppl_pct": 0.5, "kld_mean": 2e-2, "noise_floor_ppl_pct": 0.19, "noise_floor_kld": 1e-3}
    assert verdict(above, thr) == "pass"
    assert verdict({**above, "delta_ppl_pct": 3.0}, thr) == "fail"
    assert verdict({"delta_ppl_pct": 0.0, "kld_mean": 0.0}, thr) == "pass"  # no floor measured: plain threshold
    # a float64 floor at rounding level hides nothing: a no-effect policy passes
    rounding = {"delta_ppl_pct": 1e-14, "kld_mean": 1e-17, "noise_floor_ppl_pct": 1e-13, "noise_floor_kld": 1e-16}
    assert verdict(rounding, thr) == "pass"


def test_float32_floor_is_reported_and_larger_than_float64(tmp_path):
    m32 = run_experiment(cfg(tmp_path / "f32", "float32", kv=("int4_g32",)), quiet=True)
    m64 = run_experiment(cfg(tmp_path / "f64", "float64", kv=("int4_g32",)), quiet=True)
    f32 = m32["policies"]["int4_g32"]["noise_max_abs_logit_gap"]
    f64 = m64["policies"]["int4_g32"]["noise_max_abs_logit_gap"]
    assert f32 > 1e-7 and f64 < 1e-9 and f32 > 100 * f64


def test_floor_resumes(tmp_path):
    out = tmp_path / "r"
    first = run_experiment(cfg(out, noise_windows=2), quiet=True)
    lines = (out / "records.jsonl").read_text().splitlines()
    noise = [i for i, line in enumerate(lines) if json.loads(line)["task"] == "perplexity_noise"]
    assert len(noise) == 2 * 3
    dropped = lines[noise[-1]]
    kept = [line for i, line in enumerate(lines) if i != noise[-1]]
    (out / "records.jsonl").write_text("\n".join(kept) + "\n")
    again = run_experiment(cfg(out, noise_windows=2), quiet=True)
    after = (out / "records.jsonl").read_text().splitlines()
    assert len(after) == len(lines) and after[-1] == dropped, "only the missing unit is recomputed"
    assert again == first
