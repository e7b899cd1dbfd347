"""Run one experiment: set up (model, data, results folder), run each task, aggregate, report."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from kveval.calibration.checks import check_scales, check_scales_unchanged, resolve_auto_scales, scales_sources
from kveval.config import ExperimentConfig, input_files
from kveval.errors import KvevalError
from kveval.messages import print_line
from kveval.progress import Progress
from kveval.report.console import part_for_summary, summary_table, weights_interaction_table
from kveval.results import (
    BASELINE,
    SCALES_USED_FILE,
    RunDir,
    atomic_write_json,
    environment,
    lock_folder,
    now,
    run_folder,
)
from kveval.results.checks import check_inputs_unchanged
from kveval.results.layout import TASK_ENTRIES
from kveval.results.store import input_digests, task_label, tokens_digest
from kveval.tasks.context import CheckContext


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
    """The body of :func:`run_experiment`, with the folder's lock held, phase by phase: check (nothing written),
    open the folder, run the tasks, write the metrics and the report."""
    RunDir.check(out_dir, cfg.resolved(), overwrite=overwrite)  # before any slow work, and before any write
    ctx = _load_and_check(cfg, runners, quiet=quiet)
    checked = _check_folder(ctx, cfg, out_dir, overwrite=overwrite)

    # every check has passed: the first write (overwrite removes kveval's own files only now)
    run = RunDir.open(out_dir, cfg.resolved(), overwrite=overwrite, reset=checked.reset)
    if checked.digest is not None:
        run.record_tokens(checked.digest)
    run.record_inputs(checked.inputs)
    if checked.scales_used:
        atomic_write_json(run.path / SCALES_USED_FILE, checked.scales_used)
    resolve_auto_scales(ctx, run)
    started = now()
    env = _environment(ctx, config_path)
    before = run.worked_before()  # a resumed run: its earlier parts' time (the report states the whole)
    run.write_env(env, started=started, before=before)
    metrics = _run_tasks(ctx, cfg, run, runners)
    _complete(metrics, ctx, checked.plan)
    run.write_metrics(metrics)
    run.write_env(env, started=started, finished=now(), before=before)
    _print_tables(ctx.console, metrics, cfg, run.path)
    from kveval.commands.report import write_run_report

    write_run_report(run.path)  # a report that fails is one line and a non-zero exit; the results stay
    print_line(ctx.console, f"results: {run.path}/")
    return metrics


def _load_and_check(cfg: ExperimentConfig, runners: dict, *, quiet: bool) -> CheckContext:
    """Load the model and check everything that needs it (nothing is written): the attention design under each
    policy, the weight variants, every task's inputs. Returns the context the checks ran with."""
    from kveval.models import load_model, model_arch, model_info
    from kveval.patch.layers import checked_design

    console = Console(width=None if sys.stdout.isatty() else 140)
    policies = cfg.policies()
    seed_everything(cfg.seed)
    print_line(console, f"kveval {cfg.name}: loading {cfg.model.name} ({cfg.model.dtype}, {cfg.model.device})")
    model, tokenizer = load_model(
        cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed,
        device_map=cfg.model.device_map, max_memory=cfg.model.max_memory,
    )
    arch = model_arch(model)
    for policy in policies.values():  # a design kveval does not model under a policy: one line, before any write;
        checked_design(model, arch, policy)  # remembered, so that the emulation of every batch does not redo it
    weights = prepare_weights(cfg, model)  # shapes, group sizes, module kinds: before anything is written
    ctx = CheckContext(
        cfg=cfg, model=model, tokenizer=tokenizer, policies=policies, info=model_info(model),
        console=console, progress=Progress(console, quiet=quiet), weights=weights,
    )
    for entry in cfg.tasks:  # every input error surfaces before the results folder is touched
        check = getattr(runners[entry.kind], "check", None)
        if check is not None:
            check(ctx, entry.params)
    return ctx


@dataclass(frozen=True)
class FolderChecks:
    """What the checks against the results folder found, before its first write: ``scales_used`` (the digests of
    the scales and weight files, ``scales_used.json``), ``reset`` (start the folder afresh), ``plan`` (the
    planned config's predictions, or None), ``digest`` (the corpus tokens', when a task loaded them) and
    ``inputs`` (the digests of the input files, :func:`kveval.results.store.input_digests`)."""

    scales_used: dict
    reset: bool
    plan: dict | None
    digest: dict | None
    inputs: dict


def _check_folder(ctx: CheckContext, cfg: ExperimentConfig, out_dir: Path, *, overwrite: bool) -> FolderChecks:
    """The checks of the folder's previous contents against this run of ``cfg`` (scales, plan, config, tokens)."""
    scales_used = {**check_scales(ctx), **weight_file_digests(ctx)}
    reset = check_scales_unchanged(out_dir, scales_used, overwrite=overwrite)
    plan = None
    if cfg.plan is not None:
        from kveval.policy.plan_file import plan_predictions

        plan = plan_predictions(cfg.plan)
    replace = RunDir.check(out_dir, cfg.resolved(), overwrite=overwrite) or reset
    digest = tokens_digest(ctx.cache["tokens"]) if "tokens" in ctx.cache else None
    if digest is not None and not replace:
        try:
            RunDir.check_tokens(out_dir, digest)
        except KvevalError:
            if not overwrite:
                raise
            reset = True  # --overwrite: start afresh on the new tokens
    inputs = input_digests(input_files(cfg))
    if not replace:
        try:
            check_inputs_unchanged(out_dir, inputs)
        except KvevalError:
            if not overwrite:
                raise
            reset = True  # --overwrite: start afresh on the edited input files
    return FolderChecks(scales_used=scales_used, reset=reset, plan=plan, digest=digest, inputs=inputs)


def _environment(ctx: CheckContext, config_path: str | None) -> dict:
    """env.json's document of this run (versions, machine, command, weights and scales used); a dependency
    outside kveval's tested range is a warning on stderr."""
    env = environment(ctx.cfg.model.device)
    for line in env.get("untested_dependencies", []):
        print(f"kveval: warning: {line}; the results may be wrong without an error (reinstall with `make setup`)",
              file=sys.stderr)
    env["config_path"] = config_path
    env["command"] = f"kveval run {config_path}" if config_path else None
    if ctx.weights:
        env["weights"] = weights_info(ctx)
    if scales_sources(ctx):
        env["scales"] = scales_sources(ctx)  # where each policy's static scales came from (checkpoint, file, ...)
    return env


def _run_tasks(ctx: CheckContext, cfg: ExperimentConfig, run: RunDir, runners: dict) -> dict:
    """Every task entry of ``cfg`` in order, each with its own view of the folder's records; the merged metrics.
    A task that fails on records it resumed from is one line (a bug on fresh records goes through whole)."""
    metrics: dict = {"run": cfg.name, "model": cfg.model.name, BASELINE: {},
                     "policies": {n: {} for n in ctx.policies}}
    kinds = [entry.kind for entry in cfg.tasks]
    for i, entry in enumerate(cfg.tasks):
        label = task_label(kinds, i)
        view = run.task_view(f"{label}/" if label else "")  # the task sees its own records only
        try:
            add_task_metrics(metrics, runners[entry.kind].run(ctx.for_entry(run, view), entry.params), entry.kind,
                             label)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            if not view.resumed:  # nothing read back from the folder: a bug, shown in full
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise KvevalError(
                f"tasks[{i}] ({entry.kind}) cannot use the records it resumed from in {run.records_path} "
                f"({type(exc).__name__}: {first}): a record was edited or written by another version; rerun with "
                "--overwrite to start afresh"
            ) from None
    return metrics


def _complete(metrics: dict, ctx: CheckContext, plan: dict | None) -> None:
    """The run-level fields beside the tasks' metrics: the memory bill, which weights, the plan's predictions."""
    merge(metrics, memory_fields(ctx))
    if ctx.weights and isinstance(metrics.get("weights"), dict):  # which weights: first in each variant's entry
        winfo = weights_info(ctx)
        measured = metrics["weights"].get("variants") or {}
        metrics["weights"] = {"reference": winfo["reference"],
                              "variants": {n: {"info": i, **(measured.get(n) or {})}
                                           for n, i in winfo["variants"].items()}}
    if plan is not None:
        metrics["plan"] = plan


def _print_tables(console: Console, metrics: dict, cfg: ExperimentConfig, out_dir: Path) -> None:
    """The closing console tables: the summary, the weights x KV interaction, each later task entry's summary; a
    scan alone (its policies are only memory bills: a table of "-") ends with its most sensitive layers and the
    commands that plan from it instead."""
    if cfg.tasks and all(t.kind == "sensitivity" for t in cfg.tasks):
        from kveval.tasks.sensitivity.closing import closing_lines

        for line in closing_lines(metrics, str(out_dir)):
            print_line(console, line)
        return
    console.print(summary_table(metrics, cfg))
    if (metrics.get("weights") or {}).get("variants"):
        console.print(weights_interaction_table(metrics, cfg))
    for label, part in (metrics.get(TASK_ENTRIES) or {}).items():
        if part.get("policies"):
            console.print(summary_table(part_for_summary(metrics, part), cfg, label=f"{label} ({part['kind']})"))


def prepare_weights(cfg: ExperimentConfig, model) -> dict:
    """The config's weight variants checked against the loaded model (:func:`kveval.weights.apply.prepare`):
    ``{VARIANT: PreparedVariant}``, empty without ``model.weights``; KvevalError (one line) for a model without
    ``nn.Linear`` projections, a group size that does not divide a matrix's in_features, and the like."""
    variants = cfg.model.weight_variants()
    if not variants:
        return {}
    from kveval.weights.apply import prepare_all

    return prepare_all(model, variants)


def weights_info(ctx: CheckContext) -> dict:
    """Which weights the run used (env.json's and metrics.json's ``weights``): the reference (the checkpoint as
    loaded) and per variant its spec, module groups, matrices, parameters quantized and stored bytes."""
    return {"reference": {"name": "fp", "weights": f"{ctx.cfg.model.name} as loaded ({ctx.info.get('dtype')})",
                          "params_total": ctx.info.get("num_parameters")},
            "variants": {n: p.info() for n, p in ctx.weights.items()}}


def weight_file_digests(ctx: CheckContext) -> dict:
    """``{weights/<variant>: xxh3-128 of its file}`` for the weight variants read from a GGUF file: kept beside
    the scales files' digests (``scales_used.json``), so that a resumed run whose GGUF file changed is refused like
    a changed scales file."""
    from kveval.calibration.checks import WEIGHTS_KEY

    used = {}
    for name, prepared in (ctx.weights or {}).items():
        gguf = prepared.info().get("gguf")
        if isinstance(gguf, dict) and gguf.get("xxh3_128"):
            used[f"{WEIGHTS_KEY}{name}"] = gguf["xxh3_128"]
    return used


def memory_fields(ctx: CheckContext) -> dict:
    """bytes_per_token, compression_vs_fp16, max_batch and bits_per_element per policy (FP16 storage of the
    full-precision parts), at the configured context (default: the longest window of the run's tasks); the same
    at the deployment context (``memory.deployment``: ``memory.context``, else the model's context limit)."""
    from kveval.memory import Arch
    from kveval.memory.rows import policy_memory_fields
    from kveval.models.info import model_context_limit

    arch = Arch.from_model(ctx.model)
    lengths = [getattr(t.params, "seq_len", 0) for t in ctx.cfg.tasks]
    context = ctx.cfg.memory.context or max(lengths) or 2048
    gpu = ctx.cfg.memory.gpu_memory
    out = {"memory": {"arch": arch.to_dict(), "context": context, "gpu_memory": gpu}, "policies": {}}
    out[BASELINE] = policy_memory_fields(arch, "fp16", context, gpu)
    for name, policy in ctx.policies.items():
        out["policies"][name] = policy_memory_fields(arch, policy, context, gpu)
    # the same bills at a deployment-sized context (memory.context, else the model's own limit): what sizes a server
    deployed = ctx.cfg.memory.context or model_context_limit(ctx.model)
    out["memory"]["deployment"] = {
        "context": deployed, BASELINE: policy_memory_fields(arch, "fp16", deployed, gpu),
        "policies": {n: policy_memory_fields(arch, p, deployed, gpu) for n, p in ctx.policies.items()}}
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


