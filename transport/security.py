"""Who may talk to whom over the transport: mutual TLS, a pre-shared key, default deny.

How it works
------------
:class:`TransportSecurity` is what one side is configured with (the worker options and
``[workers]`` keys ``transport_tls_cert``, ``transport_tls_key``, ``transport_tls_ca``,
``transport_psk_file``, ``insecure``). Both sides read the same keys:

* **Mutual TLS** (all three TLS files): the worker serves only peers whose certificate
  chains to ``transport_tls_ca``, and the gateway talks only to workers whose certificate
  does. The CA should be the transport's own (it is the trust domain: any certificate it
  signed is accepted; names are not checked, as workers are reached by pod address). Give
  gateways certificates with extendedKeyUsage clientAuth and workers serverAuth: OpenSSL
  then refuses a worker's certificate where a gateway's is expected and the other way
  round (a gateway's local workers read the same ``[workers]`` files: give that one
  certificate both usages, or leave loopback workers without TLS). The files are read again for the
  next connection when any of them changes (rotation without a restart); a set that does not load
  keeps the last good one.

  **TLS 1.2, on purpose** (the gateway offers only 1.2; a worker accepts 1.2 and 1.3, so a gateway
  of an earlier, 1.3-only release still connects: upgrade workers first). Every engine step at low
  load is one TLS record the gateway decrypts, and OpenSSL 3.0 opens a TLS 1.3 record for about
  1.3k instructions more than a 1.2 one (the per-record nonce through the provider's parameters,
  the inner content type; tests/bench/tls_record_cost.py), which is what kept a 16-token stream's
  gateway CPU over 1.1x plain TCP (tests/bench/bench_transport_tls.py). What the transport needs of
  TLS stays: both ends authenticated by certificate (``CERT_REQUIRED`` both ways), forward secrecy
  (ECDHE only: :data:`TLS12_CIPHERS`), AEAD ciphers only (AES-GCM, ChaCha20-Poly1305: no CBC, no
  RC4, no static RSA key exchange, no anonymous suites), the handshake bound to its session
  (extended master secret, RFC 7627, which OpenSSL negotiates by default between two OpenSSLs),
  no renegotiation (``OP_NO_RENEGOTIATION``), no compression, no session tickets (nothing resumes;
  no ticket key to steal). What 1.2 gives up is of no use here: 1.3's encrypted certificates (both
  ends are ours, and their certificates name nothing secret), 0-RTT (never used), and its shorter
  handshake (once per connection, and connections live long).
* **Pre-shared key** (``transport_psk_file``): an HMAC challenge in the HELLO exchange
  (:mod:`transport.psk`): authentication without certificates, no encryption. Re-read for
  the next connection when the file changes. Both may be set: TLS, then the key.
* **Unix sockets** carry neither by default: whoever may open the socket file may connect,
  so its directory's permissions are the access control.
* **Default deny**: TCP or RDMA beyond loopback with neither is refused
  (:meth:`TransportSecurity.refusal`) unless ``insecure`` is set, like Redis's protected
  mode; the message says what to configure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

from .errors import SecurityConfigError
from .psk import read_key_file
from .select import Target

__all__ = ["TransportSecurity", "TlsContexts", "PskKeys", "is_loopback", "NO_SECURITY", "security_of"]

log = logging.getLogger("transport.security")

_TLS_KEYS = ("transport_tls_cert", "transport_tls_key", "transport_tls_ca")
# TLS 1.2's suites (module docstring): ephemeral ECDH (forward secrecy), an AEAD cipher, a certificate's
# signature; nothing else is offered or accepted. AES-256-GCM first, as TLS 1.3's default list has it.
TLS12_CIPHERS = ":".join(f"ECDHE-{auth}-{cipher}" for cipher in ("AES256-GCM-SHA384", "AES128-GCM-SHA256",
                                                                 "CHACHA20-POLY1305") for auth in ("ECDSA", "RSA"))
HOW_TO = ("set transport_tls_cert, transport_tls_key and transport_tls_ca (mutual TLS) or transport_psk_file "
          "(a pre-shared key) on the gateway and the worker alike -- `quicserve worker` flags --transport-tls-cert, "
          "--transport-tls-key, --transport-tls-ca, --transport-psk-file; [workers] keys of the same names -- or "
          "--insecure / [workers] insecure = true to accept that anyone who reaches the port can submit")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address; a name is not resolved (another name is not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class TransportSecurity:
    """One side's transport security settings (see the module docstring)."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    psk_file: str = ""
    insecure: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key and self.tls_ca)

    @property
    def psk(self) -> bool:
        return bool(self.psk_file)

    @property
    def mode(self) -> str:
        """For logs: "mutual TLS", "pre-shared key", both, or "none"."""
        return " + ".join(m for m, on in (("mutual TLS", self.tls), ("pre-shared key", self.psk)) if on) or "none"

    def problems(self, url: str) -> list[tuple[str, str]]:
        """(option key, what is wrong) for these settings on ``url``; empty if they can run there."""
        p: list[tuple[str, str]] = []
        tls_set = [k for k, v in zip(_TLS_KEYS, (self.tls_cert, self.tls_key, self.tls_ca), strict=True) if v]
        if tls_set and len(tls_set) < 3:
            missing = [k for k in _TLS_KEYS if k not in tls_set]
            p.append((missing[0], f"mutual TLS needs all of {', '.join(_TLS_KEYS)}; {', '.join(missing)} not set"))
        if self.tls and url.startswith("rdma://"):
            p.append(("transport_tls_cert", "TLS does not run over rdma://; authenticate RDMA with "
                                            "transport_psk_file"))
        return p

    def refusal(self, target: Target, side: str) -> str | None:
        """Why ``side`` ("worker": listening, "gateway": connecting) must not use ``target`` with these
        settings (default deny), or None."""
        if self.tls or self.psk or self.insecure or target.scheme == "unix" or is_loopback(target.host):
            return None
        where = (f"listen on {target.scheme}://{target.host}:{target.port}" if side == "worker"
                 else f"connect to the worker at {target.scheme}://{target.host}:{target.port}")
        return (f"refusing to {where} without transport authentication: that address is reachable beyond this "
                f"host. To authenticate, {HOW_TO}")


NO_SECURITY = TransportSecurity()


def security_of(options: Any) -> TransportSecurity:
    """The security settings among worker options (a :class:`~transport.common.worker_options.WorkerOptions`,
    ``[workers]`` settings, or the worker's parsed flags)."""
    return TransportSecurity(options.transport_tls_cert, options.transport_tls_key, options.transport_tls_ca,
                             options.transport_psk_file, bool(options.insecure))


def _stamp(paths: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((0, 0, 0))
    return tuple(out)


class _Reloading:
    """A value built from files, built again when one of them changes (checked on every :meth:`get`:
    a few stats per new connection); a rebuild that fails keeps the last good value."""

    def __init__(self, paths: tuple[str, ...], what: str) -> None:
        self._paths = paths
        self._what = what
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._value: Any = None

    def _build(self) -> Any:
        raise NotImplementedError

    def get(self) -> Any:
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return self._value
        try:
            value = self._build()
        except (OSError, ValueError, ssl.SSLError) as exc:
            if self._value is None:
                raise SecurityConfigError(f"cannot load the {self._what}: {exc}") from None
            log.error("the %s changed and does not load (%s); keeping the previous one", self._what, exc)
            self._stamp = stamp  # say it once per change
            return self._value
        if self._stamp is not None:
            log.info("reloaded the %s (%s)", self._what, ", ".join(self._paths))
        self._stamp, self._value = stamp, value
        return value


class TlsContexts(_Reloading):
    """The TLS context for one side (``server_side``: the worker), reloaded when its files change."""

    def __init__(self, sec: TransportSecurity, server_side: bool) -> None:
        super().__init__((sec.tls_cert, sec.tls_key, sec.tls_ca), "transport TLS certificate, key or CA")
        self._sec = sec
        self.server_side = server_side

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if self.server_side else ssl.PROTOCOL_TLS_CLIENT)
        # TLS 1.2 with ECDHE and AEAD alone; a worker takes 1.3 as well (module docstring: why 1.2)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if not self.server_side:
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(TLS12_CIPHERS)
        ctx.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_TICKET | ssl.OP_NO_COMPRESSION
        ctx.load_cert_chain(self._sec.tls_cert, self._sec.tls_key)
        ctx.load_verify_locations(cafile=self._sec.tls_ca)
        ctx.check_hostname = False  # the CA is the trust domain (module docstring)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def get(self) -> ssl.SSLContext:
        ctx: ssl.SSLContext = super().get()
        return ctx


class PskKeys(_Reloading):
    """The pre-shared key, reloaded when its file changes."""

    def __init__(self, path: str) -> None:
        super().__init__((path,), "transport pre-shared key")

    def _build(self) -> bytes:
        return read_key_file(self._paths[0])

    def get(self) -> bytes:
        key: bytes = super().get()
        return key
