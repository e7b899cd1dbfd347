"""Mixed precision under a memory budget: one spec per layer for K and one for V, minimising the scanned KLD.

Inputs: a sensitivity scan (``results/<scan>/metrics.json``: per layer x {K, V} x spec, the mean KL divergence
from the baseline when only that tensor is quantized) and a budget. Candidates: the scanned specs plus ``int8``
(its KLD estimated from the finest scanned spec when it was not scanned: the KLD of a small perturbation is
quadratic in it, so one bit more divides it by 4) and, only when asked (``allow_fp``), ``none`` at KLD 0. Full
precision is left out by default: an engine that quantizes its cache rarely keeps single layers in FP16, and a
plan that does spends the budget where a measurement says nothing (KLD 0 is exact, not scanned).

Costs are exact integers: the bytes that ``kveval.memory.kv_bytes`` bills for that tensor of that layer at
``context`` tokens (codes + scales + zero points). The sum over layers is the mixed policy's bill, so the budget is
respected to the byte. The choice is a multiple-choice knapsack, solved exactly by dynamic programming over
the budget in units of the gcd of all costs (``solve``), assuming that the KLDs of the cells add up.

Budget syntax (``parse_budget``):

    4.5  4.5bits  4.5b        average stored bits per K/V element, scales included
    30000B/token  35KB/token  35KiB/token    bytes per token of one sequence (KB = 1000 B, KiB = 1024 B)
    0.28x  28%                 fraction of the FP16 cache
    int4_g64                   the memory of that uniform policy (any ``kveval ls`` policy preset)

Inputs are checked before any planning (one :class:`KvevalError` line each): ``check_scan`` for a scan's
``metrics.json`` (fields missing, of the wrong type, non-finite, layers outside the architecture: a hand-edited or
foreign file). The ``.plan.json`` that ``kveval plan`` writes beside a planned config is one schema,
:class:`kveval.policy.plan_file.PlanFile`, below the tasks. What each serving engine can run (``plan --engine``) is
:data:`kveval.engines.tables.ENGINES`.

Pure: no transformers import.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from functools import reduce
from pathlib import Path

import numpy as np

from kveval.engines.names import check_engine_names
from kveval.engines.tables import ENGINES
from kveval.errors import KvevalError
from kveval.memory import Arch, fp16_bytes, kv_bytes, kv_elements
from kveval.policy import KVPolicy, policy_names
from kveval.quant import preset
from kveval.schema import is_finite_number

TENSORS = ("key", "value")
MAX_DP_CELLS = 200_000_000
GENERATED_DIR = Path("configs") / "generated"


# ------------------------------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class Budget:
    """``kind``: "bits" (per element), "bytes_per_token", "fraction" (of FP16) or "policy" (a preset's memory)."""

    kind: str
    value: float | str
    text: str

    def bytes(self, arch: Arch, context: int) -> int:
        """The largest allowed cache size in bytes for one sequence of ``context`` tokens (exact, floored)."""
        elements = kv_elements(arch, context)
        if self.kind == "bits":
            return math.floor(Fraction(str(self.value)) * elements / 8)
        if self.kind == "bytes_per_token":
            return math.floor(Fraction(str(self.value)) * context)
        if self.kind == "fraction":
            return math.floor(Fraction(str(self.value)) * fp16_bytes(arch, context))
        return kv_bytes(arch, str(self.value), context).total

    def describe(self, arch: Arch, context: int) -> str:
        b = self.bytes(arch, context)
        bits = 8 * b / kv_elements(arch, context)
        return f"{self.text}: {b:,} B at {context:,} tokens ({bits:.4f} bits/element, {b / context:,.1f} B/token)"


_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2}


def parse_budget(text: str | float) -> Budget:
    """A budget from its text form (see the module docstring); KvevalError when it is not understood."""
    raw = str(text).strip()
    t = raw.lower().replace(" ", "")
    num = r"(\d+(?:\.\d*)?|\.\d+)"
    if m := re.fullmatch(num + r"(?:bits?|b)?(?:/el(?:em(?:ent)?)?)?", t):
        value = float(m.group(1))
        if not 0 < value <= 32:
            raise KvevalError(f"budget '{raw}': {value} bits per element is out of range (0, 32]")
        return Budget("bits", m.group(1), raw)
    if m := re.fullmatch(num + r"(b|kb|kib|mb|mib)/(?:tok|token)", t):
        value = Fraction(m.group(1)) * _UNITS[m.group(2)]
        if value <= 0:
            raise KvevalError(f"budget '{raw}' must be positive")
        return Budget("bytes_per_token", str(value), raw)
    if m := re.fullmatch(num + r"(x|%)", t):
        value = Fraction(m.group(1)) / (100 if m.group(2) == "%" else 1)
        if not 0 < value <= 1:
            raise KvevalError(f"budget '{raw}': a fraction of FP16 must lie in (0, 1] (e.g. 0.28x or 28%)")
        return Budget("fraction", str(value), raw)
    if raw in policy_names():
        return Budget("policy", raw, raw)
    raise KvevalError(
        f"budget '{raw}' is not understood; use bits per element (4.5 or 4.5bits), bytes per token "
        "(35KB/token, 30000B/token), a fraction of FP16 (0.28x or 28%), or a policy preset (int4_g64)"
    )


# ------------------------------------------------------------------------------------------------- knapsack


def solve(items: list[list[tuple[int, float]]], capacity: int) -> tuple[float, list[int]]:
    """Exact multiple-choice knapsack: pick one (cost, value) per item, total cost <= capacity, minimal total value.

    Costs are non-negative integers. Returns (minimal value, chosen index per item); among equal values the
    cheaper plan wins. Dynamic programming over the capacity divided by the gcd of all costs:
    O(items x choices x capacity / gcd). KvevalError when no choice fits (with the minimum needed).
    """
    if any(not choices for choices in items):
        raise KvevalError("every item needs at least one choice")
    least = sum(min(c for c, _ in choices) for choices in items)
    if least > capacity:
        raise KvevalError(f"no plan fits {capacity} B: the cheapest plan needs {least} B")
    g = reduce(math.gcd, (c for choices in items for c, _ in choices), 0) or 1
    cap = capacity // g
    if (len(items) + 1) * (cap + 1) > MAX_DP_CELLS:
        raise KvevalError(f"the knapsack is too large ({len(items)} items x {cap + 1} cost steps); lower the context")
    dp = np.full(cap + 1, np.inf)
    dp[0] = 0.0
    picks = np.zeros((len(items), cap + 1), dtype=np.int16)
    for n, choices in enumerate(items):
        new = np.full(cap + 1, np.inf)
        for j, (cost, value) in enumerate(choices):
            c = cost // g
            if c > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c:] = dp[: cap + 1 - c] + value
            better = cand < new
            new[better] = cand[better]
            picks[n][better] = j
        dp = new
    end = int(np.argmin(dp))  # the first minimum: the cheapest among the best
    best = float(dp[end])
    chosen = [0] * len(items)
    for n in range(len(items) - 1, -1, -1):
        j = int(picks[n][end])
        chosen[n] = j
        end -= items[n][j][0] // g
    return best, chosen


# ------------------------------------------------------------------------------------------------- planning


@dataclass
class Plan:
    """The chosen spec per layer for K and V, with what the scan predicts and what the memory bill says."""

    key: list[str]
    value: list[str]
    predicted_kld_sum: float
    predicted_delta_ppl_pct: float
    budget: Budget
    budget_bytes: int
    total_bytes: int
    context: int
    arch: Arch
    estimated: list[str] = field(default_factory=list)
    #: the engine whose cache types the plan was restricted to (``kveval plan --engine``), None: any spec
    engine: str | None = None

    def policy(self, name: str = "planned") -> KVPolicy:
        """The mixed policy: the most common K and V specs as defaults, the other layers as overrides."""
        return KVPolicy.from_config(self.policy_config(), name=name)

    def policy_config(self) -> dict:
        k0 = max(set(self.key), key=lambda s: (self.key.count(s), s))
        v0 = max(set(self.value), key=lambda s: (self.value.count(s), s))
        groups: dict[tuple, list[int]] = {}
        for i, (k, v) in enumerate(zip(self.key, self.value)):
            body = tuple((t, s) for t, s, d in (("key", k, k0), ("value", v, v0)) if s != d)
            if body:
                groups.setdefault(body, []).append(i)
        layers = {",".join(map(str, idx)): dict(body) for body, idx in sorted(groups.items(), key=lambda g: g[1])}
        cfg = {"key": k0, "value": v0}
        if layers:
            cfg["layers"] = layers
        return cfg

    @property
    def bits_per_element(self) -> float:
        return 8 * self.total_bytes / kv_elements(self.arch, self.context)


MAX_CONTEXT = 10**8  # tokens: a plan's memory bill at more than this is a typo
MAX_LAYERS = 4096


def _count(value, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_scan(metrics) -> Arch:
    """The architecture of a scan's ``metrics.json``, after checking every field the planner reads: a KvevalError
    line naming the first field that is missing or wrong (a hand-edited file, or the metrics of another run)."""
    bad = "the scan's metrics.json"
    if not isinstance(metrics, dict):
        raise KvevalError(f"{bad} is not a JSON object")
    sens = metrics.get("sensitivity")
    if not isinstance(sens, dict) or not sens.get("cells"):
        raise KvevalError("these results hold no sensitivity scan (run kveval scan configs/layer_scan.yaml first)")
    memory = metrics.get("memory")
    arch_fields = memory.get("arch") if isinstance(memory, dict) else None
    if not isinstance(arch_fields, dict):
        raise KvevalError(f"{bad} has no memory.arch (the model's shape); rerun the scan")
    try:
        arch = Arch.from_dict(arch_fields)
    except (TypeError, ValueError, KvevalError) as exc:
        raise KvevalError(f"{bad}: memory.arch is not a model shape ({str(exc).splitlines()[0][:200]})") from None
    for name in ("layers", "kv_heads", "head_dim"):
        if not _count(getattr(arch, name, None)):
            raise KvevalError(f"{bad}: memory.arch.{name} is {getattr(arch, name, None)!r}, not a positive integer")
    if arch.layers > MAX_LAYERS:
        raise KvevalError(f"{bad}: memory.arch.layers {arch.layers} is more than any model has ({MAX_LAYERS})")
    if not _count(memory.get("context")):
        raise KvevalError(f"{bad}: memory.context is {memory.get('context')!r}, not a positive integer")
    specs = sens.get("specs")
    if not isinstance(specs, list) or not specs or not all(isinstance(x, str) for x in specs):
        raise KvevalError(f"{bad}: sensitivity.specs is {specs!r}, not a list of spec names")
    for name in specs:
        try:
            preset(name)
        except (KvevalError, ValueError) as exc:
            raise KvevalError(f"{bad}: sensitivity.specs: {str(exc).splitlines()[0]}") from None
    for key, least in (("seq_len", 2), ("token_end", 0)):
        if key in sens and sens[key] is not None and not _count(sens[key], least):
            raise KvevalError(f"{bad}: sensitivity.{key} is {sens[key]!r}, not an integer >= {least}")
    if not isinstance(sens["cells"], list):
        raise KvevalError(f"{bad}: sensitivity.cells is not a list")
    for i, c in enumerate(sens["cells"]):
        where = f"{bad}: sensitivity.cells[{i}]"
        if not isinstance(c, dict):
            raise KvevalError(f"{where} is not an object")
        for key in ("layer", "tensor", "spec", "kld", "nll_delta"):
            if key not in c:
                raise KvevalError(f"{where} has no '{key}'")
        if not _count(c["layer"], 0) or c["layer"] not in arch.kv_layers:
            raise KvevalError(f"{where}.layer is {c['layer']!r}, not a layer of the model that holds K/V")
        if c["tensor"] not in TENSORS:
            raise KvevalError(f"{where}.tensor is {c['tensor']!r}, not key or value")
        if c["spec"] not in specs:
            raise KvevalError(f"{where}.spec is {c['spec']!r}, not one of sensitivity.specs {specs}")
        for key in ("kld", "nll_delta"):
            if not is_finite_number(c[key]):
                raise KvevalError(f"{where}.{key} is {c[key]!r}, not a finite number")
    return arch


def scan_table(metrics: dict) -> dict[tuple[int, str, str], dict]:
    """(layer, tensor, spec) -> scan cell, from a scan run's metrics (checked by :func:`check_scan`)."""
    check_scan(metrics)
    return {(c["layer"], c["tensor"], c["spec"]): c for c in metrics["sensitivity"]["cells"]}


def candidate_costs(arch: Arch, specs: list[str], context: int) -> dict[tuple[int, str, str], int]:
    """(layer, tensor, spec) -> bytes billed for that tensor of that layer at ``context`` tokens (FP16 for none)."""
    out = {}
    for spec in specs:
        bill = kv_bytes(arch, spec, context)
        for i, (k, v) in enumerate(bill.per_layer):
            out[(i, "key", spec)], out[(i, "value", spec)] = k.total, v.total
    return out


def plan(metrics: dict, budget: Budget | str, *, context: int | None = None, extra: tuple[str, ...] = ("int8",),
         allow_fp: bool = False, engine: str | None = None) -> Plan:
    """The optimal plan under ``budget`` for a scan's metrics (``metrics.json`` of a sensitivity run); with
    ``engine`` (``kveval.engines.tables.ENGINES``) the best plan that engine can run
    (:func:`engine_plan`)."""
    budget = parse_budget(budget) if not isinstance(budget, Budget) else budget
    arch = check_scan(metrics)
    table = scan_table(metrics)
    if context is not None and (not _count(context) or context > MAX_CONTEXT):
        raise KvevalError(f"--context {context}: give a number of tokens between 1 and {MAX_CONTEXT}")
    context = context or metrics["sensitivity"].get("seq_len") or metrics["memory"]["context"]
    if engine is not None:
        return engine_plan(metrics, budget, engine, context=context, allow_fp=allow_fp)
    scanned = list(metrics["sensitivity"]["specs"])
    specs = scanned + [s for s in extra if s not in scanned] + (["none"] if allow_fp else [])
    costs = candidate_costs(arch, specs, context)
    estimated = [s for s in specs if s not in scanned and s != "none"]
    items, names = [], []
    for i in arch.kv_layers:  # a hybrid's attention layers only: the others hold no K/V
        for t in TENSORS:
            choices = []
            for s in specs:
                kld, dnll = _cell_value(table, i, t, s, scanned)
                choices.append((costs[(i, t, s)], kld, dnll))
            items.append(choices)
            names.append((i, t))
    capacity = budget.bytes(arch, context)
    try:
        best, chosen = solve([[(c, v) for c, v, _ in ch] for ch in items], capacity)
    except KvevalError:
        least = sum(min(c for c, _, _ in ch) for ch in items)
        bits = 8 * least / kv_elements(arch, context)
        raise KvevalError(
            f"budget {budget.describe(arch, context)} is below the smallest plan the candidates "
            f"({', '.join(specs)}) allow: {least:,} B = {bits:.4f} bits/element ({least / context:,.1f} B/token); "
            f"give --budget {math.ceil(bits * 100) / 100:g} or more"
        ) from None
    key, value = [""] * arch.layers, [""] * arch.layers
    dnll_sum = 0.0
    for (i, t), ch, j in zip(names, items, chosen):
        (key if t == "key" else value)[i] = specs[j]
        dnll_sum += ch[j][2]
    for chosen_specs in (key, value):  # layers without K/V take the commonest choice: no override is written
        common = max(set(s for s in chosen_specs if s), key=lambda s: (chosen_specs.count(s), s))
        chosen_specs[:] = [s or common for s in chosen_specs]
    total = sum(ch[j][0] for ch, j in zip(items, chosen))
    return Plan(key, value, best, 100.0 * math.expm1(dnll_sum), budget, capacity, total, context, arch, estimated)


class MissingEngineSpecs(KvevalError):
    """A scan holds none of the cache types an engine runs (``kveval plan`` adds the command that scans them)."""


def engine_plan(metrics: dict, budget: Budget, engine: str, *, context: int, allow_fp: bool = False) -> Plan:
    """The plan of least summed scanned KLD under ``budget`` among the policies ``engine`` can run, from the
    scanned specs that compute one of its cache types (no estimated specs: an engine's type is scanned or left
    out). vLLM: one type for K and V of every layer, each layer also free to stay in the model's dtype
    (``--kv-cache-dtype-skip-layers``: a per-layer knapsack per type, :func:`solve`); llama.cpp: one K type and
    one V type for all layers (``none``, f16, among them with ``allow_fp``); SGLang, TensorRT-LLM, transformers:
    one type for K and V of every layer. KvevalError naming the engine when the scan holds none of its types or
    no plan of them fits."""
    check_engine_names([engine])
    eng = ENGINES[engine]
    arch = check_scan(metrics)
    table = scan_table(metrics)
    scanned = list(metrics["sensitivity"]["specs"])
    cands = eng.candidates(scanned)
    if not cands:
        runnable = sorted({s for t in eng.types for s in t.specs if s != "none"})
        raise MissingEngineSpecs(f"--engine {engine}: the scan holds none of the specs {eng.title} can run "
                                 f"(scanned: {', '.join(scanned)}; it runs {', '.join(runnable)})")
    specs = cands + (["none"] if "none" not in cands else [])
    costs = candidate_costs(arch, specs, context)
    capacity = budget.bytes(arch, context)
    layers = range(arch.layers)

    def cell(i: int, t: str, s: str) -> tuple[int, float, float]:
        kld, dnll = _cell_value(table, i, t, s, scanned)
        return costs[(i, t, s)], kld, dnll

    if eng.split_kv:
        pool = cands + (["none"] if allow_fp and "none" not in cands else [])
        pairs = [(k, v) for k in pool for v in pool if (k, v) != ("none", "none")]
    else:
        pairs = [(d, d) for d in cands if d != "none"]
    best: tuple | None = None
    for dk, dv in pairs:
        if eng.skip_layers:
            items = [[(cell(i, "key", dk)[0] + cell(i, "value", dv)[0], cell(i, "key", dk)[1] + cell(i, "value", dv)[1]),
                      (costs[(i, "key", "none")] + costs[(i, "value", "none")], 0.0)] for i in layers]
            try:
                _, chosen = solve(items, capacity)
            except KvevalError:
                continue
            key = [dk if c == 0 else "none" for c in chosen]
            value = [dv if c == 0 else "none" for c in chosen]
        else:
            key, value = [dk] * arch.layers, [dv] * arch.layers
        parts = [cell(i, "key", key[i]) for i in layers] + [cell(i, "value", value[i]) for i in layers]
        total = sum(p[0] for p in parts)
        if total > capacity:
            continue
        kld, dnll = sum(p[1] for p in parts), sum(p[2] for p in parts)
        if best is None or (kld, total) < (best[0], best[1]):
            best = (kld, total, dnll, key, value)
    if best is None:
        least = min(sum(costs[(i, "key", k)] + costs[(i, "value", v)] for i in layers) for k, v in pairs)
        bits = 8 * least / kv_elements(arch, context)
        raise KvevalError(f"budget {budget.describe(arch, context)} is below the smallest plan {eng.title} can run "
                          f"from the scan's {', '.join(cands)}: {least:,} B = {bits:.4f} bits/element; give --budget "
                          f"{math.ceil(bits * 100) / 100:g} or more")
    kld, total, dnll, key, value = best
    return Plan(key, value, kld, 100.0 * math.expm1(dnll), budget, capacity, total, context, arch, [],
                engine=engine)


def _cell_value(table, layer: int, tensor: str, spec: str, scanned: list[str]) -> tuple[float, float]:
    """(KLD, ΔNLL) of a cell: scanned, 0 for none, else estimated from the finest scanned spec (4x per bit)."""
    if spec == "none":
        return 0.0, 0.0
    if (layer, tensor, spec) in table:
        c = table[(layer, tensor, spec)]
        return c["kld"], c["nll_delta"]
    if spec in scanned:
        raise KvevalError(f"the scan has no cell for layer {layer} {tensor} {spec}")
    ref = max(scanned, key=lambda s: preset(s).code_bits)
    c = table.get((layer, tensor, ref))
    if c is None:
        raise KvevalError(f"the scan has no cell for layer {layer} {tensor}; scan all layers and both tensors")
    factor = 4.0 ** -(preset(spec).code_bits - preset(ref).code_bits)
    return c["kld"] * factor, c["nll_delta"] * factor


def uniform_prediction(metrics: dict, spec: str) -> float:
    """Summed scanned KLD of the uniform policy ``spec`` (the planner's prediction for it)."""
    table = scan_table(metrics)
    scanned = list(metrics["sensitivity"]["specs"])
    layers = metrics["memory"]["arch"]["layers"]
    return sum(_cell_value(table, i, t, spec, scanned)[0] for i in range(layers) for t in TENSORS)


# ------------------------------------------------------------------------------------------------- output


def nearest_uniform(metrics: dict, plan_: Plan, specs: list[str]) -> list[str]:
    """Uniform candidates nearest in memory to the budget: the largest at or under it and the smallest above it."""
    bills = {s: kv_bytes(plan_.arch, s, plan_.context).total for s in specs}
    under = [s for s in specs if bills[s] <= plan_.budget_bytes]
    over = [s for s in specs if bills[s] > plan_.budget_bytes]
    out = []
    if under:
        out.append(max(under, key=lambda s: bills[s]))
    if over:
        out.append(min(over, key=lambda s: bills[s]))
    if plan_.budget.kind == "policy" and str(plan_.budget.value) not in out:
        out.insert(0, str(plan_.budget.value))
    return out


