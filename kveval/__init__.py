"""kveval: accuracy evaluation of KV-cache quantization for HuggingFace causal LMs."""

__version__ = "0.1.0"
