"""TLS over memory buffers (sans-I/O): ciphertext in, plaintext out, and back.

How it works: an :class:`ssl.SSLObject` between two :class:`ssl.MemoryBIO`\\ s.
:meth:`TlsSession.receive` takes bytes from the socket and returns the
plaintext they complete (driving the handshake first); :meth:`TlsSession.send`
encrypts (plaintext sent before the handshake ends waits for it);
:meth:`TlsSession.data_to_send` is what goes to the socket. Failures raise
:class:`~transport.errors.TlsFailure` in the transport's terms
(:func:`explain`: which side refused what, and what to configure), not
OpenSSL's. No sockets, no event loop: :mod:`transport.tls_channel` is the
adapter.

A peer that speaks plain quicserve frames where TLS is expected (the first
byte is our wire version, not a TLS record type) is named as such.
"""

from __future__ import annotations

import re
import ssl
from typing import Protocol

from .errors import TlsFailure

__all__ = ["FIRST_READ", "TlsSession", "explain", "looks_like_frames"]

_READ = 1 << 15  # a TLS record holds at most 16 KiB of plaintext; one read returns at most one record
# The first read of a record asks for this much: CPython allocates the whole length asked for, then
# shrinks the bytes object to what was read; up to here (with the bytes header, 512 bytes) that is a
# small-object block, beyond it a malloc and realloc of 32 KiB per record. One engine step's frames at
# low load fit; a read that fills it goes on with _READ.
FIRST_READ = 464
_SSL_SUFFIX = re.compile(r"\s*\(_ssl\.c:\d+\)$")
_NOT_TLS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
            "UNKNOWN_PROTOCOL", "RECORD_TOO_LARGE"}
_REFUSED_OURS = {"TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
                 "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "TLSV1_ALERT_DECRYPT_ERROR", "SSLV3_ALERT_CERTIFICATE_EXPIRED",
                 "SSLV3_ALERT_CERTIFICATE_REVOKED", "TLSV1_ALERT_ACCESS_DENIED"}


def looks_like_frames(first: bytes | bytearray | memoryview) -> bool:
    """The first bytes a peer sent are quicserve frames (wire version 1), not a TLS record (0x14-0x17)."""
    return len(first) > 0 and first[0] == 1


def explain(exc: ssl.SSLError, side: str) -> str:
    """``exc`` as ``side`` ("worker" or "gateway") should log it: who refused what, what to configure."""
    peer = "gateway" if side == "worker" else "worker"
    reason = exc.reason or ""
    text = _SSL_SUFFIX.sub("", str(exc))
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or "unverifiable"
        if "purpose" in why:
            usage = "clientAuth" if peer == "gateway" else "serverAuth"
            return (f"the {peer}'s certificate is not a {peer}'s: its extendedKeyUsage does not allow {usage} "
                    f"({why})")
        return f"the {peer}'s certificate does not verify against this {side}'s transport_tls_ca ({why})"
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return (f"the {peer} presented no certificate: configure transport_tls_cert and transport_tls_key on the "
                f"{peer}, signed by this {side}'s transport_tls_ca")
    if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return (f"the {peer} requires a client certificate and this {side} presented none: configure "
                f"transport_tls_cert and transport_tls_key, signed by the {peer}'s transport_tls_ca")
    if reason in _REFUSED_OURS:
        return (f"the {peer} refused this {side}'s certificate ({text}): is it signed by the {peer}'s "
                f"transport_tls_ca, current, and for a {side} (extendedKeyUsage)?")
    if reason in _NOT_TLS:
        return f"the {peer} does not speak TLS ({text}): configure transport_tls_* on the {peer} too"
    if reason in ("TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL", "NO_PROTOCOLS_AVAILABLE"):
        return (f"no TLS version in common with the {peer} ({text}): gateways speak TLS 1.2 to workers, which "
                f"accept 1.2 and 1.3 (a worker of an earlier release accepts only 1.3: upgrade workers first)")
    if reason == "NO_SHARED_CIPHER":
        return (f"no cipher suite in common with the {peer} ({text}): the transport takes ECDHE with AES-GCM or "
                f"ChaCha20-Poly1305 alone")
    return f"TLS with the {peer} failed: {text}"


class _Read(Protocol):
    """``read`` of the C object under ``ssl.SSLObject`` (or of the SSLObject itself)."""

    def __call__(self, len: int = ..., /) -> bytes: ...


class _Write(Protocol):
    def __call__(self, data: bytes, /) -> int: ...


class _Feed(Protocol):
    def __call__(self, data: bytes | bytearray | memoryview, /) -> int: ...


class TlsSession:
    """One TLS connection end over memory BIOs (see the module docstring).

    The verified connection's hot paths take one record at a time: :meth:`decrypt` (at low load one
    engine step's frames in one record) and :meth:`encrypt` (one flush, one record). They call the C
    object under ``ssl.SSLObject`` (whose methods are Python wrappers around it) through the bound
    methods ``read`` and ``write``, read a small record into a small buffer (:data:`FIRST_READ`), and
    ask ``SSL_pending`` nothing. ``feed`` puts the peer's bytes into ``incoming``; ``outgoing`` is
    the BIO of bytes for the peer (its ``pending`` says whether there are any). A channel may run
    :meth:`decrypt`'s first lines itself (:class:`~transport.tls_channel.TlsChannel` does, one
    Python frame less per record) and hand anything else to :meth:`rest` and :meth:`read_failed`."""

    __slots__ = ("incoming", "outgoing", "_obj", "read", "write", "feed", "side", "handshake_done", "_pending",
                 "closed")

    def __init__(self, ctx: ssl.SSLContext, server_side: bool) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=server_side)
        # ssl.SSLObject's read and write only forward to its C object's: one Python frame less per record
        # where the stdlib has it (CPython 3.5 onwards), the SSLObject itself otherwise.
        io = getattr(self._obj, "_sslobj", self._obj)
        self.read: _Read = io.read
        self.write: _Write = io.write
        self.feed: _Feed = self.incoming.write
        self.side = "worker" if server_side else "gateway"
        self.handshake_done = False
        self._pending: list[bytes] = []  # plaintext sent before the handshake ended
        self.closed = False

    def start(self) -> None:
        """Begin the handshake (the client's hello goes to :meth:`data_to_send`)."""
        self._handshake()

    def peer_subject(self) -> str:
        """The peer certificate's subject, for logs ("CN=gateway-1")."""
        cert = self._obj.getpeercert()
        if not cert:
            return ""
        parts: list[str] = []
        for rdn in cert.get("subject", ()):
            for pair in rdn:
                if isinstance(pair, tuple) and len(pair) == 2:
                    parts.append(f"{'CN' if pair[0] == 'commonName' else pair[0]}={pair[1]}")
        return ",".join(parts)

    def version(self) -> str | None:
        """The TLS version in use ("TLSv1.2"), None before the handshake."""
        return self._obj.version()

    def suite(self) -> str:
        """The cipher suite in use ("ECDHE-ECDSA-AES256-GCM-SHA384"), "" before the handshake."""
        cipher = self._obj.cipher()
        return cipher[0] if cipher else ""

    def receive(self, data: bytes | bytearray | memoryview) -> tuple[bytes, bool]:
        """Ciphertext from the peer -> (the plaintext it completes, whether the handshake just ended).
        ``b""`` with ``closed`` set: the peer closed TLS (close_notify)."""
        self.feed(data)
        just = False
        if not self.handshake_done:
            if not self._handshake():
                return b"", False
            just = True
        return self._more(b""), just

    def decrypt(self, data: bytes | bytearray | memoryview) -> bytes:
        """After the handshake: ciphertext in, the plaintext it completes out (``receive``'s hot path)."""
        self.feed(data)
        try:
            first = self.read(FIRST_READ)
        except ssl.SSLError as exc:
            return self.read_failed(exc)
        if 0 < len(first) < FIRST_READ and not self.incoming.pending:
            return first  # the usual case: one whole record, all read, nothing after it
        return self.rest(first)

    def rest(self, first: bytes) -> bytes:
        """What follows a first read (:data:`FIRST_READ`) that filled its buffer, found more bytes behind
        it, or found the peer's close_notify (``b""``): the plaintext from ``first`` on."""
        if not first:  # a read gives b"" only once the peer's close_notify came
            self.closed = True
            return b""
        return self._more(first)

    def read_failed(self, exc: ssl.SSLError) -> bytes:
        """A read raised ``exc``: ``b""`` for a record not whole yet or the peer's close (``closed``
        set); any other error as :class:`~transport.errors.TlsFailure`."""
        if isinstance(exc, ssl.SSLWantReadError):
            return b""
        if isinstance(exc, ssl.SSLZeroReturnError):
            self.closed = True
            return b""
        raise TlsFailure(explain(exc, self.side)) from None

    def encrypt(self, data: bytes) -> bytes:
        """After the handshake: plaintext in, the ciphertext for the peer out (``send``'s hot path)."""
        try:
            self.write(data)
        except ssl.SSLError as exc:
            raise TlsFailure(explain(exc, self.side)) from None
        return self.outgoing.read()

    @property
    def wants_write(self) -> bool:
        """Bytes for the peer are waiting (an alert, a post-handshake message)."""
        return self.outgoing.pending > 0

    def send(self, data: bytes) -> None:
        """Plaintext for the peer (held until the handshake ends)."""
        if not self.handshake_done:
            self._pending.append(data)
            return
        try:
            self.write(data)
        except ssl.SSLError as exc:
            raise TlsFailure(explain(exc, self.side)) from None

    def data_to_send(self) -> bytes:
        return self.outgoing.read()

    def close(self) -> None:
        """Say close_notify (best effort)."""
        if self.handshake_done and not self.closed:
            self.closed = True
            try:
                self._obj.unwrap()
            except ssl.SSLError:
                pass

    def _handshake(self) -> bool:
        try:
            self._obj.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLError as exc:
            raise TlsFailure(explain(exc, self.side)) from None
        self.handshake_done = True
        pending, self._pending = self._pending, []
        for data in pending:
            self.send(data)
        return True

    def _more(self, first: bytes) -> bytes:
        """The rest of what ``first`` began: the rest of its record, and every whole record after it
        (one engine step's record each, when steps came faster than this side read them). Small reads
        first (:data:`FIRST_READ`); one that fills its buffer is followed by a large one for the rest of
        its record. No ``SSL_pending``: only a full small read can leave plaintext behind."""
        chunks = [first] if first else []
        read, incoming = self.read, self.incoming
        size = _READ if len(first) == FIRST_READ else FIRST_READ
        while size == _READ or incoming.pending:
            try:
                chunk = read(size)
            except ssl.SSLWantReadError:
                break  # the rest is a record not whole yet
            except ssl.SSLZeroReturnError:
                self.closed = True
                break
            except ssl.SSLError as exc:
                raise TlsFailure(explain(exc, self.side)) from None
            if not chunk:  # the peer's close_notify
                self.closed = True
                break
            chunks.append(chunk)
            size = _READ if len(chunk) == FIRST_READ == size else FIRST_READ
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
