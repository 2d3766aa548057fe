"""Attention as ``jnp`` code XLA compiles on any platform: the ``xla`` kernels of the kernel set.

Both functions use grouped-query attention: query head ``h`` reads KV head
``h // (H // KV)``. Softmax runs in float32 whatever the input dtype.

They loop over key chunks with an *online softmax* whose trip count is
decided at run time by the longest sequence in the batch, so the cost follows
the actual context length rather than the padded shape (which lets the runner
keep one compiled shape per batch bucket instead of one per context-length
bucket). The ground truth they are tested against is :mod:`inference.kernels.reference`;
which attention a worker runs is :mod:`inference.kernels.kernel_set`'s choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["prefill_attention", "paged_decode_attention", "gather_block_rows"]

Array = jax.Array

_NEG = -1e30
_KEY_CHUNK = 256  # most keys per online-softmax step (prefill)
_MIN_KEY_CHUNK = 64  # fewest keys per online-softmax step (prefill)
# Decode: about this many (row, token) pairs per online-softmax step, so one step's
# gathered K/V stay cache-sized: 16 tokens at batch 32, 64 (the cap) at batch 8 and 1.
_DECODE_CHUNK_ROW_TOKENS = 512
_DECODE_MAX_CHUNK_TOKENS = 64
_BLOCK_DIAG_MAX_KV = 4  # the GEMM score path does KV times the useful FLOPs; above this, multiply-reduce


def _online_step(carry: tuple[Array, Array, Array], q: Array, k: Array, v: Array, mask: Array,
                 scale: float) -> tuple[Array, Array, Array]:
    """One online-softmax update. q [B,KV,G,T,D]; k/v [B,C,KV,D]; mask [B,T,C]."""
    m, denom, acc = carry
    s = jnp.einsum("bkgtd,bckd->bkgtc", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None, :, :], s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    p = jnp.where(mask[:, None, None, :, :], p, 0.0)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * denom + p.sum(axis=-1)
    pv = jnp.einsum("bkgtc,bckd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l_new, alpha[..., None] * acc + pv


def _finish(denom: Array, acc: Array, dtype: jnp.dtype) -> Array:
    # Rows with no visible key (padding) have l == 0: return zeros, not NaN.
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(dtype)


def prefill_attention(q: Array, k: Array, v: Array, q_offsets: Array, kv_lens: Array, *,
                      scale: float, window: int | None = None) -> Array:
    """Causal attention of new queries over gathered keys (cached prefix included).

    q [B,T,H,D], k/v [B,S,KV,D]; query t of row b sits at absolute position
    ``q_offsets[b] + t`` and sees keys at positions ``<= `` that and ``< kv_lens[b]``
    (with a sliding ``window``, only those ``> position - window``; key chunks before
    every row's window are skipped). Returns [B,T,H,D]; rows past a sequence's length
    are don't-care.
    """
    b, t, h, d = q.shape
    s_len, kv = k.shape[1], k.shape[2]
    g = h // kv
    # Chunks of about the query count: a prompt without cached prefix is one chunk
    # with no masked-out half (a 128-token prefill spent ~16 of its ~95 ms in
    # attention over 256-key chunks on CPU).
    chunk = min(_KEY_CHUNK, s_len, max(t, _MIN_KEY_CHUNK))
    pad = (-s_len) % chunk
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    qg = q.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)  # [B,KV,G,T,D]
    q_pos = q_offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B,T]
    n_chunks = (jnp.max(kv_lens) + chunk - 1) // chunk
    first = _first_chunk(q_offsets - window + 1, kv_lens, chunk) if window else 0

    def body(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        start = i * chunk
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=1)
        k_pos = start + jnp.arange(chunk, dtype=jnp.int32)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
        if window:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
        return _online_step(carry, qg, kc, vc, mask, scale)

    init = (jnp.full((b, kv, g, t), _NEG, jnp.float32), jnp.zeros((b, kv, g, t), jnp.float32),
            jnp.zeros((b, kv, g, t, d), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    return _finish(denom, acc, q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def _first_chunk(lowest: Array, lens: Array, chunk: int) -> Array:
    """The first key chunk any live row (``lens > 0``) sees, its lowest visible key at ``lowest``."""
    live_lowest = jnp.where(lens > 0, jnp.maximum(lowest, 0), jnp.iinfo(jnp.int32).max)
    return jnp.minimum(jnp.min(live_lowest) // chunk, (jnp.max(lens) + chunk - 1) // chunk)


def _clamp_to_context(block_tables: Array, context_lens: Array, block_size: int) -> Array:
    """Point every block past a row's context at the row's last live block.

    The chunk loop runs to the longest context in the batch, so shorter rows
    read blocks they mask out anyway. Re-reading one block that is already in
    cache instead of streaming unrelated (or padding) blocks from memory cuts
    the gather traffic for mixed lengths; the masked results are unchanged.
    """
    m = block_tables.shape[1]
    n_live = jnp.maximum((context_lens + block_size - 1) // block_size, 1)  # [B]
    last = jnp.take_along_axis(block_tables, (n_live - 1)[:, None], axis=1)  # [B,1]
    live = jnp.arange(m, dtype=jnp.int32)[None, :] < n_live[:, None]
    return jnp.where(live, block_tables, last)


def gather_block_rows(cache: Array, scales: Array | None, blocks: Array) -> Array:
    """Blocks ``[B,C]`` of ``cache`` as ``[B,C,bs*KV*D]`` rows (float32 values if ``scales`` is given).

    Gathered as flat ``[N, bs*KV*D]`` rows: XLA:CPU copies each block with one
    vectorised loop, where the 4-D gather indexes element by element.
    """
    # Block ids are validated by the runner; skip the bounds handling of plain indexing.
    rows = cache.reshape(cache.shape[0], -1).at[blocks].get(mode="promise_in_bounds")
    if scales is None:
        return rows
    b, c = blocks.shape
    bs, kv, d = cache.shape[1:]
    s = scales.at[blocks].get(mode="promise_in_bounds")[:, :, None, :, None]  # [B,C,1,KV,1]
    return (rows.reshape(b, c, bs, kv, d).astype(jnp.float32) * s).reshape(b, c, -1)


def _decode_chunk_tokens(batch: int, block_size: int, table_blocks: int) -> int:
    """Tokens per decode loop step: ~``_DECODE_CHUNK_ROW_TOKENS / batch``, whole blocks, capped.

    Measured (one core, B rows, contexts 100-200, 16-token blocks, per layer): bigger steps cut
    per-step op overhead at small batches (B=1: 16 -> 64 tokens, 0.13 -> 0.08 ms; B=8: 0.42 ->
    0.32-0.35 ms) but at B=32 a 64-token step (2 MB of gathered K+V) no longer stays in cache
    and costs more (2.0 -> 2.3-2.5 ms; 128 tokens: 4.0 ms).
    """
    tokens = min(_DECODE_MAX_CHUNK_TOKENS, _DECODE_CHUNK_ROW_TOKENS // max(batch, 1))
    return max(1, min(table_blocks, tokens // block_size))


def _block_diag_queries(qg: Array) -> Array:
    """[B,KV,G,D] queries as a block-diagonal [B, KV*D, KV*G] matrix (head k's queries in block k)."""
    b, kv, g, d = qg.shape
    eye = jnp.eye(kv, dtype=qg.dtype)
    return (qg.transpose(0, 1, 3, 2)[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(b, kv * d, kv * g)


def paged_decode_attention(q: Array, k_cache: Array, v_cache: Array, block_tables: Array,
                           context_lens: Array, *, scale: float, k_scale: Array | None = None,
                           v_scale: Array | None = None, window: int | None = None) -> Array:
    """One query per sequence over its paged KV cache.

    q [B,H,D]; k/v_cache [N,bs,KV,D]; block_tables [B,M]; the sequence's keys
    are positions ``0 .. context_lens[b]-1`` (with a sliding ``window``, the last
    ``window`` of them; key chunks before every row's window are skipped, and a table
    entry before it in the first chunk read is masked: it must name a block of finite
    values, as the KV cache's placeholders do). Returns [B,H,D]. With
    ``k_scale``/``v_scale`` [N,KV] the caches hold int8/fp8 codes, dequantized
    (``code * scale[block, head]``) per gathered chunk inside the loop.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    b, h, d = q.shape
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    m_blocks = block_tables.shape[1]
    per_chunk = _decode_chunk_tokens(b, bs, m_blocks)
    pad = (-m_blocks) % per_chunk
    if pad:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    block_tables = _clamp_to_context(block_tables, context_lens, bs)
    chunk = per_chunk * bs
    qg = (q.astype(jnp.float32) * scale).reshape(b, kv, g, d)
    # Scores as one batched GEMM per chunk, [B, C, KV*D] keys (the gathered rows as they
    # lie) times a block-diagonal [B, KV*D, KV*G] query matrix: KV times the useful FLOPs,
    # but the GEMM runs far closer to peak than the multiply-reduce over the minor head dim
    # that XLA:CPU emits otherwise (per layer, one core, contexts 100-200, 16-token chunks:
    # B=1 0.13 -> 0.10 ms, B=8 0.41 -> 0.37 ms, B=32 2.10 -> 2.01-2.08 ms, within noise). At
    # B=32 the rest is memory: the K and V row gathers (~0.4 ms each, ~13 MB copied at the
    # copy bandwidth) and the PV reduce over the copies (~0.4 ms).
    use_gemm = kv <= _BLOCK_DIAG_MAX_KV
    q_mat = _block_diag_queries(qg) if use_gemm else qg.reshape(b, 1, kv, g, d)
    n_chunks = (jnp.max(context_lens) + chunk - 1) // chunk
    # Gather whole blocks as flat rows: XLA:CPU copies a [N, bs*KV*D] row gather
    # with one vectorised loop per block, where the 4-D gather indexes element by
    # element (one layer's K+V at batch 32, contexts 100-200: 1.7 -> 1.1 ms). The
    # flat view is taken inside the loop body: taken outside, the loop and the
    # returned cache see the freshly written cache in two shapes, and at batch 1
    # XLA then copies the whole cache every step.

    def scores(kc: Array) -> Array:
        """[B,C,KV*D] gathered keys -> [B,C,KV,G] scaled scores."""
        kc = kc.astype(jnp.float32)
        if use_gemm:
            s = jax.lax.dot_general(kc, q_mat, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
            return s.reshape(b, chunk, kv, g)
        return (q_mat * kc.reshape(b, chunk, kv, 1, d)).sum(-1)

    def body(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m, denom, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(block_tables, i * per_chunk, per_chunk, axis=1)  # [B,C]
        s = scores(gather_block_rows(k_cache, k_scale, blocks).reshape(b, chunk, kv * d))  # [B,C,KV,G]
        vc = gather_block_rows(v_cache, v_scale, blocks).reshape(b, chunk, kv, 1, d)
        k_pos = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = k_pos[None, :] < context_lens[:, None]
        if window:
            mask &= k_pos[None, :] >= context_lens[:, None] - window
        mask = mask[:, :, None, None]  # [B,C,1,1]
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))  # [B,KV,G]
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        # Broadcast-multiply-reduce instead of einsum: with G=H/KV query rows per
        # KV head the dots are tiny batched matmuls that XLA:CPU feeds through a
        # transpose copy of the gathered chunk; this fused loop reads it in place
        # (whole decode step at batch 32, ~31M model, one core: 65 -> 58 ms).
        pv = (p[..., None] * vc.astype(jnp.float32)).sum(1)  # [B,KV,G,D]
        return m_new, alpha * denom + p.sum(axis=1), alpha[..., None] * acc + pv

    init = (jnp.full((b, kv, g), _NEG, jnp.float32), jnp.zeros((b, kv, g), jnp.float32),
            jnp.zeros((b, kv, g, d), jnp.float32))
    first = _first_chunk(context_lens - window, context_lens, chunk) if window else 0
    _, denom, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    return _finish(denom, acc, q.dtype).reshape(b, h, d)
