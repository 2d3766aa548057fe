"""Transport benchmarks: token-frame codec vs OpenAI JSON SSE chunks, and loopback throughput.

Run: ``python tests/bench/bench_transport.py [--quick]``. Not collected by pytest.

1. Codec. One engine step = one TokenBatch of single-token entries for 64
   concurrent requests, realistic text deltas (1-6 bytes of UTF-8 per token).
   Baseline in the same run: what an OpenAI-compatible server does per token,
   a ``chat.completion.chunk`` dict serialised with orjson as an SSE event,
   and the client parsing it back. Reported: bytes per token (frame headers
   included) and encode+decode microseconds per token, as a ratio. Timing is
   interleaved (ours, baseline, ours, ...) and the best round of each is kept,
   so the ratio is fair on a loaded machine.
2. Throughput. A test-double worker streams tokens (one frame per step with
   one token for every runnable request, honouring credit) to a gateway
   client draining every stream, over loopback TCP and a Unix socket, with 1,
   64 and 1024 concurrent requests (uvloop).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence

import orjson
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transport.api import RequestStream, ServerConnection  # noqa: E402
from transport.client import connect  # noqa: E402
from transport.messages import (  # noqa: E402
    Finish,
    FinishReason,
    Hello,
    SamplingParams,
    Submit,
    TokenBatch,
    TokenEntry,
)
from transport.server import serve  # noqa: E402
from transport.wire import FrameDecoder, FrameEncoder  # noqa: E402

WORDS = ["the", " cat", " sat", " on", " mat", ",", " é", " naïve", " 😀", " model", " tokens", "."]


def make_steps(
    n_req: int, n_steps: int, vocab: int, churn: float, logprobs: bool, seed: int = 0
) -> tuple[list[Submit], list[TokenBatch], list[list[str]]]:
    """Submits and engine steps; ``churn`` = chance per step that one request is replaced."""
    rng = random.Random(seed)
    params = SamplingParams(logprobs=logprobs)
    next_rid = 1
    live = list(range(1, n_req + 1))
    submits = [Submit(r, "m", params, prompt="p") for r in live]
    next_rid = n_req + 1
    steps, texts = [], []
    for _ in range(n_steps):
        if churn and rng.random() < churn:
            i = rng.randrange(len(live))
            live[i] = next_rid
            submits.append(Submit(next_rid, "m", params, prompt="p"))
            next_rid += 1
        words = [rng.choice(WORDS) for _ in live]
        enc = [w.encode() for w in words]
        steps.append(
            TokenBatch(
                array("I", live),
                array("I", [1]) * len(live),
                array("I", [rng.randrange(vocab) for _ in live]),
                array("I", [len(b) for b in enc]),
                b"".join(enc),
                has_logprobs=array("B", [1] * len(live)) if logprobs else array("B"),
                top_ns=array("B", [0] * len(live)) if logprobs else array("B"),
                logprobs=array("f", [-rng.random() for _ in live]) if logprobs else array("f"),
            )
        )
        texts.append(words)
    return submits, steps, texts


def ours_bytes(submits: list[Submit], steps: list[TokenBatch]) -> float:
    """Bytes per token of the token frames (Submits are per request, not per token)."""
    enc = FrameEncoder()
    live: set[int] = set()
    sub_by_rid = {s.request_id: s for s in submits}
    total = tokens = 0
    for b in steps:
        for rid in b.request_ids:
            if rid not in live:
                enc.encode(sub_by_rid[rid])
                live.add(rid)
        total += len(enc.encode(b))
        tokens += b.num_tokens
    return total / tokens


def run_ours(submits: list[Submit], steps: list[TokenBatch], entries: bool) -> Callable[[], int]:
    # Submits are per request, not per token: exchanged once, outside the timed loop.
    enc, dec = FrameEncoder(), FrameDecoder()
    for s in submits:
        dec.feed(enc.encode(s))

    def go() -> int:
        n = 0
        for b in steps:
            for m in dec.feed(enc.encode(b)):
                if entries:
                    for _ in m.entries():  # type: ignore[union-attr]
                        pass
            n += b.num_tokens
        return n

    return go


def sse_chunk(rid: int, text: str, lp: float | None) -> bytes:
    chunk = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": 1732900000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None
                if lp is None
                else {"content": [{"token": text, "logprob": lp, "top_logprobs": []}]},
                "finish_reason": None,
            }
        ],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def run_json(steps: list[TokenBatch], texts: list[list[str]], logprobs: bool) -> Callable[[], int]:
    def go() -> int:
        n = 0
        for b, words in zip(steps, texts, strict=True):
            lps = b.logprobs
            for i, rid in enumerate(b.request_ids):
                ev = sse_chunk(rid, words[i], lps[i] if logprobs else None)
                obj = orjson.loads(ev[6:-2])
                obj["choices"][0]["delta"]["content"]
                n += 1
        return n

    return go


def json_bytes(steps: list[TokenBatch], texts: list[list[str]], logprobs: bool) -> float:
    total = tokens = 0
    for b, words in zip(steps, texts, strict=True):
        for i, rid in enumerate(b.request_ids):
            total += len(sse_chunk(rid, words[i], b.logprobs[i] if logprobs else None))
            tokens += 1
    return total / tokens


def best_per_token(fns: dict[str, Callable[[], int]], rounds: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            n = fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / n * 1e6)
    return best


def codec_bench(quick: bool) -> None:
    print("== token frames vs OpenAI JSON SSE chunks (orjson), 64 concurrent single-token steps ==")
    print(
        f"{'scenario':44s} {'B/tok':>6s} {'json B/tok':>10s} {'us/tok':>7s} {'+views':>7s} {'json us':>8s} {'speedup':>8s}"
    )
    n_steps = 100 if quick else 400
    rounds = 9 if quick else 25
    for name, vocab, churn, lp in (
        ("32k vocab, same requests each step", 32000, 0.0, False),
        ("32k vocab, one request replaced per step", 32000, 1.0, False),
        ("byte vocab (u8 ids), same requests", 256, 0.0, False),
        ("128k vocab, logprobs on", 128256, 0.0, True),
    ):
        submits, steps, texts = make_steps(64, n_steps, vocab, churn, lp)
        t = best_per_token(
            {
                "ours": run_ours(submits, steps, entries=False),
                "views": run_ours(submits, steps, entries=True),
                "json": run_json(steps, texts, lp),
            },
            rounds,
        )
        print(
            f"{name:44s} {ours_bytes(submits, steps):6.2f} {json_bytes(steps, texts, lp):10.1f} "
            f"{t['ours']:7.3f} {t['views']:7.3f} {t['json']:8.3f} {t['json'] / t['ours']:7.1f}x"
        )
    print("  us/tok = encode + decode of the frames; +views = also iterating TokenBatch.entries()")
    print("  (per-request TokenEntry objects the gateway makes); speedup = json us / us/tok.")


class BenchWorker:
    """Test-double worker for throughput: every step emits one token per runnable request."""

    def __init__(self) -> None:
        self.active: dict[int, tuple[ServerConnection, int, int]] = {}  # rid -> (conn, done, max)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def hello(self) -> Hello:
        return Hello(role="worker", models=("m",))

    def on_submit(self, conn: ServerConnection, submit: Submit) -> None:
        self.active[submit.request_id] = (conn, 0, submit.params.max_tokens)
        self._kick()

    def on_cancel(self, conn: ServerConnection, request_id: int) -> None:
        if self.active.pop(request_id, None) is not None:
            conn.send_finish(Finish(request_id, FinishReason.CANCELLED, 1, 0))

    def on_credit(self, conn: ServerConnection, request_id: int, available: int) -> None:
        self._kick()

    def on_disconnect(self, conn: ServerConnection, open_requests: Sequence[int]) -> None:
        for rid in open_requests:
            self.active.pop(rid, None)

    def _kick(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        text = b"tok "
        while self.active:
            self._wake.clear()
            ready: list[int] = []
            conn = None
            for rid, (c, _done, _mx) in self.active.items():
                if c.credit(rid) >= 1:
                    ready.append(rid)
                    conn = c
            if conn is None:
                await self._wake.wait()
                continue
            n = len(ready)
            conn.send_tokens(
                TokenBatch(
                    array("I", ready),
                    array("I", [1]) * n,
                    array("I", [1234]) * n,
                    array("I", [4]) * n,
                    text * n,
                )
            )
            for rid in ready:
                c, done, mx = self.active[rid]
                done += 1
                if done >= mx:
                    del self.active[rid]
                    c.send_finish(Finish(rid, FinishReason.LENGTH, 1, done))
                else:
                    self.active[rid] = (c, done, mx)
            await asyncio.sleep(0)


async def drain(stream: RequestStream) -> int:
    n = 0
    while True:
        try:
            events = await stream.next_events()
        except StopAsyncIteration:
            return n
        for e in events:
            if isinstance(e, TokenEntry):
                n += len(e.token_ids)


async def throughput(url: str, concurrency: int, tokens_each: int) -> float:
    srv = await serve(url, BenchWorker())
    conn = await connect(srv.address)
    t0 = time.perf_counter()
    streams = [
        conn.submit(Submit(conn.next_request_id(), "m", SamplingParams(max_tokens=tokens_each), prompt="p"))
        for _ in range(concurrency)
    ]
    counts = await asyncio.gather(*(drain(s) for s in streams))
    elapsed = time.perf_counter() - t0
    assert sum(counts) == concurrency * tokens_each, (sum(counts), concurrency * tokens_each)
    await conn.close()
    await srv.close()
    return sum(counts) / elapsed


def throughput_bench(quick: bool) -> None:
    print("== tokens/s through the transport (test-double worker, uvloop, loopback) ==")
    total = 10_000 if quick else 50_000
    with tempfile.TemporaryDirectory() as tmp:
        for kind, url in (("tcp", "tcp://127.0.0.1:0"), ("unix", f"unix://{tmp}/bench.sock")):
            for conc in (1, 64, 1024):
                each = max(10, total // conc)
                rate = uvloop.run(throughput(url, conc, each))
                print(f"  {kind:4s} concurrency {conc:5d} x {each:6d} tokens: {rate:12,.0f} tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    codec_bench(args.quick)
    throughput_bench(args.quick)


if __name__ == "__main__":
    main()
