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

__all__ = ["U", "EXP_ERROR", "gamma", "assert_within", "attention", "paged_decode", "prefill", "matmul_bound", "rope"]

U = 2.0 ** -24  # unit roundoff of float32 (round to nearest)


def gamma(n: int | np.ndarray) -> np.ndarray:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n terms in any order."""
    n = np.asarray(n, np.float64)
    return n * U / (1.0 - n * U)


def assert_within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    """|got - want| <= bound everywhere; on failure, where and by how much (error / bound)."""
    got = np.asarray(got)
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err / np.maximum(bound, np.finfo(np.float64).tiny)), err.shape)
    assert (err <= bound).all(), (f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(got {got[worst]!r}, float64 {want[worst]!r}); "
                                  f"{int((err > bound).sum())} of {err.size} outside")


# The softmax exp (cpu_simd.h exp_nonpositive), relative: the Cody-Waite reduction is exact but for
# the k * 2.12e-4 term and its add (<= 0.4 u on exp(r) for |r| <= ln2 / 2), Horner's rule on the
# degree-6 polynomial (<= 0.6 u: every term after 1 + r is below 0.07), the final two adds (<= 1.6 u:
# 1 + r >= 0.7), scaling by 2^k exact; the polynomial's own truncation error is checked separately
# (test_exp_matches_float64_on_every_level measures both). std::exp (the decode's corrections) is
# better than this.
EXP_ERROR = 3 * U


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, tile: int,
              seen: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of queries ``q [Q, H, D]`` over keys and values ``k, v [M, H, D]`` (already one
    KV row per query head), query i seeing the first ``seen[i]`` keys (default all), in float64: the
    output ``[Q, H, D]`` and its error bound for a float32 online softmax over key tiles of ``tile``.

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
    n = np.full(q64.shape[0], k64.shape[0]) if seen is None else np.asarray(seen)
    visible = (np.arange(k64.shape[0]) < n[:, None])[:, None, :]  # [Q, 1, M]
    s = np.einsum("qhd,mhd->qhm", q64 * scale, k64)
    a = np.einsum("qhd,mhd->qhm", np.abs(q64 * scale), np.abs(k64))
    top = np.where(visible, s, -np.inf).max(-1, keepdims=True)
    t = np.where(visible, s - top, -np.inf)
    w = np.exp(t)
    p = w / w.sum(-1, keepdims=True)
    o = np.einsum("qhm,mhd->qhd", p, v64)
    tiles = -(-n // tile)[:, None, None]
    low = np.where(visible, s, np.inf).min(-1, keepdims=True)
    corr = tiles * (EXP_ERROR + U) + U * (top - low)
    eta = np.where(t < -87.0, 1.0, gamma(q64.shape[-1] + 1) * a + U * np.abs(t) + EXP_ERROR + corr)
    eta = np.where(visible, eta, 0.0)
    eta_bar = (p * eta).sum(-1, keepdims=True)
    dev = np.abs(v64.transpose(1, 0, 2)[None] - o[:, :, None])  # |v_j - o| [Q, H, M, D]
    spread = np.matmul((p * (eta + eta_bar))[:, :, None, :], dev)[:, :, 0]
    sums = gamma(n[:, None, None] + tiles) * (np.einsum("qhm,mhd->qhd", p, np.abs(v64)) + np.abs(o))
    return o, spread + sums + 2 * U * np.abs(o)


def paged_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, tables: np.ndarray, ctx: np.ndarray,
                 scale: float, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention of ``q [B, H, D]`` over each row's first ``ctx[b]`` keys of the paged caches
    ``[N, BS, KV, D]`` through ``tables [B, M]``, as :func:`attention` (output and bound); rows without
    context are zeros with bound 0."""
    q, k_cache, v_cache, tables, ctx = (np.asarray(a) for a in (q, k_cache, v_cache, tables, ctx))
    want, bound = np.zeros(q.shape), np.zeros(q.shape)
    g = q.shape[1] // k_cache.shape[2]
    for row, n in enumerate(ctx):
        if n > 0:
            keys, values = (c[tables[row]].reshape(-1, *c.shape[2:])[:n].repeat(g, axis=1) for c in (k_cache, v_cache))
            (want[row],), (bound[row],) = attention(q[row][None], keys, values, scale, tile)
    return want, bound


def prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offsets: np.ndarray, kv_lens: np.ndarray, scale: float,
            tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Causal prefill attention of ``q [B, T, H, D]`` over ``k, v [B, S, KV, D]`` (query t of row b at
    position q_offsets[b] + t, seeing keys at positions up to its own and below kv_lens[b]), as
    :func:`attention`: output, bound and the mask of real queries (the rest are padding: zeros)."""
    q, k, v, q_offsets, kv_lens = (np.asarray(a) for a in (q, k, v, q_offsets, kv_lens))
    want, bound = np.zeros(q.shape), np.zeros(q.shape)
    real = np.zeros(q.shape[:2], bool)
    g = q.shape[2] // k.shape[2]
    for row in range(q.shape[0]):
        n = max(0, min(q.shape[1], min(int(kv_lens[row]), k.shape[1]) - int(q_offsets[row])))
        if n:
            keys, values = (x[row].repeat(g, axis=1) for x in (k, v))
            seen = q_offsets[row] + np.arange(n) + 1
            want[row, :n], bound[row, :n] = attention(q[row, :n], keys, values, scale, tile, seen)
            real[row, :n] = True
    return want, bound, real


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
