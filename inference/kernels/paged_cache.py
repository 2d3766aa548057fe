"""The paged KV cache as arrays: its layout, its bytes, and the writes and reads every kernel set shares.

One ``[num_blocks, block_size, KV, D]`` array per layer for keys and one for
values; a token's K/V lives at flat slot ``block * block_size + offset``, and a
slot index ``>= num_blocks * block_size`` means "padding, drop the write". A
quantized cache (``kv_quant="int8"|"fp8"``) holds a ``(codes, scales)`` pair per
layer instead (see :mod:`inference.kernels.quant`): written through the
quantizing write, dequantized when prefill gathers its blocks and inside the
decode attention. Which one a layer holds is known at trace time, so the float
path compiles to the same program as if quantization did not exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from inference.kernels.quant import code_dtype, init_quantized_cache, write_quantized_kv_flat
from inference.kernels.xla_attention import gather_block_rows

__all__ = ["LayerKV", "KVCache", "init_kv_cache", "kv_bytes_per_token", "write", "gather", "over_cache"]

Array = jax.Array
LayerKV = Array | tuple[Array, Array]  # float [N,bs,KV,D], or (codes [N,bs,KV,D], scales [N,KV])
KVCache = tuple[tuple[LayerKV, ...], tuple[LayerKV, ...]]  # (keys per layer, values per layer)


def init_kv_cache(layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int, dtype: Any,
                  kv_quant: str | None = None) -> KVCache:
    """Zeroed cache: float ``dtype`` arrays, or ``(codes, scales)`` pairs with ``kv_quant``."""
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def layer() -> LayerKV:
        return jnp.zeros(shape, dtype) if kv_quant is None else init_quantized_cache(*shape, kv_quant)

    return tuple(layer() for _ in range(layers)), tuple(layer() for _ in range(layers))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: Any,
                       kv_quant: str | None = None) -> float:
    """Cache bytes one token takes over all layers, K and V (a quantized block's scales shared by its tokens)."""
    per_head = head_dim * jnp.dtype(dtype if kv_quant is None else code_dtype(kv_quant)).itemsize
    if kv_quant is not None:
        per_head += 4 / block_size  # one float32 scale per (block, KV head)
    return 2 * layers * kv_heads * per_head


def write(cache: LayerKV, slots: Array, new: Array, *, as_bytes: bool = False) -> LayerKV:
    """Write ``new`` [..., KV, D] at flat ``slots`` (``>= N*block_size``: dropped), in place.

    A quantized ``(codes, scales)`` layer goes through the quantizing write (``as_bytes``: float8 codes
    scattered as bytes, see :func:`inference.kernels.quant.write_quantized_kv`).

    Indexed as (block, offset) pairs, not through a flat ``[N*bs, KV, D]``
    view: with one row XLA turns the flat-view scatter into a
    dynamic-update-slice it duplicates per consumer, which copies every
    layer's whole cache on each batch-1 decode step (~600 ms on the bench
    model instead of ~10 ms).
    """
    if isinstance(cache, tuple):
        return write_quantized_kv_flat(*cache, new, slots, as_bytes=as_bytes)
    bs, kv, d = cache.shape[1:]
    flat = slots.reshape(-1)
    return cache.at[flat // bs, flat % bs].set(new.reshape(-1, kv, d), mode="drop")


def gather(cache: LayerKV, block_tables: Array, dtype: Any) -> Array:
    """The blocks of each row's table, as ``[B, M*block_size, KV, D]`` (dequantized to ``dtype``)."""
    codes, scales = cache if isinstance(cache, tuple) else (cache, None)
    kv, d = codes.shape[2:]
    rows = gather_block_rows(codes, scales, block_tables)
    return rows.astype(dtype).reshape(block_tables.shape[0], -1, kv, d)


def over_cache(fn: Callable[..., Array]) -> Callable[..., Array]:
    """A kernel of the form ``fn(q, k, v, tables, *lens, scale=, k_scale=, v_scale=)`` called on cache layers:
    a float cache as it is, or codes with their scales (dequantized inside the kernel)."""
    def call(q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array, *lens: Array, scale: float) -> Array:
        if isinstance(kc, tuple) and isinstance(vc, tuple):
            return fn(q, kc[0], vc[0], block_tables, *lens, scale=scale, k_scale=kc[1], v_scale=vc[1])
        return fn(q, kc, vc, block_tables, *lens, scale=scale)

    return call
