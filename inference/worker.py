"""``quicserve worker``: load a model, serve the transport, drain on SIGTERM.

Stdout carries JSON lines for the supervisor (nothing else is printed there):
``{"event":"progress","stage":"load|compile","done":i,"total":n,"message":...}``
while loading and compiling, then exactly one
``{"event":"ready","url":...,"models":[...],"startup":{"load":s,"compile":s,"warmup":s}}`` once the
transport is bound (``startup``: the seconds of each start-up phase, also in its Hello),
or, when the options are bad or cannot run, one ``{"event":"fatal","message":...}``
before exit status 2 (usage) or 78 (``EXIT_CONFIG``): the supervisor reports it
once and does not restart the worker. Logs go to stderr. ``--engine synthetic`` runs the scheduler over the
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
import time
from pathlib import Path
from typing import Any, NoReturn

from transport.common.logfmt import install
from transport.common.worker_options import (
    EXIT_CONFIG,
    JAX_NUM_BLOCKS,
    SYNTHETIC_MAX_MODEL_LEN,
    SYNTHETIC_NUM_BLOCKS,
    add_flags,
    compilation_cache_dir,
    flag_name,
    option_problems,
    options_from,
    parse_cpus,
)

from .batch_window import AdaptiveWindow, bucket_calls, parse_batch_window
from .engine import Engine, EngineConfig
from .service import WorkerService
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from .tracing import WorkerTracer

__all__ = ["main", "parse_args", "parse_cpus", "numa_cpus", "build_service"]

log = logging.getLogger("inference.worker")
DRAIN_TIMEOUT = 30.0
_STARTED = time.perf_counter()  # about when the process started: this module loads first


def numa_cpus(node: int, sysfs: Path = Path("/sys/devices/system/node")) -> set[int]:
    """CPUs of a NUMA node, from sysfs."""
    try:
        return parse_cpus((sysfs / f"node{node}" / "cpulist").read_text().strip())
    except (OSError, ValueError) as exc:
        raise ValueError(f"NUMA node {node}: {exc}") from None


class _Parser(argparse.ArgumentParser):
    """A usage error also goes to the supervisor, as a ``fatal`` event on stdout, before exit status 2."""

    def error(self, message: str) -> NoReturn:
        emit({"event": "fatal", "message": f"{self.prog}: {message}"})
        super().error(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags of :mod:`transport.common.worker_options` (one default each, shared with the gateway's
    ``[workers]`` settings) plus ``--identity``; a bad value exits 2 naming its flag."""
    p = _Parser(prog="quicserve worker", description="Run an inference worker. Local workers of `quicserve "
                "serve` take these options as keys of its [workers] settings (max_batch = 64, ...).")
    add_flags(p)
    p.add_argument("--identity", default="", help="name in Hello and logs ('' = worker@host:pid)")
    args = p.parse_args(argv)
    problems = option_problems(options_from(args))
    if problems:
        p.error("; ".join(f"{flag_name(key)}: {why}" for key, why in problems))
    # A window can only save prefill calls if one call carries several prompts:
    # the engine's full batch, the window's cost model and the runner's
    # prefill buckets all use the same size.
    args.max_prefill_batch = min(args.max_prefill_batch, args.max_batch)
    args.batch_window = parse_batch_window(args.batch_window, prefill_group=args.max_prefill_batch)
    args.cpus = parse_cpus(args.cpus) if args.cpus else None
    return args


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _progress(stage: str, done: int, total: int, message: str) -> None:
    emit({"event": "progress", "stage": stage, "done": done, "total": total, "message": message})


def _jax_runner(args: argparse.Namespace) -> Any:
    """The model's runner as the options say, loaded and compiled (every process of a distributed one)."""
    from .model import compile_cache
    from .model.jax_runner import JaxRunner  # JAX only on this path

    cache = compilation_cache_dir(args.compilation_cache, _served_name(args))
    if cache is not None:  # before the first compilation (loading the tiny model's weights compiles)
        try:
            compile_cache.enable(cache)
            log.info("compilation cache in %s", cache)
        except OSError as exc:  # e.g. a read-only home: a slower start, not a failed one
            log.warning("no compilation cache (%s): every start compiles", exc)

    runner = JaxRunner.load(args.model, dtype=args.dtype, block_size=args.block_size,
                            num_blocks=args.num_blocks or JAX_NUM_BLOCKS, max_batch=args.max_batch,
                            max_model_len=args.max_model_len or None, attention=args.attention,
                            max_prefill_batch=args.max_prefill_batch,
                            max_prefill_tokens=args.max_prefill_tokens, kv_cache_dtype=args.kv_cache_dtype,
                            weight_dtype=args.weight_dtype, weight_quant_method=args.weight_quant_method,
                            step_tokens=args.step_tokens, tensor_parallel=args.tensor_parallel,
                            progress=_progress)  # fmt: skip
    log.info("KV cache %s: %.1f bytes per token (%.1f in the model dtype), %d blocks of %d tokens",
             args.kv_cache_dtype, runner.kv_bytes_per_token, runner.float_kv_bytes_per_token,
             runner.num_blocks, runner.block_size)
    log.info("weights %s (%s): %d bytes (%d in the model dtype)", args.weight_dtype,
             args.weight_quant_method, runner.weight_bytes, runner.float_weight_bytes)
    args.loaded_at = time.perf_counter()
    runner.warmup(progress=_progress)
    args.compiled_at = time.perf_counter()
    return runner


def _served_name(args: argparse.Namespace) -> str:
    return str(args.served_name or (args.model if args.model == "tiny" else Path(args.model).name))


def startup_phases(args: argparse.Namespace, now: float) -> tuple[float, float, float]:
    """Seconds of (load, compile, warm-up) from the process's start to ``now``: loading covers the
    imports, the weights and the KV cache; compiling, the shapes (0 for the synthetic engine, which
    has none); warming up, the rest until it serves (the engine, the transport bound)."""
    loaded = getattr(args, "loaded_at", now)
    compiled = getattr(args, "compiled_at", loaded)
    return loaded - _STARTED, compiled - loaded, now - compiled


def build_service(args: argparse.Namespace) -> WorkerService:
    """Load the runner and tokenizer and wire them to an engine."""
    tokenizer: Tokenizer
    if args.engine == "synthetic":
        from .synthetic import SyntheticCost, SyntheticFaults, SyntheticRunner

        runner: Any = SyntheticRunner(block_size=args.block_size, num_blocks=args.num_blocks or SYNTHETIC_NUM_BLOCKS,
                                      max_model_len=args.max_model_len or SYNTHETIC_MAX_MODEL_LEN,
                                      cost=SyntheticCost.from_options(args), faults=SyntheticFaults.from_options(args),
                                      verify=False)  # fmt: skip
        tokenizer = ByteTokenizer()
        served = args.served_name or args.model
        if args.synthetic_startup_ms:  # a model's cold start, imitated (elastic pools' tests)
            time.sleep(args.synthetic_startup_ms / 1e3)
        args.loaded_at = time.perf_counter()
        _progress("load", 1, 1, "synthetic engine (no model)")
    else:
        tokenizer = load_tokenizer(args.model)
        runner = _jax_runner(args)
        if isinstance(args.batch_window, AdaptiveWindow):  # its step-cost model sees the runner's real shapes
            args.batch_window.calls = bucket_calls(runner.buckets)
        served = _served_name(args)
    cfg = EngineConfig(max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                       prefill_batch=args.max_prefill_batch, enable_prefix_cache=args.prefix_cache,
                       stall_timeout=args.stall_timeout, step_tokens=args.step_tokens)  # fmt: skip
    engine = Engine(runner, tokenizer, cfg, window=args.batch_window)
    # A step runs in a one-thread executor so the loop keeps serving frames during it; a synthetic step
    # with no sleep takes microseconds, and the hand-off to a thread would cost more than the step.
    threaded = args.engine != "synthetic" or not runner.cost.free
    tracer = WorkerTracer(args.otlp_endpoint, service_name="quicserve-worker")
    return WorkerService(engine, tokenizer, served_name=served, model_id=args.model, identity=args.identity,
                         stats_interval=args.stats_interval, threaded=threaded, tracer=tracer)  # fmt: skip


async def _serve(args: argparse.Namespace, service: WorkerService) -> int:
    from transport.errors import SecurityConfigError
    from transport.security import security_of
    from transport.server import serve

    service.startup = startup_phases(args, time.perf_counter())  # in its Hello and the ready event
    try:  # TLS files or a key that do not load: a restart would not help (transport/security.py)
        server = await serve(args.listen, service, identity=service.identity, security=security_of(args))
    except SecurityConfigError as exc:
        return _fatal(str(exc))
    service.server = server  # Stats also reach connections that have not submitted yet
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready: dict[str, Any] = {"event": "ready", "url": server.address, "models": [service.served_name],
                             "startup": dict(zip(("load", "compile", "warmup"), service.startup, strict=True))}
    if args.metrics_listen:
        from .metrics_http import serve_metrics

        try:
            ready["metrics_url"] = serve_metrics(args.metrics_listen, lambda: service.last_stats,
                                                 (service.served_name,))
        except OSError as exc:  # the port is taken: a restart would not help
            await server.close()
            return _fatal(f"cannot serve metrics on {args.metrics_listen}: {exc}")
        log.info("metrics on %s", ready["metrics_url"])
    engine_task = asyncio.create_task(service.run())
    emit(ready)
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
    service.tracer.shutdown()  # flush the last spans
    return rc


def _fatal(message: str) -> int:
    """Options that parse but cannot run: log, tell the supervisor (which will not restart us), exit."""
    log.error("%s", message)
    emit({"event": "fatal", "message": message})
    return EXIT_CONFIG


def main(argv: list[str]) -> int:
    """Entry point of ``quicserve worker``; returns the exit status."""
    # The gateway that started us exports its level and format: our lines join its log. Like
    # basicConfig, nothing changes where logging is already set up (main() called in a test).
    if not logging.getLogger().handlers:
        install(os.environ.get("QUICSERVE_LOG", "INFO"), os.environ.get("QUICSERVE_LOG_FORMAT", "text"), sys.stderr)
    args = parse_args(argv)
    if args.numa_node >= 0:
        try:
            node_cpus = numa_cpus(args.numa_node)
        except ValueError as exc:
            return _fatal(str(exc))
        args.cpus = (args.cpus & node_cpus) if args.cpus else node_cpus
    if args.cpus:
        try:
            os.sched_setaffinity(0, args.cpus)
            log.info("pinned to CPUs %s", sorted(args.cpus))
        except (OSError, AttributeError) as exc:
            return _fatal(f"cannot pin to CPUs {sorted(args.cpus)}: {exc}")
    if args.distributed_processes > 1:  # one model over several processes' devices (inference/model/multihost.py)
        from .model import multihost

        multihost.initialize(args.distributed_coordinator, args.distributed_processes, args.distributed_process_id)
        if args.distributed_process_id > 0:  # a follower: no transport, the leader's steps
            try:
                runner = _jax_runner(args)
            except (ValueError, OSError) as exc:
                return _fatal(f"cannot load {args.model!r}: {exc}")
            emit({"event": "following", "process": args.distributed_process_id})
            multihost.follow(runner)
            return 0
    try:
        service = build_service(args)
    except (ValueError, OSError) as exc:
        return _fatal(f"cannot load {args.model!r}: {exc}")
    import uvloop

    if args.distributed_processes == 1:
        return uvloop.run(_serve(args, service))
    service.engine.runner.broadcast = multihost.send_plan
    try:
        return uvloop.run(_serve(args, service))
    finally:
        multihost.send_plan(None)  # the followers stop with the leader


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
