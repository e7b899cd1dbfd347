"""A reference implementation of KIVI's KV cache, written from reading jy-yuan/KIVI at commit
876b4d2d08e3b1d5f70d0969c299d8c7c42ddfb6 (2025-11-20), independent of kveval (it imports torch and transformers
only), for the parity tests of kveval's ``kivi2`` / ``kivi4`` presets. KIVI's code needs CUDA (Triton and its
``kivi_gemv`` kernels); this follows the same schedule and arithmetic in plain torch, as a transformers ``Cache``
that any HuggingFace Llama-family model runs with its own attention.

Files followed (paraphrased, not copied):

- ``models/llama_kivi.py``, ``LlamaFlashAttention_KIVI.forward`` (and ``LlamaAttention_KIVI.forward``, the same
  schedule). Per layer the cache holds ``(key_quant_trans, key_full, key_scale, key_mn, value_quant, value_full,
  value_scale, value_mn, kv_seq_len)``.
  * Prefill (no past; T prompt tokens): attention over the full-precision K/V (flash attention). Then keys: if
    ``T % R != 0``: all full when ``T < R``, else the first ``T - T % R`` quantized and the last ``T % R`` full;
    if ``T % R == 0``: all T quantized. Values: all full when ``T <= R``, else the first ``T - R`` quantized and
    the last R full.
  * Decode (one token): the scores are ``[q · deq(key_quant) , q · cat(key_full, k_new)]``; then, if
    ``key_full`` holds exactly R tokens, they are quantized (one chunk, appended to ``key_quant``) and
    ``key_full`` is emptied. Values: ``value_full = cat(value_full, v_new)``; the output is ``attn[:quant] ·
    deq(value_quant) + attn[-len(value_full):] · value_full``; then, if ``value_full`` holds more than R tokens
    (exactly R + 1), the oldest one is quantized and appended to ``value_quant``.
  * Keys are quantized post-RoPE; GQA through ``repeat_kv`` (the model's own attention does it here).
- ``quant/new_pack.py``, ``triton_quantize_and_pack_along_last_dim(data, group_size, bit)`` on ``[B, nh, D, T]``
  (keys, transposed: per channel, groups of ``group_size`` tokens) or ``[B, nh, T, D]`` (values: per token, groups
  of ``group_size`` channels): ``mn``, ``mx`` per group in ``data.dtype``; ``scale = (mx - mn) / (2^bit - 1)``;
  ``(data - mn) / scale``, ``clamp_(0, 2^bit - 1)``, ``round_()`` (half to even), int32; codes packed ``32 // bit``
  per int32 along the last dim, the j-th code of a word shifted by ``bit * j`` (``_pack_along_last_dim``).
- ``quant/matmul.py`` ``cuda_bmm_fA_qB_outer`` -> ``quant/csrc/gemv_cuda.cu``: dequantization
  ``scale_f32 * q + mn_f32`` from the fp16 scale and min, products accumulated in f32.

KIVI runs fp16 models, so its quantizer computes in fp16 (``quant_dtype``, default ``torch.float16``): the K/V are
rounded to fp16 before quantization and min, max, scale and ``(x - mn) / scale`` are fp16 operations. The
full-precision residual stays in the model's dtype, and attention runs in the model's dtype with the model's own
implementation (the output of KIVI's gemv kernel, rounded to fp16, is not reproduced). ``quant_dtype =
torch.float32`` gives the same schedule with float32 arithmetic and scales (for exact comparisons).

Shapes: K/V ``[batch, kv_heads, seq, head_dim]``.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

KIVI_COMMIT = "876b4d2d08e3b1d5f70d0969c299d8c7c42ddfb6"


def quantize_last_dim(data: torch.Tensor, group_size: int, bits: int, quant_dtype: torch.dtype):
    """``triton_quantize_and_pack_along_last_dim``: data ``[B, H, X, N]`` with ``N % group_size == 0`` ->
    (codes int32 packed ``[B, H, X, N * bits / 32]``, scale ``[B, H, X, N / group_size]``, mn of the same shape),
    scale and mn in ``quant_dtype``."""
    B, H, X, N = data.shape
    assert N % group_size == 0, (N, group_size)
    top = 2**bits - 1
    x = data.to(quant_dtype).reshape(B * H * X, N // group_size, group_size)
    mn = x.amin(dim=-1)
    mx = x.amax(dim=-1)
    scale = (mx - mn) / top
    q = ((x - mn.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, top).round_().to(torch.int32)
    codes = pack(q.reshape(B, H, X, N), bits)
    return codes, scale.reshape(B, H, X, -1), mn.reshape(B, H, X, -1)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``_pack_along_last_dim``: int32 codes ``[..., N]`` -> ``[..., N * bits / 32]``, code j of a word at bit
    ``bits * j``."""
    per = 32 // bits
    assert q.shape[-1] % per == 0, (q.shape, per)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    words = q << shifts
    out = words[..., 0].clone()
    for j in range(1, per):  # code |= data << (bits * j)
        out |= words[..., j]
    return out


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack`` (``unpack_tensor``): ``[..., M]`` int32 -> ``[..., M * 32 / bits]`` int32 in
    ``[0, 2^bits - 1]``."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    q = (codes.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return q.reshape(*codes.shape[:-1], codes.shape[-1] * per)


def dequantize_last_dim(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int, bits: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``scale_f32 * q + mn_f32`` (gemv_cuda.cu) per group of ``group_size`` along the last dim, as ``dtype``."""
    q = unpack(codes, bits).float()
    B, H, X, N = q.shape
    q = q.reshape(B, H, X, N // group_size, group_size)
    x = scale.float().unsqueeze(-1) * q + mn.float().unsqueeze(-1)
    return x.reshape(B, H, X, N).to(dtype)


class KiviLayer(DynamicLayer):
    """One layer of KIVI's cache (see the module docstring). ``bits`` for keys and values, ``group_size`` G,
    ``residual_length`` R (KIVI's ``k_bits``/``v_bits``, ``group_size``, ``residual_length``)."""

    def __init__(self, k_bits: int, v_bits: int, group_size: int, residual_length: int,
                 quant_dtype: torch.dtype = torch.float16):
        super().__init__()
        assert residual_length % group_size == 0
        self.k_bits, self.v_bits, self.G, self.R = k_bits, v_bits, group_size, residual_length
        self.quant_dtype = quant_dtype
        self.kv_seq_len = 0
        self.key_quant = self.key_scale = self.key_mn = None  # [B, H, D, T/per], [B, H, D, T/G]
        self.value_quant = self.value_scale = self.value_mn = None  # [B, H, T, D/per], [B, H, T, D/G]
        self.key_full: torch.Tensor | None = None
        self.value_full: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    # -- storage --------------------------------------------------------------------------------------------------
    def _quantize_keys(self, k: torch.Tensor) -> None:
        codes, scale, mn = quantize_last_dim(k.transpose(2, 3).contiguous(), self.G, self.k_bits, self.quant_dtype)
        if self.key_quant is None:
            self.key_quant, self.key_scale, self.key_mn = codes, scale, mn
        else:
            self.key_quant = torch.cat([self.key_quant, codes], dim=3)
            self.key_scale = torch.cat([self.key_scale, scale], dim=3)
            self.key_mn = torch.cat([self.key_mn, mn], dim=3)

    def _quantize_values(self, v: torch.Tensor) -> None:
        codes, scale, mn = quantize_last_dim(v.contiguous(), self.G, self.v_bits, self.quant_dtype)
        if self.value_quant is None:
            self.value_quant, self.value_scale, self.value_mn = codes, scale, mn
        else:
            self.value_quant = torch.cat([self.value_quant, codes], dim=2)
            self.value_scale = torch.cat([self.value_scale, scale], dim=2)
            self.value_mn = torch.cat([self.value_mn, mn], dim=2)

    def dequantized_keys(self) -> torch.Tensor | None:
        if self.key_quant is None:
            return None
        return dequantize_last_dim(self.key_quant, self.key_scale, self.key_mn, self.G, self.k_bits,
                                   self.dtype).transpose(2, 3)

    def dequantized_values(self) -> torch.Tensor | None:
        if self.value_quant is None:
            return None
        return dequantize_last_dim(self.value_quant, self.value_scale, self.value_mn, self.G, self.v_bits, self.dtype)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        if self.kv_seq_len == 0:  # prefill: attention reads the full-precision prompt, then the cache is filled
            self.kv_seq_len = T
            R = self.R
            if T % R != 0:
                if T < R:
                    self.key_full = key_states
                else:
                    self._quantize_keys(key_states[:, :, :-(T % R)])
                    self.key_full = key_states[:, :, -(T % R):]
            else:
                self._quantize_keys(key_states)
                self.key_full = None
            if T <= R:
                self.value_full = value_states
            else:
                self._quantize_values(value_states[:, :, :-R])
                self.value_full = value_states[:, :, -R:]
            return key_states, value_states
        assert T == 1, "KIVI decodes one token per call"
        self.kv_seq_len += T
        # keys: the scores read deq(key_quant) and cat(key_full, new) in full precision; then a full residual of R
        # keys is quantized
        self.key_full = key_states if self.key_full is None else torch.cat([self.key_full, key_states], dim=2)
        parts = [p for p in (self.dequantized_keys(), self.key_full) if p is not None]
        keys = torch.cat(parts, dim=2)
        if self.key_full.shape[-2] == self.R:
            self._quantize_keys(self.key_full)
            self.key_full = None
        # values: the output reads deq(value_quant) and cat(value_full, new); then the oldest of R + 1 is quantized
        self.value_full = torch.cat([self.value_full, value_states], dim=2)
        parts = [p for p in (self.dequantized_values(), self.value_full) if p is not None]
        values = torch.cat(parts, dim=2)
        if self.value_full.shape[-2] > self.R:
            assert self.value_full.shape[-2] == self.R + 1
            self._quantize_values(self.value_full[:, :, :1])
            self.value_full = self.value_full[:, :, 1:]
        return keys, values

    def get_seq_length(self) -> int:
        return self.kv_seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_seq_len + query_length, 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``codes`` (the packed int32 words), ``scales`` (scale + mn), ``residual`` (key_full and
        value_full in the model's dtype)."""
        def size(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        out = {"codes": size(self.key_quant, self.value_quant),
               "scales": size(self.key_scale, self.key_mn, self.value_scale, self.value_mn),
               "residual": size(self.key_full, self.value_full)}
        out["total"] = sum(out.values())
        return out


class KiviCache(Cache):
    """KIVI's cache for every layer of ``model`` (``num_hidden_layers`` of its text config)."""

    def __init__(self, model, k_bits: int = 2, v_bits: int = 2, group_size: int = 32, residual_length: int = 128,
                 quant_dtype: torch.dtype = torch.float16):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = [KiviLayer(k_bits, v_bits, group_size, residual_length, quant_dtype)
                  for _ in range(cfg.num_hidden_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> dict[str, int]:
        total = {"codes": 0, "scales": 0, "residual": 0, "total": 0}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] += v
        return total


@torch.no_grad()
def kivi_logits(model, ids: torch.Tensor, prompt: int, *, bits: int = 2, group_size: int = 32,
                residual_length: int = 128, quant_dtype: torch.dtype = torch.float16, cache: KiviCache | None = None,
                ) -> torch.Tensor:
    """Logits ``[T, vocab]`` of ``ids [T]`` through KIVI's cache: the first ``prompt`` ids in one call (KIVI's
    prefill), then one id per call."""
    cache = cache or KiviCache(model, bits, bits, group_size, residual_length, quant_dtype)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    x = ids[None]
    out = [model(x[:, :prompt], use_cache=True, **{name: cache}).logits[0]]
    for t in range(prompt, x.shape[1]):
        out.append(model(x[:, t:t + 1], use_cache=True, **{name: cache}).logits[0])
    return torch.cat(out, dim=0)
