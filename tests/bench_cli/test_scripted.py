"""TTFT, TPOT, ITL and E2E against a scripted server whose token gaps are known exactly.

The script (``Script`` defaults): tokens at 50, 70, 100, 140 and 150 ms after the request
arrives, the end (usage, ``[DONE]``) at 160 ms. So, by vLLM's definitions:
TTFT = 50 ms; ITL = 20, 30, 40, 10 ms; E2E = 160 ms; TPOT = (160 - 50) / (5 - 1) = 27.5 ms.
Not streamed, the whole answer at 160 ms: TTFT = E2E = 160 ms, no ITL or TPOT.
"""

from __future__ import annotations

import pytest

from gateway.bench.bodies import BodyOptions, grpc_body, openai_body
from gateway.bench.data import random_requests
from gateway.bench.exchange import grpc_web_exchange, openai_exchange
from gateway.bench.grpc_web import frame_body
from gateway.bench.http1 import HTTP1Sender
from gateway.bench.runner import LoadSpec, Prepared, run_load
from gateway.bench.stats import parse_slos, summarize

from .scripted_server import Script, ScriptClock, start_scripted

MS = 1e-3


async def _run(script: Script, *, stream: bool = True, endpoint: str = "completions", n: int = 3,
               timeout: float = 10.0, slos: str = "") -> tuple[list, dict]:  # type: ignore[type-arg]
    clock = ScriptClock()
    srv = await start_scripted(script, clock)
    web = endpoint == "grpc-web"
    exchange = grpc_web_exchange(stream=stream) if web else openai_exchange(endpoint, stream=stream)
    sender = HTTP1Sender(f"http://127.0.0.1:{srv.port}", exchange, timeout=timeout, now=clock)
    reqs = random_requests(2, input_len=10, output_len=5)
    o = BodyOptions("m", "completions" if web else endpoint, stream)
    prepared = [Prepared(sender.prepare(frame_body(grpc_body(r, o)) if web else openai_body(r, o)), 10, 5)
                for r in reqs]
    try:
        out = await run_load(sender, prepared, LoadSpec(concurrency=1, num_requests=n), now=clock)
    finally:
        await sender.close()
        await srv.close()
    return out.records, summarize(out.records, slos=parse_slos([slos]) if slos else None)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "grpc-web"])
async def test_streamed_figures_are_the_scripts_gaps(endpoint: str) -> None:
    records, s = await _run(Script(), endpoint=endpoint)
    assert [r.error for r in records] == ["", "", ""]
    for r in records:
        assert r.ttft == pytest.approx(50 * MS, abs=1e-9)
        assert r.itl == pytest.approx([20 * MS, 30 * MS, 40 * MS, 10 * MS], abs=1e-9)
        assert r.e2e == pytest.approx(160 * MS, abs=1e-9)
        assert r.tpot == pytest.approx(27.5 * MS, abs=1e-9)
        assert (r.output_tokens, r.prompt_tokens) == (5, 7)  # the server's usage
    ttft, tpot, itl, e2e = (s[f"{m}_ms"] for m in ("ttft", "tpot", "itl", "e2e"))
    assert ttft["median"] == pytest.approx(50) and ttft["p99"] == pytest.approx(50)
    assert tpot["mean"] == pytest.approx(27.5)
    assert itl["count"] == 12 and itl["mean"] == pytest.approx(25) and itl["median"] == pytest.approx(25)
    assert itl["p90"] == pytest.approx(40) and min(min(r.itl) for r in records) == pytest.approx(10 * MS)
    assert e2e["median"] == pytest.approx(160)
    assert s["completed"] == 3 and s["output_tokens"] == 15
    # closed loop, one client: three requests back to back, 160 ms each on the script's clock
    assert s["duration_s"] == pytest.approx(0.48, abs=1e-6)
    assert s["request_throughput"] == pytest.approx(3 / 0.48)


@pytest.mark.parametrize("endpoint", ["completions", "grpc-web"])
async def test_whole_response_has_ttft_equal_to_e2e_and_no_gaps(endpoint: str) -> None:
    records, s = await _run(Script(), stream=False, endpoint=endpoint)
    assert all(r.ttft == pytest.approx(160 * MS) and r.e2e == pytest.approx(160 * MS) for r in records)
    assert all(r.itl == [] and r.tpot is None and r.output_tokens == 5 for r in records)
    assert s["tpot_ms"]["count"] == 0 and s["itl_ms"]["count"] == 0


async def test_goodput_counts_requests_within_every_slo() -> None:
    _, s = await _run(Script(), slos="ttft:50 tpot:28")
    assert s["goodput"]["requests"] == 3
    _, s = await _run(Script(), slos="ttft:50 tpot:27")  # TPOT is 27.5 ms: none meets it
    assert s["goodput"]["requests"] == 0 and s["goodput"]["fraction"] == 0


async def test_without_usage_the_text_chunks_are_counted() -> None:
    records, _ = await _run(Script(usage=False), n=1)
    assert records[0].output_tokens == 5 and records[0].prompt_tokens == 10  # the client's own estimate


@pytest.mark.parametrize(("script", "kind"), [
    (Script(status=503), "http_503"),
    (Script(done=False), "incomplete_stream"),
    (Script(cut=True), "connection"),
    (Script(hang=True), "timeout"),
])
async def test_errors_by_kind(script: Script, kind: str) -> None:
    records, s = await _run(script, n=2, timeout=0.3)
    assert [r.error for r in records] == [kind, kind]
    assert s["errors"] == {kind: 2} and s["completed"] == 0 and s["failed"] == 2
    assert s["ttft_ms"]["count"] == 0


@pytest.mark.parametrize(("script", "kind"), [
    (Script(grpc_status=8), "grpc_RESOURCE_EXHAUSTED"),
    (Script(grpc_status=4), "timeout"),
    (Script(done=False), "incomplete_stream"),
    (Script(status=503), "http_503"),
])
@pytest.mark.parametrize("stream", [True, False])
async def test_grpc_web_errors_by_kind(script: Script, kind: str, stream: bool) -> None:
    records, s = await _run(script, endpoint="grpc-web", stream=stream, n=2)
    assert [r.error for r in records] == [kind, kind]
    assert s["errors"] == {kind: 2} and s["completed"] == 0
    if kind.startswith("grpc_"):
        assert records[0].detail == "scripted refusal"  # grpc-message, percent-decoded
