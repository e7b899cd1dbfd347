"""What a run checks of its policies' calibrated scales before its first forward pass, and ``scales: auto``.

    used = check_scales(ctx)                          # {policy: sha256 of its scales file}; KvevalError otherwise
    reset = check_scales_unchanged(out_dir, {**used, **weight_files}, overwrite=False)
    resolve_auto_scales(ctx, folder)                   # calibrate once into <run>/scales.safetensors

``ctx`` is the run's :class:`kveval.tasks.context.CheckContext`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kveval.errors import KvevalError
from kveval.fileio import read_regular_bytes
from kveval.results import SCALES_FILE, SCALES_USED_FILE, RunDir
from kveval.tasks.context import CheckContext

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



def check_scales(ctx: CheckContext) -> dict:
    """Scales files that policies name exist, fit the model and were not calibrated on the evaluated tokens;
    ``scales: auto`` has a calibration slice that fits the corpus and is disjoint from the evaluation.
    Returns ``{policy: sha256 of its scales file}`` for the policies that name a file."""
    from kveval.calibration.calibrate import calibration_slice, check_overlap
    from kveval.data import tokenizer_fingerprint
    from kveval.patch.quantizers import layer_quantizers, policy_scales
    from kveval.policy import AUTO_SCALES

    sources = resolve_checkpoint_scales(ctx)
    users = {n: p for n, p in ctx.policies.items() if p.needs_scales_file()}
    local = Path(str(ctx.cfg.model.name)).expanduser().is_dir()  # a folder may gain scales before a resume
    used = {n: NO_CHECKPOINT_SCALES for n, s in sources.items() if s.get("kind") == "preset" and local}
    ctx.cache[SOURCES_KEY] = {**sources, **{n: _own_source(ctx, p) for n, p in ctx.policies.items()
                                            if n not in sources and _own_source(ctx, p)}}
    if not users:
        return used
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
        elif name in sources and sources[name].get("kind") == "checkpoint":
            used[name] = sources[name]["digest"]  # read and checked by resolve_checkpoint_scales
            layers = ctx.info["num_layers"]
            try:
                sf = policy_scales(policy, ctx.model)
                for i in range(layers):
                    layer_quantizers(policy, i, layers, sf)
            except (KvevalError, ValueError, IndexError) as exc:
                raise KvevalError(f"policy '{name}': {exc}") from None
        else:
            try:
                sf = policy_scales(policy, ctx.model)
                layers = ctx.info["num_layers"]
                for i in range(layers):  # a format the file was not searched for fails here, not mid-run
                    layer_quantizers(policy, i, layers, sf)
            except (KvevalError, ValueError, IndexError, OSError) as exc:
                raise KvevalError(f"policy '{name}': {exc}") from None
            check_overlap(sf.header, ctx.cfg, n_tokens, fp, f"policy '{name}': scales file {policy.scales}")
            if hasattr(sf, "digest"):  # a model folder named as scales: DIR
                used[name] = sf.digest()
                ctx.cache[SOURCES_KEY][name] = sf.source()
            else:
                used[name] = hashlib.sha256(read_regular_bytes(policy.scales)).hexdigest()
    return used


#: ``ctx.cache`` key of where each policy's scales came from (env.json's ``scales``: :func:`scales_sources`)
SOURCES_KEY = "scales_sources"
#: the ``scales_used.json`` entry of a policy whose engine would read checkpoint scales that the model lacks (so
#: that a resumed run on a folder that gained scales since is refused)
NO_CHECKPOINT_SCALES = "no-checkpoint-scales"


def _own_source(ctx: CheckContext, policy) -> dict | None:
    """Where a policy's scales come from when no checkpoint supplies them (None: dynamic scales only)."""
    from kveval.policy import AUTO_SCALES

    static = [s for s in policy.all_specs() if not s.is_none and (policy.uses_static(s) or s.static_scale)]
    if not static:
        return None
    if policy.scales == AUTO_SCALES:
        cal = ctx.cfg.calibration
        return {"kind": "auto", "describe": f"calibrated by kveval on the last {cal.tokens} corpus tokens "
                                            f"(method {cal.method}; <run>/scales.safetensors)"}
    if policy.scales:
        return {"kind": "file", "path": str(policy.scales), "describe": f"the scales file {policy.scales}"}
    values = sorted({f"{s.static_scale:g}" for s in static if s.static_scale is not None})
    return {"kind": "static", "describe": f"its spec's static scale {', '.join(values)}"}


def resolve_checkpoint_scales(ctx: CheckContext) -> dict:
    """Give every policy whose engine loads checkpoint KV scales (``vllm_fp8``, ``trtllm_int8``, ...: the presets
    of :data:`kveval.scales.checkpoint.PRESET_ENGINES`, unless the policy sets its own ``scales:``; any policy with
    ``scales: checkpoint``) the scales of the run's model folder, as that engine loads them; returns ``{policy:
    source record}`` for those policies (env.json's ``scales``). A bad scale is one KvevalError line naming the
    layer; so is a model whose loading applied the checkpoint's KV scheme to the model itself (compressed-tensors
    hooks would quantize the full-precision baseline)."""
    from dataclasses import replace

    from kveval.scales.checkpoint import checkpoint_targets

    kv = getattr(ctx.cfg, "kv", None)
    raw = getattr(kv, "policies", None) or {}
    targets = checkpoint_targets(ctx.cfg.model.name, raw, ctx.policies)
    if any(target for target, _ in targets.values()):
        hooked = next((n for n, m in ctx.model.named_modules() if hasattr(m, "quantization_scheme")), None)
        if hooked is not None:
            raise KvevalError(f"model {ctx.cfg.model.name}: loading it applied its quantization_config to module "
                              f"'{hooked}' (compressed-tensors hooks), so the full-precision baseline would be "
                              "quantized too; load it with a transformers whose compressed-tensors hooks find no "
                              "attention (5.24) or remove quantization_config from a copy of config.json")
    for name, (target, _) in targets.items():
        if target is not None:
            ctx.policies[name] = replace(ctx.policies[name], scales=target)
    return {name: source for name, (_, source) in targets.items()}


def scales_sources(ctx: CheckContext) -> dict:
    """``{policy: {"kind": checkpoint | file | auto | static | preset, "describe", ...}}``: where each policy's
    static scales came from (env.json's ``scales``; the report shows ``describe``)."""
    return dict(ctx.cache.get(SOURCES_KEY) or {})



def resolve_auto_scales(ctx: CheckContext, folder: RunDir) -> None:
    """Calibrate once per run for ``scales: auto`` policies (``<run>/scales.safetensors`` in the open ``folder``,
    reused on resume) and point those policies at the file."""
    from dataclasses import replace

    from kveval.calibration.calibrate import calibrate
    from kveval.policy import AUTO_SCALES

    auto = [n for n, p in ctx.policies.items() if p.scales == AUTO_SCALES and p.needs_scales_file()]
    if not auto:
        return
    path = folder.path / SCALES_FILE
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
