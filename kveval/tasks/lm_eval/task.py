"""lm-evaluation-harness tasks under each KV policy, beside perplexity in the same run.

Config: ``tasks: [{lm_eval: {tasks: [arc_easy], num_fewshot: 0, limit: 200}}]``. For each (lm-eval task, policy)
and for the FP baseline, one ``simple_evaluate`` with the bridge's model (``kveval.tasks.lm_eval.bridge.KVEvalLM``) on the
already loaded model; one record per (task, policy) in ``records.jsonl`` (resume skips recorded pairs; a pair cut
short by an interrupt is rerun whole). Metrics land in ``metrics.json`` as
``"lm_eval": {"<task>": {"acc": .., "acc_stderr": .., "acc_norm": .., "n": .., "layers_quantized": ..}}`` per
policy (plus ``delta_<metric>`` against the baseline) and under ``"baseline"``. A task name that is a group or a
tag yields one entry per subtask (and the group's own aggregate, when lm-eval computes one).

Metric names: lm-eval's ``"<metric>,<filter>"`` keys become ``<metric>`` when the filter is ``none`` or the only
filter of that metric, and stay ``<metric>,<filter>`` otherwise. No number is NaN: NaN or infinity in the logits
stops the run with one line (the bridge's check), a NaN metric likewise, and a standard error lm-eval could not
compute is recorded as null (:func:`check_finite_metrics`).

``include_path``: a folder of lm-eval task YAMLs (e.g. ``tasks/lm_eval``). A relative path is resolved against
the working directory, like every path in a kveval config (``output:``, ``data:``), and, when no such folder
exists there, against the kveval source checkout (the folder that holds ``kveval/`` and ``configs/``), and a path
under ``tasks/`` against kveval's task definitions wherever kveval is installed (:mod:`kveval.task_definitions`),
so the shipped ``configs/lm_eval.yaml`` runs from any directory.

Code: lm-eval imports Python from an include folder (a task YAML's ``!function utils.f`` loads ``utils.py`` beside
it). A config is pure data, so an include folder that holds code (a ``.py`` file, a ``!function`` tag or
``trust_remote_code`` in a YAML under it or in a YAML it includes) is refused unless the run was started with
``--allow-code`` (``cfg.allow_code``; never a config key). Without it, lm-eval's Jinja templates (``doc_to_text``
...) also render in Jinja's sandbox, so that a template cannot reach Python internals either. The one folder
trusted without the flag is kveval's own example, ``tasks/lm_eval`` of kveval's task definitions
(:data:`SHIPPED_TASKS`): its code is kveval's code, as trusted as the rest of it (a folder of that name elsewhere,
e.g. under the working directory, is not).
"""

from __future__ import annotations

import difflib
import logging
import math
import sys
from contextlib import contextmanager

from kveval.errors import KvevalError
from kveval.results.layout import BASELINE
from kveval.stats import minimum_detectable_effect
from kveval.tasks.common.finite import non_finite_numbers
from kveval.tasks.common.runner import Unit, Work, run_units
from kveval.tasks.lm_eval.include import (  # noqa: F401 (the include-path check, named here too)
    MAX_INCLUDE_FILES,
    SHIPPED_TASKS,
    check_include_path,
    include_code,
    resolve_include_path,
)
from kveval.tasks.lm_eval.params import NAME, Params, check_sampling_kwargs  # noqa: F401 (NAME, Params: a task module names them)

_TASK_MANAGERS: dict = {}


def _record_key(task: str, policy: str) -> str:
    return f"lm_eval/{task}/{policy}"


@contextmanager
def sandboxed_templates(enabled: bool = True):
    """Render lm-eval's Jinja task templates in Jinja's sandbox (no attribute access to Python internals) while
    the block runs; ``enabled=False`` leaves lm-eval as it is."""
    if not enabled:
        yield
        return
    import lm_eval.utils as lm_utils
    from jinja2.sandbox import SandboxedEnvironment

    original = lm_utils.env
    sandbox = SandboxedEnvironment(loader=original.loader, undefined=original.undefined,
                                   keep_trailing_newline=original.keep_trailing_newline)
    sandbox.filters.update(original.filters)
    lm_utils.env = sandbox
    try:
        yield
    finally:
        lm_utils.env = original


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


def _allow_code(ctx) -> bool:
    return bool(getattr(ctx.cfg, "allow_code", False))


def check(ctx, params: Params) -> None:
    """Unknown lm-eval task names, a missing include folder, an include folder with code (without
    ``--allow-code``): one line, before the results folder is touched and before lm-eval reads the folder."""
    tm = task_manager(check_include_path(params.include_path, allow_code=_allow_code(ctx)), params.tasks)
    for name in params.tasks:
        if name not in tm.all_tasks:
            close = difflib.get_close_matches(name, tm.all_tasks, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else " (lm-eval ls tasks lists them)"
            where = f" (include_path {params.include_path})" if params.include_path else ""
            raise KvevalError(f"tasks: lm_eval: unknown lm-eval task '{name}'{where}{hint}")
    with _quiet_lm_eval(), sandboxed_templates(not _allow_code(ctx)):
        check_documents(tm, params)


def _leaf_tasks(tasks: dict) -> list:
    """The Task objects of ``get_task_dict``'s (possibly nested, for groups) result."""
    out = []
    for value in tasks.values():
        out.extend(_leaf_tasks(value) if isinstance(value, dict) else [value])
    return out


def check_documents(tm, params: Params) -> None:
    """Every lm-eval task loads, and no evaluated document (the first ``limit``) has a null in a field that its
    text, target or choice template names (Jinja would render it as the text 'None' and score it): one line
    naming the task, the document and the field."""
    import lm_eval.utils as lm_utils
    from jinja2 import meta
    from jinja2.exceptions import SecurityError, TemplateError
    from lm_eval.tasks import get_task_dict

    try:
        tasks = get_task_dict(list(params.tasks), tm)
    except KvevalError:
        raise
    except SecurityError as exc:
        raise KvevalError(f"tasks: lm_eval: a template of {params.tasks} reaches into Python ({exc}); refused "
                          "without --allow-code") from None
    except Exception as exc:  # lm-eval and datasets raise many kinds (ValueError, DatasetGenerationError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise KvevalError(f"tasks: lm_eval: the tasks {params.tasks} cannot be loaded ({type(exc).__name__}: "
                          f"{first[:300]})") from None
    for task in _leaf_tasks(tasks):
        config = getattr(task, "config", None)
        check_repeats(config, params)
        features = set(getattr(task, "features", None) or [])
        fields: dict[str, str] = {}
        for attr in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            template = getattr(config, attr, None)
            if not isinstance(template, str):
                continue
            if template in features:
                names = {template}
            else:
                try:
                    names = meta.find_undeclared_variables(lm_utils.env.parse(template))
                except TemplateError:
                    continue  # lm-eval reports a broken template itself
            fields.update({n: attr for n in names})
        docs = task.eval_docs
        count = len(docs) if params.limit is None else min(params.limit, len(docs))
        for i in range(count):
            doc = docs[i]
            if not isinstance(doc, dict):
                continue
            for field, attr in fields.items():
                value = doc.get(field, "")
                bad = value is None or (isinstance(value, list) and any(v is None for v in value))
                if bad:
                    raise KvevalError(
                        f"tasks: lm_eval: task '{getattr(config, 'task', '?')}' document {i} (line {i + 1} of a "
                        f"JSONL source) has {field}: null, which {attr} would render as the text 'None'; fix the "
                        "data (a text field must be a string)"
                    )


#: lm-eval's filters that choose among a request's samples: the first in a pipeline decides which it scores
_SELECTING = ("take_first", "take_first_k", "majority_vote")


def scores_first_sample_only(config) -> bool:
    """Whether every filter pipeline of the task keeps only a request's first sample (its first selecting step is
    ``take_first``; no filter list means lm-eval's default, ``take_first``): then repeats are never scored."""
    pipelines = getattr(config, "filter_list", None) or []
    for pipeline in pipelines:
        steps = [f.get("function") for f in (pipeline.get("filter") or []) if isinstance(f, dict)]
        if next((s for s in steps if s in _SELECTING), None) != "take_first":
            return False
    return True


def check_repeats(config, params: Params) -> None:
    """``repeats`` asks for several samples per generation request: refused for a task that is not a generation
    task, one whose filters score the first sample only, or one that decodes greedily (identical samples)."""
    if not params.repeats or params.repeats == 1:
        return
    name = getattr(config, "task", "?")
    if getattr(config, "output_type", None) != "generate_until":
        raise KvevalError(f"tasks: lm_eval.repeats: task '{name}' is not a generation task (repeats samples "
                          "generated answers); drop repeats or the task")
    if scores_first_sample_only(config):
        raise KvevalError(f"tasks: lm_eval.repeats: task '{name}' scores only the first sample of each request "
                          "(its filters take_first), so the other samples would be wasted; use a task that scores "
                          "them all (a majority_vote filter or its own process_results, e.g. kveval_qa_sampled "
                          "in tasks/lm_eval)")
    kwargs = {**(getattr(config, "generation_kwargs", None) or {}), **(params.gen_kwargs or {})}
    try:
        check_sampling_kwargs(kwargs, f"tasks: lm_eval: task '{name}' with gen_kwargs")
    except ValueError as exc:
        raise KvevalError(str(exc)) from None
    if str(kwargs.get("do_sample", False)).lower() not in ("true", "1"):
        raise KvevalError(f"tasks: lm_eval.repeats: task '{name}' decodes greedily (do_sample is not true), so "
                          f"its {params.repeats} samples would be identical; add gen_kwargs: {{do_sample: true, "
                          "temperature: 0.7}")


class _Repeats:
    """A TaskManager whose loaded tasks draw ``repeats`` samples per request (lm-eval's ``repeats``, set before
    their requests are built); every other attribute is the manager's."""

    def __init__(self, tm, repeats: int):
        self._tm, self._repeats = tm, repeats

    def load(self, *args, **kwargs):
        loaded = self._tm.load(*args, **kwargs)
        for task in loaded["tasks"].values():
            if task.get_config("output_type") == "generate_until":
                task.set_config(key="repeats", value=self._repeats)
        return loaded

    def __getattr__(self, name):
        return getattr(self._tm, name)


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
    from jinja2.exceptions import SecurityError

    from kveval.tasks.lm_eval.bridge import KVEvalLM

    with _quiet_lm_eval(), sandboxed_templates(not _allow_code(ctx)):
        lm = KVEvalLM(
            pretrained=ctx.model, tokenizer=ctx.tokenizer, kv=policy if policy is not None else "fp16",
            prefill=params.prefill, batch_size=params.batch_size,
        )
        try:
            res = lm_eval.simple_evaluate(
                model=lm, tasks=[task], num_fewshot=params.num_fewshot, limit=params.limit,
                task_manager=_Repeats(tm, params.repeats) if params.repeats else tm,
                gen_kwargs=dict(params.gen_kwargs) if params.gen_kwargs else None, log_samples=False,
            )
        except SecurityError as exc:
            raise KvevalError(f"lm-eval task '{task}': a template reaches into Python ({exc}); refused without "
                              "--allow-code") from None
        except KvevalError as exc:  # NaN or infinity in the logits (the bridge's check): name the task too
            sys.stderr.write("\n")  # end the line of lm-eval's progress bar, cut short, so the error starts its own
            raise KvevalError(f"lm-eval task '{task}': {exc}") from None
    results = {name: metric_values(r) for name, r in res["results"].items()}
    check_finite_metrics(results, task, BASELINE if policy is None else f"policy '{policy.name}'")
    return {"results": results, "layers_quantized": lm.get_model_info()["layers_quantized"]}


def check_finite_metrics(results: dict, task: str, who: str) -> None:
    """NaN or infinity among lm-eval's numbers for one (task, policy), in place: a standard error that lm-eval
    could not compute becomes None (JSON null: not measured); a metric is one :class:`KvevalError` line, so that
    no NaN metric is recorded (the logits were finite: the bridge checks them, so the metric itself is broken)."""
    for sub, metrics in results.items():
        for name in non_finite_numbers(metrics):
            if "_stderr" in name:
                metrics[name] = None
                continue
            raise KvevalError(f"lm-eval task '{task}' ({sub}) under {who}: metric '{name}' is {metrics[name]} "
                              "although the logits were finite; nothing was recorded for it: check the task's "
                              "metric definition, or leave this task out")


def run(ctx, params: Params) -> dict:
    """Evaluate every (task, policy) not yet recorded, then aggregate all records into metrics."""
    tm = task_manager(check_include_path(params.include_path, allow_code=_allow_code(ctx)), params.tasks)
    units = [Unit(_record_key(task, name), (task, name), amount=1)
             for task in params.tasks for name in (BASELINE, *ctx.policies)]

    def evaluate_batch(batch: list[Unit], _prepared):
        for unit in batch:
            task, name = unit.item
            out = evaluate_one(ctx, params, tm, task, None if name == BASELINE else ctx.policies[name])
            yield {"key": unit.key, "task": "lm_eval", "lm_eval_task": task, "policy": name,
                   "num_fewshot": params.num_fewshot, "limit": params.limit, "prefill": params.prefill, **out}

    run_units(ctx, NAME, units, Work(label="lm_eval", noun="(task, policy) pairs", evaluate=evaluate_batch,
                                     rate_unit="task"))
    return aggregate(ctx.run.records(), list(ctx.policies), params)


def _delta_mde(metrics: dict, base: dict, name: str) -> float | None:
    """The smallest change of metric ``name`` the task's samples detect (alpha 0.05, power 0.8), from lm-eval's
    own standard errors of the two means taken as independent: ``2.80 · sqrt(se_policy² + se_baseline²)``
    (lm-eval keeps no per-sample scores, so the pairing of the samples is not used: a conservative MDE); None when
    either standard error is missing. ``name`` ``acc`` reads ``acc_stderr``; ``f1,a`` reads ``f1_stderr,a``."""
    metric, _, flt = name.partition(",")
    key = f"{metric}_stderr" + (f",{flt}" if flt else "")
    a, b = metrics.get(key), base.get(key)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return minimum_detectable_effect(math.sqrt(float(a) ** 2 + float(b) ** 2))


def aggregate(records: list[dict], policies: list[str], params: Params) -> dict:
    """metrics.json's ``lm_eval`` fields from the records (pure: the same records give the same metrics); each
    ``delta_<metric>`` has its minimum detectable effect beside it (``delta_<metric>_mde``, :func:`_delta_mde`)."""
    by_policy: dict[str, dict] = {}
    for rec in records:
        if rec.get("task") == "lm_eval" and rec["lm_eval_task"] in params.tasks:
            slot = by_policy.setdefault(rec["policy"], {})
            for sub, metrics in rec["results"].items():
                slot[sub] = {**metrics, "layers_quantized": rec["layers_quantized"]}
    base = by_policy.get(BASELINE, {})
    out = {BASELINE: {"lm_eval": base, "lm_eval_mean": headline(base, params.tasks)}, "policies": {}}
    for name in policies:
        entry = {}
        for sub, metrics in by_policy.get(name, {}).items():
            m = dict(metrics)
            for k, v in metrics.items():
                ref = base.get(sub, {}).get(k)
                if k not in ("n", "layers_quantized") and "_stderr" not in k and ref is not None:
                    m[f"delta_{k}"] = v - ref
                    m[f"delta_{k}_mde"] = _delta_mde(metrics, base.get(sub, {}), k)
            entry[sub] = m
        out["policies"][name] = {"lm_eval": entry, "lm_eval_mean": headline(entry, params.tasks)}
    return out


def primary_metric(metrics: dict) -> tuple[str, float] | None:
    """(name, value) of a task's first metric as lm-eval reports it (``acc`` before ``acc_norm``; neither ``n``,
    ``layers_quantized``, a standard error nor a ``delta_``); None when it has none."""
    for key, value in metrics.items():
        if key in ("n", "layers_quantized") or "_stderr" in key or key.startswith("delta_"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, float(value)
    return None


def headline(entry: dict, tasks: list[str]) -> float | None:
    """The per-policy headline of the run's lm-eval tasks (``lm_eval_mean``): the unweighted mean of the primary
    metric (:func:`primary_metric`) of each task the config names (a group's own aggregate stands for the group);
    None when none was measured."""
    scores = [p[1] for t in tasks if isinstance(entry.get(t), dict) and (p := primary_metric(entry[t])) is not None]
    return sum(scores) / len(scores) if scores else None
