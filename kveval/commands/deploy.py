"""``kveval deploy PLAN_OR_CONFIG [--run RUN_DIR] [--engine E ...] [--model M]``: a policy in each engine's own
syntax, or, where an engine cannot express it, the nearest policies it can run with their cost.

Input: a ``.plan.json`` (``kveval plan``: its planned policy, the scan it came from for predicted costs), or a
config (every policy of its ``kv:``; its ``plan:`` sidecar, if any, for the scan). ``--run``: a run folder whose
metrics give measured costs (KLD, ΔPPL %) of the engine presets it evaluated (looked up by the preset's name, or
by a policy of the same resolved form). Per engine (``kveval.tasks.sensitivity.engines``):

- **vLLM**: ``vllm serve MODEL --kv-cache-dtype T [--kv-cache-dtype-skip-layers i j ...]``; FP8 with calibrated
  scales needs a checkpoint carrying them (``kveval calibrate CONFIG --export compressed-tensors DIR``), per-head
  ones FlashAttention 3 (``--attention-backend FLASH_ATTN``).
- **llama.cpp**: ``[LLAMA_ATTN_ROT_DISABLE=1] llama-server -m MODEL.gguf -ctk K -ctv V -fa on``.
- **SGLang**: ``python -m sglang.launch_server --model-path MODEL --kv-cache-dtype T [--attention-backend B]``.
- **TensorRT-LLM**: ``LLM(model=..., kv_cache_config=KvCacheConfig(dtype=...))`` (PyTorch backend).
- **transformers**: ``model.generate(..., cache_implementation="quantized", cache_config={...})``
  (``QuantizedCache``).

A policy is expressible when every layer's K and V map to one of the engine's types under its rules (one type
for all layers; K and V alike except llama.cpp; vLLM's layers may also stay in the model dtype) and it needs no
feature the engine lacks (residual windows and sinks: only transformers' ``residual_length``; transforms: only
the engine's own, such as llama.cpp's rotation). Otherwise the engine's uniform policies nearest in memory are
listed, each with its measured or predicted cost (or "not measured").
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from kveval.errors import KvevalError
from kveval.memory import Arch, kv_bytes
from kveval.policy import KVPolicy
from kveval.policy.plan_file import is_finite_number
from kveval.tasks.sensitivity.engine_names import check_engine_names
from kveval.tasks.sensitivity.engines import ENGINES, Engine, EngineType

#: transforms an engine's own cache applies (a policy with any other transform is not expressible there)
ENGINE_TRANSFORMS = {"vllm": {"query_fp8", "fa3_fp8_attention"}, "llamacpp": {"gguf_order", "hadamard", "query_quant"},
                     "sglang": {"query_fp8"}, "trtllm": set(), "transformers": set()}


class NotExpressible(Exception):
    """A policy an engine cannot run; the message says why."""


@dataclass
class Option:
    """One policy an engine can run, near the one asked for: ``label`` (its syntax in short), ``preset``,
    ``bits`` per element, ``kld`` / ``delta_ppl_pct`` and where they come from (``source``)."""

    label: str
    preset: str | None
    bits: float
    kld: float | None = None
    delta_ppl_pct: float | None = None
    source: str = ""

    run_name: str | None = None  # the kv: entry that evaluates it (None: no kveval policy computes it)

    def line(self, config_hint: str = "CONFIG") -> str:
        if self.kld is None and self.run_name:
            cost = "cost: not measured (run it: " + shlex.join(
                ["kveval", "run", config_hint, "-s", f"kv=[{self.run_name}]"]) + ")"
        elif self.kld is None:
            cost = "cost: not measured"
        else:
            dppl = f", ΔPPL {self.delta_ppl_pct:+.2f}%" if self.delta_ppl_pct is not None else ""
            cost = f"KLD {self.kld:.4g}{dppl} ({self.source})"
        return f"{self.label}: {self.bits:.2f} bits/element, {cost}"


@dataclass
class Deployment:
    """One policy on one engine: the ``lines`` to run it, or ``reason`` it cannot and the ``nearest`` options."""

    engine: str
    policy: str
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    reason: str = ""
    nearest: list[Option] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.reason


# ------------------------------------------------------------------------------------------------- expressing
def _layer_specs(policy: KVPolicy, arch: Arch) -> list[tuple]:
    return [policy.specs_for_layer(i, arch.layers, arch.sliding_layers) for i in range(arch.layers)]


def _check_features(engine: Engine, policy: KVPolicy) -> None:
    if policy.pre_rope:
        raise NotExpressible("pre-RoPE keys (pre_rope) are no engine's cache")
    if policy.sink_tokens:
        raise NotExpressible(f"{engine.title} keeps no attention-sink tokens in full precision")
    if policy.residual and engine.key != "transformers":
        raise NotExpressible(f"{engine.title} has no full-precision residual window")
    foreign = [t.name for t in policy.transforms if t.name not in ENGINE_TRANSFORMS[engine.key]]
    if foreign:
        raise NotExpressible(f"{engine.title} does not apply the transform(s) {', '.join(foreign)}")


def _one_type(engine: Engine, specs: list, what: str) -> EngineType:
    types = {engine.type_of(s) for s in specs}
    if None in types:
        bad = next(s for s in specs if engine.type_of(s) is None)
        raise NotExpressible(f"{bad.describe()} is none of {engine.title}'s cache types "
                             f"({', '.join(t.name for t in engine.types)})")
    if len(types) > 1:
        names = sorted(t.name for t in types if t is not None)
        raise NotExpressible(f"{what} mixes {', '.join(names)}; {engine.title} runs one type in every layer")
    (t,) = types
    assert t is not None
    return t


def _scales_notes(policy: KVPolicy, specs: list, config_hint: str) -> list[str]:
    static = [s for s in specs if policy.uses_static(s)]
    if static:
        strategy = ["--strategy", "attn_head"] if any(s.granularity == "head" for s in static) else []
        folder = f"{Path(config_hint).stem}-kv-checkpoint"
        line = shlex.join(["kveval", "calibrate", config_hint, "--export", "compressed-tensors", folder, *strategy])
        return [f"static scales: serve a checkpoint that carries them ({line}, then serve {folder} as the model)"]
    if any(s.static_scale is not None for s in specs):
        return ["scales 1.0: the engine's default for a checkpoint without k_scale / v_scale"]
    return []


#: the builtin models an engine can load: (hub id for the HF-based engines, GGUF file name for llama.cpp)
_BUILTIN_ENGINE_MODELS = {"builtin:smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def engine_model(model: str, engine_key: str) -> tuple[str, list[str]]:
    """(the model as ``engine_key`` takes it, notes). llama.cpp takes a GGUF file: a ``.gguf`` path as it is, the
    builtin SmolLM2 as its GGUF file, anything else as ``model.gguf`` with the note that converts it. The other
    engines take a hub id or folder; the builtin SmolLM2 is its hub id; a random-weight builtin has no engine."""
    notes = []
    if model.startswith("builtin:") and model not in _BUILTIN_ENGINE_MODELS:
        notes.append(f"{model} is a random-weight test model that no engine serves: pass your model with --model")
    if engine_key == "llamacpp":
        if model.lower().endswith(".gguf"):
            return model, notes
        if model == "builtin:smollm2-135m":
            from kveval.models.builtin import smollm2_gguf

            try:
                return str(smollm2_gguf()), notes
            except KvevalError:
                pass
        return "model.gguf", notes + [f"model.gguf: {model} converted with llama.cpp's convert_hf_to_gguf.py "
                                      "(python convert_hf_to_gguf.py MODEL_DIR --outfile model.gguf)"]
    return _BUILTIN_ENGINE_MODELS.get(model, model), notes


def express(engine: Engine, policy: KVPolicy, arch: Arch, model: str, config_hint: str = "CONFIG") -> Deployment:
    """The lines that run ``policy`` on ``engine`` (module docstring); NotExpressible when it cannot. Shell lines
    are quoted for a POSIX shell (``shlex.join``), Python lines with ``repr``."""
    _check_features(engine, policy)
    layers = _layer_specs(policy, arch)
    dep = Deployment(engine.key, policy.name)
    model, dep.notes = engine_model(model, engine.key)
    quantized = [(i, k, v) for i, (k, v) in enumerate(layers) if not (k.is_none and v.is_none)]
    if engine.key == "vllm":
        half = [i for i, k, v in quantized if k.is_none or v.is_none]
        if half:
            raise NotExpressible(f"layer {half[0]} quantizes only one of K and V; vLLM's skip-layers keep both")
        if not quantized:
            dep.lines = [shlex.join(["vllm", "serve", model, "--kv-cache-dtype", "auto"])]
            return dep
        t = _one_type(engine, [s for _, k, v in quantized for s in (k, v)], "the policy")
        if len({(k, v) for _, k, v in quantized}) > 1 or any(k != v for _, k, v in quantized):
            raise NotExpressible("K and V (or layers) use different specs of one vLLM type")
        skip = [str(i) for i, (k, v) in enumerate(layers) if k.is_none and v.is_none]
        if policy.skip_sliding and arch.sliding_layers:
            skip = [s for s in skip if int(s) not in arch.sliding_layers] + ["sliding_window"]
        cmd = ["vllm", "serve", model, "--kv-cache-dtype", t.name]
        if skip:
            cmd += ["--kv-cache-dtype-skip-layers", *skip]
        names = {tr.name for tr in policy.transforms}
        per_head = any(s.granularity == "head" for _, k, _v in quantized for s in (k,))
        if names or per_head:
            cmd += ["--attention-backend", "FLASH_ATTN"]
            dep.notes.append("FlashAttention 3 (Hopper): " + ("FP8 query and P·V (vllm_fp8_fa3)" if names else
                                                             "per-head scales need it"))
        dep.lines = [shlex.join(cmd)]
        dep.notes += _scales_notes(policy, [k for _, k, _ in quantized], config_hint)
        if t.note:
            dep.notes.append(t.note)
        return dep
    if engine.key == "llamacpp":
        kt = _one_type(engine, [k for k, _ in layers], "the keys")
        vt = _one_type(engine, [v for _, v in layers], "the values")
        names = {tr.name for tr in policy.transforms}
        quant = kt.name != "f16" or vt.name != "f16"
        env = ["LLAMA_ATTN_ROT_DISABLE=1"] if quant and "hadamard" not in names else []
        fa = ["-fa", "on"] if vt.name != "f16" else []
        dep.lines = [shlex.join([*env, "llama-server", "-m", model, "-ctk", kt.name, "-ctv", vt.name, *fa])]
        if quant and not {"gguf_order", "query_quant"} <= names:
            dep.notes.append("the policy's specs are the ggml formats alone; llama.cpp's cache also reads a GGUF's "
                             "channel order and converts the query (kveval's llamacpp_* presets)")
        return dep
    specs = [s for _, k, v in quantized for s in (k, v)]
    if len(quantized) != arch.layers:
        raise NotExpressible(f"{engine.title} quantizes every layer or none; the policy keeps layers "
                             f"{[i for i, (k, v) in enumerate(layers) if k.is_none and v.is_none]} in full precision")
    t = _one_type(engine, specs, "the policy")
    if any(k != v for _, k, v in quantized):
        raise NotExpressible(f"K and V take different specs; {engine.title} runs one type for both")
    if engine.key == "sglang":
        backend = {"nvfp4": ["--attention-backend", "trtllm_mha"], "mxfp8": ["--attention-backend", "fa4"]}
        dep.lines = [shlex.join(["python", "-m", "sglang.launch_server", "--model-path", model, "--kv-cache-dtype",
                                 t.name, *backend.get(t.name, [])])]
    elif engine.key == "trtllm":
        if t.name == "int8":
            raise NotExpressible("INT8 KV cache runs on TensorRT-LLM's TensorRT backend only (a ModelOpt checkpoint "
                                 "with kv_cache_quant_algo INT8, built with trtllm-build); the PyTorch backend "
                                 "takes fp8 and nvfp4")
        dep.lines = ["from tensorrt_llm import LLM",
                     "from tensorrt_llm.llmapi import KvCacheConfig",
                     f"llm = LLM(model={model!r}, kv_cache_config=KvCacheConfig(dtype={t.name!r}))"]
    else:
        dep.lines = transformers_code(t, specs[0], policy, arch)
    dep.notes += _scales_notes(policy, specs, config_hint) if engine.key != "transformers" else []
    if t.note:
        dep.notes.append(t.note)
    return dep


def transformers_code(t: EngineType, spec, policy: KVPolicy, arch: Arch) -> list[str]:
    """``generate`` through transformers' QuantizedCache for type ``t`` (``model``, ``inputs`` given); NotExpressible
    for a model with sliding-window layers (QuantizedCache builds full-attention layers only) and for a group size
    that does not divide head_dim (its quantizer groups along head_dim)."""
    if arch.sliding_layers:
        raise NotExpressible(f"transformers' QuantizedCache has no sliding-window layers; the model has "
                             f"{len(arch.sliding_layers)}")
    backend, _, nbits = t.name.partition(":")
    if backend != "fp8" and spec.group_size and arch.head_dim % spec.group_size:
        raise NotExpressible(f"transformers' QuantizedCache groups along head_dim; the group size {spec.group_size} "
                             f"does not divide head_dim {arch.head_dim}")
    if backend == "fp8":
        if policy.residual:
            raise NotExpressible("transformers' fp8 cache keeps no residual window")
        config = {"backend": "fp8"}
    else:
        if policy.residual and policy.residual_mode != "prompt_block":
            raise NotExpressible(f"transformers' QuantizedCache flushes its residual in blocks after the prompt "
                                 f"(prompt_block); the policy's residual is {policy.residual_mode}")
        config = {"backend": backend, "nbits": int(nbits), "q_group_size": spec.group_size,
                  "residual_length": policy.residual}
        if backend == "hqq":
            config.update(axis_key=1, axis_value=1)
    return ["out = model.generate(**inputs, cache_implementation=\"quantized\", "
            f"cache_config={config!r}, max_new_tokens=32)"]


# ------------------------------------------------------------------------------------------------- costs
@dataclass
class Costs:
    """Where measured and predicted costs come from: a run folder's metrics, a scan's metrics."""

    run: dict | None = None
    run_name: str = ""
    run_policies: dict = field(default_factory=dict)
    scan: dict | None = None
    scan_name: str = ""

    def measured(self, preset: str | None) -> tuple[float, float | None] | None:
        """(KLD, ΔPPL % or None) the run measured for ``preset`` (or a policy of the same form); None when it has
        no finite KLD for it (a NaN, a string or a list in a hand-edited metrics.json is no cost)."""
        if not self.run or not preset:
            return None
        pols = self.run.get("policies") or {}
        names = [preset] + [n for n, cfg in self.run_policies.items() if _same_policy(cfg, preset)]
        for n in names:
            m = pols.get(n) or {}
            if isinstance(m, dict) and is_finite_number(m.get("kld_mean")):
                dppl = m.get("delta_ppl_pct")
                return float(m["kld_mean"]), float(dppl) if is_finite_number(dppl) else None
        return None

    def predicted(self, spec_names: tuple[str, ...]) -> float | None:
        """The scan's predicted summed KLD of the first of ``spec_names`` it scanned (None: none, or not finite)."""
        if not self.scan:
            return None
        from kveval.tasks.sensitivity.planner import uniform_prediction

        section = self.scan.get("sensitivity")
        scanned = section.get("specs") if isinstance(section, dict) else None
        for s in scanned if isinstance(scanned, list) else []:
            if s in spec_names:
                try:
                    value = uniform_prediction(self.scan, s)
                except (KeyError, TypeError, ValueError, AttributeError):
                    return None  # a scan whose cells a hand edit broke: no prediction rather than a wrong one
                return float(value) if is_finite_number(value) else None
        return None


def _same_policy(cfg, preset: str) -> bool:
    try:
        return KVPolicy.from_config(cfg, name=preset).to_config() == KVPolicy.preset(preset).to_config()
    except (KvevalError, TypeError, ValueError, AttributeError):  # a hand-edited resolved config
        return False


def nearest_options(engine: Engine, arch: Arch, context: int, target_bits: float, costs: Costs,
                    n: int = 3) -> list[Option]:
    """The engine's ``n`` uniform policies nearest in memory to ``target_bits`` (the asked policy's bill in bits per
    element at ``context``): ordered
    by their distance in bits per element, then by cost (lower first, unmeasured last), each with its measured
    (``costs.run``) or predicted (``costs.scan``: the summed scanned KLD of the uniform spec) cost."""
    out = []
    for t in engine.types:
        if t.name in ("f16",):
            continue
        what = t.preset or t.specs[0]
        try:
            bill = kv_bytes(arch, what, context)
        except (KvevalError, ValueError):
            continue
        opt = Option(_label(engine, t), t.preset, bill.bits_per_element, run_name=_run_name(t))
        got = costs.measured(t.preset)
        if got is not None:
            opt.kld, opt.delta_ppl_pct = got[0], got[1]
            opt.source = f"measured in {costs.run_name}"
        else:
            pred = costs.predicted(t.specs)
            if pred is not None:
                opt.kld, opt.source = pred, f"predicted from the scan {costs.scan_name}"
        out.append(opt)
    out.sort(key=lambda o: (round(abs(o.bits - target_bits), 2), o.kld is None, o.kld or 0.0, -o.bits))
    return out[:n]


def _run_name(t: EngineType) -> str | None:
    """The ``kv:`` entry that evaluates engine type ``t``: its preset, else its first spec when that is a policy
    preset too (fp8_e5m2), else None."""
    if t.preset:
        return t.preset
    try:
        KVPolicy.preset(t.specs[0])
    except KvevalError:
        return None
    return t.specs[0]


def _label(engine: Engine, t: EngineType) -> str:
    return {"vllm": f"--kv-cache-dtype {t.name}", "llamacpp": f"-ctk {t.name} -ctv {t.name}",
            "sglang": f"--kv-cache-dtype {t.name}", "trtllm": f"KvCacheConfig(dtype={t.name!r})",
            "transformers": f"QuantizedCache {t.name}"}[engine.key]


# ------------------------------------------------------------------------------------------------- the command
def load_target(target: str) -> tuple[dict[str, KVPolicy], Arch, int, str, dict | None, str, str]:
    """(policies, arch, context, model, scan metrics or None, scan name, config hint) of a ``.plan.json`` or a
    config."""
    from kveval.tasks.sensitivity.planner import read_plan_file

    path = Path(target)
    if path.suffix == ".json":
        side = read_plan_file(path)
        try:
            arch = Arch.from_dict(side["arch"])
            context = side["context"]
            if not isinstance(context, int) or isinstance(context, bool) or context < 1:
                raise ValueError(f"context is {context!r}, not a token count")
            policy = KVPolicy.from_config(side["policy"], name="planned")
        except KvevalError as exc:
            raise KvevalError(f"plan: '{path}': {exc}; rerun kveval plan") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise KvevalError(f"plan: '{path}' lacks a valid arch, context or policy ({type(exc).__name__}: "
                              f"{str(exc)[:120]}); rerun kveval plan") from None
        config = side.get("config") if isinstance(side.get("config"), str) else "CONFIG"
        model = _model_of_config(config)
        scan, scan_name = _scan_of(side)
        return {"planned": policy}, arch, context, model, scan, scan_name, config
    from kveval.config import load_config
    from kveval.models import model_config

    cfg = load_config(path)
    arch = Arch.from_model_config(model_config(cfg.model.name), name=cfg.model.name)
    lengths = [getattr(t.params, "seq_len", 0) for t in cfg.tasks]
    context = cfg.memory.context or max(lengths) or 2048
    scan, scan_name = (None, "")
    if cfg.plan:
        scan, scan_name = _scan_of(read_plan_file(cfg.plan))
    return cfg.policies(), arch, context, cfg.model.name, scan, scan_name, str(path)


def _model_of_config(config: str) -> str:
    """The model name of the config a plan was made for; ``MODEL`` when it is gone, unreadable, not YAML or names
    no model (the plan still deploys, with the placeholder)."""
    from kveval.schema import load_yaml, read_text_file

    if not Path(config).is_file():
        return "MODEL"
    try:
        raw = load_yaml(read_text_file(Path(config), "config"), config)
    except KvevalError:
        return "MODEL"
    m = raw.get("model") if isinstance(raw, dict) else None
    name = m if isinstance(m, str) else m.get("name") if isinstance(m, dict) else None
    return name if isinstance(name, str) and name else "MODEL"


def _scan_of(side: dict) -> tuple[dict | None, str]:
    scan = side.get("scan")
    if not isinstance(scan, str) or not (Path(scan) / "metrics.json").is_file():
        return None, ""
    from kveval.results import read_metrics

    return read_metrics(scan), scan


def deploy(policies: dict[str, KVPolicy], arch: Arch, context: int, model: str, costs: Costs,
           engines: list[str] | None = None, config_hint: str = "CONFIG") -> list[Deployment]:
    """One :class:`Deployment` per (engine, policy)."""
    out = []
    check_engine_names(engines)
    for key in engines or list(ENGINES):
        engine = ENGINES[key]
        for name, policy in policies.items():
            try:
                dep = express(engine, policy, arch, model, config_hint)
            except NotExpressible as exc:
                dep = Deployment(key, name, reason=str(exc))
                dep.nearest = nearest_options(engine, arch, context, kv_bytes(arch, policy, context).bits_per_element,
                                              costs)
            dep.policy = name
            out.append(dep)
    return out


def render(deps: list[Deployment], arch: Arch, context: int, config_hint: str = "CONFIG") -> str:
    lines: list[str] = []
    for key in dict.fromkeys(d.engine for d in deps):
        engine = ENGINES[key]
        lines.append(f"== {engine.title} ==")
        for d in (d for d in deps if d.engine == key):
            if d.exact:
                lines.append(f"{d.policy}:")
                lines += [f"  {line}" for line in d.lines]
                lines += [f"  # {note}" for note in d.notes]
            else:
                lines.append(f"{d.policy}: not expressible: {d.reason}")
                lines.append("  nearest it can run (memory at the same context):")
                lines += [f"    {o.line(config_hint)}" for o in d.nearest]
        lines.append("")
    lines.append(f"(memory at {context} tokens of context, {arch.layers} layers x {arch.kv_heads} kv heads x "
                 f"head_dim {arch.head_dim})")
    return "\n".join(lines) + "\n"


def deploy_command(target: str, run_dir: str | None = None, engines: list[str] | None = None,
                   model: str | None = None) -> str:
    """``kveval deploy``: the text it prints (module docstring)."""
    policies, arch, context, model_name, scan, scan_name, hint = load_target(target)
    costs = Costs(scan=scan, scan_name=scan_name)
    if run_dir:
        from kveval.results import read_config, read_metrics

        costs.run, costs.run_name = read_metrics(run_dir), str(run_dir)
        kv = read_config(run_dir).get("kv")
        run_policies = kv.get("policies") if isinstance(kv, dict) else None
        costs.run_policies = run_policies if isinstance(run_policies, dict) else {}
    deps = deploy(policies, arch, context, model or model_name, costs, engines, hint)
    return render(deps, arch, context, hint)
