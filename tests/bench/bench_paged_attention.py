"""One layer's paged decode attention on the bench model's shapes, against the dense gather-everything version.

Shapes of ``bench_decode.model_config``: 8 query heads, 4 KV heads of dim 64,
float32, 16-token blocks, a 32-block table (``max_model_len`` 512), 2048
blocks in the cache, contexts uniform in 100-200, block ids scattered. Each
row times the decode of a kernel set (``--kernels``, default ``auto``: what a
worker here runs, the native kernel on CPU; ``xla`` for the jnp loop) and the
reference's (every table block gathered, one masked softmax) under
``jax.jit``; the figure is process CPU time per call, best of ``--repeats``
rounds of ``--inner`` calls, the two alternating. Pin to one core
(``taskset -c 0``); the load average is printed per row.

    taskset -c 0 .venv/bin/python -m tests.bench.bench_paged_attention [--batches 1,8,32] [--kernels xla]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import reference
from inference.kernels.kernel_set import build_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, TABLE, BLOCKS = 8, 4, 64, 16, 32, 2048


def inputs(batch: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM), np.float32))
    kc = jnp.asarray(rng.standard_normal((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
    vc = jnp.asarray(rng.standard_normal((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
    tables = jnp.asarray(rng.permutation(BLOCKS)[: batch * TABLE].reshape(batch, TABLE).astype(np.int32))
    lens = jnp.asarray(rng.integers(100, 201, size=batch).astype(np.int32))
    return q, kc, vc, tables, lens


def cpu_ms(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...], inner: int) -> float:
    c0 = time.process_time()
    for _ in range(inner):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.process_time() - c0) / inner * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--kernels", default="auto", help="the kernel set timed: auto, native, xla, pallas")
    args = ap.parse_args(argv)
    scale = HEAD_DIM**-0.5
    ours = jax.jit(functools.partial(build_kernels(args.kernels).decode, scale=scale))
    dense = jax.jit(functools.partial(reference.paged_decode_attention, scale=scale))
    print(f"{'batch':>5} {'paged ms':>9} {'dense ms':>9} {'ratio':>6} {'max err':>8}  load")
    for batch in (int(b) for b in args.batches.split(",")):
        x = inputs(batch)
        err = float(jnp.max(jnp.abs(ours(*x) - dense(*x))))
        t_ours = t_dense = float("inf")
        for _ in range(args.repeats):
            t_ours = min(t_ours, cpu_ms(ours, x, args.inner))
            t_dense = min(t_dense, cpu_ms(dense, x, args.inner))
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"{batch:>5} {t_ours:>9.3f} {t_dense:>9.3f} {t_dense / t_ours:>5.2f}x {err:>8.1e}  {load}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
