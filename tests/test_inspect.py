"""``kveval inspect``: its statistics against hand computations and independent implementations, its measured
errors against the emulation's own forward pass, the planted defects it must name exactly, and each suggestion
against a real run (docs/inspect.md)."""

from __future__ import annotations

import importlib
import json
import shlex

import numpy as np
import pytest
import torch
from planted_models import Plants, planted_model

from kveval.inspect import distributions as dist
from kveval.inspect.capture import capture_window
from kveval.inspect.measure import Measurements, measure_window
from kveval.inspect.variants import change_config, protect_layers, spec_form, variants
from kveval.policy import KVPolicy
from kveval.quant import fake_quantize, preset
from kveval.quant.presets import preset_names
from kveval.stats import spearman

emulate_module = importlib.import_module("kveval.patch.emulate")


# ------------------------------------------------------------------ statistics


def test_head_profile_matches_hand_computation():
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 2.0], [0.5, -0.5, 2.0, 0.0]])  # [T=3, D=4]
    p = dist.head_profile(x)
    # offset: per token |mean| / max(max - min, max |x|): 0.5/3, 2/3, 0.5/2.5
    assert p["offset"] == pytest.approx((0.5 / 3 + 2 / 3 + 0.5 / 2.5) / 3, rel=1e-12)
    assert dist.head_profile(torch.full((5, 4), -2.0))["offset"] == 1.0  # constant tokens: bounded, not 1/0
    flat = x.flatten().double().numpy()
    c = flat - flat.mean()
    assert p["kurtosis"] == pytest.approx((c ** 4).mean() / (c ** 2).mean() ** 2, rel=1e-12)
    means = np.abs(x.double().numpy()).mean(0)  # per channel: 1.5, 0.8333, 2, 0.6667
    assert p["channel_ratio"] == pytest.approx(means.max() / np.median(means), rel=1e-12)
    assert p["abs_max"] == 3.0


def test_outlier_channel_and_dominant_token_are_named():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 32, generator=g)
    x[:, 7] += 20.0  # a per-channel bias
    x[13] *= 30.0  # one dominant token
    p = dist.head_profile(x)
    assert p["outlier_channels"] == [7]
    assert p["dominant_tokens"] == [13]


def test_first_mass_matches_a_full_softmax():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 40, 8, generator=g, dtype=torch.float64), torch.randn(2, 40, 8, generator=g, dtype=torch.float64)
    q[:, :, 0] += 3.0
    k[:, 0, 0] = 5.0  # token 0 a sink
    got = dist.first_mass(q, k, 0.35, n=3, rows=7)
    want = torch.zeros(4, 3, dtype=torch.float64)
    for h in range(4):
        kh = k[h // 2]
        for t in range(3, 40):
            w = torch.softmax((q[h, t] @ kh[: t + 1].T) * 0.35, dim=-1)
            want[h] += w[:3]
    torch.testing.assert_close(got, want / 37, rtol=1e-12, atol=1e-15)
    assert float(got[:, 0].mean()) > 0.3
    on_meta = dist.first_mass(q.to("meta"), k.to("meta"), 0.35, n=3, rows=7)  # every tensor on the inputs' device
    assert on_meta.device.type == "meta" and on_meta.shape == (4, 3)


def test_massive_activation_names_position_and_channel():
    h = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    h[5, 11] = 400.0
    m = dist.massive_activations(h)
    assert [(t["position"], t["channel"]) for t in m["tokens"]] == [(5, 11)]


def test_spearman_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for _ in range(5):
        a = rng.integers(0, 6, 30).astype(float)  # ties
        b = a + rng.normal(0, 2, 30)
        assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, rel=1e-12)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


# ------------------------------------------------------------------ variants


def test_spec_form_gives_back_the_spec():
    for name in preset_names():
        form = spec_form(preset(name))
        spec = preset(form) if isinstance(form, str) else type(preset(name)).from_dict(form)
        assert spec == preset(name)


def test_changes_apply_only_where_they_mean_something():
    int8 = KVPolicy.preset("int8")
    form = change_config("int8", int8, "asymmetric_value")
    changed = KVPolicy.from_config(form)
    assert changed.value == preset("int8").replace(mapping="asymmetric") and changed.key == preset("int8")
    assert change_config("int4_g64", KVPolicy.preset("int4_g64"), "asymmetric_key") is None  # already asymmetric
    assert change_config("q4_0", KVPolicy.preset("q4_0"), "group_key") is None  # ggml's fixed blocks
    assert KVPolicy.from_config(change_config("int4_g64", KVPolicy.preset("int4_g64"), "group_key")).key == \
        preset("int4_g32")
    assert change_config("llamacpp_q4_0", KVPolicy.preset("llamacpp_q4_0"), "rotate") is None  # rotates already
    assert change_config("int8", int8, "key_int8") is None  # 8 bits already
    kivi_like = KVPolicy.from_config(change_config("int4_g64", KVPolicy.preset("int4_g64"), "channel_key"))
    assert (kivi_like.key, kivi_like.value, kivi_like.residual, kivi_like.residual_mode) == (
        preset("int4_channel").replace(group_size=32), preset("int4_g64"), 32, ("block", "sliding"))
    assert change_config("kivi2", KVPolicy.preset("kivi2"), "channel_key") is None  # a schedule of its own already
    names = [v.name for v in variants("int4_g64", "int4_g64", KVPolicy.preset("int4_g64"))[0]]
    assert names[:3] == ["int4_g64", "int4_g64+keys_only", "int4_g64+values_only"]
    protected = KVPolicy.from_config(protect_layers("vllm_turboquant_k8v4", [5, 6]))  # the preset's own overrides kept
    assert [o.selector for o in protected.layers] == [o.selector for o in KVPolicy.preset("vllm_turboquant_k8v4").layers] \
        + ["5,6"]
    assert protected.specs_for_layer(5, 30)[0] == preset("int8") and protected.specs_for_layer(0, 30)[0].is_none
    alone = variants("kivi2", "kivi2", KVPolicy.preset("kivi2"))[0][1].policy
    assert alone.value.is_none and alone.key == KVPolicy.preset("kivi2").key and alone.residual == 128


# ------------------------------------------------------------------ measured errors


@pytest.mark.parametrize(("name", "policy"), [
    ("tiny-llama", "int4_g32"), ("tiny-llama", "kivi2"), ("tiny-llama", "llamacpp_q4_0"), ("tiny-llama", "int8"),
    ("tiny-gemma3", "int4_g32"),  # a sliding-window layer
    ("tiny-gpt-oss", "int4_g32"),  # learned attention sinks, sliding windows
    ("tiny-granite-hybrid", "int8"),  # a hybrid: its attention layers among Mamba layers
])
def test_first_attention_layer_error_is_the_emulated_pass(name, policy):
    """The first attention layer reads the same inputs in the full-precision and the emulated pass (nothing before
    it is quantized), so its attention output's error in a real emulated forward pass is what inspect measures on
    the captured tensors."""
    from kveval.models import load_model, model_arch

    model, _ = load_model(f"builtin:{name}", dtype="float64")
    first = model_arch(model).kv_layers[0]
    ids = torch.randint(4, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    window = capture_window(model, ids)
    pol = KVPolicy.preset(policy)
    v = variants(policy, policy, pol)[0][0]
    meas = Measurements()
    measure_window(model, window, [v], meas)
    seen = []
    o_proj = window.calls[first].module.o_proj
    hook = o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
            with emulate_module.emulate(model, pol):
                model(ids, use_cache=False)
    finally:
        hook.remove()
    fp, q = seen
    want = float(((q - fp) ** 2).sum() / (fp ** 2).sum())
    assert want > 0
    assert meas.sums[(policy, first)].output_rel == pytest.approx(want, rel=1e-9)


def test_key_and_logit_errors_against_direct_computation(tiny_llama64):
    model, _ = tiny_llama64
    ids = torch.randint(4, 200, (1, 50), generator=torch.Generator().manual_seed(1))
    window = capture_window(model, ids)
    v = variants("int8", "int8", KVPolicy.preset("int8"))[0][0]
    meas = Measurements()
    measure_window(model, window, [v], meas)
    call = window.calls[1]
    k_hat = fake_quantize(call.key, preset("int8"))
    s = meas.sums[("int8", 1)]
    torch.testing.assert_close(s.key_err, ((k_hat - call.key) ** 2).sum(dim=(0, 2, 3)), rtol=1e-12, atol=0)
    scaling = model.model.layers[1].self_attn.scaling
    want = torch.zeros(4, dtype=torch.float64)
    for h in range(4):
        kh, kq = call.key[0, h // 2], k_hat[0, h // 2]
        for t in range(50):
            d = (call.query[0, h, t] @ kq[: t + 1].T - call.query[0, h, t] @ kh[: t + 1].T) * scaling
            want[h] += (d ** 2).sum()
    torch.testing.assert_close(s.logit_err, want, rtol=1e-9, atol=1e-20)
    assert s.pairs == 50 * 51 // 2


def test_a_nan_model_is_refused_in_one_line():
    from kveval.errors import KvevalError

    model, _ = planted_model(Plants(None, None, None, None))
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(KvevalError, match="NaN or inf at layer 2"):
        capture_window(model, torch.arange(4, 40)[None])


# ------------------------------------------------------------------ planted defects

DISTRIBUTION_KINDS = ("outlier_channels", "offset", "sink", "massive_activation")


def _inspect(plants: Plants, candidates=("int8", "int4_g32")):
    from kveval.data import load_tokens
    from kveval.inspect.analysis import Inputs, inspect_model

    model, tok = planted_model(plants)
    ids = load_tokens("builtin", tok)[:512][None]
    return inspect_model(model, tok, Inputs({c: c for c in candidates}, ["int8", "int4_g32"], [ids]))


def test_planted_defects_are_named_exactly_at_their_places():
    doc, _ = _inspect(Plants())
    found = {(f["kind"], tuple(f["layers"])): f for f in doc["findings"] if f["kind"] in DISTRIBUTION_KINDS}
    assert set(found) == {("outlier_channels", (1,)), ("offset", (2,)), ("sink", (3,)),
                          ("massive_activation", (0, 1, 2, 3))}
    outliers = found[("outlier_channels", (1,))]["evidence"]
    assert outliers["tensor"] == "key_pre_rope"
    assert [(c["head"], c["channels"]) for c in outliers["channels"][1]] == [(0, [5])]
    assert list(outliers["channels"]) == [1] and outliers["channels"][1][0]["ratio"] > 6
    assert found[("offset", (2,))]["evidence"]["tensor"] == "value"
    massive = found[("massive_activation", (0, 1, 2, 3))]["evidence"]
    assert (massive["position"], massive["channel"], massive["texts"]) == (0, 37, ["<bos>"])
    # the sink dominates this model's KLD: keeping it in full precision is what helps, and is suggested
    assert {s["policy"] for s in found[("sink", (3,))]["suggestions"]} == {"int8+sinks", "int4_g32+sinks"}
    for f in doc["findings"]:
        for sugg in f["suggestions"]:  # each confirmed by its own emulated pass
            assert sugg["kld"] < 0.9 * sugg["base_kld"] and sugg["error"] < 0.9 * sugg["base_error"]


@pytest.mark.parametrize(("plants", "kind", "change"), [
    (Plants(None, 2, None, None), "offset", "int4_g32_sym+asymmetric_value"),
    (Plants((1, 0, 5), None, None, None), "outlier_channels", "int8+rotate"),
])
def test_a_defect_alone_gets_the_change_that_answers_it(plants, kind, change):
    doc, _ = _inspect(plants, ("int8", "int4_g32_sym"))
    found = [f for f in doc["findings"] if f["kind"] in DISTRIBUTION_KINDS]
    assert [f["kind"] for f in found] == [kind]
    assert change in [s["policy"] for s in found[0]["suggestions"]]


def test_a_candidate_that_does_not_fit_is_skipped_with_its_reason():
    doc, _ = _inspect(Plants(None, None, None, None), ("int8", "int4_g64"))  # groups of 64 on heads of 32
    assert list(doc["candidates"]) == ["int8"]
    assert "group_size 64 does not divide head_dim 32" in doc["skipped_candidates"]["int4_g64"]


def test_a_clean_model_shows_none_of_the_planted_defects():
    doc, _ = _inspect(Plants(None, None, None, None))
    assert [f["text"] for f in doc["findings"] if f["kind"] in DISTRIBUTION_KINDS] == []


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A planted model saved as a folder, its config, and ``kveval inspect`` run on it through the CLI."""
    from checkpoint_folders import save_model_folder
    from typer.testing import CliRunner

    from kveval.cli import app

    root = tmp_path_factory.mktemp("planted")
    model, tok = planted_model(Plants())
    folder = save_model_folder(model, tok, root / "model")
    cfg = root / "planted.yaml"
    cfg.write_text(f"name: planted\nmodel: {json.dumps(str(folder))}\ndata: builtin\nkv: [int8, int4_g32]\n"
                   "tasks:\n  - perplexity: {seq_len: 256, max_tokens: 1024}\noutput: " + json.dumps(str(root / "results"))
                   + "\n")
    out = root / "inspect"
    result = CliRunner().invoke(app, ["inspect", str(cfg), "-o", str(out)])  # 1,024 tokens in windows of 256
    assert result.exit_code == 0, result.output
    return root, cfg, out, result.output


def test_inspect_writes_its_files_and_report(planted_run):
    _, _, out, printed = planted_run
    doc = json.loads((out / "inspect.json").read_text())
    # (the planted sink sits on BOS, which only the first of these 4 windows starts with: too little on average)
    assert {f["kind"] for f in doc["findings"]} >= {"outlier_channels", "offset", "massive_activation"}
    report = (out / "report.md").read_text()
    assert "## Findings" in report and doc["findings"][0]["text"] in report
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<h2>Findings</h2>" in page and "<script" not in page
    assert "kveval run" in printed and "kveval plan" in printed


def test_each_suggestion_validates_and_lowers_the_kld_of_a_run(planted_run, monkeypatch):
    from typer.testing import CliRunner

    from kveval.cli import app

    root, _, out, _ = planted_run
    monkeypatch.chdir(root)
    doc = json.loads((out / "inspect.json").read_text())
    lines = {s["run"]: s for f in doc["findings"] for s in f["suggestions"]}
    assert len(lines) >= 4
    for line, s in lines.items():
        args = shlex.split(line)
        assert args[:2] == ["kveval", "run"]
        checked = CliRunner().invoke(app, ["validate", *args[2:]])
        assert checked.exit_code == 0, checked.output
        ran = CliRunner().invoke(app, [*args[1:], "--quiet"])
        assert ran.exit_code == 0, ran.output
        folder = args[args.index("-o") + 1]
        assert folder == f"{root / 'results'}-{s['policy'].replace('+', '_')}"
        metrics = json.loads((root / folder / "metrics.json").read_text())
        base, changed = s["base"], s["policy"].replace("+", "_")
        assert metrics["policies"][changed]["kld_mean"] < metrics["policies"][base]["kld_mean"], line


def test_the_printed_plan_line_runs_and_says_it_is_a_prediction(planted_run, monkeypatch):
    from typer.testing import CliRunner

    from kveval.cli import app

    root, _, out, printed = planted_run
    monkeypatch.chdir(root)
    line = next(x for x in printed.splitlines() if "kveval plan" in x).split(": ", 1)[1]
    args = shlex.split(line)
    ran = CliRunner().invoke(app, [*args[1:], "-o", str(root / "plan.yaml")])
    assert ran.exit_code == 0, ran.output
    assert "PREDICTED by kveval inspect" in (root / "plan.yaml").read_text()
    plan_file = json.loads((root / "plan.plan.json").read_text())
    assert plan_file["command"].endswith("--from-inspect")
    refused = CliRunner().invoke(app, ["plan", str(out), "--budget", args[-1]])
    assert refused.exit_code == 2 and "--from-inspect" in refused.output


def test_a_model_with_kv_options_gets_lines_that_validate(tmp_path, monkeypatch):
    """A model (not a config) with --kv and -s: the lines name the config inspect wrote, carry the -s overrides but
    not the --kv ones (their own kv.policies replaces them), and validate."""
    from typer.testing import CliRunner

    from kveval.cli import app

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "insp"
    result = CliRunner().invoke(app, ["inspect", "builtin:tiny-llama", "--kv", "int4_g32", "-s", "seed=3",
                                      "--tokens", "256", "--seq-len", "128", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "inspect.json").read_text())
    lines = {s["run"] for f in doc["findings"] for s in f["suggestions"]}
    assert lines
    for line in lines:
        args = shlex.split(line)
        assert args[2] == str(out / "config.yaml") and "seed=3" in args and not any(a.startswith("kv=") for a in args)
        checked = CliRunner().invoke(app, ["validate", *args[2:]])
        assert checked.exit_code == 0, (line, checked.output)


def test_a_gguf_path_names_a_model_not_a_config(tmp_path):
    from typer.testing import CliRunner

    from kveval.cli import app

    bogus = tmp_path / "m.gguf"
    bogus.write_bytes(b"not a gguf")
    result = CliRunner().invoke(app, ["inspect", str(bogus), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not a GGUF file" in result.output


# ------------------------------------------------------------------ refusals


def test_refusals_are_one_line(planted_run, tmp_path):
    from typer.testing import CliRunner

    from kveval.cli import app

    root, cfg, out, _ = planted_run
    run_folder = tmp_path / "a_run"
    run_folder.mkdir()
    (run_folder / "notes.txt").write_text("mine")
    scan = tmp_path / "a_scan"  # a measured scan's files, as plan reads them
    scan.mkdir()
    (scan / "config.resolved.yaml").write_text("model: m\n")
    (scan / "metrics.json").write_text(json.dumps({"model": "m", "sensitivity": {"cells": [{"layer": 0}]}}))
    cases = [
        (["inspect", str(cfg), "-o", str(run_folder)], "not an inspection's"),
        (["inspect", str(cfg), "--tokens", "100", "--seq-len", "512", "-o", str(tmp_path / "x")], "--tokens 100"),
        (["inspect", str(cfg), "--kv", "int4_g64", "-o", str(tmp_path / "y")], "group_size 64 does not divide"),
        (["inspect", str(cfg), "--against", str(out), "-o", str(tmp_path / "z")], "not a measured scan"),
        (["plan", str(scan), "--from-inspect", "--budget", "6"], "is not a kveval inspect folder"),
    ]
    broken = tmp_path / "broken"  # an inspection whose prediction was damaged after it was written
    broken.mkdir()
    for name in ("inspect.json", "config.resolved.yaml"):
        (broken / name).write_bytes((out / name).read_bytes())
    damaged = json.loads((out / "metrics.json").read_text())
    damaged["sensitivity"]["cells"][3]["kld"] = "NaN"
    (broken / "metrics.json").write_text(json.dumps(damaged))
    cases.append((["plan", str(broken), "--from-inspect", "--budget", "6"], "cells[3].kld is 'NaN'"))
    other = tmp_path / "other_scan"  # a measured scan of another model
    other.mkdir()
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["model"], metrics["sensitivity"]["predicted"] = "builtin:tiny-llama", False
    (other / "metrics.json").write_text(json.dumps(metrics))
    cases.append((["inspect", str(cfg), "--against", str(other), "-o", str(tmp_path / "w")],
                  "that scan measured 'builtin:tiny-llama'"))
    empty = tmp_path / "no_specs"  # an inspection whose policies were no single quantizer preset
    empty.mkdir()
    (empty / "config.resolved.yaml").write_bytes((out / "config.resolved.yaml").read_bytes())
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["sensitivity"].update(specs=[], cells=[])
    (empty / "metrics.json").write_text(json.dumps(metrics))
    cases.append((["plan", str(empty), "--from-inspect", "--budget", "6"], "predicted no sensitivity"))
    for args, message in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
    assert (run_folder / "notes.txt").read_text() == "mine" and sorted(p.name for p in run_folder.iterdir()) == \
        ["notes.txt"]


def test_a_second_inspection_of_the_same_folder_waits_its_turn(planted_run):
    import subprocess
    import sys

    from typer.testing import CliRunner

    from kveval.cli import app

    _, cfg, out, _ = planted_run
    before = (out / "inspect.json").read_bytes()
    hold = ("import sys\nfrom kveval.results.lock import lock_folder\n"
            "with lock_folder(sys.argv[1], command='kveval inspect (another)'):\n"
            "    print('held', flush=True)\n    sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        result = CliRunner().invoke(app, ["inspect", str(cfg), "-o", str(out)])
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=60)
    assert result.exit_code == 2 and "kveval inspect (another)" in result.output
    assert (out / "inspect.json").read_bytes() == before


def test_an_mla_model_is_refused(monkeypatch):
    from kveval.errors import KvevalError
    from kveval.inspect.analysis import Inputs, inspect_model
    from kveval.models import load_model

    model, tok = load_model("builtin:tiny-deepseek-v3")
    with pytest.raises(KvevalError, match="MLA"):
        inspect_model(model, tok, Inputs({"int8": "int8"}, [], [torch.arange(4, 40)[None]]))


@pytest.mark.integration
def test_the_builtin_model_under_the_main_config(tmp_path):
    """The acceptance command on the builtin model: its keys' outlier channels and its keys' share of the error are
    found, and every printed line is a valid command."""
    from pathlib import Path

    from typer.testing import CliRunner

    from kveval.cli import app

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "inspect"
    result = CliRunner().invoke(app, ["inspect", str(root / "configs" / "int4_g64.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "inspect.json").read_text())
    kinds = {(f["kind"], f["evidence"].get("tensor") or f["evidence"].get("policy")) for f in doc["findings"]}
    assert ("outlier_channels", "key_pre_rope") in kinds and ("keys_vs_values", "int4_g64") in kinds
    kv = next(f for f in doc["findings"] if f["kind"] == "keys_vs_values" and f["evidence"]["policy"] == "int4_g64")
    assert kv["evidence"]["ratio_key_over_value"] > 3 and [s["policy"] for s in kv["suggestions"]] == \
        ["int4_g64+key_int8"]
    for line in {s["run"] for f in doc["findings"] for s in f["suggestions"]}:
        checked = CliRunner().invoke(app, ["validate", *shlex.split(line)[2:]])
        assert checked.exit_code == 0, (line, checked.output)
    assert doc["sensitivity"]["predicted"] is True and len(doc["sensitivity"]["cells"]) == 2 * 30 * 2


def test_dominant_tokens_are_named_by_window_position_and_text():
    from kveval.inspect.analysis import _Gathered
    from kveval.inspect.capture import LayerCall, Window
    from kveval.inspect.measure import scaling_of

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    g = torch.Generator().manual_seed(4)
    gathered = _Gathered()
    for w in range(2):
        key = torch.randn(1, 1, 16, 8, generator=g)
        if w == 1:
            key[0, 0, 3] *= 40.0  # window 1, position 3
        call = LayerCall(None, torch.randn(1, 2, 16, 8, generator=g), key, torch.randn(1, 1, 16, 8, generator=g),
                         None, None, torch.zeros(1, 16, 2, 8), None, (), {"scaling": 0.3})
        gathered.add(w, Window(torch.arange(100 * w, 100 * w + 16)[None], calls={0: call}), scaling_of)
    heads = gathered.profiles(Tok())[0]["key"]
    assert heads[0]["dominant_tokens"] == [{"window": 1, "position": 3, "text": "<103>"}]
    assert heads[0]["token_ratio"] > 6 and gathered.profiles(Tok())[0]["value"][0]["dominant_tokens"] == []
