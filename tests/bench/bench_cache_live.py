"""Cache-aware routing live (issue #29): T2's requests against 4 synthetic workers behind a real
``quicserve serve``, one run per routing policy, the same trace each time.

The workers' cost model makes a request's prefill time its *uncached* prompt tokens: each engine
step sleeps ``step_ms + step_ms_per_seq * sequences + prefill_us * prefill tokens`` (the
synthetic engine's ``synthetic_*`` options), and the engine's own prefix cache (``num_blocks``:
T2's contexts are ``demand`` of the fleet's blocks, plus room for the running sequences) decides
what is cached. The client sends each prompt (token ids, so the trace's block chains are the
worker's) at its arrival time (open loop), streams the answer, and takes the time to the first
chunk and the answer's ``usage.prompt_tokens_details.cached_tokens``. The arrival rate is ``load``
of the fleet's capacity at the oracle's hit rate (:func:`tests.bench.bench_cache_routing.fleet_rate`
with the workers' cost model; one ideal LRU cache of the whole fleet's blocks).

Printed per policy: hit rate (cached / prompt tokens, as the workers report it), the same as a share
of the oracle's, p50 / p95 TTFT, p95 as a share of least loaded's, failures; then the simulator's
figures for the same trace and cost model beside them (its policies' models of the same ones).

    .venv/bin/python -m tests.bench.bench_cache_live [--requests 600] [--load 0.7]

``run_policy`` is what the smoke test (tests/integration/test_cache_live_smoke.py) calls.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import orjson

from gateway.routing.cache_policy import CostModel

from .bench_cache_routing import T2, capacity_for, fleet_rate, policies
from .cache_sim import SimResult, oracle_hit_rate, percentile, simulate
from .trace_gen import TraceRequest, TraceSpec, generate, warmup

REPO = Path(__file__).resolve().parents[2]
REPLICAS = 4
MAX_BATCH = 32  # the worker's default max_batch: sequences running at once
POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "cache_aware")
SIM_NAMES = {"round_robin": "round_robin", "least_loaded": "least_loaded", "prefix_affinity": "prefix_affinity",
             "cache_aware": "cost_based"}


@dataclass(frozen=True, slots=True)
class Workers:
    """The synthetic workers' cost model and cache."""

    step_ms: float = 15.0  # (the simulator's CostModel's defaults)
    step_ms_per_seq: float = 0.3
    prefill_us: float = 100.0
    step_tokens: int = 2048  # chunked prefill: tokens one step carries
    num_blocks: int = 0  # 0: sized from the trace (see the module)

    def scaled(self, k: float) -> Workers:
        """Every time ``k`` times longer (so a slow host's own overhead counts for less)."""
        return replace(self, step_ms=self.step_ms * k, step_ms_per_seq=self.step_ms_per_seq * k,
                       prefill_us=self.prefill_us * k)

    def cost(self) -> CostModel:
        return CostModel(prefill_s=self.prefill_us / 1e6, decode_s=self.step_ms / 1e3,
                         decode_seq_s=self.step_ms_per_seq / 1e3, chunk=self.step_tokens)


@dataclass(frozen=True, slots=True)
class LiveResult:
    policy: str
    hit_rate: float
    ttft_p50: float
    ttft_p95: float
    failed: int
    seconds: float


def config(policy: str, w: Workers, blocks: int) -> str:
    return f"""
[workers]
engine = "synthetic"
local = {REPLICAS}
num_blocks = {blocks}
step_tokens = {w.step_tokens}
synthetic_step_ms = {w.step_ms}
synthetic_step_ms_per_seq = {w.step_ms_per_seq}
synthetic_prefill_us_per_token = {w.prefill_us}
[routing]
policy = "{policy}"
cache_prefill_us_per_token = {w.prefill_us}
cache_step_ms = {w.step_ms}
"""


async def _one(client: httpx.AsyncClient, url: str, req: TraceRequest, t0: float) -> tuple[float, int, int] | None:
    """(time to first chunk, cached tokens, prompt tokens), or None if it failed."""
    assert req.tokens is not None
    await asyncio.sleep(max(0.0, t0 + req.t - time.monotonic()))
    body = {"model": "tiny", "prompt": req.tokens.tolist(), "max_tokens": req.output_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first = 0.0
    usage: dict[str, object] = {}
    try:
        async with client.stream("POST", url + "/v1/completions", content=orjson.dumps(body),
                                  headers={"content-type": "application/json"}) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not first:
                    first = time.monotonic() - sent
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError:
        return None
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    return first, int(details.get("cached_tokens", 0)), int(usage.get("prompt_tokens", 0))  # type: ignore[call-overload]


async def _drive(url: str, trace: Sequence[TraceRequest]) -> list[tuple[float, int, int] | None]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.monotonic() + 0.2
        return await asyncio.gather(*(_one(client, url, r, t0) for r in trace))


def run_policy(policy: str, trace: Sequence[TraceRequest], w: Workers, blocks: int, state: Path,
               measure_from: int = 0) -> LiveResult:
    """``trace`` through a real ``quicserve serve`` routing by ``policy``; figures over the requests
    from ``measure_from`` on."""
    from tests.integration.test_gateway_e2e import stop_gateway, wait_ready

    d = state / policy
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text(config(policy, w, blocks))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(d / "config.toml"), "--port", "0", "--no-tls",
           "--grpc-port", "-1", "--quic-port", "-1", "--state-dir", str(d), "--progress", "lines"]
    with (d / "gateway.log").open("w") as log:
        g = wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                        env={**os.environ, "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"}))
        try:
            deadline = time.monotonic() + 120
            while g.metric("quicserve_workers_ready") < REPLICAS:
                assert time.monotonic() < deadline, "the workers never all came up"
                time.sleep(0.1)
            time.sleep(0.5)  # the KV subscriptions' first (empty) sets
            start = time.monotonic()
            out = asyncio.run(_drive(g.http, trace))
            took = time.monotonic() - start
        finally:
            stop_gateway(g)
    done = [x for x in out[measure_from:] if x is not None]
    ttft = [x[0] for x in done]
    hit = sum(x[1] for x in done) / max(1, sum(x[2] for x in done))
    return LiveResult(policy, hit, percentile(ttft, 50), percentile(ttft, 95), len(out) - measure_from - len(done),
                      took)


def live_trace(spec: TraceSpec, w: Workers, load: float, demand: float) -> tuple[list[TraceRequest], int, int, float]:
    """(one request per tenant, paced at what the fleet prefills with nothing cached, then
    T2's requests at ``load`` of the fleet's capacity at the oracle's hit rate; where T2 starts;
    the blocks a worker has; T2's arrival rate)."""
    cap = capacity_for(spec, demand, REPLICAS)
    cost = w.cost()
    spec = replace(spec, vocab=256, keep_tokens=True)
    prompt = spec.common_tokens + spec.context_tokens + spec.query_tokens
    warm = warmup(spec, REPLICAS / cost.prefill_wait_s(prompt, 0))  # as fast as the fleet prefills them
    probe = generate(replace(spec, rate=1.0, keep_tokens=False))
    hit = oracle_hit_rate(warm + probe, cap * REPLICAS, spec.block_size, len(warm))
    rate = fleet_rate(spec, hit, load, cost, REPLICAS)
    gap = warm[-1].t + 2.0  # the warm-up's last prefill done
    trace = [replace(r, t=r.t + gap) for r in generate(replace(spec, rate=rate))]
    # room for every running sequence's own blocks (its query and output) beside the cache the demand sizes
    blocks = w.num_blocks or cap + MAX_BATCH * math.ceil((spec.query_tokens * 3 // 2 + spec.output_tokens)
                                                         / spec.block_size)
    return warm + trace, len(warm), blocks, rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--demand", type=float, default=0.73)
    ap.add_argument("--output-tokens", type=int, default=T2.output_tokens)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scale", type=float, default=2.0, help="every modelled time this many times the simulator's")
    args = ap.parse_args()
    w = Workers().scaled(args.scale)
    spec = replace(T2, requests=args.requests, output_tokens=args.output_tokens)
    trace, start, blocks, rate = live_trace(spec, w, args.load, args.demand)
    cap = capacity_for(spec, args.demand, REPLICAS)
    oracle = oracle_hit_rate(trace, cap * REPLICAS, spec.block_size, start)
    print(f"T2 live: {start} warm-up requests (one a tenant), then {len(trace) - start} over"
          f" {trace[-1].t - trace[start].t:.1f} s ({rate:.1f} req/s, load {args.load:.0%} at the oracle's hit rate);"
          f" {REPLICAS} synthetic workers of {blocks} blocks ({cap} for the demand {args.demand:.0%}, the rest for"
          f" running sequences); step {w.step_ms} ms + {w.step_ms_per_seq} ms a sequence + {w.prefill_us} us a"
          f" prefill token, {w.step_tokens} tokens a step; oracle hit rate {oracle:.3f}", flush=True)
    state = Path(tempfile.mkdtemp(prefix="bench_cache_live_"))
    results: list[LiveResult] = []
    try:
        for policy in args.policies.split(","):
            results.append(run_policy(policy, trace, w, blocks, state, start))
            print(f"  {policy}: {results[-1].seconds:.1f} s", flush=True)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    ll = next((r for r in results if r.policy == "least_loaded"), results[0])
    cost = w.cost()
    sims: dict[str, SimResult] = {}
    for mk in policies(REPLICAS, cap, cost):
        res = simulate(trace, mk, replicas=REPLICAS, capacity=cap, cost=cost, block_size=spec.block_size,
                       measure_from=start)
        sims[res.policy] = res
    print(f"{'policy':<18}{'hit':>7}{'/oracle':>9}{'p50 s':>8}{'p95 s':>8}{'p95/ll':>8}{'failed':>8}"
          f"   simulated: {'hit':>6}{'/oracle':>9}{'p50 s':>8}{'p90 s':>8}")
    for r in results:
        s = sims.get(SIM_NAMES.get(r.policy, ""))
        sim = f"{s.hit_rate:>6.3f}{s.hit_rate / oracle:>9.3f}{s.ttft_p50:>8.3f}{s.ttft_p90:>8.3f}" if s else ""
        print(f"{r.policy:<18}{r.hit_rate:>7.3f}{r.hit_rate / oracle:>9.3f}{r.ttft_p50:>8.3f}{r.ttft_p95:>8.3f}"
              f"{r.ttft_p95 / ll.ttft_p95:>8.3f}{r.failed:>8}              {sim}")


if __name__ == "__main__":
    main()
