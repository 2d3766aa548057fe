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

Paged variant (:func:`tpu_paged_flash_prefill`): keys and values are read
straight from the model's cache ``[N, bs, KV, D]`` through the block table,
with no gathered ``[B, M*bs, KV, D]`` copy. A BlockSpec cannot take one KV
head of a page (the ``(KV, D)`` minor dims must be whole), so the unit moved
is one page of all heads, as in :mod:`inference.kernels.tpu_decode`, and the
KV heads move from the grid into the program: the grid is ``(B, query blocks,
key tiles)``, a program holds the ``[KV, G, block_q, D]`` queries of its
block and the softmax state of every head, and each page is copied from HBM
once per query block rather than once per KV head. A key tile is ``block_k //
bs`` pages; the cache is passed once per page of a tile, each with an index
map reading the (scalar-prefetched) table, so Pallas double-buffers the next
tile's pages. In the program each page is split into heads with tpu_decode's
strided reads (bf16/int8/fp8 pages, or a head count that is not a whole
sublane tile, through a float32 scratch page), dequantized (one scale per
page and head, an SMEM scalar), and stored into per-head float32 key and
value tiles ``[block_k, D]``; each head then runs the dense kernel's step on
them (in q's dtype on the MXU). Tiles past the visible end are skipped and
their pages not copied: past a row's last needed page each page slot keeps
the block it last fetched. Table ids are clamped into ``[0, N)``. Query and
key tiles shrink (by halves) until an estimate of the VMEM this takes fits
Mosaic's scoped limit (16 MiB unless ``vmem_limit_bytes`` is raised).

On CPU the kernels run interpreted (the tests); lowering for TPU is checked on
any host with ``jax.export(..., platforms=["tpu"])``, and Mosaic's own
compiler runs in ``tests/inference/kernels/mosaic_compile.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from inference.kernels.reference import MASK_VALUE, Array, check_prefill_args
from inference.kernels.tpu_decode import (
    DOT_NN,
    DOT_NT,
    check_cache,
    flat_page,
    head_dim_fits,
    head_rows,
    lane_chunks,
    tile_rows,
)

__all__ = ["TpuPrefillBlocks", "tpu_flash_prefill", "tpu_paged_flash_prefill", "paged_prefill_supports"]

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


def _reset(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _causal_keep(first_q: Array, start: Array, kv_len: Array, group: int, block_q: int, block_k: int) -> Array:
    """``[G * block_q, block_k]``: which keys of the tile at ``start`` each query row (G heads of a block
    whose first position is ``first_q``) sees: causal, and below the row's length."""
    rows = group * block_q
    q_pos = first_q + lax.broadcasted_iota(jnp.int32, (group, block_q, block_k), 1).reshape(rows, block_k)
    k_pos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    return (k_pos <= q_pos) & (k_pos < kv_len)


def _fold(q: Array, k: Array, v: Array, m_ref, l_ref, acc_ref, scale: float, keep: Array | None) -> None:
    """Fold one key tile into the online softmax of ``q``'s rows: logits masked where ``keep`` is False,
    running max and sum lane-replicated in ``m_ref``/``l_ref`` ``[rows, LANES]``, the unnormalised
    float32 ``acc_ref`` ``[rows, D]``. ``q``, ``k`` and ``v`` share a dtype."""
    s = lax.dot_general(q, k, DOT_NT, preferred_element_type=jnp.float32) * scale
    if keep is not None:
        s = jnp.where(keep, s, MASK_VALUE)
    m_prev, l_prev = m_ref[...], l_ref[...]  # every lane the same
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, :1])
    l_ref[...] = l_prev * correction + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    pv = lax.dot_general(p.astype(v.dtype), v, DOT_NN, preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * correction[:, :1] + pv


def _normalised(l_ref, acc_ref) -> Array:
    """The folded rows' attention output, float32 ``[rows, D]``; rows that saw no key get zeros."""
    l_sum = l_ref[...][:, :1]
    return acc_ref[...] / jnp.where(l_sum == 0.0, 1.0, l_sum)


def _prefill_kernel(
    qoff_ref, kvlen_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref,
    *, scale: float, block_q: int, block_k: int, group: int, seq_k: int,
):  # fmt: skip
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_off, kv_len = qoff_ref[b], jnp.minimum(kvlen_ref[b], seq_k)
    rows = group * block_q

    pl.when(j == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    first_q = q_off + i * block_q
    start = j * block_k
    visible = start < _visible_end(q_off, kv_len, i, block_q, seq_k)
    # Every query of the block sees every key of the tile: no mask needed.
    full = (start + block_k <= first_q + 1) & (start + block_k <= kv_len)

    def step(masked: bool) -> None:
        keep = _causal_keep(first_q, start, kv_len, group, block_q, block_k) if masked else None
        q = q_ref[...].reshape(rows, q_ref.shape[-1])  # [G * block_q, D]
        _fold(q, k_ref[...], v_ref[...], m_ref, l_ref, acc_ref, scale, keep)

    pl.when(visible & full)(lambda: step(False))
    pl.when(visible & jnp.logical_not(full))(lambda: step(True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        o_ref[...] = _normalised(l_ref, acc_ref).reshape(o_ref.shape).astype(o_ref.dtype)


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


# --- Paged prefill: keys and values read through the block table -------------------------------------------

def paged_prefill_supports(head_dim: int) -> bool:
    """Whether :func:`tpu_paged_flash_prefill` takes this head dim: at most 128 lanes, or a multiple of them
    (pages move in 128-lane chunks, as in the decode kernel). Any page size compiles (1-256 checked)."""
    return head_dim_fits(head_dim)


def _sublane_rows(dtype) -> int:
    """Rows of one native VMEM tile of ``dtype`` (8 for 32-bit, 16 for bf16): q's query blocks come in
    whole tiles so that ``[G, block_q, D] -> [G * block_q, D]`` is a plain reshape."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


# Mosaic's default scoped VMEM limit on v4/v5e/v5p (v6e: 32 MiB): tiles are sized to fit it unless the caller
# raises the limit.
_DEFAULT_VMEM_LIMIT = 16 << 20


def _paged_vmem_bytes(h: int, kv: int, d: int, block_q: int, page_size: int, pages: int, q_dtype, cache_dtype,
                      upcast: bool) -> int:
    """An upper estimate of the paged kernel's VMEM (checked against Mosaic: 1-1.6x what it allocates)."""
    d_pad, rows_all = _round_up(d, LANES), h * block_q
    rows, block_k = (h // kv) * block_q, pages * page_size
    q_size, c_size = jnp.dtype(q_dtype).itemsize, jnp.dtype(cache_dtype).itemsize
    q_and_out = 2 * 2 * rows_all * d_pad * q_size  # double-buffered blocks
    state = rows_all * (2 * LANES + d_pad) * 4  # m, l, acc
    tiles = 2 * kv * block_k * d_pad * 4
    page_blocks = 2 * 2 * pages * page_size * _round_up(kv, 8 if c_size == 4 else 16) * d_pad * c_size
    page_bufs = 2 * page_size * _round_up(tile_rows(kv), 8) * d_pad * 4 if upcast else 0
    temps = 2 * rows * block_k * 4 + 2 * rows * d_pad * 4  # logits, probabilities, a head's q and pv
    return q_and_out + state + tiles + page_blocks + page_bufs + temps


def _paged_tiles(h: int, kv: int, d: int, t: int, page_size: int, table_width: int, blocks: TpuPrefillBlocks,
                 q_dtype, cache_dtype, upcast: bool, budget: int) -> tuple[int, int]:
    """(block_q, pages per key tile): ``blocks`` clamped to the problem, then halved (key tiles down to 128
    keys first, then query blocks, then key tiles) until the estimate fits ``budget`` bytes of VMEM."""
    sub = _sublane_rows(q_dtype)
    block_q = _round_up(min(blocks.block_q, _round_up(t, sub)), sub)
    pages = max(1, min(blocks.block_k // page_size, table_width))

    def fits() -> bool:
        return _paged_vmem_bytes(h, kv, d, block_q, page_size, pages, q_dtype, cache_dtype, upcast) <= budget

    while not fits():
        if pages > 1 and pages * page_size > LANES:
            pages //= 2
        elif block_q > sub:
            block_q = _round_up(block_q // 2, sub)
        elif pages > 1:
            pages //= 2
        else:
            break
    return block_q, pages


def _paged_prefill_kernel(
    qoff_ref, kvlen_ref, tables_ref, q_ref, *refs,
    scale: float, block_q: int, page_size: int, pages: int, chunks: int, seq_k: int, quantized: bool,
    upcast: bool,
) -> None:  # fmt: skip
    del tables_ref  # read by the index maps only
    n_pages = pages * chunks
    k_refs, v_refs, refs = refs[:n_pages], refs[n_pages : 2 * n_pages], refs[2 * n_pages :]
    if quantized:
        ks_refs, vs_refs, refs = refs[:pages], refs[pages : 2 * pages], refs[2 * pages :]
    else:
        ks_refs = vs_refs = (None,) * pages
    o_ref, m_ref, l_ref, acc_ref, kt_ref, vt_ref, *bufs = refs
    if upcast:  # float32 scratch pages, one per lane chunk
        k_bufs, v_bufs = ([buf.at[c] for c in range(chunks)] for buf in bufs)
    else:
        k_bufs = v_bufs = [None] * chunks
    kv_heads, group, _, d = q_ref.shape
    rows, block_k, width = group * block_q, pages * page_size, d // chunks
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_off, kv_len = qoff_ref[b], jnp.minimum(kvlen_ref[b], seq_k)
    first_q, start = q_off + i * block_q, j * block_k
    end = _visible_end(q_off, kv_len, i, block_q, seq_k)
    visible = start < end
    # Every query of the block sees every key of the tile: no mask needed.
    full = (start + block_k <= first_q + 1) & (start + block_k <= kv_len)

    pl.when(j == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    def gather(p: int) -> None:
        """Page ``p`` of the tile, for every head: its head's rows (dequantized) into that head's float32 key
        and value tiles."""
        toks = pl.ds(p * page_size, page_size)
        for c in range(chunks):
            lanes = pl.ds(c * width, width)
            for srcs, tile_bufs, scales, tile in ((k_refs, k_bufs, ks_refs, kt_ref),
                                                  (v_refs, v_bufs, vs_refs, vt_ref)):  # fmt: skip
                flat = flat_page(srcs[p * chunks + c], tile_bufs[c])
                for h in range(kv_heads):
                    x = head_rows(flat, h, page_size)  # [bs, W] float32
                    if scales[p] is not None:
                        x = x * scales[p][0, h]
                    tile[h, toks, lanes] = x

    # Pages past the visible end are left out: their tile rows keep whatever they held, which the masked
    # step below neither weighs nor (values) multiplies.
    for p in range(pages):
        pl.when(start + p * page_size < end)(functools.partial(gather, p))

    def step(masked: bool) -> None:
        keep = _causal_keep(first_q, start, kv_len, group, block_q, block_k) if masked else None
        # Rows past the visible end (a page's stale slots, or a page not gathered) hold values no query
        # weighs, but 0 * inf is NaN: a masked tile zeroes them.
        live = start + lax.broadcasted_iota(jnp.int32, (block_k, d), 0) < end if masked else None
        for h in range(kv_heads):
            q = q_ref[h].reshape(rows, d)  # [G * block_q, D]
            v = vt_ref[h] if live is None else jnp.where(live, vt_ref[h], 0.0)
            _fold(q, kt_ref[h].astype(q.dtype), v.astype(q.dtype), m_ref.at[h], l_ref.at[h], acc_ref.at[h], scale,
                  keep)  # fmt: skip

    pl.when(visible & full)(lambda: step(False))
    pl.when(visible & jnp.logical_not(full))(lambda: step(True))

    @pl.when(j == pl.num_programs(2) - 1)
    def _write() -> None:
        for h in range(kv_heads):
            o_ref[h] = _normalised(l_ref.at[h], acc_ref.at[h]).reshape(group, block_q, d).astype(o_ref.dtype)


def _paged_index_map(slot: int, tail: tuple[int, ...], *, pages: int, page_size: int, block_q: int,
                     table_width: int, num_blocks: int) -> Callable[..., tuple[Array, ...]]:
    """Index map of page ``slot`` of a key tile: the block its table column names, then ``tail``.

    Past the last page any query of the block sees, a slot keeps the column it last fetched (the same
    block index: Pallas copies nothing), so skipped tiles cost no HBM traffic; a slot never needed
    names that last page. Columns are clamped into the table, ids into ``[0, N)``.
    """

    def index_map(b, i, j, qoff_ref, lens_ref, tables_ref) -> tuple[Array, ...]:
        end = _visible_end(qoff_ref[b], lens_ref[b], i, block_q, table_width * page_size)
        last = lax.div(end + (page_size - 1), page_size) - 1  # -1: nothing visible
        col = j * pages + slot
        kept = slot + pages * lax.div(jnp.maximum(last - slot, 0), pages)  # this slot's last needed column
        col = jnp.where(col <= last, col, jnp.where(last >= slot, kept, jnp.maximum(last, 0)))
        col = jnp.clip(col, 0, table_width - 1)
        return (jnp.clip(tables_ref[b * table_width + col], 0, num_blocks - 1), *tail)

    return index_map


def _validate_paged(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, q_offsets: Array,
                    kv_lens: Array, k_scale: Array | None, v_scale: Array | None) -> bool:
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(f"expected q [B, T, H, D] and caches [N, bs, KV, D], got q{q.shape} k{k_cache.shape} "
                         f"v{v_cache.shape}")  # fmt: skip
    quantized = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    b = q.shape[0]
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B, M] with B={b} and M >= 1, got {block_tables.shape}")
    if q_offsets.shape != (b,) or kv_lens.shape != (b,):
        raise ValueError(f"q_offsets and kv_lens must have shape {(b,)}, got {q_offsets.shape} and {kv_lens.shape}")
    for name, x in (("block_tables", block_tables), ("q_offsets", q_offsets), ("kv_lens", kv_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {x.dtype}")
    if k_cache.shape[0] < 1:
        raise ValueError("the cache needs at least one block")
    return quantized


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "vmem_limit_bytes", "interpret"))
def tpu_paged_flash_prefill(
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
    blocks: TpuPrefillBlocks = TpuPrefillBlocks(),
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
) -> Array:
    """Causal GQA prefill for TPU reading keys and values straight from the paged cache.

    q[B,T,H,D], k/v_cache[N,bs,KV,D] (float32/bf16 in q's dtype, or int8/float8_e4m3fn codes with
    ``k_scale``/``v_scale`` [N, KV] float32), block_tables[B,M], q_offsets[B], kv_lens[B] int32 ->
    [B,T,H,D] in q's dtype: the result of :func:`inference.kernels.reference.prefill_attention` over each
    row's table gathered into ``[B, M*bs, KV, D]`` (dequantized), without that copy. Table ids are clamped
    into ``[0, N)``; a row with no visible key gets zeros. A key tile is ``block_k // bs`` pages (at most
    ``M``); ``vmem_limit_bytes`` raises Mosaic's scoped VMEM limit for large tiles.
    """
    quantized = _validate_paged(q, k_cache, v_cache, block_tables, q_offsets, kv_lens, k_scale, v_scale)
    b, t, h, d = q.shape
    n, page_size, kv, _ = k_cache.shape
    m = block_tables.shape[1]
    group = h // kv
    chunks, width = lane_chunks(d)
    kv_rows = tile_rows(kv)
    upcast = jnp.dtype(k_cache.dtype).itemsize != 4 or kv_rows != kv
    budget = int(0.9 * (vmem_limit_bytes or _DEFAULT_VMEM_LIMIT))
    block_q, pages = _paged_tiles(h, kv, d, t, page_size, m, blocks, q.dtype, k_cache.dtype, upcast, budget)
    block_k = pages * page_size
    t_pad = _round_up(t, block_q)

    # [B,T,H,D] -> [B,KV,G,T,D]
    qg = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))).reshape(b, t_pad, kv, group, d)
    qg = qg.transpose(0, 2, 3, 1, 4)
    q_spec = pl.BlockSpec((None, kv, group, block_q, d), lambda bi, i, j, *_: (bi, 0, 0, i, 0))
    index_map = functools.partial(_paged_index_map, pages=pages, page_size=page_size, block_q=block_q,
                                  table_width=m, num_blocks=n)  # fmt: skip
    page_specs = [pl.BlockSpec((None, page_size, kv, width), index_map(p, (0, 0, c)))
                  for p in range(pages) for c in range(chunks)]  # fmt: skip
    in_specs = [q_spec, *page_specs, *page_specs]
    operands = [qg, *([k_cache] * len(page_specs)), *([v_cache] * len(page_specs))]
    if quantized:
        scale_specs = [pl.BlockSpec((None, 1, kv), index_map(p, (0, 0)), memory_space=pltpu.SMEM)
                       for p in range(pages)]  # fmt: skip
        in_specs += [*scale_specs, *scale_specs]
        operands += [*([k_scale.astype(jnp.float32).reshape(n, 1, kv)] * pages),
                     *([v_scale.astype(jnp.float32).reshape(n, 1, kv)] * pages)]  # fmt: skip
    rows = group * block_q
    scratch = [
        pltpu.VMEM((kv, rows, LANES), jnp.float32),  # m
        pltpu.VMEM((kv, rows, LANES), jnp.float32),  # l
        pltpu.VMEM((kv, rows, d), jnp.float32),  # acc
        pltpu.VMEM((kv, block_k, d), jnp.float32),  # the key tile of every head
        pltpu.VMEM((kv, block_k, d), jnp.float32),  # and its value tile
    ]
    if upcast:
        scratch += [pltpu.VMEM((chunks, page_size, kv_rows, width), jnp.float32)] * 2  # float32 K and V page
    kernel = functools.partial(
        _paged_prefill_kernel, scale=float(scale), block_q=block_q, page_size=page_size, pages=pages,
        chunks=chunks, seq_k=m * page_size, quantized=quantized, upcast=upcast,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, t_pad // block_q, -(-m // pages)),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),  # fmt: skip
        interpret=interpret,
        name="tpu_paged_flash_prefill",
    )(q_offsets.astype(jnp.int32), kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1),
      *operands)  # fmt: skip
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t_pad, h, d)[:, :t]
