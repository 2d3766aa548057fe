"""``quicserve worker``: load a model, serve the transport, drain on SIGTERM.

Stdout carries JSON lines for the supervisor (nothing else is printed there):
``{"event":"progress","stage":"load|compile","done":i,"total":n,"message":...}``
while loading and compiling, then exactly one
``{"event":"ready","url":...,"models":[...]}`` once the transport is bound.
Logs go to stderr. ``--engine synthetic`` runs the scheduler over the
:class:`~inference.synthetic.SyntheticRunner` test/benchmark double and never
imports JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .batch_window import AdaptiveWindow, bucket_calls, parse_batch_window
from .engine import Engine, EngineConfig
from .service import WorkerService
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["main", "parse_args", "parse_cpus", "numa_cpus", "build_service"]

# 2: each batch size adds prefill buckets to compile at start-up (tiny model, --max-batch 8: 51
# shapes against 28 at 1, first answer ~24 s after start; 4 would add 21 more), and at saturation ~1 prompt
# joins per step, so pairs are what a short wait gathers (calls of 4 shorten a saturated step by
# 1.12x at best, pairs by 1.08x: tests/bench/bench_batch_window.py; on the decode bench's
# batch-32 run, with the native matmul: prefill 0.95-0.96 s at 2, 1.01 at 4, 1.09 at 8).
DEFAULT_MAX_PREFILL_BATCH = 2
log = logging.getLogger("inference.worker")
DRAIN_TIMEOUT = 30.0


def parse_cpus(spec: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad CPU list {spec!r} (e.g. 0-3,6)") from None
    return cpus


def numa_cpus(node: int, sysfs: Path = Path("/sys/devices/system/node")) -> set[int]:
    """CPUs of a NUMA node, from sysfs."""
    try:
        return parse_cpus((sysfs / f"node{node}" / "cpulist").read_text().strip())
    except (OSError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"NUMA node {node}: {exc}") from None


def _window(spec: str) -> str:
    try:
        parse_batch_window(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def _via_serve(flag: str) -> str:
    return f"Local workers of `quicserve serve` take it through [workers] extra_args = [\"{flag}\", \"int8\"] in the config"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quicserve worker", description="Run an inference worker.")
    p.add_argument("--listen", default="tcp://127.0.0.1:0", help="tcp://host:port, unix:///path or rdma://")
    p.add_argument("--engine", choices=("jax", "synthetic"), default="jax")
    p.add_argument("--model", default="tiny", help="'tiny' or a local HF checkpoint directory")
    p.add_argument("--served-name", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-prefill-batch", type=int, default=DEFAULT_MAX_PREFILL_BATCH,
                   help="prompts one prefill call may carry (the batch window gathers up to this many)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batch-window", type=_window, default="adaptive", help="adaptive | fixed:<ms>")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--attention", choices=("reference", "pallas"), default="reference")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="KV cache storage: 'auto' = the model dtype; 'int8' or 'fp8' (e4m3) store codes with "
                        "a float32 scale per block and KV head, quantized when written and dequantized in "
                        "attention (1/4 of a float32 cache's bytes, 1/2 of bfloat16's). On CPU prefer int8: "
                        "XLA:CPU has no float8 scatter, so each fp8 write copies the cache. " + _via_serve("--kv-cache-dtype"))
    p.add_argument("--weight-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="projection weights: 'auto' = the model dtype; 'int8' or 'fp8' (e4m3) store every "
                        "projection (attention, MLP, head) as 1-byte codes with a float32 scale per output "
                        "channel, dequantized inside the matmul (the embedding table stays float). On CPU "
                        "prefer int8: XLA:CPU converts fp8 in software, several times slower than float. "
                        + _via_serve("--weight-dtype"))
    p.add_argument("--weight-quant-method", choices=("rtn", "gptq"), default="rtn",
                   help="how --weight-dtype picks the codes: 'rtn' rounds each weight to nearest; 'gptq' "
                        "calibrates on the model's own activations (random tokens, fixed seed) and feeds each "
                        "column's rounding error into the columns not yet quantized (same storage, slower start)")
    p.add_argument("--stats-interval", type=float, default=0.5)
    p.add_argument("--synthetic-step-ms", type=float, default=0.0)
    p.add_argument("--cpus", type=parse_cpus, default=None, help="pin to these CPUs, e.g. 0-3")
    p.add_argument("--numa-node", type=int, default=None, help="pin to this NUMA node's CPUs")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--identity", default="")
    args = p.parse_args(argv)
    for name in ("block_size", "max_batch", "max_prefill_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_blocks is not None and args.num_blocks < 1:
        p.error("--num-blocks must be >= 1")
    if args.stats_interval <= 0 or args.synthetic_step_ms < 0:
        p.error("--stats-interval must be > 0 and --synthetic-step-ms >= 0")
    if args.engine == "synthetic" and args.model != "tiny":
        p.error("--engine synthetic only serves the byte-level 'tiny' tokenizer")
    # A window can only save prefill calls if one call carries several prompts:
    # the engine's full batch, the window's cost model and the runner's
    # prefill buckets all use the same size.
    args.max_prefill_batch = min(args.max_prefill_batch, args.max_batch)
    args.batch_window = parse_batch_window(args.batch_window, prefill_group=args.max_prefill_batch)
    return args


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _progress(stage: str, done: int, total: int, message: str) -> None:
    emit({"event": "progress", "stage": stage, "done": done, "total": total, "message": message})


def build_service(args: argparse.Namespace) -> WorkerService:
    """Load the runner and tokenizer and wire them to an engine."""
    tokenizer: Tokenizer
    if args.engine == "synthetic":
        from .synthetic import SyntheticRunner

        runner: Any = SyntheticRunner(block_size=args.block_size, num_blocks=args.num_blocks or 2048,
                                      max_model_len=args.max_model_len or 4096,
                                      step_s=args.synthetic_step_ms / 1e3, verify=False)  # fmt: skip
        tokenizer = ByteTokenizer()
        served = args.served_name or args.model
        _progress("load", 1, 1, "synthetic engine (no model)")
    else:
        from .model.runner import JaxRunner  # JAX only on this path

        tokenizer = load_tokenizer(args.model)
        runner = JaxRunner.load(args.model, dtype=args.dtype, block_size=args.block_size,
                                num_blocks=args.num_blocks or 512, max_batch=args.max_batch,
                                max_model_len=args.max_model_len, attention=args.attention,
                                max_prefill_batch=args.max_prefill_batch, kv_cache_dtype=args.kv_cache_dtype,
                                weight_dtype=args.weight_dtype, weight_quant_method=args.weight_quant_method,
                                progress=_progress)  # fmt: skip
        log.info("KV cache %s: %.1f bytes per token (%.1f in the model dtype), %d blocks of %d tokens",
                 args.kv_cache_dtype, runner.kv_bytes_per_token, runner.float_kv_bytes_per_token,
                 runner.num_blocks, runner.block_size)
        log.info("weights %s (%s): %d bytes (%d in the model dtype)", args.weight_dtype,
                 args.weight_quant_method, runner.weight_bytes, runner.float_weight_bytes)
        runner.warmup(progress=_progress)
        if isinstance(args.batch_window, AdaptiveWindow):  # its step-cost model sees the runner's real shapes
            args.batch_window.calls = bucket_calls(runner.buckets)
        served = args.served_name or (args.model if args.model == "tiny" else Path(args.model).name)
    cfg = EngineConfig(max_batch=args.max_batch, max_prefill_tokens=2048, prefill_batch=args.max_prefill_batch,
                       enable_prefix_cache=not args.no_prefix_cache)  # fmt: skip
    engine = Engine(runner, tokenizer, cfg, window=args.batch_window)
    # A step runs in a one-thread executor so the loop keeps serving frames during it; a synthetic step
    # with no sleep takes microseconds, and the hand-off to a thread would cost more than the step.
    threaded = args.engine != "synthetic" or args.synthetic_step_ms > 0
    return WorkerService(engine, tokenizer, served_name=served, identity=args.identity,
                         stats_interval=args.stats_interval, threaded=threaded)  # fmt: skip


async def _serve(args: argparse.Namespace, service: WorkerService) -> int:
    from transport.server import serve

    server = await serve(args.listen, service, identity=service.identity)
    service.server = server  # Stats also reach connections that have not submitted yet
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine_task = asyncio.create_task(service.run())
    emit({"event": "ready", "url": server.address, "models": [service.served_name]})
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({engine_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if engine_task.done():
        exc = engine_task.exception()
        if exc is not None:
            log.error("engine loop failed: %r", exc)
            rc = 1
    else:
        log.info("draining: %d waiting, %d running", service.engine.num_waiting, service.engine.num_running)
        service.drain()
        goodbye = asyncio.create_task(server.drain(DRAIN_TIMEOUT))  # Goodbye to every gateway
        try:
            await asyncio.wait_for(asyncio.shield(engine_task), DRAIN_TIMEOUT)
        except TimeoutError:
            service.abort()
            await engine_task
        await asyncio.sleep(0.05)  # let the last frames flush
        goodbye.cancel()
    stopper.cancel()
    await server.close()
    return rc


def main(argv: list[str]) -> int:
    """Entry point of ``quicserve worker``; returns the exit status."""
    logging.basicConfig(level=os.environ.get("QUICSERVE_LOG", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    args = parse_args(argv)
    if args.numa_node is not None:
        try:
            node_cpus = numa_cpus(args.numa_node)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        args.cpus = (args.cpus & node_cpus) if args.cpus else node_cpus
    if args.cpus:
        try:
            os.sched_setaffinity(0, args.cpus)
            log.info("pinned to CPUs %s", sorted(args.cpus))
        except (OSError, AttributeError) as exc:
            log.error("cannot pin to CPUs %s: %s", sorted(args.cpus), exc)
            return 2
    try:
        service = build_service(args)
    except (ValueError, OSError) as exc:
        log.error("cannot load %r: %s", args.model, exc)
        return 2
    import uvloop

    return uvloop.run(_serve(args, service))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
