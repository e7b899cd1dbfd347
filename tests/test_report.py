"""Reports: every plot on a synthetic results folder, the self-contained HTML, optional tasks, corrupt input,
several runs. No model: the folders are written by hand (tests/synthetic_runs.py)."""

from __future__ import annotations

import json
import re
import shutil

import pandas as pd
import pytest
from synthetic_runs import write_synthetic_run

from kveval.commands.report import report_command, write_run_report
from kveval.errors import KvevalError
from kveval.report import load, plots
from kveval.report.reading import kv_pairs, reading_of

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A run with every optional part: needle cells, a sensitivity scan, noise floors, a mixed policy."""
    return write_synthetic_run(tmp_path_factory.mktemp("runs") / "full", needle=True, sensitivity=True,
                               noise_floor=True)


@pytest.fixture(scope="module")
def full_report(full_run, tmp_path_factory):
    return report_command([full_run], tmp_path_factory.mktemp("report"))


def test_load_frames(full_run):
    res = load(full_run)
    assert list(res.summary["policy"]) == ["baseline", "int8", "int4_g64", "k4v8", "k8v4", "kivi2", "mixed"]
    base = res.summary.iloc[0]
    assert base["delta_ppl_pct"] == 0 and base["compression_vs_fp16"] == pytest.approx(1.0)
    assert res.summary["spec"].iloc[1] == "K/V int8 sym token (fp16 scales)"
    assert set(res.positions["policy"]) == set(res.summary["policy"])
    assert len(res.layers) == 6 * 4 and {"key_rel_mse", "value_rel_mse"} <= set(res.layers.columns)
    assert len(res.needle) == 7 * 9 and len(res.sensitivity) == 8
    assert list(res.memory["policy"])[0] == "baseline"
    assert (res.memory["codes"] + res.memory["scales"] + res.memory["residual"] == res.memory["total"]).all()
    assert len(res.records) == 8 * 7
    assert res.threshold == {"delta_ppl_pct": 1.0, "kld": None}


@pytest.mark.parametrize("name", list(plots.RUN_PLOTS))
def test_every_plot_writes_a_png(full_run, tmp_path, name):
    fig = plots.RUN_PLOTS[name](load(full_run))
    assert fig is not None, name
    path = plots.save(fig, tmp_path / f"{name}.png", dpi=40)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000
    for ax in fig.axes:  # every visible panel (colour bars aside) is labelled
        if ax.get_visible() and ax.axison and ax.get_label() != "<colorbar>":
            assert ax.get_xlabel() or ax.get_ylabel(), (name, ax.get_title())
    assert any(ax.get_xlabel() for ax in fig.axes) and any(ax.get_ylabel() for ax in fig.axes)


def test_pareto_front():
    # (bytes, damage): the point at 3 is dominated by the one at 2
    assert plots.pareto_front([1, 2, 3, 4], [10, 1, 5, 0.5]) == [0, 1, 3]
    assert plots.pareto_front([1, float("nan")], [1, 0]) == [0]


def test_report_files_and_self_contained_html(full_run, full_report):
    out = full_report
    for f in ("report.md", "report.html", "tables/summary.csv", "tables/positions.csv", "tables/layers.csv",
              "tables/memory.csv", "tables/needle.csv", "tables/sensitivity.csv"):
        assert (out / f).is_file(), f
    pngs = sorted((out / "plots").glob("*.png"))
    assert {p.stem for p in pngs} == set(plots.RUN_PLOTS)
    page = (out / "report.html").read_text()
    # every image embedded, and nothing else is fetched
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == len(pngs) and all(s.startswith("data:image/png;base64,") for s in srcs)
    without_data = re.sub(r'data:image/png;base64,[A-Za-z0-9+/=]+', "", page)
    assert "http" not in without_data and "<script" not in without_data and "<link" not in without_data
    assert "href=" not in without_data and "url(" not in without_data
    # every table: the verdict table (one row per policy), memory, worst layers, environment
    assert page.count("<table>") >= 4
    summary = pd.read_csv(out / "tables" / "summary.csv")
    for policy in summary["policy"]:
        assert f"<td>{policy}</td>" in page
    md = (out / "report.md").read_text()
    for p in pngs:
        assert f"](plots/{p.name})" in md
    assert "kveval run configs/full.yaml" in md and "kveval report" in md
    assert "within_noise" in page


def test_reading(full_run):
    res = load(full_run)
    assert kv_pairs(res) == [("k4v8", "k8v4")]
    text = "\n".join(reading_of(res))
    assert "Keys are more sensitive than values" in text and "K4/V8 (k4v8)" in text
    assert "cheapest policy within ΔPPL ≤ 1%" in text


def test_missing_optional_parts_still_report(tmp_path):
    run = write_synthetic_run(tmp_path / "plain", policies=("int8", "int4_g64"), records=False)
    m = json.loads((run / "metrics.json").read_text())
    for p in m["policies"].values():  # an old run: no memory fields, no layer errors
        for k in ("bytes_per_token", "compression_vs_fp16", "bits_per_element", "max_batch", "layer_errors"):
            p.pop(k)
    m.pop("memory")
    (run / "metrics.json").write_text(json.dumps(m))
    (run / "env.json").unlink()
    out = report_command([run])
    assert out == run
    stems = {p.stem for p in (out / "plots").glob("*.png")}
    assert {"policy_quality", "by_position"} <= stems
    # no memory fields and a model whose shape is unknown: nothing to put on a memory axis
    assert not stems & {"needle_grid", "sensitivity_grid", "layer_errors", "bits_per_layer", "memory", "quality_vs_memory"}
    assert not (out / "tables" / "needle.csv").exists()
    md = (out / "report.md").read_text()
    assert "int4_g64" in md and "Keys are more sensitive" not in md
    res = load(run)
    assert res.summary["bytes_per_token"].iloc[1:].isna().all()


def test_memory_fields_of_old_runs_come_from_the_bill(tmp_path):
    run = write_synthetic_run(tmp_path / "old", policies=("int8",), records=False)
    m = json.loads((run / "metrics.json").read_text())
    expected = m["policies"]["int8"]["bytes_per_token"]
    del m["policies"]["int8"]["bytes_per_token"]
    m["model"] = "builtin:smollm2-135m"
    (run / "metrics.json").write_text(json.dumps(m))
    res = load(run)  # the arch still comes from metrics["memory"]
    assert res.summary.set_index("policy").loc["int8", "bytes_per_token"] == pytest.approx(expected)


def test_corrupt_metrics_is_one_line(tmp_path):
    run = write_synthetic_run(tmp_path / "bad", policies=("int8",), records=False)
    (run / "metrics.json").write_text('{"run": "bad", "policies": {')
    with pytest.raises(KvevalError) as exc:
        report_command([run])
    msg = str(exc.value)
    assert "metrics.json" in msg and "\n" not in msg
    assert not (run / "report.html").exists()
    with pytest.raises(KvevalError, match="does not exist"):
        load(tmp_path)


def test_write_run_report_fails_in_one_line_and_keeps_the_results(tmp_path):
    """A report that cannot be drawn is one KvevalError line (kveval run then exits 2), naming the folder and how
    to draw it again; the run's files are untouched."""
    run = write_synthetic_run(tmp_path / "r", policies=("int8",), records=False)
    write_run_report(run)
    assert (run / "report.html").is_file()
    (run / "metrics.json").write_text("not json")
    with pytest.raises(KvevalError) as info:
        write_run_report(run)
    msg = str(info.value)
    assert msg.startswith(f"the report of {run} was not written:") and "\n" not in msg
    assert "kept" in msg and f"kveval report {run}" in msg
    assert (run / "metrics.json").read_text() == "not json"


def test_multi_run_report(tmp_path):
    a = write_synthetic_run(tmp_path / "a", policies=("int8", "k4v8", "k8v4"), records=False)
    other = write_synthetic_run(tmp_path / "other", policies=("int8", "int2_g32"), seed=1, records=False)
    twin = tmp_path / "twin"  # the same run name twice: kept apart
    shutil.copytree(other, twin)
    out = report_command([a, other, twin], tmp_path / "cmp")
    summary = pd.read_csv(out / "tables" / "summary.csv")
    assert list(dict.fromkeys(summary["run"])) == ["a", "other", "other-2"]
    assert len(summary) == 4 + 3 + 3
    assert (out / "plots" / "all_runs_quality_vs_memory.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "plots" / "other-2_memory.png").is_file()
    md = (out / "report.md").read_text()
    assert "## All policies of all runs" in md and "| run |" in md
    assert "## Run a" in md and "## Run other-2" in md
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(list((out / "plots").glob("*.png")))


def test_default_out_for_several_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = [write_synthetic_run(tmp_path / n, policies=("int8",), records=False) for n in ("x", "y")]
    out = report_command(runs)
    assert out.parent.name == "reports" and (tmp_path / out / "report.html").is_file()


def test_no_runs_is_an_error():
    with pytest.raises(KvevalError):
        report_command([])


def test_unfinished_run_says_so(tmp_path):
    run = write_synthetic_run(tmp_path / "half", policies=("int8",))
    (run / "metrics.json").unlink()
    with pytest.raises(KvevalError, match="unfinished"):
        report_command([run])


def test_the_verdict_table_reads_at_a_glance(full_run, full_report):
    """The first table: at most 8 columns (policy, bits, ΔPPL % with its MDE, KLD, KLD 99%, same top p, max batch
    at the deployment context, verdict), the verdict last; every other column in the appendix's table."""
    from kveval.report import tables

    res = load(full_run)
    glance = tables.glance_table(res)
    assert 4 <= len(glance.columns) <= tables.GLANCE_COLUMNS and list(glance.columns)[:2] == ["policy", "bits/elem"]
    assert glance.columns[-1] == "verdict" and list(glance["policy"]) == list(res.summary["policy"])
    full = tables.verdict_table(res)
    assert len(full.columns) > len(glance.columns)
    md = (full_report / "report.md").read_text()
    assert md.index("## Verdicts") < md.index("## Appendix: every column") < md.index("## Environment")


def test_max_batch_is_sized_at_the_deployment_context(tmp_path):
    """metrics.json's memory.deployment (the model's context limit, or memory.context): the glance table's max batch
    and its header come from there, and the memory table gains the same bill at that context; a run before it falls
    back to its own context."""
    from kveval.memory import Arch
    from kveval.memory.rows import policy_memory_fields
    from kveval.report import tables

    path = write_synthetic_run(tmp_path / "r")
    metrics = json.loads((path / "metrics.json").read_text())
    old = tables.glance_table(load(path))
    assert not any("@ 8k" in c for c in old.columns)
    arch = Arch.from_dict(metrics["memory"]["arch"])
    metrics["memory"]["gpu_memory"] = "80GiB"
    metrics["memory"]["deployment"] = {
        "context": 8192, "baseline": policy_memory_fields(arch, "fp16", 8192, "80GiB"),
        "policies": {n: policy_memory_fields(arch, "int8", 8192, "80GiB") for n in metrics["policies"]}}
    (path / "metrics.json").write_text(json.dumps(metrics))
    res = load(path)
    glance = tables.glance_table(res)
    col = "max batch @ 8k, 80GiB"
    want = f"{metrics['memory']['deployment']['baseline']['max_batch']:,}"
    assert glance.loc[glance["policy"] == "baseline", col].item() == want
    memory = tables.memory_table(res)
    assert "max batch @ 8k" in memory.columns and "total @ 8k" in memory.columns


def test_a_wide_range_of_delta_ppl_stays_readable():
    """0.18% and 16.5% on one axis: symmetric log from the decade of the smallest value, so 0.1-1 and 1-10 get the
    same height (a linear part up to the 1% threshold gave 0-1 the height of 1-20)."""
    from kveval.report.style import readable_linthresh

    assert readable_linthresh([0.184, 16.49], 1.0) == pytest.approx(0.1)
    assert readable_linthresh([0.0001, 30.0], 1.0) == pytest.approx(0.01)  # at most two decades below the threshold
    assert readable_linthresh([5.0, 30.0], 1.0) == pytest.approx(1.0)  # never above the threshold
    assert readable_linthresh([0.0], 1.0) == 1.0


def test_plot_titles_name_the_model_not_the_run(full_run):
    res = load(full_run)
    model = str(res.metrics["model"])
    assert model != res.name
    for name, fn in plots.RUN_PLOTS.items():
        fig = fn(res)
        if fig is None:
            continue
        titles = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
        assert not any(t.startswith(f"{res.name}:") for t in titles), (name, titles)
        assert any(model in t for t in titles), (name, titles)


def test_the_reports_next_steps_paste_back_from_a_folder_with_a_space(tmp_path):
    """The "rebuild this report" line of a run in a folder whose name has a space and a ';' splits, as a shell
    would split it, into exactly `kveval report FOLDER`."""
    import shlex

    path = write_synthetic_run(tmp_path / "my runs; x" / "r")
    out = report_command([path], None)
    md = (out / "report.md").read_text()
    line = md.split("# rebuild this report\n", 1)[1].splitlines()[0]
    assert shlex.split(line) == ["kveval", "report", str(path)]


def test_reading_says_the_next_cheaper_policys_own_verdict(tmp_path):
    """Issue 53: the Reading said "k8v4 ... fails with ΔPPL +1.14%" where the table and metrics.json said
    inconclusive; the sentence now carries the policy's verdict, the same field the table shows."""
    run = write_synthetic_run(tmp_path / "r", policies=("int8", "int4_g64"))
    m = json.loads((run / "metrics.json").read_text())
    m["policies"]["int8"]["verdict"] = "pass"
    m["policies"]["int4_g64"].update(verdict="inconclusive", delta_ppl_pct=1.14)
    (run / "metrics.json").write_text(json.dumps(m))
    text = "\n".join(reading_of(load(run)))
    assert "int4_g64" in text and "is inconclusive at this run's size with ΔPPL +1.14%" in text
    assert "fails" not in text
    m["policies"]["int4_g64"]["verdict"] = "fail"
    (run / "metrics.json").write_text(json.dumps(m))
    assert "fails with ΔPPL +1.14% (its verdict: fail)" in "\n".join(reading_of(load(run)))


def test_max_batch_says_its_context_and_never_compares_two_unlabelled(tmp_path):
    """Issue 53: the appendix's max batch had no context, and the cross-run table put max batches counted at
    different contexts side by side."""
    from pathlib import Path

    from kveval.report.tables import verdict_table

    reference = Path(__file__).resolve().parents[1] / "results" / "reference"
    one = load(str(reference))
    dep = one.metrics["memory"]["deployment"]
    assert dep["context"] == 8192
    table = verdict_table(one)
    assert "max batch @ 8k" in table.columns and "max batch" not in table.columns
    assert table.set_index("policy").loc["int8", "max batch @ 8k"] == f"{dep['policies']['int8']['max_batch']:,}"
    other = tmp_path / "other"
    shutil.copytree(reference, other)
    metrics = json.loads((other / "metrics.json").read_text())
    metrics["run"] = "other"
    metrics["memory"]["deployment"]["context"] = 4096
    (other / "metrics.json").write_text(json.dumps(metrics))
    config = (other / "config.resolved.yaml").read_text().replace("name: int4_g64", "name: other")
    (other / "config.resolved.yaml").write_text(config)
    both = verdict_table([one, load(str(other))])
    cells = dict(zip(zip(both["run"], both["policy"]), both["max batch @ context"]))
    assert cells[(one.name, "int8")].endswith(" @ 8k") and cells[("other", "int8")].endswith(" @ 4k"), cells
