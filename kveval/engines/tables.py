"""What each serving engine can run as a KV cache, as data: its cache types, the kveval spec that computes each,
the preset that reproduces it, how a policy may vary across layers and between K and V, the transforms its own
cache applies and how one of its types is written. ``kveval plan --engine E`` plans within it (the sensitivity
planner) and ``kveval deploy`` turns a policy into the engine's flags (:mod:`kveval.engines.express`; pure, no
transformers).

Per engine (the versions kveval's presets follow; docs/engines.md):

- **vllm** (0.33.0): ``--kv-cache-dtype`` one type for K and V of every layer (``CacheDType`` in
  ``vllm/config/cache.py`` L44-67), except the layers ``--kv-cache-dtype-skip-layers`` names (0-based indices or
  ``sliding_window``, space-separated, ``nargs="+"``: ``engine/arg_utils.py`` L1415-1417; attention.py L300-320),
  which stay in the model dtype (``auto``).
- **llamacpp** (0c1e570): ``-ctk`` / ``-ctv`` one type each for K and V, the same in every layer
  (``common/arg.cpp`` L2436-2461, ``kv_cache_types`` L304-314; ``llama_context_params`` has one ``type_k`` /
  ``type_v``); a quantized V needs flash attention (``-fa on``); ``LLAMA_ATTN_ROT_DISABLE=1`` turns its Hadamard
  rotation of quantized caches off (``src/llama-kv-cache.cpp`` L314-339).
- **sglang** (0.5.23): ``--kv-cache-dtype`` one type for K and V in every layer (``srt/arg_groups/fields/model.py``
  L197-220).
- **trtllm** (PyTorch backend): ``KvCacheConfig(dtype=...)`` one type for every layer (``kv_cache_quant_algo`` of
  a ModelOpt checkpoint: one value for all layers, ``LayerQuantConfig`` in ``models/modeling_utils.py`` @01ea6d79;
  no per-layer KV type exists); NVFP4 needs a ModelOpt-quantized checkpoint; INT8 only on the TensorRT backend.
- **transformers** (5.24): ``QuantizedCache(backend=..., nbits=...)`` one configuration for every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kveval.quant import QuantSpec


@dataclass(frozen=True)
class EngineType:
    """One KV cache type of an engine: its ``name`` in the engine's syntax, the kveval ``preset`` that reproduces
    it (a run's measured cost is looked up under that name), the QuantSpec presets a scan may hold for it (the
    planner's candidates) and ``match`` (whether a policy's spec computes it)."""

    name: str
    preset: str | None
    specs: tuple[str, ...]
    match: Callable[[QuantSpec], bool]
    note: str = ""


@dataclass(frozen=True)
class Engine:
    """An engine: ``key`` (``--engine``), ``title``, its cache ``types``; ``split_kv``: K and V may take different
    types; ``skip_layers``: single layers may stay in the model's dtype; ``full``: its name for that dtype;
    ``transforms``: the K/V transforms its own cache applies (a policy with any other is not expressible there);
    ``syntax``: how one of its types is written in short (``syntax.format(name=...)``, :meth:`label`)."""

    key: str
    title: str
    types: tuple[EngineType, ...]
    split_kv: bool
    skip_layers: bool
    full: str
    transforms: frozenset[str]
    syntax: str

    def type_of(self, spec: QuantSpec) -> EngineType | None:
        """The engine's type that ``spec`` computes (None: none does; ``none`` is the model's dtype)."""
        return next((t for t in self.types if t.match(spec)), None)

    def candidates(self, scanned: list[str]) -> list[str]:
        """The scanned spec names the engine can run (in scan order)."""
        return [s for s in scanned if any(s in t.specs for t in self.types)]

    def type_named(self, spec_name: str) -> EngineType | None:
        return next((t for t in self.types if spec_name in t.specs), None)

    def label(self, t: EngineType) -> str:
        """Type ``t`` in the engine's syntax, in short (``--kv-cache-dtype fp8``, ``-ctk q8_0 -ctv q8_0``)."""
        return self.syntax.format(name=t.name)


def _fmt(name: str, *grans: str) -> Callable[[QuantSpec], bool]:
    return lambda s: s.format == name and (not grans or s.granularity in grans) and not s.outliers


def _ggml(name: str) -> Callable[[QuantSpec], bool]:
    return lambda s: s.format == "int" and s.ggml in ((name, "q8_0_x86") if name == "q8_0" else (name,))


def _int8_tensor(s: QuantSpec) -> bool:
    return s.format == "int" and s.bits == 8 and s.ggml is None and s.mapping == "symmetric" \
        and s.granularity == "tensor"


def _quanto(bits: int) -> Callable[[QuantSpec], bool]:
    return lambda s: s.format == "int" and s.ggml is None and s.bits == bits and s.mapping == "asymmetric" \
        and s.granularity == "group" and s.group_size in (32, 64, 128) and not s.outliers


def _hqq(bits: int) -> Callable[[QuantSpec], bool]:
    return lambda s: s.format == "hqq" and s.bits == bits and s.group_size in (32, 64, 128)


def _none(s: QuantSpec) -> bool:
    return s.is_none


VLLM = Engine("vllm", "vLLM 0.33.0", (
    EngineType("fp8", "vllm_fp8", ("fp8_e4m3", "fp8_e4m3_tensor", "fp8_e4m3_head"), _fmt("fp8_e4m3", "tensor", "head"),
               "scales from the checkpoint (k_scale/v_scale), 1.0 without; per head only with an attn_head "
               "checkpoint on FlashAttention 3"),
    EngineType("fp8_e5m2", None, ("fp8_e5m2",), _fmt("fp8_e5m2", "tensor")),
    EngineType("nvfp4", "vllm_nvfp4", ("nvfp4", "nvfp4_tensor"), _fmt("nvfp4", "tensor", "head"), "SM100"),
    EngineType("nvfp4_4over6", "vllm_nvfp4_4over6", ("nvfp4_4over6",), _fmt("nvfp4_4over6", "tensor"), "SM100"),
    EngineType("int8_per_token_head", "vllm_int8_per_token_head", ("int8_per_token_head",),
               _fmt("int8_per_token_head"), "Triton backend"),
    EngineType("fp8_per_token_head", "vllm_fp8_per_token_head", ("fp8_per_token_head",),
               _fmt("fp8_per_token_head"), "Triton backend"),
    EngineType("int4_per_token_head", "vllm_int4_per_token_head", ("int4_per_token_head",),
               _fmt("int4_per_token_head"), "Triton backend"),
), split_kv=False, skip_layers=True, full="auto", transforms=frozenset({"query_fp8", "fa3_fp8_attention"}),
    syntax="--kv-cache-dtype {name}")

LLAMACPP = Engine("llamacpp", "llama.cpp 0c1e570", (
    EngineType("f16", None, ("none",), _none),
    EngineType("q8_0", "llamacpp_q8_0", ("q8_0", "q8_0_x86"), _ggml("q8_0")),
    EngineType("q4_0", "llamacpp_q4_0", ("q4_0",), _ggml("q4_0")),
    EngineType("q4_1", "llamacpp_q4_1", ("q4_1",), _ggml("q4_1")),
    EngineType("q5_0", "llamacpp_q5_0", ("q5_0",), _ggml("q5_0")),
    EngineType("q5_1", "llamacpp_q5_1", ("q5_1",), _ggml("q5_1")),
    EngineType("iq4_nl", "llamacpp_iq4_nl", ("iq4_nl",), _ggml("iq4_nl")),
), split_kv=True, skip_layers=False, full="f16", transforms=frozenset({"gguf_order", "hadamard", "query_quant"}),
    syntax="-ctk {name} -ctv {name}")

SGLANG = Engine("sglang", "SGLang 0.5.23", (
    EngineType("fp8_e4m3", None, ("fp8_e4m3", "fp8_e4m3_tensor"), _fmt("fp8_e4m3", "tensor"),
               "scales from the checkpoint (k_scale/v_scale), 1.0 without"),
    EngineType("fp8_e5m2", None, ("fp8_e5m2",), _fmt("fp8_e5m2", "tensor")),
    EngineType("nvfp4", "sglang_nvfp4", ("nvfp4_flashinfer", "nvfp4", "nvfp4_tensor"),
               lambda s: s.format in ("nvfp4_flashinfer", "nvfp4") and s.granularity == "tensor", "SM100/SM120"),
    EngineType("mxfp8", "sglang_mxfp8", ("mxfp8",), _fmt("mxfp8"), "FA4 backend"),
    EngineType("fp4_mx_block16", "sglang_fp4_e2m1", ("fp4_mx_block16",), _fmt("fp4_mx_block16"),
               "fp4_e2m1 before 0.5.23"),
), split_kv=False, skip_layers=False, full="auto", transforms=frozenset({"query_fp8"}), syntax="--kv-cache-dtype {name}")

TRTLLM = Engine("trtllm", "TensorRT-LLM (PyTorch backend)", (
    EngineType("fp8", None, ("fp8_e4m3", "fp8_e4m3_tensor"), _fmt("fp8_e4m3", "tensor"),
               "scales from a ModelOpt checkpoint (k_proj.k_scale), 1.0 without"),
    EngineType("nvfp4", "trtllm_nvfp4", ("nvfp4", "nvfp4_tensor"), _fmt("nvfp4", "tensor"),
               "a ModelOpt checkpoint with kv_cache_quant_algo NVFP4"),
    EngineType("int8", "trtllm_int8", ("int8_tensor",), _int8_tensor, "TensorRT backend only"),
), split_kv=False, skip_layers=False, full="auto", transforms=frozenset(), syntax="KvCacheConfig(dtype={name!r})")

TRANSFORMERS = Engine("transformers", "transformers 5.24 QuantizedCache", (
    EngineType("fp8", "hf_fp8", ("fp8_e4m3_tensor",), _fmt("fp8_e4m3", "tensor")),
    EngineType("quanto:4", "hf_quanto_int4", ("int4_g64", "int4_g32", "int4_g128"), _quanto(4),
               "scale and min in the model's dtype; the newest residual_length tokens in full precision"),
    EngineType("quanto:2", "hf_quanto_int2", ("int2_g64", "int2_g32"), _quanto(2)),
    EngineType("hqq:4", "hf_hqq_int4", ("hqq4_g64", "hqq4_g32"), _hqq(4)),
    EngineType("hqq:2", "hf_hqq_int2", ("hqq2_g64",), _hqq(2)),
), split_kv=False, skip_layers=False, full="DynamicCache", transforms=frozenset(), syntax="QuantizedCache {name}")

ENGINES: dict[str, Engine] = {e.key: e for e in (VLLM, LLAMACPP, SGLANG, TRTLLM, TRANSFORMERS)}
