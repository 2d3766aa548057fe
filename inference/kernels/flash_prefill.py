"""Flash-attention prefill as a Pallas kernel: causal, GQA, ragged lengths.

How it works: the grid is ``(query blocks, batch, query heads)``. Each program
holds one ``[block_q, D]`` tile of queries in registers and streams the keys
and values of its KV head (``h // group``) in ``[block_k, D]`` tiles, keeping
the FlashAttention-2 running max ``m``, running sum ``l`` and an unnormalised
accumulator. Softmax is computed base 2 (``exp2``) with ``log2(e)`` folded
into the scale. The key loop stops at the last tile that any query of the
block can see: ``min(kv_len, q_offset + (i+1)*block_q)``, so causal prefill
does about half the work of full attention, and a short sequence in a padded
batch costs only its own length.

Shapes follow ``inference.kernels.reference.prefill_attention``. Sequence
lengths are padded here to multiples of the block sizes and the head dim to a
power of two (Triton needs power-of-two tiles); padding is sliced off.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from inference.kernels.reference import MASK_VALUE, Array, check_paged_cache, check_prefill_args

__all__ = ["PrefillBlocks", "flash_prefill", "paged_flash_prefill", "compiler_params_for"]

_LOG2E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class PrefillBlocks:
    """Tile sizes (powers of two) and Triton launch parameters."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")


def _dot_nt(a: Array, b: Array) -> Array:
    """a[M,D] @ b[N,D].T accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a: Array, b: Array) -> Array:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _prefill_kernel(
    qoff_ref, kvlen_ref, *refs, scale: float, block_q: int, block_k: int, seq_k: int, page_size: int | None = None,
    quantized: bool = False,
):  # fmt: skip
    """One query block of one head. Dense: ``q, k, v, out`` refs, k/v ``[S, D]``. Paged (``page_size``):
    ``table, q, k_cache, v_cache, [k_scale, v_scale,] out`` refs, each key tile gathered page by page."""
    if page_size is None:
        bt_ref, (q_ref, k_ref, v_ref, o_ref), ks_ref, vs_ref = None, refs, None, None
    elif quantized:
        bt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref = refs
    else:
        (bt_ref, q_ref, k_ref, v_ref, o_ref), ks_ref, vs_ref = refs, None, None
    # Heaviest causal tiles first: program 0 takes the last query block, so
    # the long-running programs start early and the tail of the launch is short.
    i = pl.num_programs(0) - 1 - pl.program_id(0)
    q_off = qoff_ref[0]
    kv_len = jnp.minimum(kvlen_ref[0], seq_k)
    q = q_ref[...]  # [block_q, D]
    d = q.shape[-1]
    first_q = q_off + i * block_q
    q_pos = first_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    # Keys visible to any query of this tile: [0, min(kv_len, last query pos + 1)).
    hi = jnp.maximum(jnp.minimum(kv_len, first_q + block_q), 0)
    num_tiles = lax.div(hi + (block_k - 1), block_k)
    # Tiles every query of the block sees in full need no mask.
    num_full = jnp.minimum(lax.div(jnp.minimum(first_q + 1, kv_len), block_k), num_tiles)
    qk_scale = scale * _LOG2E

    def load(ref, scale_ref, start):
        if bt_ref is None:
            return ref[pl.ds(start, block_k), :]
        pages_per_tile = block_k // page_size
        pages = bt_ref[pl.ds(lax.div(start, page_size), pages_per_tile)]
        x = ref[pages]  # [pages_per_tile, page_size, D]
        if quantized:
            x = x.astype(jnp.float32) * scale_ref[pages][:, None, None]
        return x.reshape(block_k, d).astype(q.dtype)

    def make_body(masked: bool):
        def body(j, carry):
            acc, m_prev, l_prev = carry
            start = pl.multiple_of(j * block_k, block_k)
            k = load(k_ref, ks_ref, start)
            s = _dot_nt(q, k) * qk_scale  # [block_q, block_k]
            if masked:
                k_pos = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
                s = jnp.where((k_pos <= q_pos) & (k_pos < kv_len), s, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            correction = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - m_next[:, None])
            l_next = l_prev * correction + jnp.sum(p, axis=1)
            v = load(v_ref, vs_ref, start)
            acc = acc * correction[:, None] + _dot_nn(p.astype(v.dtype), v)
            return acc, m_next, l_next

        return body

    carry = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, num_full, make_body(False), carry)
    acc, _, l_sum = lax.fori_loop(num_full, num_tiles, make_body(True), carry)
    l_sum = jnp.where(l_sum == 0.0, 1.0, l_sum)  # empty sequence: output zeros
    o_ref[...] = (acc / l_sum[:, None]).astype(o_ref.dtype)


def _pad_axis(x: Array, axis: int, size: int) -> Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def compiler_params_for(platform: str | None, num_warps: int, num_stages: int):
    """Triton launch parameters for GPU lowering (``platform`` None: the family's own, GPU); None for
    any other platform."""
    if platform in (None, "gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return None


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "platform"))
def flash_prefill(
    q: Array,
    k: Array,
    v: Array,
    q_offsets: Array,
    kv_lens: Array,
    *,
    scale: float,
    blocks: PrefillBlocks = PrefillBlocks(),
    interpret: bool = False,
    platform: str | None = None,
) -> Array:
    """Pallas causal GQA prefill attention; same contract as the reference.

    q[B,T,H,D], k/v[B,S,KV,D], q_offsets[B] int32, kv_lens[B] int32 -> [B,T,H,D].
    ``platform`` is the one lowered for (None: GPU, this family's own; Triton's
    launch parameters go with it); ``interpret`` runs the kernel body as plain
    JAX (CPU tests).
    """
    b, t, h, d = q.shape
    s = k.shape[1]
    group = check_prefill_args(q, k, v, q_offsets, kv_lens)
    # Triton's dot needs every tile dimension >= 16; interpretation does not.
    floor = 1 if interpret else 16
    block_q = max(floor, min(blocks.block_q, pl.next_power_of_2(t)))
    block_k = max(floor, min(blocks.block_k, pl.next_power_of_2(s)))
    d_pad = max(floor, pl.next_power_of_2(d))
    t_pad, s_pad = _round_up(t, block_q), _round_up(s, block_k)
    qp = _pad_axis(_pad_axis(q, 1, t_pad), 3, d_pad)
    kp = _pad_axis(_pad_axis(k, 1, s_pad), 3, d_pad)
    vp = _pad_axis(_pad_axis(v, 1, s_pad), 3, d_pad)

    nq = t_pad // block_q  # query blocks, launched last-first (see the kernel)
    kernel = functools.partial(
        _prefill_kernel, scale=float(scale), block_q=block_q, block_k=block_k, seq_k=s
    )
    compiler_params = (
        None if interpret else compiler_params_for(platform, blocks.num_warps, blocks.num_stages)
    )
    out = pl.pallas_call(
        kernel,
        grid=(nq, b, h),
        in_specs=[
            pl.BlockSpec((1,), lambda i, bi, hi: (bi,)),
            pl.BlockSpec((1,), lambda i, bi, hi: (bi,)),
            pl.BlockSpec((None, block_q, None, d_pad), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
            pl.BlockSpec((None, s_pad, None, d_pad), lambda i, bi, hi: (bi, 0, hi // group, 0)),
            pl.BlockSpec((None, s_pad, None, d_pad), lambda i, bi, hi: (bi, 0, hi // group, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, d_pad), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="flash_prefill",
    )(q_offsets.astype(jnp.int32), kv_lens.astype(jnp.int32), qp, kp, vp)
    return out[:, :t, :, :d]


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "platform"))
def paged_flash_prefill(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    block_tables: Array,
    q_offsets: Array,
    kv_lens: Array,
    *,
    scale: float,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    blocks: PrefillBlocks = PrefillBlocks(),
    interpret: bool = False,
    platform: str | None = None,
) -> Array:
    """Causal GQA prefill reading keys and values straight from the paged cache.

    q[B,T,H,D], k/v_cache[N,bs,KV,D] (float in q's dtype, or int8/fp8 codes
    with ``k_scale``/``v_scale`` [N, KV]), block_tables[B,M], q_offsets[B],
    kv_lens[B] -> [B,T,H,D]; the same result as gathering each row's table
    into ``[B, M*bs, KV, D]`` and calling :func:`flash_prefill`, without that
    copy: each key tile is ``block_k / bs`` pages loaded through the table,
    dequantized in registers, and tiles past a row's keys are never loaded.
    Table entries are clamped into ``[0, N)``.
    """
    b, t, h, d = q.shape
    n, bs, kv, dk = k_cache.shape
    quantized = check_paged_cache(q, k_cache, v_cache, k_scale, v_scale)
    if block_tables.ndim != 2 or block_tables.shape[0] != b or q_offsets.shape != (b,) or kv_lens.shape != (b,):
        raise ValueError("block_tables must be [B, M], q_offsets and kv_lens [B]")
    if bs & (bs - 1) or (not interpret and d & (d - 1)):
        raise ValueError(f"paged prefill needs a power-of-two page size (and head dim when compiled), got {bs}, {d}")
    group = h // kv
    floor = 1 if interpret else 16
    m = block_tables.shape[1]
    block_q = max(floor, min(blocks.block_q, pl.next_power_of_2(t)))
    block_k = max(floor, bs, min(blocks.block_k, pl.next_power_of_2(m * bs)))  # whole pages per tile
    pages_per_tile = block_k // bs
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, n - 1)
    tables = _pad_axis(tables, 1, _round_up(m, pages_per_tile))
    t_pad = _round_up(t, block_q)
    qp = _pad_axis(q, 1, t_pad)
    nq = t_pad // block_q
    kernel = functools.partial(_prefill_kernel, scale=float(scale), block_q=block_q, block_k=block_k, seq_k=m * bs,
                               page_size=bs, quantized=quantized)  # fmt: skip
    cache_spec = pl.BlockSpec((n, bs, None, d), lambda i, bi, hi: (0, 0, hi // group, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda i, bi, hi: (bi,)),
        pl.BlockSpec((1,), lambda i, bi, hi: (bi,)),
        pl.BlockSpec((None, tables.shape[1]), lambda i, bi, hi: (bi, 0)),
        pl.BlockSpec((None, block_q, None, d), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
        cache_spec,
        cache_spec,
    ]
    operands = [q_offsets.astype(jnp.int32), kv_lens.astype(jnp.int32), tables, qp, k_cache, v_cache]
    if quantized:
        scale_spec = pl.BlockSpec((n, None), lambda i, bi, hi: (0, hi // group))
        in_specs += [scale_spec, scale_spec]
        operands += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(nq, b, h),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda i, bi, hi: (bi, nq - 1 - i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=None if interpret else compiler_params_for(platform, blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="paged_flash_prefill",
    )(*operands)
    return out[:, :t]
