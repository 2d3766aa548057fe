"""GPU kernel benchmark: Pallas flash prefill and paged decode against XLA, in one run.

Run: ``.venv/bin/python tests/bench/gpu_kernels.py`` (about 2-5 minutes on one
H200, autotuning included; the tuner's cache makes later runs faster).

Prints, per shape:
  prefill: TFLOP/s of the Pallas kernel and of XLA's attention
           (``jax.nn.dot_product_attention(implementation="xla")``, causal,
           GQA), the ratio, and the fraction of the chip's bf16 dense peak
           (``--peak-tflops``, H200 ~790 measured);
  paged prefill: a prefix-cache hit (512 new tokens after 3584 cached, tables
           of 512 pages: max_model_len 8192) through the paged kernel against
           gathering each row's table and running the dense kernel (no target);
  weights: int8/fp8 weight-only matmul at decode sizes (Pallas kernel and XLA
           convert+dot) against the bf16 matmul, as weight bytes per second;
  decode:  achieved bandwidth (bytes of K/V pages + scales + q/out per step
           divided by time) of the Pallas kernel and of the XLA paged reference
           (gather + einsum), against ``--peak-tbs`` (H200 ~4.3 TB/s), for
           bf16, int8 and fp8 caches.
  chunked prefill: a small Llama through the runner with the platform's kernel set: a prompt in
           chunks that start mid-sequence, each in one mixed pass with other sequences' decodes,
           against the whole prompt and the decodes alone (logits checked), and the times of a
           decode step, a chunk alone and the mixed pass (no target);
  sharded step: the same model's decode and prefill under ``shard_map`` over every local device
           (tensor parallelism: heads and MLP columns split, one psum per projection pair),
           checked against the unsharded steps, and timed (no target).
Targets (printed as MET / MISSED): prefill >= 60% of peak, decode >= 70% of
bandwidth, both faster than XLA. Every kernel is first checked against XLA
on the benchmark's own inputs; a mismatch exits 1.

On a machine without a GPU it prints a note and exits 0. ``--smoke`` runs the
same code path on tiny shapes with the kernels interpreted (CPU), to check the
script itself; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from inference.kernels import reference  # noqa: E402
from inference.kernels.autotune import Autotuner, time_call  # noqa: E402
from inference.kernels.flash_prefill import flash_prefill, paged_flash_prefill  # noqa: E402
from inference.kernels.kernel_set import current_platform  # noqa: E402
from inference.kernels.paged_decode import paged_decode  # noqa: E402
from inference.kernels.pallas import (  # noqa: E402
    tuned_decode_blocks,
    tuned_matmul_blocks,
    tuned_prefill_blocks,
)
from inference.kernels.quant import QMAX, code_dtype, kv_read_bytes, quantize_weight, quantized_matmul  # noqa: E402
from inference.kernels.quant_matmul import MatmulBlocks, pallas_quantized_matmul  # noqa: E402
from tests.bench import gpu_model_steps  # noqa: E402

__all__ = ["main"]

BUDGET_S = 7 * 60  # stop starting new measurements past this (the run must stay under 8 min)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.interpret = args.smoke
        self.iters = 2 if args.smoke else args.iters
        self.tuner = Autotuner(enabled=False) if args.smoke else Autotuner(
            Path(args.tune_cache) if args.tune_cache else None, enabled=True
        )
        self.start = time.monotonic()
        self.results: list[tuple[str, bool]] = []
        self.failures: list[str] = []

    def out_of_time(self) -> bool:
        if time.monotonic() - self.start > BUDGET_S:
            print("  (time budget reached: skipping the remaining shapes)")
            return True
        return False

    def target(self, name: str, ok: bool) -> str:
        self.results.append((name, ok))
        return "MET" if ok else "MISSED"

    def check(self, what: str, got, want, bound: float) -> None:
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        status = "ok" if rel < bound and np.isfinite(got).all() else "MISMATCH"
        print(f"  check {what}: relative L2 error vs XLA {rel:.2e} (bound {bound:.0e}) {status}")
        if status != "ok":
            self.failures.append(what)

    def prefill(self, b: int, t: int, h: int, kv: int, d: int, dtype) -> None:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype)
                   for s in ((b, t, h, d), (b, t, kv, d), (b, t, kv, d)))
        offs, lens = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
        scale = d**-0.5
        blocks = tuned_prefill_blocks(self.tuner, q, k, interpret=self.interpret)
        ours = jax.jit(functools.partial(flash_prefill, scale=scale, blocks=blocks, interpret=self.interpret))
        xla = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=True,
                                        implementation="xla"))
        name = f"prefill B{b} T{t} H{h}/KV{kv} D{d} {jnp.dtype(dtype).name}"
        print(f"\n{name} (causal, blocks {blocks})")
        self.check("prefill", ours(q, k, v, offs, lens), xla(q, k, v), 2e-2)
        t_ours = time_call(lambda: ours(q, k, v, offs, lens), iters=self.iters)
        t_xla = time_call(lambda: xla(q, k, v), iters=self.iters)
        flops = 4.0 * b * h * d * t * (t + 1) / 2  # QK^T and PV over the causal triangle
        tf_ours, tf_xla = flops / t_ours / 1e12, flops / t_xla / 1e12
        peak = self.args.peak_tflops
        print(f"  pallas {t_ours * 1e3:8.3f} ms  {tf_ours:7.1f} TFLOP/s  {tf_ours / peak:6.1%} of {peak:.0f} peak"
              f"  [target >=60%: {self.target(name + ' peak', tf_ours / peak >= 0.6)}]")
        print(f"  xla    {t_xla * 1e3:8.3f} ms  {tf_xla:7.1f} TFLOP/s  {tf_xla / peak:6.1%} of peak")
        print(f"  pallas / xla speed-up {t_xla / t_ours:5.2f}x  "
              f"[target >1: {self.target(name + ' vs xla', t_ours < t_xla)}]")
        if not self.interpret:
            self.mosaic_reference(q, k, v, flops)

    def paged_prefill(self, b: int, t: int, ctx: int, width: int, h: int, kv: int, d: int, bs: int, dtype) -> None:
        """A prefix-cache hit: ``t`` new tokens after ``ctx - t`` cached ones, tables ``width`` pages wide
        (max_model_len = width * bs). The model used to gather each row's whole table, then run the dense
        kernel; the paged kernel reads pages through the table. No target: how much the copy cost."""
        rng = np.random.default_rng(2)
        n = b * width
        q = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32)).astype(dtype)
        kc, vc = (jnp.asarray(rng.standard_normal((n, bs, kv, d), np.float32)).astype(dtype) for _ in "kv")
        tables = jnp.asarray(rng.permutation(n).reshape(b, width).astype(np.int32))
        offs, lens = jnp.full((b,), ctx - t, jnp.int32), jnp.full((b,), ctx, jnp.int32)
        scale = d**-0.5
        dense_k = jax.ShapeDtypeStruct((b, width * bs, kv, d), dtype)
        blocks = tuned_prefill_blocks(self.tuner, q, dense_k, interpret=self.interpret)
        gathered = jax.jit(lambda q, kc, vc, tables, offs, lens: flash_prefill(
            q, reference.gather_pages(kc, tables), reference.gather_pages(vc, tables), offs, lens, scale=scale,
            blocks=blocks, interpret=self.interpret))  # fmt: skip
        paged = jax.jit(functools.partial(paged_flash_prefill, scale=scale, blocks=blocks, interpret=self.interpret))
        args = (q, kc, vc, tables, offs, lens)
        print(f"\npaged prefill B{b} T{t} after {ctx - t} cached, tables of {width} x {bs} H{h}/KV{kv} D{d} "
              f"{jnp.dtype(dtype).name} (blocks {blocks})")
        self.check("paged prefill vs gather + dense", paged(*args), gathered(*args), 2e-2)
        t_paged = time_call(lambda: paged(*args), iters=self.iters)
        t_gathered = time_call(lambda: gathered(*args), iters=self.iters)
        print(f"  gather + dense {t_gathered * 1e3:8.3f} ms   paged {t_paged * 1e3:8.3f} ms   "
              f"speed-up {t_gathered / t_paged:5.2f}x")

    def mosaic_reference(self, q, k, v, flops: float) -> None:
        """For context only: JAX's own Hopper (Mosaic GPU, FA3-style) kernel; uniform lengths, no paging."""
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

            config = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
            fn = jax.jit(functools.partial(mgpu.attention, config=config))
            seconds = time_call(lambda: fn(q, k, v), iters=self.iters)
        except Exception as exc:  # not every toolchain/shape supports it; it is not ours
            print(f"  (jax mosaic-gpu reference kernel unavailable: {str(exc).splitlines()[0][:120]})")
            return
        tflops = flops / seconds / 1e12
        print(f"  (jax mosaic-gpu reference kernel, for context: {seconds * 1e3:.3f} ms, {tflops:.1f} TFLOP/s, "
              f"{tflops / self.args.peak_tflops:.1%} of peak)")

    def decode(self, b: int, h: int, kv: int, d: int, ctx: int, bs: int, kind: str, dtype) -> None:
        rng = np.random.default_rng(1)
        m = ctx // bs
        n = b * m
        q = jnp.asarray(rng.standard_normal((b, h, d), np.float32)).astype(dtype)
        tables = jnp.asarray(rng.permutation(n).reshape(b, m).astype(np.int32))
        lens = jnp.full((b,), ctx, jnp.int32)
        if kind == "float":
            kc, vc = (jnp.asarray(rng.standard_normal((n, bs, kv, d), np.float32)).astype(dtype) for _ in "kv")
            ks = vs = None
        else:
            qmax = QMAX[kind]
            kc, vc = (jnp.asarray(rng.uniform(-qmax, qmax, (n, bs, kv, d)).astype(np.float32))
                      .astype(code_dtype(kind)) for _ in "kv")
            ks = vs = jnp.full((n, kv), 1.0 / qmax, jnp.float32)
        scale = d**-0.5
        blocks = tuned_decode_blocks(self.tuner, q, kc, tables, quantized=ks is not None, interpret=self.interpret)
        ours = jax.jit(functools.partial(paged_decode, scale=scale, k_scale=ks, v_scale=vs, blocks=blocks,
                                         interpret=self.interpret))
        xla = jax.jit(functools.partial(reference.paged_decode_attention, scale=scale, k_scale=ks, v_scale=vs))
        label = jnp.dtype(dtype).name if kind == "float" else kind
        name = f"decode B{b} H{h}/KV{kv} D{d} ctx{ctx} page{bs} {label}"
        print(f"\n{name} (blocks {blocks})")
        self.check("decode " + label, ours(q, kc, vc, tables, lens), xla(q, kc, vc, tables, lens), 2e-2)
        t_ours = time_call(lambda: ours(q, kc, vc, tables, lens), iters=self.iters)
        t_xla = time_call(lambda: xla(q, kc, vc, tables, lens), iters=self.iters)
        nbytes = kv_read_bytes(np.asarray(lens), block_size=bs, kv_heads=kv, head_dim=d, dtype=kc.dtype,
                               quantized=ks is not None) + 2 * q.size * q.dtype.itemsize
        bw_ours, bw_xla = nbytes / t_ours / 1e12, nbytes / t_xla / 1e12
        peak = self.args.peak_tbs
        print(f"  KV bytes per step {nbytes / 1e6:.1f} MB")
        print(f"  pallas {t_ours * 1e3:8.3f} ms  {bw_ours:6.2f} TB/s  {bw_ours / peak:6.1%} of {peak} TB/s"
              f"  [target >=70%: {self.target(name + ' bandwidth', bw_ours / peak >= 0.7)}]")
        print(f"  xla    {t_xla * 1e3:8.3f} ms  {bw_xla:6.2f} TB/s  {bw_xla / peak:6.1%} of peak")
        print(f"  pallas / xla speed-up {t_xla / t_ours:5.2f}x  "
              f"[target >1: {self.target(name + ' vs xla', t_ours < t_xla)}]")

    def weight_matmul(self, m: int, k: int, n: int, dtype) -> None:
        """Weight-only int8/fp8 matmul (decode-sized M): weight bytes per second, no target."""
        rng = np.random.default_rng(2)
        x = jnp.asarray(rng.standard_normal((m, k), np.float32)).astype(dtype)
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * k**-0.5).astype(dtype)
        dense = jax.jit(lambda a, b: a @ b)
        t_dense = time_call(lambda: dense(x, w), iters=self.iters)
        print(f"\nweight matmul M{m} K{k} N{n}: XLA {jnp.dtype(dtype).name} {t_dense * 1e3:.3f} ms "
              f"({k * n * w.dtype.itemsize / t_dense / 1e12:.2f} TB/s of weights)")
        for kind in ("int8", "fp8"):
            qw = quantize_weight(w, kind)
            blocks = MatmulBlocks() if self.interpret else tuned_matmul_blocks(self.tuner, x, qw.codes)
            pallas = jax.jit(functools.partial(pallas_quantized_matmul, blocks=blocks, interpret=self.interpret))
            fused = jax.jit(quantized_matmul)
            self.check(f"{kind} weight matmul", pallas(x, qw.codes, qw.scale), fused(x, qw), 2e-2)
            t_p = time_call(lambda p=pallas, q=qw: p(x, q.codes, q.scale), iters=self.iters)
            t_f = time_call(lambda f=fused, q=qw: f(x, q), iters=self.iters)
            wb = k * n * qw.codes.dtype.itemsize
            print(f"  {kind}: pallas {t_p * 1e3:.3f} ms ({wb / t_p / 1e12:.2f} TB/s), "
                  f"XLA convert+dot {t_f * 1e3:.3f} ms ({wb / t_f / 1e12:.2f} TB/s); "
                  f"vs {jnp.dtype(dtype).name} dense: {t_dense / t_p:.2f}x / {t_dense / t_f:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (CPU check)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense peak (H200 ~790)")
    parser.add_argument("--peak-tbs", type=float, default=4.3, help="HBM bandwidth in TB/s (H200 ~4.3)")
    parser.add_argument("--tune-cache", default=None, help="autotune cache file (default: the tuner's)")
    args = parser.parse_args(argv)
    kernel_log = logging.getLogger("inference.kernels")  # the autotuner's choices and timings
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [%(name)s] %(message)s"))
    old_level = kernel_log.level
    kernel_log.addHandler(handler)
    kernel_log.setLevel(logging.INFO)
    try:
        return _run(args)
    finally:
        kernel_log.removeHandler(handler)
        kernel_log.setLevel(old_level)


def _run(args: argparse.Namespace) -> int:

    platform = current_platform()
    if platform != "gpu" and not args.smoke:
        print(f"gpu_kernels: no GPU here (JAX backend {platform!r}); nothing to measure. "
              "Run on a CUDA machine, or pass --smoke to check the script on CPU.")
        return 0
    dev = jax.devices()[0]
    print(f"device: {getattr(dev, 'device_kind', dev.platform)}  jax {jax.__version__}  "
          f"{'SMOKE (interpreted, figures meaningless)' if args.smoke else 'compiled (Triton lowering)'}")
    bench = Bench(args)
    if args.smoke:
        prefill_shapes = [(1, 64, 4, 2, 64)]
        paged_prefill_shapes = [(2, 16, 40, 8, 4, 2, 64, 8)]
        decode_shapes = [(2, 8, 2, 64, 64, 16)]
        matmul_shapes = [(4, 64, 48)]
        dtype = jnp.float32
    else:
        prefill_shapes = [(4, 4096, 32, 8, 128), (1, 8192, 32, 8, 128), (8, 2048, 32, 8, 64)]
        paged_prefill_shapes = [(4, 512, 4096, 512, 32, 8, 128, 16)]  # max_model_len 8192
        decode_shapes = [(64, 32, 8, 128, 4096, 16), (8, 32, 8, 128, 8192, 16)]
        matmul_shapes = [(16, 4096, 14336), (64, 4096, 14336)]
        dtype = jnp.bfloat16
    for shape in prefill_shapes:
        if bench.out_of_time():
            break
        bench.prefill(*shape, dtype)
    for shape in paged_prefill_shapes:
        if bench.out_of_time():
            break
        bench.paged_prefill(*shape, dtype)
    for shape in decode_shapes:
        for kind in ("float", "int8", "fp8"):
            if bench.out_of_time():
                break
            bench.decode(*shape, kind, dtype)
    for shape in matmul_shapes:
        if bench.out_of_time():
            break
        bench.weight_matmul(*shape, dtype)
    for step in (gpu_model_steps.chunked_prefill, gpu_model_steps.sharded_step):
        if bench.out_of_time():
            break
        step(bench, dtype)

    met = sum(ok for _, ok in bench.results)
    print(f"\nsummary: {met}/{len(bench.results)} targets met in {time.monotonic() - bench.start:.0f} s")
    for name, ok in bench.results:
        if not ok:
            print(f"  missed: {name}")
    if bench.failures:
        print(f"correctness MISMATCH: {', '.join(bench.failures)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
