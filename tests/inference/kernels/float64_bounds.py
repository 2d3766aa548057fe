"""Float64 references for the native CPU kernels, each with a first-order bound on the float32 error.

Why bounds and not a tolerance: a fixed ``atol`` sits either under the float32 error that a
different instruction set's reduction order or FMA contraction legitimately gives (``make test``
failed on an AVX-512 machine at 3.1e-5 > 2e-5, against a float32 reference with its own error of the
same size), or so far above it that it hides a bug. Each function here computes the exact result in
float64 and, per output element, how far any float32 evaluation order can move it (standard rounding
error analysis, Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3): the kernels may
sum in any order, contract to FMA or not, and still must land inside. Terms of order u^2 are left
out. Measured on the tests' inputs, the kernels' errors reach 10-30% of these bounds on every level;
a wrong mask, a lost correction or a sloppy exp (the 62 u one of the generic level before the
association barrier) lands far outside.
"""

from __future__ import annotations

import numpy as np

__all__ = ["U", "EXP_ERROR", "gamma", "attention", "matmul_bound", "rope"]

U = 2.0 ** -24  # unit roundoff of float32 (round to nearest)


def gamma(n: int | np.ndarray) -> np.ndarray:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n terms in any order."""
    n = np.asarray(n, np.float64)
    return n * U / (1.0 - n * U)


# The softmax exp (cpu_simd.h exp_nonpositive), relative: the Cody-Waite reduction is exact but for
# the k * 2.12e-4 term and its add (<= 0.4 u on exp(r) for |r| <= ln2 / 2), Horner's rule on the
# degree-6 polynomial (<= 0.6 u: every term after 1 + r is below 0.07), the final two adds (<= 1.6 u:
# 1 + r >= 0.7), scaling by 2^k exact; the polynomial's own truncation error is checked separately
# (test_exp_matches_float64_on_every_level measures both). std::exp (the decode's corrections) is
# better than this.
EXP_ERROR = 3 * U


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of queries ``q [H, D]`` over keys and values ``k, v [M, H, D]`` (already one
    KV row per query head), in float64: the output ``[H, D]`` and its error bound ``[H, D]`` for a
    float32 online softmax over key tiles of ``tile`` keys.

    How the bound goes (first order in u; p_j the exact weights, o the exact output):

    - Perturbing each weight's exponent by eta_j moves the output by sum_j p_j (eta_j - eta_bar)
      (v_j - o) (the weights' common factor cancels in the normalisation), so its size is at most
      sum_j p_j (eta_j + eta_bar) |v_j - o|, eta_bar = sum_j p_j eta_j.
    - eta_j: the score s_j = (scale q) . k_j in float32 errs by at most gamma_{D+1} sum |scale q k_j|
      (D products and sums, and scaling q); s_j - max rounds by u |s_j - max| (the running max is
      at most the final one); exp adds EXP_ERROR; inputs below -87 give 0 (eta 1, weight < e^-87).
    - The online corrections exp(m_old - m_new): one per tile (EXP_ERROR + u for the exp and the
      multiply, T tiles), and the rounding of the max differences, which telescope to at most
      u (max - min) of the scores. Every key may carry all of them.
    - The weighted sum and the denominator: M products and sums plus T corrections each, so
      gamma_{M+T} (sum_j p_j |v_j| + |o|); the final reciprocal and multiply 2 u |o|.
    """
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    m = k64.shape[0]
    s = np.einsum("hd,mhd->hm", q64 * scale, k64)
    a = np.einsum("hd,mhd->hm", np.abs(q64 * scale), np.abs(k64))
    top = s.max(-1, keepdims=True)
    t = s - top
    w = np.exp(t)
    p = w / w.sum(-1, keepdims=True)
    o = np.einsum("hm,mhd->hd", p, v64)
    tiles = -(-m // tile)
    corr = tiles * (EXP_ERROR + U) + U * (top - s.min(-1, keepdims=True))
    eta = gamma(q64.shape[-1] + 1) * a + U * np.abs(t) + EXP_ERROR + corr
    eta = np.where(t < -87.0, 1.0, eta)
    eta_bar = (p * eta).sum(-1, keepdims=True)
    spread = np.einsum("hm,mhd->hd", p * (eta + eta_bar), np.abs(v64 - o[None]))
    sums = gamma(m + tiles) * (np.einsum("hm,mhd->hd", p, np.abs(v64)) + np.abs(o))
    return o, spread + sums + 2 * U * np.abs(o)


def matmul_bound(x: np.ndarray, w: np.ndarray, rel_x: float = 0.0) -> np.ndarray:
    """The error bound of float32 ``x [M, K] @ w [N, K].T`` (any summation order, FMA or not), when x's
    entries already carry a relative error of ``rel_x``: (gamma_K + rel_x) |x| @ |w|.T."""
    x64, w64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    return (gamma(x64.shape[-1]) + rel_x) * (x64 @ w64.T)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rotate-half RoPE of ``x [R, heads, D]`` by the float32 tables ``cos, sin [R, D/2]`` in
    float64, and its float32 bound: each output is a product pair and one add, gamma_2 (|a c| + |b s|)."""
    x64 = np.asarray(x, np.float64)
    c, s = (np.asarray(a, np.float64)[:, None, :] for a in (cos, sin))
    half = x64.shape[-1] // 2
    x1, x2 = x64[..., :half], x64[..., half:]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    size = np.concatenate([np.abs(x1 * c) + np.abs(x2 * s), np.abs(x2 * c) + np.abs(x1 * s)], axis=-1)
    return out, gamma(2) * size
