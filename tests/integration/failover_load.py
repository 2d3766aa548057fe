"""The load of the mid-stream failover tests (tests/integration/test_failover.py): many concurrent
generations against a real ``quicserve serve`` -- SSE streams, whole responses, native gRPC
streams -- with the arrival time of every piece of a stream, and optionally a kill -9 of one of
the gateway's local workers once the streams have ``kill_at`` tokens on average."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import orjson

from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.integration.test_gateway_e2e import Gateway

__all__ = ["Load", "Outcome", "across", "busiest", "gaps_at", "step_seconds", "local_workers", "p99", "run_load"]

GENERATE = "/quicserve.v1.Inference/Generate"


@dataclass(frozen=True)
class Load:
    model: str
    streams: int = 100  # SSE
    wholes: int = 0  # non-streaming
    grpc_streams: int = 0
    max_tokens: int = 64
    seeded: bool = False  # every other SSE stream samples at temperature 1 with its own seed

    def body(self, i: int, stream: bool) -> dict[str, object]:
        sampling: dict[str, object] = {"temperature": 0.0}
        if self.seeded and i % 2:
            sampling = {"temperature": 1.0, "seed": 1000 + i}
        return {"model": self.model, "prompt": f"request {i}: tell me a story", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": stream, **sampling}


@dataclass
class Outcome:
    texts: dict[str, str] = field(default_factory=dict)  # by request name: the text the client got
    times: dict[str, list[float]] = field(default_factory=dict)  # arrival of each chunk (streams)
    bad: list[str] = field(default_factory=list)  # requests that did not end properly, and why
    killed_at: float = 0.0  # time.monotonic() of the kill (0: none)
    started_at: float = field(default_factory=time.monotonic)

    def timeline(self) -> str:
        """When the kill came, against the streams' first and last chunks (seconds from the start)."""
        firsts = [t[0] - self.started_at for t in self.times.values() if t]
        lasts = [t[-1] - self.started_at for t in self.times.values() if t]
        return (f"kill at {self.killed_at - self.started_at:.2f} s; first chunks {min(firsts):.2f}-{max(firsts):.2f} s, "
                f"last {min(lasts):.2f}-{max(lasts):.2f} s")


def local_workers(g: Gateway) -> list[int]:
    """The pids of the gateway's `quicserve worker` children."""
    out = []
    for task in Path(f"/proc/{g.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                out.append(int(pid))
    return out


async def _sse(c: httpx.AsyncClient, load: Load, i: int, out: Outcome, counts: list[int]) -> None:
    name, text, times, done = f"sse {i}", [], out.times.setdefault(f"sse {i}", []), False
    async with c.stream("POST", "/v1/completions", json=load.body(i, True)) as r:
        if r.status_code != 200:
            out.bad.append(f"{name}: status {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                if done:
                    out.bad.append(f"{name}: two ends")
                done = True
                continue
            ev = orjson.loads(line[6:])
            if "error" in ev:
                out.bad.append(f"{name}: {ev['error']}")
                return
            if ev.get("choices"):  # one per engine step, even when its text is "" (part of a character)
                text.append(ev["choices"][0]["text"])
                times.append(time.monotonic())
                counts[i] += 1
    if not done:
        out.bad.append(f"{name}: no [DONE]")
    out.texts[name] = "".join(text)


async def _whole(c: httpx.AsyncClient, load: Load, i: int, out: Outcome) -> None:
    r = await c.post("/v1/completions", json=load.body(10_000 + i, False))
    if r.status_code != 200:
        out.bad.append(f"whole {i}: status {r.status_code} {r.text[:200]}")
        return
    body = r.json()
    if body["usage"]["completion_tokens"] != load.max_tokens:
        out.bad.append(f"whole {i}: usage {body['usage']}")
    out.texts[f"whole {i}"] = body["choices"][0]["text"]


async def _grpc(ch: grpc.aio.Channel, load: Load, i: int, out: Outcome) -> None:
    call = ch.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb.GenerateResponse.FromString)
    text, last = [], None
    req = pb.GenerateRequest(model=load.model, prompt=f"request {20_000 + i}: tell me a story",
                             sampling=pb.Sampling(max_tokens=load.max_tokens, temperature=0.0))
    try:
        async for msg in call(req, timeout=120):
            text.append(msg.text)
            last = msg
    except grpc.aio.AioRpcError as e:
        out.bad.append(f"grpc {i}: {e.code()} {e.details()}")
        return
    if last is None or last.usage.completion_tokens < 1:
        out.bad.append(f"grpc {i}: no usage at the end")
    out.texts[f"grpc {i}"] = "".join(text)


def busiest(metrics: str, pids: list[int]) -> tuple[int, float]:
    """Of ``pids``, the worker with the most requests open, and how many all have: from
    ``quicserve_worker_in_flight`` in the ``/metrics`` text (labelled ``worker@host:pid``)."""
    open_: dict[int, float] = {}
    for line in metrics.splitlines():
        if m := re.match(r'quicserve_worker_in_flight\{worker="[^"]*:(\d+)"\} (\S+)', line):
            open_[int(m.group(1))] = float(m.group(2))
    return max(pids, key=lambda p: open_.get(p, 0.0)), sum(open_.values())


def step_seconds(metrics: str) -> float:
    """The workers' mean engine step time so far (their Stats counters on the gateway's /metrics)."""
    def total(name: str) -> float:
        return sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith(name + "{"))
    return total("quicserve_worker_step_seconds_total") / max(1.0, total("quicserve_worker_steps_total"))


class _Killer(threading.Thread):
    """Off the load's event loop (whose clients see chunks later than the workers make them: 100
    streams of a fast model keep this process busy), on its own connection: polls /metrics until
    the load's requests are all placed, then ``after`` seconds later kills -9 the worker holding
    the most of them."""

    def __init__(self, g: Gateway, requests: int, after: float, out: Outcome) -> None:
        super().__init__(daemon=True)
        self.g, self.requests, self.after, self.out = g, requests, after, out

    def run(self) -> None:
        pids = local_workers(self.g)
        with httpx.Client(base_url=self.g.http, timeout=10) as m:
            while True:
                pid, open_ = busiest(m.get("/metrics").text, pids)
                if open_ >= 0.9 * self.requests:
                    break
                time.sleep(0.002)
        time.sleep(self.after)
        os.kill(pid, signal.SIGKILL)
        self.out.killed_at = time.monotonic()


async def run_load(g: Gateway, grpc_target: str | None, load: Load, kill_after: float | None = None) -> Outcome:
    """Run ``load`` once; with ``kill_after``, kill -9 the worker holding the most of its requests
    that many seconds after they are all placed."""
    out = Outcome()
    counts = [0] * load.streams
    killer = None
    if kill_after is not None:
        killer = _Killer(g, load.streams + load.wholes + load.grpc_streams, kill_after, out)
        killer.start()
    limits = httpx.Limits(max_connections=load.streams + load.wholes)
    async with httpx.AsyncClient(base_url=g.http, timeout=120, limits=limits) as c:
        jobs = [_sse(c, load, i, out, counts) for i in range(load.streams)]
        jobs += [_whole(c, load, i, out) for i in range(load.wholes)]
        if grpc_target is not None and load.grpc_streams:
            async with grpc.aio.insecure_channel(grpc_target) as ch:
                await asyncio.gather(*jobs, *(_grpc(ch, load, i, out) for i in range(load.grpc_streams)))
        else:
            await asyncio.gather(*jobs)
    if killer is not None:
        killer.join(10)
    return out


def across(out: Outcome) -> tuple[int, int, int]:
    """(streams that had every chunk before the kill, some before and some after, all after)."""
    n = [0, 0, 0]
    for times in out.times.values():
        before = sum(t <= out.killed_at for t in times)
        n[0 if before == len(times) else 2 if not before else 1] += 1
    return n[0], n[1], n[2]


def gaps_at(out: Outcome) -> list[float]:
    """Per stream not over by the kill: the longest wait for its next chunk from its last chunk
    before the kill (from the kill, if it had shown none yet) on. The client may see chunks a
    dying worker sent after the kill (it reads behind), so the failover's pause is the longest
    wait, not the first."""
    gaps = []
    for times in out.times.values():
        after = [t for t in times if t > out.killed_at]
        if after:
            before = [t for t in times if t <= out.killed_at]
            points = [before[-1] if before else out.killed_at, *after]
            gaps.append(max(b - a for a, b in zip(points, points[1:], strict=False)))
    return gaps


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile."""
    s = sorted(values)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]
