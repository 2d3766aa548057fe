"""Weight-only quantized matmul as a Pallas kernel: dequantization inside the matmul.

How it works: the grid is ``(row blocks, column blocks)``; each program keeps
a ``[block_m, block_n]`` float32 accumulator and walks the contraction
dimension ``block_k`` at a time, loading the activation tile and the int8 /
fp8 weight-code tile and converting the codes to the activation dtype in
registers just before the ``dot``. The per-output-channel scale is applied
once to the accumulator at the end (``x @ (c * s) == (x @ c) * s``), so HBM
only ever carries the 1-byte codes: the weight read, which dominates decode
matmuls, is halved against bf16.

Group-wise scales (``scale[K // g, N]``): ``block_k`` is capped at ``g`` so a
contraction tile never straddles two groups, and each tile's partial product
is scaled by its group's row of scales before it is accumulated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from inference.kernels.flash_prefill import compiler_params_for
from inference.kernels.reference import Array

__all__ = ["MatmulBlocks", "pallas_quantized_matmul"]


@dataclass(frozen=True, slots=True)
class MatmulBlocks:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, group: int | None):
    x_dtype = x_ref.dtype

    def body(i, acc):
        start = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(start, block_k)]
        w = w_ref[pl.ds(start, block_k), :].astype(x_dtype)
        part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        if group is not None:  # this tile's group scales, [1, block_n]
            part = part * s_ref[pl.ds(i // (group // block_k), 1), :]
        return acc + part

    block_m, block_n = o_ref.shape
    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
    if group is None:
        acc = acc * s_ref[...][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad2(x: Array, rows: int, cols: int) -> Array:
    if x.shape == (rows, cols):
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "platform"))
def pallas_quantized_matmul(
    x: Array,
    codes: Array,
    scale: Array,
    *,
    blocks: MatmulBlocks = MatmulBlocks(),
    interpret: bool = False,
    platform: str | None = None,
) -> Array:
    """``x[..., K] @ (codes[K, N] * scale)`` in ``x``'s dtype, codes int8 or fp8.

    ``scale`` is ``[N]`` (per output channel) or ``[K // g, N]`` (group-wise,
    ``g`` a power of two).
    """
    *lead, k = x.shape
    groups = scale.shape[0] if scale.ndim == 2 else None
    n = codes.shape[1] if codes.ndim == 2 else -1
    want = (n,) if groups is None else (groups, n)
    if codes.ndim != 2 or codes.shape[0] != k or scale.shape != want or (groups and k % groups):
        raise ValueError(f"shape mismatch: x{x.shape} codes{codes.shape} scale{scale.shape}")
    group = None if groups is None else k // groups
    if group is not None and group & (group - 1):
        raise ValueError(f"group size {group} (K {k} / {groups} groups) must be a power of two")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    floor = 1 if interpret else 16  # Triton dot tiles are >= 16 wide
    bm = max(floor, min(blocks.block_m, pl.next_power_of_2(m)))
    bn = max(floor, min(blocks.block_n, pl.next_power_of_2(n)))
    bk = max(floor, min(blocks.block_k, pl.next_power_of_2(k)))
    if group is not None:
        if group < floor:
            raise ValueError(f"group size {group} is below the smallest compiled tile ({floor})")
        bk = min(bk, group)  # a tile never straddles two groups; K is a multiple of the group
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    xp = _pad2(x2, mp, kp)
    wp = _pad2(codes, kp, np_)
    if group is None:
        sp = jnp.pad(scale.astype(jnp.float32), (0, np_ - n))
        scale_spec = pl.BlockSpec((bn,), lambda i, j: (j,))
    else:
        sp = _pad2(scale.astype(jnp.float32), groups, np_)
        scale_spec = pl.BlockSpec((groups, bn), lambda i, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, group=group),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
            scale_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        compiler_params=None if interpret else compiler_params_for(platform, blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="quantized_matmul",
    )(xp, wp, sp)
    return out[:m, :n].reshape(*lead, n)
