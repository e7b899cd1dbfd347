"""An lm-eval run in the report and on the console (no lm-eval needed: the metrics come from the task's own pure
aggregation of hand-written records): each task's primary metric per policy with its standard error, Δ and MDE, the
headline mean in the verdict table, and a closing console table without perplexity's empty columns."""

from __future__ import annotations

import json

import pytest
import yaml

from kveval.memory import Arch
from kveval.memory.rows import policy_memory_fields
from kveval.results import BASELINE, CONFIG_FILE, ENV_FILE, METRICS_FILE, RECORDS_FILE
from kveval.tasks.lm_eval.params import Params
from kveval.tasks.lm_eval.task import aggregate, headline, primary_metric

SCORES = {BASELINE: {"arc_easy": 0.70, "hellaswag": 0.50}, "int8": {"arc_easy": 0.69, "hellaswag": 0.51},
          "int2_g32": {"arc_easy": 0.30, "hellaswag": 0.26}}


def _records() -> list[dict]:
    out = []
    for policy, tasks in SCORES.items():
        for task, acc in tasks.items():
            out.append({"key": f"lm_eval/{task}/{policy}", "task": "lm_eval", "lm_eval_task": task, "policy": policy,
                        "layers_quantized": 0 if policy == BASELINE else 4,
                        "results": {task: {"acc": acc, "acc_stderr": 0.01, "acc_norm": acc + 0.05,
                                           "acc_norm_stderr": 0.01, "n": 200}}})
    return out


@pytest.fixture
def lm_eval_run(tmp_path):
    params = Params(tasks=["arc_easy", "hellaswag"])
    metrics = aggregate(_records(), ["int8", "int2_g32"], params)
    arch = Arch(layers=4, kv_heads=2, head_dim=64, name="builtin:tiny-llama", params=1_000_000)
    metrics[BASELINE].update(policy_memory_fields(arch, "fp16", 2048, "80GiB"))
    for name in ("int8", "int2_g32"):
        metrics["policies"][name].update(policy_memory_fields(arch, name, 2048, "80GiB"))
    metrics.update(run="lm", model="builtin:tiny-llama",
                   memory={"arch": arch.to_dict(), "context": 2048, "gpu_memory": "80GiB"})
    path = tmp_path / "lm"
    path.mkdir()
    config = {"name": "lm", "model": {"name": "builtin:tiny-llama", "device": "cpu", "dtype": "float32"},
              "data": {"source": "builtin"}, "kv": {"policies": {"int8": "int8", "int2_g32": "int2_g32"}},
              "tasks": [{"lm_eval": params.model_dump()}], "threshold": {"delta_ppl_pct": 1.0, "kld": None}}
    (path / CONFIG_FILE).write_text(yaml.safe_dump(config))
    (path / ENV_FILE).write_text(json.dumps({"argv": ["kveval", "run", "configs/lm.yaml"]}))
    (path / METRICS_FILE).write_text(json.dumps(metrics))
    (path / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return path, metrics


def test_the_headline_is_the_mean_of_the_named_tasks_primary_metrics(lm_eval_run):
    _, metrics = lm_eval_run
    assert primary_metric({"n": 3, "acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.6}) == ("acc", 0.5)
    assert metrics[BASELINE]["lm_eval_mean"] == pytest.approx((0.70 + 0.50) / 2)
    assert metrics["policies"]["int2_g32"]["lm_eval_mean"] == pytest.approx((0.30 + 0.26) / 2)
    assert headline({"other": {"acc": 1.0}}, ["arc_easy"]) is None


def test_the_report_shows_each_task_with_its_error_and_the_headline(lm_eval_run, tmp_path):
    from kveval.commands.report import report_command
    from kveval.report import load, tables

    path, _ = lm_eval_run
    res = load(path)
    glance = tables.glance_table(res)
    assert "lm-eval mean" in glance.columns and "ΔPPL % (MDE)" not in glance.columns
    assert glance.loc[glance["policy"] == "int2_g32", "lm-eval mean"].item() == "0.280"
    out = report_command([path], tmp_path / "report")
    md = (out / "report.md").read_text()
    assert "## lm-eval" in md
    assert "0.300 ± 0.010 (Δ -0.400, MDE 0.040)" in md  # 2.80 * sqrt(0.01² + 0.01²) = 0.0396
    csv = (out / "tables" / "lm_eval.csv").read_text()
    assert csv.count("\n") == 1 + 3 * 2 * 2  # header + (policy, task, metric acc / acc_norm)


def test_the_console_table_of_an_lm_eval_run_has_no_empty_perplexity_columns(lm_eval_run):
    from rich.console import Console

    from kveval.report.console import summary_table

    _, metrics = lm_eval_run

    class Cfg:
        name = "lm"

        class threshold:  # noqa: N801 - the config's attribute name
            delta_ppl_pct, kld = 1.0, None

    console = Console(record=True, width=200)
    console.print(summary_table(metrics, Cfg))
    text = console.export_text()
    assert "lm-eval mean" in text and "0.280" in text
    assert "PPL" not in text and "threshold" not in text
