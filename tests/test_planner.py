"""The mixed-precision planner: budget syntax, the exact knapsack, byte-exact budgets, the generated config."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import yaml

from kveval.commands.plan import plan_command
from kveval.config import load_config
from kveval.errors import KvevalError
from kveval.memory import Arch, fp16_bytes, kv_bytes
from kveval.quant import preset
from kveval.tasks.sensitivity.planner import Budget, parse_budget, plan, solve


def brute_force(items, capacity):
    best = (float("inf"), None)
    for combo in itertools.product(*[range(len(c)) for c in items]):
        cost = sum(items[i][j][0] for i, j in enumerate(combo))
        value = sum(items[i][j][1] for i, j in enumerate(combo))
        if cost <= capacity and value < best[0] - 1e-12:
            best = (value, combo)
    return best


def test_solve_hand_checked():
    # two items, (cost, value); capacity 5: (2, 1.0) + (3, 0.5) = 1.5 beats (1, 3.0) + (4, 0.1) = 3.1
    items = [[(1, 3.0), (2, 1.0), (4, 0.0)], [(1, 2.0), (3, 0.5), (4, 0.1)]]
    assert solve(items, 5) == (pytest.approx(1.5), [1, 1])
    assert solve(items, 8) == (pytest.approx(0.1), [2, 2])
    assert solve(items, 2) == (pytest.approx(5.0), [0, 0])
    # gcd scaling: costs in multiples of 6
    items6 = [[(c * 6, v) for c, v in it] for it in items]
    assert solve(items6, 5 * 6 + 5) == (pytest.approx(1.5), [1, 1])
    # ties: the cheaper plan
    assert solve([[(1, 1.0), (3, 1.0)]], 3) == (pytest.approx(1.0), [0])


def test_solve_matches_brute_force_and_respects_capacity():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 5)
        items = [[(rng.randint(0, 9) * 3, rng.random()) for _ in range(rng.randint(1, 4))] for _ in range(n)]
        least = sum(min(c for c, _ in it) for it in items)
        capacity = least + rng.randint(0, 25)
        value, chosen = solve(items, capacity)
        expected, _ = brute_force(items, capacity)
        assert value == pytest.approx(expected, abs=1e-9)
        assert sum(items[i][j][0] for i, j in enumerate(chosen)) <= capacity
        assert sum(items[i][j][1] for i, j in enumerate(chosen)) == pytest.approx(value, abs=1e-9)


def test_solve_unachievable():
    with pytest.raises(KvevalError, match="cheapest plan needs 5 B"):
        solve([[(2, 0.0), (3, 0.0)], [(3, 1.0)]], 4)


def test_parse_budget():
    assert parse_budget("4.5") == Budget("bits", "4.5", "4.5")
    assert parse_budget("4.5bits").kind == "bits" and parse_budget(" 3b ").value == "3"
    assert parse_budget(4).kind == "bits"
    b = parse_budget("35KB/token")
    assert (b.kind, b.value) == ("bytes_per_token", "35000")
    assert parse_budget("1KiB/token").value == "1024" and parse_budget("30000B/token").value == "30000"
    assert parse_budget("0.28x").value == "7/25" and parse_budget("28%").value == "7/25"
    assert parse_budget("int4_g64") == Budget("policy", "int4_g64", "int4_g64")
    for bad in ("4.5 bananas", "-1", "0", "150%", "1.5x", "int4_g46", "35KB"):
        with pytest.raises(KvevalError):
            parse_budget(bad)


def test_budget_bytes_exact():
    arch = Arch.named("smollm2-135m")
    ctx = 256
    elements = 2 * 30 * 3 * ctx * 64
    assert parse_budget("4.5").bytes(arch, ctx) == elements * 9 // 16
    assert parse_budget("16").bytes(arch, ctx) == fp16_bytes(arch, ctx)
    assert parse_budget("25%").bytes(arch, ctx) == fp16_bytes(arch, ctx) // 4
    assert parse_budget("1000B/token").bytes(arch, ctx) == 1000 * ctx
    assert parse_budget("int4_g64").bytes(arch, ctx) == kv_bytes(arch, "int4_g64", ctx).total
    assert kv_bytes(arch, "int4_g64", ctx).bits_per_element == 4.5  # 32 B codes + fp16 scale and min per 64


def fake_scan(layers=4, kv_heads=2, head_dim=64, seq_len=64, seed=0):
    """metrics.json of a scan with random KLDs (finer specs always better)."""
    rng = random.Random(seed)
    cells = []
    for i in range(layers):
        for t in ("key", "value"):
            k2 = rng.uniform(0.01, 1.0) * (3 if t == "value" else 1)
            for spec, kld in (("int2_g32", k2), ("int4_g64", k2 * rng.uniform(0.02, 0.2)), ("int8", k2 * 1e-4)):
                cells.append({"layer": i, "tensor": t, "spec": spec, "kld": kld, "nll_delta": kld / 2})
    arch = Arch(layers=layers, kv_heads=kv_heads, head_dim=head_dim, name="fake", params=1000)
    return {"run": "fake_scan", "model": "builtin:tiny-llama",
            "memory": {"arch": arch.to_dict(), "context": seq_len},
            "sensitivity": {"specs": ["int8", "int4_g64", "int2_g32"], "seq_len": seq_len, "cells": cells,
                            "tokens": 63, "token_end": 64}}


def _brute_plan(metrics, capacity, specs):
    from kveval.tasks.sensitivity.planner import candidate_costs

    arch = Arch(**metrics["memory"]["arch"])
    ctx = metrics["sensitivity"]["seq_len"]
    costs = candidate_costs(arch, specs, ctx)
    kld = {(c["layer"], c["tensor"], c["spec"]): c["kld"] for c in metrics["sensitivity"]["cells"]}
    names = [(i, t) for i in range(arch.layers) for t in ("key", "value")]
    items = [[(costs[(i, t, s)], kld.get((i, t, s), 0.0)) for s in specs] for i, t in names]
    return brute_force(items, capacity)[0]


@pytest.mark.parametrize("budget", ["3", "3.7", "4.5", "int4_g64", "5.2bits", "0.4x", "40%", "400B/token"])
def test_plan_is_optimal_and_fits_the_budget_exactly(budget):
    metrics = fake_scan(layers=3)
    p = plan(metrics, budget)
    arch, ctx = p.arch, p.context
    bill = kv_bytes(arch, p.policy(), ctx)
    assert bill.total == p.total_bytes <= p.budget_bytes  # the memory bill of the written policy
    assert p.budget_bytes == parse_budget(budget).bytes(arch, ctx)
    if parse_budget(budget).kind == "bits":
        assert bill.bits_per_element <= float(parse_budget(budget).value)
    assert p.predicted_kld_sum == pytest.approx(_brute_plan(metrics, p.budget_bytes, ["int8", "int4_g64", "int2_g32"]))
    # the prediction is the sum of the chosen cells
    kld = {(c["layer"], c["tensor"], c["spec"]): c["kld"] for c in metrics["sensitivity"]["cells"]}
    chosen = sum(kld[(i, "key", k)] + kld[(i, "value", v)] for i, (k, v) in enumerate(zip(p.key, p.value)))
    assert chosen == pytest.approx(p.predicted_kld_sum)


def test_plan_at_uniform_memory_is_no_worse_than_uniform():
    metrics = fake_scan(layers=6, seed=3)
    p = plan(metrics, "int4_g64")
    uniform = sum(c["kld"] for c in metrics["sensitivity"]["cells"] if c["spec"] == "int4_g64")
    assert p.predicted_kld_sum <= uniform + 1e-12


def test_plan_with_fp_and_estimated_int8():
    metrics = fake_scan(layers=2)
    metrics["sensitivity"]["cells"] = [c for c in metrics["sensitivity"]["cells"] if c["spec"] != "int8"]
    metrics["sensitivity"]["specs"] = ["int4_g64", "int2_g32"]
    p = plan(metrics, "16")  # everything affordable: int8 (estimated, 4^-4 of int4) is the best quantized choice
    assert p.estimated == ["int8"] and set(p.key + p.value) == {"int8"}
    q = plan(metrics, "16", allow_fp=True)
    assert set(q.key + q.value) == {"none"} and q.predicted_kld_sum == 0.0


def test_unachievable_budget_is_a_clear_error():
    metrics = fake_scan()
    with pytest.raises(KvevalError, match=r"below the smallest plan.*3\.0000 bits/element"):
        plan(metrics, "2.5")


def test_plan_command_writes_a_runnable_config(tmp_path, capsys):
    scan = tmp_path / "scan"
    scan.mkdir()
    metrics = fake_scan(layers=4, kv_heads=4, head_dim=32)  # tiny-llama's shape
    metrics["sensitivity"]["specs"] = ["int4_g32", "int2_g32"]
    for c in metrics["sensitivity"]["cells"]:
        c["spec"] = {"int4_g64": "int4_g32"}.get(c["spec"], c["spec"])
    metrics["sensitivity"]["cells"] = [c for c in metrics["sensitivity"]["cells"] if c["spec"] != "int8"]
    (scan / "metrics.json").write_text(json.dumps(metrics))
    (scan / "config.resolved.yaml").write_text(yaml.safe_dump(
        {"model": {"name": "builtin:tiny-llama", "dtype": "float32", "device": "cpu", "trust_remote_code": False},
         "data": {"source": "builtin", "text_field": "text", "split": None}, "seed": 0}))
    out = tmp_path / "gen" / "plan.yaml"
    path = plan_command(str(scan), "int4_g32", str(out))
    assert path == str(out)
    text = out.read_text()
    assert text.splitlines()[0] == f"# kveval run {out.as_posix()}"
    assert "# predicted_kld_sum:" in text
    cfg = load_config(out)
    assert list(cfg.policies())[:2] == ["planned", "int4_g32"]
    # the validation run reads the corpus after the scan's tokens
    assert cfg.tasks[0].params.start_token == metrics["sensitivity"]["token_end"] > 0
    side = json.loads((tmp_path / "gen" / "plan.plan.json").read_text())
    assert side["total_bytes"] <= side["budget_bytes"]
    planned = cfg.policies()["planned"]
    arch = Arch(**metrics["memory"]["arch"])
    assert kv_bytes(arch, planned, side["context"]).total == side["total_bytes"]
    for row in side["layers"]:
        assert planned.specs_for_layer(row["layer"], 4) == (preset(row["key"]), preset(row["value"]))
    assert "planned:" in capsys.readouterr().out


def test_run_of_a_planned_config_reports_predicted_against_measured(tmp_path, capsys):
    test_plan_command_writes_a_runnable_config(tmp_path, capsys)
    from kveval.commands.run import run_experiment
    from kveval.report.tables import plan_table
    from kveval.results.read import load

    out = tmp_path / "run"
    cfg = load_config(tmp_path / "gen" / "plan.yaml", ["tasks[0].perplexity.max_tokens=128", f"output={out}",
                                                       "tasks[0].perplexity.bootstrap=0"])
    assert cfg.plan == (tmp_path / "gen" / "plan.plan.json").as_posix()
    metrics = run_experiment(cfg, quiet=True)
    side = json.loads((tmp_path / "gen" / "plan.plan.json").read_text())
    assert metrics["plan"]["predicted"]["planned"]["kld"] == side["predicted_kld_sum"]
    table = plan_table(load(out))
    row = table.set_index("policy").loc["planned"]
    assert row["measured KLD"] == format(metrics["policies"]["planned"]["kld_mean"], ".4g")
    assert row["predicted KLD"] == format(side["predicted_kld_sum"], ".4g")
    assert "Plan: predicted against measured" in (out / "report.md").read_text()
    # a missing plan file is one clear error before anything runs
    with pytest.raises(KvevalError, match="does not exist"):
        run_experiment(load_config(tmp_path / "gen" / "plan.yaml", ["plan=nope.plan.json", f"output={tmp_path}/r2"]))
