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

Besides each kernel alone (the paged prefill over bf16, int8 and fp8 caches
among them), whole model steps compile: a two-layer Llama-3-8B-shaped model's
decode (bf16 and int8 KV caches, int8 weights) and prefill (int8 KV, keys
read through the block table by the paged prefill), bf16, with the kernel set
built for a TPU (``build_kernels("pallas", platform="tpu")``), so the model
takes its accelerator paths (no XLA:CPU multiply-reduce, no native CPU kernels).

Prints one line per case and exits 1 if any fails to compile.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from inference.kernels.autotune import Autotuner
from inference.kernels.kernel_set import KernelSet, build_kernels
from inference.kernels.paged_cache import init_kv_cache
from inference.kernels.quant import quantize_weight_t
from inference.kernels.tpu_decode import tpu_paged_decode
from inference.kernels.tpu_prefill import TpuPrefillBlocks, tpu_flash_prefill, tpu_paged_flash_prefill
from inference.kernels.tpu_quant_matmul import TpuMatmulBlocks, tpu_quantized_matmul
from inference.model import llama
from inference.model.config import LlamaConfig

Case = tuple[str, Callable[..., Any], list[Any]]  # name, jitted fn, args: (shape, dtype) or a tree of structs
QUANT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _cache_args(n: int, bs: int, kv: int, d: int, dtype: Any) -> tuple[list, list]:
    """The two caches' (shape, dtype), and their scales' when ``dtype`` holds codes."""
    caches = [((n, bs, kv, d), dtype)] * 2
    return caches, [((n, kv), jnp.float32)] * 2 if jnp.dtype(dtype) in QUANT else []


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
    # Paged: keys read through the block table. (cache dtype, q dtype, B, T, H, KV, D, page size, table width,
    # blocks); 512 pages. (256, 256) tiles shrink to fit v5e's scoped VMEM.
    for cdt, qdt, b, t, h, kv, d, bs, m, blocks in [
        (jnp.bfloat16, jnp.bfloat16, 2, 512, 32, 8, 128, 16, 64, TpuPrefillBlocks()),
        (jnp.int8, jnp.bfloat16, 2, 512, 32, 8, 128, 16, 64, TpuPrefillBlocks(256, 256)),
        (jnp.float8_e4m3fn, jnp.bfloat16, 4, 100, 8, 2, 64, 32, 16, TpuPrefillBlocks()),
        (jnp.bfloat16, jnp.bfloat16, 4, 100, 8, 2, 64, 16, 32, TpuPrefillBlocks(128, 256)),
        (jnp.float32, jnp.float32, 3, 40, 8, 2, 64, 8, 40, TpuPrefillBlocks()),
    ]:
        n = 512

        def paged(q, kc, vc, tables, offs, lens, ks=None, vs=None, d=d, blocks=blocks):
            return tpu_paged_flash_prefill(q, kc, vc, tables, offs, lens, scale=d**-0.5, k_scale=ks, v_scale=vs,
                                           blocks=blocks)  # fmt: skip

        caches, scales = _cache_args(n, bs, kv, d, cdt)
        args = [((b, t, h, d), qdt), *caches, ((b, m), jnp.int32), ((b,), jnp.int32), ((b,), jnp.int32), *scales]
        yield (f"paged prefill {jnp.dtype(cdt).name} cache, {jnp.dtype(qdt).name} q, B{b} T{t} H{h} KV{kv} D{d} "
               f"page {bs} x{m} q{blocks.block_q} k{blocks.block_k}", jax.jit(paged), args)  # fmt: skip


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

        caches, scales = _cache_args(n, bs, kv, d, cdt)
        args = [((b, h, d), qdt), *caches, ((b, m), jnp.int32), ((b,), jnp.int32), *scales]
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


# Llama-3-8B's layer and vocabulary shapes, two layers (compile time, not fidelity, grows with depth).
MODEL = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)


def abstract_params(cfg: LlamaConfig, weights: str | None, dtype: Any = jnp.bfloat16) -> Any:
    """Abstract parameters in the runner's layout (projections ``[out, in]``), 1-byte codes with ``weights``."""
    def build() -> Any:
        shapes = llama.param_shapes(cfg)
        top = {k: jnp.zeros(shapes[k], dtype) for k in ("embed", "norm", "lm_head")}
        layer = [k for k in shapes if k not in top]
        params = llama.serving_params({**top, "layers": [{k: jnp.zeros(shapes[k], dtype) for k in layer}
                                                         for _ in range(cfg.num_hidden_layers)]})  # fmt: skip
        return params if weights is None else llama.map_projections(params, partial(quantize_weight_t, kind=weights))

    return jax.eval_shape(build)


def abstract_cache(cfg: LlamaConfig, blocks: int, block_size: int, dtype: Any, kv_quant: str | None) -> Any:
    return jax.eval_shape(lambda: init_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks,
                                                block_size, dtype, kv_quant))


def accelerator_kernels(platform: str, dtype: Any = jnp.bfloat16, kv_quant: str | None = None) -> KernelSet:
    """The kernel set a worker on ``platform`` ("gpu", "tpu") runs, built here to lower for it (nothing timed)."""
    return build_kernels("auto", platform=platform, dtype=dtype, kv_quant=kv_quant, tuner=Autotuner(enabled=False))


def model_cases() -> Iterator[Case]:
    cfg, b, blocks, bs, width = MODEL, 32, 2048, 16, 64  # 32 sequences of up to 1024 tokens
    for kv_quant, weights in ((None, None), ("int8", None), (None, "int8")):
        attn = accelerator_kernels("tpu", kv_quant=kv_quant)
        params = abstract_params(cfg, weights)
        cache = abstract_cache(cfg, blocks, bs, jnp.bfloat16, kv_quant)
        label = f"KV {kv_quant or 'bf16'}, weights {weights or 'bf16'}"

        def decode(p, c, tokens, positions, slots, tables, lens, attn=attn):
            return llama.decode_forward(p, c, tokens, positions, slots, tables, lens, cfg=cfg, kernels=attn)

        yield (f"model decode step, {cfg.num_hidden_layers} Llama-3-8B layers, batch {b}, {label}", jax.jit(decode),
               [params, cache, ((b,), jnp.int32), ((b,), jnp.int32), ((b,), jnp.int32), ((b, width), jnp.int32),
                ((b,), jnp.int32)])  # fmt: skip
        if kv_quant == "int8":  # one prefill: its compile is ~4x a decode step's
            t = 256

            def prefill(p, c, tokens, positions, slots, tables, offs, lens, last, attn=attn):
                return llama.prefill_forward(p, c, tokens, positions, slots, tables, offs, lens, last, cfg=cfg,
                                             kernels=attn)  # fmt: skip

            yield (f"model prefill step, 4 x {t} tokens, {label}", jax.jit(prefill),
                   [params, cache, ((4, t), jnp.int32), ((4, t), jnp.int32), ((4, t), jnp.int32),
                    ((4, width), jnp.int32), ((4,), jnp.int32), ((4,), jnp.int32), ((4,), jnp.int32)])  # fmt: skip


def _abstract(arg: Any, sharding: SingleDeviceSharding) -> Any:
    if isinstance(arg, tuple) and len(arg) == 2 and all(isinstance(n, int) for n in arg[0]):  # (shape, dtype)
        return jax.ShapeDtypeStruct(arg[0], arg[1], sharding=sharding)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), arg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:2x2", help="a compile-only TPU topology, e.g. v5e:2x2, v6e:2x2")
    ap.add_argument("--kernels-only", action="store_true", help="skip the whole-model steps")
    args = ap.parse_args(argv)
    device = topologies.get_topology_desc(args.topology, platform="tpu").devices[0]
    sharding = SingleDeviceSharding(device)
    print(f"compiling for {device.device_kind} ({args.topology}), jax {jax.__version__}")
    failed = 0
    for name, fn, shapes in [*prefill_cases(), *decode_cases(), *matmul_cases(),
                              *([] if args.kernels_only else model_cases())]:
        t0 = time.perf_counter()
        try:
            fn.lower(*(_abstract(a, sharding) for a in shapes)).compile()
        except Exception:  # report every case, then fail
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc(limit=3)}", flush=True)
            continue
        print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
