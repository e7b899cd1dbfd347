"""A GGUF file as the source of a weight variant (``model.weights: {NAME: {gguf: FILE}}``): the checks on the file
and what its header says (the ``gguf`` package and the file system; no model code).

    path = check_gguf_file("./model.Q4_K_M.gguf", "model.weights.q4_k_m")   # KvevalError (one line) otherwise
    header = read_header(path)                  # architecture, file type, every tensor's name, group, type, bytes
    header.tensor_types()                       # {"attention": {"Q4_K": 96, "Q6_K": 16}, "other": {"F32": 61}, ...}

Module groups of a GGUF tensor (llama.cpp's names, :func:`tensor_group`): ``token_embd`` -> ``embeddings``,
``output`` -> ``lm_head``, the other matrices of a block ``blk.N.attn_*`` -> ``attention``, ``blk.N.ffn_*`` ->
``mlp``; every 1-D tensor (norms, biases) and anything else -> ``other``. ``kveval.weights.apply`` puts a loaded
model's parameters in the same groups (the embeddings and the output projection by identity, the other matrices
by their module path, every 1-D tensor in ``other``), so that the two sides count alike.

A tensor is quantized when its type is not a float type (``FLOAT_TYPES``: F32, F16, BF16, F64); its bytes are
the file's (``n_bytes``: llama.cpp's blocks, codes and scales together).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kveval.errors import KvevalError

#: GGUF tensor types that hold plain floats (not quantized).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
#: The groups of :func:`tensor_group`: the four module groups, then ``other`` (norms, biases: every 1-D tensor).
TENSOR_GROUPS = ("attention", "mlp", "lm_head", "embeddings", "other")
GGUF_VERSIONS = (2, 3)


def read_magic(path: Path) -> tuple[bytes, int | None]:
    """The first 4 bytes of ``path`` (``b"GGUF"`` for a GGUF file) and the little-endian version after them (None
    for a file shorter than 8 bytes). OSError when the file cannot be read."""
    with open(path, "rb") as f:
        head = f.read(8)
    return head[:4], int.from_bytes(head[4:8], "little") if len(head) == 8 else None


def check_gguf_file(value: Any, where: str) -> Path:
    """The path of an existing GGUF file (``~`` expanded) named by ``value``; KvevalError (one line, starting with
    ``where``) when it does not exist, is not a file, or does not start with the GGUF magic and a version 2 or 3."""
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise KvevalError(f"{where}: gguf file '{value}' does not exist")
    if not path.is_file():
        raise KvevalError(f"{where}: gguf '{value}' is not a file (give the path of a .gguf file)")
    try:
        magic, version = read_magic(path)
    except OSError as e:
        raise KvevalError(f"{where}: gguf file '{value}' cannot be read ({e.strerror or type(e).__name__})") from None
    if magic != b"GGUF":
        raise KvevalError(f"{where}: '{value}' is not a GGUF file (no GGUF magic at its start)")
    if version not in GGUF_VERSIONS:
        raise KvevalError(f"{where}: '{value}' is GGUF version {version}; versions 2 and 3 are read")
    if path.suffix.lower() != ".gguf":
        raise KvevalError(f"{where}: '{value}' is a GGUF file without the .gguf suffix; rename it to end in .gguf "
                          "(transformers' loader needs it)")
    return path


def check_variant_files(variants: dict) -> None:
    """:func:`check_gguf_file` for every GGUF variant of ``{NAME: variant}`` (what ``kveval validate`` can say of
    the files without loading a model)."""
    for name, v in variants.items():
        file = getattr(v, "gguf", None)
        if file is not None:
            check_gguf_file(file, f"model.weights.{name}.gguf")


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
    except Exception as e:  # the reader raises ValueError, KeyError, struct errors... on a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KvevalError(f"{where}: '{path}' is not a GGUF file the gguf package can read ({first})") from None
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name if ftype is not None else None
    except (ValueError, TypeError):
        ftype_name = None
    return GgufHeader(architecture=str(arch) if arch is not None else None, file_type=ftype_name, tensors=tensors)


__all__ = ["FLOAT_TYPES", "GGUF_VERSIONS", "TENSOR_GROUPS", "GgufHeader", "GgufTensor", "check_gguf_file",
           "check_variant_files", "read_header", "tensor_group"]
