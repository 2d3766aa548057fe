"""Gateway settings: TOML file + ``QUICSERVE_SECTION__KEY`` env vars + CLI flags.

How it works: the defaults live in the dataclasses below (and are documented,
one for one, in ``config/default.toml``). :func:`load_settings` starts from an
empty mapping, merges the TOML file, then environment overrides, then CLI
overrides (later wins), checks every key against the dataclass fields
(unknown key or wrong type -> :class:`SettingsError` listing *all* problems),
and builds frozen dataclasses. :func:`check_file` returns the problems
without raising, for ``quicserve config check``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transport.logfmt import FORMATS as LOG_FORMATS
from transport.worker_options import URL_SCHEMES, WorkerOptions, option_problems

from .admission.config import AdmissionSettings
from .discovery import DiscoverySettings
from .http.quic_settings import QuicSettings
from .observability.tracing import TraceSettings
from .routing.config import RoutingSettings

__all__ = [
    "Settings",
    "ServerSettings",
    "LimitsSettings",
    "WorkersSettings",
    "ApiSettings",
    "ShutdownSettings",
    "GrpcSettings",
    "LogSettings",
    "SettingsError",
    "load_settings",
    "check_file",
    "check_mapping",
    "assignments",
]

ENV_PREFIX = "QUICSERVE_"
# Keys that were dropped, with what replaces them (a plain "unknown key" would leave the reader guessing).
_REMOVED = {
    "workers.extra_args": "workers.extra_args: removed; worker options are typed keys of [workers] now "
                          "(e.g. max_batch = 64, kv_cache_dtype = \"int8\"; see config/default.toml)",
}


class SettingsError(ValueError):
    """Invalid configuration; ``problems`` lists every one found."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080  # cleartext HTTP/1.1 + h2c; 0 = any free port
    tls_port: int = 8443  # TLS with ALPN h2/http1.1; -1 disables TLS
    tls_cert: str = ""  # PEM file; empty = self-signed cert in state_dir
    tls_key: str = ""
    state_dir: str = "~/.local/state/quicserve"
    uvloop: bool = True
    unix_socket: str = ""  # also serve HTTP/1.1 + h2c on this Unix socket path ("" = none)
    reuse_port: bool = False  # SO_REUSEPORT: several gateway processes on one port (one per core)

    def _validate(self, p: list[str]) -> None:
        if not (0 <= self.port <= 65535):
            p.append(f"server.port: {self.port} is not a TCP port (0..65535)")
        if not (-1 <= self.tls_port <= 65535):
            p.append(f"server.tls_port: {self.tls_port} is not a TCP port (0..65535, -1 = off)")
        if bool(self.tls_cert) != bool(self.tls_key):
            p.append("server.tls_cert and server.tls_key must be given together")
        if not self.host:
            p.append("server.host: must not be empty")


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    h2_max_concurrent_streams: int = 256
    send_buffer_bytes: int = 0  # SO_SNDBUF per connection; 0 = the kernel's autotuning

    def _validate(self, p: list[str]) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0 and f.name != "send_buffer_bytes":
                p.append(f"limits.{f.name}: must be > 0")
        if self.send_buffer_bytes < 0:
            p.append("limits.send_buffer_bytes: must be >= 0")


@dataclass(frozen=True, slots=True)
class WorkersSettings(WorkerOptions):
    """How the gateway runs its workers, plus every ``quicserve worker`` option (inherited from
    :class:`~transport.worker_options.WorkerOptions`, which holds their defaults and checks)."""

    local: int = 1  # local worker processes started by `quicserve serve`
    remote: list[str] = field(default_factory=list)  # URLs of workers started elsewhere
    ready_timeout: float = 900.0
    connect_timeout: float = 10.0
    restart_backoff_initial: float = 0.5
    restart_backoff_max: float = 30.0
    stop_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    dead_after: float = 5.0

    def _validate(self, p: list[str]) -> None:
        p += [f"workers.{key}: {why}" for key, why in option_problems(self)]
        if self.local < 0:
            p.append("workers.local: must be >= 0")
        for u in self.remote:
            if not u.startswith(URL_SCHEMES):
                p.append(f"workers.remote: {u!r} is not a tcp://, unix:// or rdma:// URL")
        for name in ("ready_timeout", "connect_timeout", "restart_backoff_initial", "stop_timeout",
                     "heartbeat_interval", "dead_after"):
            if getattr(self, name) <= 0:
                p.append(f"workers.{name}: must be > 0")
        if self.restart_backoff_max < self.restart_backoff_initial:
            p.append("workers.restart_backoff_max: must be >= restart_backoff_initial")


@dataclass(frozen=True, slots=True)
class ApiSettings:
    default_max_tokens: int = 256  # when the request gives none
    max_tokens_limit: int = 4096  # larger requests get a 400
    request_timeout: float = 600.0  # whole request, seconds
    retries: int = 1  # resubmits on another worker if one dies before the first token
    write_timeout: float = 60.0  # a streaming client that reads nothing this long is cut off

    def _validate(self, p: list[str]) -> None:
        if self.default_max_tokens < 1:
            p.append("api.default_max_tokens: must be >= 1")
        if self.max_tokens_limit < self.default_max_tokens:
            p.append("api.max_tokens_limit: must be >= api.default_max_tokens")
        if self.request_timeout <= 0:
            p.append("api.request_timeout: must be > 0")
        if self.retries < 0:
            p.append("api.retries: must be >= 0")
        if self.write_timeout <= 0:
            p.append("api.write_timeout: must be > 0")


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    port: int = 50051  # native gRPC (h2c); -1 disables, 0 = any free port
    host: str = ""  # "" = server.host
    web: bool = True  # gRPC-Web on the HTTP listeners
    allowed_origins: list[str] = field(default_factory=list)  # gRPC-Web CORS; empty = any origin
    zstd_level: int = 3
    gzip_level: int = 6
    compress_min_bytes: int = 64  # smaller messages go uncompressed untried (a token's delta)
    max_message_bytes: int = 4 << 20

    def _validate(self, p: list[str]) -> None:
        if not (-1 <= self.port <= 65535):
            p.append(f"grpc.port: {self.port} is not a TCP port (0..65535, -1 = off)")
        if not (-7 <= self.zstd_level <= 22):
            p.append(f"grpc.zstd_level: {self.zstd_level} is not a zstd level (-7..22)")
        if not (0 <= self.gzip_level <= 9):
            p.append(f"grpc.gzip_level: {self.gzip_level} is not a gzip level (0..9)")
        if self.compress_min_bytes < 0:
            p.append("grpc.compress_min_bytes: must be >= 0")
        if self.max_message_bytes < 1024:
            p.append("grpc.max_message_bytes: must be >= 1024")


@dataclass(frozen=True, slots=True)
class ShutdownSettings:
    drain_timeout: float = 30.0  # SIGTERM: finish in-flight requests for up to this long
    sigint_drain_timeout: float = 3.0  # SIGINT: the same, faster
    grace_period: float = 5.0  # SIGTERM: keep listening this long, /readyz 503 and new work refused, first

    def _validate(self, p: list[str]) -> None:
        if self.drain_timeout < 0 or self.sigint_drain_timeout < 0 or self.grace_period < 0:
            p.append("shutdown: timeouts must be >= 0")


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "info"
    progress: str = "auto"  # "auto" (bar on a TTY, lines otherwise) | "bar" | "lines" | "off"
    format: str = "text"  # "text" | "json" (one object a line); workers get the same
    access_log: bool = False  # one line per finished request on the quicserve.access logger

    def _validate(self, p: list[str]) -> None:
        if self.format not in LOG_FORMATS:
            p.append(f"log.format: {self.format!r} is not one of {', '.join(LOG_FORMATS)}")
        if self.level.lower() not in ("debug", "info", "warning", "error", "critical"):
            p.append(f"log.level: {self.level!r} is not a log level")
        if self.progress not in ("auto", "bar", "lines", "off"):
            p.append(f"log.progress: {self.progress!r} is not one of auto, bar, lines, off")


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    workers: WorkersSettings = field(default_factory=WorkersSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    shutdown: ShutdownSettings = field(default_factory=ShutdownSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    quic: QuicSettings = field(default_factory=QuicSettings)
    tracing: TraceSettings = field(default_factory=TraceSettings)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    log: LogSettings = field(default_factory=LogSettings)


_SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Settings)[f.name] for f in dataclasses.fields(Settings)}


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin is list:
        return f"list of {typing.get_args(t)[0].__name__}"
    return getattr(t, "__name__", str(t))


def _coerce(value: Any, t: Any, where: str, p: list[str]) -> Any:
    """Check ``value`` against annotation ``t``; ints are accepted for floats."""
    origin = typing.get_origin(t)
    if origin is list:
        (item,) = typing.get_args(t)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            p.append(f"{where}: expected {_type_name(t)}, got {value!r}")
            return None
        return list(value)
    if isinstance(t, types.UnionType):
        raise TypeError("unions are not used in settings")
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is int and isinstance(value, bool) or not isinstance(value, t):
        p.append(f"{where}: expected {_type_name(t)}, got {type(value).__name__} {value!r}")
        return None
    return value


def _parse_env_value(raw: str, t: Any) -> Any:
    """Env values are strings; read them as the field's type would be written in TOML."""
    if t is str:
        return raw
    if typing.get_origin(t) is list:
        raw = raw.strip()
        if raw.startswith("["):
            return tomllib.loads(f"v = {raw}")["v"]
        return [s for s in (x.strip() for x in raw.split(",")) if s]
    if t is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return raw
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _typed(section: str, key: str, raw: str, where: str, problems: list[str]) -> tuple[bool, Any]:
    """``raw`` read as the type of ``section.key``; (False, None) and a problem if there is no such key."""
    cls = _SECTIONS.get(section)
    hints = typing.get_type_hints(cls) if cls else {}
    if key not in hints:
        problems.append(f"{where}: unknown setting {section}.{key}")
        return False, None
    return True, _parse_env_value(raw, hints[key])


def env_overrides(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """``QUICSERVE_SERVER__PORT=9000`` -> ``{"server": {"port": 9000}}``."""
    out: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        known, value = _typed(section, key, raw, name, problems)
        if known:
            out.setdefault(section, {})[key] = value
    return out, problems


def assignments(section: str, items: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``["max_batch=64"]`` -> ``{"max_batch": 64}`` for ``section``, values read as its env vars are."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq:
            problems.append(f"{item!r}: expected KEY=VALUE, e.g. max_batch=64")
            continue
        known, value = _typed(section, key.strip(), raw, item, problems)
        if known:
            out[key.strip()] = value
    return out, problems


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win, key by key within each section."""
    out: dict[str, Any] = {}
    for layer in layers:
        for section, values in layer.items():
            if isinstance(values, Mapping) and isinstance(out.get(section), dict):
                out[section].update(values)
            elif isinstance(values, Mapping):
                out[section] = dict(values)
            else:
                out[section] = values
    return out


def check_mapping(data: Mapping[str, Any]) -> tuple[Settings | None, list[str]]:
    """Build Settings from a merged mapping; return (settings or None, problems)."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for section, values in data.items():
        cls = _SECTIONS.get(section)
        if cls is None:
            problems.append(f"unknown section [{section}] (known: {', '.join(_SECTIONS)})")
            continue
        if not isinstance(values, Mapping):
            problems.append(f"[{section}]: expected a table, got {values!r}")
            continue
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in hints:
                problems.append(_REMOVED.get(f"{section}.{key}")
                                or f"{section}.{key}: unknown key (known: {', '.join(hints)})")
                continue
            v = _coerce(value, hints[key], f"{section}.{key}", problems)
            if v is not None:
                kwargs[key] = v
        sections[section] = cls(**kwargs)
    if problems:
        return None, problems
    settings = Settings(**sections)
    for section in _SECTIONS:
        getattr(settings, section)._validate(problems)
    w = settings.workers
    if w.local == 0 and not w.remote and not settings.discovery.worker_dns:
        problems.append("workers: no local workers, no remote workers and no discovery.worker_dns: nothing would "
                        "serve requests")
    return (None, problems) if problems else (settings, [])


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise SettingsError([f"{path}: cannot read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError([f"{path}: not valid TOML: {e}"]) from None


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """File, then env, then ``overrides`` (CLI flags). Raises SettingsError."""
    file_data = read_toml(path) if path else {}
    env_data, problems = env_overrides(os.environ if environ is None else environ)
    settings, more = check_mapping(merge(file_data, env_data, overrides or {}))
    problems += more
    if problems or settings is None:
        raise SettingsError(problems)
    return settings


def check_file(path: str | os.PathLike[str]) -> list[str]:
    """Every problem with a config file (no env, no flags); empty if it is fine."""
    try:
        data = read_toml(path)
    except SettingsError as e:
        return e.problems
    return check_mapping(data)[1]


def state_dir(settings: Settings) -> Path:
    return Path(os.path.expanduser(settings.server.state_dir))
