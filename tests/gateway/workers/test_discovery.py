"""DNS discovery of remote workers: the core's diffs, and the adapter driven by a stub resolver and fake clock."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.workers.discovery import (
    DiscoverySettings,
    DnsWatch,
    NameNotFound,
    getaddrinfo_resolver,
    parse_worker_dns,
    watch_workers,
    worker_url,
)

SPEC = "quicserve-worker.quicserve.svc.cluster.local:7000"


def test_parse_and_urls() -> None:
    assert parse_worker_dns(SPEC) == ("quicserve-worker.quicserve.svc.cluster.local", 7000)
    for bad in ("quicserve-worker", ":7000", "w:0", "w:70000", "w:http"):
        with pytest.raises(ValueError):
            parse_worker_dns(bad)
    assert worker_url("10.1.2.3", 7000) == "tcp://10.1.2.3:7000"
    assert worker_url("fd00::5", 7000) == "tcp://[fd00::5]:7000"
    problems: list[str] = []
    DiscoverySettings(worker_dns=["w"], interval=0)._validate(problems)
    assert len(problems) == 2


def test_watch_diffs_and_keeps_workers_through_a_transient_failure() -> None:
    w = DnsWatch("w:7000", interval=5.0)
    c = w.resolved(["10.0.0.2", "10.0.0.1"], now=0.0)
    assert c.added == ("tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000") and c.removed == ()
    assert w.next_at == 5.0
    c = w.failed(now=5.0)  # SERVFAIL, timeout: the pool keeps both
    assert c.added == c.removed == () and len(w.urls) == 2 and w.next_at == 10.0
    c = w.resolved(["10.0.0.2", "10.0.0.3"], now=10.0)  # a pod replaced
    assert c.added == ("tcp://10.0.0.3:7000",) and c.removed == ("tcp://10.0.0.1:7000",)
    assert w.resolved(["10.0.0.3", "10.0.0.2"], now=15.0).added == ()  # order does not matter
    c = w.not_found(now=20.0)  # no ready pod at all
    assert c.removed == ("tcp://10.0.0.2:7000", "tcp://10.0.0.3:7000") and not w.urls


async def test_watch_workers_with_a_stub_resolver_and_fake_clock() -> None:
    """Scripted answers, one per resolution; the fake sleep advances the clock and ends the run."""
    answers: list[list[str] | Exception] = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], OSError("SERVFAIL"),
                                            NameNotFound("w"), ["10.0.0.2"]]
    clock = [100.0]
    asked: list[tuple[str, int, float]] = []
    events: list[tuple[str, str, float]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port, clock[0]))
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    async def sleep(s: float) -> None:
        assert s == 3.0  # the resolver answered at once: a whole interval till the next
        if not answers:
            raise asyncio.CancelledError
        clock[0] += s

    with pytest.raises(asyncio.CancelledError):
        await watch_workers("w:7000", lambda u: events.append(("+", u, clock[0])),
                            lambda u: events.append(("-", u, clock[0])),
                            interval=3.0, resolver=resolver, clock=lambda: clock[0], sleep=sleep)
    assert [t for _, _, t in asked] == [100.0, 103.0, 106.0, 109.0, 112.0]
    assert events == [("+", "tcp://10.0.0.1:7000", 100.0), ("+", "tcp://10.0.0.2:7000", 103.0),
                      ("-", "tcp://10.0.0.1:7000", 109.0), ("-", "tcp://10.0.0.2:7000", 109.0),
                      ("+", "tcp://10.0.0.2:7000", 112.0)]


async def test_system_resolver_answers_and_says_not_found() -> None:
    assert await getaddrinfo_resolver("127.0.0.1", 7000) == ["127.0.0.1"]
    with pytest.raises((NameNotFound, socket.gaierror)):  # NXDOMAIN, or EAI_AGAIN where no DNS server answers
        await getaddrinfo_resolver("no-such-worker.invalid", 7000)
