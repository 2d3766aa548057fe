"""What the gateway processes share, two "processes" in one test: session tickets (keys from one
secret, one claim of a ticket across stores), the merged /metrics, and ``[server] processes``."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
from aioquic.tls import CipherSuite, SessionTicket

from gateway.http.quic_tickets import TicketStore
from gateway.http.ticket_dir import SharedTickets
from gateway.multiproc.metrics_merge import merge_expositions
from gateway.server_config import ServerSettings
from gateway.settings import SettingsError, load_settings

NOW = 1_800_000_000.0


def _ticket() -> SessionTicket:
    t = datetime.datetime.fromtimestamp(NOW, datetime.UTC)
    return SessionTicket(age_add=1, cipher_suite=CipherSuite.AES_128_GCM_SHA256, not_valid_after=t,
                         not_valid_before=t, resumption_secret=os.urandom(32), server_name="x",
                         ticket=os.urandom(64), max_early_data_size=0xFFFFFFFF)


def _stores(tmp_path: Path, n: int, *, single_use: bool = True, capacity: int = 100) -> list[TicketStore]:
    secret = b"s" * 32
    return [TicketStore(lifetime=7200, rotation=3600, capacity=capacity, single_use=single_use,
                        shared=SharedTickets(secret, str(tmp_path / "tickets"))) for _ in range(n)]


def test_a_ticket_issued_by_one_process_resumes_once_at_any(tmp_path: Path) -> None:
    a, b, c = _stores(tmp_path, 3)
    t = _ticket()
    a.issue(t, NOW)
    got = b.take(t.ticket, NOW + 1)
    assert got is not None and got.resumption_secret == t.resumption_secret
    assert c.take(t.ticket, NOW + 2) is None and b.take(t.ticket, NOW + 2) is None  # claimed: a replay
    assert (b.resumed, b.refused, c.refused) == (1, 1, 1)


def test_keys_rotate_alike_and_expire_with_their_tickets(tmp_path: Path) -> None:
    a, b = _stores(tmp_path, 2, single_use=False)
    t = _ticket()
    a.issue(t, NOW)
    assert b.take(t.ticket, NOW + 3600 * 1.5) is not None  # a later period's process still opens it
    assert b.take(t.ticket, NOW + 7200 + 1) is None  # past its lifetime


def test_another_secret_opens_nothing(tmp_path: Path) -> None:
    a = _stores(tmp_path, 1)[0]
    other = TicketStore(lifetime=7200, rotation=3600, capacity=100, single_use=True,
                        shared=SharedTickets(b"o" * 32, str(tmp_path / "tickets")))
    t = _ticket()
    a.issue(t, NOW)
    assert other.take(t.ticket, NOW + 1) is None


def test_a_full_directory_keeps_no_more(tmp_path: Path) -> None:
    a, b = _stores(tmp_path, 2, capacity=3)
    tickets = [_ticket() for _ in range(5)]
    for t in tickets:
        a.issue(t, NOW)
    assert [b.take(t.ticket, NOW + 1) is not None for t in tickets] == [True] * 3 + [False] * 2


def test_merged_metrics_add_shares_and_take_shared_facts_once() -> None:
    one = (b'# TYPE quicserve_requests_total counter\nquicserve_requests_total{route="/x"} 3.0\n'
           b"# TYPE quicserve_requests_in_flight gauge\nquicserve_requests_in_flight 1.0\n"
           b'# TYPE quicserve_worker_steps_total counter\nquicserve_worker_steps_total{worker="w"} 100.0\n'
           b'# TYPE quicserve_worker_in_flight gauge\nquicserve_worker_in_flight{worker="w"} 2.0\n')
    two = one.replace(b"} 3.0", b"} 4.0").replace(b"steps_total{worker=\"w\"} 100.0", b"steps_total{worker=\"w\"} 104.0")
    text = merge_expositions([one, two]).decode()
    assert 'quicserve_requests_total{route="/x"} 7.0' in text
    assert "quicserve_requests_in_flight 2.0" in text
    assert 'quicserve_worker_steps_total{worker="w"} 100.0' in text  # the worker's own: once, the first's
    assert 'quicserve_worker_in_flight{worker="w"} 4.0' in text  # each process's requests on it: added


@pytest.mark.parametrize(("value", "count"), [(1, 1), (4, 4), ("auto", len(os.sched_getaffinity(0)))])
def test_processes_setting(value: int | str, count: int, tmp_path: Path) -> None:
    assert ServerSettings(processes=value).process_count() == count
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\nprocesses = {value!r}\n".replace("'", '"'))
    assert load_settings(str(cfg)).server.processes == value


@pytest.mark.parametrize("bad", ["0", '"many"', "true", "1.5"])
def test_processes_setting_refused(bad: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\nprocesses = {bad}\n")
    with pytest.raises(SettingsError, match="server.processes"):
        load_settings(str(cfg))


def test_key_slots_cap_across_processes_and_forget_a_dead_ones(tmp_path: Path) -> None:
    from gateway.multiproc.key_slots import KeySlots

    path = str(tmp_path / "slots")
    a, b = KeySlots(path, 0, 2, slots=64), KeySlots(path, 1, 2, slots=64)
    assert a.acquire("k", 2) and b.acquire("k", 2)
    assert a.acquire("k", 2) is False and b.acquire("k", 2) is False  # 2 held, whichever process asks
    assert a.acquire("other", 1) and a.held("k") == 2
    b.release("k")
    assert a.acquire("k", 2) and a.held("k") == 2
    KeySlots(path, 0, 2, slots=64)  # process 0 died and was started again: its places went with it
    assert b.held("k") == 0 and b.held("other") == 0
    assert b.acquire("k", 1)


def test_key_slots_full_window_refuses_rather_than_evicts(tmp_path: Path) -> None:
    from gateway.multiproc.key_slots import WINDOW, KeySlots

    s = KeySlots(str(tmp_path / "slots"), 0, 1, slots=WINDOW)  # one window: every key shares it
    assert all(s.acquire(f"k{i}", 1) for i in range(WINDOW))
    assert s.acquire("one more", 1) is None
    s.release("k0")
    assert s.acquire("one more", 1) is True
