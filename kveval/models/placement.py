"""Placing a model's layers across devices with accelerate (``model.device_map`` / ``model.max_memory``): the
checks of a config's placement, :class:`Placement`, the ``from_pretrained`` arguments and the dispatch of a model
held in CPU memory, and the summary of where a dispatched model's modules are."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.models.checks import first_line
from kveval.models.temporaries import clean_stale_temporaries
from kveval.paths import cache_dir
from kveval.units import parse_size

#: ``model.device_map`` strategies (accelerate's, as ``from_pretrained`` takes them; ``auto`` is ``balanced``).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


_DEVICE_RE = re.compile(r"cpu|disk|cuda|cuda:(\d+)")


def _device_index(value: str | int, where: str) -> int | str:
    """A placement device in accelerate's form: GPU index ``N`` for ``N``, ``cuda``, ``cuda:N``; ``cpu``; ``disk``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise KvevalError(f"{where}: {value!r} is not a device; use cpu, disk, cuda:N or a GPU index N")
    if isinstance(value, int):
        if value < 0:
            raise KvevalError(f"{where}: GPU index {value} is negative")
        return value
    if value.strip().isdigit():  # a GPU index written as text (YAML keys of a resolved config)
        return int(value.strip())
    m = _DEVICE_RE.fullmatch(value.strip())
    if m is None:
        raise KvevalError(f"{where}: unknown device {value!r}; use cpu, disk, cuda:N or a GPU index N")
    if value.strip() == "cuda":
        return 0
    return int(m.group(1)) if m.group(1) is not None else value.strip()


def check_device_map(value) -> None:
    """KvevalError (one line) unless ``value`` is None, a strategy (:data:`DEVICE_MAP_STRATEGIES`) or a non-empty
    ``{MODULE: DEVICE}`` mapping (module names as in the model's ``named_modules``, ``""`` for the whole model;
    devices ``cpu``, ``disk``, ``cuda``, ``cuda:N`` or a GPU index). Module names are checked at load time."""
    if value is None:
        return
    if isinstance(value, str):
        if value not in DEVICE_MAP_STRATEGIES:
            raise KvevalError(f"unknown strategy {value!r}; use one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
                              "{module: device} mapping")
        return
    if not isinstance(value, dict) or not value:
        raise KvevalError("give a strategy (auto, balanced, balanced_low_0, sequential) or a non-empty "
                          "{module: device} mapping")
    for module, device in value.items():
        _device_index(device, f"'{module}'")


def check_max_memory(value) -> None:
    """KvevalError (one line) unless ``value`` is None or ``{DEVICE: SIZE}`` with devices a GPU index, ``cuda:N``
    or ``cpu`` and sizes such as ``70GiB`` (:func:`kveval.units.parse_size`) or a number of bytes."""
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise KvevalError("give {device: size}, e.g. {0: 70GiB, cpu: 200GiB}")
    for device, size in value.items():
        if _device_index(device, f"'{device}'") == "disk":
            raise KvevalError("'disk' has no limit to set: what does not fit the devices listed goes to disk")
        _size_bytes(size, f"'{device}'")


def _size_bytes(size, where: str) -> int:
    try:
        return parse_size(size)
    except KvevalError as exc:
        raise KvevalError(f"{where}: {exc}") from None


def check_placement_devices(device_map, max_memory) -> None:
    """The GPUs that a device map or ``max_memory`` names exist on this machine (KvevalError otherwise)."""
    named = set()
    if isinstance(device_map, dict):
        named |= {_device_index(d, "model.device_map") for d in device_map.values()}
    if isinstance(max_memory, dict):
        named |= {_device_index(d, "model.max_memory") for d in max_memory}
    gpus = sorted(d for d in named if isinstance(d, int))
    if not gpus:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus[-1] >= available:
        have = f"this machine has {available} CUDA device{'s' if available != 1 else ''}" if available else \
            "CUDA is not available"
        raise KvevalError(f"model.device_map/max_memory name GPU {gpus[-1]}, but {have}; use cpu and disk, or run "
                          "where the GPUs are")


@dataclass(frozen=True)
class Placement:
    """Where a dispatched model's layers go: ``device_map`` (a strategy or ``{module: device}``, devices in
    accelerate's form) and ``max_memory`` (``{device: bytes}``) for a strategy."""

    device_map: str | dict
    max_memory: dict | None = None

    @classmethod
    def of(cls, device_map, max_memory=None) -> Placement | None:
        """The placement of a config's ``model.device_map`` / ``model.max_memory`` (None without a device map),
        checked (KvevalError, one line) and normalised: ``cuda:N`` and ``cuda`` become GPU indices, sizes bytes."""
        if device_map is None:
            if max_memory is not None:
                raise KvevalError("max_memory needs a device_map strategy (auto, balanced, balanced_low_0, "
                                  "sequential)")
            return None
        check_device_map(device_map)
        check_max_memory(max_memory)
        dm = device_map if isinstance(device_map, str) else {
            str(k): _device_index(v, f"device_map '{k}'") for k, v in device_map.items()}
        mm = None if max_memory is None else {
            _device_index(k, "max_memory"): _size_bytes(v, f"max_memory '{k}'") for k, v in max_memory.items()}
        return cls(dm, mm)


def offload_folder() -> Path:
    """A new folder for the layers a device map sends to ``disk``: ``<cache>/offload/.offload-<id>.<random>.pid<N>``,
    removed when this process exits (and, if it was killed, by the next load: :func:`clean_stale_temporaries`)."""
    import atexit
    import secrets
    import tempfile

    base = cache_dir("offload")
    clean_stale_temporaries(base)
    folder = Path(tempfile.mkdtemp(prefix=f".offload-{secrets.token_hex(8)}.", suffix=f".pid{os.getpid()}",
                                   dir=base))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def pretrained_placement(placement: Placement | None, dtype: torch.dtype) -> dict:
    """``from_pretrained`` keyword arguments that load a checkpoint straight onto its devices; none without a
    placement, and none for float64 (its norms are made exact on the CPU first, then :func:`dispatch` places it)."""
    if placement is None or dtype == torch.float64:
        return {}
    kwargs: dict[str, Any] = {"device_map": placement.device_map, "offload_folder": str(offload_folder())}
    if placement.max_memory is not None:
        kwargs["max_memory"] = placement.max_memory
    return kwargs


def dispatch(model, placement: Placement, dtype: torch.dtype, name: str) -> None:
    """Place a model held in CPU memory by ``placement`` with accelerate, as ``from_pretrained`` would have: a
    strategy is resolved with ``infer_auto_device_map`` (balanced over the GPUs unless ``sequential``), then
    ``dispatch_model`` moves each module to its device and hooks the offloaded ones. KvevalError (one line) for a
    map that does not fit the model (an unknown module, parameters left without a device)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = placement.device_map
    try:
        if isinstance(device_map, str):
            if device_map == "sequential":
                memory = get_max_memory(placement.max_memory)
            else:
                memory = get_balanced_memory(model, max_memory=placement.max_memory, no_split_module_classes=no_split,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
            device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
        kwargs = {}
        if "disk" in set(device_map.values()):
            kwargs["offload_dir"] = str(offload_folder())
        dispatch_model(model, device_map=device_map, skip_keys=getattr(model, "_skip_keys_device_placement", None),
                       **kwargs)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise KvevalError(f"model {name!r}: model.device_map cannot place it: {first_line(exc)}") from None
    model.hf_device_map = device_map


def placement_summary(model) -> str | None:
    """``dispatched: cpu 3, disk 2`` (modules of the device map per device) for a dispatched model, else None."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not device_map:
        return None
    counts: dict[str, int] = {}
    for device in device_map.values():
        key = f"cuda:{device}" if isinstance(device, int) else str(device)
        counts[key] = counts.get(key, 0) + 1
    return "dispatched: " + ", ".join(f"{d} {n}" for d, n in counts.items())
