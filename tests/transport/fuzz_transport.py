"""A long fuzz run: a million random frames at a worker and at a gateway's worker connection.

    .venv/bin/python tests/transport/fuzz_transport.py [--frames 1000000] [--side worker|gateway|both] [--seed 36]

Worker side: a real ``quicserve worker --engine synthetic`` process; hostile connections (25 at a
time) each send a burst of 1-40 random frames (tests/transport/hostile.py; most after a valid
gateway HELLO, so the request decoders are reached) while an honest connection streams requests
and checks every token. Gateway side: this process is the gateway (the same ClientConnection code
``quicserve serve`` runs) connecting to a hostile worker that answers every connection with a
HELLO and a burst, submitting requests on each, while an honest worker process serves another
connection. Both: the process's RSS is sampled throughout; a crash, a wrong honest answer or a
request that does not end exactly once fails the run (exit 1). The tests run the same generator
briefly (tests/transport/test_hostile_peers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.transport.hostile import (  # noqa: E402
    RandomDraw,
    gateway_hello,
    hostile_stream,
    hostile_worker,
    send_to_worker,
    worker_hello,
)
from transport.client import ClientConnection, connect  # noqa: E402
from transport.errors import TransportError  # noqa: E402
from transport.messages import Error, Finish, SamplingParams, Submit  # noqa: E402

TOKENS = 32
WIDTH = 25  # hostile connections at a time


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Watch:
    """RSS samples of one process, every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first = rss_mib(pid)
        self.max = self.first
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.max = max(self.max, rss_mib(self.pid))
            await asyncio.sleep(0.2)


def start_worker() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic", "--listen", "tcp://127.0.0.1:0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUICSERVE_LOG": "ERROR"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["event"] == "ready":
            return proc, str(ev["url"])
    raise SystemExit(f"worker did not start ({proc.wait()})")


async def honest(conn: ClientConnection, stop: asyncio.Event, done: list[int]) -> None:
    """Four requests at a time, every token checked, every 20 ms (the hostile peers get the rest)."""
    while not stop.is_set():
        await asyncio.sleep(0.02)
        streams = [conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=TOKENS,
                                                                                     ignore_eos=True), prompt="hi"))
                   for _ in range(4)]
        for s in streams:
            got = await s.collect()
            if not isinstance(got.final, Finish) or got.tokens != TOKENS:
                raise SystemExit(f"FAIL: an honest request got {got.final} after {got.tokens} tokens")
            done[0] += 1


async def at_worker(frames: int, rng: random.Random) -> bool:
    proc, url = start_worker()
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    watch = Watch(proc.pid)
    conn = await connect(url)
    assert isinstance(conn, ClientConnection)
    stop, done = asyncio.Event(), [0]
    load = asyncio.create_task(honest(conn, stop, done))
    sent = conns = cut = 0
    t0 = time.monotonic()
    while sent < frames:
        batch = []
        for i in range(WIDTH):
            n = rng.randint(1, 40)
            batch.append(hostile_stream(RandomDraw(rng), n, gateway_hello() if i % 5 else None))
            sent += n
        cut += sum(await asyncio.gather(*(send_to_worker(host, int(port), d, 0.2) for d in batch)))
        conns += len(batch)
        if proc.poll() is not None:
            print(f"FAIL: the worker exited ({proc.returncode}) after {sent} frames")
            return False
        if conns % 10000 == 0:
            print(f"  worker: {sent} frames, {conns} connections, RSS {rss_mib(proc.pid):.0f} MiB", flush=True)
    stop.set()
    await load
    watch.task.cancel()
    end = rss_mib(proc.pid)
    print(f"worker side: {sent} random frames on {conns} connections in {time.monotonic() - t0:.0f} s; "
          f"{cut} cut off by the worker; honest requests {done[0]} all exact; worker RSS {watch.first:.0f} MiB "
          f"at start, {watch.max:.0f} max, {end:.0f} at end; alive: {proc.poll() is None}")
    await conn.close()
    proc.terminate()
    proc.wait(20)
    return True


async def at_gateway(frames: int, rng: random.Random) -> bool:
    proc, url = start_worker()
    conn = await connect(url)
    assert isinstance(conn, ClientConnection)
    stop, done = asyncio.Event(), [0]
    load = asyncio.create_task(honest(conn, stop, done))
    watch = Watch(os.getpid())
    pending: list[bytes] = []
    bad, bad_url = await hostile_worker(pending.pop)
    sent = conns = refused = dropped = 0
    t0 = time.monotonic()

    async def one() -> None:
        nonlocal sent, refused, dropped
        n = rng.randint(1, 40)
        pending.append(worker_hello() + hostile_stream(RandomDraw(rng), n, None))
        sent += n
        try:
            c = await connect(bad_url, timeout=2)
        except TransportError:
            refused += 1
            return
        assert isinstance(c, ClientConnection)
        streams = [c.submit(Submit(c.next_request_id(), "tiny", prompt="x")) for _ in range(3)
                   if not c.closed and not c.draining]
        async with asyncio.timeout(10):
            for s in streams:
                got = await s.collect()
                if not isinstance(got.final, (Finish, Error)):
                    raise SystemExit("FAIL: a request did not end")
            await c.close()
        dropped += c.core.close_error is not None and c.core.close_error.code == 9

    while sent < frames:
        await asyncio.gather(*(one() for _ in range(WIDTH)))
        conns += WIDTH
        if conns % 10000 == 0:
            print(f"  gateway: {sent} frames, {conns} connections, RSS {rss_mib(os.getpid()):.0f} MiB", flush=True)
    stop.set()
    await load
    watch.task.cancel()
    print(f"gateway side: {sent} random frames on {conns} worker connections in {time.monotonic() - t0:.0f} s; "
          f"{refused} refused at connect, {dropped} dropped later, every request ended once; honest requests "
          f"{done[0]} all exact, connection open: {not conn.closed}; gateway RSS {watch.first:.0f} MiB at start, "
          f"{watch.max:.0f} max, {rss_mib(os.getpid()):.0f} at end")
    bad.close()
    await conn.close()
    proc.terminate()
    proc.wait(20)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--side", choices=["worker", "gateway", "both"], default="both")
    ap.add_argument("--seed", type=int, default=36)
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the hostile peers' warnings would be most of the output
    rng = random.Random(a.seed)
    ok = True
    if a.side in ("worker", "both"):
        ok &= asyncio.run(at_worker(a.frames, rng))
    if a.side in ("gateway", "both"):
        ok &= asyncio.run(at_gateway(a.frames, rng))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
