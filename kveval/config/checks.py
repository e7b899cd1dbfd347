"""The config's inputs on this machine: what a run would refuse later, refused before the first forward pass
(``kveval validate`` and ``kveval run`` both call :func:`check_inputs`), without loading a model.

The model, its device and placement, windows that fit the model's context and weight variants that tile its
projections (when its shape is known without loading it), folders and files to write
(:func:`check_writable_path`), the corpus, scales files, the ``plan:`` file (:mod:`kveval.policy.plan_file`), and
each task's own checks (its parameter module's ``check_inputs`` hook, through :data:`kveval.tasks.TASKS`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kveval.errors import KvevalError
from kveval.policy import AUTO_SCALES

if TYPE_CHECKING:
    from kveval.config.schema import ExperimentConfig

_NAMED_CORPORA = ("builtin", "wikitext2", "pg19")
_MAX_COMPONENT = 240  # bytes of one path component: NAME_MAX (255) less room for atomic writes' temporary names


def check_inputs(cfg: ExperimentConfig, source: str = "config") -> None:
    """What the config names on this machine, checked without loading a model (``kveval validate`` and ``kveval
    run`` both call it, before anything is written).

    The model name (a builtin, an existing local folder whose config parses, with safetensors weights and no code
    it would need, a GGUF file), a CUDA device that exists, an output folder that can be created (not a file, no
    file in its way, writable, names not too long), ``calibration.output`` likewise, the cache root
    (``KVEVAL_CACHE``) a folder, a local corpus file that reads as non-empty UTF-8 text with string text fields, a named HF corpus and a hub
    model that can be loaded here (cached when the hub cannot be reached),
    each task's own inputs (its ``check_inputs`` hook, e.g. a folder of task definitions that exists and holds no
    code unless ``allow_code``), ``scales:`` files and the ``plan:`` file that are what they claim to be. Errors
    are one KvevalError line starting with ``source``."""
    from kveval.models import check_model_source
    from kveval.paths import check_cache_root

    try:
        check_model_source(cfg.model.name, cfg.model.trust_remote_code)
        _check_windows_fit(cfg)
        _check_weight_widths(cfg)
        _check_policies_fit(cfg)
        from kveval.weights.spec import check_variant_files

        check_variant_files(cfg.model.weight_variants())
        if cfg.model.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise KvevalError("model.device: cuda requested but CUDA is not available; use device: cpu or auto")
        if cfg.model.device_map is not None:
            from kveval.models import check_placement_devices

            check_placement_devices(cfg.model.device_map, cfg.model.max_memory)
        check_writable_path(cfg.output_dir(), "output", folder=True)
        if cfg.calibration.output:
            check_writable_path(Path(cfg.calibration.output), "calibration.output", folder=False)
        check_cache_root()
        from kveval.data import check_corpus_available, load_text

        if cfg.data.source not in _NAMED_CORPORA:
            load_text(cfg.data.source, split=cfg.data.split, text_field=cfg.data.text_field)
        else:
            check_corpus_available(cfg.data.source)
        from kveval.tasks import TASKS

        for entry in cfg.tasks:  # each task's own checks: its parameter module's check_inputs hook, if any
            TASKS.check_inputs(entry.kind, entry.params, allow_code=cfg.allow_code)
        from kveval.scales.checkpoint import CHECKPOINT_SCALES, checkpoint_targets

        checkpoint_targets(cfg.model.name, cfg.kv.policies, cfg.policies())  # checkpoint KV scales, as engines load
        for name, policy in cfg.policies().items():
            if policy.needs_scales_file() and policy.scales not in (AUTO_SCALES, CHECKPOINT_SCALES):
                from kveval.scales.file import load_scales

                try:
                    load_scales(str(policy.scales))
                except KvevalError as exc:
                    raise KvevalError(f"policy '{name}': {exc}") from None
        if cfg.plan is not None:
            from kveval.policy.plan_file import read_plan_file

            read_plan_file(cfg.plan)
    except KvevalError as exc:
        raise KvevalError(f"{source}: {exc}") from None


def input_files(cfg: ExperimentConfig) -> dict[str, str]:
    """``{label: path}`` of the files a run of ``cfg`` reads its inputs from, whose digests its run folder records
    (:func:`kveval.results.store.input_digests`) so that a resume on an input edited in place is refused: a local
    corpus file (``data``), the ``plan:`` file, and each task's input files, which its parameters declare (an
    ``input_files()`` method returning ``{field: path}``, e.g. the generation task's prompt file; label
    ``tasks[i].KIND.FIELD``). Scales and GGUF weight files are recorded apart (``scales_used.json``)."""
    files: dict[str, str] = {}
    if cfg.data.source not in _NAMED_CORPORA and Path(cfg.data.source).expanduser().is_file():
        files["data"] = str(Path(cfg.data.source).expanduser())
    if cfg.plan is not None:
        files["plan"] = str(cfg.plan)
    for i, entry in enumerate(cfg.tasks):
        declared = getattr(entry.params, "input_files", None)
        for field, path in (declared() if callable(declared) else {}).items():
            files[f"tasks[{i}].{entry.kind}.{field}"] = str(path)
    return files


def _check_windows_fit(cfg: ExperimentConfig) -> None:
    """Task windows longer than the model's context, when the context is known without loading the model (the
    tasks' own checks say the same at run time, for every model): a task's ``context_needed`` (tokens, the
    fields that add up to them) when its parameters compute one, else its ``context_lengths`` or ``seq_len``."""
    from kveval.models import context_limit_of

    limit = context_limit_of(cfg.model.name)
    if limit is None:
        return
    for i, entry in enumerate(cfg.tasks):
        p = entry.params
        needed = getattr(p, "context_needed", None)  # a length computed from several fields, and their names
        if isinstance(needed, tuple):
            if needed[0] > limit:
                raise KvevalError(f"tasks[{i}].{entry.kind}: {needed[1]} = {needed[0]} tokens is longer than the "
                                  f"model's context ({limit} tokens); lower it")
            continue
        field = "context_lengths" if hasattr(p, "context_lengths") else "seq_len"
        longest = max(getattr(p, field)) if field == "context_lengths" else getattr(p, field, None)
        if isinstance(longest, int) and longest > limit:
            raise KvevalError(f"tasks[{i}].{entry.kind}.{field} {longest} is longer than the model's context "
                              f"({limit} tokens); lower it")


#: The builtin checkpoint's shape, known without reading its GGUF file (kveval validate's weight checks)
_SMOLLM2_DIMS = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "head_dim": 64}


def _model_dims(name: str) -> dict | None:
    """The model's config dict when it is known without loading the model: builtins and local folders with a
    config.json; None otherwise (hub ids, GGUF files: the run checks the loaded matrices)."""
    import json

    if name == "builtin:smollm2-135m":
        return _SMOLLM2_DIMS
    from kveval.models.builtin import TINY_FAMILIES

    if name.removeprefix("builtin:") in TINY_FAMILIES and name.startswith("builtin:"):
        from kveval.models import tiny_model_config

        return tiny_model_config(name).to_dict()
    path = Path(name).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _known_arch(name: str):
    """The model's shape when it is known without loading the model (the builtins, a local folder's config.json, a
    hub id whose config.json is in the local cache); None otherwise (a GGUF file: the run checks the loaded model)."""
    from kveval.memory import Arch

    if name == "builtin:smollm2-135m":
        return Arch.named("smollm2-135m")
    data = _model_dims(name)
    if data is None and "/" in name and not name.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json")
        except ValueError:
            cached = None
        data = _model_dims(str(Path(cached).parent)) if isinstance(cached, str) else None
    if data is None:
        return None
    try:
        return Arch.from_model_config(data, name=name)
    except KvevalError:  # a raw config.json in another vocabulary (GPT-2's n_layer): the run checks the loaded model
        return None


def _check_policies_fit(cfg: ExperimentConfig) -> None:
    """Each policy laid out on the model and on its attention design, as the run's patching checks them
    (:func:`kveval.memory.fit.check_policy` and :func:`~kveval.memory.fit.check_design`: group sizes that divide
    head_dim, or an MLA model's latent and RoPE widths; a preset written for another design), when the model's
    shape is known without loading it."""
    arch = _known_arch(cfg.model.name)
    if arch is None:
        return
    from kveval.memory.fit import check_design, check_policy

    for policy in cfg.policies().values():
        check_design(arch, policy)  # first: a preset of another design is named as such, not by its widths
        check_policy(arch, policy)


def _check_weight_widths(cfg: ExperimentConfig) -> None:
    """Weight variants whose group size cannot tile the model's projections, when the model's widths are known
    without loading it (the run checks every loaded matrix again, for every model)."""
    if not cfg.model.weights:
        return
    from kveval.weights.spec import check_widths, widths_from_config

    widths = widths_from_config(_model_dims(cfg.model.name))
    if widths is not None:
        check_widths(cfg.model.weight_variants(), widths, cfg.model.name)


def _can_create_in(folder: Path) -> bool:
    """Whether a folder can really be made in ``folder`` (made and removed at once): ``os.access`` says yes to root
    on a read-only file system or a folder the kernel will not write (``/proc``, ``/sys``)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kveval-probe-", dir=folder))
    except OSError:
        return False
    return True


def check_writable_path(path: Path, what: str, *, folder: bool) -> None:
    """KvevalError unless ``path`` (a folder with ``folder``, else a file) could be created or written here:
    nothing of the other kind in its place, no file among its parents, the nearest existing folder writable,
    every name at most ``_MAX_COMPONENT`` bytes. Creates nothing."""
    for part in path.parts:
        if len(os.fsencode(part)) > _MAX_COMPONENT:
            raise KvevalError(f"{what} '{path}': the name '{part[:40]}...' is longer than the file system allows "
                              f"({_MAX_COMPONENT} bytes); shorten it")
    if len(os.fsencode(str(path.absolute()))) > 3800:
        raise KvevalError(f"{what} '{path}': the path is longer than the file system allows; shorten it")
    if path.exists():
        if folder and not path.is_dir():
            raise KvevalError(f"{what} '{path}' is a file, not a folder; choose another output")
        if not folder and path.is_dir():
            raise KvevalError(f"{what} '{path}' is a folder, not a file")
        if not folder and not path.is_file():  # /dev/null, a pipe: an atomic write would replace it
            raise KvevalError(f"{what} '{path}' is not a regular file; give the path of a file to write")
        target = path if path.is_dir() else path.parent
    else:
        target = path.absolute().parent
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise KvevalError(f"{what} '{path}': '{target}' is a file, so no folder can be made under it")
    if not os.access(target, os.W_OK | os.X_OK) or not _can_create_in(target):
        raise KvevalError(f"{what} '{path}': '{target}' is not writable (permission denied or a read-only file "
                          "system); choose another output")
