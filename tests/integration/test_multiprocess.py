"""Several gateway processes over one worker pool (``--processes N``, #33), through real processes:
a real ``quicserve serve --engine synthetic --processes N`` (a supervisor, N gateway processes, one
synthetic worker) and real clients (httpx over HTTP/1.1 and TLS h2, grpcio, aioquic over h3).

Which process served what is read from each process's own figures (the snapshots it publishes for
the others' /metrics) or, for a TCP connection, from /proc (which process holds its socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from collections.abc import Iterator

import grpc
import httpx
import orjson
import pytest
from aioquic.tls import SessionTicket

from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.multiproc.steering import cid_owner
from tests.gateway.http.h3_client import chat_body, h3_connect
from tests.integration.multiprocess_gateway import Fleet, fleet_of, until
from tests.integration.test_gateway_e2e import start_gateway, stop_gateway
from tests.netrelay import Link, UdpRelay

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"
JSON = [(b"content-type", b"application/json")]
GENERATE = "/quicserve.v1.Inference/Generate"


@pytest.fixture(scope="module", params=[2, 3], ids=["N=2", "N=3"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    n = request.param
    gw = start_gateway(tmp_path_factory.mktemp(f"procs{n}"), "--processes", str(n),
                       "--worker-option=synthetic_step_ms=2")
    try:
        yield fleet_of(gw, n)
    finally:
        assert stop_gateway(gw) == 0


def _served(fleet: Fleet, index: int, route: str, protocol: str | None = None) -> float:
    return sum(v for (name, labels), v in fleet.figures(index).items()
               if name == "quicserve_requests_total" and dict(labels)["route"] == route
               and (protocol is None or dict(labels)["protocol"] == protocol))


def _h1_fresh(port: int) -> None:
    with httpx.Client(http2=False) as c:
        assert c.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200


def _h2_fresh(port: int) -> None:
    with httpx.Client(http2=True, verify=False) as c:
        r = c.get(f"https://127.0.0.1:{port}/v1/models")
        assert r.status_code == 200 and r.http_version == "HTTP/2"


def _grpc_fresh(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.GenerateResponse.FromString)
        out = list(call(pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=2)), timeout=30))
        assert out[-1].usage.completion_tokens == 2


async def _h3_fresh(port: int) -> None:
    async with h3_connect(port) as client:
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200


def test_every_protocol_is_served_by_every_process_on_every_port(fleet: Fleet) -> None:
    """New connections spread over the processes: each serves HTTP/1.1, TLS h2, h3 and gRPC."""
    def every_process_served(route: str, protocol: str | None = None) -> bool:
        return all(_served(fleet, i, route, protocol) > 0 for i in range(fleet.n))

    for _ in range(64):  # new connections until each process has had one of each (usually 4-8 rounds)
        _h1_fresh(fleet.ports["http"])
        _h2_fresh(fleet.ports["tls"])
        asyncio.run(_h3_fresh(fleet.ports["quic"]))
        _grpc_fresh(fleet.ports["grpc"])
        with contextlib.suppress(AssertionError):
            until(lambda: all(every_process_served("/v1/models", p) for p in ("http/1.1", "h2", "h3"))
                  and every_process_served("grpc:quicserve.v1.Inference", "grpc"), 1.2)
            return
    raise AssertionError({i: {k: v for k, v in fleet.figures(i).items() if k[0] == "quicserve_requests_total"}
                          for i in range(fleet.n)})


def test_metrics_from_any_process_report_the_whole_gateway(fleet: Fleet) -> None:
    before = _total_chat(httpx.get(f"http://127.0.0.1:{fleet.ports['http']}/metrics").text)
    for _ in range(12):  # a new connection each: they land on every process
        with httpx.Client() as c:
            r = c.post(f"http://127.0.0.1:{fleet.ports['http']}{CHAT}",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200

    def every_scrape_counts_them() -> bool:  # each scrape (any process) sees all 12 once snapshots are fresh
        return all(_total_chat(httpx.get(f"http://127.0.0.1:{fleet.ports['http']}/metrics",
                                         headers={"connection": "close"}).text) - before == 12 for _ in range(6))

    until(every_scrape_counts_them, 10, "every scrape to count the 12 requests")


def _total_chat(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("quicserve_requests_total{") and f'route="{CHAT}"' in line)


def test_a_quic_connection_migrated_20_times_keeps_its_streams(fleet: Fleet) -> None:
    """NAT rebinding: each new source port hashes anywhere; steering by connection ID keeps the
    connection's packets at its owner, so a stream open across the 20 moves ends whole."""
    async def run() -> None:
        relay = await UdpRelay.start(("127.0.0.1", fleet.ports["quic"]), Link())
        try:
            async with h3_connect(relay.address[1]) as client:
                long = client.start("POST", CHAT, chat_body(max_tokens=200, stream=True), JSON)
                for i in range(20):
                    relay.rebind()
                    resp = await client.request("GET", "/v1/models", timeout=10)
                    assert resp.status == 200, f"after move {i + 1}"
                await asyncio.wait_for(long.done.wait(), 30)
                assert long.status == 200 and not long.reset
                chunks = [orjson.loads(e[6:]) for e in long.body.split(b"\n\n") if e.startswith(b"data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                assert len(text) == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"  # a char a token
        finally:
            relay.close()

    asyncio.run(run())


def _client_cids_naming(index: int) -> contextlib.AbstractContextManager[None]:
    """This test process's aioquic client draws its connection IDs with ``index`` as octet 1, so its
    first flight (under a DCID it chose) is steered to gateway process ``index % N``."""
    from aioquic.quic import connection as aioquic_connection

    from gateway.multiproc.steering import _CidRandom

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        saved = aioquic_connection.os  # type: ignore[attr-defined]
        aioquic_connection.os = _CidRandom(index)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            aioquic_connection.os = saved  # type: ignore[attr-defined]

    return patched()


async def _ticket_from(port: int, index: int) -> tuple[SessionTicket, int]:
    """A full handshake steered to process ``index``: the ticket it issued, and its owner per its CID."""
    tickets: list[SessionTicket] = []
    with _client_cids_naming(index):
        async with h3_connect(port, tickets=tickets) as client:
            await client.request("GET", "/healthz")
            owner = cid_owner(client._quic._peer_cid.cid)  # the CID the server chose names it
            for _ in range(200):
                if tickets:
                    break
                await asyncio.sleep(0.01)
    assert tickets
    return tickets[-1], owner


def test_0rtt_generation_on_a_ticket_another_process_issued(fleet: Fleet) -> None:
    """A ticket issued by process a resumes at process b with the chat completion in 0-RTT; the
    same ticket presented again (at a third process, or at b) is refused: a full handshake, and
    the request it carries in 0-RTT runs only after it (once)."""
    port = fleet.ports["quic"]

    async def run() -> None:
        ticket, a = await _ticket_from(port, 0)
        assert a == 0
        b = 1
        with _client_cids_naming(b):
            async with h3_connect(port, ticket=ticket, wait_connected=False) as client:
                resp = client.start("POST", CHAT, chat_body(4), JSON)
                await asyncio.wait_for(resp.done.wait(), 15)
                assert client.early_data_accepted is True and resp.status == 200
                assert resp.json()["usage"]["completion_tokens"] == 4
                assert cid_owner(client._quic._peer_cid.cid) == b
        c = 2 % fleet.n
        with _client_cids_naming(c):
            async with h3_connect(port, ticket=ticket, wait_connected=False) as client:
                resp = client.start("POST", CHAT, chat_body(4), JSON)
                await asyncio.wait_for(resp.done.wait(), 15)
                assert client.early_data_accepted is False and client.session_resumed is False
                assert resp.status == 200  # sent again by the client in 1-RTT

    asyncio.run(run())
    until(lambda: fleet.figures(1).get(("quicserve_h3_early_data_requests_total", (("outcome", "served"),)), 0) >= 1,
          5, "process 1 to count the early request")


def _retargeted(datagram: bytes, process: int) -> bytes:
    """The client's Initial datagram under another DCID, one naming ``process``: what an attacker
    can do (Initial keys derive from the DCID, which anyone can read) to take a recorded ClientHello,
    ticket and all, to another gateway process. Coalesced packets after it (0-RTT, under the old
    DCID, which the attacker cannot re-protect) ride along unchanged."""
    from aioquic._buffer import Buffer
    from aioquic.quic.crypto import CryptoPair
    from aioquic.quic.packet import pull_quic_header

    buf = Buffer(data=datagram)
    header = pull_quic_header(buf, host_cid_length=8)
    assert header.version is not None
    old, new = header.destination_cid, bytes([7, process]) + os.urandom(len(header.destination_cid) - 2)
    server, client = CryptoPair(), CryptoPair()
    server.setup_initial(old, is_client=False, version=header.version)
    client.setup_initial(new, is_client=True, version=header.version)
    packet = datagram[:header.packet_length]
    plain_header, payload, number = server.decrypt_packet(packet, buf.tell(), 0)
    assert plain_header[6:6 + len(old)] == old
    plain_header = plain_header[:6] + new + plain_header[6 + len(old):]
    return client.encrypt_packet(plain_header, payload, number) + datagram[header.packet_length:]


def test_a_replayed_first_flight_never_runs_the_request_again(fleet: Fleet) -> None:
    """The client's first flight (Initial with the ticket + the chat completion in 0-RTT), recorded
    and sent again from 16 other source ports -- while its connection is open and after it closed
    -- and its Initial retargeted at every other process: the worker ran the request once (its own
    step counter), and each other process refused the ticket (claimed by the first)."""
    port = fleet.ports["quic"]

    def read_sequences() -> float:
        text = httpx.get(f"http://127.0.0.1:{fleet.ports['http']}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("quicserve_worker_step_sequences_total"))

    def worker_sequences() -> float:
        """The worker's count once its reports (every 0.5 s) stop moving: the same twice, 1.2 s apart."""
        last = read_sequences()
        for _ in range(20):
            time.sleep(1.2)
            now = read_sequences()
            if now == last:
                return now
            last = now
        raise AssertionError("the worker's step count never settled")

    def refused(index: int) -> float:
        return fleet.figures(index).get(("quicserve_quic_session_tickets_presented_total",
                                         (("outcome", "refused"),)), 0.0)

    async def replay(flight: list[bytes]) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(16):
            transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol,
                                                               local_addr=("127.0.0.1", 0))
            for d in flight:
                transport.sendto(d, ("127.0.0.1", port))
            await asyncio.sleep(0.02)
            transport.close()

    others = [j for j in range(fleet.n) if j != 1]
    before = {j: refused(j) for j in others}

    async def run() -> tuple[float, float, float]:
        ticket, _ = await _ticket_from(port, 0)
        relay = await UdpRelay.start(("127.0.0.1", port), Link())
        relay.record = []
        base = worker_sequences()
        try:
            with _client_cids_naming(1):  # the first flight goes to process 1
                async with h3_connect(relay.address[1], ticket=ticket, wait_connected=False) as client:
                    resp = client.start("POST", CHAT, chat_body(4), JSON)
                    await asyncio.wait_for(resp.done.wait(), 15)
                    assert client.early_data_accepted is True and resp.status == 200
                    flight = [d for d in relay.record if d[0] & 0x80 and (d[0] & 0x30) in (0x00, 0x10)]
                    assert flight, "no Initial / 0-RTT datagrams recorded"
                    once = worker_sequences()
                    await replay(flight)  # the connection is open
            await asyncio.sleep(0.3)
            await replay(flight)  # and closed
            initials = [d for d in flight if d[0] & 0x30 == 0x00 and d[6:14] == flight[0][6:14]]  # the first flight's
            await replay([_retargeted(d, j) for j in others for d in initials] + flight)  # at the others
            return base, once, worker_sequences()
        finally:
            relay.close()

    base, once, after = asyncio.run(run())
    assert once > base and after == once, (base, once, after)
    until(lambda: all(refused(j) > before[j] for j in others), 5, "every other process to refuse the ticket")


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """Three processes, a key file and a rate limit on /v1/completions."""
    from tests.integration.serve_process import serve_config

    state = tmp_path_factory.mktemp("limited")
    keys = state / "keys.jsonl"
    keys.write_text(_key_line("alpha") + _key_line("gamma", max_concurrency=2))
    gw = serve_config(state, f'''
[server]
processes = 3
[workers]
engine = "synthetic"
synthetic_step_ms = 10.0
[admission]
keys_file = "{keys}"
keys_check_interval = 3600.0
limits = ["route=/v1/completions requests 200/1m"]
''', args=("--no-tls", "--grpc-port", "-1", "--quic-port", "-1"))
    try:
        yield fleet_of(gw, 3), str(keys)
    finally:
        assert stop_gateway(gw) == 0


def _key_line(name: str, **record: int) -> str:
    import hashlib

    return orjson.dumps({"id": name, "sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest(),
                         **record}).decode() + "\n"


def test_a_keys_concurrency_cap_holds_across_processes(limited: tuple[Fleet, str]) -> None:
    """A key allowed 2 requests at once sends 8 long streams on 8 connections (over the 3 processes):
    2 run, 6 get 429, whichever process each reached; once they end, 2 run again."""
    fleet, _ = limited

    async def burst() -> list[int]:
        async def one() -> int:
            async with httpx.AsyncClient(headers={"authorization": "Bearer sk-gamma"}, timeout=30) as c:
                r = await c.post(f"http://127.0.0.1:{fleet.ports['http']}/v1/chat/completions",
                                 json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 300, "stream": True})
                return r.status_code

        return list(await asyncio.gather(*(one() for _ in range(8))))

    for _ in range(2):
        codes = asyncio.run(burst())
        assert sorted(codes) == [200] * 2 + [429] * 6, codes


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the local store is a redis-server")
def test_rate_limits_hold_across_processes(limited: tuple[Fleet, str]) -> None:
    """A client over the limit (12 connections, spread over the 3 processes, 800 requests against
    200 a minute) is admitted the limit, counted across processes in their local store: never more,
    and (leases renewed under load) not 0.5 % less."""
    fleet, _ = limited

    async def run() -> list[int]:
        codes: list[int] = []
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=12), timeout=30,
                                     headers={"authorization": "Bearer sk-alpha"}) as c:
            left = [800]

            async def one_by_one() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    r = await c.post(f"http://127.0.0.1:{fleet.ports['http']}/v1/completions",
                                     json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
                    codes.append(r.status_code)

            await asyncio.gather(*(one_by_one() for _ in range(12)))
        return codes

    codes = asyncio.run(run())
    assert set(codes) <= {200, 429}
    assert 200 * 0.995 <= codes.count(200) <= 200, codes.count(200)
    # the limit was shared: at least two processes admitted (all 12 connections on one: p = 3 ** -11)
    until(lambda: sum(_served(fleet, i, "/v1/completions") > 0 for i in range(3)) >= 2, 5,
          "two processes to have served the client")


def test_sighup_reloads_every_process(limited: tuple[Fleet, str]) -> None:
    fleet, keys = limited
    url = f"http://127.0.0.1:{fleet.ports['http']}/v1/models"
    with httpx.Client(headers={"authorization": "Bearer sk-beta"}) as c:
        assert c.get(url).status_code == 401
    with open(keys, "a") as f:
        f.write(_key_line("beta"))
    fleet.gw.proc.send_signal(1)  # SIGHUP, to the supervisor only

    def every_connection_admits_beta() -> bool:
        for _ in range(16):  # new connections: every process
            with httpx.Client(headers={"authorization": "Bearer sk-beta"}) as c:
                if c.get(url).status_code != 200:
                    return False
        return True

    until(every_connection_admits_beta, 10, "every process to know the new key")


def test_a_restarted_worker_reaches_every_process(limited: tuple[Fleet, str]) -> None:
    """The supervisor restarts a worker that died (on a new port); every process is told the new
    URL and serves from it."""
    fleet, _ = limited
    (worker,) = _children_of_supervisor(fleet) - set(fleet.pids.values()) - _redis_of(fleet)
    os.kill(worker, 9)

    def every_process_generates() -> bool:
        for _ in range(12):  # new connections: every process
            with httpx.Client(headers={"authorization": "Bearer sk-alpha"}) as c:
                r = c.post(f"http://127.0.0.1:{fleet.ports['http']}/v1/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                if r.status_code != 200:
                    return False
        return True

    until(lambda: worker not in _children_of_supervisor(fleet), 10, "the worker to be gone")
    until(every_process_generates, 60, "every process to serve from the restarted worker")


def _redis_of(fleet: Fleet) -> set[int]:
    out = set()
    for pid in _children_of_supervisor(fleet):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"redis-server" in f.read():
                out.add(pid)
    return out


def test_killing_one_process_loses_only_its_connections(limited: tuple[Fleet, str]) -> None:
    fleet, _ = limited
    port = fleet.ports["http"]
    worker_pids = _children_of_supervisor(fleet)
    conns: list[tuple[socket.socket, int]] = []
    while len({owner for _, owner in conns}) < 2:  # connections held by at least two processes
        assert len(conns) < 64
        s = socket.create_connection(("127.0.0.1", port))
        assert _h1_get(s) == 200
        conns.append((s, fleet.owner_of(s.getsockname()[1])))
    victim = conns[0][1]
    old_pid = fleet.pids[victim]
    os.kill(old_pid, 9)
    until(lambda: fleet.pids[victim] != old_pid, 15, "the process to be started again")
    for s, owner in conns:
        if owner == victim:
            assert _h1_get(s) is None  # its connections went with it
        else:
            assert _h1_get(s) == 200  # the others' did not notice
        s.close()
    assert _children_of_supervisor(fleet) - {fleet.pids[victim]} == worker_pids - {old_pid}  # the worker stayed
    assert len(worker_pids - set(fleet.pids.values()) - {old_pid}) == 1 + len(_redis_of(fleet))  # (+ the store)
    until(lambda: _h1_get_fresh(port) == 200, 15)


def _h1_get(s: socket.socket) -> int | None:
    """One keep-alive GET on ``s``: its status, read whole; None if the connection is gone."""
    try:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alpha\r\n\r\n")
        s.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                return None
            body += chunk
    except OSError:
        return None
    return int(head.split(b" ", 2)[1])


def _h1_get_fresh(port: int) -> int | None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        return _h1_get(s)


def _children_of_supervisor(fleet: Fleet) -> set[int]:
    pid = fleet.gw.proc.pid
    kids: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(x) for x in f.read().split()}
    return kids


def test_sigterm_drains_every_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Streams open on two processes when the supervisor gets SIGTERM: both finish whole, then the
    processes, the worker and the supervisor exit (0)."""
    gw = start_gateway(tmp_path_factory.mktemp("drain"), "--processes", "2", "--no-tls", "--quic-port", "-1",
                       "--grpc-port", "-1", "--worker-option=synthetic_step_ms=25")
    try:
        fleet = fleet_of(gw, 2)
        conns: list[tuple[socket.socket, int]] = []
        while len({owner for _, owner in conns}) < 2:
            assert len(conns) < 64
            s = socket.create_connection(("127.0.0.1", fleet.ports["http"]))
            assert _h1_get(s) == 200
            conns.append((s, fleet.owner_of(s.getsockname()[1])))
        streams = [next(s for s, owner in conns if owner == i) for i in range(2)]
        body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                             "stream": True})
        for s in streams:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            s.settimeout(30)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")  # streaming has begun
        workers = _children_of_supervisor(fleet) - set(fleet.pids.values())
        gw.proc.send_signal(15)
        for s in streams:
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk, f"cut short: {data[-200:]!r}"
                data += chunk
            assert b"data: [DONE]" in data and b'"finish_reason":"length"' in data
        assert gw.proc.wait(30) == 0
        for pid in [*fleet.pids.values(), *workers]:
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
        for s, _ in conns:
            s.close()
    finally:
        stop_gateway(gw)


def test_systemd_hears_the_supervisor_alone(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under a Type=notify unit (NotifyAccess=main): READY=1 from the supervisor's pid once every
    process serves, no datagram from a gateway process, STOPPING=1 on SIGTERM."""
    state = tmp_path_factory.mktemp("notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(state / "notify"))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram says who sent it
    sock.settimeout(60)
    senders: set[int] = set()

    def receive() -> dict[str, str]:
        data, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
        senders.update(int.from_bytes(d[:4], "little") for level, kind, d in anc
                       if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)

    os.environ["NOTIFY_SOCKET"] = str(state / "notify")  # start_gateway passes this environment on
    try:
        gw = start_gateway(state, "--processes", "2", "--no-tls", "--quic-port", "-1", "--grpc-port", "-1")
    finally:
        del os.environ["NOTIFY_SOCKET"]
    try:
        fleet = fleet_of(gw, 2)
        fields: dict[str, str] = {}
        while "READY" not in fields:
            fields = receive()
        assert fields["MAINPID"] == str(gw.proc.pid) and "tiny" in fields["STATUS"]
        assert httpx.get(f"http://127.0.0.1:{fleet.ports['http']}/readyz").status_code == 200
        gw.proc.send_signal(15)
        while "STOPPING" not in fields:
            fields = receive()
        assert gw.proc.wait(30) == 0
        assert senders == {gw.proc.pid}
    finally:
        stop_gateway(gw)
        sock.close()
