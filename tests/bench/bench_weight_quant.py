"""Decode throughput with weight-only quantized projections: float vs int8 vs fp8 weights.

The bench_decode model (``tests/bench/bench_decode.py: model_config``, 8
layers, hidden 512, vocab 8192, ~30M parameters, float32) is loaded three
times: ``JaxRunner(weight_dtype="auto" | "int8" | "fp8")``. For each batch
size, every sequence is prefilled with a 64-token prompt (untimed), then
``--steps`` greedy decode steps are timed through ``execute`` (the serving
path: bucketed decode call plus on-device sampling). The three runners take
turns, ``--repeats`` times, and the best time of each counts (the machine is
shared; the minimum is the least noisy estimate). Ratios are speedups against the
float runner of the same row, by wall time and by process CPU time (``cpu``:
time the process is descheduled for other users' work is not counted, the
steadier figure on a busy machine; with two threads it also counts both). Weight bytes are what the params pytree holds
(codes + per-channel float32 scales; the float32 embedding lookup table stays,
and a quantized head is stored beside it).

What to expect on CPU: batch 1 reads every weight once per token, so it is
bandwidth-bound and 1-byte codes should help there; at 8-32 rows the fused
multiply-reduce is compute-bound and the convert is extra work per element.
XLA:CPU converts float8 e4m3fn in software, so fp8 is expected to be slower
than float on CPU (it is meant for accelerators with fp8 units).

Measured (2 shared cores, load average 6-8 throughout, so read the ranges;
``--repeats 3``): weights 120.5 MiB float32 -> 42.3 MiB int8 or fp8 (0.35x;
the float embedding table is 16 MiB of it). int8/float speedup by wall time
over three runs: batch 1 1.05x / 0.65x / 1.30x, batch 8 0.99x / 1.60x /
1.27x, batch 32 1.06x / 1.25x / 0.79x; by CPU time (last run) 0.91x / 1.22x
/ 1.10x. So int8 is about even with float at batch 1 and somewhat ahead at
8-32 here, within this machine's noise; the batch-1 bandwidth win did not
show (the multiply-reduce over converted codes costs more instructions per
weight than the float dot's matrix-vector product). fp8: 0.11-0.55x of float
at every batch size: XLA:CPU does not fuse the float8 convert, so each step
first converts every weight to a float32 copy (``test_weight_quant.py``).

    .venv/bin/python -m tests.bench.bench_weight_quant [--batches 1,8,32] [--steps 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from inference.model.jax_runner import JaxRunner
from inference.runner import SeqWork, StepPlan
from inference.weights import write_hf_checkpoint
from tests.bench.bench_decode import BLOCK, GREEDY, _load, model_config

KINDS = ("auto", "int8", "fp8")
PROMPT = 64


def _tables(batch: int, steps: int) -> list[list[int]]:
    per = -(-(PROMPT + steps + 1) // BLOCK)
    return [list(range(i * per, (i + 1) * per)) for i in range(batch)]


def decode_seconds(runner: JaxRunner, batch: int, steps: int) -> tuple[float, float]:
    """Prefill ``batch`` prompts, then time ``steps`` decode steps of the whole batch: (wall, process CPU) s."""
    rng = np.random.default_rng(batch)
    tables = _tables(batch, steps)
    prompts = [rng.integers(3, 8192, PROMPT).tolist() for _ in range(batch)]
    outs = runner.execute(StepPlan(prefills=tuple(SeqWork(i, p, 0, tables[i], GREEDY, 0, 0)
                                                  for i, p in enumerate(prompts)), decodes=()))
    last = [o.token_id for o in outs]
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        outs = runner.execute(StepPlan(prefills=(), decodes=tuple(
            SeqWork(i, [last[i]], PROMPT + step, tables[i], GREEDY, 0, step + 1) for i in range(batch))))
        last = [o.token_id for o in outs]
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * -(-(PROMPT + args.steps + 1) // BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_checkpoint(tmp, model_config(args.layers), seed=0)
        runners = {k: JaxRunner.load(tmp, block_size=BLOCK, num_blocks=blocks, max_batch=max(batches),
                                     max_model_len=PROMPT + args.steps + 1, weight_dtype=k, attention="auto")
                   for k in KINDS}
    print(f"model: bench_decode model_config({args.layers}), float32; load average at start: {_load()} "
          f"(machine has {os.cpu_count()} cores)")
    base = runners["auto"].weight_bytes
    for k, r in runners.items():
        print(f"  weights {k:>4}: {r.weight_bytes / 2**20:7.1f} MiB ({r.weight_bytes / base:.2f}x of float)")
    print(f"{'batch':>5} " + " ".join(f"{k + ' tok/s':>11}" for k in KINDS)
          + f" {'int8/float':>10} {'fp8/float':>9} {'cpu int8':>10} {'cpu fp8':>9}  load1")
    for batch in batches:
        for r in runners.values():
            decode_seconds(r, batch, 2)  # compile this batch's shapes
        wall, cpu = dict.fromkeys(KINDS, float("inf")), dict.fromkeys(KINDS, float("inf"))
        for _ in range(args.repeats):
            for k, r in runners.items():
                w, c = decode_seconds(r, batch, args.steps)
                wall[k], cpu[k] = min(wall[k], w), min(cpu[k], c)
        tps = {k: batch * args.steps / wall[k] for k in KINDS}
        print(f"{batch:>5} " + " ".join(f"{tps[k]:>11.1f}" for k in KINDS)
              + f" {wall['auto'] / wall['int8']:>9.2f}x {wall['auto'] / wall['fp8']:>8.2f}x"
              + f" {cpu['auto'] / cpu['int8']:>9.2f}x {cpu['auto'] / cpu['fp8']:>8.2f}x  {os.getloadavg()[0]:.2f}",
              flush=True)
    print(f"load average at end: {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
