"""Where kveval meets transformers' attention: finding attention modules, switching the implementation.

The emulation registers its own attention function in transformers' ``AttentionInterface`` under a name per
wrapped implementation (``kveval_sdpa``, ``kveval_eager``). Each wraps the stock function: layers without a
kveval state attached, and layers whose specs are ``none``, go straight to it with the original arguments.

Two ways to attach states: ``patched(model, states)`` for the duration of a ``with`` block (emulation,
calibration), and ``patched_while_passed(model, states, owner)`` for exactly the forward calls that receive
``owner`` (the real cache, whose K/V transforms hook the query and the attention output).

When a K/V transform computes the attention itself (an attention hook, e.g. FlashAttention 3's FP8 arithmetic),
``attention_call`` puts it in the stock function's place, for emulation and the real cache alike.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.import_utils import is_torch_greater_or_equal

from kveval.errors import KvevalError

if TYPE_CHECKING:
    from kveval.patch.quantizers import TensorQuantizer

STATE_ATTR = "_kveval_emulation"
WRAPPABLE = ("sdpa", "eager")


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a decoder, in layer order (``*Attention`` modules with a ``layer_idx``)."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
    return sorted(found, key=lambda m: m.layer_idx)


def stock_attention(module: torch.nn.Module, implementation: str) -> Callable:
    """The attention function transformers would call for ``implementation`` on this module."""
    if implementation == "eager":
        modeling = sys.modules[type(module).__module__]
        fn = getattr(modeling, "eager_attention_forward", None)
        if fn is None:
            raise KvevalError(f"{type(module).__name__}: no eager_attention_forward found to wrap")
        return fn
    return ALL_ATTENTION_FUNCTIONS[implementation]


def allowed_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor:
    """transformers' mask (bool: True = attend; float: 0 = attend; None = causal) as a bool tensor
    ``[batch or 1, 1, q_len, kv_len]``."""
    if attention_mask is None:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
        return causal[None, None]
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def inner_mask(mask: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask in the form the wrapped implementation expects."""
    if implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.finfo(dtype).min)
    return mask


#: keywords with which ``grouped_sdpa`` leaves a call to transformers' own function (its other keywords are ignored
#: by both alike)
STOCK_ONLY_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")
#: the oldest torch whose CPU kernel gives ``enable_gqa`` the bits of the expanded call, as tests/test_attention.py
#: checks on the torch installed (``enable_gqa`` exists since 2.5; the versions between were not checked): with an
#: older torch ``grouped_sdpa`` is transformers' function
GROUPED_SDPA_TORCH = "2.13"
_GROUPED = is_torch_greater_or_equal(GROUPED_SDPA_TORCH)


def grouped_sdpa(module, query, key, value, attention_mask, *args, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' ``sdpa_attention_forward``, with the case where it copies the key/value heads computed without
    the copy: a GQA layer (``module.num_key_value_groups`` > 1) on the CPU with a bool mask and several queries,
    where transformers expands keys and values to one head per query head (``repeat_kv``) and calls SDPA with the
    mask. Here SDPA gets the grouped keys/values and ``enable_gqa=True``: PyTorch's CPU kernel then reads each query
    head's group in place, the same arithmetic on the same values, so the same output bit for bit
    (tests/test_attention.py compares the two over dtypes, head sizes, lengths and masks). Every other call
    (CUDA, where transformers keeps the expansion because a masked GQA call can leave the fused kernels; no mask;
    one query; dropout; a float mask; ``STOCK_ONLY_KWARGS``; a torch older than ``GROUPED_SDPA_TORCH``) goes to
    transformers' function unchanged.

    The emulation's chunks are such calls: queries ``[batch, heads, rows, head_dim]`` over the kept keys of every
    version with an explicit mask ``[batch or 1, 1, rows, keys]``; output ``[batch, rows, heads, v_head_dim]``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (not _GROUPED or args or groups <= 1 or attention_mask is None or attention_mask.dtype != torch.bool
            or query.shape[2] <= 1 or query.device.type != "cpu" or dropout or query.shape[1] != key.shape[1] * groups
            or any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in STOCK_ONLY_KWARGS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def attention_call(stock: Callable, value_q: TensorQuantizer, rope=None) -> Callable:
    """The attention function a patched layer calls: the stock signature plus ``key_positions``,
    ``fn(module, query, key, value, attention_mask, *args, key_positions=None, **kwargs) -> (output, weights)``,
    query ``[batch, heads, Tq, head_dim]``, key/value ``[batch, kv_heads, Tk, head_dim]``, output ``[batch, Tq,
    heads, head_dim]``.

    Without an attention hook on the value chain this is ``stock`` (``key_positions`` is dropped; transformers'
    SDPA function as ``grouped_sdpa``, the same numbers without the copies of grouped heads). With one, the
    hook computes the output (weights None) from: the mask as bool (``allowed_mask``; no mask with
    ``is_causal=False``: every key), ``key_positions`` int64 ``[Tk]`` (default 0..Tk-1: keys in position order from
    the first token) and the softmax scale (the ``scaling`` keyword, else ``module.scaling``, else
    head_dim^-0.5). Attention with soft-capped logits, sinks or a position bias is refused (KvevalError)."""
    if not value_q.replaces_attention:
        call = grouped_sdpa if stock is sdpa_attention_forward else stock

        def plain(module, query, key, value, attention_mask, *args, key_positions=None, **kwargs):
            return call(module, query, key, value, attention_mask, *args, **kwargs)
        return plain

    def hooked(module, query, key, value, attention_mask, *args, key_positions=None, **kwargs):
        for unsupported in ("softcap", "s_aux", "position_bias"):
            if kwargs.get(unsupported) is not None:
                raise KvevalError(f"{type(module).__name__}: an attention transform cannot compute attention with "
                                  f"'{unsupported}'; use a policy without one")
        q_len, kv_len = query.shape[-2], key.shape[-2]
        if attention_mask is None and kwargs.get("is_causal") is False:
            allowed = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=key.device)
        else:
            allowed = allowed_mask(attention_mask, q_len, kv_len, key.device)
        if key_positions is None:
            key_positions = torch.arange(kv_len, device=key.device)
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        out = value_q.attention(query, key, value, allowed, key_positions, float(scaling), rope)
        return out.transpose(1, 2).contiguous(), None

    return hooked


def _register(name: str, implementation: str, dispatch: Callable) -> None:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        state = getattr(module, STATE_ATTR, None)
        if state is None:
            return stock_attention(module, implementation)(module, query, key, value, attention_mask, *args, **kwargs)
        return dispatch(state, module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask if implementation == "sdpa" else eager_mask)


def install(dispatch: Callable) -> None:
    """Register ``kveval_<impl>`` for every wrappable implementation (idempotent)."""
    for impl in WRAPPABLE:
        _register(f"kveval_{impl}", impl, dispatch)


def current_implementation(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def set_implementation(model, name: str) -> None:
    """Switch the whole model (and its sub-configs) to a registered attention implementation."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise KvevalError(
            f"{type(model).__name__} does not use transformers' attention interface; kveval cannot patch its attention"
        )
    try:
        model.set_attn_implementation(name)
    except (ValueError, KeyError, AttributeError):
        model.config._attn_implementation = name
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def _dispatch(state, module, query, key, value, attention_mask, *args, **kwargs):
    return state.attend(module, query, key, value, attention_mask, *args, **kwargs)


def base_implementation(model) -> str:
    """The stock implementation (``sdpa`` or ``eager``) that the kveval wrapper will call; KvevalError otherwise."""
    original = current_implementation(model)
    base = original.removeprefix("kveval_")
    if base not in WRAPPABLE:
        raise KvevalError(
            f"attention implementation '{original}' cannot be emulated; load the model with sdpa or eager attention"
        )
    return base


@contextmanager
def patched(model, states: dict[torch.nn.Module, object]):
    """Route each attention module's attention call to ``states[module].attend(module, q, k, v, mask, ...)``
    (which calls ``stock_attention`` itself); modules without a state run stock. Restores the model on exit."""
    original = current_implementation(model)
    base = base_implementation(model)
    install(_dispatch)
    for module, state in states.items():
        setattr(module, STATE_ATTR, state)
    set_implementation(model, f"kveval_{base}")
    try:
        yield
    finally:
        for module in states:
            if hasattr(module, STATE_ATTR):
                delattr(module, STATE_ATTR)
        set_implementation(model, original)


def patched_while_passed(model, states: dict[torch.nn.Module, object], owner: object) -> Callable[[], None]:
    """Route attention to ``states`` (as ``patched`` does) during exactly those forward calls of ``model`` that
    receive ``owner`` as an argument: a cache handed to ``model(...)`` as ``past_key_values``/``cache``, also by
    ``generate()``. Each such call patches the model on entry and restores it when the call returns or raises;
    other calls run untouched. Returns a function removing the hooks; they are removed too once ``owner`` is
    garbage-collected (the hooks hold it weakly). Raises ``KvevalError`` now if the model cannot be patched."""
    base_implementation(model)
    ref = weakref.ref(owner)
    active: list[AbstractContextManager | None] = []

    def before(_module, args, kwargs):
        mine = ref()
        passed = mine is not None and (any(a is mine for a in args) or any(v is mine for v in kwargs.values()))
        cm = patched(model, states) if passed else None
        if cm is not None:
            cm.__enter__()
        active.append(cm)

    def after(_module, _args, _kwargs, _output):
        cm = active.pop() if active else None
        if cm is not None:
            cm.__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True, always_call=True)]

    def remove() -> None:
        for h in handles:
            h.remove()

    weakref.finalize(owner, remove)
    return remove
