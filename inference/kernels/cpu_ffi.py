"""Native CPU kernels, built on first use and called through the XLA FFI.

``cpu_decode.cc``: paged decode attention over a float32 cache. The plain
``jnp`` version runs on CPU as small XLA ops in a run-time loop that copy
every gathered block before reading it and never use a second core (at
batch 32 on the bench model ~15-26 ms of a ~32-44 ms step on two threads,
``tests/bench/bench_decode.py`` docstring); the kernel reads each K/V row in
place through the block table, once, and shares the sequences out over
XLA's own intra-op threads (``cpu_parallel.h``). ``cpu_prefill.cc``: causal
prefill attention over the gathered keys; the ``jnp`` loop scores whole key
chunks, the masked half included, on one core (7.4 of a 53.4 ms 128-token
prefill call, 67 of 225 ms at 512); the kernel visits only the key tiles a
query tile sees, with register-tiled products, over the same threads (8
layers' attention at 128 tokens 6.3 -> 1.4 ms, at 512 50 -> 18 ms). Both
share ``cpu_simd.h``. Float32 only; other dtypes keep the ``jnp`` path.

``cpu_matmul.cc``: ``x @ W.T`` for float32 projections stored packed (16-column
panels, ``inference.kernels.projections.pack_weight``), a 6 x 16 register-tiled
GEMM that prefetches the next panel while it multiplies this one, for every
row count (decode and prefill). Bench model, 8-layer projection chain, two
threads: 32 rows 13.1 -> 11.3 ms, 8 rows 7.2 -> 5.7, 64 rows 23.2 -> 20.2;
whole decode step at batch 32 22.3 -> 19.2 ms. A first version that
multiplied unpacked ``[out, in]`` rows as dot products (6x2 tiles, horizontal
sums) was slower than XLA's multiply-reduce and was dropped. The same call
multiplies only a bucket's real rows (``live``) and takes the RMSNorm before a
projection, the SwiGLU before w_down and the residual adds in with it (the
decode bench's batch-32 run: prefill ~0.88 -> ~0.79 s, decode ~1.61 -> ~1.51 s).

``cpu_rope.cc``: one layer's RoPE on q and k and its new K/V written into the paged
cache, as one call. XLA fused RoPE's cos and sin into every layer's rotation and
evaluated them per head element; as this call's operands they are computed once per
call, and the rotated k and v go straight to their slots (no reshape copies, no
scatters). bench_decode's batch-32 run 2.59 -> 2.48 s, decode step 17.9 -> 17.0 ms.

How: the sources are compiled with the system ``g++`` for one instruction-set level
(:mod:`inference.kernels.cpu_isa`: ``avx512``, ``avx2`` or ``generic``, the best this CPU executes
unless ``$QUICSERVE_CPU_ISA`` names one) into a cached library, loaded with ctypes, and each handler
registered as an FFI target for the CPU platform under a name that carries the level, so one process
can hold several levels (the tests compare them). Anything missing (no compiler, a failed build)
logs once and :func:`available` returns False, so the kernel set
(:mod:`inference.kernels.kernel_set`) picks the XLA kernels instead. Which calls run here is the
kernel set's choice: on CPU, for float32 models.
``QUICSERVE_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import cpu_isa

__all__ = ["available", "paged_decode_cpu", "prefill_attention_cpu", "matmul_packed_cpu",
           "rope_write_kv_cpu", "gather_live_cpu", "THREADS"]

log = logging.getLogger(__name__)

_TARGETS = {"quicserve_paged_decode_f32": "QuicservePagedDecodeF32",
            "quicserve_prefill_f32": "QuicservePrefillF32",
            "quicserve_gather_live_f32": "QuicserveGatherLiveF32",
            "quicserve_matmul_packed_f32": "QuicserveMatmulPackedF32",
            "quicserve_matmul_packed_norm_f32": "QuicserveMatmulPackedNormF32",
            "quicserve_matmul_packed_residual_f32": "QuicserveMatmulPackedResidualF32",
            "quicserve_rope_write_kv_f32": "QuicserveRopeWriteKvF32"}
THREADS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@functools.cache
def _load_and_register(level: str) -> None:
    """Build (or find) one level's library and register its handlers, once per process and level: XLA
    refuses a second registration of the same target from another address, and then fails to start
    its CPU backend."""
    lib = ctypes.cdll.LoadLibrary(str(cpu_isa.build(cpu_isa.level(level))))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(f"{target}_{level}", jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    log.info("native CPU kernels loaded for %s (%s picks another level)", level, cpu_isa.ENV_VAR)


def _target(name: str, level: str | None) -> str:
    """The registered FFI target of ``name`` at ``level`` (default: :func:`cpu_isa.level`), loading it first."""
    lv = cpu_isa.level(level).name
    _load_and_register(lv)
    return f"{name}_{lv}"


@functools.cache
def available(level: str | None = None) -> bool:
    """Whether the kernels are built and registered for ``level`` (default: the chosen one), False and
    logged once if they cannot be. An unknown level, or one this CPU cannot run, is a ValueError."""
    if os.environ.get("QUICSERVE_CPU_KERNELS", "1") == "0":
        return False
    name = cpu_isa.level(level).name
    try:
        _load_and_register(name)
    except Exception as exc:  # noqa: BLE001 -- any failure means "use the XLA kernels"
        log.warning("native CPU kernels unavailable, the kernel set takes the XLA ones: %s", exc)
        return False
    return True


def paged_decode_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                     context_lens: jax.Array, *, scale: float, window: int | None = None, threads: int = THREADS,
                     level: str | None = None) -> jax.Array:
    """``inference.kernels.xla_attention.paged_decode_attention`` for float32 caches, as one native call.

    Call only when :func:`available` is True. Context lengths past the block table are clamped to it;
    with a sliding ``window``, table entries before a row's window are never read.
    """
    call = jax.ffi.ffi_call(_target("quicserve_paged_decode_f32", level), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache, v_cache, block_tables.astype(jnp.int32),
                context_lens.astype(jnp.int32), scale=np.float32(scale), threads=np.int64(threads),
                window=np.int64(window or 0))


def prefill_attention_cpu(q: jax.Array, k: jax.Array, v: jax.Array, q_offsets: jax.Array, kv_lens: jax.Array,
                          *, scale: float, window: int | None = None, threads: int = THREADS,
                          level: str | None = None) -> jax.Array:
    """``inference.kernels.xla_attention.prefill_attention`` for float32 (``window`` too), as one native call.

    Call only when :func:`available` is True. Queries at or past ``kv_lens`` (padding) get zeros.
    """
    call = jax.ffi.ffi_call(_target("quicserve_prefill_f32", level), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), q_offsets.astype(jnp.int32),
                kv_lens.astype(jnp.int32), scale=np.float32(scale), threads=np.int64(threads),
                window=np.int64(window or 0))


def gather_live_cpu(k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array, kv_lens: jax.Array, *,
                    threads: int = THREADS, level: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Each row's blocks of the float32 caches ``[NB, BS, KV, D]`` as ``k, v [B, M * BS, KV, D]``, copying
    only the blocks that hold its first ``kv_lens[b]`` keys: the rest is left unwritten, so only
    :func:`prefill_attention_cpu` (which reads no key past ``kv_lens``) may consume them."""
    b, m = block_tables.shape
    shape = jax.ShapeDtypeStruct((b, m * k_cache.shape[1], *k_cache.shape[2:]), jnp.float32)
    call = jax.ffi.ffi_call(_target("quicserve_gather_live_f32", level), (shape, shape))
    return call(k_cache, v_cache, block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32),
                threads=np.int64(threads))


def matmul_packed_cpu(x: jax.Array, panels: jax.Array, n: int, *, live: jax.Array | None = None,
                      norm: jax.Array | None = None, eps: float = 0.0, residual: jax.Array | None = None,
                      swiglu: bool = False, threads: int = THREADS, level: str | None = None) -> jax.Array:
    """``x [M, K] @ W.T -> [M, n]`` for float32 ``W [n, K]`` stored as ``panels [ceil(n/16), K, 16]``
    (``inference.kernels.projections.pack_weight``), as one native call. Call only when :func:`available` is True.

    ``live [G]`` (int32): x's rows are G groups of M / G and only the first ``live[g]`` rows of group g
    are multiplied; the others (a shape bucket's padding) are skipped and come out zero. Fused on the
    way: ``norm [K]`` multiplies ``rms_norm(x, norm, eps)`` instead of ``x``; ``residual [M, n]`` is
    added to the product; with ``swiglu`` (and a residual) ``x [M, 2K]`` is gate | up and
    ``silu(gate) * up`` is multiplied.
    """
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    x = x.astype(jnp.float32)
    live = jnp.full((1,), x.shape[0], jnp.int32) if live is None else live.astype(jnp.int32)
    if norm is not None:
        call = jax.ffi.ffi_call(_target("quicserve_matmul_packed_norm_f32", level), out)
        return call(x, panels, live, norm.astype(jnp.float32), eps=np.float32(eps), threads=np.int64(threads))
    if residual is not None:
        call = jax.ffi.ffi_call(_target("quicserve_matmul_packed_residual_f32", level), out)
        return call(x, panels, live, residual.astype(jnp.float32), swiglu=np.int64(swiglu),
                    threads=np.int64(threads))
    if swiglu:
        raise ValueError("swiglu is fused only with a residual")
    return jax.ffi.ffi_call(_target("quicserve_matmul_packed_f32", level), out)(x, panels, live, threads=np.int64(threads))


def rope_write_kv_cpu(qkv: jax.Array, cos: jax.Array, sin: jax.Array, slots: jax.Array, k_cache: jax.Array,
                      v_cache: jax.Array, *, heads: int,
                      threads: int = THREADS, level: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's RoPE and K/V cache write (``cpu_rope.cc``): ``qkv [R, (heads + 2 KV) D]`` (q | k | v),
    ``cos``/``sin [R, D/2]``, ``slots [R]`` (outside the cache: dropped) -> rotated ``q [R, heads, D]`` and
    the caches with rotated k and v written, in place (aliased). Call only when :func:`available` is True."""
    r, d = qkv.shape[0], k_cache.shape[-1]
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    results = (f32((r, heads, d)), f32(k_cache.shape), f32(v_cache.shape))
    call = jax.ffi.ffi_call(_target("quicserve_rope_write_kv_f32", level), results, input_output_aliases={4: 1, 5: 2})
    return call(qkv.astype(jnp.float32), cos, sin, slots.astype(jnp.int32), k_cache, v_cache,
                threads=np.int64(threads))
