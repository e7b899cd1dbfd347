"""What an engine's uniform policies cost: measured in a run folder's metrics (by the engine preset's name, or a
policy of the same resolved form), else predicted from a sensitivity scan (the summed scanned KLD of the uniform
spec), else "not measured" with the ``kveval run`` line that measures it. ``nearest_options`` lists an engine's
uniform policies nearest in memory to a policy it cannot run, each with its cost.

The scan's prediction is given, not computed here (:class:`ScanPredictions`: the sensitivity planner's
``uniform_prediction``, bound by ``kveval deploy``), so that the engines sit below the tasks. Pure: no transformers.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kveval.engines.tables import Engine, EngineType
from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy
from kveval.schema import is_finite_number


@dataclass
class Option:
    """One policy an engine can run, near the one asked for: ``label`` (its syntax in short), ``preset``,
    ``bits`` per element, ``kld`` / ``delta_ppl_pct`` and where they come from (``source``)."""

    label: str
    preset: str | None
    bits: float
    kld: float | None = None
    delta_ppl_pct: float | None = None
    source: str = ""

    run_name: str | None = None  # the kv: entry that evaluates it (None: no kveval policy computes it)

    def line(self, config_hint: str = "CONFIG") -> str:
        if self.kld is None and self.run_name:
            out = f"results/{Path(config_hint).stem}-{self.run_name}"  # its own folder: the config's holds its run
            cost = "cost: not measured (run it: " + shlex.join(
                ["kveval", "run", config_hint, "-s", f"kv=[{self.run_name}]", "-o", out]) + ")"
        elif self.kld is None:
            cost = "cost: not measured"
        else:
            dppl = f", ΔPPL {self.delta_ppl_pct:+.2f}%" if self.delta_ppl_pct is not None else ""
            cost = f"KLD {self.kld:.4g}{dppl} ({self.source})"
        return f"{self.label}: {self.bits:.2f} bits/element, {cost}"


@dataclass(frozen=True)
class ScanPredictions:
    """A sensitivity scan as costs read it: the ``specs`` it scanned (in scan order) and ``predict(spec)``, the
    summed scanned KLD of the uniform policy ``spec`` (it may raise on a scan a hand edit broke)."""

    specs: list
    predict: Callable[[str], float]


@dataclass
class Costs:
    """Where measured and predicted costs come from: a run folder's metrics, a scan's predictions."""

    run: dict | None = None
    run_name: str = ""
    run_policies: dict = field(default_factory=dict)
    scan: ScanPredictions | None = None
    scan_name: str = ""

    def measured(self, preset: str | None) -> tuple[float, float | None] | None:
        """(KLD, ΔPPL % or None) the run measured for ``preset`` (or a policy of the same form); None when it has
        no finite KLD for it (a NaN, a string or a list in a hand-edited metrics.json is no cost)."""
        if not self.run or not preset:
            return None
        pols = self.run.get("policies") or {}
        names = [preset] + [n for n, cfg in self.run_policies.items() if _same_policy(cfg, preset)]
        for n in names:
            m = pols.get(n) or {}
            if isinstance(m, dict) and is_finite_number(m.get("kld_mean")):
                dppl = m.get("delta_ppl_pct")
                return float(m["kld_mean"]), float(dppl) if is_finite_number(dppl) else None
        return None

    def predicted(self, spec_names: tuple[str, ...]) -> float | None:
        """The scan's predicted summed KLD of the first of ``spec_names`` it scanned (None: none, or not finite)."""
        if not self.scan:
            return None
        for s in self.scan.specs:
            if s in spec_names:
                try:
                    value = self.scan.predict(s)
                except (KeyError, TypeError, ValueError, AttributeError):
                    return None  # a scan whose cells a hand edit broke: no prediction rather than a wrong one
                return float(value) if is_finite_number(value) else None
        return None


def _same_policy(cfg, preset: str) -> bool:
    try:
        return KVPolicy.from_config(cfg, name=preset).to_config() == KVPolicy.preset(preset).to_config()
    except (KvevalError, TypeError, ValueError, AttributeError):  # a hand-edited resolved config
        return False


def nearest_options(engine: Engine, arch: Arch, context: int, target_bits: float, costs: Costs,
                    n: int = 3) -> list[Option]:
    """The engine's ``n`` uniform policies nearest in memory to ``target_bits`` (the asked policy's bill in bits per
    element at ``context``): ordered
    by their distance in bits per element, then by cost (lower first, unmeasured last), each with its measured
    (``costs.run``) or predicted (``costs.scan``: the summed scanned KLD of the uniform spec) cost."""
    out = []
    for t in engine.types:
        if t.name in ("f16",):
            continue
        what = t.preset or t.specs[0]
        try:
            bill = kv_bytes(arch, what, context)
        except (KvevalError, ValueError):
            continue
        opt = Option(engine.label(t), t.preset, bill.bits_per_element, run_name=_run_name(t))
        got = costs.measured(t.preset)
        if got is not None:
            opt.kld, opt.delta_ppl_pct = got[0], got[1]
            opt.source = f"measured in {costs.run_name}"
        else:
            pred = costs.predicted(t.specs)
            if pred is not None:
                opt.kld, opt.source = pred, f"predicted from the scan {costs.scan_name}"
        out.append(opt)
    out.sort(key=lambda o: (round(abs(o.bits - target_bits), 2), o.kld is None, o.kld or 0.0, -o.bits))
    return out[:n]


def _run_name(t: EngineType) -> str | None:
    """The ``kv:`` entry that evaluates engine type ``t``: its preset, else its first spec when that is a policy
    preset too (fp8_e5m2), else None."""
    if t.preset:
        return t.preset
    try:
        KVPolicy.preset(t.specs[0])
    except KvevalError:
        return None
    return t.specs[0]
