"""K/V transforms as plug-ins: maps applied to K and/or V before quantization and undone on read, with hooks on
the query and the attention output (``base`` has the interface and the order rules).

- ``base``: ``KVTransform`` (the hooks), ``TransformContext``, ``TransformChain`` (one layer's K or V side of a
  sequence), ``check_sequence``;
- one module per transform: ``pre_rope`` (KVQuant's pre-RoPE keys); llama.cpp's: ``gguf_order`` (Q/K channel
  order of a Llama GGUF), ``hadamard`` (blocked Hadamard rotation of Q with K, V with the output),
  ``query_quant`` (the query rounded to the keys' vec_dot type); ``random_rotation`` (TurboQuant's seeded random
  rotation: Haar-orthogonal or random signs); vLLM's FP8 attention on FlashAttention 3: ``query_fp8`` (the query
  cast to E4M3 with a static scale), ``fa3_fp8_attention`` (the attention hook: FA3's FP8 kernel, softmax
  probabilities rounded to E4M3 before P·V); ``rotate`` (a Hadamard, random-sign Hadamard or random orthogonal
  rotation on any policy, kept in the cache or undone on read: the ``rotate:`` key of a policy);
- ``registry``: the registry (name -> class) and the config form (``"name"`` or ``{name: ..., param: ...}``).

Pure maths: nothing here imports transformers; the hooks into a model live in ``kveval.patch``.

A new transform: a module here with a frozen-dataclass ``KVTransform`` subclass decorated with ``@register``, and
an import of it below, which registers it (tests and plug-ins may also call ``register`` from their own module).
"""

from kveval.transforms.base import KVTransform, TransformChain, TransformContext, check_sequence
from kveval.transforms.fa3_fp8_attention import Fa3Fp8Attention
from kveval.transforms.gguf_order import GgufOrder
from kveval.transforms.hadamard import Hadamard
from kveval.transforms.pre_rope import PreRope
from kveval.transforms.query_fp8 import QueryFp8
from kveval.transforms.query_quant import QueryQuant
from kveval.transforms.random_rotation import RandomRotation
from kveval.transforms.registry import make_transform, parse_transforms, register, transform_names
from kveval.transforms.rotate import Rotate

__all__ = ["Fa3Fp8Attention", "GgufOrder", "Hadamard", "KVTransform", "PreRope", "QueryFp8", "QueryQuant",
           "RandomRotation", "Rotate", "TransformChain", "TransformContext", "check_sequence", "make_transform",
           "parse_transforms", "register", "transform_names"]
