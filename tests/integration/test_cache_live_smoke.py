"""The live cache-routing bench's smoke run (#29): a small T2-shaped trace through a real
``quicserve serve`` of 4 synthetic workers routing by ``cache_aware`` (tests/bench/bench_cache_live.py's
own code path), after one warm-up request per tenant: every request is answered, and the hit
rate the workers report (usage ``cached_tokens``) is most of the ideal single cache's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.bench.bench_cache_live import Workers, live_trace, run_policy
from tests.bench.bench_cache_routing import T2, capacity_for
from tests.bench.cache_sim import oracle_hit_rate

SMALL = replace(T2, requests=30, tenants=8, common_tokens=256, context_tokens=512, query_tokens=64, output_tokens=4)


def test_cache_aware_live_reaches_most_of_the_oracles_hit_rate(tmp_path: Path) -> None:
    w = Workers().scaled(0.5)
    trace, start, blocks, _ = live_trace(SMALL, w, load=0.3, demand=0.73)
    oracle = oracle_hit_rate(trace, capacity_for(SMALL, 0.73) * 4, SMALL.block_size, start)
    r = run_policy("cache_aware", trace, w, blocks, tmp_path, start)
    assert r.failed == 0
    # a request whose tenant's holder is busy (the load bound) prefills a second copy elsewhere: most, not all
    assert r.hit_rate >= 0.75 * oracle, (r, oracle)
    assert 0 < r.ttft_p50 <= r.ttft_p95
