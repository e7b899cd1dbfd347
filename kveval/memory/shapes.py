"""Named shapes (``kveval memory --shape NAME``): the cache-relevant config.json values of the models people serve,
as data, read by :meth:`kveval.memory.arch.Arch.from_model_config` like any config.

Each entry: ``config`` (the published config.json's values that decide the cache: layers, heads, head_dim, the
layer pattern, MLA's dimensions, the linear-attention state; and hidden/intermediate/vocab sizes where known),
``params`` (the parameter count the model card states, rounded as the card rounds it, for the capacity figures), ``source`` (where the values
come from). ``checked``: ``config`` when the values were read from the published config.json (or a verbatim copy of
it), ``copies`` when they were read from third-party copies of it (test fixtures of other projects, mirrors) or
from the transformers config defaults that describe that model, ``memory`` when they could not be checked against
any file here (they are the values the model family is documented with; treat them as such). Sources were read
2026-12-02 through the code and page indexes (no network here).
"""

from __future__ import annotations

from typing import Any


def _every(n: int, period: int, kind: str, other: str) -> list[str]:
    """Layer types: ``kind`` at every ``period``-th layer (1-based), ``other`` elsewhere."""
    return [kind if (i + 1) % period == 0 else other for i in range(n)]


NAMED_SHAPES: dict[str, dict[str, Any]] = {
    # ---- kveval's worked shapes (docs and tests)
    "llama-7b-mha": {  # LLaMA-7B: 32 x 202,383,360 + 2 x 32000 x 4096 embeddings + 4096 norm
        "config": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "head_dim": 128, "hidden_size": 4096},
        "params": 6_738_415_616, "source": "LLaMA-7B (Touvron et al., 2023)", "checked": "config"},
    "llama-7b-gqa4": {  # the same with 4 KV heads (K and V projections 4096 x 512): 939,524,096 fewer parameters
        "config": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 4096},
        "params": 5_798_891_520, "source": "LLaMA-7B with 4 KV heads (a worked example)", "checked": "config"},
    "smollm2-135m": {  # the builtin model: hidden 576, 9 q / 3 kv heads, tied 49152-token embeddings
        "config": {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                   "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576},
        "params": 134_515_008, "source": "HuggingFaceTB/SmolLM2-135M-Instruct config.json", "checked": "config"},
    # ---- Llama 3.1
    "llama-3.1-8b": {
        "config": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
                   "vocab_size": 128256, "max_position_embeddings": 131072},
        "params": 8_030_261_248, "source": "meta-llama/Llama-3.1-8B config.json", "checked": "copies"},
    "llama-3.1-70b": {
        "config": {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 8192, "intermediate_size": 28672,
                   "vocab_size": 128256, "max_position_embeddings": 131072},
        "params": 70_553_706_496, "source": "meta-llama/Llama-3.1-70B config.json", "checked": "copies"},
    "llama-3.1-405b": {  # 8 KV heads (the paper, the FP8 release); one BF16 export shows 16 (model parallel 16)
        "config": {"model_type": "llama", "num_hidden_layers": 126, "num_attention_heads": 128,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 16384, "intermediate_size": 53248,
                   "vocab_size": 128256, "max_position_embeddings": 131072},
        "params": 405_853_388_800, "source": "meta-llama/Llama-3.1-405B config.json; Llama 3 paper, Table 3",
        "checked": "copies"},
    # ---- Qwen3
    "qwen3-8b": {
        "config": {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
                   "vocab_size": 151936, "max_position_embeddings": 40960},
        "params": 8_200_000_000, "source": "Qwen/Qwen3-8B model card (8.2B; 36 layers, 32 Q / 8 KV heads)",
        "checked": "memory"},
    "qwen3-32b": {
        "config": {"model_type": "qwen3", "num_hidden_layers": 64, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120, "intermediate_size": 25600,
                   "vocab_size": 151936, "max_position_embeddings": 40960},
        "params": 32_800_000_000, "source": "Qwen/Qwen3-32B model card (32.8B; 64 layers, 64 Q / 8 KV heads)",
        "checked": "memory"},
    "qwen3-235b-a22b": {
        "config": {"model_type": "qwen3_moe", "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 4096, "num_experts": 128,
                   "max_position_embeddings": 40960},
        "params": 235_000_000_000, "source": "Qwen/Qwen3-235B-A22B config.json (a verbatim copy); card: 235B",
        "checked": "copies"},
    "qwen3-next-80b-a3b": {  # 36 Gated DeltaNet + 12 full-attention layers (every 4th)
        "config": {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
                   "layer_types": _every(48, 4, "full_attention", "linear_attention"),
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
                   "max_position_embeddings": 262144},
        "params": 80_000_000_000, "source": "Qwen/Qwen3-Next-80B-A3B-Instruct config.json; transformers 5.24 "
        "configuration_qwen3_next.py", "checked": "copies"},
    # ---- DeepSeek-V3 and Kimi-K2 (multi-head latent attention)
    "deepseek-v3": {
        "config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
                   "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "q_lora_rank": 1536,
                   "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
                   "max_position_embeddings": 163840},
        "params": 671_000_000_000, "source": "deepseek-ai/DeepSeek-V3 config.json; card: 671B", "checked": "config"},
    "kimi-k2": {
        "config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 64,
                   "num_key_value_heads": 64, "hidden_size": 7168, "kv_lora_rank": 512, "q_lora_rank": 1536,
                   "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 384,
                   "max_position_embeddings": 131072},
        "params": 1_026_000_000_000, "source": "moonshotai/Kimi-K2-Instruct config.json (copies); card: 1T total",
        "checked": "copies"},
    # ---- GPT-OSS (sliding 128 on every other layer, starting with layer 0; learned sinks are parameters)
    "gpt-oss-20b": {
        "config": {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
                   "layer_types": _every(24, 2, "full_attention", "sliding_attention"), "num_local_experts": 32,
                   "max_position_embeddings": 131072},
        "params": 21_000_000_000, "source": "openai/gpt-oss-20b model card (21B; 24 layers)", "checked": "memory"},
    "gpt-oss-120b": {
        "config": {"model_type": "gpt_oss", "num_hidden_layers": 36, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
                   "layer_types": _every(36, 2, "full_attention", "sliding_attention"), "num_local_experts": 128,
                   "max_position_embeddings": 131072},
        "params": 117_000_000_000, "source": "transformers 5.24 configuration_gpt_oss.py (its defaults are "
        "gpt-oss-120b); card: 117B", "checked": "copies"},
    # ---- Gemma 3 (5 sliding : 1 full)
    "gemma-3-27b": {
        "config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                   "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                   "layer_types": _every(62, 6, "full_attention", "sliding_attention"),
                   "max_position_embeddings": 131072},
        "params": 27_000_000_000, "source": "google/gemma-3-27b-it config.json text_config (copies); "
        "transformers 5.24 configuration_gemma3.py", "checked": "copies"},
    # ---- Mistral
    "mistral-small-3.1-24b": {
        "config": {"model_type": "mistral", "num_hidden_layers": 40, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                   "vocab_size": 131072, "max_position_embeddings": 131072},
        "params": 24_000_000_000, "source": "mistralai/Mistral-Small-3.1-24B-Instruct-2503 model card (24B)",
        "checked": "memory"},
    "mistral-large-2411": {
        "config": {"model_type": "mistral", "num_hidden_layers": 88, "num_attention_heads": 96,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 12288, "intermediate_size": 28672,
                   "vocab_size": 32768, "max_position_embeddings": 131072},
        "params": 123_000_000_000, "source": "mistralai/Mistral-Large-Instruct-2411 config.json (copies); card: 123B",
        "checked": "copies"},
    # ---- GLM-4.5 (partial rotary 0.5, MoE)
    "glm-4.5": {
        "config": {"model_type": "glm4_moe", "num_hidden_layers": 92, "num_attention_heads": 96,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120, "partial_rotary_factor": 0.5,
                   "n_routed_experts": 160, "max_position_embeddings": 131072},
        "params": 355_000_000_000, "source": "zai-org/GLM-4.5 config.json (copies); card: 355B", "checked": "copies"},
    # ---- Llama 4 (RoPE layers chunked at 8192, every 4th layer global without RoPE)
    "llama-4-scout-17b-16e": {
        "config": {"model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
                   "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120, "attention_chunk_size": 8192,
                   "layer_types": _every(48, 4, "full_attention", "chunked_attention"),
                   "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(48)], "num_local_experts": 16,
                   "max_position_embeddings": 10485760},
        "params": 109_000_000_000, "source": "meta-llama/Llama-4-Scout-17B-16E-Instruct config.json (copies); "
        "card: 109B total", "checked": "copies"},
}

__all__ = ["NAMED_SHAPES"]
