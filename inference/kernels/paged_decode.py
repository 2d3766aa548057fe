"""Paged-attention decode as a Pallas kernel: one query token per sequence.

How it works: the grid is ``(batch, KV heads, splits)``. A program owns all
``G = H // KV`` query heads that share one KV head (padded to ``block_h``
rows, at least 16 so Triton's ``dot`` has a legal tile) and walks its slice
of the sequence's block table ``pages_per_chunk`` pages at a time: it
gathers those pages of K and V from the shared cache
(``[num_blocks, block_size, KV, D]``), dequantizes them if the cache holds
int8/fp8 codes (``code * scale[block, kv_head]``), and folds them into an
online softmax. Each K/V byte is read once per step for all heads of the
group, which is what makes GQA decode cheap.

With ``k_splits > 1`` the pages of a sequence are cut into that many slices
processed by separate programs (more parallelism for small batches, the
"flash-decoding" trick); each writes an unnormalised partial output with its
running max and sum (base 2), merged afterwards in plain JAX.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from inference.kernels.flash_prefill import compiler_params_for
from inference.kernels.reference import MASK_VALUE, Array, check_paged_cache

__all__ = ["DecodeBlocks", "paged_decode", "supports"]

_LOG2E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class DecodeBlocks:
    """Pages gathered per inner step, sequence splits, and Triton launch parameters."""

    pages_per_chunk: int = 8
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        p = self.pages_per_chunk
        if p < 1 or p & (p - 1):
            raise ValueError(f"pages_per_chunk must be a positive power of two, got {p}")
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(page_size: int, head_dim: int) -> bool:
    """Whether the compiled kernel handles this cache geometry (Triton tiles are powers of two)."""
    return _pow2(page_size) and _pow2(head_dim)


def _decode_kernel(
    len_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    scale: float,
    pages_per_chunk: int,
    page_size: int,
    pages_per_split: int,
    quantized: bool,
):
    if quantized:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    split = pl.program_id(2)
    length = len_ref[0]
    first_page = split * pages_per_split
    pages_needed = lax.div(length + (page_size - 1), page_size) - first_page
    num_pages = jnp.clip(pages_needed, 0, pages_per_split)
    num_chunks = lax.div(num_pages + (pages_per_chunk - 1), pages_per_chunk)
    q = q_ref[...]  # [block_h, D]
    block_h, d = q.shape
    chunk_tokens = pages_per_chunk * page_size
    qk_scale = scale * _LOG2E

    def load(ref, scale_ref, pages):
        x = ref[pages]  # [pages_per_chunk, page_size, D]
        if quantized:
            x = x.astype(jnp.float32) * scale_ref[pages][:, None, None]
        return x.reshape(chunk_tokens, d).astype(q.dtype)

    def body(c, carry):
        acc, m_prev, l_prev = carry
        pages = bt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k = load(k_ref, ks_ref if quantized else None, pages)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * qk_scale  # [block_h, chunk_tokens]
        tok = (first_page + c * pages_per_chunk) * page_size + lax.broadcasted_iota(
            jnp.int32, (1, chunk_tokens), 1
        )
        s = jnp.where(tok < length, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        v = load(v_ref, vs_ref if quantized else None, pages)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, m_next, l_next

    init = (
        jnp.zeros((block_h, d), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    acc, m_i, l_i = lax.fori_loop(0, num_chunks, body, init)
    o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "platform"))
def paged_decode(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    block_tables: Array,
    context_lens: Array,
    *,
    scale: float,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    blocks: DecodeBlocks = DecodeBlocks(),
    interpret: bool = False,
    platform: str | None = None,
) -> Array:
    """Pallas paged GQA decode; same contract as the reference.

    q[B,H,D], k/v_cache[N,bs,KV,D], block_tables[B,M] int32, context_lens[B]
    int32 -> [B,H,D]. Quantized caches (int8 or float8_e4m3fn codes) need
    ``k_scale``/``v_scale`` of shape [N, KV] (float32, per block and head).
    """
    b, h, d = q.shape
    n, page_size, kv, dk = k_cache.shape
    quantized = check_paged_cache(q, k_cache, v_cache, k_scale, v_scale)
    if block_tables.ndim != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError("block_tables must be [B, M] and context_lens [B]")
    if not interpret and not (_pow2(page_size) and _pow2(d)):
        raise ValueError(f"compiled paged decode needs power-of-two page size and head dim, got {page_size}, {d}")
    group = h // kv
    block_h = max(16, pl.next_power_of_2(group))
    m = block_tables.shape[1]
    splits = min(blocks.k_splits, m)
    ppc = min(blocks.pages_per_chunk, pl.next_power_of_2(-(-m // splits)))
    if not interpret:  # Triton's dot needs >= 16 tokens per chunk
        ppc = max(ppc, pl.next_power_of_2(-(-16 // page_size)))
    per_split = -(-m // (splits * ppc)) * ppc
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, per_split * splits - m)))
    qg = q.reshape(b, kv, group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))

    kernel = functools.partial(
        _decode_kernel,
        scale=float(scale),
        pages_per_chunk=ppc,
        page_size=page_size,
        pages_per_split=per_split,
        quantized=quantized,
    )
    cache_spec = pl.BlockSpec((n, page_size, None, d), lambda bi, hi, si: (0, 0, hi, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda bi, hi, si: (bi,)),
        pl.BlockSpec((None, per_split), lambda bi, hi, si: (bi, si)),
        pl.BlockSpec((None, None, block_h, d), lambda bi, hi, si: (bi, hi, 0, 0)),
        cache_spec,
        cache_spec,
    ]
    operands = [context_lens.astype(jnp.int32), tables, qg, k_cache, v_cache]
    if quantized:
        scale_spec = pl.BlockSpec((n, None), lambda bi, hi, si: (0, hi))
        in_specs += [scale_spec, scale_spec]
        operands += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    row_spec = pl.BlockSpec((None, None, None, block_h), lambda bi, hi, si: (si, bi, hi, 0))
    acc, m_i, l_i = pl.pallas_call(
        kernel,
        grid=(b, kv, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, d), lambda bi, hi, si: (si, bi, hi, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, kv, block_h, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, kv, block_h), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, kv, block_h), jnp.float32),
        ],
        compiler_params=None if interpret else compiler_params_for(platform, blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="paged_decode",
    )(*operands)
    # Merge the splits' partial softmaxes (base 2).
    m_max = jnp.max(m_i, axis=0)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp2(m_i - m_max[None])
    l_sum = jnp.sum(l_i * w, axis=0)
    out = jnp.sum(acc * w[..., None], axis=0) / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]
    return out[:, :, :group, :].reshape(b, h, d).astype(q.dtype)
