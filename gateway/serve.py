"""``quicserve serve``: listeners + app + workers in one uvloop process, and a clean drain.

Start-up: build the app, open the cleartext and TLS listeners (so ``/healthz``
answers at once and ``/readyz`` says 503 until a worker is ready), then start
the worker supervisor with its progress display. Shutdown (SIGTERM, or SIGINT
with a shorter deadline; a second signal skips the wait): ``/readyz`` turns
503, listeners stop accepting, in-flight requests get until the deadline to
finish, then connections close and workers are stopped.

Lines on stdout are for people and scripts alike::

    quicserve: listening on http://127.0.0.1:8080 (HTTP/1.1, h2c)
    quicserve: listening on https://127.0.0.1:8443 (h2, HTTP/1.1) cert sha256 AB:CD:...
    quicserve: ready (1 worker(s): tiny)
    quicserve: stopped
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TextIO

from prometheus_client import generate_latest

from . import clock
from .admission.metrics import AdmissionCollector
from .admission.setup import build_admission
from .app import App
from .gc_sweep import CycleSweeper
from .grpc.mount import mount_grpc
from .grpc.native_server import NativeServer
from .http.listeners import Listener
from .http.quic_listener import QuicListener, start_quic_listener
from .http.quic_settings import alt_svc as alt_svc_header
from .http.ticket_dir import SharedTickets
from .http.tls import SELF_SIGNED_CERT, SELF_SIGNED_KEY
from .multiproc.key_slots import KeySlots, share_key_caps
from .multiproc.process import GatewayProcess
from .observability.counters import GatewayCounters
from .observability.logs import ACCESS_LOGGER, configure_logging
from .observability.metrics import GatewayMetrics
from .observability.metrics_listener import start_metrics_listener
from .observability.systemd import SystemdNotifier, required_models
from .observability.tracing import RequestTracer
from .reload import Reloader
from .routing.health_collector import HealthCollector
from .routing.pool import ModelPool
from .routing.rollout import Rollouts
from .routing.rollout_runner import STATE_FILE, RolloutCollector, load_rollouts, run_rollouts
from .settings import Settings, state_dir
from .workers.discovery import watch_workers
from .workers.elastic_pool import ElasticPools, pool_class
from .workers.healing import heal_forever
from .workers.supervisor import WorkerSupervisor

__all__ = ["run_gateway", "serve_forever", "tune_gc"]

log = logging.getLogger("quicserve")


GC_GEN0_THRESHOLD = 20_000


def tune_gc(gen0_threshold: int = GC_GEN0_THRESHOLD) -> None:
    """Garbage-collector settings for a long-running gateway.

    Everything allocated at start-up (modules, settings, the app) is moved to
    the permanent generation (``gc.freeze``) so no collection walks it again,
    and generation 0 is collected every ``gen0_threshold`` allocations instead
    of every 700: the request path makes few reference cycles (asyncio tasks
    and futures are freed by refcount), and with the default threshold cyclic
    collections took about a tenth of the gateway's CPU under load. The cycles
    it does make (per connection) are swept by :class:`~gateway.gc_sweep.CycleSweeper`.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


def _say(out: TextIO, text: str) -> None:
    out.write(f"quicserve: {text}\n")
    out.flush()


async def run_gateway(settings: Settings, *, out: TextIO | None = None,
                      stop: asyncio.Event | None = None, reload: Reload | None = None,
                      process: GatewayProcess | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set); return the exit status. ``process``: this is
    one gateway process of several (gateway/multiproc): inherited sockets, shared state, its workers
    named by the supervisor."""
    from .http.common import HttpLimits
    from .http.listeners import ListenerSpec, start_listener
    from .http.tls import load_or_create_tls

    out = out if out is not None else sys.stdout
    loop = asyncio.get_running_loop()
    metrics = GatewayMetrics()
    if process is not None:
        metrics.merge = process.merged  # /metrics: the whole gateway
    served = settings.served()
    model_workers = [m.worker_settings() for m in served] if settings.models else [settings.workers]
    elastic = process is None and any(w.elastic for w in model_workers)  # one process: its own elastic pools
    pool = (pool_class(model_workers) if elastic else ModelPool)(
        retries=settings.api.retries, policy=settings.routing.build(), health=settings.routing.health())
    metrics.registry.register(HealthCollector(pool))
    if settings.models:  # configured names answer 404/503 before their workers are up
        pool.configure((m.name, m.aliases) for m in served)
        pool.fallbacks.update((m.name, m.fallback) for m in served if m.fallback)
    adm = build_admission(settings.admission, settings.server.host)
    if process is not None and adm.stage is not None:  # keys' concurrency caps count every process's requests
        share_key_caps(adm.stage.admission, KeySlots(os.path.join(process.runtime, "key-slots"), process.index,
                                                     process.of))
    if adm.stage is not None:
        metrics.registry.register(AdmissionCollector(adm.stage.admission, adm.leases))
    if adm.warning:
        log.warning("%s", adm.warning)
        _say(out, adm.warning)
    tracer = RequestTracer(settings.tracing)
    rollouts = Rollouts(settings.rollouts, clock.now())
    rollout_state = state_dir(settings) / STATE_FILE
    if rollouts:
        load_rollouts(rollouts, rollout_state)
    metrics.registry.register(RolloutCollector(rollouts))
    app = App(pool, metrics, settings.api, admission=adm.stage,
              validate=adm.schemas.validate if adm.schemas is not None else None, tracer=tracer,
              access_log=settings.log.access_log, rules=settings.rule_tree(), rollouts=rollouts,
              identify=keys.identify if adm.stage is not None and (keys := adm.stage.admission.keys) else None)
    lim = settings.limits
    limits = HttpLimits(max_body_bytes=lim.max_body_bytes, max_header_bytes=lim.max_header_bytes,
                        header_timeout=lim.header_timeout, body_timeout=lim.body_timeout,
                        keepalive_timeout=lim.keepalive_timeout,
                        h2_max_concurrent_streams=lim.h2_max_concurrent_streams, send_buffer=lim.send_buffer_bytes)
    srv = settings.server
    specs = [(ListenerSpec("tcp", srv.host, srv.port, reuse_port=srv.reuse_port), "(HTTP/1.1, h2c)")]
    servers: list[Listener] = []
    if srv.tls_port >= 0:
        ctx, fingerprint = load_or_create_tls(srv.tls_cert or None, srv.tls_key or None, state_dir(settings))
        alt_svc: tuple[tuple[bytes, bytes], ...] = ()
        if settings.quic.port >= 0:  # HTTP/3 first, so the TLS listener can advertise its port
            quic = await _start_quic(app, settings, process)
            servers.append(quic)
            _say(out, f"listening on {quic.url} (h3, UDP)")
            alt_svc = (alt_svc_header(quic.address[1]),)
        specs.append((ListenerSpec("tls", srv.host, srv.tls_port, ssl=ctx, reuse_port=srv.reuse_port,
                                   extra_headers=alt_svc), f"(h2, HTTP/1.1) cert sha256 {fingerprint}"))
    if srv.unix_socket:
        specs.append((ListenerSpec("unix", path=os.path.expanduser(srv.unix_socket)), "(HTTP/1.1, h2c)"))
    for spec, what in specs:
        servers.append(await start_listener(app.handle, spec, limits=limits, on_event=app.on_http_event,
                                            streams_body=app.streams_body))
        _say(out, f"listening on {servers[-1].url} {what}")
    scrape = await start_metrics_listener(app, settings.observability, limits, bind=process is None or process.index == 0)
    if scrape is not None:  # [observability] metrics_listen: /metrics there, and not on the listeners above
        servers.append(scrape)
        _say(out, f"metrics on {scrape.url}/metrics (Prometheus; not on the other listeners)")
    native = await mount_grpc(app, settings.grpc, srv.host)
    if native is not None:
        _say(out, f"listening on grpc://{_hostport(settings.grpc.host or srv.host, native.port)} (gRPC, h2c)")

    notifier = SystemdNotifier.from_environ()  # systemd hook: READY/STATUS/STOPPING + watchdog pings
    supervisor = WorkerSupervisor(model_workers, pool, metrics, notifier.progress_display(settings.log.progress),
                                  state_dir=srv.state_dir)
    app.worker_failure = lambda: supervisor.failure
    supervisor.start()
    pools = ElasticPools.start(model_workers, supervisor, pool, metrics, settings.shutdown.drain_timeout,
                               advisory=bool(settings.discovery.worker_dns))  # Kubernetes scales those workers
    notifier.start(required_models(*model_workers), pool.models)
    tune_gc()
    sweeper = asyncio.create_task((cycles := CycleSweeper()).run())  # a burst's garbage cycles do not outlive it
    metrics.registry.register(GatewayCounters(next((s for s in servers if isinstance(s, QuicListener)), None), cycles,
                                              supervisor))  # 0-RTT, tickets, GC sweeps, workers by model
    if process is not None:  # the supervisor's workers, as it names them; this process's figures for the others
        watches_of_process = [asyncio.create_task(process.follow(supervisor.add_remote, supervisor.remove_remote)),
                              asyncio.create_task(process.publish_metrics(lambda: generate_latest(metrics.registry)))]
    watches = [asyncio.create_task(watch_workers(spec, supervisor.add_remote, supervisor.remove_remote,
                                                 interval=settings.discovery.interval))
               for spec in settings.discovery.worker_dns]  # workers behind a DNS name (Kubernetes)
    if process is not None:
        watches += watches_of_process

    stop = stop if stop is not None else asyncio.Event()
    deadline = [settings.shutdown.drain_timeout]
    grace = [settings.shutdown.grace_period]
    signals = [0]
    now_ = asyncio.Event()  # a second signal: skip what is left of the grace period and the drain

    def on_signal(sig: signal.Signals) -> None:
        signals[0] += 1
        if signals[0] > 1:
            deadline[0] = grace[0] = 0.0
            now_.set()
            log.warning("second signal: stopping now")
        elif sig == signal.SIGINT:
            deadline[0] = settings.shutdown.sigint_drain_timeout
            grace[0] = 0.0
        log.info("%s: draining (up to %g s)", sig.name, grace[0] + deadline[0])
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    reloader = Reloader(reload[0], reload[1], settings, app, pool, supervisor) if reload is not None else None
    hup_tasks: set[asyncio.Task[bool]] = set()

    def on_hup() -> None:
        if adm.stage is not None:
            problems = adm.stage.admission.reload_keys()
            log.info("SIGHUP: API keys reloaded%s", f" ({'; '.join(problems)})" if problems else "")
        if reloader is not None:
            task = asyncio.create_task(reloader.reload("SIGHUP"))
            hup_tasks.add(task)
            task.add_done_callback(hup_tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    leases_task = asyncio.create_task(adm.leases.run()) if adm.leases is not None else None
    rollout_task = asyncio.create_task(run_rollouts(rollouts, rollout_state))
    heal_task = asyncio.create_task(heal_forever(supervisor, pool, settings.shutdown.drain_timeout))
    watch_task = asyncio.create_task(reloader.watch()) if reloader is not None and reloader.path else None

    async def announce_ready() -> None:
        if process is not None and process.first_workers is not None:
            await process.first_workers.wait()  # until the supervisor names a worker, there is none to wait for
        if await supervisor.wait_ready():
            _say(out, f"ready ({pool.ready_workers()} worker(s): {', '.join(pool.models())})")

    ready_task = asyncio.create_task(announce_ready())
    try:
        await stop.wait()
    finally:
        ready_task.cancel()
        sweeper.cancel()
        rollout_task.cancel()
        heal_task.cancel()
        if pools is not None:
            pools.stop()
        if watch_task is not None:
            watch_task.cancel()
        for w in watches:
            w.cancel()
        notifier.stopping()
        await _drain(app, servers, native, grace[0], deadline[0], now_, out)
        await supervisor.stop()
        if adm.leases is not None and leases_task is not None:
            leases_task.cancel()
            await adm.leases.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await notifier.close()
        tracer.shutdown()
        _say(out, "stopped")
    return 0


async def _drain(app: App, servers: list[Listener], native: NativeServer | None, grace: float, deadline: float,
                 now: asyncio.Event, out: TextIO) -> None:
    """Stop serving without losing a request or cutting one silently.

    1. Grace period: keep listening while ``/readyz`` answers 503 "draining" and new generation
       requests get 503 + Retry-After + Connection: close, so a load balancer (Kubernetes' endpoint
       removal) takes this instance out before its listeners close.
    2. Stop accepting; in-flight requests get until ``deadline`` to finish.
    3. At the deadline every request still open ends with an explicit error (its stream's terminal
       event), counted in ``quicserve_drain_cut_requests``; then connections close.
    """
    app.draining = True
    if native is not None:
        native.health.set(False)  # NOT_SERVING for the whole drain: balancers stop sending calls
    if grace > 0:
        _say(out, f"draining: /readyz 503 for {grace:g} s before the listeners close")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(now.wait(), grace)
    if native is not None:
        native.stop_accepting()
        servers = [*servers, native.listener]  # its calls drain with the others'
    for s in servers:
        s.stop_accepting()
    in_flight = sum(s.in_flight for s in servers)
    if in_flight:
        _say(out, f"draining {in_flight} request(s), up to {deadline:g} s")
    with contextlib.suppress(Exception):
        await asyncio.gather(*(s.wait_idle(deadline) for s in servers))
    cut = app.end_all()
    if cut:
        _say(out, f"drain deadline: {cut} request(s) ended with a shutting_down error")
        with contextlib.suppress(Exception):
            await asyncio.gather(*(s.wait_idle(1.0) for s in servers))  # let their last bytes go out
    await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)


async def _start_quic(app: App, settings: Settings, process: GatewayProcess | None) -> QuicListener:
    """The HTTP/3 listener on UDP, with the TLS listener's certificate (self-signed: made by now);
    several processes seal and claim their session tickets in one shared store."""
    srv = settings.server
    cert = srv.tls_cert or str(state_dir(settings) / SELF_SIGNED_CERT)
    key = srv.tls_key or str(state_dir(settings) / SELF_SIGNED_KEY)
    shared = SharedTickets(process.secret, os.path.join(process.runtime, "tickets")) if process is not None else None
    return await start_quic_listener(app.handle, srv.host, settings.quic.port, cert, key, settings.quic,
                                     on_event=app.on_http_event, streams_body=app.streams_body, shared=shared)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


Reload = tuple[Callable[[], Settings], str | None]
"""How to read the configuration again (the file, the environment and the same flags) and the
file to watch for changes (None: SIGHUP only)."""


def serve_forever(settings: Settings, reload: Reload | None = None, process: GatewayProcess | None = None) -> int:
    """Run :func:`run_gateway` on uvloop (unless ``server.uvloop = false``)."""
    configure_logging(settings.log.level, settings.log.format)  # text/JSON; level and format reach the workers
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if settings.log.access_log else logging.WARNING)
    try:
        if settings.server.uvloop:
            import uvloop

            return uvloop.run(run_gateway(settings, reload=reload, process=process))
        return asyncio.run(run_gateway(settings, reload=reload, process=process))
    except OSError as e:  # the usual one: a port already in use
        print(f"quicserve: cannot start: {e}", file=sys.stderr)
        return 1
