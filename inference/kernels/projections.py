"""Projections in the serving layout: ``x @ W.T`` for weights stored ``[out, in]``, and the RMSNorm,
SwiGLU and residual add the native kernel fuses into them.

A projection is one of three types, and the type says how it is multiplied:
a float array ``[out, in]`` (XLA's dot, or on XLA:CPU a multiply-reduce for a
few rows), a :class:`~inference.kernels.quant.QuantizedWeightT` (1-byte codes
converted inside the multiply) or a :class:`PackedWeightT` (the native CPU
matmul's panels, ``cpu_matmul.cc``). Which types a worker's weights take is the
kernel set's choice, made once at load (:mod:`inference.kernels.kernel_set`:
its ``pack``); :func:`linear` with ``mulreduce`` (XLA:CPU) or without
(accelerators) is its ``linear``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import cpu_ffi
from inference.kernels.quant import QuantizedWeightT

__all__ = ["MULREDUCE_ROWS", "PackedWeightT", "pack_weight", "rms_norm", "linear", "norm_linear",
           "residual_linear"]

Array = jax.Array
Weight = Any  # a float array [out, in], a QuantizedWeightT or a PackedWeightT

# Row counts for which x @ W.T runs as a fused multiply-reduce instead of a dot (see linear), on XLA:CPU.
MULREDUCE_ROWS = (2, 64)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeightT:
    """A float32 projection ``W [n, in]`` in the native CPU matmul's layout (``cpu_matmul.cc``):
    ``panels [ceil(n/16), in, 16]``, 16 output columns per contiguous panel, zero-padded."""

    panels: Array
    n: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, int(self.panels.shape[1])


def pack_weight(w_t: Array | np.ndarray) -> PackedWeightT:
    """``w_t [out, in]`` (float32) as :class:`PackedWeightT`.

    Why: the projections are most of a step, and the native kernel streams each packed panel once
    while it prefetches the next (``inference/kernels/cpu_matmul.cc``): bench model, 8-layer chain,
    two threads, 32 rows 13.7 -> ~11.8 ms, 64-256 rows ~150 -> 179-190 GFLOP/s.
    """
    w = np.asarray(w_t, np.float32)
    n, k = w.shape
    p = -(-n // 16)
    padded = np.zeros((p * 16, k), np.float32)
    padded[:n] = w
    return PackedWeightT(jnp.asarray(padded.reshape(p, 16, k).transpose(0, 2, 1)), n)


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """``w * x / rms(x)``, the statistics in float32, the result in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def linear(x: Array, w_t: Weight, out_dtype: Any, *, mulreduce: bool) -> Array:
    """``x @ w_t.T`` for ``w_t`` stored ``[out, in]``, accumulated in float32.

    ``mulreduce`` (XLA:CPU): for a few rows (decode batches, short prefills)
    XLA:CPU's dot packs the whole weight matrix on every call, which costs more
    than the multiply itself; a broadcast multiply-reduce over the shared minor
    axis reads each weight row in place. Laid out ``[rows, out, in]`` (output
    already ``[rows, out]``, no transpose) it beats the ``[out, rows, in]``
    layout too. Measured on the bench model's chained projections (8 layers +
    head), one core, ms per step: 8 rows 19.4 dot / 15.7 [out, rows] / 13.8
    [rows, out]; 32 rows 35.1 / 30.3 / 25.0; 64 rows 49.0 / 49.3 / 43.1; at
    128 rows the dot catches up and past that it wins; one row stays a dot (a
    matrix-vector product XLA does well). On an accelerator it would read the
    whole weight once per row (a reduction kernel, not a GEMM): there every
    projection is a dot.
    """
    if isinstance(w_t, QuantizedWeightT):
        return _quantized(x, w_t, out_dtype, mulreduce)
    rows = math.prod(x.shape[:-1])
    if isinstance(w_t, PackedWeightT):
        y = cpu_ffi.matmul_packed_cpu(x.reshape(rows, x.shape[-1]), w_t.panels, w_t.n)
        return y.reshape(*x.shape[:-1], w_t.n).astype(out_dtype)
    if not (mulreduce and MULREDUCE_ROWS[0] <= rows <= MULREDUCE_ROWS[1]):
        return jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    y = (w_t.astype(jnp.float32)[None, :, :] * x2[:, None, :]).sum(-1)  # [rows, out]
    return y.reshape(*x.shape[:-1], w_t.shape[0]).astype(out_dtype)


def _quantized(x: Array, w: QuantizedWeightT, out_dtype: Any, mulreduce: bool) -> Array:
    """``x @ (codes * scale[:, None]).T`` as ``(x @ codes.T) * scale``: the codes are converted in the matmul.

    With ``mulreduce`` up to 64 rows: the fused multiply-reduce of :func:`linear`
    with the code-to-float32 convert inside the fusion, so a step reads the
    1-byte codes and no float copy of the weight exists (checked on the
    compiled HLO: no ``f32[out, in]`` array outside a fusion); the scale
    multiplies the ``[rows, out]`` result. One row runs as two (the row
    repeated): XLA:CPU emits a one-row reduce of a converted operand as scalar
    code, ~13x slower, and a dot would convert the whole weight to a float copy
    first (bench-model projections, one row, at load ~8: dot on converted codes
    123 ms, one-row reduce 100-150 ms, two-row reduce 7.7 ms, float dot 10 ms).
    Past 64 rows: a dot against the converted codes (a float copy of the weight
    per call, small next to a prefill's multiply), then the scale. These are
    XLA:CPU's trade-offs; on an accelerator every call is the dot on converted
    codes, which XLA fuses into the GEMM's operand.
    """
    rows = math.prod(x.shape[:-1])
    if rows > MULREDUCE_ROWS[1] or not mulreduce:
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        y = jax.lax.dot_general(x, w.codes.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * w.scale).astype(out_dtype)
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    if rows == 1:
        x2 = jnp.concatenate([x2, x2])
    y = (w.codes.astype(jnp.float32)[None, :, :] * x2[:, None, :]).sum(-1)[:rows] * w.scale  # [rows, out]
    return y.reshape(*x.shape[:-1], w.codes.shape[0]).astype(out_dtype)


def norm_linear(x: Array, norm: Array, eps: float, w_t: Weight, live: Array | None, out_dtype: Any, *,
                mulreduce: bool) -> Array:
    """``linear(rms_norm(x, norm, eps), w_t)``. A packed weight norms each row inside the native matmul as
    it packs x (``cpu_matmul.cc``), so XLA runs no reduce and no scale of its own, and multiplies only
    the ``live`` rows (per group of rows, how many lead ones are real: see
    :func:`inference.kernels.cpu_ffi.matmul_packed_cpu`)."""
    if not isinstance(w_t, PackedWeightT):
        return linear(rms_norm(x, norm, eps), w_t, out_dtype, mulreduce=mulreduce)
    y = cpu_ffi.matmul_packed_cpu(x.reshape(-1, x.shape[-1]), w_t.panels, w_t.n, live=live, norm=norm, eps=eps)
    return y.reshape(*x.shape[:-1], w_t.n).astype(out_dtype)


def residual_linear(res: Array, x: Array, w_t: Weight, live: Array | None, *, swiglu: bool,
                    mulreduce: bool) -> Array:
    """``res + linear(x, w_t)``; with ``swiglu``, ``x`` is gate | up and ``silu(gate) * up`` is
    multiplied. A packed weight does both inside the native matmul (the SwiGLU as it packs x, the add as
    it stores y), for the ``live`` rows only."""
    if not isinstance(w_t, PackedWeightT):
        if swiglu:
            gate, up = jnp.split(x, 2, axis=-1)
            x = jax.nn.silu(gate) * up
        return res + linear(x, w_t, x.dtype, mulreduce=mulreduce)
    y = cpu_ffi.matmul_packed_cpu(x.reshape(-1, x.shape[-1]), w_t.panels, w_t.n, live=live,
                                  residual=res.reshape(-1, w_t.n), swiglu=swiglu)
    return y.reshape(res.shape).astype(res.dtype)
