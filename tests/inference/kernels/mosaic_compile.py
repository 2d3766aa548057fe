"""Compile the TPU kernels with Mosaic itself, for compile-only TPUs: no TPU needed, only the libtpu wheel.

``jax.export(..., platforms=["tpu"])`` (the kernels' own tests) checks the
Pallas -> Mosaic lowering. Mosaic's own passes (layout inference, vector
layouts, VMEM budgets) run in libtpu's compiler; with the wheel importable,
``jax.experimental.topologies`` gives compile-only devices of a named TPU
generation and ``.lower(...).compile()`` runs that compiler on this host.

Run with libtpu on the path (``make test`` installs it into ``.venv/libtpu``
and ``test_mosaic_compile.py`` runs this in a subprocess, so no other test
process loads libtpu)::

    PYTHONPATH=.venv/libtpu:. .venv/bin/python -m tests.inference.kernels.mosaic_compile [--topology v5e:2x2]

Prints one line per case and exits 1 if any fails to compile.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from inference.kernels.tpu_decode import tpu_paged_decode
from inference.kernels.tpu_prefill import TpuPrefillBlocks, tpu_flash_prefill
from inference.kernels.tpu_quant_matmul import TpuMatmulBlocks, tpu_quantized_matmul

Case = tuple[str, Callable[..., Any], list[tuple[tuple[int, ...], Any]]]
QUANT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def prefill_cases() -> Iterator[Case]:
    # (dtype, B, T, S, H, KV, D, blocks)
    for dt, b, t, s, h, kv, d, blocks in [
        (jnp.bfloat16, 2, 512, 1024, 32, 8, 128, TpuPrefillBlocks()),
        (jnp.bfloat16, 1, 2048, 2048, 32, 8, 128, TpuPrefillBlocks(256, 512)),
        (jnp.bfloat16, 4, 100, 300, 8, 8, 64, TpuPrefillBlocks(128, 128)),
        (jnp.float32, 2, 256, 256, 16, 2, 128, TpuPrefillBlocks(128, 256)),
        (jnp.float32, 3, 17, 40, 8, 1, 64, TpuPrefillBlocks()),
    ]:
        fn = jax.jit(lambda q, k, v, o, n, d=d, blocks=blocks: tpu_flash_prefill(q, k, v, o, n, scale=d**-0.5,
                                                                                 blocks=blocks))  # fmt: skip
        name = f"prefill {jnp.dtype(dt).name} B{b} T{t} S{s} H{h} KV{kv} D{d} q{blocks.block_q} k{blocks.block_k}"
        yield name, fn, [((b, t, h, d), dt), ((b, s, kv, d), dt), ((b, s, kv, d), dt), ((b,), jnp.int32),
                         ((b,), jnp.int32)]  # fmt: skip


def decode_cases() -> Iterator[Case]:
    # (cache dtype, q dtype, KV, H, D, page size, pages per step); 8 sequences, 512 pages, tables of 32
    for cdt, qdt, kv, h, d, bs, pps in [
        (jnp.float32, jnp.float32, 8, 32, 128, 16, 1),
        (jnp.float32, jnp.float32, 2, 8, 64, 8, 3),
        (jnp.float32, jnp.float32, 3, 12, 128, 16, 2),
        (jnp.bfloat16, jnp.bfloat16, 8, 32, 128, 16, 2),
        (jnp.bfloat16, jnp.bfloat16, 1, 8, 256, 32, 1),
        (jnp.int8, jnp.bfloat16, 8, 32, 128, 16, 1),
        (jnp.int8, jnp.float32, 2, 16, 256, 32, 2),
        (jnp.float8_e4m3fn, jnp.bfloat16, 8, 64, 128, 16, 4),
    ]:
        b, n, m = 8, 512, 32

        def fn(q, kc, vc, tables, lens, ks=None, vs=None, d=d, pps=pps):
            return tpu_paged_decode(q, kc, vc, tables, lens, scale=d**-0.5, k_scale=ks, v_scale=vs,
                                    pages_per_step=pps)

        args = [((b, h, d), qdt), ((n, bs, kv, d), cdt), ((n, bs, kv, d), cdt), ((b, m), jnp.int32),
                ((b,), jnp.int32)]  # fmt: skip
        if jnp.dtype(cdt) in QUANT:
            args += [((n, kv), jnp.float32)] * 2
        yield (f"decode {jnp.dtype(cdt).name} cache, {jnp.dtype(qdt).name} q, KV{kv} H{h} D{d} page {bs} "
               f"x{pps}/step", jax.jit(fn), args)  # fmt: skip


def matmul_cases() -> Iterator[Case]:
    # (x dtype, codes dtype, M, K, N, groups, blocks)
    for xdt, cdt, m, k, n, groups, blocks in [
        (jnp.bfloat16, jnp.int8, 8, 4096, 4096, None, TpuMatmulBlocks(8, 256, 512)),
        (jnp.bfloat16, jnp.float8_e4m3fn, 256, 4096, 1024, None, TpuMatmulBlocks()),
        (jnp.bfloat16, jnp.int8, 32, 4096, 1024, 32, TpuMatmulBlocks(32, 512, 512)),
        (jnp.float32, jnp.int8, 5, 300, 200, None, TpuMatmulBlocks()),
    ]:
        fn = jax.jit(lambda x, c, s, blocks=blocks: tpu_quantized_matmul(x, c, s, blocks=blocks))
        scale = ((n,) if groups is None else (groups, n), jnp.float32)
        name = (f"matmul {jnp.dtype(xdt).name} x {jnp.dtype(cdt).name} M{m} K{k} N{n} "
                f"{'per channel' if groups is None else f'{groups} groups'}")  # fmt: skip
        yield name, fn, [((m, k), xdt), ((k, n), cdt), scale]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:2x2", help="a compile-only TPU topology, e.g. v5e:2x2, v6e:2x2")
    args = ap.parse_args(argv)
    device = topologies.get_topology_desc(args.topology, platform="tpu").devices[0]
    sharding = SingleDeviceSharding(device)
    print(f"compiling for {device.device_kind} ({args.topology}), jax {jax.__version__}")
    failed = 0
    for name, fn, shapes in [*prefill_cases(), *decode_cases(), *matmul_cases()]:
        t0 = time.perf_counter()
        try:
            fn.lower(*(jax.ShapeDtypeStruct(s, dt, sharding=sharding) for s, dt in shapes)).compile()
        except Exception:  # report every case, then fail
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=3)}", flush=True)
            continue
        print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
