"""The checks of a policy's fields: each field's form resolved (``residual_mode``, ``transforms``), what a spec
needs of its tensor's schedule, and the widths a model gives each spec (``KVPolicy.check_model``).

``KVPolicy.__post_init__`` and ``KVPolicy.check_model`` call these; every error is one line that names the policy.
Functions of plain values, so that ``kveval.policy.policy`` imports this module and never the reverse.
"""

from __future__ import annotations

from typing import Any

from kveval.errors import KvevalError
from kveval.policy.masks import BLOCK_MODES, RESIDUAL_MODES, Schedule
from kveval.quant import QuantSpec
from kveval.transforms import KVTransform, PreRope, parse_transforms

KINDS = ("key", "value")
PREFILL_MODES = ("fp", "quantized")


def resolve_transforms(given: Any, pre_rope: bool, name: str) -> tuple[bool, tuple[KVTransform, ...]]:
    """``(pre_rope, transforms)`` of policy ``name``: transforms given in config form (names, mappings) become a
    tuple of ``KVTransform``; a leading ``pre_rope`` becomes ``pre_rope: true`` (one policy, one resolved config).
    The caller checks the order of the sequence (``kveval.transforms.check_sequence``)."""
    transforms = given
    if not isinstance(given, tuple) or not all(isinstance(t, KVTransform) for t in given):
        transforms = parse_transforms(given, f"policy '{name}'.transforms")
    if transforms and transforms[0] == PreRope() and not pre_rope:
        return True, transforms[1:]
    return pre_rope, transforms


def resolve_modes(given: Any, name: str) -> str | tuple[str, str]:
    """The ``residual_mode`` of policy ``name``: a mode name, or (key, value) modes given as a ``{key, value}``
    mapping or a pair; a pair of equal modes becomes one name (one policy, one resolved config)."""
    modes: Any = given
    if isinstance(modes, dict):
        unknown = [k for k in modes if k not in KINDS]
        if unknown or len(modes) != 2:
            raise KvevalError(f"policy '{name}': residual_mode as a mapping needs exactly the keys 'key' and "
                              f"'value'; got {sorted(map(str, modes))}")
        modes = (modes["key"], modes["value"])
    if isinstance(modes, list):
        modes = tuple(modes)
    if not isinstance(modes, tuple):
        modes = (modes,)
    if len(modes) not in (1, 2) or not all(isinstance(m, str) for m in modes):
        raise KvevalError(f"policy '{name}': residual_mode must be a mode name or {{key: MODE, value: MODE}}; "
                          f"got {given!r}")
    for m in modes:
        if m not in RESIDUAL_MODES:
            raise KvevalError(f"policy '{name}': residual_mode must be one of {RESIDUAL_MODES}, got '{m}'")
    return modes[0] if len(set(modes)) == 1 else modes


def check_values(name: str, prefill: str, scales: Any, schedules: list[Schedule]) -> None:
    """``prefill`` one of ``PREFILL_MODES``; the block size (``residual``) of every block schedule (the keys',
    the values'); ``scales`` a path or ``auto`` when given."""
    if prefill not in PREFILL_MODES:
        raise KvevalError(f"policy '{name}': prefill must be one of {PREFILL_MODES}, got '{prefill}'")
    for schedule in schedules:
        if schedule.mode in BLOCK_MODES and schedule.residual == 0:
            raise KvevalError(f"policy '{name}': residual_mode '{schedule.mode}' needs residual > 0 (the block size)")
    if scales is not None and (not isinstance(scales, str) or not scales.strip()):
        raise KvevalError(f"policy '{name}': scales must be a path to a scales file or 'auto'; got {scales!r}")


def check_spec(name: str, kind: str, spec: QuantSpec, schedule: Schedule, static: bool) -> None:
    """What ``spec`` (for the ``kind``s of policy ``name``) needs of the tensor's ``schedule`` when it does not take
    calibrated parameters (``static``: it does): per-channel statistics need token blocks that its token groups
    tile, and a static-only granularity needs static scales."""
    if spec.is_none or static:
        return
    if spec.gran.token_blocks:
        if schedule.mode != "block":
            raise KvevalError(
                f"policy '{name}': per-channel quantization takes its statistics over a block of tokens; "
                f"set residual_mode: block (for the {kind}s) and residual: N (e.g. 128, as KIVI does), or "
                "calibrate static scales (scales: auto)"
            )
        tokens = spec.gran.token_group
        if tokens is not None and schedule.residual % tokens:
            raise KvevalError(
                f"policy '{name}': per-channel groups of {tokens} tokens must tile the {schedule.residual}-token "
                "blocks (KIVI asserts residual_length % group_size == 0)"
            )
    if spec.gran.static_only and spec.static_scale is None:
        raise KvevalError(
            f"policy '{name}': '{spec.granularity}' granularity needs static scales (scales: auto, "
            "scales: FILE from kveval calibrate, or static_scale: 1.0); dynamic per-tensor statistics would "
            "look at tokens that are not decoded yet"
        )


def check_widths(name: str, kind_specs: list[tuple[str, QuantSpec]], transforms: tuple[KVTransform, ...],
                 dims: dict[str, int], note: str = "") -> None:
    """Group sizes of policy ``name`` that divide the width of what each spec quantizes (``dims``: kind -> width),
    transforms that can act on every width (``KVTransform.check_head_dim``); ``note`` ends the error line."""
    for kind, spec in kind_specs:
        try:
            spec.check_head_dim(dims[kind])
        except ValueError as exc:
            raise KvevalError(f"policy '{name}': {exc}{note}") from None
    for t in transforms:
        for dim in sorted(set(dims.values())):
            try:
                t.check_head_dim(dim)
            except ValueError as exc:
                raise KvevalError(f"policy '{name}': transform '{t.name}': {exc}{note}") from None
