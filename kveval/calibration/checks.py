"""What a run checks of its policies' calibrated scales before its first forward pass, and ``scales: auto``.

    used = check_scales(ctx)                          # {policy: sha256 of its scales file}; KvevalError otherwise
    reset = check_scales_unchanged(out_dir, {**used, **weight_files}, overwrite=False)
    resolve_auto_scales(ctx)                           # calibrate once into <run>/scales.safetensors

``ctx`` is the run's :class:`kveval.tasks.context.TaskContext`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kveval.errors import KvevalError
from kveval.results import SCALES_FILE, SCALES_USED_FILE
from kveval.tasks.context import TaskContext

#: The prefix of a GGUF weight variant's entry in ``scales_used.json`` (policy names cannot hold ``/``).
WEIGHTS_KEY = "weights/"


def check_scales_unchanged(out_dir, scales_used: dict, *, overwrite: bool) -> bool:
    """A resumed run whose ``scales: FILE`` (or a weight variant's GGUF file) changed since its records were
    written would mix two calibrations (two weight sets): refuse it, or with ``overwrite`` return True (start the
    folder afresh; :meth:`RunDir.open` does it once every check has passed). Reads only."""
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



def check_scales(ctx: TaskContext) -> dict:
    """Scales files that policies name exist, fit the model and were not calibrated on the evaluated tokens;
    ``scales: auto`` has a calibration slice that fits the corpus and is disjoint from the evaluation.
    Returns ``{policy: sha256 of its scales file}`` for the policies that name a file."""
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



def resolve_auto_scales(ctx: TaskContext) -> None:
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
