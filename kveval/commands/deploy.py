"""``kveval deploy PLAN_OR_CONFIG [--run RUN_DIR] [--engine E ...] [--model M]``: a policy in each engine's own
syntax, or, where an engine cannot express it, the nearest policies it can run with their cost.

Input: a ``.plan.json`` (``kveval plan``: its planned policy, the scan it came from for predicted costs), or a
config (every policy of its ``kv:``; its ``plan:`` sidecar, if any, for the scan). ``--run``: a run folder whose
metrics give measured costs (KLD, ΔPPL %) of the engine presets it evaluated (looked up by the preset's name, or
by a policy of the same resolved form). What each engine can run and its syntax are :mod:`kveval.engines`
(``express``: the rules and the lines per engine, ``costs``: measured and predicted costs); here the target is
read, the scan's predictions bound (the sensitivity planner's ``uniform_prediction``) and the result printed.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from kveval.engines.costs import Costs, ScanPredictions
from kveval.engines.express import Deployment, deploy
from kveval.engines.tables import ENGINES
from kveval.errors import KvevalError
from kveval.memory import Arch
from kveval.policy import KVPolicy
from kveval.policy.plan_file import PlanFile, read_plan_file


def load_target(target: str) -> tuple[dict[str, KVPolicy], Arch, int, str, ScanPredictions | None, str, str]:
    """(policies, arch, context, model, the scan's predictions or None, scan name, config hint) of a ``.plan.json``
    (:class:`kveval.policy.plan_file.PlanFile`) or a config."""
    path = Path(target)
    if path.suffix == ".json":
        side = read_plan_file(path)
        try:
            arch = Arch.from_dict(side.arch)
            if arch.layers != len(side.layers):  # a hand-edited layer count would be billed (1e9 layers: no memory)
                raise KvevalError(f"arch has {arch.layers} layers and the plan chooses specs for {len(side.layers)}")
            policy = KVPolicy.from_config(side.policy, name="planned")
        except KvevalError as exc:
            raise KvevalError(f"plan: '{path}': {exc}; rerun kveval plan") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise KvevalError(f"plan: '{path}' lacks a valid arch or policy ({type(exc).__name__}: "
                              f"{str(exc)[:120]}); rerun kveval plan") from None
        scan, scan_name = _scan_of(side)
        return {"planned": policy}, arch, side.context, _model_of_config(side.config), scan, scan_name, side.config
    from kveval.commands.memory import resolve_arch  # the builtin model's shape without reading its GGUF
    from kveval.config import load_config

    cfg = load_config(path)
    arch = resolve_arch(model=cfg.model.name)
    lengths = [getattr(t.params, "seq_len", 0) for t in cfg.tasks]
    context = cfg.memory.context or max(lengths) or 2048
    scan, scan_name = (None, "")
    if cfg.plan:
        scan, scan_name = _scan_of(read_plan_file(cfg.plan))
    return cfg.policies(), arch, context, cfg.model.name, scan, scan_name, str(path)


def _model_of_config(config: str) -> str:
    """The model name of the config a plan was made for; ``MODEL`` when it is gone, unreadable, not YAML or names
    no model (the plan still deploys, with the placeholder)."""
    from kveval.schema import load_yaml, read_text_file

    if not Path(config).is_file():
        return "MODEL"
    try:
        raw = load_yaml(read_text_file(Path(config), "config"), config)
    except KvevalError:
        return "MODEL"
    m = raw.get("model") if isinstance(raw, dict) else None
    name = m if isinstance(m, str) else m.get("name") if isinstance(m, dict) else None
    return name if isinstance(name, str) and name else "MODEL"


def _scan_of(side: PlanFile) -> tuple[ScanPredictions | None, str]:
    """The predictions of the scan a plan was made from (None when its folder holds no metrics any more): its
    scanned specs and the planner's summed scanned KLD of a uniform spec."""
    if not (Path(side.scan) / "metrics.json").is_file():
        return None, ""
    from kveval.results import read_metrics
    from kveval.tasks.sensitivity.planner import uniform_prediction

    metrics = read_metrics(side.scan)
    section = metrics.get("sensitivity")
    specs = section.get("specs") if isinstance(section, dict) else None
    return ScanPredictions(specs if isinstance(specs, list) else [], partial(uniform_prediction, metrics)), side.scan


def render(deps: list[Deployment], arch: Arch, context: int, config_hint: str = "CONFIG") -> str:
    lines: list[str] = []
    for key in dict.fromkeys(d.engine for d in deps):
        engine = ENGINES[key]
        lines.append(f"== {engine.title} ==")
        for d in (d for d in deps if d.engine == key):
            if d.exact:
                lines.append(f"{d.policy}:")
                lines += [f"  {line}" for line in d.lines]
                lines += [f"  # {note}" for note in d.notes]
            else:
                lines.append(f"{d.policy}: not expressible: {d.reason}")
                lines.append("  nearest it can run (memory at the same context):")
                lines += [f"    {o.line(config_hint)}" for o in d.nearest]
        lines.append("")
    lines.append(f"(memory at {context} tokens of context, {arch.layers} layers x {arch.kv_heads} kv heads x "
                 f"head_dim {arch.head_dim})")
    return "\n".join(lines) + "\n"


def deploy_command(target: str, run_dir: str | None = None, engines: list[str] | None = None,
                   model: str | None = None) -> str:
    """``kveval deploy``: the text it prints (module docstring)."""
    policies, arch, context, model_name, scan, scan_name, hint = load_target(target)
    costs = Costs(scan=scan, scan_name=scan_name)
    if run_dir:
        from kveval.results import read_config, read_metrics

        costs.run, costs.run_name = read_metrics(run_dir), str(run_dir)
        kv = read_config(run_dir).get("kv")
        run_policies = kv.get("policies") if isinstance(kv, dict) else None
        costs.run_policies = run_policies if isinstance(run_policies, dict) else {}
    deps = deploy(policies, arch, context, model or model_name, costs, engines, hint)
    return render(deps, arch, context, hint)
