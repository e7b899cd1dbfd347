"""metrics.json's session fields from the records (pure: the same records give the same metrics).

Per run (the baseline, and each policy x variant under ``policies.<name>.session.<variant>``):

- ``accuracy`` (share of turns answered correctly), ``by_turn`` (per turn index), ``by_depth`` (per history-depth
  bucket: ``[{"upto", "turns", "accuracy"}]``, the bucket of a turn being the tokens of history before it), and
  ``depth_area``: the mean accuracy over the buckets that hold turns (MRCR's area under the accuracy-by-length
  curve, normalised to 0..1);
- ``tool``: over the tool-call turns, the shares that parse as JSON, match the schema and have exact arguments,
  overall and ``by_depth``; ``persistence``: per turn, the share of answers that kept the system prompt's
  instruction (its suffix, its most sentences);
- ``survival``: per turn t, the share of sessions with no failed turn up to t (``first_failure``: per session,
  the first failed turn or None);
- policies add ``recovery`` (accuracy / the baseline's, %), ``drop`` (points lost, paired on the same turns),
  ``drop_mde`` (the smallest drop the run detects: alpha 0.05, power 0.8, from the paired per-turn differences,
  floored by the binomial spread of a policy at ``max_drop``), ``verdict`` (``pass`` / ``fail`` / ``inconclusive``
  with ``more_sessions_to_decide``), ``effective_depth`` (the deepest bucket up to which every bucket's accuracy
  is within ``max_drop`` points of the baseline's in that bucket: RULER's effective length; None when the first
  bucket already fails) and, for ``fp_history``, ``kld_by_turn`` (mean of the per-turn mean KLD along the FP
  answers).
"""

from __future__ import annotations

import math
from bisect import bisect_left

from kveval.results.layout import BASELINE
from kveval.stats import (
    binomial_sd_points,
    effective_length,
    inconclusive,
    length_area,
    mean_of_present,
    minimum_detectable_effect,
    paired_standard_error,
    size_to_decide,
)

FP = "fp"


def _bucket(depth: int, edges: list[int]) -> int | None:
    """The upper edge of the bucket that holds ``depth`` (``depth <= edge``), None beyond the last."""
    i = bisect_left(edges, depth)
    return edges[i] if i < len(edges) else None


def _share(values: list) -> float | None:
    """The share of true values among those that are not None; None when there are none."""
    return mean_of_present([float(bool(v)) for v in values if v is not None])


def summarise(records: list[dict], n_turns: int, edges: list[int]) -> dict:
    """The summary of one run's session records (see the module docstring)."""
    turns = [t for r in records for t in r["turns"]]
    by_depth: dict[int | None, list[dict]] = {}
    for t in turns:
        by_depth.setdefault(_bucket(int(t["depth"]), edges), []).append(t)
    depth_rows = [{"upto": e, "turns": len(by_depth[e]), "accuracy": _share([t["correct"] for t in by_depth[e]])}
                  for e in edges if e in by_depth]
    if None in by_depth:
        depth_rows.append({"upto": None, "turns": len(by_depth[None]),
                           "accuracy": _share([t["correct"] for t in by_depth[None]])})
    tools = [t for t in turns if t.get("tool")]
    tool = None
    if tools:
        tool = {k: _share([t["tool"][k] for t in tools]) for k in ("parsed", "schema", "exact")}
        tool["turns"] = len(tools)
        tool["by_depth"] = [{"upto": row["upto"], "turns": len(ts), **{k: _share([t["tool"][k] for t in ts])
                                                                       for k in ("parsed", "schema", "exact")}}
                            for row in depth_rows
                            if (ts := [t for t in by_depth[row["upto"]] if t.get("tool")])]
    first = {}
    for r in records:
        failed = [t["turn"] for t in r["turns"] if not t["correct"]]
        first[r["session"]] = min(failed) if failed else None
    survival = [mean_of_present([float(f is None or f > k) for f in first.values()]) for k in range(n_turns)]
    return {
        "accuracy": _share([t["correct"] for t in turns]),
        "turns": len(turns),
        "sessions": len(records),
        "by_turn": [_share([t["correct"] for t in turns if t["turn"] == k]) for k in range(n_turns)],
        "by_depth": depth_rows,
        "depth_area": length_area({r["upto"]: r["accuracy"] for r in depth_rows if r["upto"] is not None}),
        "tool": tool,
        "persistence": [_share([t["persist"] for t in turns if t["turn"] == k]) for k in range(n_turns)],
        "first_failure": first,
        "survival": survival,
    }


def _effective_depth(mine: list[dict], base: list[dict], max_drop: float) -> int | None:
    """The deepest bucket edge up to which every bucket's accuracy is within ``max_drop`` points of the
    baseline's in the same bucket (:func:`kveval.stats.effective_length`; buckets either side lacks skipped)."""
    def points(rows: list[dict]) -> dict[int, float | None]:
        return {r["upto"]: None if r["accuracy"] is None else 100.0 * r["accuracy"] for r in rows
                if r["upto"] is not None}

    return effective_length(points(mine), points(base), max_drop)


def _paired(mine: list[dict], base: list[dict], max_drop: float, turns_per_session: float) -> dict:
    """Drop, its MDE and the verdict from the per-turn paired differences (baseline minus policy, points)."""
    fp = {(r["session"], t["turn"]): t["correct"] for r in base for t in r["turns"]}
    diffs = [100.0 * (float(fp[(r["session"], t["turn"])]) - float(t["correct"]))
             for r in mine for t in r["turns"] if (r["session"], t["turn"]) in fp]
    if not diffs:
        return {"drop": None, "drop_mde": None, "verdict": None, "paired_turns": 0}
    drop = round(math.fsum(diffs) / len(diffs), 9)
    mde = minimum_detectable_effect(paired_standard_error(diffs, binomial_sd_points(max_drop)))
    out = {"drop": drop, "drop_mde": mde, "paired_turns": len(diffs)}
    if inconclusive(drop, max_drop, mde):
        out["verdict"] = "inconclusive"
        total = size_to_decide(len(diffs), drop, max_drop, mde) if mde is not None else None
        out["more_sessions_to_decide"] = None if total is None else \
            max(0, math.ceil((total - len(diffs)) / max(turns_per_session, 1)))
    else:
        out["verdict"] = "fail" if drop > max_drop else "pass"
    return out


def aggregate(records: list[dict], sessions: list, policies: list[str], params) -> dict:
    """metrics.json's ``session`` fields: ``baseline.session`` and ``policies.<name>.session.<variant>``."""
    mine = [r for r in records if r.get("task") == "session"]
    n_turns = max((len(s.turns) for s in sessions), default=0)
    edges = list(params.depth_buckets)
    per_session = sum(len(s.turns) for s in sessions) / len(sessions) if sessions else 1.0
    base_recs = [r for r in mine if r["policy"] == BASELINE and r["variant"] == FP]
    base = summarise(base_recs, n_turns, edges)
    out: dict = {BASELINE: {"session": base, "session_accuracy": base["accuracy"]}, "policies": {}}
    for name in policies:
        variants = {}
        for v in params.variants:
            recs = [r for r in mine if r["policy"] == name and r["variant"] == v]
            s = summarise(recs, n_turns, edges)
            acc, fp_acc = s["accuracy"], base["accuracy"]
            s["recovery"] = None if acc is None or not fp_acc else 100.0 * acc / fp_acc
            s.update(_paired(recs, base_recs, params.max_drop, per_session))
            s["effective_depth"] = _effective_depth(s["by_depth"], base["by_depth"], params.max_drop)
            if v == "fp_history":
                s["kld_by_turn"] = [mean_of_present([t.get("kld_mean") for r in recs for t in r["turns"]
                                                     if t["turn"] == k]) for k in range(n_turns)]
            variants[v] = s
        head = variants[params.variants[0]]
        out["policies"][name] = {"session": variants, "session_accuracy": head["accuracy"],
                                 "session_recovery": head["recovery"], "session_verdict": head["verdict"]}
    return out
