"""Paged-attention decode for TPU (Mosaic lowering): one query token per sequence, GQA, paged KV cache.

The GPU kernel (:mod:`inference.kernels.paged_decode`) gathers many pages per
program with Triton's pointer loads. Mosaic instead moves data with DMAs
described by BlockSpecs, and wants each block's last two dimensions to be
``(8, 128)``-aligned or whole. The model's cache is ``[N, bs, KV, D]``
(block, offset in block, KV head, head dim), so the unit this kernel moves is
one page of all KV heads, block ``(bs, KV, W)``: ``KV`` is whole, and ``W``
is the whole head dim up to 128 lanes, or one 128-lane chunk of a wider one
(a page of ``D = 256`` comes in as two blocks), since Mosaic's strided loads
(below) need the last dim to be one lane tile.

How it works: the grid is ``(B, steps)`` with ``steps = ceil(M /
pages_per_step)`` for ``M`` table columns. ``context_lens`` and the flattened
block table are scalar-prefetch operands (SMEM), which is what lets the index
maps read them: page ``j`` of step ``s`` of sequence ``b`` is block
``tables[b, s * pages_per_step + j]``. The caches are passed once per page
of a step (and lane chunk), each with such an index map, so Pallas
double-buffers ``pages_per_step`` pages while the previous step computes.
Columns past a sequence's last live page are clamped to that page: Pallas
copies a block only when its index changes, so they cost no HBM traffic, and
``pl.when`` skips their compute (table ids are clamped into ``[0, N)`` too,
so stray entries cannot address past the cache). The batch axis is
"parallel" (megacore may split it), the page axis "arbitrary": it carries
the online softmax.

One step, for each of its live pages and each KV head ``h`` (a static loop):

* the head's keys are rows ``h, h + KV, h + 2 KV, ...`` of the page viewed as
  ``[bs * KV, W]``, read with a strided load. Mosaic strides 32-bit rows
  only and reshapes only slabs of whole tiles (``KV`` in 1, 2, 4 or a
  multiple of 8), so a bf16/int8/fp8 page, or one with another ``KV``, is
  first converted into a float32 VMEM scratch page (one pass, shared by all
  heads; ``KV`` padded up to a whole tile there, padding never read);
* the ``G = H // KV`` query rows of the group (padded to a multiple of 8, the
  sublane tile) meet the ``[bs, W]`` keys in MXU dots, ``[G, bs]`` logits;
  tokens past the context are masked (and their values zeroed, so stale or
  non-finite cache slots cannot leak into the sum);
* the online softmax folds the page in: running max ``m`` and sum ``l``
  (lane-replicated ``[G, 128]``, as Mosaic keeps row statistics) and the
  unnormalised float32 accumulator ``[G, D]`` live in VMEM scratch across
  grid steps, reset at step 0 and normalised into the output at the last.

Quantized caches (int8 or float8_e4m3fn codes, float32 scales ``[N, KV]``):
a page's scales come in as an SMEM block ``(1, KV)`` of the scales viewed as
``[N, 1, KV]`` (whole last two dims again), so each head's scale is a scalar.
Since one page has one scale per head, dequantization is folded into the
dots: ``q . (code * s) = (q . code) * s`` for the logits and likewise
``p @ (code * s) = (p @ code) * s`` for the values, the same arithmetic as
``code.astype(f32) * scale`` up to rounding.

A sequence with ``context_lens == 0`` gets zeros (nothing is folded in and
``l == 0``), as :func:`inference.kernels.paged_decode.paged_decode` and the
model's own decode attention return; the plain reference instead averages the
whole table there (a don't-care row).

The kernel's own boundary is float32 (q padded to ``[B, KV, G8, D]``, the
output likewise; both tiny), so only the cache pages cross it in their
storage dtype.

Cost model: every table column is a grid step, live or not (a dead step is
only the per-step overhead, no copy and no compute), so a table much wider
than the contexts wastes steps; ``pages_per_step`` divides their number. Each
step holds ``2 * 2 * pages_per_step`` page blocks in VMEM (K and V, double
buffered), which ``vmem_limit_bytes`` may need to allow for large steps.

Checking without a TPU: on CPU the kernel runs with ``interpret=True`` (the
tests), and ``jax.export(..., platforms=["tpu"])`` runs the Pallas-to-Mosaic
lowering and embeds the ``tpu_custom_call``. With the ``libtpu`` wheel
installed, ``jax.experimental.topologies.get_topology_desc("v5e:2x2")`` gives
compile-only TPU devices, and ``.lower(...).compile()`` on them runs Mosaic's
own compiler: float32, bf16, int8 and fp8 caches, ``KV`` 1-16 (3, 5, 6 and
12 included), head dims 64/96/128/256 and pages of 4-64 tokens compile for
v4, v5e, v5p and v6e (``tests/inference/kernels/test_tpu_decode.py`` has
that check, skipped where libtpu is absent). Compiling is not running: numerics on
hardware are only covered by the interpret-mode tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from inference.kernels.reference import MASK_VALUE, Array, check_paged_cache

__all__ = ["LANES", "SUBLANES", "tpu_paged_decode", "tile_rows", "lane_chunks", "head_rows", "flat_page",
           "check_cache", "head_dim_fits", "DOT_NT", "DOT_NN"]

LANES = 128  # a TPU vector register's lanes: m and l are kept replicated across them
SUBLANES = 8  # its sublanes: query rows per group are padded to a multiple of this

_FLOAT_CACHE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_QUANT_CACHE = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
DOT_NT = (((1,), (1,)), ((), ()))  # a[M, D] . b[N, D] -> [M, N]
DOT_NN = (((1,), (0,)), ((), ()))  # a[M, K] @ b[K, N] -> [M, N]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tile_rows(kv_heads: int) -> int:
    """Rows a ``(KV, W)`` float32 slab takes so that ``[bs, KV, W] -> [bs * KV, W]`` is a plain reshape of VMEM.

    Mosaic tiles a slab of 1, 2, 4 or 8 rows, or a multiple of 8, exactly;
    any other head count is padded up to the next such size.
    """
    if kv_heads in (1, 2, 4) or kv_heads % SUBLANES == 0:
        return kv_heads
    return 4 if kv_heads == 3 else _round_up(kv_heads, SUBLANES)


def lane_chunks(head_dim: int) -> tuple[int, int]:
    """(chunks, width): a head dim above 128 lanes is moved and read as 128-lane chunks."""
    if head_dim <= LANES:
        return 1, head_dim
    return head_dim // LANES, LANES


def head_rows(flat_ref, head: int, page_size: int) -> Array:
    """Rows of one KV head from a page chunk viewed as ``[bs * R, W]`` (``R`` rows a token): ``[bs, W]``."""
    stride = flat_ref.shape[0] // page_size
    if stride == 1:
        return flat_ref[...]
    return flat_ref[pl.ds(head, page_size, stride=stride), :]


def flat_page(page_ref, buf_ref):
    """A ``(bs, KV, W)`` page chunk as a float32 ``[bs * R, W]`` ref.

    A 32-bit chunk with whole-tile slabs (``R = KV``) is viewed in place.
    Otherwise it is converted into the float32 scratch ``buf_ref`` of ``R =
    tile_rows(KV)`` rows per token first: Mosaic's strided loads are 32-bit,
    and only whole-tile slabs reshape; padding rows are never read.
    """
    page_size, kv_heads, width = page_ref.shape
    if buf_ref is None:
        return page_ref.reshape(page_size * kv_heads, width)
    rows = buf_ref.shape[1]
    if rows == kv_heads:
        buf_ref[...] = page_ref[...].astype(jnp.float32)
    else:
        buf_ref[:, :kv_heads, :] = page_ref[...].astype(jnp.float32)
    return buf_ref.reshape(page_size * rows, width)


def _fold_page(
    q_ref, k_flats: Sequence, v_flats: Sequence, k_scale_ref, v_scale_ref, m_ref, l_ref, acc_ref,
    remaining: Array, *, scale: float, kv_heads: int, page_size: int,
) -> None:  # fmt: skip
    """Fold one page (its first ``remaining`` >= 1 tokens are live) into every head's softmax state.

    ``k_flats``/``v_flats`` hold the page's lane chunks, each a ``[bs * R, W]`` float32 view.
    """
    rows = q_ref.shape[1]
    width = k_flats[0].shape[-1]
    col = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    row = lax.broadcasted_iota(jnp.int32, (page_size, width), 0)
    for h in range(kv_heads):
        s = None  # [rows, bs] logits, summed over lane chunks
        for c, k_flat in enumerate(k_flats):
            q = q_ref[h, :, pl.ds(c * width, width)]  # [rows, W] float32
            k = head_rows(k_flat, h, page_size)  # [bs, W]
            part = lax.dot_general(q, k, DOT_NT, preferred_element_type=jnp.float32)
            s = part if s is None else s + part
        logit_scale = scale if k_scale_ref is None else scale * k_scale_ref[0, h]
        s = jnp.where(col < remaining, s * logit_scale, MASK_VALUE)
        m_cur = jnp.max(s, axis=1, keepdims=True)  # [rows, 1]
        p = jnp.exp(s - m_cur)
        l_cur = jnp.sum(p, axis=1, keepdims=True)
        m_prev, l_prev = m_ref[h], l_ref[h]  # [rows, 128], lane-replicated
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)  # rescales what was folded before
        beta = jnp.exp(m_cur - m_next)  # rescales this page
        m_ref[h] = m_next
        l_ref[h] = alpha * l_prev + beta * l_cur
        for c, v_flat in enumerate(v_flats):
            v = jnp.where(row < remaining, head_rows(v_flat, h, page_size), 0.0)
            pv = lax.dot_general(p, v, DOT_NN, preferred_element_type=jnp.float32)  # [rows, W]
            if v_scale_ref is not None:
                pv = pv * v_scale_ref[0, h]
            lanes = pl.ds(c * width, width)
            acc_ref[h, :, lanes] = acc_ref[h, :, lanes] * alpha[:, :width] + pv * beta[:, :width]


def _decode_kernel(
    lens_ref, tables_ref, q_ref, *refs,
    scale: float, page_size: int, pages_per_step: int, chunks: int, table_width: int, quantized: bool,
    upcast: bool,
) -> None:  # fmt: skip
    pps, n_pages = pages_per_step, pages_per_step * chunks
    k_refs, v_refs, refs = refs[:n_pages], refs[n_pages : 2 * n_pages], refs[2 * n_pages :]
    if quantized:
        ks_refs, vs_refs, refs = refs[:pps], refs[pps : 2 * pps], refs[2 * pps :]
    else:
        ks_refs = vs_refs = (None,) * pps
    o_ref, m_ref, l_ref, acc_ref, *bufs = refs
    if upcast:  # float32 scratch pages, one per lane chunk
        k_bufs, v_bufs = ([buf.at[c] for c in range(chunks)] for buf in bufs)
    else:
        k_bufs = v_bufs = [None] * chunks
    kv_heads = q_ref.shape[0]
    b, step = pl.program_id(0), pl.program_id(1)
    length = lens_ref[b]
    live_pages = jnp.minimum(lax.div(length + page_size - 1, page_size), table_width)

    @pl.when(step == 0)
    def _init() -> None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for j in range(pps):
        page = step * pps + j

        @pl.when(page < live_pages)
        def _fold(j: int = j, page: Array = page) -> None:
            pages = range(j * chunks, (j + 1) * chunks)
            _fold_page(
                q_ref,
                [flat_page(k_refs[i], k_bufs[c]) for c, i in enumerate(pages)],
                [flat_page(v_refs[i], v_bufs[c]) for c, i in enumerate(pages)],
                ks_refs[j],
                vs_refs[j],
                m_ref,
                l_ref,
                acc_ref,
                length - page * page_size,
                scale=scale,
                kv_heads=kv_heads,
                page_size=page_size,
            )

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish() -> None:
        width = min(acc_ref.shape[-1], LANES)
        for h in range(kv_heads):
            denom = l_ref[h]
            inv = jnp.where(denom == 0.0, 0.0, 1.0 / jnp.where(denom == 0.0, 1.0, denom))  # empty context -> 0
            for c in range(chunks):
                lanes = pl.ds(c * width, width)
                o_ref[h, :, lanes] = acc_ref[h, :, lanes] * inv[:, :width]


def _page_index_map(j: int, tail: tuple[int, ...], *, pages_per_step: int, page_size: int, table_width: int,
                    num_blocks: int) -> Callable[..., tuple[Array, ...]]:
    """Index map of the ``j``-th page of a step: its table entry, then ``tail`` (block indices of the other dims).

    Pages past the last live one are clamped to it: the block index repeats,
    so Pallas skips the copy; a context of 0 still names column 0 (fetched,
    never used). Ids are clamped into ``[0, N)`` so a stray table entry
    cannot address past the cache.
    """

    def index_map(b: Array, step: Array, lens_ref, tables_ref) -> tuple[Array, ...]:
        live = lax.div(lens_ref[b] + page_size - 1, page_size)
        col = jnp.clip(jnp.minimum(step * pages_per_step + j, live - 1), 0, table_width - 1)
        block = jnp.clip(tables_ref[b * table_width + col], 0, num_blocks - 1)
        return (block, *tail)

    return index_map


def head_dim_fits(d: int) -> bool:
    """Whether pages of head dim ``d`` move whole: at most 128 lanes, or whole 128-lane chunks."""
    return d <= LANES or d % LANES == 0


def check_cache(q: Array, k_cache: Array, v_cache: Array, k_scale: Array | None, v_scale: Array | None) -> bool:
    """The paged caches these Mosaic kernels take (``reference.check_paged_cache``, and): K and V of one
    dtype, float32/bf16 in q's dtype or int8/fp8 codes with scales, a head dim :func:`head_dim_fits`.
    Returns whether the cache is quantized."""
    quantized = check_paged_cache(q, k_cache, v_cache, k_scale, v_scale)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k and v caches must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if quantized and k_cache.dtype not in _QUANT_CACHE:
        raise ValueError(f"a cache with scales must hold int8 or float8_e4m3fn codes, got {k_cache.dtype}")
    if not quantized and k_cache.dtype not in _FLOAT_CACHE:
        raise ValueError(f"unquantized cache must be float32 or bfloat16, got {k_cache.dtype}")
    if not head_dim_fits(q.shape[-1]):
        raise ValueError(f"a head dim above {LANES} must be a multiple of {LANES}, got {q.shape[-1]}")
    return quantized


def _validate(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array,
              k_scale: Array | None, v_scale: Array | None, pages_per_step: int) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"expected q [B, H, D] and caches [N, bs, KV, D], got q{q.shape} k{k_cache.shape}")
    b = q.shape[0]
    check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if block_tables.ndim != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables must be [B, M] and context_lens [B] for B={b}, got "
                         f"{block_tables.shape} and {context_lens.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer) or not jnp.issubdtype(context_lens.dtype, jnp.integer):
        raise ValueError(f"block_tables and context_lens must be integers, got {block_tables.dtype} "
                         f"and {context_lens.dtype}")
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables needs at least one column")
    if pages_per_step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")


def _specs(kv: int, rows: int, d: int, page_size: int, table_width: int, num_blocks: int,
           pages_per_step: int, quantized: bool) -> tuple[list[pl.BlockSpec], pl.BlockSpec]:
    """Input BlockSpecs (q, K page chunks, V page chunks, [K scales, V scales]) and the output's."""
    chunks, width = lane_chunks(d)
    q_spec = pl.BlockSpec((None, kv, rows, d), lambda b, step, lens_ref, tables_ref: (b, 0, 0, 0))
    index_map = functools.partial(_page_index_map, pages_per_step=pages_per_step, page_size=page_size,
                                  table_width=table_width, num_blocks=num_blocks)
    page_specs = [
        pl.BlockSpec((None, page_size, kv, width), index_map(j, (0, 0, c)))
        for j in range(pages_per_step)
        for c in range(chunks)
    ]
    in_specs = [q_spec, *page_specs, *page_specs]
    if quantized:
        scale_specs = [
            pl.BlockSpec((None, 1, kv), index_map(j, (0, 0)), memory_space=pltpu.SMEM)
            for j in range(pages_per_step)
        ]
        in_specs += [*scale_specs, *scale_specs]
    return in_specs, q_spec


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_step", "vmem_limit_bytes", "interpret"))
def tpu_paged_decode(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    block_tables: Array,
    context_lens: Array,
    *,
    scale: float,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    pages_per_step: int = 1,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
) -> Array:
    """Paged GQA decode for TPU; same contract as :func:`inference.kernels.reference.paged_decode_attention`.

    q[B,H,D], k/v_cache[N,bs,KV,D], block_tables[B,M] int32, context_lens[B]
    int32 -> [B,H,D] in q's dtype. Unquantized caches have q's dtype (float32
    or bfloat16). Quantized caches hold int8 or float8_e4m3fn codes and need
    ``k_scale``/``v_scale`` [N, KV] float32 (value = ``code * scale[block,
    head]``). ``pages_per_step`` pages are fetched and folded per grid step;
    ``vmem_limit_bytes`` raises Mosaic's scoped VMEM limit when those pages
    need more than its default. Table entries past a sequence's last live
    page are never used (nor copied), and a context of 0 yields zeros.
    ``interpret=True`` runs the kernel on CPU.
    """
    _validate(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, pages_per_step)
    b, h, d = q.shape
    n, page_size, kv, _ = k_cache.shape
    m = block_tables.shape[1]
    group = h // kv
    rows = _round_up(group, SUBLANES)
    quantized = k_scale is not None
    kv_rows = tile_rows(kv)
    upcast = k_cache.dtype.itemsize != 4 or kv_rows != kv
    pps = min(pages_per_step, m)

    qg = q.astype(jnp.float32).reshape(b, kv, group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    chunks, width = lane_chunks(d)
    operands: list[Array] = [qg, *([k_cache] * (pps * chunks)), *([v_cache] * (pps * chunks))]
    if quantized:
        ks = k_scale.astype(jnp.float32).reshape(n, 1, kv)
        vs = v_scale.astype(jnp.float32).reshape(n, 1, kv)
        operands += [*([ks] * pps), *([vs] * pps)]
    in_specs, out_spec = _specs(kv, rows, d, page_size, m, n, pps, quantized)
    scratch: Sequence[pltpu.MemoryRef] = [
        pltpu.VMEM((kv, rows, LANES), jnp.float32),  # m
        pltpu.VMEM((kv, rows, LANES), jnp.float32),  # l
        pltpu.VMEM((kv, rows, d), jnp.float32),  # acc
    ]
    if upcast:
        scratch += [pltpu.VMEM((chunks, page_size, kv_rows, width), jnp.float32)] * 2  # float32 K and V page
    kernel = functools.partial(
        _decode_kernel,
        scale=float(scale),
        page_size=page_size,
        pages_per_step=pps,
        chunks=chunks,
        table_width=m,
        quantized=quantized,
        upcast=upcast,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, -(-m // pps)),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((b, kv, rows, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="tpu_paged_decode",
    )(context_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), *operands)
    return out[:, :, :group, :].reshape(b, h, d).astype(q.dtype)
