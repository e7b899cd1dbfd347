"""`QuantFormat`: the base of every per-segment format (int, fp8, the ggml types, fp4, hqq, turboquant, ...): the
tensor operations of `TensorFormat` implemented once from the maths of one statistics segment.

A format here provides ``code_bits``, ``code_dtype``, ``range_qparams`` (parameters of groups whose values lie in
[mn, mx]), ``encode`` and ``decode`` (codes from parameters and back), and optionally ``fit`` / ``fake`` (fused
or faster paths, bit for bit with encode + decode), ``validate`` and ``check_head_dim``. What is the same for
every such format lives here (shapes as in `kveval.quant.primitives`' docstring):

- segments: views of x [B, H, T, D] whose statistics groups are reduced over `dims` (`spec.gran.segments`): per
  token, per group of head_dim, per channel over blocks of ``channel_block`` tokens (a partial last block is its
  own block), per head, per tensor;
- static (calibrated) parameters, broadcast over the tokens (tensor [1, 1, 1, 1], head [1, H, 1, 1], channel
  [1, H, 1, D]);
- outliers (``spec.outliers``): the k largest |x| of each head_dim row are taken out first (values [B, H, T, k]
  in x's dtype, uint8 indices), the dense rest (outliers set to 0) is quantized, and they are written back on
  dequantize;
- bytes: ``row_nbytes`` per token row of codes, ``param_nbytes`` per statistics group, outliers with an index.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import replace
from typing import Any

import torch

from .base import (
    BLOCK_SCALE_DTYPES,
    MODEL_DTYPE,
    SCALE_TORCH_DTYPES,
    QParams,
    Spec,
    TensorFormat,
    TensorParts,
    check_finite,
    minmax,
)


# ------------------------------------------------------------------------------------------------ outliers
def split_outliers(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense-and-sparse split of x [B, H, T, D]: the k largest |x| of each row (ties: the lower index first).

    Returns (dense [B, H, T, D] with those entries set to 0, values [B, H, T, k] in x's dtype, index [B, H, T, k]
    uint8, or int16 when D > 256). Worked: row [0.1, -3.0, 0.2, 2.0], k = 1 -> dense [0.1, 0, 0.2, 2.0],
    values [-3.0], index [1].
    """
    D = x.shape[-1]
    # a stable descending sort makes the choice among equal magnitudes deterministic (lowest index first)
    index = x.abs().sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values
    values = x.gather(-1, index)
    dense = x.scatter(-1, index, 0.0)
    return dense, values, index.to(torch.uint8 if D <= 256 else torch.int16)


def _restore_outliers(xhat: torch.Tensor, values: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor:
    if values is None or index is None:
        return xhat
    return xhat.scatter_(-1, index.long(), values.to(xhat.dtype))


# ------------------------------------------------------------------------------------------------ helpers
def _cat(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    B, H, _, D = shape
    parts = [p.reshape(B, H, -1, D) for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _cat_qparams(parts: list[QParams]) -> QParams:
    """Parameters of consecutive segments (token blocks along dim 2) as one."""
    if len(parts) == 1:
        return parts[0]
    zps = [p.zero_point for p in parts if p.zero_point is not None]
    zp = torch.cat(zps, dim=2) if zps else None
    return QParams(torch.cat([p.scale for p in parts], dim=2), zp)


def _check_zero_point(qp: QParams, spec: Spec) -> None:
    if (qp.zero_point is None) != (spec.mapping == "symmetric"):
        raise ValueError(f"qparams.zero_point must be {'None' if spec.mapping == 'symmetric' else 'given'} "
                         f"for mapping {spec.mapping!r}")


def empty_qparams(spec: Spec, shape: tuple[int, ...], cb: int | None) -> QParams:
    """Zero-sized parameters of the granularity's scale shape for an empty x of ``shape``."""
    ss = spec.gran.scale_shape(shape, cb)
    scale = torch.zeros(ss, dtype=SCALE_TORCH_DTYPES.get(spec.scale_dtype) or BLOCK_SCALE_DTYPES[spec.scale_dtype])
    zp = None
    if spec.mapping == "asymmetric":
        zp = torch.zeros(ss, dtype=torch.uint8 if spec.zero_point == "int" else scale.dtype)
    return QParams(scale, zp)


def is_static(spec: Spec, qp: QParams) -> bool:
    """Whether ``qp`` are broadcast (calibrated) parameters: a channel spec given a [1, H, 1, D] scale."""
    return spec.gran.token_blocks and qp.scale.dim() == 4 and qp.scale.shape[0] == 1 and qp.scale.shape[2] == 1


# ------------------------------------------------------------------------------------------------ the base
class QuantFormat(TensorFormat):
    """A per-segment format (module docstring): implement ``code_bits``, ``code_dtype``, ``range_qparams``,
    ``encode`` and ``decode``; the tensor operations follow."""

    whole_tensor = False

    # ---- sizes ----------------------------------------------------------------------------------------------
    def bits_per_element(self, spec: Spec, head_dim: int) -> float:
        """Stored bits per element of a head_dim row: packed codes, plus the scales and zero points of the groups
        inside the row (token, group); per-channel, per-head and per-tensor parameters are amortised over the
        tokens and not counted. Worked: int4 g64 asym fp16, D = 128: (64 B + 2 groups * 4 B) * 8 / 128 = 4.5."""
        groups = spec.gran.groups_per_row(head_dim)
        return 8 * (self.row_nbytes(spec, head_dim) + self.param_nbytes(spec) * groups) / head_dim

    def param_nbytes(self, spec: Spec) -> int:
        """Bytes of one statistics group's parameters: the scale, plus the zero point for asymmetric mappings
        (1 byte for an int zero point, else the scale's size). A ``model`` scale dtype not yet resolved
        (`QuantSpec.resolved`) counts 2 bytes, a 16-bit serving model's; `packed_nbytes` resolves it first."""
        sdt = torch.float16 if spec.scale_dtype == MODEL_DTYPE else SCALE_TORCH_DTYPES[spec.scale_dtype]
        n = torch.empty((), dtype=sdt).element_size()
        if spec.mapping == "asymmetric":
            n += 1 if spec.zero_point == "int" else n
        return n

    # ---- one segment ----------------------------------------------------------------------------------------
    @abstractmethod
    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        """Parameters for groups whose values lie in [mn, mx] (keepdim shapes, compute dtype), rounded to the
        storage dtype: from a segment's statistics (`group_qparams`) or from a calibrated range."""

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        """Parameters from the statistics of segment xv: one min/max pass (NaN/Inf raise ValueError)."""
        mn, mx = minmax(xv, dims)
        check_finite(mn, mx)
        return self.range_qparams(mn, mx, spec)

    @abstractmethod
    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """Codes (xv's shape, `code_dtype`) of xv given parameters already in xv's dtype (broadcastable).
        Must not modify xv (it may be the caller's tensor)."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """x^ (codes' shape, in scale's dtype, the compute dtype) from codes and parameters in that dtype."""

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """(codes, parameters) of segment xv from its own statistics; override when the two are fused (ggml)."""
        qp = self.group_qparams(xv, dims, spec)
        zp = None if qp.zero_point is None else qp.zero_point.to(xv.dtype)
        return self.encode(xv, qp.scale.to(xv.dtype), zp, spec), qp

    def fake(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> torch.Tensor:
        """decode(fit(xv)) (x^ of xv's shape and dtype), bit for bit; override with a faster path that skips the
        storage dtype (the emulation hot path: one min/max pass, in-place arithmetic)."""
        codes, qp = self.fit(xv, dims, spec)
        zp = None if qp.zero_point is None else qp.zero_point.to(xv.dtype)
        return self.decode(codes, qp.scale.to(xv.dtype), zp, spec)

    # ---- whole tensors from segments --------------------------------------------------------------------------
    def choose_qparams(self, x: torch.Tensor, spec: Spec, channel_block: int | None = None) -> QParams:
        """Scale (and zero point) of x [B, H, T, D] from its statistics, rounded to spec.scale_dtype."""
        cb = spec.gran.block(x.shape[2], channel_block)
        if x.numel() == 0:
            return empty_qparams(spec, tuple(x.shape), cb)
        xc = x.to(self.compute_dtype(x.dtype))
        return _cat_qparams([self.group_qparams(xv, dims, spec) for xv, dims, _ in spec.gran.segments(xc, cb)])

    def static_qparams(self, lo: torch.Tensor, hi: torch.Tensor, spec: Spec, shape: tuple[int, ...]) -> QParams:
        """Fixed parameters for values in [lo, hi] reshaped to the static scale ``shape`` (compute dtype)."""
        cdt = torch.float64 if lo.dtype == torch.float64 else torch.float32
        return self.range_qparams(lo.to(cdt).reshape(shape), hi.to(cdt).reshape(shape), spec)

    def quantize_tensor(self, x: torch.Tensor, spec: Spec, qparams: QParams | None,
                        channel_block: int | None = None) -> TensorParts:
        shape = tuple(x.shape)
        k = spec.outlier_count(shape[-1])
        if k and x.numel():
            dense, values, index = split_outliers(x, k)
            check_finite(values)
            inner = self.quantize_tensor(dense, spec.replace(outliers=0.0), qparams, channel_block)
            return replace(inner, outlier_values=values, outlier_index=index)
        if qparams is not None and is_static(spec, qparams):
            return self._quantize_static(x, spec, qparams)
        cb = spec.gran.block(shape[2], channel_block)
        if x.numel() == 0:
            qp = empty_qparams(spec, shape, cb)
            codes = torch.empty(shape, dtype=self.code_dtype(spec))
            return TensorParts(codes, qp.scale, qp.zero_point, channel_block=cb)
        xc = x.to(self.compute_dtype(x.dtype))
        if qparams is None:
            fits = [self.fit(xv, dims, spec) for xv, dims, _ in spec.gran.segments(xc, cb)]
            qp = _cat_qparams([q for _, q in fits])
            return TensorParts(_cat([c for c, _ in fits], shape), qp.scale, qp.zero_point, channel_block=cb)
        self._check_qparams(qparams, spec, shape, cb)
        check_finite(*minmax(xc, None))
        s_all = qparams.scale.to(device=xc.device, dtype=xc.dtype)
        zp_all = None if qparams.zero_point is None else qparams.zero_point.to(device=xc.device, dtype=xc.dtype)
        parts = []
        for xv, _, sl in spec.gran.segments(xc, cb):
            zp = None if zp_all is None else zp_all[:, :, sl]
            parts.append(self.encode(xv, s_all[:, :, sl], zp, spec))
        return TensorParts(_cat(parts, shape), qparams.scale, qparams.zero_point, channel_block=cb)

    def _quantize_static(self, x: torch.Tensor, spec: Spec, qp: QParams) -> TensorParts:
        B, H, T, D = x.shape
        if qp.scale.shape[1] not in (1, H) or qp.scale.shape[3] != D:
            raise ValueError(f"static {spec.granularity} qparams have shape {tuple(qp.scale.shape)}; "
                             f"need [1, {H}, 1, {D}]")
        xc = x.to(self.compute_dtype(x.dtype))
        if xc.numel():
            check_finite(*minmax(xc, None))
        _check_zero_point(qp, spec)
        zp = None if qp.zero_point is None else qp.zero_point.to(device=xc.device, dtype=xc.dtype)
        codes = self.encode(xc, qp.scale.to(device=xc.device, dtype=xc.dtype), zp, spec)
        return TensorParts(codes, qp.scale, qp.zero_point, static=True)

    @staticmethod
    def _check_qparams(qp: QParams, spec: Spec, shape: tuple[int, ...], cb: int | None) -> None:
        want = spec.gran.scale_shape(shape, cb)
        if tuple(qp.scale.shape) != want:
            raise ValueError(f"qparams.scale has shape {tuple(qp.scale.shape)}; {spec.granularity} needs {want}")
        _check_zero_point(qp, spec)
        check_finite(qp.scale if qp.zero_point is None else torch.cat([qp.scale.float(), qp.zero_point.float()]))

    def dequantize_tensor(self, qt: Any) -> torch.Tensor:
        spec = qt.spec
        if qt.outlier_values is not None:
            dense = replace(qt, spec=spec.replace(outliers=0.0), outlier_values=None, outlier_index=None)
            return _restore_outliers(self.dequantize_tensor(dense), qt.outlier_values, qt.outlier_index)
        assert qt.scale is not None
        cdt = self.compute_dtype(qt.dtype)
        if qt.static:
            dev = qt.codes.device
            zp = None if qt.zero_point is None else qt.zero_point.to(device=dev, dtype=cdt)
            return self.decode(qt.codes, qt.scale.to(device=dev, dtype=cdt), zp, spec).to(qt.dtype)
        s_all = qt.scale.to(cdt)
        zp_all = None if qt.zero_point is None else qt.zero_point.to(cdt)
        parts = []
        for cv, _, sl in spec.gran.segments(qt.codes, qt.channel_block):
            zp = None if zp_all is None else zp_all[:, :, sl]
            parts.append(self.decode(cv, s_all[:, :, sl], zp, spec))
        return _cat(parts, tuple(qt.shape)).to(qt.dtype)

    def fake_tensor(self, x: torch.Tensor, spec: Spec, channel_block: int | None = None) -> torch.Tensor | None:
        if spec.outliers:
            return None  # outliers go through quantize + dequantize
        shape = tuple(x.shape)
        cb = spec.gran.block(shape[2], channel_block)
        xc = x.to(self.compute_dtype(x.dtype))
        parts = [self.fake(xv, dims, spec) for xv, dims, _ in spec.gran.segments(xc, cb)]
        return _cat(parts, shape).to(x.dtype)

    def tensor_nbytes(self, spec: Spec, shape: tuple[int, int, int, int], dtype: torch.dtype, static: bool,
                      channel_block: int | None = None) -> dict[str, int]:
        B, H, T, D = shape
        gran = spec.gran
        codes = B * H * T * self.row_nbytes(spec, D)
        if static and gran.calibratable:
            groups = math.prod(gran.static_scale_shape(H, D))
        else:
            groups = math.prod(gran.scale_shape(shape, gran.block(T, channel_block)))
        k = spec.outlier_count(D)
        outliers = B * H * T * k * (torch.empty((), dtype=dtype).element_size() + (1 if D <= 256 else 2))
        scales = groups * self.param_nbytes(spec)
        return {"codes": codes, "scales": scales, "outliers": outliers, "total": codes + scales + outliers}


__all__ = ["QuantFormat", "empty_qparams", "is_static", "split_outliers"]
