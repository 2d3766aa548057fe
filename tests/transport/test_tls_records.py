"""The TLS core's record reads: one engine step's record at a time (the hot path), many records in one
chunk (steps that came faster than the gateway read them), records around the small first read's size
(``tls.FIRST_READ``: a read that fills it goes on for the rest of its record), in any split of the bytes."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.certs import Leaf, TestCA
from transport.security import TlsContexts, TransportSecurity
from transport.tls import FIRST_READ as _FIRST
from transport.tls import TlsSession


@pytest.fixture(scope="module")
def leaf(tmp_path_factory: pytest.TempPathFactory) -> Leaf:
    return TestCA(tmp_path_factory.mktemp("pki")).issue("both", "both")


def _pair(leaf: Leaf) -> tuple[TlsSession, TlsSession]:
    sec = TransportSecurity(leaf.cert, leaf.key, leaf.ca)
    gateway = TlsSession(TlsContexts(sec, server_side=False).get(), server_side=False)
    worker = TlsSession(TlsContexts(sec, server_side=True).get(), server_side=True)
    gateway.start()
    while not (gateway.handshake_done and worker.handshake_done):
        worker.receive(gateway.data_to_send())
        gateway.receive(worker.data_to_send())
    return gateway, worker


_SIZES = st.one_of(st.integers(1, 80), st.integers(_FIRST - 2, _FIRST + 2), st.integers(1, 20000))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(_SIZES, min_size=1, max_size=12), cuts=st.lists(st.integers(1, 700), min_size=1, max_size=20))
def test_records_in_any_split_give_the_plaintext_in_order(leaf: Leaf, sizes: list[int], cuts: list[int]) -> None:
    gateway, worker = _pair(leaf)
    messages = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    wire = b"".join(worker.encrypt(m) for m in messages)  # one record per flush (two beyond 16 KiB)
    got, i, pos = bytearray(), 0, 0
    while pos < len(wire):
        n = cuts[i % len(cuts)]
        i += 1
        got += gateway.decrypt(wire[pos : pos + n])
        pos += n
    assert bytes(got) == b"".join(messages)
    assert not gateway.closed


def test_one_record_per_read_and_many_in_one_chunk(leaf: Leaf) -> None:
    gateway, worker = _pair(leaf)
    step = b"\x01" * 40  # about one engine step's Tokens frame at c=1
    assert all(gateway.decrypt(worker.encrypt(step)) == step for _ in range(50))
    burst = b"".join(worker.encrypt(bytes([k]) * 30) for k in range(16))
    assert gateway.decrypt(burst) == b"".join(bytes([k]) * 30 for k in range(16))
    exact = b"\x07" * _FIRST  # fills the first read exactly: the next read finds the record done
    assert gateway.decrypt(worker.encrypt(exact)) == exact
    assert gateway.decrypt(worker.encrypt(step)) == step


def test_close_notify_after_data_in_one_chunk(leaf: Leaf) -> None:
    gateway, worker = _pair(leaf)
    data = worker.encrypt(b"last words")
    worker.close()
    assert gateway.decrypt(data + worker.data_to_send()) == b"last words"
    assert gateway.decrypt(b"") == b"" and gateway.closed  # OpenSSL took the alert with the data


def test_close_notify_alone(leaf: Leaf) -> None:
    gateway, worker = _pair(leaf)
    worker.close()
    assert gateway.decrypt(worker.data_to_send()) == b"" and gateway.closed


def test_a_tampered_record_fails(leaf: Leaf, tmp_path: Path) -> None:
    from transport.errors import TlsFailure

    gateway, worker = _pair(leaf)
    record = bytearray(worker.encrypt(b"x" * 60))
    record[-1] ^= 1
    with pytest.raises(TlsFailure, match="TLS with the worker failed"):
        gateway.decrypt(bytes(record))


def test_the_transport_speaks_tls_1_2_with_ecdhe_and_aead_only(leaf: Leaf) -> None:
    gateway, worker = _pair(leaf)
    assert gateway.version() == worker.version() == "TLSv1.2"
    name, _, bits = gateway._obj.cipher() or ("", "", 0)
    assert name == "ECDHE-ECDSA-AES256-GCM-SHA384" and bits == 256
    offered = [c["name"] for c in TlsContexts(TransportSecurity(leaf.cert, leaf.key, leaf.ca), False).get().get_ciphers()]
    tls12 = [n for n in offered if not n.startswith("TLS_")]  # TLS 1.3's suites are all AEAD with (EC)DHE
    assert tls12 and all(n.startswith("ECDHE-") and ("GCM" in n or "CHACHA20" in n) for n in tls12)


def _context(leaf: Leaf, server_side: bool, version: ssl.TLSVersion, ciphers: str = "") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ctx.maximum_version = version
    if ciphers:
        ctx.set_ciphers(ciphers)
    ctx.load_cert_chain(leaf.cert, leaf.key)
    ctx.load_verify_locations(cafile=leaf.ca)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _handshake(gateway: TlsSession, worker: TlsSession) -> None:
    gateway.start()
    for _ in range(10):
        if gateway.handshake_done and worker.handshake_done:
            return
        worker.receive(gateway.data_to_send())
        gateway.receive(worker.data_to_send())


def test_a_worker_takes_a_tls_1_3_gateway_of_an_earlier_release(leaf: Leaf) -> None:
    old = TlsSession(_context(leaf, False, ssl.TLSVersion.TLSv1_3), server_side=False)
    worker = TlsSession(TlsContexts(TransportSecurity(leaf.cert, leaf.key, leaf.ca), True).get(), server_side=True)
    _handshake(old, worker)
    assert worker.version() == "TLSv1.3"
    assert old.decrypt(worker.encrypt(b"hello")) == b"hello"


def _refusals(gateway: TlsSession, worker: TlsSession) -> tuple[str, str]:
    """What each side says of a handshake that fails (the worker's alert taken to the gateway)."""
    from transport.errors import TlsFailure

    said = {"gateway": "", "worker": ""}
    gateway.start()
    for _ in range(10):
        for side, session, data in (("worker", worker, gateway.data_to_send()),
                                    ("gateway", gateway, worker.data_to_send())):
            try:
                if data:
                    session.receive(data)
            except TlsFailure as exc:
                said[side] = said[side] or str(exc)
    return said["gateway"], said["worker"]


def test_a_gateway_refuses_what_is_not_tls_1_2_with_ecdhe_and_aead(leaf: Leaf) -> None:
    sec = TransportSecurity(leaf.cert, leaf.key, leaf.ca)
    old_worker = TlsSession(_context(leaf, True, ssl.TLSVersion.TLSv1_3), server_side=True)
    gw, wk = _refusals(TlsSession(TlsContexts(sec, False).get(), server_side=False), old_worker)
    assert gw.startswith("no TLS version in common with the worker") and "upgrade workers first" in gw
    assert wk.startswith("no TLS version in common with the gateway")
    cbc_worker = TlsSession(_context(leaf, True, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-SHA256"), server_side=True)
    gw, wk = _refusals(TlsSession(TlsContexts(sec, False).get(), server_side=False), cbc_worker)
    assert gw.startswith("TLS with the worker failed") and wk.startswith("no cipher suite in common with the gateway")
    cbc_gateway = TlsSession(_context(leaf, False, ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-SHA256"),
                             server_side=False)
    gw, wk = _refusals(cbc_gateway, TlsSession(TlsContexts(sec, True).get(), server_side=True))
    assert gw.startswith("TLS with the worker failed") and wk.startswith("no cipher suite in common with the gateway")
