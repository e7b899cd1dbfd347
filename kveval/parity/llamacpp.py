"""Parity with llama.cpp: kveval's ``llamacpp_*`` presets against the real library (llama-cpp-python) on the same
weights and token ids.

    rows = run("builtin:smollm2-135m", ["q8_0/q8_0", "f16/q4_0"], tokens=256, rotation=None)  # None: on and off

What runs:

- **The same weights.** The float32 HF model kveval loads is written to an F32 GGUF (``f32_gguf``) with the ``gguf``
  package, Q/K rows permuted as convert_hf_to_gguf.py's ``LlamaModel.permute`` does, once, under
  ``kveval.paths.cache_dir("llamacpp")``. Metadata and vocabulary come from the GGUF kveval loaded the model from
  (``builtin:smollm2-135m`` and ``*.gguf`` paths); other Llama models (a local folder, the tiny test models) get
  metadata from their config and a placeholder vocabulary (llama.cpp only sees ids here). Only the KV cache then
  differs: llama.cpp's f16 cache against kveval's float32 model differs by KLD ~6e-7 on the builtin model.
- **The same ids**: the first ``tokens`` ids of kveval's builtin corpus (``kveval.data.load_tokens``).
- **llama.cpp** (``LlamaCpp``): one context per cache type (``type_k``/``type_v``, flash attention on, which a
  quantized V requires; ``use_extra_bufts = False``: the repacked/AMX weight buffers crash on some x86 machines),
  and ONE ``llama_decode`` call over all ids (``n_batch = n_ubatch = n_ctx = tokens``) with logits for every
  position. llama.cpp writes the batch's K/V into the cache before attention, so every query reads the quantized
  K/V of itself and of the tokens before it. Rotation: ``LLAMA_ATTN_ROT_DISABLE=1`` is set in the environment
  before the context is created (and removed after); the ``attn_rot_k`` / ``attn_rot_v`` lines of llama.cpp's log
  are checked against what was asked (a RuntimeError otherwise).
- **kveval**: ``llamacpp_config(type_k, type_v, rotation)`` (``llamacpp_*`` presets for equal types) through
  ``kveval.patch.emulate`` over the same ids with ``prefill_len = 0``: with no residual window every token is
  quantized when stored and read quantized by every query, itself included, which is what the single llama.cpp
  batch does (the policies' ``prefill: quantized`` gives the same for any prompt length).
- The baselines: llama.cpp's f16 cache (``ref_fp``) and kveval's unquantized model (``kv_fp``).

What is left between the two (path noise, not the cache): float32 rounding order of every matmul (llama.cpp's
tinyBLAS/ggml kernels against torch), RoPE and RMSNorm evaluated differently, f16 K/V of llama.cpp's f16 cache sides
(kveval keeps them float32), the fp16 V accumulator of ggml's flash attention over an f16 V cache, and q8_1's
fp16 block sum for q4_1/q5_1 keys (see ``kveval.transforms.query_quant``).

Read the ratio with the depth in mind: quantization turns that noise into different codes (an element moved across
a rounding boundary shifts its layer's output by a quantization step, which re-draws every later layer's rounding),
so over many layers two exact implementations of one cache drift apart like two random draws of it. On SmolLM2's
30 layers (256 ids) kveval against itself with the embeddings perturbed by 1e-6 (``noise_floor=True``) differs by
0.2-1.1 times the quantization's own KLD, and llama.cpp against kveval by about as much (0.3-1.2); on its first 2
layers (``layers=2``) the floor is below 0.005 and llama.cpp against kveval measures 0.0000-0.007.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kveval.errors import KvevalError
from kveval.fileio import atomic_path
from kveval.gguf import PERMUTED_MODEL_TYPES, add_llama_metadata, write_llama_gguf
from kveval.parity import ParityRow, compare
from kveval.paths import cache_dir
from kveval.policy import KVPolicy
from kveval.policy.presets import LLAMACPP_SPECS, POLICY_PRESETS, llamacpp_config

SYSTEM = "llamacpp"
#: cache types (K/V) run by default: the formats' two ends, and each side alone
DEFAULT_TYPES = ["q8_0/q8_0", "q4_0/q4_0", "f16/q4_0", "q4_0/f16"]
DEFAULT_TOKENS = 256
ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"
_WRITER_VERSION = 1


# --------------------------------------------------------------------------------------------------- cache types
@dataclass(frozen=True)
class CacheType:
    """One llama.cpp cache configuration: ``-ctk type_k -ctv type_v``, rotation on (its default) or off."""

    type_k: str
    type_v: str
    rotation: bool = True

    @classmethod
    def parse(cls, text: str, rotation: bool = True) -> CacheType:
        """``q4_0`` (K and V), ``f16/q4_0`` (K/V); a ``:norot`` / ``:rot`` suffix overrides ``rotation``."""
        body, _, suffix = text.strip().partition(":")
        if suffix not in ("", "rot", "norot"):
            raise KvevalError(f"llamacpp cache type '{text}': the suffix must be ':rot' or ':norot'")
        k, _, v = body.partition("/")
        v = v or k
        for t in (k, v):
            if t not in LLAMACPP_SPECS:
                raise KvevalError(f"llamacpp cache type '{text}': unknown type '{t}' (known: {', '.join(LLAMACPP_SPECS)})")
        return cls(k, v, rotation if not suffix else suffix == "rot")

    @property
    def label(self) -> str:
        return f"{self.type_k}/{self.type_v}" + ("" if self.rotation else " norot")

    @property
    def preset(self) -> str:
        """The kveval preset (equal types) or the ``llamacpp_config(...)`` call that builds the policy."""
        if self.type_k == self.type_v:
            name = f"llamacpp_{self.type_k}" + ("" if self.rotation else "_norot")
            if name in POLICY_PRESETS:
                return name
        return f"llamacpp_config('{self.type_k}', '{self.type_v}'{'' if self.rotation else ', rotation=False'})"

    def policy(self, gguf_order: bool = True) -> KVPolicy:
        cfg = llamacpp_config(self.type_k, self.type_v, self.rotation, gguf_order=gguf_order)
        return KVPolicy.from_config(cfg, name=self.preset)


# --------------------------------------------------------------------------------------------------- the GGUF file
def _source_gguf(model_name: str) -> Path | None:
    """The GGUF file kveval loaded ``model_name`` from (its metadata and vocabulary are copied), or None."""
    if model_name == "builtin:smollm2-135m":
        from kveval.models import smollm2_gguf

        return smollm2_gguf()
    if model_name.lower().endswith(".gguf") and Path(model_name).expanduser().is_file():
        return Path(model_name).expanduser()
    return None


def _state_key(model) -> str:
    import hashlib

    h = hashlib.sha256(f"{_WRITER_VERSION}|{model.config.to_json_string()}".encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def truncate(model, layers: int):
    """``model`` cut to its first ``layers`` decoder layers, in place (config included); returns it."""
    inner = model.model
    if not 0 < layers <= len(inner.layers):
        raise KvevalError(f"layers must be in 1..{len(inner.layers)}; got {layers}")
    inner.layers = inner.layers[:layers]
    model.config.num_hidden_layers = layers
    for name in ("layer_types",):
        if isinstance(getattr(model.config, name, None), list):
            setattr(model.config, name, getattr(model.config, name)[:layers])
    return model


def f32_gguf(model, model_name: str) -> Path:
    """The F32 GGUF of ``model``'s weights (float32, Q/K permuted), written once under ``cache_dir("llamacpp")``.

    Llama-architecture models only (``model.config.model_type`` in ``kveval.gguf.PERMUTED_MODEL_TYPES``). A model
    truncated with ``truncate`` gets its own file (``block_count`` = its layers)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in PERMUTED_MODEL_TYPES:
        raise KvevalError(f"llamacpp parity writes Llama-architecture GGUF files; {model_name} is "
                          f"'{getattr(cfg, 'model_type', '?')}'")
    src = _source_gguf(model_name)
    if src is not None:
        from kveval.models import gguf_cache_path

        key = f"{gguf_cache_path(src).name}-L{cfg.num_hidden_layers}-w{_WRITER_VERSION}"
    else:
        key = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', model_name)[-60:]}-{_state_key(model)}"
    path = cache_dir("llamacpp") / f"{key}.f32.gguf"
    if path.is_file():
        return path
    with atomic_path(path, suffix=".gguf") as tmp:
        _write_gguf(model, tmp, src)
    return path


def _write_gguf(model, dest: Path, src: Path | None) -> None:
    """``model``'s weights as an F32 GGUF (:func:`kveval.gguf.write_llama_gguf`): the metadata and vocabulary of
    the GGUF file it was loaded from, else its config's and a placeholder byte-level vocabulary (only ids are
    fed)."""
    cfg = model.config

    def placeholder(writer) -> None:
        from kveval.models import bytes_to_unicode

        byte_chars = bytes_to_unicode()
        tokens = [byte_chars[i] if i < 256 else f"<id{i}>" for i in range(cfg.vocab_size)]
        add_llama_metadata(writer, cfg, tokens, merges=[f"{byte_chars[32]} {byte_chars[32]}"])

    try:
        write_llama_gguf(dest, model.state_dict(), cfg, metadata_from=src, metadata=placeholder)
    except KvevalError as exc:
        raise KvevalError(f"llamacpp parity: {exc}") from None


# --------------------------------------------------------------------------------------------------- llama.cpp
_LOG: list[str] = []
_LOG_CALLBACK: Any = None


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise KvevalError(f"llamacpp parity needs llama-cpp-python (pip install llama-cpp-python): {exc}") from None
    return llama_cpp


def llamacpp_version() -> str:
    """``llama-cpp-python X, ggml V, commit C`` of the installed library (``ggml_version``/``ggml_commit``)."""
    lc = _llama_cpp()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(lc.__file__), "lib", "libggml-base.so"))
    out = [f"llama-cpp-python {lc.__version__}"]
    for fn in ("ggml_version", "ggml_commit"):
        f = getattr(lib, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            out.append(f"{fn.removeprefix('ggml_')} {f().decode()}")
    return ", ".join(out)


class LlamaCpp:
    """One F32 GGUF loaded by llama.cpp (CPU; ``use_extra_bufts = False``) and its logits per cache type.
    ``head_dim``: the model's, to know when llama.cpp rotates (head_dim % 64 == 0; None: assume it does)."""

    def __init__(self, path: Path, threads: int | None = None, head_dim: int | None = None):
        self.head_dim = head_dim
        lc = _llama_cpp()
        self.lc = lc
        self._install_log()
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise KvevalError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads or max(1, min(4, len(os.sched_getaffinity(0))))
        self.types = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0,
                      "q4_1": lc.GGML_TYPE_Q4_1, "q5_0": lc.GGML_TYPE_Q5_0, "q5_1": lc.GGML_TYPE_Q5_1,
                      "iq4_nl": lc.GGML_TYPE_IQ4_NL}

    def _install_log(self) -> None:
        global _LOG_CALLBACK
        if _LOG_CALLBACK is None:
            @self.lc.llama_log_callback
            def _collect(level, text, user):  # pragma: no cover - called from C
                _LOG.append(text.decode(errors="replace"))

            _LOG_CALLBACK = _collect
        self.lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())

    def close(self) -> None:
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None
        logger = getattr(getattr(self.lc, "_logger", None), "llama_log_callback", None)
        if logger is not None:
            self.lc.llama_log_set(logger, ctypes.c_void_p())

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def logits(self, ids: torch.Tensor, ct: CacheType, check_rotation: bool = True) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of ids ``[T]`` in one ``llama_decode`` call with cache type ``ct``."""
        lc = self.lc
        T = int(ids.numel())
        params = lc.llama_context_default_params()
        params.n_ctx = T
        params.n_batch = params.n_ubatch = T
        params.n_seq_max = 1
        params.type_k, params.type_v = self.types[ct.type_k], self.types[ct.type_v]
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        old = os.environ.get(ROT_ENV)
        if ct.rotation:
            os.environ.pop(ROT_ENV, None)
        else:
            os.environ[ROT_ENV] = "1"
        _LOG.clear()
        try:
            ctx = lc.llama_init_from_model(self.model, params)
        finally:
            if old is None:
                os.environ.pop(ROT_ENV, None)
            else:
                os.environ[ROT_ENV] = old
        if not ctx:
            raise KvevalError(f"llama.cpp refused the context for {ct.label}: {''.join(_LOG)[-500:]}")
        try:
            if check_rotation:
                self._check_rotation(ct)
            batch = lc.llama_batch_init(T, 0, 1)
            try:
                for i, tok in enumerate(ids.tolist()):
                    batch.token[i] = tok
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1
                batch.n_tokens = T
                rc = lc.llama_decode(ctx, batch)
                if rc != 0:
                    raise KvevalError(f"llama_decode failed ({rc}) for {ct.label}")
                out = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(T * self.n_vocab,))
                return torch.from_numpy(out.reshape(T, self.n_vocab).copy())
            finally:
                lc.llama_batch_free(batch)
        finally:
            lc.llama_free(ctx)

    def _check_rotation(self, ct: CacheType) -> None:
        """The ``attn_rot_k`` / ``attn_rot_v`` that llama.cpp logged must be what ``ct`` asks for."""
        check_rotation_log("".join(_LOG), ct, self.head_dim)


def check_rotation_log(log: str, ct: CacheType, head_dim: int | None) -> None:
    """The ``attn_rot_k`` / ``attn_rot_v`` lines of llama.cpp's log (``src/llama-kv-cache.cpp``) must be what ``ct``
    asks for (RuntimeError otherwise); llama.cpp rotates a quantized side when ``head_dim % 64 == 0`` (None: assume
    it does)."""
    for side, t in (("k", ct.type_k), ("v", ct.type_v)):
        m = re.search(rf"attn_rot_{side} = (\d)", log)
        quantized = t not in ("f16", "f32")
        if m is None:
            if ct.rotation and quantized:
                raise RuntimeError("llama.cpp logged no attention rotation state; this build predates the "
                                   "rotation (PR #21038): compare against the *_norot presets instead")
            continue
        want = ct.rotation and quantized and (head_dim is None or head_dim % 64 == 0)
        if bool(int(m.group(1))) != want:
            raise RuntimeError(f"llama.cpp reports attn_rot_{side} = {m.group(1)} for {ct.label}; expected "
                               f"{int(want)} ({ROT_ENV} not taking effect, or head_dim % 64 != 0)")


# --------------------------------------------------------------------------------------------------- the run
def _types(types: list[str] | None, rotation: bool | None) -> list[CacheType]:
    rots = [True, False] if rotation is None else [rotation]
    out = []
    for text in types or DEFAULT_TYPES:
        if ":" in text:
            out.append(CacheType.parse(text))
        else:
            out.extend(CacheType.parse(text, r) for r in rots)
    return out


@torch.no_grad()
def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int = DEFAULT_TOKENS,
        rotation: bool | None = True, layers: int | None = None, threads: int | None = None,
        noise_floor: bool = False, timings: dict[str, float] | None = None) -> list[ParityRow]:
    """Per cache type: llama.cpp's logits against kveval's preset on the first ``tokens`` ids of the builtin
    corpus (see the module docstring). ``types``: ``"K/V"`` or ``"T"`` strings (default ``DEFAULT_TYPES``), each
    run with ``rotation`` (None: on and off; a ``:rot``/``:norot`` suffix decides for that type). ``layers``: keep
    only the first N decoder layers (in both systems). ``noise_floor``: also measure kveval against itself with the
    embeddings perturbed by a relative 1e-6 (``notes``): how much KLD float32 path noise alone can cause through
    the quantizer's rounding boundaries. ``timings``: filled with wall seconds per step when given. The model is
    evaluated in float32."""
    from kveval.data import load_tokens
    from kveval.models import load_model

    clock = time.perf_counter()
    model, tok = load_model(model_name, dtype="float32")
    if layers is not None:
        truncate(model, layers)
    ids = load_tokens("builtin", tok, max_tokens=tokens)
    stamp = {"load": time.perf_counter() - clock}
    rows = run_model(model, model_name, ids, _types(types, rotation), threads=threads, noise_floor=noise_floor,
                     timings=stamp)
    if timings is not None:
        timings.update(stamp)
        timings["total"] = time.perf_counter() - clock
    return rows


@torch.no_grad()
def run_model(model, model_name: str, ids: torch.Tensor, cache_types: list[CacheType], *,
              policies: dict[str, KVPolicy] | None = None, threads: int | None = None,
              noise_floor: bool = False, timings: dict[str, float] | None = None) -> list[ParityRow]:
    """``run`` on a loaded float32 Llama model and ids ``[T]``: one row per cache type. ``policies`` (label ->
    policy) replaces the preset of some cache types (to measure what a variant of a preset changes)."""
    from kveval.patch import emulate

    if ids.numel() < 2:
        raise KvevalError(f"llamacpp parity needs at least 2 tokens; got {ids.numel()}")
    stamp = timings if timings is not None else {}
    t0 = time.perf_counter()
    path = f32_gguf(model, model_name)
    stamp["gguf"] = time.perf_counter() - t0
    version = llamacpp_version()
    rows: list[ParityRow] = []
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with LlamaCpp(path, threads, head_dim=head_dim) as lc:
        t0 = time.perf_counter()
        ref_fp = lc.logits(ids, CacheType("f16", "f16"))
        kv_fp = model(ids[None]).logits[0].float()
        stamp["baseline"] = time.perf_counter() - t0
        for ct in cache_types:
            t0 = time.perf_counter()
            ref = lc.logits(ids, ct)
            t1 = time.perf_counter()
            policy = (policies or {}).get(ct.label) or ct.policy()
            with emulate(model, policy):
                kv = model(ids[None]).logits[0].float()
            t2 = time.perf_counter()
            notes = (f"{version}; {ids.numel()} ids in one llama_decode, flash attention, "
                     f"llama.cpp {t1 - t0:.2f} s, kveval {t2 - t1:.2f} s")
            row = compare(SYSTEM, ct.label, policy.name, ids, ref_fp=ref_fp, ref=ref, kv_fp=kv_fp, kv=kv)
            if noise_floor:
                floor = self_noise(model, ids, policy, kv)
                notes += f"; noise floor KLD {floor:.3g} (ratio {floor / row.ref_kld if row.ref_kld else math.inf:.3f})"
            row.notes = notes
            rows.append(row)
            stamp[ct.label] = time.perf_counter() - t0
    return rows


@torch.no_grad()
def self_noise(model, ids: torch.Tensor, policy: KVPolicy, logits: torch.Tensor, rel: float = 1e-6,
               seed: int = 1) -> float:
    """Mean KL(P ‖ P') between kveval's logits ``logits`` ``[T, vocab]`` under ``policy`` and the same run with the
    input embeddings multiplied by ``1 + rel * N(0, 1)`` (restored afterwards): the part of ``kld_between`` that
    float32 path noise alone produces once quantization rounds it into different codes. Near 0 for a few layers;
    at SmolLM2's 30 layers it is of the order of the quantization's own KLD."""
    from kveval.patch import emulate
    from kveval.stats import compare_logits

    emb = model.get_input_embeddings().weight
    saved = emb.detach().clone()
    g = torch.Generator().manual_seed(seed)
    try:
        emb.data.mul_(1 + rel * torch.randn(emb.shape, generator=g, dtype=emb.dtype))
        with emulate(model, policy):
            other = model(ids[None]).logits[0].float()
    finally:
        emb.data.copy_(saved)
    return float(compare_logits(logits[:-1], other[:-1], ids[1:])["kld"].mean())
