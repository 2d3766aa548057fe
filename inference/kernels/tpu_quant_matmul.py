"""Weight-only quantized matmul for TPU (Mosaic lowering): the codes are dequantized inside the matmul.

The GPU kernel (:mod:`inference.kernels.quant_matmul`) walks the contraction
in a loop inside one program; on TPU the contraction is the innermost grid
axis instead, so Pallas double-buffers each ``[block_k, block_n]`` tile of
1-byte codes from HBM into VMEM while the MXU works on the previous one. The
grid is ``(M / block_m, N / block_n, K / block_k)``; each program converts
its code tile to the activation dtype in VMEM, multiplies, and adds into a
float32 ``[block_m, block_n]`` scratch accumulator, reset at ``k == 0`` and
written out at the last ``k``. A per-output-channel scale multiplies the
accumulator once at the end (``x @ (c * s) == (x @ c) * s``); group-wise
scales (``scale[K // g, N]``, ``block_k`` dividing ``g``) multiply each
tile's partial product by its group's row. HBM only carries the codes.

Tiles: ``block_m`` a multiple of 8 (rows are padded up to it), ``block_n``
and ``block_k`` multiples of 128, as Mosaic's ``(8, 128)`` vector tiling
wants. On CPU the kernel runs with ``interpret=True`` (the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from inference.kernels.reference import Array

__all__ = ["TpuMatmulBlocks", "tpu_quantized_matmul"]


@dataclass(frozen=True, slots=True)
class TpuMatmulBlocks:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 512

    def __post_init__(self) -> None:
        if self.block_m < 8 or self.block_m % 8:
            raise ValueError(f"block_m must be a positive multiple of 8, got {self.block_m}")
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 128 or value % 128:
                raise ValueError(f"{name} must be a positive multiple of 128, got {value}")


def _kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, group_tiles: int | None):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    part = lax.dot_general(x, w_ref[...].astype(x.dtype), (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # fmt: skip
    if group_tiles is not None:  # this tile's group: row kk // group_tiles of the [groups, block_n] scales
        part = part * s_ref[pl.ds(lax.div(kk, group_tiles), 1), :]
    acc_ref[...] += part

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        acc = acc_ref[...]
        if group_tiles is None:
            acc = acc * s_ref[...]
        o_ref[...] = acc.astype(o_ref.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2(x: Array, rows: int, cols: int) -> Array:
    if x.shape == (rows, cols):
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def tpu_quantized_matmul(
    x: Array,
    codes: Array,
    scale: Array,
    *,
    blocks: TpuMatmulBlocks = TpuMatmulBlocks(),
    interpret: bool = False,
) -> Array:
    """``x[..., K] @ (codes[K, N] * scale)`` in ``x``'s dtype; codes int8 or fp8 (e4m3).

    ``scale`` is ``[N]`` (per output channel) or ``[K // g, N]`` (group-wise,
    ``g`` a multiple of 128).
    """
    *lead, k = x.shape
    groups = scale.shape[0] if scale.ndim == 2 else None
    n = codes.shape[1] if codes.ndim == 2 else -1
    want = (n,) if groups is None else (groups, n)
    if codes.ndim != 2 or codes.shape[0] != k or scale.shape != want or (groups and k % groups):
        raise ValueError(f"shape mismatch: x{x.shape} codes{codes.shape} scale{scale.shape}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    bm = min(blocks.block_m, _round_up(m, 8))
    bn = min(blocks.block_n, _round_up(n, 128))
    bk = min(blocks.block_k, _round_up(k, 128))
    group_tiles = None
    if groups is not None:
        group = k // groups
        if group % 128:
            raise ValueError(f"group size {group} (K {k} / {groups} groups) must be a multiple of 128 on TPU")
        bk = max(g for g in range(128, min(bk, group) + 1, 128) if group % g == 0)  # tiles never straddle groups
        group_tiles = group // bk
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    xp = _pad2(x2, mp, kp)
    wp = _pad2(codes, kp, np_)
    if groups is None:
        sp = _pad2(scale.astype(jnp.float32)[None, :], 1, np_)
        scale_spec = pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))
    else:
        g_pad = _round_up(groups, 8)  # a block of all groups: full rows, whole (8, 128) tiles
        sp = _pad2(scale.astype(jnp.float32), g_pad, np_)
        scale_spec = pl.BlockSpec((g_pad, bn), lambda i, j, kk: (0, j))
    out = pl.pallas_call(
        functools.partial(_kernel, group_tiles=group_tiles),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            scale_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tpu_quantized_matmul",
    )(xp, wp, sp)
    return out[:m, :n].reshape(*lead, n)
