"""Format 'hqq': HQQ (Half-Quadratic Quantization) integer codes, the quantizer behind transformers'
``QuantizedCache(backend="hqq")``: asymmetric b-bit codes per group whose zero point is optimised by HQQ's
half-quadratic solver, scale and zero kept in the model's dtype.

Read in mobiusml/hqq 0.2.8.post1 (commit e0b1d00, the PyPI sdist's files are identical): ``hqq/core/quantize.py``
(``Quantizer.quantize`` with its defaults ``channel_wise=True, optimize=True, round_zero=False, bitpack=True``,
``Quantizer.dequantize``, ``Quantizer.cuda`` -> ``to_inplace``), ``hqq/core/optimize.py``
(``optimize_weights_proximal_legacy``, which ``Quantizer.optimize_weights = optimize_weights_proximal`` names, and
``shrink_lp_op``), ``hqq/core/bitpack.py`` (``BitPack``). transformers 5.24 (``cache_utils.py``
``HQQQuantizedLayer._quantize``) calls ``Quantizer.quantize(tensor, axis, device, compute_dtype=model dtype, nbits,
group_size)``, then casts scale and zero to the model's dtype.

One group x = g consecutive elements of a head_dim row (granularity 'group', g = ``group_size``; 'token': g = D;
hqq's ``axis=1``: ``W.reshape([-1, g])``), b = bits, top = 2^b - 1. All of the fitting is float32 (hqq:
``W = tensor.float()``; the solver runs in float32 on the CPU), whatever the input dtype:

1. start: ``denom = max(x) - min(x)``; inverse scale ``c = top / denom`` (torch's ``int / tensor``:
   ``reciprocal(denom) * top``), ``c = 1`` where ``|denom| <= 1e-4``, then ``c = min(c, 2e4)``; zero
   ``z = -min(x) * c``.
2. HQQ's solver, ``iters = 20`` steps, ``p = 0.7``, ``beta = 10`` (kappa = 1.01 is in hqq's parameters but the
   legacy solver never uses it: beta stays 10); c is fixed, only z moves:
   ``q = clamp(round(x * c + z), 0, top)``; ``x_r = (q - z) / c``; ``e = shrink(x - x_r)`` with
   ``shrink(v) = sign(v) * max(|v| - (1/beta) * |v|^(p - 1), 0)``; ``z = mean(q - (x - e) * c)`` over the group.
3. codes ``q = clamp(round(x * c + z), 0, top)`` (round half to even) with the float32 c and z;
   stored: scale ``s = 1.0 / c`` and ``z``, each cast to ``scale_dtype`` (``model`` for the transformers cache:
   hqq's ``compute_dtype``); ``x^ = (q - z) * s``, computed in the storage dtype (hqq dequantizes in its
   compute_dtype: bf16 arithmetic for a bf16 model).

Worked (b = 2, one group x = [0, 1, 2, 4]): denom 4, c = 0.75, z = -0.0; step 1: x * c + z = [0, .75, 1.5, 3] ->
q = [0, 1, 2, 3], x_r = [0, 4/3, 8/3, 4], x - x_r = [0, -1/3, -2/3, 0] -> e = [0, -0.1943, -0.5537, 0] (|v| = 1/3:
1/3 - 0.1 * (1/3)^-0.3 = 0.1943) -> z = mean([0, 1 - 1.1943 * 0.75, 2 - 2.5537 * 0.75, 0]) = 0.0472; z then rises
to 0.1072 after 20 steps, the codes stay [0, 1, 2, 3]; s = 1/0.75 = 1.3333334, x^ = (q - z) * s = [-0.1429, 1.1904,
2.5237, 3.8571]. (hqq alone on this one-group tensor stops after step 3, z = 0.0877: see "Early stop".)

Early stop. hqq stops the solver at the first step whose mean |x - x_r| over the *whole tensor of the call* does
not decrease (and keeps the zero that step computed). That couples every group of a call, and a call of
transformers' cache is the whole history re-quantized at each flush, which kveval's cache (token blocks) and its
emulation (the whole sequence at once) cannot share; so here every group runs the 20 steps, ending early only when
no group's zero moves any more (a fixed point: running on changes nothing). On a call of many groups the
call-wide stop fires when (nearly) every group has reached its fixed point, so the two agree: on the builtin
model's keys and values (15 of its 30 layers, prefixes of 4 to 512 tokens of ids 1000-1519 of the builtin corpus,
each one call) 86 of 115,560 4-bit zero points differ from hqq's (6 groups' codes), 7 of 115,560 at 2 bits. A
call of few groups can stop well before (a 4-token prompt of 3 KV heads: 12 groups); kveval/parity/hf_hqq.py
measures what that leaves. ``hqq_fit(..., call_stop=True)`` is hqq's rule exactly (tests/parity/test_hf_hqq.py
checks it against hqq bit for bit).

Storage as hqq packs it: b in (1, 2, 4, 8) gives 8/b codes per byte (``BitPack.pack_{1,2,4,8}bit_u8``) and the
same byte count as kveval's row bitstream (ceil(D * b / 8) per row; hqq interleaves rows, not bits, so only the
layout differs); plus one scale and one zero per group in ``scale_dtype``. hqq's 3-bit packing (ten codes per
int32 across rows, padded to a multiple of ten rows) has no per-row byte count, so bits 3 is refused; transformers'
cache takes 1, 2, 3, 4 and 8. Not modelled: the float16 solver hqq uses on CUDA (``optimize_weights_proximal_legacy``
casts to float16 when the device is CUDA); a scale or zero beyond the storage dtype's range (hqq gives inf, kveval
clamps to the largest finite value).
"""

from __future__ import annotations

import torch

from .base import MODEL_DTYPE, SCALE_TORCH_DTYPES, QParams, Spec, check_finite, store
from .segment import QuantFormat

#: hqq 0.2.8.post1 ``optimize_weights_proximal_legacy`` defaults (kappa 1.01 is unused by that solver)
HQQ_ITERS = 20
HQQ_LP_NORM = 0.7
HQQ_BETA = 1e1
#: ``Quantizer.quantize``: inverse scales of ranges up to this are set to 1; inverse scales are clamped to SCALE_MAX
SMALL_RANGE = 1e-4
SCALE_MAX = 2e4
#: bits whose hqq packing holds a whole number of codes per byte (``Quantizer.bit_to_packing``)
BITS = (1, 2, 4, 8)
#: float32 elements of torch's widest CPU loop step (two AVX-512 vectors): groups of a multiple of it never fall
#: in a loop's scalar tail (``_solve_per_group``)
WHOLE_VECTORS = 32


def shrink_lp(x: torch.Tensor, beta: float, lp_norm: float, *, in_place: bool = False) -> torch.Tensor:
    """hqq's ``shrink_lp_op`` (lp_norm < 1): ``sign(x) * max(|x| - (1/beta) * |x|^(lp_norm - 1), 0)``, elementwise,
    in x's dtype (|x| = 0 gives inf inside and 0 out). ``in_place``: computed in x's buffer (the same operations,
    the same bits), which is returned."""
    sign = torch.sign(x)
    out = x.abs_() if in_place else torch.abs(x)
    out.sub_(out.pow(lp_norm - 1).mul_(1.0 / beta)).clamp_min_(0.0)
    return out.mul_(sign)


def hqq_start(w: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse scale c, zero z) ``[..., 1]`` of groups w ``[..., g]`` (float32) before the solver, as
    ``Quantizer.quantize`` computes them (the expressions are hqq's, so that torch rounds them the same way)."""
    _min = w.amin(-1, keepdim=True)
    _max = w.amax(-1, keepdim=True)
    denom = _max - _min
    scale = top / denom
    scale = torch.where(denom.abs() <= SMALL_RANGE, torch.full_like(scale, 1.0), scale)
    scale = scale.clamp(max=SCALE_MAX)
    return scale, -_min * scale


def hqq_fit(w: torch.Tensor, bits: int, *, call_stop: bool = False,
            iters: int = HQQ_ITERS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HQQ's quantizer on groups w ``[..., g]`` (float32, groups along the last dim): (codes ``[..., g]`` as float32
    integers, inverse scale c ``[..., 1]``, zero z ``[..., 1]``), float32.

    ``call_stop``: hqq's early stop, on the mean |w - w_r| over all of w (what one ``Quantizer.quantize`` call on
    w does); default: each group runs ``iters`` steps (see the module docstring), ending when no zero moves."""
    top = 2**bits - 1
    scale, zero = hqq_start(w, top)
    if not call_stop:
        zero = _solve_per_group(w, scale, zero, top, iters)
    else:
        best = torch.tensor(torch.inf, dtype=torch.float32, device=w.device)
        for _ in range(iters):
            w_q, w_r, new = _hqq_step(w, scale, zero, top)
            zero = new
            error = torch.abs(w - w_r).mean().float()
            if error < best:
                best = error
            else:
                break
    codes = torch.round(w * scale + zero).clamp_(0, top)
    return codes, scale, zero


def _hqq_step(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of HQQ's solver on groups w ``[..., g]`` with c, z ``[..., 1]``: (codes, w_r, the new zero).
    hqq's expressions (``round(w * c + z)``, ``(q - z) / c``, ``shrink(w - w_r)``, ``mean(q - (w - e) * c)``),
    each intermediate written into the buffer of the one before it where that one is not needed again: the same
    operations on the same values, so the same bits, with 6 new tensors a step instead of 14."""
    w_q = (w * scale).add_(zero).round_().clamp_(0, top)
    w_r = (w_q - zero).div_(scale)
    w_e = shrink_lp(w - w_r, HQQ_BETA, HQQ_LP_NORM, in_place=True)
    moved = torch.sub(w, w_e, out=w_e).mul_(scale)  # (w - e) * c, in e's buffer
    return w_q, w_r, torch.sub(w_q, moved, out=moved).mean(dim=-1, keepdim=True)


def _solve_per_group(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, top: int, iters: int) -> torch.Tensor:
    """The zeros after ``iters`` steps per group, each group stepping until its zero no longer moves: a group whose
    step returned its own zero is at a fixed point (a step is a function of the group alone), so it leaves the
    working set and the later steps run on the moving groups only; the zeros are those of running every group
    every step. w ``[..., g]``, scale and zero ``[..., 1]``; returns the zeros ``[..., 1]``.

    Exact only where an elementwise op gives an element the same bits whatever the tensor's size: torch's CPU
    loops run two vectors at a time and the elements left over through a scalar loop, whose ``pow`` can differ from
    the vector one by an ulp. With g a multiple of ``WHOLE_VECTORS`` every group is whole vectors (AVX-512: 2 x 16
    floats); other g take every group every step, as before (measured: g = 4 differed in 5 of 800 fits)."""
    g = w.shape[-1]
    if g % WHOLE_VECTORS:  # a step's last elements could fall in a vector loop's scalar tail: every group, every step
        for _ in range(iters):
            _, _, new = _hqq_step(w, scale, zero, top)
            if torch.equal(new, zero):
                break
            zero = new
        return zero
    out = zero.reshape(-1, 1).clone()
    moving = torch.arange(out.shape[0], device=w.device)
    w_m, s_m, z_m = w.reshape(-1, g), scale.reshape(-1, 1), out
    for _ in range(iters):
        _, _, new = _hqq_step(w_m, s_m, z_m, top)
        moved = (new != z_m).squeeze(1)
        if not bool(moved.any()):
            break
        out[moving] = new
        if bool(moved.all()):
            z_m = new
            continue
        keep = moved.nonzero().squeeze(1)
        moving, w_m, s_m, z_m = moving[keep], w_m[keep], s_m[keep], new[keep]
    return out.reshape(zero.shape)


class HqqFormat(QuantFormat):
    """HQQ codes with a half-quadratic zero point (see the module docstring)."""

    name = "hqq"
    mappings = ("asymmetric",)
    supports_static = False  # the zero point is fitted to the values, not to a range

    def validate(self, spec: Spec) -> None:
        if spec.bits not in BITS:
            raise ValueError(f"QuantSpec.bits must be 1, 2, 4 or 8 for format 'hqq' (hqq packs 3-bit codes ten to an "
                             f"int32 across rows, which has no per-row byte count); got {spec.bits}")
        super().validate(spec)
        if spec.granularity not in ("group", "token"):
            raise ValueError(f"format 'hqq' quantizes groups along head_dim (hqq's axis=1): granularity must be "
                             f"'group' or 'token'; got {spec.granularity!r}")
        if spec.zero_point != "float":
            raise ValueError(f"format 'hqq' keeps a float zero point (round_zero=False): zero_point must be 'float'; "
                             f"got {spec.zero_point!r}")
        if spec.clip_ratio != 1.0:
            raise ValueError("format 'hqq' takes no clip_ratio (its solver moves the zero point instead)")

    def code_bits(self, spec: Spec) -> int:
        return spec.bits

    def short_name(self, spec: Spec) -> str:
        return f"hqq{spec.bits}"

    def code_dtype(self, spec: Spec) -> torch.dtype:
        return torch.uint8

    def range_qparams(self, mn: torch.Tensor, mx: torch.Tensor, spec: Spec) -> QParams:
        raise ValueError("format 'hqq' fits its zero point to the values (half-quadratic solver); it takes no range "
                         "or fixed parameters")

    def _storage(self, spec: Spec, fallback: torch.dtype) -> torch.dtype:
        return fallback if spec.scale_dtype == MODEL_DTYPE else SCALE_TORCH_DTYPES[spec.scale_dtype]

    def fit(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> tuple[torch.Tensor, QParams]:
        """Codes (uint8, xv's shape) and the stored (scale, zero) ``[..., 1]`` of segment xv ``[..., g]`` (groups
        along its last dim): `hqq_fit` in float32, codes from the float32 c and z (as hqq), parameters rounded to
        the storage dtype."""
        mn, mx = xv.amin(-1, keepdim=True), xv.amax(-1, keepdim=True)
        check_finite(mn, mx)
        codes, c, z = hqq_fit(xv.to(torch.float32).contiguous(), spec.bits)
        sdt = self._storage(spec, xv.dtype)
        wide = torch.promote_types(c.dtype, sdt)  # a float64 storage holds the float32 values exactly
        return codes.to(torch.uint8), QParams(store((1.0 / c).to(wide), sdt), store(z.to(wide), sdt))

    def group_qparams(self, xv: torch.Tensor, dims: tuple[int, ...] | None, spec: Spec) -> QParams:
        return self.fit(xv, dims, spec)[1]

    def encode(self, xv: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """Codes from given (stored) parameters: ``clamp(round(x * (1 / s) + z), 0, 2^b - 1)``. kveval's own paths
        call `fit` (codes from hqq's float32 inverse scale), this only for parameters passed to ``quantize``."""
        assert zero_point is not None
        top = 2**spec.bits - 1
        return torch.round(xv * (1.0 / scale) + zero_point).clamp_(0, top).to(torch.uint8)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               spec: Spec) -> torch.Tensor:
        """``x^ = (q - z) * s`` in the storage dtype (hqq's ``Quantizer.dequantize`` in its compute_dtype), returned
        in scale's dtype."""
        assert zero_point is not None
        sdt = self._storage(spec, scale.dtype)
        return ((codes.to(sdt) - zero_point.to(sdt)) * scale.to(sdt)).to(scale.dtype)


FORMATS = (HqqFormat(),)
