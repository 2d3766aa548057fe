"""The single-use store and the session-ticket store, sans I/O: the clock is an argument."""

from __future__ import annotations

import datetime
import os

from aioquic.tls import CipherSuite, SessionTicket
from hypothesis import given
from hypothesis import strategies as st

from gateway.http.quic_settings import DEFAULT_EARLY_DATA_ROUTES, QuicSettings, alt_svc, early_data_safe
from gateway.http.quic_tickets import TicketStore
from gateway.http.replay import SingleUseStore


def test_a_key_is_claimed_once_until_it_expires() -> None:
    s = SingleUseStore(capacity=4)
    assert s.claim(b"a", expires_at=10.0, now=0.0)
    assert not s.claim(b"a", expires_at=10.0, now=9.9)
    assert s.claim(b"a", expires_at=20.0, now=10.0)  # forgotten once it could no longer be presented


def test_a_full_store_refuses_rather_than_forgets() -> None:
    s = SingleUseStore(capacity=2)
    assert s.claim(b"a", 10.0, 0.0) and s.claim(b"b", 10.0, 0.0)
    assert not s.claim(b"c", 10.0, 1.0)  # evicting "a" would let it be replayed
    assert not s.claim(b"a", 10.0, 1.0) and s.refused == 1
    assert s.claim(b"c", 20.0, 10.0) and len(s) == 1  # room again once the others expired


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=2), st.floats(0, 100)), max_size=60))
def test_claims_never_succeed_twice_while_live_and_memory_is_bounded(ops: list[tuple[bytes, float]]) -> None:
    s = SingleUseStore(capacity=8)
    live: dict[bytes, float] = {}
    now = 0.0
    for key, dt in sorted(ops, key=lambda o: o[1]):
        now = dt
        ok = s.claim(key, now + 5.0, now)
        if key in live and live[key] > now:
            assert not ok
        if ok:
            live[key] = now + 5.0
        assert len(s) <= 8


def _ticket(identity: bytes) -> SessionTicket:
    now = datetime.datetime.now(datetime.UTC)
    return SessionTicket(age_add=7, cipher_suite=CipherSuite.AES_128_GCM_SHA256, not_valid_after=now
                         + datetime.timedelta(days=1), not_valid_before=now, resumption_secret=os.urandom(32),
                         server_name="localhost", ticket=identity, max_early_data_size=0xFFFFFFFF,
                         other_extensions=[(0x39, b"params")])


def test_ticket_round_trip_and_single_use() -> None:
    store = TicketStore(lifetime=100.0, rotation=10.0, capacity=10, single_use=True)
    t = _ticket(b"x" * 64)
    store.issue(t, now=0.0)
    assert all(t.ticket not in blob for _, blob in store._blobs.values())  # sealed, not stored in clear
    back = store.take(t.ticket, now=1.0)
    assert back is not None
    assert (back.resumption_secret, back.cipher_suite, back.age_add, back.other_extensions) == (
        t.resumption_secret, t.cipher_suite, t.age_add, t.other_extensions)
    assert store.take(t.ticket, now=2.0) is None  # one use


def test_reusable_tickets_without_replay_protection_until_lifetime() -> None:
    store = TicketStore(lifetime=100.0, rotation=10.0, capacity=10, single_use=False)
    t = _ticket(b"y" * 64)
    store.issue(t, now=0.0)
    assert store.take(t.ticket, 1.0) is not None and store.take(t.ticket, 2.0) is not None
    assert store.take(t.ticket, 100.0) is None


def test_keys_rotate_and_old_keys_are_dropped() -> None:
    store = TicketStore(lifetime=30.0, rotation=10.0, capacity=10, single_use=False)
    old, new = _ticket(b"o" * 64), _ticket(b"n" * 64)
    store.issue(old, now=0.0)
    store.issue(new, now=15.0)  # sealed under the next key
    assert store._blobs[next(iter(store._blobs))][1][:4] != store._blobs[next(reversed(store._blobs))][1][:4]
    assert store.take(old.ticket, 20.0) is not None  # its key is kept while its tickets live
    store.take(new.ticket, 41.0)
    assert 1 not in store._keys  # created at 0, sealing until 10, tickets dead by 40


def test_a_tampered_or_unknown_ticket_resumes_nothing() -> None:
    store = TicketStore(lifetime=100.0, rotation=10.0, capacity=10, single_use=True)
    t = _ticket(b"t" * 64)
    store.issue(t, 0.0)
    (lookup, (exp, blob)), = store._blobs.items()
    store._blobs[lookup] = (exp, blob[:-1] + bytes([blob[-1] ^ 1]))
    assert store.take(t.ticket, 1.0) is None
    assert store.take(b"unknown", 1.0) is None and store.refused == 2


def test_alt_svc_and_early_data_routes() -> None:
    assert alt_svc(8443) == (b"alt-svc", b'h3=":8443"; ma=86400')
    routes = list(DEFAULT_EARLY_DATA_ROUTES)
    assert early_data_safe(routes, "GET", "/v1/models") and early_data_safe(routes, "HEAD", "/healthz")
    assert early_data_safe(routes, "GET", "/v1/models/tiny")
    assert not early_data_safe(routes, "GET", "/v1/models/")  # "/*" needs a name after the slash
    assert early_data_safe(routes, "POST", "/v1/chat/completions")  # generation: single-use tickets (#33)
    assert not early_data_safe(routes, "GET", "/metrics")
    assert not early_data_safe(routes, "POST", "/v1/models")
    problems: list[str] = []
    QuicSettings(early_data_routes=["post /x", "GET x"], port=70000, max_streams=0)._validate(problems)
    assert len(problems) == 4, problems
