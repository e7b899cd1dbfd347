"""The sensitivity scan: prefix reuse == naive full forward passes; records, resume, metrics and plots."""

from __future__ import annotations

import json

import pytest
import torch

from kveval.commands.run import run_experiment
from kveval.commands.scan import scan_command
from kveval.config import load_config, validate
from kveval.errors import KvevalError
from kveval.tasks import TASKS
from kveval.tasks.sensitivity.scan import (
    baseline_prefix,
    cell_policy,
    naive_logits,
    replay,
    verify_replay,
)
from kveval.tasks.sensitivity.task import Params


def _ids(model, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


@pytest.mark.parametrize("fixture", ["tiny_llama64", "tiny_gemma3_64"])
def test_replay_equals_naive_forward_float64(fixture, request):
    """Every cell (layer x K/V) from the baseline's layer inputs gives the full forward pass's logits to 1e-6."""
    model, _ = request.getfixturevalue(fixture)
    ids = _ids(model)
    prefix = baseline_prefix(model, ids)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    assert torch.equal(prefix.logits, plain)  # capturing changes nothing
    assert verify_replay(model, prefix) < 1e-12
    for layer in range(model.config.num_hidden_layers):
        for tensor in ("key", "value"):
            policy = cell_policy(layer, tensor, "int2_g32")
            reused = replay(model, prefix, layer, policy)
            full = naive_logits(model, ids, policy)
            assert (reused - full).abs().max() < 1e-6
            assert (full - plain).abs().max() > 1e-4  # the cell does quantize something


def test_replay_with_eager_attention(tiny_llama64):
    model, _ = tiny_llama64
    model.set_attn_implementation("eager")
    try:
        ids = _ids(model, seed=1)
        prefix = baseline_prefix(model, ids)
        policy = cell_policy(2, "value", "int4_g32")
        assert (replay(model, prefix, 2, policy) - naive_logits(model, ids, policy)).abs().max() < 1e-6
    finally:
        model.set_attn_implementation("sdpa")


def test_replay_refuses_a_policy_that_quantizes_earlier_layers(tiny_llama64):
    model, _ = tiny_llama64
    prefix = baseline_prefix(model, _ids(model))
    with pytest.raises(ValueError, match="quantizes layer 1"):
        replay(model, prefix, 2, cell_policy(1, "key", "int4_g32"))


def _config(tmp_path, **task):
    body = {"specs": ["int4_g32", "int2_g32"], "seq_len": 32, "max_tokens": 63, **task}
    path = tmp_path / "scan.yaml"
    path.write_text(
        "# kveval run scan.yaml\nname: tiny_scan\nmodel: {name: 'builtin:tiny-llama', dtype: float64}\n"
        f"kv: [int4_g32]\ntasks:\n  - sensitivity: {json.dumps(body)}\noutput: {tmp_path / 'out'}\n"
    )
    return path


def test_scan_reuse_and_naive_give_the_same_numbers(tmp_path):
    path = _config(tmp_path)
    reuse = scan_command(str(path), quiet=True)["sensitivity"]
    naive = scan_command(str(path), ["tasks[0].sensitivity.plots=false"], naive=True, quiet=True)["sensitivity"]
    assert reuse["mode"] == "reuse" and naive["mode"] == "naive"
    assert reuse["token_end"] == 63  # two windows of 32 sharing one token read corpus tokens [0, 63)
    assert len(reuse["cells"]) == 4 * 2 * 2
    for a, b in zip(reuse["cells"], naive["cells"]):
        assert (a["layer"], a["tensor"], a["spec"]) == (b["layer"], b["tensor"], b["spec"])
        assert a["kld"] == pytest.approx(b["kld"], rel=1e-6, abs=1e-12)
        assert a["delta_ppl_pct"] == pytest.approx(b["delta_ppl_pct"], rel=1e-6, abs=1e-9)
    out = tmp_path / "out"
    assert (tmp_path / "out-naive" / "metrics.json").exists()
    assert (out / "plots" / "sensitivity_heatmap.png").stat().st_size > 1000
    assert (out / "plots" / "sensitivity_ranked.png").stat().st_size > 1000
    # ranking and K/V summary
    for spec in ("int4_g32", "int2_g32"):
        ranked = [c["kld"] for c in reuse["ranking"][spec]]
        assert ranked == sorted(ranked, reverse=True)
        kv = reuse["k_vs_v"][spec]
        assert kv["more_sensitive"] in ("key", "value") and kv["layers_compared"] == 4
    # fewer bits, more damage, cell by cell
    cells = {(c["layer"], c["tensor"], c["spec"]): c["kld"] for c in reuse["cells"]}
    for layer in range(4):
        for t in ("key", "value"):
            assert cells[(layer, t, "int2_g32")] > cells[(layer, t, "int4_g32")]


def test_scan_resumes_from_records(tmp_path):
    path = _config(tmp_path, specs=["int4_g32"], tensors=["value"], layers="1-2", plots=False)
    first = scan_command(str(path), quiet=True)
    records = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    assert len(records) == 2 * (1 + 2)  # 2 windows x (baseline + 2 cells)
    # drop the last cell and rerun: only it is computed again
    (tmp_path / "out" / "records.jsonl").write_text("\n".join(records[:-1]) + "\n")
    second = scan_command(str(path), quiet=True)
    assert len((tmp_path / "out" / "records.jsonl").read_text().splitlines()) == len(records)
    assert first["sensitivity"]["cells"] == second["sensitivity"]["cells"]


def test_scan_params_and_input_errors(tmp_path):
    assert "sensitivity" in TASKS
    with pytest.raises(KvevalError, match="did you mean 'int4_g64'"):
        validate({"name": "x", "kv": "int8", "tasks": [{"sensitivity": {"specs": ["int4_g46"]}}]})
    with pytest.raises(KvevalError, match="unknown key"):
        validate({"name": "x", "kv": "int8", "tasks": [{"sensitivity": {"spec": ["int4_g64"]}}]})
    assert Params().specs == ["int4_g64", "int2_g32"]
    path = _config(tmp_path, layers="7")
    with pytest.raises(KvevalError, match="layer 7"):
        run_experiment(load_config(path), quiet=True)
    assert not (tmp_path / "out").exists()  # input errors before the results folder is touched
    path.write_text(path.read_text().replace("sensitivity", "perplexity").replace('"specs": ["int4_g32", "int2_g32"], ', "")
                    .replace(', "layers": "7"', ""))
    with pytest.raises(KvevalError, match="no 'sensitivity' task"):
        scan_command(str(path), quiet=True)


def test_compare_matches_stats_compare_logits():
    from kveval.stats import compare_logits
    from kveval.tasks.sensitivity.task import baseline_terms, compare

    g = torch.Generator().manual_seed(0)
    base = torch.randn(20, 300, generator=g) * 3
    logits = base + 0.3 * torch.randn(20, 300, generator=g)
    targets = torch.randint(0, 300, (20,), generator=g)
    ref = compare_logits(base, logits, targets)
    got = compare(baseline_terms(base), logits, targets)
    assert got["kld_sum"] == pytest.approx(float(ref["kld"].sum()), rel=1e-10)
    assert got["nll_sum"] == pytest.approx(float(ref["nll"].sum()), rel=1e-12)
    assert got["agree_sum"] == float(ref["agree"].sum())


def test_the_2026_formats_are_scan_and_plan_candidates(tmp_path):
    """NVFP4, MXFP4 and TurboQuant's key codebook as scan specs: the prefix-reuse scan equals naive forward passes
    cell by cell, and ``kveval plan`` builds a mixed policy of them whose exact bill fits the budget."""
    from kveval.commands.plan import plan_command
    from kveval.memory import Arch, kv_bytes
    from kveval.quant import preset

    specs = ["nvfp4", "mxfp4", "turboquant_k4_nc"]
    path = _config(tmp_path, specs=specs, plots=False)
    reuse = scan_command(str(path), quiet=True)["sensitivity"]
    naive = scan_command(str(path), naive=True, quiet=True)["sensitivity"]
    assert len(reuse["cells"]) == 4 * 2 * 3 and {c["spec"] for c in reuse["cells"]} == set(specs)
    for a, b in zip(reuse["cells"], naive["cells"]):
        assert (a["layer"], a["tensor"], a["spec"]) == (b["layer"], b["tensor"], b["spec"])
        assert a["kld"] == pytest.approx(b["kld"], rel=1e-6, abs=1e-12) and a["kld"] > 0
    out = tmp_path / "gen" / "plan.yaml"
    plan_command(str(tmp_path / "out"), "nvfp4", str(out))
    side = json.loads((tmp_path / "gen" / "plan.plan.json").read_text())
    planned = load_config(out).policies()["planned"]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    arch = Arch(**metrics["memory"]["arch"])
    assert kv_bytes(arch, planned, side["context"]).total == side["total_bytes"] <= side["budget_bytes"]
    used = {s for row in side["layers"] for s in (row["key"], row["value"])}
    assert used <= set(specs) | {"int8", "none"}
    for row in side["layers"]:
        assert planned.specs_for_layer(row["layer"], 4) == (preset(row["key"]), preset(row["value"]))
