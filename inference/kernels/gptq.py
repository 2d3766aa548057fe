"""GPTQ: error-compensating weight quantization to the storage format of round-to-nearest.

Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers". A linear map ``y = x @ W.T`` (``W``
stored ``[out, in]``) is quantized to minimise the output error
``||X W.T - X Q.T||^2`` over calibration inputs ``X [n, in]``, not the weight
error. That objective's Hessian is ``H = 2 X^T X`` (the factor 2 does not
matter), the same for every output row, so all rows are quantized at once.

How it works: columns (input features) are quantized one at a time, in
order. Quantizing column ``i`` leaves an error ``w_i - q_i`` per row; the
optimal update of the columns not yet quantized, given that error, is
``W[:, j>i] -= (w_i - q_i) / U[i, i] * U[i, j>i]`` where ``U`` is the upper
Cholesky factor of ``H^-1`` (``H^-1 = U^T U``). Cholesky of the inverse
folds in the removal of each quantized column from the inverse Hessian (the
OBQ update) exactly, so one factorisation serves every step. Columns go in
blocks of ``block`` with the updates to later blocks applied lazily (one
matmul per block), which is the paper's speed trick; the result is the same.
``H`` is dampened by ``damp`` times its mean diagonal (1% as in the paper)
for a stable inverse; inputs that are always zero (``H[i, i] == 0``) get
weight 0 and a unit diagonal.

Storage is unchanged: symmetric codes (int8, or fp8 e4m3fn) with one
float32 scale per output row, chosen before the loop from the row's amax
(``amax / qmax``, as round-to-nearest does), so the runner's matmul cannot
tell the two apart. Only which code each weight gets differs.
"""

from __future__ import annotations

import numpy as np

from inference.kernels.quant import QMAX

__all__ = ["GPTQ_DAMP", "hessian", "gptq_quantize"]

GPTQ_DAMP = 0.01


def hessian(x: np.ndarray) -> np.ndarray:
    """``X^T X`` (float64) of calibration inputs ``x[..., in]``, every leading position one sample."""
    x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    return x2.T @ x2


def _round(w: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """Codes of ``w / scale`` (float64 values of the code grid), clipped to the kind's range."""
    q = np.clip(w / scale, -QMAX[kind], QMAX[kind])
    if kind == "int8":
        return np.round(q)
    import ml_dtypes

    return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper ``U`` with ``U^T U = (H + damp * mean(diag H) * I)^-1``."""
    h = h + damp * np.mean(np.diag(h)) * np.eye(h.shape[0])
    h_inv = np.linalg.inv(h)
    return np.linalg.cholesky(h_inv).T  # numpy gives lower L with L L^T = H^-1, so U = L^T


def gptq_quantize(w_t: np.ndarray, h: np.ndarray, kind: str = "int8", *, damp: float = GPTQ_DAMP,
                  block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w_t[out, in]`` against the Hessian ``h[in, in]``: (codes ``[out, in]`` as float64
    values on the code grid, scale ``[out]`` float32). Dequantized weight: ``codes * scale[:, None]``."""
    if kind not in QMAX:
        raise ValueError(f"unknown quantization kind {kind!r}; expected 'int8' or 'fp8'")
    w = np.array(w_t, np.float64)
    h = np.array(h, np.float64)
    if w.ndim != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"weight {w.shape} [out, in] and Hessian {h.shape} [in, in] do not match")
    scale = (np.abs(w).max(axis=1) / QMAX[kind]).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float64)[:, None]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    u = _inverse_cholesky(h, damp)
    codes = np.zeros_like(w)
    n = w.shape[1]
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        err = np.zeros((w.shape[0], b1 - b0))
        for i in range(b0, b1):
            col = w[:, i:i + 1]
            codes[:, i:i + 1] = _round(col, safe, kind)
            e = (col - codes[:, i:i + 1] * safe) / u[i, i]
            w[:, i + 1:b1] -= e * u[i, i + 1:b1]
            err[:, i - b0:i - b0 + 1] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes, scale
