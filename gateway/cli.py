"""The ``quicserve`` command.

Subcommands::

    quicserve serve [--config FILE] [--engine jax|synthetic] [--model M] [--host H] [--port P] ...
    quicserve worker ARGS...          # the inference worker (see `quicserve worker --help`)
    quicserve config check FILE       # unknown keys, wrong types, bad values -> exit 1
    quicserve config show [--config FILE]
    quicserve transport probe         # which transports (RDMA, TCP, unix) work here
    quicserve bench --url URL ...     # serving benchmark (TTFT/TPOT/ITL, plots); bench compare A B

``worker`` imports :mod:`inference.worker` lazily, inside that subcommand only,
so the gateway process never imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quicserve", description="LLM inference gateway and serving stack.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,worker,config,transport,bench}")

    s = sub.add_parser("serve", help="run the gateway and its local workers")
    s.add_argument("--config", metavar="FILE", help="TOML settings file (see config/default.toml)")
    s.add_argument("--engine", choices=["jax", "synthetic"],
                   help="engine of the local workers (synthetic: deterministic test/benchmark double)")
    s.add_argument("--model", help='model of the local workers ("tiny" or a checkpoint directory)')
    s.add_argument("--served-name", help="name the model is served under")
    s.add_argument("--host", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="cleartext HTTP/1.1 + h2c port (default 8080; 0 = any)")
    s.add_argument("--tls-port", type=int, help="TLS port (default 8443; 0 = any)")
    s.add_argument("--no-tls", action="store_true", help="do not open the TLS listener")
    s.add_argument("--grpc-port", type=int, help="native gRPC port (default 50051; 0 = any, -1 = off)")
    s.add_argument("--quic-port", type=int, help="HTTP/3 UDP port (default 8443; 0 = any, -1 = off)")
    s.add_argument("--tls-cert", help="PEM certificate (default: self-signed in the state dir)")
    s.add_argument("--tls-key", help="PEM private key")
    s.add_argument("--state-dir", help="where the self-signed certificate is kept")
    s.add_argument("--workers", type=int, metavar="N", help="local worker processes (default 1)")
    s.add_argument("--worker-url", action="append", metavar="URL",
                   help="a remote worker's transport URL (repeatable)")
    s.add_argument("--worker-dns", action="append", metavar="NAME:PORT",
                   help="workers behind a DNS name, re-resolved as they come and go (repeatable; a Kubernetes "
                        "headless Service)")
    s.add_argument("--worker-option", action="append", metavar="KEY=VALUE", default=[],
                   help="a [workers] setting (repeatable), e.g. --worker-option max_batch=64")
    s.add_argument("--processes", metavar="N|auto",
                   help='gateway processes over one worker pool (default 1; "auto": one per CPU)')
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--progress", choices=["auto", "bar", "lines", "off"])

    sub.add_parser("worker", help="run an inference worker (arguments go to the worker)", add_help=False)

    c = sub.add_parser("config", help="check or show settings")
    csub = c.add_subparsers(dest="config_command", required=True)
    chk = csub.add_parser("check", help="report unknown keys, wrong types and bad values; exit 1 if any")
    chk.add_argument("file")
    show = csub.add_parser("show", help="print the effective settings (file + environment)")
    show.add_argument("--config", metavar="FILE")

    t = sub.add_parser("transport", help="transport tools")
    tsub = t.add_subparsers(dest="transport_command", required=True)
    tsub.add_parser("probe", help="report which transports work on this machine")

    sub.add_parser("bench", help="serving benchmark against a running server (`quicserve bench --help`)",
                   add_help=False)
    return p


def _serve_overrides(a: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Settings the flags override (the dedicated flags win over --worker-option), and any problems."""
    from .settings import assignments

    workers, problems = assignments("workers", a.worker_option)
    o: dict[str, dict[str, Any]] = {"server": {}, "workers": workers, "log": {}, "grpc": {}, "quic": {},
                                    "discovery": {}}
    for flag, section, key in [("host", "server", "host"), ("port", "server", "port"),
                               ("tls_port", "server", "tls_port"), ("tls_cert", "server", "tls_cert"),
                               ("tls_key", "server", "tls_key"), ("state_dir", "server", "state_dir"),
                               ("engine", "workers", "engine"), ("model", "workers", "model"),
                               ("served_name", "workers", "served_name"), ("workers", "workers", "local"),
                               ("worker_url", "workers", "remote"),
                               ("log_level", "log", "level"), ("progress", "log", "progress"),
                               ("grpc_port", "grpc", "port"), ("quic_port", "quic", "port"),
                               ("worker_dns", "discovery", "worker_dns")]:
        v = getattr(a, flag)
        if v is not None:
            o[section][key] = v
    if a.processes is not None:
        try:
            o["server"]["processes"] = a.processes if a.processes == "auto" else int(a.processes)
        except ValueError:
            problems.append(f"--processes: {a.processes!r} is not a number or \"auto\"")
    if a.no_tls:
        o["server"]["tls_port"] = -1
    if (a.worker_url or a.worker_dns) and a.workers is None:
        o["workers"]["local"] = 0  # only remote workers were asked for
    return {k: v for k, v in o.items() if v}, problems


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        from inference.worker import main as worker_main  # lazy: only worker processes import JAX

        return int(worker_main(argv[1:]) or 0)
    if argv[:1] == ["bench"]:
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    a = build_parser().parse_args(argv)
    from .settings import SettingsError, check_file, load_settings

    if a.command == "config":
        if a.config_command == "check":
            problems = check_file(a.file)
            for line in problems:
                print(f"{a.file}: {line}")
            if not problems:
                print(f"{a.file}: OK")
            return 1 if problems else 0
        try:
            settings = load_settings(a.config)
        except SettingsError as e:
            print(e, file=sys.stderr)
            return 1
        print(_to_toml(dataclasses.asdict(settings)), end="")
        return 0
    if a.command == "transport":
        from transport.probe import probe_report

        print(probe_report())
        return 0
    # serve
    overrides, problems = _serve_overrides(a)
    try:
        if problems:
            raise SettingsError(problems)
        settings = load_settings(a.config, overrides=overrides)
    except SettingsError as e:
        print(e, file=sys.stderr)
        return 2
    from .multiproc.process import from_environ

    process = from_environ()  # started by a supervisor of several gateway processes
    if process is None and settings.server.process_count() > 1:
        from .multiproc.supervisor import run_processes

        return run_processes(settings, argv, settings.server.process_count())
    from .serve import serve_forever

    def again() -> Any:  # the same file, environment and flags (SIGHUP, or the file changed)
        fresh = load_settings(a.config, overrides=overrides)
        return fresh if process is None else _one_of_several(fresh, process.redis_url)

    if process is not None:
        settings = _one_of_several(settings, process.redis_url)
    return serve_forever(settings, (again, a.config), process)


def _one_of_several(settings: Any, redis_url: str) -> Any:
    """A gateway process's settings: its supervisor runs the local workers (the process connects to
    them); the supervisor's local store holds the shared limits unless ``redis_url`` names one."""
    adm = settings.admission
    return dataclasses.replace(
        settings, workers=dataclasses.replace(settings.workers, local=0),
        models=[dataclasses.replace(m, local=0) for m in settings.models],
        admission=dataclasses.replace(adm, redis_url=adm.redis_url or redis_url))


def _to_toml(d: dict[str, Any]) -> str:
    import orjson

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return str(v).lower() if isinstance(v, bool) else orjson.dumps(v).decode()

    lines = []
    for section, values in d.items():
        tables = values if isinstance(values, list) else [values]  # [[models]]: a list of tables
        for table in tables:
            lines.append(f"[[{section}]]" if isinstance(values, list) else f"[{section}]")
            lines += [f"{k} = {value(v)}" for k, v in table.items()]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
