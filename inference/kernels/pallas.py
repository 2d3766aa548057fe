"""The Pallas kernels as the kernel set calls them: two families, block sizes tuned per shape.

``flash_prefill``/``paged_decode``/``quant_matmul`` are written for Triton (GPU) and
``tpu_prefill``/``tpu_decode``/``tpu_quant_matmul`` for Mosaic (TPU).
:func:`gpu_kernels` and :func:`tpu_kernels` wrap a family as :class:`PallasKernels`
with the signatures of :mod:`inference.kernels.reference`::

    prefill(q, k, v, q_offsets, kv_lens, *, scale) -> [B,T,H,D]
    paged_prefill(q, k_cache, v_cache, block_tables, q_offsets, kv_lens, *, scale,
                  k_scale=None, v_scale=None) -> [B,T,H,D]
    decode(q, k_cache, v_cache, block_tables, context_lens, *, scale,
           k_scale=None, v_scale=None) -> [B,H,D]
    matmul(x, w) -> x @ w   (w: a QuantizedWeight [in, out], or a float array)

Compiled on their own accelerator, with block sizes from the autotuner (tuned
on first trace of each shape, then read from the cache file; the key names
``platform``); with ``interpret=True`` the kernel bodies run as plain JAX on
any host, which is what the CPU tests do. Which family runs, and whether
interpreted, is :mod:`inference.kernels.kernel_set`'s choice; nothing here
asks which backend it is on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import reference
from inference.kernels.autotune import Autotuner, time_call
from inference.kernels.flash_prefill import PrefillBlocks, flash_prefill, paged_flash_prefill
from inference.kernels.paged_decode import DecodeBlocks, paged_decode, supports
from inference.kernels.quant import QuantizedWeight, gather_dequantized, quantized_matmul
from inference.kernels.quant_matmul import MatmulBlocks, pallas_quantized_matmul
from inference.kernels.reference import Array
from inference.kernels.tpu_decode import LANES, head_dim_fits, tpu_paged_decode
from inference.kernels.tpu_prefill import (
    TpuPrefillBlocks,
    paged_prefill_supports,
    tpu_flash_prefill,
    tpu_paged_flash_prefill,
)
from inference.kernels.tpu_quant_matmul import TpuMatmulBlocks, tpu_quantized_matmul

__all__ = [
    "FAMILIES",
    "PallasKernels",
    "gpu_kernels",
    "tpu_kernels",
    "prefill_candidates",
    "decode_candidates",
    "tuned_prefill_blocks",
    "tuned_decode_blocks",
    "matmul_candidates",
    "tuned_matmul_blocks",
    "TpuDecodeBlocks",
    "tpu_prefill_candidates",
    "tpu_decode_candidates",
    "tuned_tpu_prefill_blocks",
    "tuned_tpu_decode_blocks",
    "tuned_tpu_matmul_blocks",
]

log = logging.getLogger(__name__)
FAMILIES = ("gpu", "tpu")  # the Pallas kernel families, by the accelerator each is written for
PrefillFn = Callable[..., Array]
DecodeFn = Callable[..., Array]


@dataclasses.dataclass(frozen=True, slots=True)
class PallasKernels:
    """One family's kernels (signatures in the module docstring). ``paged_prefill`` reads keys straight
    from the paged cache, which the model prefers to gathering each row's table."""

    prefill: PrefillFn
    paged_prefill: PrefillFn
    decode: DecodeFn
    matmul: Callable[[Array, QuantizedWeight | Array], Array]


def prefill_candidates() -> list[PrefillBlocks]:
    """Tiles tried on GPU; the first is the default."""
    return [
        PrefillBlocks(128, 64, 4, 3),
        PrefillBlocks(128, 64, 8, 3),
        PrefillBlocks(128, 128, 8, 2),
        PrefillBlocks(128, 128, 8, 3),
        PrefillBlocks(64, 64, 4, 3),
        PrefillBlocks(64, 128, 4, 2),
    ]


def decode_candidates(batch: int, kv_heads: int) -> list[DecodeBlocks]:
    """Chunks/splits tried on GPU: split the sequence when B*KV programs are too few."""
    splits = [1, 2] if batch * kv_heads >= 256 else [4, 8, 16]
    out = [DecodeBlocks(8, splits[0], 4, 2), DecodeBlocks(4, splits[0], 4, 2)]
    for s in splits:
        for cand in (DecodeBlocks(8, s, 4, 2), DecodeBlocks(16, s, 8, 2)):
            if cand not in out:
                out.append(cand)
    return out


def _random(shape: tuple[int, ...], dtype: jnp.dtype, seed: int) -> Array:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-127, 128, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _tuned_prefill(tuner: Autotuner, q: Array, k: Array, kernel: Callable[..., Array], candidates: list,
                   family: str, interpret: bool, platform: str):  # fmt: skip
    """Block sizes for this prefill shape from ``candidates``, timed on ``kernel`` over full-length causal
    inputs; ``family`` tags the cache key ("" for Triton, "-mosaic" for TPU), ``platform`` where it runs."""
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    key = f"prefill/{platform}{family}/B{b}-T{t}-S{s}-H{h}-KV{kv}-D{d}-{jnp.dtype(q.dtype).name}"

    def measure(blocks) -> float:
        args = (_random(q.shape, q.dtype, 0), _random(k.shape, k.dtype, 1), _random(k.shape, k.dtype, 2))
        offs, lens = jnp.full((b,), s - t, jnp.int32), jnp.full((b,), s, jnp.int32)
        fn = functools.partial(kernel, scale=d**-0.5, blocks=blocks, interpret=interpret)
        return time_call(lambda: fn(*args, offs, lens), iters=5)

    return tuner.pick(key, candidates, measure)


def tuned_prefill_blocks(tuner: Autotuner, q: Array, k: Array, *, interpret: bool = False,
                         platform: str = "gpu") -> PrefillBlocks:
    """Block sizes for this prefill shape (tuned on full-length causal inputs)."""
    return _tuned_prefill(tuner, q, k, flash_prefill, prefill_candidates(), "", interpret, platform)


def _tuned_decode(tuner: Autotuner, q: Array, k_cache: Array, block_tables: Array, quantized: bool,
                  kernel: Callable[..., Callable[..., Array]], candidates: list, family: str,
                  platform: str):  # fmt: skip
    """Decode tiles for this shape from ``candidates``, timed with every page in use on ``kernel(blocks)``
    (the decode function those tiles configure); ``family`` tags the cache key as for prefill."""
    b, h, d = q.shape
    n, bs, kv, _ = k_cache.shape
    m = block_tables.shape[1]
    key = (
        f"decode/{platform}{family}/B{b}-H{h}-KV{kv}-D{d}-N{n}-bs{bs}-M{m}-"
        f"{jnp.dtype(q.dtype).name}-{jnp.dtype(k_cache.dtype).name}"
    )

    def measure(blocks) -> float:
        qq = _random(q.shape, q.dtype, 0)
        kc = _random(k_cache.shape, k_cache.dtype, 1)
        vc = _random(k_cache.shape, k_cache.dtype, 2)
        tables = jnp.asarray(np.random.default_rng(3).integers(0, n, (b, m)), jnp.int32)
        lens = jnp.full((b,), m * bs, jnp.int32)
        scales = jnp.full((n, kv), 0.01, jnp.float32) if quantized else None
        fn = functools.partial(kernel(blocks), scale=d**-0.5, k_scale=scales, v_scale=scales)
        return time_call(lambda: fn(qq, kc, vc, tables, lens), iters=10)

    return tuner.pick(key, candidates, measure)


def tuned_decode_blocks(tuner: Autotuner, q: Array, k_cache: Array, block_tables: Array, *, quantized: bool,
                        interpret: bool = False, platform: str = "gpu") -> DecodeBlocks:
    """Chunk/split sizes for this decode shape (tuned with every page in use)."""
    def kernel(blocks: DecodeBlocks) -> Callable[..., Array]:
        return functools.partial(paged_decode, blocks=blocks, interpret=interpret)

    return _tuned_decode(tuner, q, k_cache, block_tables, quantized, kernel,
                         decode_candidates(q.shape[0], k_cache.shape[2]), "", platform)  # fmt: skip


def matmul_candidates(m: int) -> list[MatmulBlocks]:
    """Weight-only matmul tiles tried on GPU: thin row blocks for decode-sized M."""
    if m <= 16:
        return [MatmulBlocks(16, 128, 128, 4, 3), MatmulBlocks(16, 256, 64, 4, 3), MatmulBlocks(16, 64, 256, 4, 4)]
    return [MatmulBlocks(64, 128, 64, 4, 3), MatmulBlocks(128, 128, 64, 8, 3), MatmulBlocks(64, 256, 64, 8, 3),
            MatmulBlocks(128, 256, 64, 8, 3)]


def tuned_matmul_blocks(tuner: Autotuner, x: Array, codes: Array, *, platform: str = "gpu") -> MatmulBlocks:
    """Tiles for ``x[..., K] @ codes[K, N]`` (the weight-only quantized matmul)."""
    k, n = codes.shape
    m = int(np.prod(x.shape[:-1]))
    key = f"wmatmul/{platform}/M{m}-K{k}-N{n}-{jnp.dtype(x.dtype).name}-{jnp.dtype(codes.dtype).name}"

    def measure(blocks: MatmulBlocks) -> float:
        xx = _random((m, k), x.dtype, 0)
        cc = _random((k, n), codes.dtype, 1)
        ss = jnp.full((n,), 0.01, jnp.float32)
        return time_call(lambda: pallas_quantized_matmul(xx, cc, ss, blocks=blocks), iters=10)

    return tuner.pick(key, matmul_candidates(m), measure)


def _gathered_prefill(prefill_fn: PrefillFn, q: Array, k_cache: Array, v_cache: Array, block_tables: Array,
                      q_offsets: Array, kv_lens: Array, scale: float, k_scale: Array | None,
                      v_scale: Array | None) -> Array:  # fmt: skip
    """A dense ``prefill_fn`` over each row's table gathered (and dequantized) into contiguous keys."""
    if k_scale is None:
        k, v = reference.gather_pages(k_cache, block_tables), reference.gather_pages(v_cache, block_tables)
    else:
        k = gather_dequantized(k_cache, k_scale, block_tables, q.dtype)
        v = gather_dequantized(v_cache, v_scale, block_tables, q.dtype)
    return prefill_fn(q, k, v, q_offsets, kv_lens, scale=scale)


def gpu_kernels(*, platform: str = "gpu", interpret: bool = False, tuner: Autotuner) -> PallasKernels:
    """The Triton-model kernels (compiled on ``platform`` "gpu"; any platform with ``interpret``)."""
    def prefill(q: Array, k: Array, v: Array, q_offsets: Array, kv_lens: Array, *, scale: float) -> Array:
        blocks = tuned_prefill_blocks(tuner, q, k, interpret=interpret, platform=platform)
        return flash_prefill(q, k, v, q_offsets, kv_lens, scale=scale, blocks=blocks, interpret=interpret)

    def paged_prefill(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, q_offsets: Array,
                      kv_lens: Array, *, scale: float, k_scale: Array | None = None,
                      v_scale: Array | None = None) -> Array:  # fmt: skip
        n, bs, kv, d = k_cache.shape
        b, m = block_tables.shape
        if not interpret and not supports(bs, d):  # the dense kernel pads what Triton cannot tile
            return _gathered_prefill(prefill, q, k_cache, v_cache, block_tables, q_offsets, kv_lens, scale,
                                     k_scale, v_scale)  # fmt: skip
        dense = jax.ShapeDtypeStruct((b, m * bs, kv, d), q.dtype)  # tuned as the dense kernel over that many keys
        blocks = tuned_prefill_blocks(tuner, q, dense, interpret=interpret, platform=platform)
        return paged_flash_prefill(q, k_cache, v_cache, block_tables, q_offsets, kv_lens, scale=scale,
                                   k_scale=k_scale, v_scale=v_scale, blocks=blocks, interpret=interpret)  # fmt: skip

    def decode(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array, *,
               scale: float, k_scale: Array | None = None, v_scale: Array | None = None) -> Array:  # fmt: skip
        if not interpret and not supports(k_cache.shape[1], q.shape[-1]):
            log.warning("paged decode: page size %d / head dim %d not powers of two; using the reference",
                        k_cache.shape[1], q.shape[-1])
            return reference.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale=scale, k_scale=k_scale, v_scale=v_scale
            )
        blocks = tuned_decode_blocks(tuner, q, k_cache, block_tables, quantized=k_scale is not None,
                                     interpret=interpret, platform=platform)  # fmt: skip
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale=scale, k_scale=k_scale,
                            v_scale=v_scale, blocks=blocks, interpret=interpret)  # fmt: skip

    def matmul(x: Array, w: QuantizedWeight | Array) -> Array:
        if not isinstance(w, QuantizedWeight):
            return x @ w
        if interpret:  # the default tiles: tuning times nothing when interpreted
            return pallas_quantized_matmul(x, w.codes, w.scale, interpret=True)
        blocks = tuned_matmul_blocks(tuner, x, w.codes, platform=platform)
        return pallas_quantized_matmul(x, w.codes, w.scale, blocks=blocks)

    return PallasKernels(prefill, paged_prefill, decode, matmul)


@dataclasses.dataclass(frozen=True, slots=True)
class TpuDecodeBlocks:
    """Pages the TPU decode kernel fetches and folds per grid step."""

    pages_per_step: int = 1


def tpu_prefill_candidates() -> list[TpuPrefillBlocks]:
    """TPU prefill tiles tried; the first is the default (a 128x128 MXU pass per group head)."""
    return [TpuPrefillBlocks(128, 128), TpuPrefillBlocks(128, 256), TpuPrefillBlocks(256, 256),
            TpuPrefillBlocks(256, 512), TpuPrefillBlocks(512, 512)]  # fmt: skip


def tpu_decode_candidates(page_size: int) -> list[TpuDecodeBlocks]:
    """Pages per step tried: enough that a step moves >= ~64 tokens of keys, and the neighbours."""
    base = max(1, 64 // page_size)
    return [TpuDecodeBlocks(p) for p in dict.fromkeys((base, 1, 2 * base, 4 * base))]


def tuned_tpu_prefill_blocks(tuner: Autotuner, q: Array, k: Array, *, interpret: bool = False,
                             platform: str = "tpu") -> TpuPrefillBlocks:
    return _tuned_prefill(tuner, q, k, tpu_flash_prefill, tpu_prefill_candidates(), "-mosaic", interpret, platform)


def tuned_tpu_decode_blocks(tuner: Autotuner, q: Array, k_cache: Array, block_tables: Array, *, quantized: bool,
                            interpret: bool = False, platform: str = "tpu") -> TpuDecodeBlocks:
    def kernel(blocks: TpuDecodeBlocks) -> Callable[..., Array]:
        return functools.partial(tpu_paged_decode, pages_per_step=blocks.pages_per_step, interpret=interpret)

    return _tuned_decode(tuner, q, k_cache, block_tables, quantized, kernel, tpu_decode_candidates(k_cache.shape[1]),
                         "-mosaic", platform)  # fmt: skip


def tuned_tpu_matmul_blocks(tuner: Autotuner, x: Array, codes: Array, *, platform: str = "tpu") -> TpuMatmulBlocks:
    """TPU tiles for ``x[..., K] @ codes[K, N]``: a thin row block for decode-sized M, square ones past it."""
    k, n = codes.shape
    m = int(np.prod(x.shape[:-1]))
    key = f"wmatmul/{platform}-mosaic/M{m}-K{k}-N{n}-{jnp.dtype(x.dtype).name}-{jnp.dtype(codes.dtype).name}"
    rows = [8, 32] if m <= 32 else [128, 256]
    cands = [TpuMatmulBlocks(r, bn, bk) for r in rows for bn, bk in ((256, 512), (512, 512), (256, 1024))]

    def measure(blocks: TpuMatmulBlocks) -> float:
        xx, cc = _random((m, k), x.dtype, 0), _random((k, n), codes.dtype, 1)
        ss = jnp.full((n,), 0.01, jnp.float32)
        return time_call(lambda: tpu_quantized_matmul(xx, cc, ss, blocks=blocks), iters=10)

    return tuner.pick(key, cands, measure)


def tpu_kernels(*, platform: str = "tpu", interpret: bool = False, tuner: Autotuner) -> PallasKernels:
    """The Mosaic-model kernels (compiled on ``platform`` "tpu"; any platform with ``interpret``)."""
    def prefill(q: Array, k: Array, v: Array, q_offsets: Array, kv_lens: Array, *, scale: float) -> Array:
        blocks = tuned_tpu_prefill_blocks(tuner, q, k, interpret=interpret, platform=platform)
        return tpu_flash_prefill(q, k, v, q_offsets, kv_lens, scale=scale, blocks=blocks, interpret=interpret)

    def paged_prefill(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, q_offsets: Array,
                      kv_lens: Array, *, scale: float, k_scale: Array | None = None,
                      v_scale: Array | None = None) -> Array:  # fmt: skip
        n, bs, kv, d = k_cache.shape
        b, m = block_tables.shape
        if not paged_prefill_supports(d):  # a head dim Mosaic cannot move in 128-lane chunks: gather, then dense
            return _gathered_prefill(prefill, q, k_cache, v_cache, block_tables, q_offsets, kv_lens, scale,
                                     k_scale, v_scale)  # fmt: skip
        dense = jax.ShapeDtypeStruct((b, m * bs, kv, d), q.dtype)  # tuned as the dense kernel over that many keys
        blocks = tuned_tpu_prefill_blocks(tuner, q, dense, interpret=interpret, platform=platform)
        return tpu_paged_flash_prefill(q, k_cache, v_cache, block_tables, q_offsets, kv_lens, scale=scale,
                                       k_scale=k_scale, v_scale=v_scale, blocks=blocks,
                                       interpret=interpret)  # fmt: skip

    def decode(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, context_lens: Array, *,
               scale: float, k_scale: Array | None = None, v_scale: Array | None = None) -> Array:  # fmt: skip
        d = q.shape[-1]
        if not head_dim_fits(d):
            log.warning("paged decode: head dim %d is over %d lanes and not a multiple of them; using the reference",
                        d, LANES)  # fmt: skip
            return reference.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale=scale, k_scale=k_scale, v_scale=v_scale
            )
        blocks = tuned_tpu_decode_blocks(tuner, q, k_cache, block_tables, quantized=k_scale is not None,
                                         interpret=interpret, platform=platform)  # fmt: skip
        return tpu_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale=scale, k_scale=k_scale,
                                v_scale=v_scale, pages_per_step=blocks.pages_per_step, interpret=interpret)  # fmt: skip

    def matmul(x: Array, w: QuantizedWeight | Array) -> Array:
        """Per-channel scales, or groups of a multiple of 128 rows: the Mosaic kernel; smaller groups: XLA."""
        if not isinstance(w, QuantizedWeight) or not (w.scale.ndim == 1 or w.group_size % 128 == 0):
            return quantized_matmul(x, w)
        tiles = tuned_tpu_matmul_blocks(tuner, x, w.codes, platform=platform)
        return tpu_quantized_matmul(x, w.codes, w.scale, blocks=tiles, interpret=interpret)

    return PallasKernels(prefill, paged_prefill, decode, matmul)
