"""Settings of the QUIC listener (HTTP/3): the ``[quic]`` section, one source of its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["QuicSettings", "DEFAULT_EARLY_DATA_ROUTES", "GENERATION_ROUTES", "early_data_safe", "alt_svc"]

# Requests that may run from 0-RTT data (only while replay_protection is on; otherwise every early
# request gets 425). "PATH/*" matches every path below PATH.
#
# The safe ones (RFC 8470 5.1: idempotent, no side effect), and generation. Generation is not
# idempotent -- a replayed flight would run (and bill) the completion again -- so it runs from early
# data only because no flight can be replayed into a second run: RFC 9001 9.2 leaves anti-replay
# to the server and names single-use tickets as a way (RFC 8446 8.1); ours are claimed once, in the
# one store of every process that can open them (gateway/http/quic_tickets.py: the process's own
# with one process, the directory the processes of a host share under [server] processes, their
# keys derived from one secret; a ticket issued elsewhere does not open here, whatever its key was:
# the client does a full handshake). So an early request runs at most once per flight the client
# sent: the guarantee of a 1-RTT request whose answer was lost (an attacker who drops the client's
# flight and replays it loses the client's own, and a client that retries then is retrying a
# request, as over TCP). What early data still lacks is the client's proof of address; bounded per
# connection by max_early_data and, as every request, by admission.
GENERATION_ROUTES = ("POST /v1/chat/completions", "POST /v1/completions")
DEFAULT_EARLY_DATA_ROUTES = ("GET /v1/models", "GET /v1/models/*", "GET /healthz", "GET /readyz", *GENERATION_ROUTES)


@dataclass(frozen=True, slots=True)
class QuicSettings:
    """HTTP/3 over QUIC on UDP (same host, certificate and, by default, port number as TLS)."""

    port: int = 8443  # UDP; 0 = any free port, -1 = off
    idle_timeout: float = 60.0  # seconds without a packet before a connection is dropped
    max_streams: int = 128  # concurrent request streams per connection (MAX_STREAMS)
    max_body_bytes: int = 1 << 20  # request body -> 413 beyond
    max_header_bytes: int = 16 << 10  # request header names + values -> 431 beyond
    body_timeout: float = 30.0  # seconds from a request's headers to its end -> 408
    max_stream_buffer: int = 64 << 10  # bytes a stream holds unacknowledged before send_nowait() says False
    retry: bool = False  # address validation with a Retry before any handshake work
    max_early_data: int = 16 << 10  # request bytes (headers + body) a connection may send in 0-RTT
    replay_protection: bool = True  # single-use 0-RTT tickets; off = every early request gets 425
    early_data_routes: list[str] = field(default_factory=lambda: list(DEFAULT_EARLY_DATA_ROUTES))
    ticket_lifetime: float = 7200.0  # seconds a session ticket resumes (and its single use is remembered)
    ticket_key_rotation: float = 3600.0  # seconds between ticket encryption keys
    max_tickets: int = 100_000  # tickets (and remembered uses) kept in memory; full = no resumption

    def _validate(self, p: list[str]) -> None:
        if not (-1 <= self.port <= 65535):
            p.append(f"quic.port: {self.port} is not a UDP port (0..65535, -1 = off)")
        for name in ("idle_timeout", "body_timeout", "ticket_lifetime", "ticket_key_rotation"):
            if getattr(self, name) <= 0:
                p.append(f"quic.{name}: must be > 0")
        for name in ("max_streams", "max_body_bytes", "max_header_bytes", "max_stream_buffer", "max_tickets"):
            if getattr(self, name) < 1:
                p.append(f"quic.{name}: must be >= 1")
        if self.max_early_data < 0:
            p.append("quic.max_early_data: must be >= 0 (0 = every early request gets 425)")
        for route in self.early_data_routes:
            method, _, path = route.partition(" ")
            if not method.isupper() or not path.startswith("/"):
                p.append(f"quic.early_data_routes: {route!r} is not 'METHOD /path' (or '/path/*')")


def early_data_safe(routes: list[str] | tuple[str, ...], method: str, path: str) -> bool:
    """Whether ``method path`` is listed as safe to run from 0-RTT data (HEAD counts as GET)."""
    if method == "HEAD":
        method = "GET"
    for route in routes:
        m, _, p = route.partition(" ")
        if m != method:
            continue
        if p == path or (p.endswith("/*") and path.startswith(p[:-1]) and len(path) > len(p) - 1):
            return True
    return False


def alt_svc(port: int, max_age: int = 86400) -> tuple[bytes, bytes]:
    """The ``alt-svc`` header HTTP/1.1 and HTTP/2 TLS responses carry so browsers move to h3 on
    ``port`` (RFC 7838; same host). ``max_age`` is how long a client may remember it."""
    return b"alt-svc", b'h3=":%d"; ma=%d' % (port, max_age)
