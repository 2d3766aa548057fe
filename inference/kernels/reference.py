"""The reference: plain ``jnp`` attention, the ground truth every attention kernel is tested against.

"Reference" means this module and nothing else: the dense, obviously-right
versions (every key gathered, one masked softmax) that the Pallas, native and
XLA kernels must reproduce, and the ``reference`` kernel set that serves them
(:mod:`inference.kernels.kernel_set`; slow, for checking numerics). Contract
(shared by every kernel): shapes as below, masking, GQA head grouping (query
head ``h`` reads KV head ``h // (H // KV)``). Softmax runs in float32 whatever
the input dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "Array",
    "MASK_VALUE",
    "prefill_attention",
    "paged_decode_attention",
    "gather_pages",
    "check_prefill_args",
    "check_paged_cache",
]

Array = Any  # a jax.Array (named alias; jax.Array itself is not generic)

# Large finite negative: a fully masked row yields a uniform (finite) softmax
# instead of NaN, which keeps don't-care rows harmless.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _group(q: Array, kv_heads: int) -> Array:
    """[..., H, D] -> [..., KV, G, D] with query head h = kv * G + g."""
    *lead, h, d = q.shape
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv_heads})")
    return q.reshape(*lead, kv_heads, h // kv_heads, d)


def check_prefill_args(q: Array, k: Array, v: Array, q_offsets: Array, kv_lens: Array) -> int:
    """Validate a prefill call's shapes (the contract of :func:`prefill_attention`); returns ``H // KV``."""
    b, _, h, d = q.shape
    kv, dk = k.shape[2], k.shape[3]
    if k.shape != v.shape or k.shape[0] != b or dk != d:
        raise ValueError(f"shape mismatch: q{q.shape} k{k.shape} v{v.shape}")
    if h % kv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv})")
    if q_offsets.shape != (b,) or kv_lens.shape != (b,):
        raise ValueError("q_offsets and kv_lens must have shape [B]")
    return h // kv


def check_paged_cache(q: Array, k_cache: Array, v_cache: Array, k_scale: Array | None,
                      v_scale: Array | None) -> bool:
    """Validate a paged cache against ``q[..., H, D]``: float in q's dtype, or codes with ``[N, KV]`` scales
    for both K and V. Returns whether it is quantized."""
    h, d = q.shape[-2:]
    n, kv, dk = k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]
    if v_cache.shape != k_cache.shape or dk != d:
        raise ValueError(f"shape mismatch: q{q.shape} k{k_cache.shape} v{v_cache.shape}")
    if h % kv:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kv})")
    quantized = k_scale is not None
    if quantized != (v_scale is not None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    if quantized and (k_scale.shape != (n, kv) or v_scale.shape != (n, kv)):
        raise ValueError(f"scales must have shape {(n, kv)}, got {k_scale.shape} and {v_scale.shape}")
    if not quantized and k_cache.dtype != q.dtype:
        raise ValueError(f"unquantized cache dtype {k_cache.dtype} must match q dtype {q.dtype}")
    return quantized


def prefill_attention(
    q: Array, k: Array, v: Array, q_offsets: Array, kv_lens: Array, *, scale: float, window: int | None = None
) -> Array:
    """Causal GQA attention with per-sequence offsets.

    q[B,T,H,D], k/v[B,S,KV,D], q_offsets[B], kv_lens[B] -> [B,T,H,D]. Query
    ``t`` of sequence ``b`` sits at position ``q_offsets[b] + t`` and sees keys
    at positions ``<=`` that and ``< kv_lens[b]``; with a sliding ``window``, only
    the last ``window`` of them (positions ``> q_pos - window``, itself included).
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    qg = _group(q, kv).astype(jnp.float32)  # [B,T,KV,G,D]
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    q_pos = q_offsets[:, None] + jnp.arange(t)[None, :]  # [B,T]
    k_pos = jnp.arange(s)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    logits = jnp.where(mask[:, None, None, :, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def gather_pages(cache: Array, block_tables: Array) -> Array:
    """[N,bs,KV,D] cache and [B,M] tables -> contiguous [B, M*bs, KV, D]."""
    pages = cache[block_tables]  # [B,M,bs,KV,D]
    b, m, bs = pages.shape[:3]
    return pages.reshape(b, m * bs, *pages.shape[3:])


def paged_decode_attention(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    block_tables: Array,
    context_lens: Array,
    *,
    scale: float,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    window: int | None = None,
) -> Array:
    """One query token per sequence against the paged cache.

    q[B,H,D], caches [N,bs,KV,D], block_tables[B,M], context_lens[B] -> [B,H,D];
    with a sliding ``window``, a row sees only its last ``window`` keys.
    With ``k_scale``/``v_scale`` ([N, KV] float32) the caches hold int8 or fp8
    codes and are dequantized as ``code * scale[block, head]``.
    """
    b, h, d = q.shape
    kv = k_cache.shape[2]
    k = gather_pages(k_cache, block_tables).astype(jnp.float32)  # [B,S,KV,D]
    v = gather_pages(v_cache, block_tables).astype(jnp.float32)
    bs = k_cache.shape[1]
    if k_scale is not None:
        k = k * jnp.repeat(k_scale[block_tables], bs, axis=1)[..., None]
    if v_scale is not None:
        v = v * jnp.repeat(v_scale[block_tables], bs, axis=1)[..., None]
    qg = _group(q, kv).astype(jnp.float32)  # [B,KV,G,D]
    logits = jnp.einsum("bkgd,bskd->bkgs", qg, k) * scale
    mask = jnp.arange(k.shape[1])[None, :] < context_lens[:, None]  # [B,S]
    if window is not None:
        mask &= jnp.arange(k.shape[1])[None, :] >= context_lens[:, None] - window
    logits = jnp.where(mask[:, None, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v)
    return out.reshape(b, h, d).astype(q.dtype)
