"""The K/V transform interface: maps applied to keys/values before quantization and undone on read, with hooks
on the query and on the attention output (pure tensor maths; nothing here imports transformers).

Shapes: keys, values and queries ``[batch, heads, T, head_dim]`` (``kv_heads`` for K/V, query heads for Q);
attention outputs ``[batch, heads, T, head_dim]`` as well (the plumbing transposes transformers'
``[batch, T, heads, head_dim]`` for the hook). ``TransformContext.rope`` is ``(cos, sin)`` ``[batch, T, head_dim]``
of the positions of the tensor handed to the hook (the same positions for a query and its keys in emulation; the
query's positions for ``query``/``output`` in the real cache).

Per tensor kind, a transform ``t`` is six optional hooks (identity by default)::

    stored  = quantize(key_in(k))          # k: what the model hands to the cache (post-RoPE)
    read    = key_out(dequantize(stored))  # what attention meets (the "attention domain")
    q'      = query(q)                     # q before the dot product
    v / o   : value_in, value_out, and output(o') after attention (o' [batch, heads, T, head_dim])

and a seventh, ``attention(q', k, v, allowed, key_positions, scaling, ctx) -> o'``, for an engine whose attention
arithmetic itself is low precision (FlashAttention 3 rounds the softmax probabilities to FP8 before P·V): it
replaces ``softmax(q'kᵀ·scaling)·v`` between the query and output hooks, in emulation and in the real cache alike.
It belongs to the V chain (it forms the product with the values); at most one transform of a sequence may have it.
``key_positions`` gives each key's token position: emulation concatenates two versions of every token (``[k ; k̂]``,
a mask selecting one per query), so a key's index is not its position.

Two ways to rotate Q and K together by an orthogonal ``H`` (q·k unchanged: ``(qH)·(kH) = q·k``); a transform
chooses with ``keeps_keys_transformed`` (and ``keeps_values_transformed`` for V with the output):

* un-rotate on read (``False``, the default): ``key_in(k) = kH``, ``key_out(ŝ) = ŝHᵀ``; no query hook. Attention
  runs in the model's own domain; full-precision tokens (sinks, residual window, FP prefill, ``none`` specs) skip
  the transform entirely, exactly as if it were not there (key_out∘key_in is the identity).
* keep the cache rotated (``True``, what llama.cpp does: it rotates Q and the output and never un-rotates the
  cache): ``key_in(k) = kH``, ``key_out`` the identity, ``query(q) = qH``; for V ``value_in(v) = vH``,
  ``output(o') = o'Hᵀ``. Attention then runs in the transform's domain, so every key the query meets must be
  there: full-precision tokens and ``none`` specs go through ``key_out(key_in(k))`` too (``to_attention``).

Both give the same logits in exact arithmetic (tests/test_transforms.py checks it in float64); they differ in
rounding and cost, so a transform should follow the engine it models: keep the cache rotated for llama.cpp-style
rotations (a matmul on q and on o per attention call; the stored codes are what the engine stores), un-rotate on
read otherwise (a matmul per dequantized K/V token, no change to the attention call). ``KVTransform``'s default is
un-rotate on read; a transform may offer both as a parameter (the test's toy rotation has ``keep``).

Order: a sequence ``[t1, t2, ...]`` applies ``*_in`` and ``query`` in order and ``*_out`` and ``output`` in
reverse. Transforms that keep K (or V) transformed must come before the others acting on K (V): the domain they
define is the outermost one (``check_sequence`` refuses other orders with one line).

A new transform: a frozen dataclass of plain parameters (it is part of a policy's identity and config form)
subclassing ``KVTransform``, with a ``name`` and the hooks it needs, registered with
``kveval.transforms.register``; tensors it derives (matrices) are built on demand and memoized by the transform.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from kveval.errors import KvevalError

Kind = Literal["key", "value"]
Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TransformContext:
    """What a hook may need besides the tensor: the layer, head_dim and ``rope = (cos, sin)``
    ``[batch, T, head_dim]`` of the tensor's positions (None unless some transform of the chain ``needs_rope``)."""

    layer: int
    head_dim: int
    rope: Rope | None = None


class KVTransform:
    """One transform (see the module docstring). Subclasses override the hooks they need; which hooks act is
    derived from which methods a subclass overrides, so a transform without query/output hooks costs nothing on
    the query and the attention output."""

    name: ClassVar[str] = ""
    #: whether the hooks read ``ctx.rope`` (the plumbing then captures the rotary embedding)
    needs_rope: ClassVar[bool] = False

    # --- hooks: x [batch, heads, T, head_dim] -> same shape ---------------------------------------------------
    def key_in(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        """Keys before quantization (model domain -> stored domain)."""
        return k

    def key_out(self, k: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        """Dequantized keys on read (stored domain -> attention domain)."""
        return k

    def value_in(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v

    def value_out(self, v: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        return v

    def query(self, q: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        """The query before the dot product (model domain -> attention domain of the keys)."""
        return q

    def output(self, o: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
        """The attention output ``[batch, heads, T, head_dim]`` (attention domain of the values -> model domain)."""
        return o

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  key_positions: torch.Tensor, scaling: float, ctx: TransformContext) -> torch.Tensor:
        """The attention computation itself, replacing ``softmax(q kᵀ · scaling) v`` (only for transforms that
        override it). q ``[batch, heads, Tq, head_dim]`` after the query hooks; k, v ``[batch, kv_heads, Tk,
        head_dim]`` as attention reads them (heads a multiple of kv_heads: grouped-query attention); ``allowed``
        bool, broadcastable to ``[batch, heads, Tq, Tk]`` (True = the query sees that key); ``key_positions`` int64
        ``[Tk]``, the token position of each key. Returns o' ``[batch, heads, Tq, head_dim]`` in q's dtype, before
        the output hooks."""
        raise NotImplementedError(f"transform '{self.name}' has no attention hook")

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError (one line) when the transform cannot act on vectors of ``head_dim`` (checked with the model's
        shape, before any forward pass); default: any head_dim."""

    def applies_to(self, model_type: str | None) -> bool:
        """Whether this transform acts on a model of ``model_type`` (the config's ``model_type``; None: unknown).
        Default: every model; a transform that describes one family's layout (``gguf_order``) says no to others,
        and the plumbing then leaves it out of that model's chains."""
        return True

    # --- what acts ------------------------------------------------------------------------------------------------
    def _overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(KVTransform, hook)

    @property
    def acts_on_keys(self) -> bool:
        return self._overrides("key_in") or self._overrides("key_out")

    @property
    def acts_on_values(self) -> bool:
        return self._overrides("value_in") or self._overrides("value_out")

    @property
    def has_query_hook(self) -> bool:
        return self._overrides("query")

    @property
    def has_output_hook(self) -> bool:
        return self._overrides("output")

    @property
    def has_attention_hook(self) -> bool:
        return self._overrides("attention")

    @property
    def keeps_keys_transformed(self) -> bool:
        """True when ``key_out`` leaves keys in this transform's domain (the query hook moves queries there)."""
        return False

    @property
    def keeps_values_transformed(self) -> bool:
        """True when ``value_out`` leaves values in this transform's domain (the output hook brings o back)."""
        return False

    def acts_on(self, kind: Kind) -> bool:
        """Whether the transform belongs to the K (query hook included) or V (output and attention hooks
        included) chain."""
        if kind == "key":
            return self.acts_on_keys or self.has_query_hook
        return self.acts_on_values or self.has_output_hook or self.has_attention_hook

    def keeps_transformed(self, kind: Kind) -> bool:
        return self.keeps_keys_transformed if kind == "key" else self.keeps_values_transformed

    def scales_kind(self, kind: str) -> str | None:
        """The scales-file kind (``kveval.calibration``) describing this transform's output when its input is
        described by ``kind`` (``key``, ``value``, ...); None: no calibrated scales exist for that domain. Only
        called for transforms acting on the tensor."""
        return None

    # --- config form ----------------------------------------------------------------------------------------------
    def to_config(self) -> str | dict[str, Any]:
        """``name`` for a transform without parameters, else ``{"name": name, **parameters}`` (all of them)."""
        if not dataclasses.is_dataclass(self) or not dataclasses.fields(self):
            return self.name
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def describe(self) -> str:
        cfg = self.to_config()
        if isinstance(cfg, str):
            return cfg
        params = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "name")
        return f"{self.name}({params})"


def check_sequence(transforms: tuple[KVTransform, ...], where: str) -> None:
    """KvevalError (one line) for a sequence the plumbing cannot apply consistently: a repeated transform, two
    transforms that both replace the attention computation, or a transform keeping K/V transformed after another
    transform acting on the same tensor."""
    for i, t in enumerate(transforms):
        if t in transforms[:i]:
            hint = " (pre_rope: true already puts it first)" if t.name == "pre_rope" else ""
            raise KvevalError(f"{where}: transform '{t.describe()}' appears twice{hint}")
    replacing = [t.describe() for t in transforms if t.has_attention_hook]
    if len(replacing) > 1:
        raise KvevalError(f"{where}: transforms {' and '.join(repr(n) for n in replacing)} both replace the attention "
                          "computation; keep one")
    for kind in ("key", "value"):
        seen: KVTransform | None = None
        for t in transforms:
            if not t.acts_on(kind):
                continue
            if t.keeps_transformed(kind) and seen is not None:
                raise KvevalError(
                    f"{where}: transform '{t.describe()}' keeps {kind}s transformed (attention runs in its domain) "
                    f"and must come before '{seen.describe()}'; reorder the transforms (pre_rope: true counts as first)"
                )
            if not t.keeps_transformed(kind):
                seen = seen or t


@dataclass(frozen=True)
class TransformChain:
    """One layer's K (``kind="key"``) or V (``kind="value"``) side of a transform sequence: the transforms acting
    on that tensor, in sequence order. Every method returns its input unchanged (the same object) when no
    transform acts, so an empty chain costs nothing."""

    kind: Kind
    transforms: tuple[KVTransform, ...] = ()
    layer: int = 0

    @classmethod
    def of(cls, transforms: tuple[KVTransform, ...], kind: Kind, layer: int) -> TransformChain:
        return cls(kind, tuple(t for t in transforms if t.acts_on(kind)), layer)

    # --- properties -----------------------------------------------------------------------------------------------
    @property
    def domain(self) -> tuple[KVTransform, ...]:
        """The leading transforms that keep this tensor transformed: attention reads it in their domain."""
        out = []
        for t in self.transforms:
            if not t.keeps_transformed(self.kind):
                break
            out.append(t)
        return tuple(out)

    @property
    def needs_rope(self) -> bool:
        return any(t.needs_rope for t in self.transforms)

    @property
    def domain_needs_rope(self) -> bool:
        return any(t.needs_rope for t in self.domain)

    @property
    def hook_transforms(self) -> tuple[KVTransform, ...]:
        """The transforms whose query (K chain) or output (V chain) hook acts."""
        if self.kind == "key":
            return tuple(t for t in self.transforms if t.has_query_hook)
        return tuple(t for t in self.transforms if t.has_output_hook)

    @property
    def has_query_hook(self) -> bool:
        return self.kind == "key" and any(t.has_query_hook for t in self.transforms)

    @property
    def has_output_hook(self) -> bool:
        return self.kind == "value" and any(t.has_output_hook for t in self.transforms)

    @property
    def attention_transform(self) -> KVTransform | None:
        """The transform whose ``attention`` hook replaces the attention computation (V chain only), or None."""
        if self.kind != "value":
            return None
        return next((t for t in self.transforms if t.has_attention_hook), None)

    def context(self, x: torch.Tensor, rope: Rope | None) -> TransformContext:
        return TransformContext(self.layer, x.shape[-1], rope)

    def scales_kind(self) -> str | None:
        """The scales-file kind of the stored tensor: ``key``/``value`` without transforms, ``key_pre_rope`` after
        pre_rope, None when no calibrated scales describe the stored domain."""
        kind: str | None = self.kind
        for t in self.transforms:
            stores = t.acts_on_keys if self.kind == "key" else t.acts_on_values
            if stores and kind is not None:
                kind = t.scales_kind(kind)
        return kind

    # --- application: x [batch, heads, T, head_dim] ---------------------------------------------------------------
    def _in(self, transforms, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        if not transforms:
            return x
        ctx = self.context(x, rope)
        for t in transforms:
            x = t.key_in(x, ctx) if self.kind == "key" else t.value_in(x, ctx)
        return x

    def _out(self, transforms, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        if not transforms:
            return x
        ctx = self.context(x, rope)
        for t in reversed(transforms):
            x = t.key_out(x, ctx) if self.kind == "key" else t.value_out(x, ctx)
        return x

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """Model domain -> stored domain (before quantization): every ``*_in`` in order."""
        return self._in(self.transforms, x, rope)

    def backward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """Stored domain -> attention domain (after dequantization): every ``*_out`` in reverse order."""
        return self._out(self.transforms, x, rope)

    def to_attention(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """A full-precision tensor (never quantized) in the attention domain: through the ``domain`` transforms
        only; the others are skipped (their out∘in is the identity), so without a domain this returns x itself."""
        domain = self.domain
        if not domain:
            return x
        return self._out(domain, self._in(domain, x, rope), rope)

    def query(self, q: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """q ``[batch, heads, T, head_dim]`` before the dot product: every query hook in order."""
        if not self.has_query_hook:
            return q
        ctx = self.context(q, rope)
        for t in self.transforms:
            if t.has_query_hook:
                q = t.query(q, ctx)
        return q

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  key_positions: torch.Tensor, scaling: float, rope: Rope | None = None) -> torch.Tensor:
        """o' ``[batch, heads, Tq, head_dim]`` from the ``attention_transform``'s hook (shapes in
        ``KVTransform.attention``); a chain without one raises ValueError (the plumbing asks first)."""
        t = self.attention_transform
        if t is None:
            raise ValueError(f"the {self.kind} chain has no transform replacing the attention computation")
        return t.attention(q, k, v, allowed, key_positions, scaling, self.context(q, rope))

    def output(self, o: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """The attention output ``[batch, heads, T, head_dim]``: every output hook in reverse order."""
        if not self.has_output_hook:
            return o
        ctx = self.context(o, rope)
        for t in reversed(self.transforms):
            if t.has_output_hook:
                o = t.output(o, ctx)
        return o
