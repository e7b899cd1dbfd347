"""lm-evaluation-harness tasks under each KV policy, beside perplexity in the same run.

Config: ``tasks: [{lm_eval: {tasks: [arc_easy], num_fewshot: 0, limit: 200}}]``. For each (lm-eval task, policy)
and for the FP baseline, one ``simple_evaluate`` with the bridge's model (``kveval.tasks.lm_eval.bridge.KVEvalLM``) on the
already loaded model; one record per (task, policy) in ``records.jsonl`` (resume skips recorded pairs; a pair cut
short by an interrupt is rerun whole). Metrics land in ``metrics.json`` as
``"lm_eval": {"<task>": {"acc": .., "acc_stderr": .., "acc_norm": .., "n": .., "layers_quantized": ..}}`` per
policy (plus ``delta_<metric>`` against the baseline) and under ``"baseline"``. A task name that is a group or a
tag yields one entry per subtask (and the group's own aggregate, when lm-eval computes one).

Metric names: lm-eval's ``"<metric>,<filter>"`` keys become ``<metric>`` when the filter is ``none`` or the only
filter of that metric, and stay ``<metric>,<filter>`` otherwise.

``include_path``: a folder of lm-eval task YAMLs (e.g. ``tests/lmeval_tasks``). A relative path is resolved
against the working directory, like every path in a kveval config (``output:``, ``data:``), and, when no such
folder exists there, against the kveval source checkout (the folder that holds ``kveval/`` and ``configs/``), so
the shipped ``configs/lm_eval.yaml`` runs from any directory inside a checkout.
"""

from __future__ import annotations

import difflib
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import Field

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.schema import Strict

NAME = "lm_eval"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
_TASK_MANAGERS: dict = {}


class Params(Strict):
    """lm-evaluation-harness tasks (log-likelihood under emulation, generation through the quantized cache)."""

    tasks: list[str] = Field(min_length=1)
    num_fewshot: int | None = Field(0, ge=0)  # None: each task's own default
    limit: int | None = Field(None, gt=0)
    include_path: str | None = None
    batch_size: int = Field(1, gt=0)
    prefill: Literal["none", "context"] = "none"


def _record_key(task: str, policy: str) -> str:
    return f"lm_eval/{task}/{policy}"


def resolve_include_path(path: str | None) -> str | None:
    """The include folder as an absolute path (see the module docstring), or a one-line error."""
    if path is None:
        return None
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_dir():
            return str(c.resolve())
    raise KvevalError(f"tasks: lm_eval.include_path {path!r} is not a folder (relative paths: from the working directory)")


def task_manager(include_path: str | None, names: list[str]):
    """An lm-eval ``TaskManager`` that knows ``names``: the include folder alone when it defines all of them
    (fast), else lm-eval's ~15k builtin tasks as well (indexing them takes ~20 s). Cached per process."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise KvevalError("the lm_eval task needs lm-evaluation-harness: pip install 'kveval[lmeval]'") from None
    if include_path is not None:
        key = (include_path, False)
        if key not in _TASK_MANAGERS:
            _TASK_MANAGERS[key] = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in _TASK_MANAGERS[key].all_tasks for n in names):
            return _TASK_MANAGERS[key]
    key = (include_path, True)
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=include_path)
    return _TASK_MANAGERS[key]


def check(ctx, params: Params) -> None:
    """Unknown lm-eval task names and a missing include folder: one line, before the results folder is touched."""
    tm = task_manager(resolve_include_path(params.include_path), params.tasks)
    for name in params.tasks:
        if name not in tm.all_tasks:
            close = difflib.get_close_matches(name, tm.all_tasks, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else " (lm-eval ls tasks lists them)"
            where = f" (include_path {params.include_path})" if params.include_path else ""
            raise KvevalError(f"tasks: lm_eval: unknown lm-eval task '{name}'{where}{hint}")


@contextmanager
def _quiet_lm_eval():
    """lm-eval logs many warnings per evaluation (pre-loaded model, custom datasets); keep errors only."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def metric_values(task_results: dict) -> dict:
    """``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ..}`` -> ``{"acc": 0.5, "acc_stderr": 0.1}``."""
    filters: dict[str, set] = {}
    for k in task_results:
        if "," in k:
            metric, flt = k.split(",", 1)
            filters.setdefault(metric.removesuffix("_stderr"), set()).add(flt)
    out = {}
    for k, v in task_results.items():
        if "," not in k or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        metric, flt = k.split(",", 1)
        single = flt == "none" or len(filters[metric.removesuffix("_stderr")]) == 1
        out[metric if single else k] = float(v)
    if "sample_len" in task_results:
        out["n"] = int(task_results["sample_len"])
    return out


def evaluate_one(ctx, params: Params, tm, task: str, policy) -> dict:
    """One task under one policy (``policy=None``: the FP baseline): the record's metrics per (sub)task."""
    import lm_eval

    from kveval.tasks.lm_eval.bridge import KVEvalLM

    with _quiet_lm_eval():
        lm = KVEvalLM(
            pretrained=ctx.model, tokenizer=ctx.tokenizer, kv=policy if policy is not None else "fp16",
            prefill=params.prefill, batch_size=params.batch_size,
        )
        res = lm_eval.simple_evaluate(
            model=lm, tasks=[task], num_fewshot=params.num_fewshot, limit=params.limit, task_manager=tm,
            log_samples=False,
        )
    results = {name: metric_values(r) for name, r in res["results"].items()}
    return {"results": results, "layers_quantized": lm.get_model_info()["layers_quantized"]}


def run(ctx, params: Params) -> dict:
    """Evaluate every (task, policy) not yet recorded, then aggregate all records into metrics."""
    tm = task_manager(resolve_include_path(params.include_path), params.tasks)
    names = [BASELINE, *ctx.policies]
    done = ctx.run.done_keys()
    pairs = [(t, n) for t in params.tasks for n in names]
    todo = [(t, n) for t, n in pairs if _record_key(t, n) not in done]
    if len(todo) < len(pairs):
        ctx.progress.log(f"lm_eval: resuming, {len(pairs) - len(todo)} of {len(pairs)} (task, policy) pairs already recorded")
    with ctx.progress.task("lm_eval", total=len(todo), unit="task") as advance:
        for task, name in todo:
            policy = None if name == BASELINE else ctx.policies[name]
            out = evaluate_one(ctx, params, tm, task, policy)
            ctx.run.append({
                "key": _record_key(task, name), "task": "lm_eval", "lm_eval_task": task, "policy": name,
                "num_fewshot": params.num_fewshot, "limit": params.limit, "prefill": params.prefill, **out,
            })
            advance(1)
    return aggregate(ctx.run.records(), list(ctx.policies), params)


def aggregate(records: list[dict], policies: list[str], params: Params) -> dict:
    """metrics.json's ``lm_eval`` fields from the records (pure: the same records give the same metrics)."""
    by_policy: dict[str, dict] = {}
    for rec in records:
        if rec.get("task") == "lm_eval" and rec["lm_eval_task"] in params.tasks:
            slot = by_policy.setdefault(rec["policy"], {})
            for sub, metrics in rec["results"].items():
                slot[sub] = {**metrics, "layers_quantized": rec["layers_quantized"]}
    base = by_policy.get(BASELINE, {})
    out = {BASELINE: {"lm_eval": base}, "policies": {}}
    for name in policies:
        entry = {}
        for sub, metrics in by_policy.get(name, {}).items():
            m = dict(metrics)
            for k, v in metrics.items():
                ref = base.get(sub, {}).get(k)
                if k not in ("n", "layers_quantized") and "_stderr" not in k and ref is not None:
                    m[f"delta_{k}"] = v - ref
            entry[sub] = m
        out["policies"][name] = {"lm_eval": entry}
    return out
