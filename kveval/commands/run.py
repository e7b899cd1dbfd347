"""Run one experiment: set up (model, data, results folder), run each task, aggregate, report."""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kveval.config import ExperimentConfig
from kveval.errors import KvevalError
from kveval.policy import KVPolicy
from kveval.progress import Progress
from kveval.results import (
    BASELINE,
    SCALES_FILE,
    SCALES_USED_FILE,
    RunDir,
    atomic_write_json,
    environment,
    lock_folder,
    now,
    run_folder,
)
from kveval.results.layout import TASK_ENTRIES
from kveval.results.store import task_label, tokens_digest


@dataclass
class RunContext:
    """What a task gets: the config, the loaded model and data, the run folder, and a way to report progress.

    ``run``: inside a task's ``run``, the folder as that task entry sees it (:class:`kveval.results.TaskRecords`:
    ``done_keys``, ``append``, ``records``, ``path``); elsewhere the :class:`kveval.results.RunDir` itself, None
    before the folder is opened (task checks).
    """

    cfg: ExperimentConfig
    run: Any
    model: Any
    tokenizer: Any
    policies: dict[str, KVPolicy]
    info: dict
    console: Console
    progress: Progress
    cache: dict = field(default_factory=dict)
    folder: RunDir | None = None
    #: ``model.weights``: ``{VARIANT: kveval.weights.apply.PreparedVariant}`` checked against the model (empty: the
    #: checkpoint alone); the perplexity task scores every window under each of them too
    weights: dict = field(default_factory=dict)

    def tokens(self) -> torch.Tensor:
        """The corpus as token ids ``[n_tokens]`` (loaded once, cached on disk per tokenizer and corpus). Loaded
        after the run folder is open, they are checked against the tokens its records were computed on."""
        if "tokens" not in self.cache:
            from kveval.data import load_tokens

            d = self.cfg.data
            self.cache["tokens"] = load_tokens(d.source, self.tokenizer, split=d.split, text_field=d.text_field)
            if self.folder is not None:
                self.folder.record_tokens(tokens_digest(self.cache["tokens"]))
        return self.cache["tokens"]


def merge(into: dict, part: dict) -> dict:
    """Deep-merge task metrics into the run's metrics."""
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def add_task_metrics(metrics: dict, part: dict, kind: str, label: str = "") -> dict:
    """Put one task entry's metrics into the run's: the first entry of each kind (``label`` ``""``) merges into the
    top level (``baseline``, ``policies``...), a later entry of the same kind (``label`` ``"tasks[i]"``:
    :func:`kveval.results.store.task_label`) goes whole under ``metrics["tasks"][label]`` with its ``kind``, so
    that two entries of one kind never overwrite each other's fields."""
    if not label:
        return merge(metrics, part)
    metrics.setdefault(TASK_ENTRIES, {})[label] = {"kind": kind, **part}
    return metrics


def task_runners() -> dict[str, Any]:
    from kveval.tasks import TASKS

    return TASKS


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def command_line(config_path: str | None) -> str:
    """The command as typed, for the lock file and messages: ``kveval ARGS`` when run as the kveval program, else
    ``kveval run CONFIG`` (library callers)."""
    import shlex

    argv = sys.argv
    if argv and Path(str(argv[0])).name in ("kveval", "__main__.py") and len(argv) > 1:
        return "kveval " + shlex.join(str(a) for a in argv[1:])
    return f"kveval run {config_path}" if config_path else f"{Path(str(argv[0])).name if argv else 'python'} (library)"


def run_experiment(
    cfg: ExperimentConfig, *, overwrite: bool = False, quiet: bool = False, config_path: str | None = None
) -> dict:
    """Run every task of ``cfg`` and write the results folder; returns the aggregated metrics.

    The run folder has one owner: this process holds its lock (:func:`kveval.results.lock_folder`) from the first
    check to the end, so a second run on the same folder is refused with one line naming this one. Every check
    (the folder, the config, the model, the tasks' inputs, scales, plan, corpus tokens) passes before the folder
    is written, and ``overwrite`` removes kveval's own files only then (:meth:`RunDir.open`).
    """
    runners = task_runners()
    for entry in cfg.tasks:
        if entry.kind not in runners:
            raise KvevalError(f"task '{entry.kind}' is not available in this version of kveval")
    out_dir = run_folder(cfg.name, cfg.output)  # contained (no '..' names, '~' expanded) before anything is written
    with lock_folder(out_dir, command=command_line(config_path)) as lock:
        if lock.stale:
            print(f"kveval: note: {out_dir} was locked by a process that ended without releasing it "
                  f"(pid {lock.stale.get('pid')} on {lock.stale.get('host')}); taking it over", file=sys.stderr)
        return _run_locked(cfg, out_dir, runners, overwrite=overwrite, quiet=quiet, config_path=config_path)


def _run_locked(cfg: ExperimentConfig, out_dir: Path, runners: dict, *, overwrite: bool, quiet: bool,
                config_path: str | None) -> dict:
    """The body of :func:`run_experiment`, with the folder's lock held."""
    from kveval.models import load_model, model_info

    console = Console(width=None if sys.stdout.isatty() else 140)
    policies = cfg.policies()
    RunDir.check(out_dir, cfg.resolved(), overwrite=overwrite)  # before any slow work, and before any write

    seed_everything(cfg.seed)
    console.print(f"[bold]kveval[/] {cfg.name}: loading {cfg.model.name} ({cfg.model.dtype}, {cfg.model.device})")
    model, tokenizer = load_model(
        cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed,
        device_map=cfg.model.device_map, max_memory=cfg.model.max_memory,
    )
    info = model_info(model)
    for policy in policies.values():
        policy.check_model(info["num_layers"], info["head_dim"])
    weights = prepare_weights(cfg, model)  # shapes, group sizes, module kinds: before anything is written

    ctx = RunContext(
        cfg=cfg, run=None, model=model, tokenizer=tokenizer, policies=policies, info=info,
        console=console, progress=Progress(console, quiet=quiet), weights=weights,
    )
    for entry in cfg.tasks:  # every input error surfaces before the results folder is touched
        check = getattr(runners[entry.kind], "check", None)
        if check is not None:
            check(ctx, entry.params)
    scales_used = {**check_scales(ctx), **gguf_weights_used(ctx)}
    reset = check_scales_unchanged(out_dir, scales_used, overwrite=overwrite)
    plan = read_plan(cfg.plan)
    replace = RunDir.check(out_dir, cfg.resolved(), overwrite=overwrite) or reset
    digest = tokens_digest(ctx.cache["tokens"]) if "tokens" in ctx.cache else None
    if digest is not None and not replace:
        try:
            RunDir.check_tokens(out_dir, digest)
        except KvevalError:
            if not overwrite:
                raise
            reset = True  # --overwrite: start afresh on the new tokens

    # every check has passed: the first write (overwrite removes kveval's own files only now)
    run = ctx.run = ctx.folder = RunDir.open(out_dir, cfg.resolved(), overwrite=overwrite, reset=reset)
    if digest is not None:
        run.record_tokens(digest)
    if scales_used:
        atomic_write_json(run.path / SCALES_USED_FILE, scales_used)
    resolve_auto_scales(ctx)
    started = now()
    env = environment(cfg.model.device)
    env["config_path"] = config_path
    env["command"] = f"kveval run {config_path}" if config_path else None
    if weights:
        env["weights"] = weights_info(ctx)
    run.write_env(env, started=started)
    metrics: dict = {"run": cfg.name, "model": cfg.model.name, BASELINE: {}, "policies": {n: {} for n in policies}}
    kinds = [entry.kind for entry in cfg.tasks]
    for i, entry in enumerate(cfg.tasks):
        label = task_label(kinds, i)
        view = ctx.run = run.task_view(f"{label}/" if label else "")  # the task sees its own records only
        try:
            add_task_metrics(metrics, runners[entry.kind].run(ctx, entry.params), entry.kind, label)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            if not view.resumed:  # nothing read back from the folder: a bug, shown in full
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise KvevalError(
                f"tasks[{i}] ({entry.kind}) cannot use the records it resumed from in {run.records_path} "
                f"({type(exc).__name__}: {first}): a record was edited or written by another version; rerun with "
                "--overwrite to start afresh"
            ) from None
        finally:
            ctx.run = run
    merge(metrics, memory_fields(ctx))
    if weights and isinstance(metrics.get("weights"), dict):  # which weights: first in each variant's entry
        winfo = weights_info(ctx)
        measured = metrics["weights"].get("variants") or {}
        metrics["weights"] = {"reference": winfo["reference"],
                              "variants": {n: {"info": i, **(measured.get(n) or {})}
                                           for n, i in winfo["variants"].items()}}
    if plan is not None:
        metrics["plan"] = plan
    run.write_metrics(metrics)
    run.write_env(env, started=started, finished=now())
    from kveval.report import write_run_report

    write_run_report(run.path)
    console.print(summary_table(metrics, cfg))
    if (metrics.get("weights") or {}).get("variants"):
        console.print(weights_table(metrics, cfg))
    for label, part in (metrics.get(TASK_ENTRIES) or {}).items():
        if part.get("policies"):
            console.print(summary_table(part_for_summary(metrics, part), cfg, label=f"{label} ({part['kind']})"))
    console.print(f"results: {run.path}/")
    return metrics


def prepare_weights(cfg: ExperimentConfig, model) -> dict:
    """The config's weight variants checked against the loaded model (:func:`kveval.weights.apply.prepare`):
    ``{VARIANT: PreparedVariant}``, empty without ``model.weights``; KvevalError (one line) for a model without
    ``nn.Linear`` projections, a group size that does not divide a matrix's in_features, and the like."""
    variants = cfg.model.weight_variants()
    if not variants:
        return {}
    from kveval.weights.apply import prepare_all

    return prepare_all(model, variants)


def weights_info(ctx: RunContext) -> dict:
    """Which weights the run used (env.json's and metrics.json's ``weights``): the reference (the checkpoint as
    loaded) and per variant its spec, module groups, matrices, parameters quantized and stored bytes."""
    return {"reference": {"name": "fp", "weights": f"{ctx.cfg.model.name} as loaded ({ctx.info.get('dtype')})",
                          "params_total": ctx.info.get("num_parameters")},
            "variants": {n: p.info() for n, p in ctx.weights.items()}}


#: The prefix of a GGUF weight variant's entry in ``scales_used.json`` (policy names cannot hold ``/``).
WEIGHTS_KEY = "weights/"


def gguf_weights_used(ctx: RunContext) -> dict:
    """``{weights/<variant>: xxh3-128 of its file}`` for the weight variants read from a GGUF file: kept beside
    the scales files' digests, so that a resumed run whose GGUF file changed is refused like a changed scales
    file."""
    used = {}
    for name, prepared in (ctx.weights or {}).items():
        gguf = prepared.info().get("gguf")
        if isinstance(gguf, dict) and gguf.get("xxh3_128"):
            used[f"{WEIGHTS_KEY}{name}"] = gguf["xxh3_128"]
    return used


def check_scales_unchanged(out_dir, scales_used: dict, *, overwrite: bool) -> bool:
    """A resumed run whose ``scales: FILE`` (or a weight variant's GGUF file) changed since its records were
    written would mix two calibrations (two weight sets): refuse it, or with ``overwrite`` return True (start the
    folder afresh; :meth:`RunDir.open` does it once every check has passed). Reads only."""
    import json

    path = Path(out_dir) / SCALES_USED_FILE
    if not os.path.lexists(path):
        return False
    try:
        before = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        before = None
    changed = [n for n, h in scales_used.items() if isinstance(before, dict) and before.get(n, h) != h]
    if not changed and isinstance(before, dict):
        return False
    if overwrite:
        return True
    if not changed:
        what = "the record of the scales files"
    elif changed[0].startswith(WEIGHTS_KEY):
        what = f"model.weights.{changed[0][len(WEIGHTS_KEY):]}: its GGUF file"
    else:
        what = f"policy '{changed[0]}': its scales file"
    raise KvevalError(f"{out_dir}: {what} changed since this run's records were written; rerun with --overwrite "
                      "to start afresh, or set output: to another folder")


def check_scales(ctx: RunContext) -> dict:
    """Scales files that policies name exist, fit the model and were not calibrated on the evaluated tokens;
    ``scales: auto`` has a calibration slice that fits the corpus and is disjoint from the evaluation.
    Returns ``{policy: sha256 of its scales file}`` for the policies that name a file."""
    import hashlib

    from kveval.calibration.calibrate import calibration_slice, check_overlap
    from kveval.data import tokenizer_fingerprint
    from kveval.patch.quantizers import layer_quantizers, policy_scales
    from kveval.policy import AUTO_SCALES

    users = {n: p for n, p in ctx.policies.items() if p.needs_scales_file()}
    if not users:
        return {}
    used = {}
    n_tokens = len(ctx.tokens())
    fp = tokenizer_fingerprint(ctx.tokenizer)
    for name, policy in users.items():
        if policy.scales == AUTO_SCALES:
            start, end = calibration_slice(n_tokens, ctx.cfg.calibration.tokens)
            header = {"corpus": ctx.cfg.data.source, "tokenizer": fp, "token_start": start, "token_end": end}
            check_overlap(header, ctx.cfg, n_tokens, fp, f"policy '{name}' (scales: auto)")
            cal = ctx.cfg.calibration
            if cal.method == "mse":
                from kveval.quant import preset

                target = preset(cal.target)
                for spec in policy.all_specs():
                    if policy.uses_static(spec) and (spec.format, spec.bits) != (target.format, target.bits):
                        raise KvevalError(
                            f"policy '{name}': calibration.method mse searches ranges for {cal.target}, the policy "
                            f"uses {spec.describe()}; set calibration.target to match, or use absmax/percentile"
                        )
        else:
            try:
                sf = policy_scales(policy, ctx.model)
                layers = ctx.info["num_layers"]
                for i in range(layers):  # a format the file was not searched for fails here, not mid-run
                    layer_quantizers(policy, i, layers, sf)
            except (KvevalError, ValueError, IndexError, OSError) as exc:
                raise KvevalError(f"policy '{name}': {exc}") from None
            check_overlap(sf.header, ctx.cfg, n_tokens, fp, f"policy '{name}': scales file {policy.scales}")
            used[name] = hashlib.sha256(Path(policy.scales).read_bytes()).hexdigest()
    return used


def resolve_auto_scales(ctx: RunContext) -> None:
    """Calibrate once per run for ``scales: auto`` policies (``<run>/scales.safetensors``, reused on resume) and
    point those policies at the file."""
    from dataclasses import replace

    from kveval.calibration.calibrate import calibrate
    from kveval.policy import AUTO_SCALES

    auto = [n for n, p in ctx.policies.items() if p.scales == AUTO_SCALES and p.needs_scales_file()]
    if not auto:
        return
    path = ctx.run.path / SCALES_FILE
    fractions = {s.outliers for n in auto for s in ctx.policies[n].all_specs() if ctx.policies[n].uses_static(s)}
    if path.is_file():
        ctx.progress.log(f"calibration: reusing {path}")
    else:
        try:
            calibrate(ctx.model, ctx.tokenizer, ctx.tokens(), ctx.cfg, path, ctx.progress, outliers=fractions)
        except OSError as exc:
            raise KvevalError(f"cannot write the scales file {path}: {exc}") from None
    for name in auto:
        ctx.policies[name] = replace(ctx.policies[name], scales=str(path))


def read_plan(path: str | None) -> dict | None:
    """The predictions of ``kveval plan`` (its ``.plan.json``) for the report's predicted-vs-measured table:
    ``{"sidecar", "budget", "policy": "planned", "predicted": {policy: {"kld", "delta_ppl_pct"?}}}``."""
    if path is None:
        return None
    import json
    from pathlib import Path

    p = Path(path)
    try:
        side = json.loads(p.read_text())
        predicted = {"planned": {"kld": side["predicted_kld_sum"], "delta_ppl_pct": side["predicted_delta_ppl_pct"]}}
        for name, u in side.get("uniform", {}).items():
            predicted[name] = {"kld": u["predicted_kld_sum"]}
    except FileNotFoundError:
        raise KvevalError(f"plan: '{path}' does not exist; rerun kveval plan, or remove the plan: line") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise KvevalError(f"plan: '{path}' is not a kveval plan file (.plan.json from kveval plan)") from None
    return {"sidecar": str(path), "budget": side.get("budget"), "scan": side.get("scan"), "policy": "planned",
            "predicted": predicted}


def memory_fields(ctx: RunContext) -> dict:
    """bytes_per_token, compression_vs_fp16, max_batch and bits_per_element per policy (FP16 storage of the
    full-precision parts), at the configured context (default: the longest window of the run's tasks)."""
    from kveval.memory import Arch
    from kveval.memory.table import policy_memory_fields

    arch = Arch.from_model(ctx.model)
    lengths = [getattr(t.params, "seq_len", 0) for t in ctx.cfg.tasks]
    context = ctx.cfg.memory.context or max(lengths) or 2048
    gpu = ctx.cfg.memory.gpu_memory
    out = {"memory": {"arch": arch.to_dict(), "context": context, "gpu_memory": gpu}, "policies": {}}
    out[BASELINE] = policy_memory_fields(arch, "fp16", context, gpu)
    for name, policy in ctx.policies.items():
        out["policies"][name] = policy_memory_fields(arch, policy, context, gpu)
    if ctx.weights:  # the same bills beside each variant's quantized weights (codes + scales, the rest in FP16)
        variants = {}
        for vname, prepared in ctx.weights.items():
            nb = prepared.quantized_bytes()
            varch = arch.with_quantized_weights(prepared.params_quantized, nb["total"])
            variants[vname] = {
                "weight_bytes": varch.model_bytes, "weight_bytes_fp16": arch.model_bytes,
                "alone": policy_memory_fields(varch, "fp16", context, gpu),
                "policies": {n: policy_memory_fields(varch, p, context, gpu) for n, p in ctx.policies.items()},
            }
        out["weights"] = {"variants": variants}
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def part_for_summary(metrics: dict, part: dict) -> dict:
    """A later task entry's metrics (``metrics["tasks"][label]``) in the shape :func:`summary_table` reads, with
    the run's memory fields (bits per element) beside them."""
    def with_memory(entry: dict, top: dict) -> dict:
        return {**{k: v for k, v in top.items() if k == "bits_per_element"}, **entry}

    top_policies = metrics.get("policies") or {}
    return {"model": metrics.get("model"), BASELINE: with_memory(part.get(BASELINE) or {}, metrics.get(BASELINE) or {}),
            "policies": {n: with_memory(m or {}, top_policies.get(n) or {})
                         for n, m in (part.get("policies") or {}).items()}}


def summary_table(metrics: dict, cfg: ExperimentConfig, label: str | None = None) -> Table:
    """The closing console table: one row per policy against the threshold; perplexity columns when the run
    measured perplexity, needle columns when it ran the needle task. ``label``: the task entry the metrics are of,
    in the title (a later entry of a kind already in the config, ``tasks[1] (perplexity)``)."""
    thr = cfg.threshold
    title = f"{cfg.name}{' ' + label if label else ''}: {metrics['model']}, threshold ΔPPL <= {thr.delta_ppl_pct}%" + (
        f", KLD <= {thr.kld}" if thr.kld is not None else ""
    )
    base = metrics.get(BASELINE, {})
    rows = [(BASELINE, base), *metrics.get("policies", {}).items()]
    has = {key: any(m.get(key) is not None for _, m in rows) for key in ("ppl", "needle_accuracy")}
    cols = [("bits/elem", lambda m: _fmt(m.get("bits_per_element"), ".2f"))]
    if has["ppl"] or not has["needle_accuracy"]:
        cols += [
            ("PPL", lambda m: _fmt(m.get("ppl"), ".4f")),
            ("ΔPPL %", lambda m: _fmt(m.get("delta_ppl_pct"), "+.3f")),
            ("KLD", lambda m: _fmt(m.get("kld_mean"), ".3g")),
            ("KLD CI95", lambda m: "-" if not m.get("kld_ci95") else f"[{m['kld_ci95'][0]:.3g}, {m['kld_ci95'][1]:.3g}]"),
            ("top-1", lambda m: _fmt(m.get("top1_agree"), ".4f")),
        ]
    if has["needle_accuracy"]:
        cols += [
            ("needle EM", lambda m: _fmt(m.get("needle_accuracy"), ".3f")),
            ("answer logp/tok", lambda m: _fmt(m.get("needle_answer_logprob"), ".3f")),
        ]
    table = Table(title=title, title_justify="left")
    table.add_column("policy", justify="left", no_wrap=True)
    for name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("verdict", justify="left", no_wrap=True)
    for name, m in rows:
        verdict = "" if name == BASELINE else m.get("verdict", "-")
        style = {"pass": "green", "fail": "red"}.get(verdict, "yellow")
        cells = [fn(m) for _, fn in cols]
        if name == BASELINE and has["ppl"]:
            cells[1:6] = [cells[1], "", "", "", ""]
        table.add_row(name, *cells, f"[{style}]{verdict}[/]" if verdict else "")
    return table


def _yes_no(flag, interaction: str | None) -> str:
    """``yes`` / ``no`` for "worse than the sum", with ``*`` when the bootstrap interval of the excess excludes 0."""
    if flag is None:
        return "-"
    sure = interaction in ("superadditive", "subadditive")
    return ("yes" if flag else "no") + ("*" if sure else "")


def weights_table(metrics: dict, cfg: ExperimentConfig) -> Table:
    """The weights x KV interaction table: per weight variant, its effect alone (KV ``fp16``) and, per policy, the
    weight effect alone (W), the KV effect on the checkpoint's weights (KV), the combined effect (both), their
    sum and whether the combination is worse than the sum (``*``: the 95% interval of the excess excludes 0);
    every effect against the FP model (checkpoint weights, full-precision cache)."""
    from rich import box

    table = Table(title=f"{cfg.name}: weights x KV cache against the FP model; worse: both > W + KV (*: the 95% "
                        "interval of the excess excludes 0)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    cols = ["weights", "KV", "ΔPPL% W", "ΔPPL% KV", "ΔPPL% both", "W + KV", "worse",
            "KLD W", "KLD KV", "KLD both", "W + KV", "worse"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("weights", "KV") else "right", no_wrap=True)
    for vname, v in metrics["weights"]["variants"].items():
        alone = v.get("alone") or {}
        table.add_row(vname, "fp16", _fmt(alone.get("delta_ppl_pct"), "+.3f"), "", "", "", "",
                      _fmt(alone.get("kld_mean"), ".3g"), "", "", "", "")
        for pname, m in (v.get("policies") or {}).items():
            table.add_row(
                vname, pname,
                _fmt(m.get("weights_delta_ppl_pct"), "+.3f"), _fmt(m.get("kv_delta_ppl_pct"), "+.3f"),
                _fmt(m.get("delta_ppl_pct"), "+.3f"), _fmt(m.get("delta_ppl_pct_sum"), "+.3f"),
                _yes_no(m.get("delta_ppl_worse_than_sum"), m.get("delta_ppl_interaction")),
                _fmt(m.get("weights_kld_mean"), ".3g"), _fmt(m.get("kv_kld_mean"), ".3g"),
                _fmt(m.get("kld_mean"), ".3g"), _fmt(m.get("kld_sum"), ".3g"),
                _yes_no(m.get("kld_worse_than_sum"), m.get("kld_interaction")),
            )
    return table
