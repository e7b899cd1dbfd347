"""``load_model``: a causal LM and its tokenizer from any name kveval takes (:mod:`kveval.models`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from kveval.errors import KvevalError
from kveval.models.builtin import build_tiny_model, byte_tokenizer, smollm2_gguf
from kveval.models.cache import load_gguf
from kveval.models.checks import (
    check_finite_weights,
    check_model_folder,
    first_line,
    resolve_device,
    resolve_dtype,
)
from kveval.models.hub import hub_guard, is_connection_error
from kveval.models.placement import Placement, dispatch, pretrained_placement
from kveval.models.source import model_source


def load_model(
    name: str,
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
    seed: int = 0,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)``; the model is in eval mode, on ``device``, with ``requires_grad_(False)``.

    name: ``builtin:smollm2-135m`` | ``builtin:tiny-llama`` | ``builtin:tiny-gemma3`` | a hub id
        (``HuggingFaceTB/SmolLM2-135M``) | a local folder with ``config.json`` | a local ``.gguf`` file.
    device: ``cpu`` | ``cuda`` (``cuda:N``) | ``auto`` (cuda when available, else cpu).
    dtype: ``float32`` | ``float64`` | ``bfloat16`` | ``float16``; weights are cast after loading if needed.
    seed: only for the tiny random models (``torch.manual_seed(seed)`` before construction).
    device_map, max_memory: place the layers across devices with accelerate instead of ``device`` (big models;
        :class:`Placement`): checkpoints load straight onto their devices (``from_pretrained(device_map=...)``),
        models built in memory (the tiny ones) and float64 models (whose norms are made exact first) are loaded
        on the CPU and then dispatched (``accelerate.dispatch_model``). Layers on ``cpu`` or ``disk`` are brought
        to the compute device layer by layer by accelerate's hooks; ``disk`` layers go to a temporary folder
        under the kveval cache, removed when the process exits.

    The attention implementation is ``sdpa``; ``generation_config.pad_token_id`` is set when missing.
    ``model.kveval_name`` holds ``name``. Bad names, paths, devices or dtypes raise :class:`KvevalError`.
    """
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    placement = Placement.of(device_map, max_memory)
    name = str(name)
    source = model_source(name)
    if source.kind == "builtin" and source.key == "smollm2-135m":
        model, tok = load_gguf(smollm2_gguf(), torch_dtype, placement)
    elif source.kind == "builtin":
        model, tok = build_tiny_model(name, dtype=dtype, seed=seed), byte_tokenizer()
    elif source.kind == "gguf" and source.path is not None:
        model, tok = load_gguf(source.path, torch_dtype, placement)
    elif source.kind == "folder" and source.path is not None:
        model, tok = _load_folder(source.path, torch_dtype, trust_remote_code, placement)
    else:
        model, tok = _load_hub(name, torch_dtype, trust_remote_code, placement)
    return _finish(model, tok, name, dev, torch_dtype, placement)


@contextlib.contextmanager
def quiet_quantization_progress():
    """compressed-tensors draws a progress bar ("Applying quantization config") on stderr while transformers loads a
    checkpoint with a ``quantization_config``, whatever ``-q`` says, and before any one-line error that follows:
    its loop runs without one here. (Its module imports ``tqdm`` by name; nothing else of it changes.)"""
    try:
        from compressed_tensors.quantization.lifecycle import apply as ct_apply
    except ImportError:  # compressed-tensors is not installed (Python 3.10): there is no bar to hide
        yield
        return
    saved = getattr(ct_apply, "tqdm", None)
    ct_apply.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        ct_apply.tqdm = saved


def _load_folder(path: Path, dtype: torch.dtype, trust_remote_code: bool, placement: Placement | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_folder(path, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        with quiet_quantization_progress():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                         trust_remote_code=trust_remote_code, use_safetensors=True,
                                                         **pretrained_placement(placement, dtype))
    except KvevalError:
        raise
    except Exception as e:  # noqa: BLE001 - a folder's files meet transformers, safetensors and tokenizers, whose
        # errors for a broken file include plain Exception (the tokenizers binding): each is the folder's one line
        raise KvevalError(f"model folder '{path}' cannot be loaded: {first_line(e)}") from None
    return model, tok


def _load_hub(name: str, dtype: torch.dtype, trust_remote_code: bool, placement: Placement | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_guard() as offline:
        try:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            with quiet_quantization_progress():
                model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa",
                                                             trust_remote_code=trust_remote_code,
                                                             use_safetensors=True, **pretrained_placement(placement, dtype))
        except (OSError, ValueError) as e:  # hub errors are OSError subclasses; bad repo ids are ValueError
            if offline or is_connection_error(e):
                raise KvevalError(f"model {name!r} is not in the local HuggingFace cache and the hub cannot be "
                                  "reached; use builtin:smollm2-135m or a local directory") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KvevalError(f"model {name!r} could not be loaded from the HuggingFace hub: {first}") from None
    return model, tok


def _finish(model, tok, name: str, device: torch.device, dtype: torch.dtype, placement: Placement | None = None):
    """The loaded model made ready: finite weights (also after a narrowing cast), ``dtype``, exact float64 norms,
    on its device or placed, eval mode without gradients, sdpa attention, a pad token, ``model.kveval_name``."""
    loaded = next(model.parameters()).dtype
    dispatched = getattr(model, "hf_device_map", None) is not None  # placed by from_pretrained(device_map=...)
    if not getattr(model, "kveval_weights_finite", False):  # a verified cache entry was checked when built
        check_finite_weights(model, name)  # a broken model file
    if loaded != dtype and not dispatched:  # a dispatched model was loaded in dtype
        model.to(dtype)
        if loaded.is_floating_point and torch.finfo(dtype).max < torch.finfo(loaded).max:
            check_finite_weights(model, name, cast_from=loaded)  # a narrowing cast (to float16) that overflowed
    if dtype == torch.float64:  # float64 end to end: transformers' RMSNorm would compute in float32
        from kveval.models.exact_norms import make_norms_exact

        make_norms_exact(model)  # float64 models are dispatched after this (pretrained_placement)
    if placement is not None and not dispatched:
        dispatch(model, placement, dtype, name)
    elif not dispatched:
        model.to(device)
    model.eval().requires_grad_(False)
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        with contextlib.suppress(ValueError, ImportError, AttributeError, NotImplementedError):  # eager-only models
            model.set_attn_implementation("sdpa")
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            eos = gen.eos_token_id
            pad = eos[0] if isinstance(eos, list) and eos else eos
        gen.pad_token_id = pad
    model.kveval_name = name
    return model, tok
