"""The native CPU kernels on each instruction-set level this host runs, against each other (one run).

Why: the level is picked from the CPU (``inference.kernels.cpu_isa``), so a slower level would go
unnoticed wherever it is picked. Each kernel runs at the bench model's shapes (bench_decode: 8
query / 4 KV heads, head dim 64, hidden 512, intermediate 1376, block 16): decode attention at
batch 32 over contexts of 100-200 keys, prefill attention of one 128- and one 512-token prompt,
the packed projections of a batch-32 decode step (fused q|k|v with the RMSNorm, w_down with SwiGLU
and the residual) and RoPE with the K/V write. Variants are timed round-robin (``--rounds``
rounds of ``--calls`` calls each) and the best round counts, so a busy machine slows all alike;
the ratio column is each level's time over the first level's.

    .venv/bin/python -m tests.bench.bench_cpu_levels [--levels avx512,avx2,generic] [--rounds 15]
    taskset -c 1 .venv/bin/python -m tests.bench.bench_cpu_levels --threads 1 --cpu   # on a busy machine
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import cpu_ffi, cpu_isa
from inference.kernels.projections import pack_weight

HEADS, KV, D, BS, HIDDEN, FFN = 8, 4, 64, 16, 512, 1376


def cases(level: str, rng: np.random.Generator, threads: int) -> dict[str, Callable[[], jax.Array]]:
    """One zero-argument call per kernel workload at ``level`` on ``threads`` threads, each jitted and warmed."""

    f32 = np.float32
    b, n_blocks = 32, 2048
    kc, vc = (jnp.asarray(rng.standard_normal((n_blocks, BS, KV, D), dtype=f32)) for _ in range(2))
    tables = jnp.asarray(rng.permutation(n_blocks)[: b * 13].reshape(b, 13).astype(np.int32))
    ctx = jnp.asarray(rng.integers(100, 201, b).astype(np.int32))
    q1 = jnp.asarray(rng.standard_normal((b, HEADS, D), dtype=f32))
    out: dict[str, Callable[[], jax.Array]] = {}
    decode = jax.jit(lambda q: cpu_ffi.paged_decode_cpu(q, kc, vc, tables, ctx, scale=D ** -0.5, level=level,
                                                        threads=threads))
    out["decode attention b=32"] = lambda: decode(q1)
    for t in (128, 512):
        q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, D), dtype=f32)) for h in (HEADS, KV, KV))
        args = (q, k, v, jnp.zeros(1, jnp.int32), jnp.full(1, t, jnp.int32))
        fn = jax.jit(lambda *a: cpu_ffi.prefill_attention_cpu(*a, scale=D ** -0.5, level=level, threads=threads))
        out[f"prefill attention t={t}"] = lambda fn=fn, args=args: fn(*args)
    x = jnp.asarray(rng.standard_normal((b, HIDDEN), dtype=f32))
    qkv_w = pack_weight(rng.standard_normal(((HEADS + 2 * KV) * D, HIDDEN), dtype=f32) * 0.05)
    norm = jnp.ones(HIDDEN, jnp.float32)
    proj = jax.jit(lambda x: cpu_ffi.matmul_packed_cpu(x, qkv_w.panels, qkv_w.shape[0], norm=norm, eps=1e-5,
                                                       level=level, threads=threads))
    out["qkv projection + norm b=32"] = lambda: proj(x)
    gate_up = jnp.asarray(rng.standard_normal((b, 2 * FFN), dtype=f32))
    down_w = pack_weight(rng.standard_normal((HIDDEN, FFN), dtype=f32) * 0.05)
    down = jax.jit(lambda g: cpu_ffi.matmul_packed_cpu(g, down_w.panels, HIDDEN, residual=x, swiglu=True,
                                                       level=level, threads=threads))
    out["w_down + swiglu + residual b=32"] = lambda: down(gate_up)
    qkv = jnp.asarray(rng.standard_normal((b, (HEADS + 2 * KV) * D), dtype=f32))
    angles = rng.uniform(0, 100, (b, D // 2)).astype(f32)
    cos, sin = jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))
    slots = jnp.asarray(rng.permutation(n_blocks * BS)[:b].astype(np.int32))
    # The caches are donated, as the model step donates them: the write goes in place, no 2 x 33 MB copy.
    rope = jax.jit(lambda qkv, kc, vc: cpu_ffi.rope_write_kv_cpu(qkv, cos, sin, slots, kc, vc, heads=HEADS,
                                                                 level=level, threads=threads),
                   donate_argnums=(1, 2))
    caches = [jnp.array(kc), jnp.array(vc)]

    def rope_step() -> jax.Array:
        q, caches[0], caches[1] = rope(qkv, *caches)
        return q

    out["rope + kv write b=32"] = rope_step
    for fn in out.values():
        fn().block_until_ready()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default=",".join(lv.name for lv in cpu_isa.host_levels()))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=cpu_ffi.THREADS)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time: the robust figure on "
                    "a shared machine with --threads 1 (time descheduled is not counted)")
    args = ap.parse_args(argv)
    levels = [cpu_isa.level(name).name for name in args.levels.split(",")]
    for name in levels:
        if not cpu_ffi.available(name):
            raise SystemExit(f"the {name} kernels did not build")
    runs = {name: cases(name, np.random.default_rng(0), args.threads) for name in levels}
    clock = time.process_time if args.cpu else time.perf_counter
    best = {(name, case): float("inf") for name in levels for case in runs[name]}
    for _ in range(args.rounds):
        for name in levels:
            for case, fn in runs[name].items():
                t0 = clock()
                for _ in range(args.calls):
                    fn().block_until_ready()
                best[name, case] = min(best[name, case], (clock() - t0) / args.calls)
    print(f"best of {args.rounds} rounds x {args.calls} calls, {'process CPU' if args.cpu else 'wall'} time; load "
          f"average {os.getloadavg()[0]:.1f}; {args.threads} threads; ratio = level / {levels[0]}")
    print(f"{'kernel':<34}" + "".join(f"{name:>10} {'ratio':>6}" for name in levels))
    for case in runs[levels[0]]:
        base = best[levels[0], case]
        print(f"{case:<34}" + "".join(f"{best[name, case] * 1e3:>8.3f}ms {best[name, case] / base:>6.2f}"
                                      for name in levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
