"""What a worker is asked to be: every option of ``quicserve worker``, one default each.

Why it lives here: the gateway (the ``[workers]`` settings, ``quicserve config
check``, the supervisor's child command line) and the worker (its flags, the
engine, the runner) must agree on each option, its default and what a valid
value is; imports flow ``gateway -> transport <- inference``, so this launch
contract sits beside the wire contract. Pure data and checks: no JAX, no I/O.

How it works: :class:`WorkerOptions` holds every option and its default.
:func:`option_problems` names each bad value by key (the gateway prefixes
``workers.``, the worker CLI spells the flag). :func:`add_flags` declares one
``quicserve worker`` flag per field and :func:`to_flags` writes the flags for
given options, both from the same fields, so the gateway's command line and
the worker's parser cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..security import security_of
from ..select import BadURL, parse_url

__all__ = [
    "WorkerOptions",
    "ENGINES",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "WEIGHT_DTYPES",
    "WEIGHT_QUANT_METHODS",
    "ATTENTION_BACKENDS",
    "URL_SCHEMES",
    "JAX_NUM_BLOCKS",
    "SYNTHETIC_NUM_BLOCKS",
    "SYNTHETIC_MAX_MODEL_LEN",
    "EXIT_USAGE",
    "EXIT_CONFIG",
    "PERMANENT_EXITS",
    "option_problems",
    "parse_cpus",
    "parse_host_port",
    "batch_window_ms",
    "add_flags",
    "options_from",
    "to_flags",
    "flag_name",
    "compilation_cache_dir",
    "DEFAULT_STATE_DIR",
]

ENGINES = ("jax", "synthetic")
DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model dtype
WEIGHT_DTYPES = ("auto", "int8", "fp8")  # "auto": the model dtype
WEIGHT_QUANT_METHODS = ("rtn", "gptq")  # round to nearest; GPTQ calibrated on random tokens
ATTENTION_BACKENDS = ("auto", "pallas", "native", "xla", "reference")  # inference.kernels.kernel_set.ATTENTION
URL_SCHEMES = ("tcp://", "unix://", "rdma://")

# KV blocks when ``num_blocks`` is 0, per engine, and the synthetic engine's context length.
JAX_NUM_BLOCKS = 512
SYNTHETIC_NUM_BLOCKS = 2048
SYNTHETIC_MAX_MODEL_LEN = 4096

# Exit statuses that restarting cannot fix: argparse's usage error, and sysexits' EX_CONFIG for
# options that parse but cannot run (a missing model, CPUs this machine lacks, a context the cache
# cannot hold). The supervisor reports these once and does not restart the worker.
EXIT_USAGE = 2
EXIT_CONFIG = 78
PERMANENT_EXITS = frozenset({EXIT_USAGE, EXIT_CONFIG})


def _opt(default: Any, help: str, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """Every ``quicserve worker`` option; the defaults are the worker's, the engine's and the runner's."""

    listen: str = _opt("tcp://127.0.0.1:0", "transport URL: tcp://host:port, unix:///path or rdma:// (port 0 = any)")
    engine: str = _opt("jax", "jax (the model) or synthetic (deterministic test/benchmark double)", ENGINES)
    model: str = _opt("tiny", "'tiny' (built in) or a local Hugging Face checkpoint directory")
    served_name: str = _opt("", "name the model is served under ('' = the model's name)")
    max_batch: int = _opt(32, "sequences one engine step may run")
    # 2: each prefill batch size adds buckets to compile at start-up (tiny model, max_batch 8: 51 shapes
    # against 28 at 1, first answer ~24 s after start; 4 would add 21 more), and at saturation ~1 prompt
    # joins per step, so pairs are what a short wait gathers (calls of 4 shorten a saturated step by
    # 1.12x at best, pairs by 1.08x: tests/bench/bench_batch_window.py; on the decode bench's batch-32
    # run, with the native matmul: prefill 0.95-0.96 s at 2, 1.01 at 4, 1.09 at 8).
    max_prefill_batch: int = _opt(2, "prompts one prefill call may carry (the batch window gathers up to this "
                                     "many; capped at max_batch)")
    max_prefill_tokens: int = _opt(2048, "new prompt tokens one step may prefill (a longer prompt runs alone)")
    # Chunked prefill (inference/engine.py): a long prompt no longer stalls every stream for its whole
    # prefill; the default is tests/bench/bench_chunked_prefill.py's measurement.
    step_tokens: int = _opt(256, "tokens one engine step carries: the running sequences' decodes first, the rest "
                                 "filled with chunks of prompts (several prompts' chunks allowed); 0 = no chunking "
                                 "(a prompt prefills whole; one longer than max_prefill_tokens alone)")
    # Tensor parallelism (inference/model/tensor_parallel.py): the mesh is this many of the worker's devices
    # (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N); across hosts, with the
    # distributed_* options, the devices of every process.
    tensor_parallel: int = _opt(1, "devices the model is split over (the mesh's tp axis): attention heads, MLP "
                                   "columns and the KV cache's heads; 1 = one device")
    distributed_coordinator: str = _opt("", "HOST:PORT of process 0's jax.distributed coordinator: with "
                                            "distributed_processes > 1 the model spans every process's devices "
                                            "(tensor_parallel counts them all); '' = one process")
    distributed_processes: int = _opt(1, "worker processes (one per host) the model spans; process 0 serves the "
                                         "transport and runs the engine, the others follow its steps")
    distributed_process_id: int = _opt(0, "this worker process's rank among distributed_processes (0 = the one "
                                          "the gateway talks to)")
    max_model_len: int = _opt(0, "context length in tokens (0 = the model's, capped by the KV cache)")
    block_size: int = _opt(16, "tokens per KV-cache block (the prefix cache shares whole blocks)")
    num_blocks: int = _opt(0, f"KV-cache blocks (0 = {JAX_NUM_BLOCKS} for jax, {SYNTHETIC_NUM_BLOCKS} for synthetic)")
    dtype: str = _opt("float32", "model dtype", DTYPES)
    kv_cache_dtype: str = _opt(
        "auto", "KV cache storage: 'auto' = the model dtype; 'int8' or 'fp8' (e4m3) store codes with a float32 "
        "scale per block and KV head, quantized when written and dequantized in attention (1/4 of a float32 "
        "cache's bytes, 1/2 of bfloat16's). On CPU prefer int8: XLA:CPU has no float8 scatter, so each fp8 "
        "write copies the cache", KV_CACHE_DTYPES)
    weight_dtype: str = _opt(
        "auto", "projection weights: 'auto' = the model dtype; 'int8' or 'fp8' (e4m3) store every projection "
        "(attention, MLP, head) as 1-byte codes with a float32 scale per output channel, dequantized inside "
        "the matmul (the embedding table stays float). On CPU prefer int8: XLA:CPU converts fp8 in software",
        WEIGHT_DTYPES)
    weight_quant_method: str = _opt(
        "rtn", "how weight_dtype picks the codes: 'rtn' rounds to nearest; 'gptq' calibrates on the model's own "
        "activations and feeds each column's rounding error into the columns not yet quantized (slower start)",
        WEIGHT_QUANT_METHODS)
    # JAX's persistent compilation cache (inference/model/compile_cache.py): tiny model, first start
    # vs a restart over its cache, tests/bench/bench_cold_start.py.
    compilation_cache: str = _opt("auto", "directory of JAX's persistent compilation cache, shared by the replicas "
                                          "of a model: a restart loads its compiled shapes instead of compiling "
                                          "them ('auto' = compilation-cache/<served name> in the state directory: "
                                          "the gateway's for its local workers, else ~/.local/state/quicserve; "
                                          "'' = off)")
    attention: str = _opt("auto", "kernels: auto (Pallas on GPU and TPU, the native kernels on CPU), pallas, native, "
                                  "xla (jnp, any platform) or reference (the ground truth, slow)", ATTENTION_BACKENDS)
    batch_window: str = _opt("adaptive", "how long admission waits to batch prompts: adaptive | fixed:<ms>")
    prefix_cache: bool = _opt(True, "share the KV blocks of common prompt prefixes between requests")
    stats_interval: float = _opt(0.5, "seconds between load reports to the gateway")
    # A request whose client stops reading is paused off the batch (its slot goes to other work) and
    # ends with a TIMEOUT error after this long; a minute outlasts any reader that is merely slow.
    stall_timeout: float = _opt(60.0, "seconds a request may wait for its client to read before it ends with "
                                      "an error (0 = no limit; a paused request holds no batch slot)")
    # The synthetic engine's cost model and fault injection (inference/synthetic.py explains them).
    synthetic_step_ms: float = _opt(0.0, "synthetic engine only: sleep per step, imitating model latency")
    synthetic_step_ms_per_seq: float = _opt(0.0, "synthetic engine only: more sleep per sequence in the step")
    synthetic_prefill_us_per_token: float = _opt(0.0, "synthetic engine only: more sleep per prompt token a step "
                                                      "prefills (tokens the prefix cache holds cost nothing)")
    synthetic_slowdown: float = _opt(1.0, "synthetic engine only: factor on every modelled time")
    synthetic_startup_ms: float = _opt(0.0, "synthetic engine only: sleep at start-up before serving, imitating a "
                                            "model's load and compile (a cold start, for elastic pools)")
    synthetic_error_rate: float = _opt(0.0, "synthetic engine only: share of requests that end with an injected "
                                            "INTERNAL error")
    synthetic_hang_rate: float = _opt(0.0, "synthetic engine only: share of requests that stop producing tokens "
                                           "and never end until cancelled")
    synthetic_error_after: int = _opt(0, "synthetic engine only: tokens a request streams before its injected "
                                         "error or hang")
    synthetic_step_fail_rate: float = _opt(0.0, "synthetic engine only: share of engine steps that fail (every "
                                                "request the worker holds then ends with an error)")
    synthetic_fault_seed: int = _opt(0, "synthetic engine only: seed of the injected faults (same seed, same "
                                        "arrival order: same faults)")
    cpus: str = _opt("", "pin the worker to these CPUs, e.g. '0-3,6' ('' = no pinning)")
    numa_node: int = _opt(-1, "pin the worker to this NUMA node's CPUs (-1 = none)")
    metrics_listen: str = _opt("", "serve the worker's own Prometheus /metrics on HOST:PORT, for workers "
                                   "no local gateway scrapes ('' = off; port 0 = any)")
    otlp_endpoint: str = _opt("", "OTLP/HTTP URL for the spans (queue, prefill, decode) of requests that arrive "
                                  "with a traceparent, e.g. http://collector:4318/v1/traces ('' = off)")
    # Transport security (transport/security.py): the gateway reads the same keys for its connections.
    transport_tls_cert: str = _opt("", "PEM certificate this side presents on the transport: mutual TLS, with "
                                       "transport_tls_key and transport_tls_ca (files re-read when they change)")
    transport_tls_key: str = _opt("", "PEM private key of transport_tls_cert")
    transport_tls_ca: str = _opt("", "PEM CA certificate(s) the peer's transport certificate must chain to (the "
                                     "transport's own CA: any certificate it signed is trusted)")
    transport_psk_file: str = _opt("", "file holding a pre-shared key (>= 16 bytes, e.g. `openssl rand -hex 32`) "
                                       "proved by an HMAC challenge in the HELLO exchange: authentication without "
                                       "certificates, no encryption")
    insecure: bool = _opt(False, "allow tcp:// or rdma:// beyond loopback with no transport authentication (anyone "
                                 "who reaches the port can submit); without it such a worker refuses to start")


_FIELDS = dataclasses.fields(WorkerOptions)
_DEFAULTS = WorkerOptions()
_AT_LEAST_ONE = ("max_batch", "max_prefill_batch", "max_prefill_tokens", "block_size", "tensor_parallel",
                 "distributed_processes")
_SYNTHETIC_TIMES = ("synthetic_step_ms", "synthetic_step_ms_per_seq", "synthetic_prefill_us_per_token",
                    "synthetic_startup_ms")
_SYNTHETIC_RATES = ("synthetic_error_rate", "synthetic_hang_rate", "synthetic_step_fail_rate")


DEFAULT_STATE_DIR = "~/.local/state/quicserve"  # the gateway's default [server] state_dir


def compilation_cache_dir(setting: str, served_name: str, state_dir: str = DEFAULT_STATE_DIR) -> Path | None:
    """The directory the ``compilation_cache`` option names: ``"auto"`` is
    ``<state_dir>/compilation-cache/<served_name>``, ``""`` is off (None), anything else a path."""
    if not setting:
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", served_name).strip("._") or "model"
    return Path(state_dir).expanduser() / "compilation-cache" / key


def parse_cpus(spec: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; ValueError names the spec."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi or lo)
            if a < 0 or b < a:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        raise ValueError(f"bad CPU list {spec!r} (e.g. 0-3,6)") from None
    return cpus


def batch_window_ms(spec: str) -> float | None:
    """``"adaptive"`` -> None, ``"fixed:<ms>"`` -> ms; ValueError for anything else."""
    if spec == "adaptive":
        return None
    if spec.startswith("fixed:"):
        try:
            ms = float(spec[6:])
        except ValueError:
            raise ValueError(f"bad batch window {spec!r}: fixed:<ms> needs a number") from None
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"bad batch window {spec!r}: fixed:<ms> needs a finite ms >= 0")
        return ms
    raise ValueError(f"bad batch window {spec!r}: use 'adaptive' or 'fixed:<ms>'")


def option_problems(o: WorkerOptions) -> list[tuple[str, str]]:
    """(key, what is wrong) for every bad option; empty if the worker can start with them."""
    p: list[tuple[str, str]] = []
    for f in _FIELDS:
        v, choices = getattr(o, f.name), f.metadata["choices"]
        if choices and v not in choices:
            p.append((f.name, f"{v!r} is not one of {', '.join(map(repr, choices))}"))
    if not o.listen.startswith(URL_SCHEMES):
        p.append(("listen", f"{o.listen!r} is not a tcp://, unix:// or rdma:// URL"))
    if not o.model:
        p.append(("model", "must not be empty"))
    if o.engine == "synthetic" and o.model != "tiny":
        p.append(("model", "the synthetic engine only serves the byte-level 'tiny' tokenizer"))
    p += [(k, f"must be >= 1, got {getattr(o, k)}") for k in _AT_LEAST_ONE if getattr(o, k) < 1]
    for k in ("max_model_len", "num_blocks"):
        if getattr(o, k) < 0:
            p.append((k, f"must be >= 0 (0 = default), got {getattr(o, k)}"))
    p += _distributed_problems(o)
    if o.step_tokens < 0:
        p.append(("step_tokens", f"must be >= 0 (0 = no chunked prefill), got {o.step_tokens}"))
    blocks = o.num_blocks or (SYNTHETIC_NUM_BLOCKS if o.engine == "synthetic" else JAX_NUM_BLOCKS)
    if o.block_size >= 1 and o.max_model_len > blocks * o.block_size:
        # A lone sequence must always fit in the KV cache.
        p.append(("max_model_len", f"{o.max_model_len} tokens do not fit the KV cache ({blocks} blocks x "
                                   f"{o.block_size} tokens = {blocks * o.block_size}); raise num_blocks"))
    try:
        batch_window_ms(o.batch_window)
    except ValueError as exc:
        p.append(("batch_window", str(exc)))
    if not o.stats_interval > 0:
        p.append(("stats_interval", f"must be > 0, got {o.stats_interval}"))
    if not (math.isfinite(o.stall_timeout) and o.stall_timeout >= 0):
        p.append(("stall_timeout", f"must be >= 0 (0 = no limit), got {o.stall_timeout}"))
    p += _synthetic_problems(o)
    if o.cpus:
        try:
            parse_cpus(o.cpus)
        except ValueError as exc:
            p.append(("cpus", str(exc)))
    if o.numa_node < -1:
        p.append(("numa_node", f"must be a node number or -1 (none), got {o.numa_node}"))
    if o.otlp_endpoint and not o.otlp_endpoint.startswith(("http://", "https://")):
        p.append(("otlp_endpoint", f"{o.otlp_endpoint!r} is not an http(s) URL"))
    if o.metrics_listen:
        try:
            parse_host_port(o.metrics_listen)
        except ValueError as exc:
            p.append(("metrics_listen", str(exc)))
    return p + _security_problems(o)


def _distributed_problems(o: WorkerOptions) -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = []
    if not 0 <= o.distributed_process_id < max(1, o.distributed_processes):
        p.append(("distributed_process_id", f"must be in 0..{o.distributed_processes - 1}, got "
                                            f"{o.distributed_process_id}"))
    if o.distributed_processes > 1:
        if o.engine != "jax":
            p.append(("distributed_processes", "only the jax engine spans processes"))
        try:
            parse_host_port(o.distributed_coordinator)
        except ValueError as exc:
            p.append(("distributed_coordinator", f"needed with distributed_processes > 1: {exc}"))
    return p


def _security_problems(o: WorkerOptions) -> list[tuple[str, str]]:
    sec = security_of(o)
    p = sec.problems(o.listen)
    try:
        refusal = sec.refusal(parse_url(o.listen), "worker")
    except BadURL:
        refusal = None  # the listen check above names it
    if refusal:
        p.append(("listen", refusal))
    return p


def _synthetic_problems(o: WorkerOptions) -> list[tuple[str, str]]:
    p = [(k, f"must be >= 0, got {getattr(o, k)}") for k in _SYNTHETIC_TIMES
         if not (math.isfinite(getattr(o, k)) and getattr(o, k) >= 0)]  # fmt: skip
    if not (math.isfinite(o.synthetic_slowdown) and o.synthetic_slowdown > 0):
        p.append(("synthetic_slowdown", f"must be > 0, got {o.synthetic_slowdown}"))
    p += [(k, f"must be a share in [0, 1], got {getattr(o, k)}") for k in _SYNTHETIC_RATES
          if not 0 <= getattr(o, k) <= 1]  # fmt: skip
    if o.synthetic_error_rate + o.synthetic_hang_rate > 1:
        p.append(("synthetic_hang_rate", f"synthetic_error_rate + synthetic_hang_rate must be <= 1 (shares of the "
                                         f"same requests), got {o.synthetic_error_rate + o.synthetic_hang_rate}"))
    if o.synthetic_error_after < 0:
        p.append(("synthetic_error_after", f"must be >= 0, got {o.synthetic_error_after}"))
    return p


def parse_host_port(spec: str) -> tuple[str, int]:
    """``"0.0.0.0:9090"`` / ``"[::]:0"`` -> (host, port); ValueError names the spec."""
    host, sep, port = spec.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{spec!r} is not HOST:PORT")
    return host, int(port)


def flag_name(key: str) -> str:
    """``max_batch`` -> ``--max-batch``."""
    return "--" + key.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`WorkerOptions` field, with its type, default and choices."""
    for f in _FIELDS:
        default, meta = getattr(_DEFAULTS, f.name), f.metadata
        if isinstance(default, bool):
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=meta["help"])
            continue
        parser.add_argument(flag_name(f.name), dest=f.name, type=type(default), default=default,
                            choices=meta["choices"] or None, metavar=None if meta["choices"] else f.name.upper(),
                            help=f"{meta['help']} (default: {default!r})")


def options_from(ns: argparse.Namespace) -> WorkerOptions:
    """The options a parser built by :func:`add_flags` read."""
    return WorkerOptions(**{f.name: getattr(ns, f.name) for f in _FIELDS})


def to_flags(o: WorkerOptions) -> list[str]:
    """``quicserve worker`` flags for ``o``: listen, engine and model always, the rest where they differ
    from the default (the worker reads the same defaults)."""
    out: list[str] = []
    for f in _FIELDS:
        v = getattr(o, f.name)
        if f.name not in ("listen", "engine", "model") and v == getattr(_DEFAULTS, f.name):
            continue
        if isinstance(v, bool):
            out.append(flag_name(f.name) if v else "--no-" + f.name.replace("_", "-"))
        else:
            out.append(f"{flag_name(f.name)}={v}")  # one token: a value may start with "-"
    return out
