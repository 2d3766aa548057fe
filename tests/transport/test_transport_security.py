"""Mutual TLS and the pre-shared key over real sockets (asyncio and uvloop), certificate reload,
the TLS core in memory, and default deny."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.certs import Leaf, TestCA, write_psk
from tests.transport.doubles import EchoWorker
from tests.transport.test_integration import LOOPS, run
from transport.api import WorkerConnection
from transport.client import connect
from transport.common.worker_options import WorkerOptions, option_problems
from transport.errors import ConnectError, SecurityConfigError, TransportError
from transport.messages import Finish, SamplingParams, Submit
from transport.security import TlsContexts, TransportSecurity, is_loopback
from transport.select import parse_url
from transport.server import serve
from transport.tls import TlsSession


class PKI:
    def __init__(self, root: Path) -> None:
        self.ca = TestCA(root / "ca")
        self.other = TestCA(root / "other", "another CA")
        self.gateway = self.ca.issue("gateway-1", "gateway")
        self.worker = self.ca.issue("worker-1", "worker")
        self.foreign_gateway = self.other.issue("gateway-x", "gateway")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


def tls(leaf: Leaf, ca: str | None = None) -> TransportSecurity:
    return TransportSecurity(leaf.cert, leaf.key, ca or leaf.ca)


async def one_request(conn: WorkerConnection) -> Finish:
    stream = conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=20), prompt="x"))
    got = await stream.collect()  # type: ignore[attr-defined]
    assert isinstance(got.final, Finish) and got.tokens == 20
    return got.final


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_mutual_tls_serves_a_verified_gateway(pki: PKI, kind: str, loop_kind: str, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "transport")

    async def body() -> None:
        url = f"unix://{tmp_path}/w.sock" if kind == "unix" else "tcp://127.0.0.1:0"
        srv = await serve(url, EchoWorker(), security=tls(pki.worker))
        conn = await connect(srv.address, security=tls(pki.gateway))
        assert conn.peer_hello.models == ("tiny",)
        await asyncio.gather(*(one_request(conn) for _ in range(5)))
        await conn.close()
        await srv.close()

    run(loop_kind, body)
    assert "TLS verified (CN=gateway-1)" in caplog.text
    assert "(transport authentication: mutual TLS)" in caplog.text


REFUSALS = {
    # name: (worker security, gateway security, the gateway's error, the worker's log line)
    "no certificate": ("worker", None, "this worker requires mutual TLS and the gateway connected in plain TCP",
                       "the gateway spoke plain TCP and this worker requires mutual TLS"),
    "another CA": ("worker", "foreign", "the worker refused this gateway's certificate",
                   "the gateway's certificate does not verify against this worker's transport_tls_ca"),
    "a worker's certificate": ("worker", "worker-as-gateway", "the worker refused this gateway's certificate",
                               "the gateway's certificate is not a gateway's: its extendedKeyUsage does not allow "
                               "clientAuth"),
    "an untrusted worker": ("foreign-worker", "gateway",
                            "the worker's certificate does not verify against this gateway's transport_tls_ca",
                            "the gateway refused this worker's certificate"),
    "a plain worker": (None, "gateway", "the worker speaks plain TCP and this gateway requires mutual TLS",
                       "the peer speaks TLS and this side does not"),
}


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_say_why_on_both_sides(pki: PKI, case: str, loop_kind: str, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    wk_kind, gw_kind, gw_says, wk_says = REFUSALS[case]
    caplog.set_level(logging.INFO, "transport")
    worker_sec = {"worker": tls(pki.worker), "foreign-worker": tls(pki.other.issue("worker-x", "worker"),
                                                                   str(pki.ca.ca_file)), None: None}[wk_kind]
    gateway_sec = {"gateway": tls(pki.gateway), "foreign": tls(pki.foreign_gateway, str(pki.ca.ca_file)),
                   "worker-as-gateway": tls(pki.worker), None: None}[gw_kind]

    async def body() -> None:
        handler = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", handler, security=worker_sec)
        with pytest.raises(TransportError) as err:
            await connect(srv.address, security=gateway_sec, timeout=5)
        assert gw_says in str(err.value), str(err.value)
        for _ in range(100):  # the worker's side of it, logged as it sees it
            if wk_says in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert not srv.connections and handler.active == {}
        await srv.close()

    run(loop_kind, body)
    assert wk_says in caplog.text, caplog.text


def test_a_tcp_probe_is_not_a_refusal(pki: PKI, caplog: pytest.LogCaptureFixture) -> None:
    """Kubernetes' tcpSocket probes connect and close every few seconds: no warning for them, one for a
    peer that starts a handshake and leaves."""
    caplog.set_level(logging.DEBUG, "transport")

    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", EchoWorker(), security=tls(pki.worker))
        host, port = srv.address.removeprefix("tcp://").rsplit(":", 1)
        for first in (b"", b"\x16\x03\x01"):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(first)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.05)
        await srv.close()

    run("uvloop", body)
    warnings = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the connection was lost during the TLS handshake" in warnings[0]
    assert "closed without a byte" in caplog.text


def test_certificates_and_keys_are_read_again_when_they_change(pki: PKI, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Rotation: the worker's files are replaced by another CA's set; the next gateway must hold the new
    CA's certificate, and a connection made before keeps serving. A set that does not load keeps the last."""
    live = tmp_path / "live"
    live.mkdir()
    files = TransportSecurity(str(live / "w.crt"), str(live / "w.key"), str(live / "ca.crt"))

    def install(leaf: Leaf) -> None:
        for src, dst in ((leaf.cert, files.tls_cert), (leaf.key, files.tls_key), (leaf.ca, files.tls_ca)):
            shutil.copyfile(src, dst)

    install(pki.worker)
    new_gateway = pki.other.issue("gateway-new", "gateway")
    new_worker = pki.other.issue("worker-new", "worker")

    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", EchoWorker(), security=files)
        before = await connect(srv.address, security=tls(pki.gateway))
        install(new_worker)
        with pytest.raises(ConnectError):
            await connect(srv.address, security=tls(pki.gateway, str(pki.other.ca_file)), timeout=5)
        after = await connect(srv.address, security=tls(new_gateway))
        await one_request(before)
        await one_request(after)
        Path(files.tls_cert).write_text("not a certificate")
        again = await connect(srv.address, security=tls(new_gateway))  # the last good set still serves
        await one_request(again)
        for c in (before, after, again):
            await c.close()
        await srv.close()

    caplog.set_level(logging.INFO, "transport")
    run("uvloop", body)
    assert "reloaded the transport TLS certificate, key or CA" in caplog.text
    assert "does not load" in caplog.text and "keeping the previous one" in caplog.text


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_pre_shared_key_over_sockets(tmp_path: Path, loop_kind: str, caplog: pytest.LogCaptureFixture) -> None:
    key = write_psk(tmp_path / "k")
    wrong = write_psk(tmp_path / "k2", "a different key, long enough too")
    caplog.set_level(logging.INFO, "transport")

    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", EchoWorker(), security=TransportSecurity(psk_file=key))
        conn = await connect(srv.address, security=TransportSecurity(psk_file=key))
        await one_request(conn)
        for sec, says in ((TransportSecurity(psk_file=wrong), "the worker's proof does not match"),
                          (None, "the worker requires a pre-shared key and this gateway has none")):
            with pytest.raises(TransportError, match=says):
                await connect(srv.address, security=sec, timeout=5)
        assert len(srv.connections) == 1
        await conn.close()
        await srv.close()

    run(loop_kind, body)
    assert "refused the gateway at 127.0.0.1:" in caplog.text
    assert "the gateway's proof does not match this side's key" in caplog.text
    assert "this worker requires a pre-shared key and the gateway offered none" in caplog.text


def test_tls_and_a_key_together(pki: PKI, tmp_path: Path) -> None:
    key = write_psk(tmp_path / "k")

    async def body() -> None:
        both = TransportSecurity(pki.worker.cert, pki.worker.key, pki.worker.ca, key)
        srv = await serve("tcp://127.0.0.1:0", EchoWorker(), security=both)
        conn = await connect(srv.address, security=TransportSecurity(pki.gateway.cert, pki.gateway.key,
                                                                      pki.gateway.ca, key))
        await one_request(conn)
        with pytest.raises(TransportError, match="pre-shared key"):
            await connect(srv.address, security=tls(pki.gateway), timeout=5)
        await conn.close()
        await srv.close()

    run("uvloop", body)


def _sessions(pki: PKI) -> tuple[TlsSession, TlsSession]:
    client = TlsSession(TlsContexts(tls(pki.gateway), server_side=False).get(), server_side=False)
    server = TlsSession(TlsContexts(tls(pki.worker), server_side=True).get(), server_side=True)
    return client, server


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 300), min_size=1, max_size=40), payload=st.binary(min_size=1, max_size=40000))
def test_tls_core_in_any_split(pki: PKI, cuts: list[int], payload: bytes) -> None:
    """The sans-I/O session: bytes in any split give the same plaintext, and what is sent before the
    handshake ends waits for it."""
    client, server = _sessions(pki)
    client.start()
    client.send(payload)
    got, i = bytearray(), 0
    for _ in range(200):
        data = client.data_to_send()
        while data:
            n = cuts[i % len(cuts)]
            i += 1
            plain, _ = server.receive(data[:n])
            got += plain
            data = data[n:]
        back = server.data_to_send()
        if back:
            client.receive(back)
        if len(got) == len(payload):
            break
    assert bytes(got) == payload and client.handshake_done and server.handshake_done


def test_tls_failures_are_explained(pki: PKI) -> None:
    client = TlsSession(TlsContexts(tls(pki.foreign_gateway), server_side=False).get(), server_side=False)
    server = TlsSession(TlsContexts(tls(pki.worker), server_side=True).get(), server_side=True)
    client.start()
    server.receive(client.data_to_send())
    with pytest.raises(ConnectError, match="the worker's certificate does not verify against this gateway's"):
        client.receive(server.data_to_send())
    assert isinstance(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), ssl.SSLContext)


# --- default deny ------------------------------------------------------------------------------


def test_loopback() -> None:
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "worker-0.svc", "192.168.1.1"))


@pytest.mark.parametrize(("url", "refused"), [
    ("tcp://0.0.0.0:7000", True), ("tcp://[::]:7000", True), ("tcp://10.1.2.3:7000", True),
    ("tcp://quicserve-worker:7000", True), ("rdma://10.0.0.1:7000", True),
    ("tcp://127.0.0.1:7000", False), ("tcp://localhost:7000", False), ("tcp://[::1]:7000", False),
    ("unix:///run/quicserve/w.sock", False),
])
def test_default_deny_beyond_loopback(url: str, refused: bool, tmp_path: Path) -> None:
    target = parse_url(url)
    for side in ("worker", "gateway"):
        why = TransportSecurity().refusal(target, side)
        assert (why is not None) == refused
        if why:
            assert "transport_tls_cert, transport_tls_key and transport_tls_ca" in why
            assert "transport_psk_file" in why and "--insecure" in why
        assert TransportSecurity(insecure=True).refusal(target, side) is None
        assert TransportSecurity(psk_file="k").refusal(target, side) is None
        assert TransportSecurity("c", "k", "a").refusal(target, side) is None


def test_serve_and_connect_refuse_unauthenticated_remote_addresses() -> None:
    async def body() -> None:
        with pytest.raises(SecurityConfigError, match="refusing to listen on tcp://0.0.0.0:0 without transport"):
            await serve("tcp://0.0.0.0:0", EchoWorker())
        srv = await serve("tcp://0.0.0.0:0", EchoWorker(), security=TransportSecurity(insecure=True))
        await srv.close()
        with pytest.raises(SecurityConfigError, match="refusing to connect to the worker at tcp://10.255.0.1:7000"):
            await connect("tcp://10.255.0.1:7000")  # refused before any packet: no timeout to wait for
        with pytest.raises(SecurityConfigError, match="transport_tls_ca not set"):
            await connect("tcp://127.0.0.1:1", security=TransportSecurity("c", "k"))
        with pytest.raises(SecurityConfigError, match="cannot load the transport TLS"):
            await connect("tcp://127.0.0.1:1", security=TransportSecurity("/nope.crt", "/nope.key", "/nope.ca"))

    run("asyncio", body)


def test_worker_options_refuse_what_the_worker_would() -> None:
    (key, why), = option_problems(WorkerOptions(listen="tcp://0.0.0.0:7000"))
    assert key == "listen" and why.startswith("refusing to listen on tcp://0.0.0.0:7000 without transport")
    assert option_problems(WorkerOptions(listen="tcp://0.0.0.0:7000", insecure=True)) == []
    assert option_problems(WorkerOptions(listen="tcp://0.0.0.0:7000", transport_psk_file="/k")) == []
    assert [k for k, _ in option_problems(WorkerOptions(transport_tls_cert="/c"))] == ["transport_tls_key"]
    assert [k for k, _ in option_problems(WorkerOptions(listen="rdma://10.0.0.1:7000", transport_tls_cert="c",
                                                        transport_tls_key="k", transport_tls_ca="a"))] == [
        "transport_tls_cert"]
