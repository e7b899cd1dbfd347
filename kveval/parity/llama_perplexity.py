"""Parity with llama.cpp's own ``llama-perplexity --kl-divergence``: kveval's ``llamacpp_*`` presets against the
real tool on the same token chunks, every statistic the tool prints side by side (``kveval parity llamacpp --tool
perplexity``).

    rows = run("builtin:smollm2-135m", ["q8_0", "q4_0"], tokens=2048, ctx=512)

What runs:

- **The tool**: ``llama-perplexity`` built from the vendored llama.cpp of the pinned llama-cpp-python sdist
  (``scripts/build_llama_perplexity.sh``, which the set-up runs; cached under ``kveval.paths.cache_root()`` /
  ``llama.cpp/<commit>-<arch>-<cpu>``; ``$KVEVAL_LLAMA_PERPLEXITY`` names another binary), on kveval's F32 GGUF
  of the model's own weights (:func:`kveval.parity.llamacpp.f32_gguf`), CPU, ``-c N -b N -ub N`` (one chunk per
  decode call), ``-ctk T -ctv T -fa on``, ``LLAMA_ATTN_ROT_DISABLE=1`` for a ``:norot`` type (the ``attn_rot_*``
  lines of its log, ``-lv 4``, are checked against what was asked).
- **The same chunks and the same base**: llama-perplexity takes its token ids and the base distribution from a
  ``--kl-divergence-base`` file (:mod:`kveval.parity.kld_base`) and never tokenizes in that mode. kveval writes that
  file from its own full-precision model on consecutive ``ctx``-token chunks of the builtin corpus (or reads the
  one given: a base a user saved with ``llama-perplexity --kl-divergence-base FILE``), so both systems score
  exactly those ids against exactly that 16-bit-coded base distribution. llama-perplexity scores the second half of
  every chunk (positions ``ctx // 2 + 1 .. ctx - 1``; kveval's perplexity task scores every token of its windows);
  here kveval scores the same tokens, with llama.cpp's own formulas in its float32 arithmetic
  (:func:`kveval.parity.kld_base.token_stats`) and its summary (:func:`kveval.stats.llama_perplexity_stats`).
  Where the GGUF adds BOS (``tokenizer.ggml.add_bos_token``) both replace each chunk's first token by BOS, as the
  tool does.
- **kveval**: the preset (``CacheType.policy``) through ``kveval.patch.emulate`` on each chunk, every token
  quantized when stored and read quantized (``prefill_len = 0``), as the tool's one decode call per chunk does.
- A ``f32/f32`` row (``floor``): the tool with an F32 cache and kveval's unquantized model against the same base:
  what the two implementations and the base's 16-bit coding leave when nothing is quantized.

``types`` may also name kveval policy presets that are no llama.cpp cache type (``int4_g64``): kveval alone, scored
the same way against the base, so that a user's llama.cpp base logits score any kveval policy.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kveval.errors import KvevalError
from kveval.parity import kld_base
from kveval.parity.llamacpp import ROT_ENV, CacheType, check_rotation_log, f32_gguf, truncate
from kveval.paths import cache_root
from kveval.policy import KVPolicy
from kveval.policy.presets import LLAMACPP_SPECS, POLICY_PRESETS
from kveval.stats import LLAMA_STATS, add_llama_sums, llama_perplexity_stats, llama_sums

SYSTEM = "llamacpp"
TOOL = "llama-perplexity"
TOOL_ENV = "KVEVAL_LLAMA_PERPLEXITY"
#: the llama.cpp that llama-cpp-python 0.3.36 vendors (scripts/build_llama_perplexity.sh builds it)
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
BUILD_SCRIPT = "scripts/build_llama_perplexity.sh"
DEFAULT_TYPES = ["q8_0", "q4_0"]
DEFAULT_CTX = 512
DEFAULT_TOKENS = 4 * DEFAULT_CTX


# --------------------------------------------------------------------------------------------------- the tool
def _cpu_key() -> str:
    """The first 8 hex digits of the sha256 of the CPU's feature flags, sorted and joined (the build script's key:
    ggml is built for the building CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    flags = "".join(sorted(line.split(":", 1)[1].strip("\n").split(" "))) if ":" in line else ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def cached_tool() -> Path:
    """Where the build script puts llama-perplexity for this llama.cpp commit and CPU."""
    return (cache_root() / "llama.cpp" / f"{LLAMA_CPP_COMMIT[:12]}-{platform.machine()}-{_cpu_key()}" / "bin" / TOOL)


def _build_script() -> Path:
    return Path(__file__).resolve().parents[2] / BUILD_SCRIPT


def find_tool(build: bool = False) -> Path:
    """The llama-perplexity binary: ``$KVEVAL_LLAMA_PERPLEXITY``, else the cached build (:func:`cached_tool`); with
    ``build``, the build script runs when there is none (minutes). One KvevalError line when none is found."""
    named = os.environ.get(TOOL_ENV)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise KvevalError(f"{TOOL_ENV}={named}: not an executable file")
        return path
    path = cached_tool()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    script = _build_script()
    if build and script.is_file():
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        if proc.returncode == 0 and path.is_file():
            return path
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise KvevalError(f"building {TOOL} failed ({tail[0]}); see bash {script}")
    raise KvevalError(f"{TOOL} is not built for this machine ({path}): run bash {script} (make setup does), or set "
                      f"{TOOL_ENV} to a {TOOL} of llama.cpp {LLAMA_CPP_COMMIT[:7]}")


def tool_version(tool: Path) -> str:
    """``version: ... (build N, commit C)`` as the tool prints it (one line)."""
    proc = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.startswith("version:")]
    return lines[0] if lines else "version unknown"


_LABELS = {label: key for key, label, _ in LLAMA_STATS}


def parse_summary(stdout: str) -> dict:
    """The statistics block llama-perplexity prints on stdout after a KL pass -> ``{key: value, key_unc: ...}``
    with the keys of :data:`kveval.stats.LLAMA_STATS` (Δp and same top p in percent, as printed; nan/inf as None).
    KvevalError when the block is missing (the tool prints it only for at least 100 scored tokens)."""
    out: dict = {}
    for line in stdout.splitlines():
        label, sep, rest = line.rstrip().rpartition(": ")  # the values hold no ": "; a label may hold ", "
        key = _LABELS.get(" ".join(label.split())) if sep else None
        if key is None:
            continue
        value, _, unc = rest.replace("%", "").partition("±")
        out[key] = _number(value)
        if unc.strip():
            out[f"{key}_unc"] = _number(unc)
    if "kld_mean" not in out:
        raise KvevalError(f"{TOOL} printed no KL divergence statistics (it prints them for at least 100 scored "
                          "tokens: use more or longer chunks)")
    return out


def _number(text: str) -> float | None:
    try:
        v = float(text.strip())
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def tool_command(tool: Path, gguf: Path, base: Path, n_ctx: int, ct: CacheType, threads: int) -> list[str]:
    return [str(tool), "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence", "-c", str(n_ctx),
            "-b", str(n_ctx), "-ub", str(n_ctx), "-ctk", ct.type_k, "-ctv", ct.type_v, "-fa", "on",
            "-t", str(threads), "--no-warmup", "-lv", "4"]


def run_tool(tool: Path, gguf: Path, base: Path, n_ctx: int, ct: CacheType, threads: int,
             head_dim: int | None) -> tuple[dict, str]:
    """One KL pass of the tool; returns (its statistics, the command as a shell line)."""
    cmd = tool_command(tool, gguf, base, n_ctx, ct, threads)
    env = {k: v for k, v in os.environ.items() if k != ROT_ENV}
    if not ct.rotation:
        env[ROT_ENV] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = (f"{ROT_ENV}=1 " if not ct.rotation else "") + shlex.join(cmd)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        raise KvevalError(f"{TOOL} failed for {ct.label} (exit {proc.returncode}): {tail[0][-300:]}")
    check_rotation_log(proc.stderr, ct, head_dim)
    return parse_summary(proc.stdout), line


# --------------------------------------------------------------------------------------------------- the rows
@dataclass
class ToolRow:
    """One cache type (or kveval policy): llama-perplexity's statistics and kveval's, on the same scored tokens
    against the same base (``system`` None for a kveval-only policy)."""

    cache_type: str
    preset: str
    tokens: int
    system: dict | None
    kveval: dict
    command: str = ""
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def kld_ratio(self) -> float | None:
        """kveval's mean KLD / the tool's (1: the same)."""
        if not self.system or not self.system.get("kld_mean") or self.kveval.get("kld_mean") is None:
            return None
        return self.kveval["kld_mean"] / self.system["kld_mean"]

    def to_dict(self) -> dict:
        return {**asdict(self), "kld_ratio": self.kld_ratio}


class _Tokens:
    """Per-token values of some chunks (:func:`kveval.parity.kld_base.token_stats`), added up into the tool's
    statistics."""

    def __init__(self) -> None:
        self.sums: list[dict] = []
        self.kld: list[np.ndarray] = []
        self.p_diff: list[np.ndarray] = []

    def add(self, v: dict[str, np.ndarray]) -> None:
        self.sums.append(llama_sums(v["nll"], v["nll_base"], v["kld"], v["p_diff"], v["same_top"]))
        self.kld.append(v["kld"].astype(np.float32))
        self.p_diff.append(v["p_diff"].astype(np.float32))

    def stats(self) -> dict:
        return llama_perplexity_stats(add_llama_sums(self.sums), np.concatenate(self.kld), np.concatenate(self.p_diff))


def _gguf_bos(path: Path) -> int | None:
    """The BOS id when the GGUF's vocabulary adds BOS (llama-perplexity then puts it at every chunk's start), else
    None; KvevalError when the file does not say (llama.cpp would decide by its pre-tokenizer)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str):
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]][0]

    add = value("tokenizer.ggml.add_bos_token")
    if add is None:
        raise KvevalError(f"{path.name} does not say whether its vocabulary adds BOS (tokenizer.ggml.add_bos_token); "
                          f"{TOOL} would decide by its pre-tokenizer")
    return int(value("tokenizer.ggml.bos_token_id")) if bool(add) else None


def _parse_types(types: list[str] | None, rotation: bool | None) -> list[CacheType | str]:
    """Cache types (``q4_0``, ``f16/q4_0``, ``q4_0:norot``) and kveval presets that are no cache type."""
    out: list[CacheType | str] = []
    rots = [True, False] if rotation is None else [rotation]
    for text in types or DEFAULT_TYPES:
        body = text.partition(":")[0]
        if all(t in LLAMACPP_SPECS for t in body.split("/")):
            out.extend([CacheType.parse(text)] if ":" in text else [CacheType.parse(text, r) for r in rots])
        elif text in POLICY_PRESETS:
            out.append(text)
        else:
            CacheType.parse(text)  # the one-line error naming the known types
    return out


@torch.no_grad()
def run(model_name: str = "builtin:smollm2-135m", types: list[str] | None = None, tokens: int | None = None,
        ctx: int | None = None, kl_divergence_base: str | None = None, rotation: bool | None = True,
        layers: int | None = None, threads: int | None = None, floor: bool = True,
        timings: dict[str, float] | None = None) -> list[ToolRow]:
    """Per cache type: llama-perplexity's statistics beside kveval's preset's on the same chunks (module
    docstring). ``tokens``: how many ids of the builtin corpus (``tokens // ctx`` chunks of ``ctx``; default
    ``DEFAULT_TOKENS`` in chunks of ``DEFAULT_CTX``); with ``kl_divergence_base`` the file's chunks (the first
    ``tokens // n_ctx`` of them when ``tokens`` is given). ``rotation``: as in :func:`kveval.parity.llamacpp.run`.
    ``layers``: only the first N decoder layers (both systems). ``floor``: add the ``f32/f32`` row."""
    from kveval.models import load_model, model_config
    from kveval.patch import emulate

    clock = time.perf_counter()
    stamp = timings if timings is not None else {}
    kinds = _parse_types(types, rotation)
    # every input is checked before the model loads: the base file (against the model's vocabulary), the chunks
    given = None
    if kl_divergence_base:
        given = kld_base.BaseFile(kl_divergence_base, n_vocab=int(model_config(model_name).vocab_size))
    if given is not None and ctx is not None and ctx != given.n_ctx:
        raise KvevalError(f"--ctx {ctx}: the base file's chunks are {given.n_ctx} tokens; drop --ctx")
    n_ctx = given.n_ctx if given is not None else (ctx or DEFAULT_CTX)
    if n_ctx < 4:
        raise KvevalError(f"--ctx must be at least 4 tokens; got {n_ctx}")
    needs_tool = floor or any(isinstance(k, CacheType) for k in kinds)
    tool = find_tool() if needs_tool else None
    model, tok = load_model(model_name, dtype="float32")
    if layers is not None:
        truncate(model, layers)
    vocab = int(model.config.vocab_size)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    threads = threads or max(1, min(4, len(os.sched_getaffinity(0))))
    if given is not None:
        n_chunk = given.n_chunk if tokens is None else min(given.n_chunk, tokens // n_ctx)
        chunks = np.array(given.tokens[:n_chunk])
    else:
        from kveval.data import load_tokens

        n_chunk = (tokens or DEFAULT_TOKENS) // n_ctx
        if n_chunk >= 1:
            ids = load_tokens("builtin", tok, max_tokens=n_chunk * n_ctx)
            n_chunk = min(n_chunk, ids.numel() // n_ctx)
            chunks = ids[:n_chunk * n_ctx].reshape(n_chunk, n_ctx).numpy()
    if n_chunk < 1:
        raise KvevalError(f"--tokens must give at least one chunk of {n_ctx} tokens")
    gguf = f32_gguf(model, model_name)
    bos = _gguf_bos(gguf)
    first, n_rows = kld_base.first_scored(n_ctx), kld_base.rows_per_chunk(n_ctx)

    def inputs(c: int) -> torch.Tensor:
        x = torch.as_tensor(chunks[c], dtype=torch.long).clone()
        if bos is not None:
            x[0] = bos
        return x

    def targets(c: int) -> np.ndarray:
        return np.asarray(chunks[c][first + 1:], dtype=np.int64)

    def logits(c: int, policy: KVPolicy | None) -> np.ndarray:
        x = inputs(c)[None]
        if policy is None:
            return model(x).logits[0, first:n_ctx - 1].float().numpy()
        with emulate(model, policy):
            return model(x).logits[0, first:n_ctx - 1].float().numpy()

    fp_side = _Tokens()
    rows_of: list[np.ndarray] = []
    stamp["load"] = time.perf_counter() - clock
    with tempfile.TemporaryDirectory(prefix="kveval-kld-") as tmp:
        t0 = time.perf_counter()
        base_path = Path(tmp) / "base.kld"
        if given is None:
            def kveval_rows() -> Iterator[np.ndarray]:
                for c in range(n_chunk):
                    fp = logits(c, None)
                    rows = kld_base.encode_rows(fp)
                    fp_side.add(kld_base.token_stats(fp, rows, targets(c)))
                    rows_of.append(rows)
                    yield rows

            kld_base.write_base(base_path, n_ctx, vocab, chunks, kveval_rows())
            origin = f"kveval's float32 model ({model_name}), written for this run"
        else:
            rows_of = [given.rows(c) for c in range(n_chunk)]
            if n_chunk == given.n_chunk:
                base_path = given.path
            else:
                kld_base.write_base(base_path, n_ctx, vocab, chunks, iter(rows_of))
            for c in range(n_chunk):
                fp_side.add(kld_base.token_stats(logits(c, None), rows_of[c], targets(c)))
            origin = f"{given.path} (its first {n_chunk} of {given.n_chunk} chunks)"
        stamp["base"] = time.perf_counter() - t0
        version = tool_version(tool) if tool else ""
        common = f"{n_chunk} chunks of {n_ctx} tokens, {n_chunk * n_rows} scored; base: {origin}"
        rows: list[ToolRow] = []
        if floor:
            t0 = time.perf_counter()
            ref, line = run_tool(tool, gguf, base_path, n_ctx, CacheType("f32", "f32"), threads, head_dim)
            rows.append(ToolRow("f32/f32", "none (full precision)", n_chunk * n_rows, ref, fp_side.stats(), line,
                                f"{version}; {common}; what is left when nothing is quantized"))
            stamp["f32/f32"] = time.perf_counter() - t0
        for kind in kinds:
            t0 = time.perf_counter()
            policy = kind.policy() if isinstance(kind, CacheType) else KVPolicy.preset(kind)
            side = _Tokens()
            for c in range(n_chunk):
                side.add(kld_base.token_stats(logits(c, policy), rows_of[c], targets(c)))
            t1 = time.perf_counter()
            if isinstance(kind, CacheType):
                ref, line = run_tool(tool, gguf, base_path, n_ctx, kind, threads, head_dim)
                label, notes = kind.label, f"{version}; {common}; kveval {t1 - t0:.1f} s, {TOOL} " \
                                           f"{time.perf_counter() - t1:.1f} s"
            else:
                ref, line, label, notes = None, "", kind, f"kveval only; {common}"
            rows.append(ToolRow(label, policy.name or str(kind), n_chunk * n_rows, ref, side.stats(), line, notes))
            stamp[label] = time.perf_counter() - t0
    stamp["total"] = time.perf_counter() - clock
    return rows


def summary_rows(rows: list[ToolRow]) -> list[dict]:
    """The headline figures of each row, tool beside kveval (what ``parity.md`` tabulates first)."""
    keys = ("kld_mean", "kld_median", "kld_p99", "kld_p99_9", "kld_max", "delta_p_mean_pct", "delta_p_rms_pct",
            "same_top_p_pct", "ln_ppl_ratio")
    out = []
    for r in rows:
        d = {"cache type": r.cache_type, "kveval preset": r.preset, "tokens": r.tokens}
        for k in keys:
            d[f"{k} ({TOOL})"] = (r.system or {}).get(k)
            d[f"{k} (kveval)"] = r.kveval.get(k)
        d["kveval / tool mean KLD"] = r.kld_ratio
        out.append(d)
    return out
