"""Flash-attention prefill for TPU (Mosaic lowering): causal, GQA, ragged lengths.

The GPU kernel (:mod:`inference.kernels.flash_prefill`) is written for
Triton's model: a program per query head walking its keys in a loop. Mosaic
wants the opposite shape of program: blocks whose last two dimensions are
``(8, 128)``-aligned (or whole), the key loop as the innermost *grid* axis so
Pallas double-buffers each key tile into VMEM while the previous one is in the
MXU, and the running softmax state in VMEM scratch that lives across those
grid steps.

How it works: q is laid out ``[B, KV, G, T, D]`` (the ``G = H // KV`` query
heads that share a KV head side by side) and k/v ``[B, KV, S, D]``. The grid
is ``(B, KV, query blocks, key blocks)``; a program multiplies all ``G *
block_q`` query rows of its group by one ``[block_k, D]`` key tile, so each
key byte is read once per group rather than once per query head. The state
(running max ``m`` and sum ``l``, lane-replicated to ``[rows, 128]`` as
Mosaic keeps vectors, and the unnormalised ``acc``) is reset at key block 0
and written out, normalised, at the last.

Causality and ragged lengths cost nothing past a row's last visible key: the
key tiles past ``min(kv_len, last query position + 1)`` are skipped with
``pl.when``, and their index map is clamped to the last tile that is needed,
so Pallas (which fetches a block only when its index changes) does not even
copy them. Tiles every query of the block sees in full skip the mask.
``q_offsets`` and ``kv_lens`` travel as scalar prefetch (SMEM), which is
what lets the index maps read them.

On CPU the same kernel runs with ``interpret=True`` (the tests); lowering for
TPU is checked on any host with ``jax.export(..., platforms=["tpu"])``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from inference.kernels.reference import MASK_VALUE, Array, check_prefill_args

__all__ = ["TpuPrefillBlocks", "tpu_flash_prefill"]

LANES = 128  # a TPU vector register's lanes: m and l are kept replicated across them


@dataclass(frozen=True, slots=True)
class TpuPrefillBlocks:
    """Query rows per head (a multiple of 8) and keys per tile (a multiple of 128) of one program."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        if self.block_q < 8 or self.block_q % 8:
            raise ValueError(f"block_q must be a positive multiple of 8, got {self.block_q}")
        if self.block_k < LANES or self.block_k % LANES:
            raise ValueError(f"block_k must be a positive multiple of {LANES}, got {self.block_k}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _visible_end(q_off: Array, kv_len: Array, i: Array, block_q: int, seq_k: int) -> Array:
    """One past the last key any query of query block ``i`` sees."""
    return jnp.maximum(jnp.minimum(jnp.minimum(kv_len, seq_k), q_off + (i + 1) * block_q), 0)


def _prefill_kernel(
    qoff_ref, kvlen_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref,
    *, scale: float, block_q: int, block_k: int, group: int, seq_k: int,
):  # fmt: skip
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_off, kv_len = qoff_ref[b], jnp.minimum(kvlen_ref[b], seq_k)
    rows = group * block_q

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first_q = q_off + i * block_q
    start = j * block_k
    visible = start < _visible_end(q_off, kv_len, i, block_q, seq_k)
    # Every query of the block sees every key of the tile: no mask needed.
    full = (start + block_k <= first_q + 1) & (start + block_k <= kv_len)

    def step(masked: bool) -> None:
        q = q_ref[...].reshape(rows, q_ref.shape[-1])  # [G * block_q, D]
        k = k_ref[...]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if masked:
            q_pos = first_q + lax.broadcasted_iota(jnp.int32, (group, block_q, block_k), 1).reshape(rows, block_k)
            k_pos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            s = jnp.where((k_pos <= q_pos) & (k_pos < kv_len), s, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [rows, LANES], every lane the same
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, :1])
        l_ref[...] = l_prev * correction + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * correction[:, :1] + pv

    pl.when(visible & full)(lambda: step(False))
    pl.when(visible & jnp.logical_not(full))(lambda: step(True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        l_sum = l_ref[...][:, :1]
        out = acc_ref[...] / jnp.where(l_sum == 0.0, 1.0, l_sum)  # no visible key: zeros
        o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret"))
def tpu_flash_prefill(
    q: Array,
    k: Array,
    v: Array,
    q_offsets: Array,
    kv_lens: Array,
    *,
    scale: float,
    blocks: TpuPrefillBlocks = TpuPrefillBlocks(),
    interpret: bool = False,
) -> Array:
    """Causal GQA prefill attention for TPU; the contract of ``reference.prefill_attention``.

    q[B,T,H,D], k/v[B,S,KV,D], q_offsets[B] int32, kv_lens[B] int32 -> [B,T,H,D].
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    group = check_prefill_args(q, k, v, q_offsets, kv_lens)
    if k.dtype != q.dtype:
        raise ValueError(f"k/v dtype {k.dtype} must match q dtype {q.dtype}")
    block_q = min(blocks.block_q, _round_up(t, 8))
    block_k = min(blocks.block_k, _round_up(s, LANES))
    t_pad, s_pad = _round_up(t, block_q), _round_up(s, block_k)
    # [B,T,H,D] -> [B,KV,G,T,D]; [B,S,KV,D] -> [B,KV,S,D]
    qg = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))).reshape(b, t_pad, kv, group, d)
    qg = qg.transpose(0, 2, 3, 1, 4)
    kt = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    vt = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    nq, nk = t_pad // block_q, s_pad // block_k

    def kv_index(bi, hi, i, j, qoff, lens):
        # Past the last needed tile, repeat it: an unchanged block index is not fetched again.
        end = _visible_end(qoff[bi], lens[bi], i, block_q, s)
        last = jnp.maximum(lax.div(end + (block_k - 1), block_k) - 1, 0)
        return bi, hi, jnp.minimum(j, last), 0

    q_spec = pl.BlockSpec((None, None, group, block_q, d), lambda bi, hi, i, j, qoff, lens: (bi, hi, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), kv_index)
    kernel = functools.partial(
        _prefill_kernel, scale=float(scale), block_q=block_q, block_k=block_k, group=group, seq_k=s
    )
    rows = group * block_q
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kv, nq, nk),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="tpu_flash_prefill",
    )(q_offsets.astype(jnp.int32), kv_lens.astype(jnp.int32), qg, kt, vt)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t_pad, h, d)[:, :t]
