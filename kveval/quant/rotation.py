"""Rotations of head_dim vectors, the one home of kveval's Hadamard and random rotations (pure maths, torch only).

- :func:`hadamard_matrix`: the normalised Sylvester-Hadamard matrix ``H_n`` of order n (a power of two):
  ``H_1 = [1/sqrt(n)]``, ``H_2s = [[H_s, H_s], [H_s, -H_s]]``; symmetric and orthonormal, hence self-inverse.
  Its entries are +-1/sqrt(n) rounded once to the dtype, as llama.cpp fills its float32 matrix with 1/sqrtf(n).
- :func:`rotate_blocks`: ``x [..., D]`` times ``blockdiag(H_n, ..., H_n)`` (n dividing D): llama.cpp's attention
  rotation (``kveval.transforms.hadamard``), the ``rotate`` transform's Hadamard kinds.
- :func:`walsh_hadamard`: the unnormalised Walsh-Hadamard transform by butterflies (``H H = D I``), as vLLM's
  ``fast_hadamard_transform`` CPU tier computes it (its per-token-head formats); the same matrix as
  ``sqrt(D) * hadamard_matrix(D)`` but another order of additions, so not the same rounding.
- :func:`random_matrix`: seeded random rotations in float64: ``orthogonal`` (Haar: QR of a Gaussian matrix with
  the signs of R's diagonal moved into Q) or ``signs`` (``diag(s)``, s in {-1, +1}^D).
- :func:`rotation_matrix`: the matrix M of a ``rotate`` transform (``hadamard``, ``hadamard_signs``, ``orthogonal``).

A row vector x is rotated as ``x M``. Worked: ``hadamard_matrix(2) = [[1, 1], [1, -1]] / sqrt(2)``; the butterfly
of [1, 2, 3, 4] is [10, -2, -4, 0].
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

#: the random kinds of :func:`random_matrix`, the kinds of :func:`rotation_matrix`
RANDOM_KINDS = ("orthogonal", "signs")
ROTATION_KINDS = ("hadamard", "hadamard_signs", "orthogonal")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@lru_cache(maxsize=32)
def _sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if dtype == torch.float64:  # IEEE 1/sqrt(n) from Python's math: torch's float64 sqrt is 1 ulp off on some CPUs
        scale = torch.tensor(1.0 / math.sqrt(n), dtype=dtype)
    else:
        scale = torch.tensor(float(n), dtype=dtype).sqrt().reciprocal()
    return h.to(dtype) * scale


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix ``[n, n]`` (n a power of two), symmetric and self-inverse; memoized
    per (n, dtype) on the CPU. Worked: n = 2: [[1, 1], [1, -1]] / sqrt(2)."""
    if not is_power_of_two(n):
        raise ValueError(f"a Hadamard block must be a power of two; got {n}")
    return _sylvester(n, dtype).to(device)


def rotate_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [..., D]`` rotated in consecutive groups of n channels: ``y[..., g*n:(g+1)*n] = H_n x[..., g*n:(g+1)*n]``
    (a new tensor of x's shape and dtype; float16/bfloat16 inputs are rotated in float32)."""
    d = x.shape[-1]
    if d % n:
        raise ValueError(f"Hadamard block {n} does not divide head_dim {d}")
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    h = hadamard_matrix(n, work.dtype, work.device)
    y = (work.reshape(*x.shape[:-1], d // n, n) @ h).reshape(x.shape)  # H symmetric: row @ H = H @ column
    return y.to(x.dtype)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform along the last dimension (Sylvester order, H H = D I; D a power of
    two), as the butterfly of vLLM's ``fast_hadamard_transform`` CPU tier: pairs (a, b) at stride h -> (a + b,
    a - b), h = 1, 2, 4, ..."""
    d = x.shape[-1]
    h = 1
    while h < d:
        v = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h *= 2
    return x


@lru_cache(maxsize=256)
def random_matrix(kind: str, seed: int, head_dim: int) -> torch.Tensor:
    """A seeded random rotation ``[head_dim, head_dim]`` in float64 drawn from
    ``torch.Generator().manual_seed(seed)``: ``orthogonal`` (Haar: the QR factorisation of a standard Gaussian
    matrix with the signs of R's diagonal moved into Q, a zero sign counted as +1; Q Q^T = I to about 1e-15) or
    ``signs`` (``diag(s)``, s from ``torch.randint(0, 2, ...) * 2 - 1``)."""
    if kind not in RANDOM_KINDS:
        raise ValueError(f"'kind' must be one of {', '.join(RANDOM_KINDS)}; got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    if kind == "signs":
        s = torch.randint(0, 2, (head_dim,), generator=g).to(torch.float64) * 2 - 1
        return torch.diag(s)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    sign = torch.sign(torch.diagonal(r))
    return q * torch.where(sign == 0, 1.0, sign)[None, :]


@lru_cache(maxsize=256)
def rotation_matrix(kind: str, block: int, seed: int, head_dim: int) -> torch.Tensor:
    """M ``[head_dim, head_dim]`` float64 of a ``rotate`` transform: ``hadamard``: ``blockdiag(H_b, ...)`` (``b =
    block``, 0: the whole head_dim, which must then be a power of two); ``hadamard_signs``: ``diag(s)
    blockdiag(H_b)`` (s: ``random_matrix("signs", seed, ...)``); ``orthogonal``: ``random_matrix("orthogonal",
    seed, ...)``."""
    if kind not in ROTATION_KINDS:
        raise ValueError(f"'kind' must be one of {', '.join(ROTATION_KINDS)}; got {kind!r}")
    if kind == "orthogonal":
        return random_matrix("orthogonal", seed, head_dim)
    b = block or head_dim
    if not is_power_of_two(b) or head_dim % b:
        raise ValueError(f"a Hadamard rotation needs a power-of-two block dividing head_dim {head_dim}; got "
                         f"{'head_dim' if not block else block} (set 'block' to a power of two that divides it)")
    h = torch.block_diag(*[hadamard_matrix(b, dtype=torch.float64)] * (head_dim // b))
    if kind == "hadamard_signs":
        return random_matrix("signs", seed, head_dim) @ h
    return h


__all__ = ["RANDOM_KINDS", "ROTATION_KINDS", "hadamard_matrix", "is_power_of_two", "random_matrix",
           "rotate_blocks", "rotation_matrix", "walsh_hadamard"]
