"""``kveval plan SCAN_DIR --budget B``: a mixed-precision plan under a memory budget, written as a runnable config
and a ``.plan.json`` sidecar."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from kveval.errors import KvevalError
from kveval.memory import fp16_bytes, kv_bytes
from kveval.policy.plan_file import PlanFile, PlannedLayer, UniformPlan
from kveval.policy.selectors import layer_ranges
from kveval.results.layout import CONFIG_FILE
from kveval.tasks.sensitivity.planner import (
    GENERATED_DIR,
    MissingEngineSpecs,
    nearest_uniform,
    plan,
    uniform_prediction,
)
from kveval.units import format_bytes


def slug(text: str) -> str:
    """``text`` as one plain file-name component (letters, digits, ``_.-``; anything else ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", text).strip("_") or "plan"


def _check_same_model(scan_dir: Path, resolved: dict, metrics: dict) -> None:
    """KvevalError when the scan folder's config and metrics name different models (files of two runs mixed by
    hand): a plan needs to know which model it was measured on."""
    model = resolved.get("model")
    name = model.get("name") if isinstance(model, dict) else model
    measured = metrics.get("model")
    if isinstance(name, str) and isinstance(measured, str) and name != measured:
        raise KvevalError(f"scan folder {scan_dir}: config.resolved.yaml names model {name!r} but metrics.json was "
                          f"measured on {measured!r}; rerun the scan (kveval scan CONFIG) to rebuild the folder")


def plan_command(scan_dir: str, budget: str, out: str | None = None, *, context: int | None = None,
                 allow_fp: bool = False, eval_tokens: int = 4096, engine: str | None = None,
                 from_inspect: bool = False) -> str:
    """``kveval plan SCAN_DIR --budget B [--out PATH] [--engine E]``: write a ready-to-run config and
    ``<name>.plan.json`` beside it; print a summary; return the config's path. ``engine``: plan only among the
    policies that engine can run (:func:`kveval.tasks.sensitivity.planner.engine_plan`; ``kveval deploy`` prints
    its flags). ``from_inspect``: ``scan_dir`` is a ``kveval inspect`` folder, whose sensitivity is predicted
    (stated as such in the config's header and the summary); a scan folder is then refused, as an inspect folder is
    without it.

    Bad input is one KvevalError line before anything is written: a scan whose metrics.json misses fields or holds
    wrong ones (:func:`kveval.tasks.sensitivity.planner.check_scan`), a budget below the smallest plan, a context
    out of range, an ``--out`` that cannot be written."""
    from kveval.results import atomic_write_text, read_config, read_metrics

    scan_dir = Path(scan_dir)
    metrics = read_metrics(scan_dir)
    resolved = read_config(scan_dir)
    _check_same_model(scan_dir, resolved, metrics)
    predicted = isinstance(metrics, dict) and isinstance(metrics.get("sensitivity"), dict) and bool(
        metrics["sensitivity"].get("predicted"))
    if predicted and not from_inspect:
        raise KvevalError(f"{scan_dir} holds kveval inspect's predicted sensitivity, not a scan; plan from it with "
                          f"--from-inspect, or measure it: kveval scan CONFIG")
    if from_inspect and not predicted:
        raise KvevalError(f"--from-inspect: {scan_dir} is not a kveval inspect folder (its metrics.json holds no "
                          "predicted sensitivity); drop --from-inspect to plan from a scan")
    if predicted and not metrics["sensitivity"].get("cells"):
        raise KvevalError(f"{scan_dir}: kveval inspect predicted no sensitivity there (none of its policies is a "
                          "single quantizer preset); rerun it with --kv SPEC, e.g. --kv int8 --kv int4_g64")
    try:
        p = plan(metrics, budget, context=context, allow_fp=allow_fp, engine=engine)
    except MissingEngineSpecs as exc:
        from kveval.commands.scan import engine_scan_line

        assert engine is not None
        again = f"{scan_dir}-{engine}"
        raise KvevalError(f"{exc}; scan them with: {engine_scan_line(str(scan_dir / CONFIG_FILE), engine, again)}"
                          f", then: kveval plan {shlex.quote(again)} --budget {shlex.quote(budget)} --engine "
                          f"{engine}") from None
    if engine == "transformers" and p.arch.sliding_layers:  # QuantizedCache refuses such a model (kveval deploy)
        raise KvevalError(f"--engine transformers: transformers' QuantizedCache has no sliding-window layers and "
                          f"this model has {len(p.arch.sliding_layers)}; plan for another engine, or without --engine")
    name = slug(f"{metrics.get('run', 'scan')}_plan_{p.budget.text}" + (f"_{engine}" if engine else ""))
    path = Path(out) if out else GENERATED_DIR / f"{name}.yaml"
    if path.suffix not in (".yaml", ".yml"):
        path = path / f"{name}.yaml"
    scanned = list(metrics["sensitivity"]["specs"])
    if engine:
        from kveval.engines.tables import ENGINES

        pool = [s for s in ENGINES[engine].candidates(scanned) if s != "none"]
    else:
        pool = list(dict.fromkeys(scanned + ["int8"]))
    uniform = nearest_uniform(metrics, p, pool)
    bills = {s: kv_bytes(p.arch, s, p.context) for s in uniform}
    fp16 = fp16_bytes(p.arch, p.context)
    policies = {"planned": p.policy_config(), **{s: s for s in uniform}}
    config = {
        "name": name,
        "model": resolved.get("model", metrics.get("model")),
        "data": resolved.get("data", "builtin"),
        "kv": {"policies": policies},
        "tasks": [{"perplexity": {"seq_len": metrics["sensitivity"].get("seq_len", 512), "max_tokens": eval_tokens,
                                  "start_token": int(metrics["sensitivity"].get("token_end", 0))}}],
        "threshold": resolved.get("threshold", {"delta_ppl_pct": 1.0}),
        "plan": path.with_name(path.stem + ".plan.json").as_posix(),
        "seed": resolved.get("seed", 0),
    }
    from kveval.config import check_writable_path, validate  # lazy: it imports the task registry

    validate(config, str(path))  # the written config must load
    for target in (path, path.with_name(path.stem + ".plan.json")):  # before writing either file
        check_writable_path(target, "--out", folder=False)
    cmd = shlex.join(["kveval", "plan", str(scan_dir), "--budget", p.budget.text]
                     + (["--from-inspect"] if from_inspect else []))
    predictions = {s: uniform_prediction(metrics, s) for s in uniform}
    header = [
        f"# kveval run {path.as_posix()}",
        f"# Generated by: {cmd}",
        f"# Budget {p.budget.describe(p.arch, p.context)}",
        f"# Planned: {p.total_bytes} B at {p.context} tokens = {p.bits_per_element:.4f} bits/element, "
        f"{p.total_bytes / p.context:.1f} B/token, {p.total_bytes / fp16:.4f}x FP16 (scales included)",
        (f"# predicted_kld_sum: {p.predicted_kld_sum:.6g}  (sum of the per-cell KLDs PREDICTED by kveval inspect from "
         "the attention-output error of each layer, scaled to one measured uniform pass per spec; not a scan)"
         if from_inspect else
         f"# predicted_kld_sum: {p.predicted_kld_sum:.6g}  (sum of the scanned per-cell mean KLDs; cells assumed additive)"),
        f"# predicted_delta_ppl_pct: {p.predicted_delta_ppl_pct:.4g}",
        *[f"# uniform {s}: {bills[s].bits_per_element:.4f} bits/element, predicted_kld_sum {predictions[s]:.6g}"
          for s in uniform],
        (f"# Engine: {engine}: only the policies it can run, from the scanned {', '.join(pool)} (kveval deploy "
         f"{path.with_name(path.stem + '.plan.json').as_posix()} prints its flags)" if engine else
         f"# Candidates: {', '.join(scanned + [s for s in ('int8',) if s not in scanned])}"
         + (" + none" if allow_fp else "") + (f"; KLD of {', '.join(p.estimated)} estimated (not scanned)"
                                               if p.estimated else "")),
        "# Per layer (K / V): " + "; ".join(f"{i}: {k}/{v}" for i, (k, v) in enumerate(zip(p.key, p.value))),
        (f"# Evaluated on corpus tokens from {metrics['sensitivity']['token_end']} on: after the scan's slice "
         f"[0, {metrics['sensitivity']['token_end']}), so the plan is not judged on the tokens it was fitted on."
         if metrics["sensitivity"].get("token_end") else
         "# The perplexity windows start at the corpus start: the scan's tokens are part of them (older scan)."),
    ]
    plan_file = PlanFile(  # the schema's checks before either file is written
        scan=str(scan_dir), command=cmd, config=path.as_posix(), budget=p.budget.text,
        budget_bytes=p.budget_bytes, context=p.context, arch=p.arch.to_dict(),
        total_bytes=p.total_bytes, bits_per_element=p.bits_per_element,
        bytes_per_token=p.total_bytes / p.context, fraction_of_fp16=p.total_bytes / fp16,
        predicted_kld_sum=p.predicted_kld_sum, predicted_delta_ppl_pct=p.predicted_delta_ppl_pct,
        estimated_specs=p.estimated, allow_fp=allow_fp, engine=engine,
        layers=[PlannedLayer(layer=i, key=k, value=v) for i, (k, v) in enumerate(zip(p.key, p.value))],
        policy=p.policy_config(),
        uniform={s: UniformPlan(bits_per_element=bills[s].bits_per_element, total_bytes=bills[s].total,
                                predicted_kld_sum=predictions[s]) for s in uniform},
    )
    text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False, width=110)
    atomic_write_text(path, text)
    plan_file.write(path.with_name(path.stem + ".plan.json"))
    counts = {s: (p.key.count(s), p.value.count(s)) for s in dict.fromkeys(p.key + p.value)}
    print(f"plan under {p.budget.describe(p.arch, p.context)}"
          + (" (from kveval inspect's predicted sensitivity, not a scan)" if from_inspect else ""))
    print(f"  planned: {p.bits_per_element:.4f} bits/element, predicted summed KLD {p.predicted_kld_sum:.4g}, "
          f"predicted ΔPPL {p.predicted_delta_ppl_pct:+.3f}%")
    print("  layers per spec (K, V): " + ", ".join(f"{s} {k}/{v}" for s, (k, v) in counts.items()))
    for tensor, specs in (("keys", p.key), ("values", p.value)):
        print(f"  {tensor}: " + "; ".join(f"{s} at {layer_ranges(i for i, x in enumerate(specs) if x == s)}"
                                          for s in dict.fromkeys(specs)))
    print(f"  cache at {p.context:,} tokens: {p.total_bytes:,} B ({format_bytes(p.total_bytes)}), "
          f"{p.total_bytes / fp16:.4f}x FP16")
    for s in uniform:
        print(f"  uniform {s}: {bills[s].bits_per_element:.4f} bits/element, predicted summed KLD {predictions[s]:.4g}")
    print(f"config: {path}   run it: {shlex.join(['kveval', 'run', str(path)])}")
    if engine:
        deploy = ["kveval", "deploy", str(path.with_name(path.stem + ".plan.json")), "--engine", engine]
        print(f"its flags for {engine}: {shlex.join(deploy)}")
    return str(path)
