"""GGUF files: the one place kveval reads, checks and writes them, and llama.cpp's Q/K channel order.

    check_gguf(path, "model")                   # KvevalError (one line) unless GGUF magic and version 2 or 3
    header = read_header(path)                  # architecture, file type, every tensor's name, group, type, bytes
    header.tensor_types()                       # {"attention": {"Q4_K": 96, "Q6_K": 16}, "other": {"F32": 61}, ...}
    permute_rows(w, n_head)                     # q/k_proj rows in llama.cpp's order (convert_hf_to_gguf.py)
    write_llama_gguf(dest, state_dict, config)  # an HF Llama's weights as a GGUF file (F32 or gguf-py's types)

Module groups of a GGUF tensor (llama.cpp's names, :func:`tensor_group`): ``token_embd`` -> ``embeddings``,
``output`` -> ``lm_head``, the other matrices of a block ``blk.N.attn_*`` -> ``attention``, ``blk.N.ffn_*`` ->
``mlp``; every 1-D tensor (norms, biases) and anything else -> ``other``. ``kveval.weights.apply`` puts a loaded
model's parameters in the same groups, so that the two sides count alike. A tensor is quantized when its type is
not a float type (``FLOAT_TYPES``); its bytes are the file's (``n_bytes``: llama.cpp's blocks, codes and scales).

**llama.cpp's Q/K order.** ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, applied to ``q_proj``/``k_proj``
weights and biases in ``LlamaModel.modify_tensors``) permutes the rows of each head so that HF's rotate-half
pairs ``(i, i + d/2)`` become adjacent: GGUF channel ``2i + j`` holds HF channel ``j*d/2 + i`` (i < d/2, j in
{0, 1}); llama.cpp then applies RoPE to adjacent pairs (``LLAMA_ROPE_TYPE_NORM``). Only the HF model types that
llama.cpp converts to its ``llama`` architecture are permuted (:data:`PERMUTED_MODEL_TYPES`, the architectures
whose Q/K rows transformers' own GGUF loader un-permutes: ``TENSOR_PROCESSORS["llama"]`` in transformers 5.24
``modeling_gguf_pytorch_utils.py``); Qwen2/3, Gemma, Phi-3 and others keep HF's order (NEOX RoPE in llama.cpp).

The ``gguf`` package (gguf-py, llama.cpp's own) does the parsing and writing; it is imported when used.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kveval.errors import KvevalError

#: GGUF versions kveval reads (the ``gguf`` package and transformers' loader read both)
GGUF_VERSIONS = (2, 3)
#: GGUF tensor types that hold plain floats (not quantized).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
#: The groups of :func:`tensor_group`: the four module groups, then ``other`` (norms, biases: every 1-D tensor).
TENSOR_GROUPS = ("attention", "mlp", "lm_head", "embeddings", "other")
#: HF ``model_type`` values whose GGUF files hold Q/K rows in llama.cpp's permuted order (module docstring)
PERMUTED_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral"})


# ------------------------------------------------------------------------------------------------ checking
def read_magic(path: Path) -> tuple[bytes, int | None]:
    """The first 4 bytes of ``path`` (``b"GGUF"`` for a GGUF file) and the little-endian version after them (None
    for a file shorter than 8 bytes). OSError when the file cannot be read."""
    from kveval.fileio import open_regular

    with open_regular(path) as f:  # a FIFO or device is refused (OSError), never opened
        head = f.read(8)
    return head[:4], int.from_bytes(head[4:8], "little") if len(head) == 8 else None


def gguf_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a GGUF file kveval reads, as the end of a sentence about it ("is not a GGUF
    file (no GGUF magic at its start)", "is GGUF version 1 (2 and 3 are read)", "cannot be read (...)"), or None."""
    try:
        magic, version = read_magic(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    if magic != b"GGUF":
        return "is not a GGUF file (no GGUF magic at its start)"
    if version not in GGUF_VERSIONS:
        return f"is GGUF version {version} ({' and '.join(map(str, GGUF_VERSIONS))} are read)"
    return None


def check_gguf(path: Path, where: str = "", shown: str | None = None) -> None:
    """KvevalError (one line, starting with ``where``) unless ``path`` starts with the GGUF magic and a version
    this reader handles (2 or 3); ``shown``: how the message names the file (default its path)."""
    problem = gguf_problem(path)
    if problem is not None:
        name = f"'{shown if shown is not None else path}'"
        what = f"GGUF file {name} {problem}" if problem.startswith("cannot") else f"{name} {problem}"
        raise KvevalError(f"{where}: {what}" if where else what)


# ------------------------------------------------------------------------------------------------ the header
def tensor_group(name: str, n_dims: int) -> str:
    """The group of a GGUF tensor (module docstring): ``blk.3.attn_q.weight`` -> ``attention``,
    ``blk.3.ffn_down.weight`` -> ``mlp``, ``token_embd.weight`` -> ``embeddings``, ``output.weight`` ->
    ``lm_head``, ``blk.3.attn_norm.weight`` (1-D) -> ``other``."""
    if name == "token_embd.weight":
        return "embeddings"
    if name == "output.weight":
        return "lm_head"
    if n_dims < 2:
        return "other"
    part = name.split(".")[2] if name.startswith("blk.") and name.count(".") >= 2 else ""
    if part.startswith("attn_"):
        return "attention"
    if part.startswith("ffn_"):
        return "mlp"
    return "other"


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: ``name`` (llama.cpp's), ``group`` (:func:`tensor_group`), ``type`` (``Q4_K``,
    ``F32``...), ``shape`` (PyTorch order: ``[out, in]`` for a matrix), ``n_elements``, ``n_bytes`` (in the file)."""

    name: str
    group: str
    type: str
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int

    @property
    def quantized(self) -> bool:
        return self.type not in FLOAT_TYPES


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file says of itself: ``architecture`` (``general.architecture``), ``file_type`` (the name of
    ``general.file_type``: ``MOSTLY_Q4_K_M``; None when absent or unknown) and its ``tensors`` in file order."""

    architecture: str | None
    file_type: str | None
    tensors: tuple[GgufTensor, ...]

    def tensor_types(self, groups: tuple[str, ...] | None = None) -> dict[str, dict[str, int]]:
        """``{group: {type: number of tensors}}`` in ``TENSOR_GROUPS`` order (types by count, then name), over
        ``groups`` (all when None)."""
        out: dict[str, dict[str, int]] = {}
        for g in TENSOR_GROUPS:
            if groups is not None and g not in groups:
                continue
            counts = Counter(t.type for t in self.tensors if t.group == g)
            if counts:
                out[g] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        return out


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of a GGUFReader, None when absent (read from the raw parts, which every
    gguf-py version from 0.10 has)."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    try:
        return bytes(part).decode("utf-8") if len(field.types) == 1 and field.types[0].name == "STRING" else part[0]
    except (UnicodeDecodeError, IndexError, AttributeError):
        return None


def read_header(path: str | Path, where: str = "gguf") -> GgufHeader:
    """The header of a GGUF file (memory-mapped: the tensors' data is not read). KvevalError (one line, starting
    with ``where``) when the gguf package cannot parse it."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        tensors = tuple(
            GgufTensor(name=t.name, group=tensor_group(t.name, len(t.shape)), type=t.tensor_type.name,
                       shape=tuple(int(x) for x in reversed(t.shape.tolist())), n_elements=int(t.n_elements),
                       n_bytes=int(t.n_bytes))
            for t in reader.tensors)
        arch = _field(reader, "general.architecture")
        ftype = _field(reader, "general.file_type")
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError, OSError, EOFError, struct.error) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KvevalError(f"{where}: '{path}' is not a GGUF file the gguf package can read ({first})") from None
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name if ftype is not None else None
    except (ValueError, TypeError):
        ftype_name = None
    return GgufHeader(architecture=str(arch) if arch is not None else None, file_type=ftype_name, tensors=tensors)


# ------------------------------------------------------------------------------------------------ Q/K order
@lru_cache(maxsize=16)
def _perm(head_dim: int) -> torch.Tensor:
    return torch.arange(head_dim).reshape(2, head_dim // 2).t().reshape(-1)


def gguf_permutation(head_dim: int) -> torch.Tensor:
    """Index map ``[head_dim]`` (int64): GGUF channel p holds HF channel ``perm[p]``, ``perm[2i + j] = j*d/2 + i``.
    Worked: d = 8 -> [0, 4, 1, 5, 2, 6, 3, 7]."""
    return _perm(_even(head_dim))


def _even(head_dim: int) -> int:
    """``head_dim`` when the GGUF Q/K order is defined for it (even, positive); ValueError otherwise."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"the GGUF Q/K permutation needs an even head_dim; got {head_dim}")
    return head_dim


def to_gguf_order(x: torch.Tensor) -> torch.Tensor:
    """Activations ``x [..., head_dim]`` in HF channel order -> GGUF order (a new, contiguous tensor): the
    :func:`gguf_permutation` as the transpose of ``[2, d/2]`` (a strided copy, the same values as ``index_select``
    with the index map, 7-11x faster on CPU for [1, 9, 2048, 64])."""
    d = _even(x.shape[-1])
    out = x.unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)
    same = out.data_ptr() == x.data_ptr()  # head_dim 2: the identity, a view of x
    return out.clone(memory_format=torch.contiguous_format) if same else out


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` of the rows of a q/k_proj weight ``[n_head * d, in]`` (or
    bias ``[n_head * d]``): within each head, row ``2i + j`` <- row ``j*d/2 + i`` (:func:`gguf_permutation`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_rows` (GGUF row order back to HF's)."""
    idx = permute_rows(np.arange(w.shape[0]), n_head)
    out = np.empty_like(w)
    out[idx] = w
    return out


# ------------------------------------------------------------------------------------------------ writing
#: ``tensor_type(gguf_name, group) -> gguf.GGMLQuantizationType | None`` (None: F32)
TensorType = Callable[[str, str], Any]


def write_llama_gguf(dest: Path, state_dict: Mapping[str, torch.Tensor], config: Any, *,
                     metadata_from: Path | None = None, metadata: Callable[[Any], None] | None = None,
                     tensor_type: TensorType | None = None) -> None:
    """Write an HF Llama-architecture model's weights (``state_dict``, ``config``: its transformers config) as a
    GGUF file at ``dest``: llama.cpp's tensor names, q/k_proj rows permuted (:func:`permute_rows`), tied
    ``lm_head`` left out, every tensor F32 unless ``tensor_type`` names a gguf-py quantized type for it (then
    gguf-py's own quantizer writes it).

    Metadata: every key of the GGUF file ``metadata_from`` (the one the model was loaded from; ``file_type`` set to
    F32, ``block_count`` to the config's layers), else what ``metadata(writer)`` adds (hyper-parameters and a
    vocabulary: :func:`add_llama_metadata`). KvevalError for a tensor that has no llama.cpp name."""
    import gguf

    writer = gguf.GGUFWriter(str(dest), "llama")
    if metadata_from is not None:
        reader = gguf.GGUFReader(str(metadata_from))
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key == "general.file_type":
                writer.add_uint32(key, int(gguf.LlamaFileType.ALL_F32))
                continue
            if key == "llama.block_count":
                writer.add_uint32(key, config.num_hidden_layers)
                continue
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    elif metadata is not None:
        metadata(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, t in state_dict.items():
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KvevalError(f"no GGUF name for the tensor '{hf_name}'")
        w = t.detach().to(torch.float32).numpy()
        if ".self_attn.q_proj." in hf_name:
            w = permute_rows(w, config.num_attention_heads)
        elif ".self_attn.k_proj." in hf_name:
            w = permute_rows(w, config.num_key_value_heads)
        qtype = None if tensor_type is None else tensor_type(name, tensor_group(name, w.ndim))
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_llama_metadata(writer: Any, config: Any, tokens: list[str], *, token_types: list[int] | None = None,
                       merges: list[str] | None = None, special_ids: Mapping[str, int] | None = None,
                       add_bos: bool | None = False, file_type: int | None = None) -> None:
    """Llama hyper-parameters from an HF ``config`` and a gpt2-style vocabulary ``tokens`` (one string per id) on a
    ``gguf.GGUFWriter``: what llama.cpp and transformers' GGUF loader need to build the model. ``special_ids``:
    ``{"bos": id, "eos": id, ...}`` (default: the config's bos/eos, else 0); ``file_type``: the
    ``general.file_type`` (default ALL_F32)."""
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32) if file_type is None else int(file_type))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "rope_theta")
    writer.add_rope_freq_base(float(rope_theta or 10000.0))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types or [int(gguf.TokenType.NORMAL)] * len(tokens))
    writer.add_token_merges(merges if merges is not None else [])
    if special_ids is None:
        special_ids = {"bos": config.bos_token_id if config.bos_token_id is not None else 0,
                       "eos": config.eos_token_id if isinstance(config.eos_token_id, int) else 0}
    for key, tid in special_ids.items():
        getattr(writer, f"add_{key}_token_id")(tid)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)


__all__ = ["FLOAT_TYPES", "GGUF_VERSIONS", "PERMUTED_MODEL_TYPES", "TENSOR_GROUPS", "GgufHeader", "GgufTensor",
           "add_llama_metadata", "check_gguf", "gguf_permutation", "gguf_problem", "permute_rows", "read_header",
           "read_magic", "tensor_group", "to_gguf_order", "unpermute_rows", "write_llama_gguf"]
