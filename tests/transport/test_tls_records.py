"""The TLS core's record reads: one engine step's record at a time (the hot path), many records in one
chunk (steps that came faster than the gateway read them), records around the small first read's size
(``tls._FIRST``: a read that fills it goes on for the rest of its record), in any split of the bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.certs import Leaf, TestCA
from transport.security import TlsContexts, TransportSecurity
from transport.tls import _FIRST, TlsSession


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
