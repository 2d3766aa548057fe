"""The synthetic engine's cost model and injected faults through the real thing: `quicserve serve
--engine synthetic --worker-option=...` (a gateway process and its worker child) and httpx.

- a long prompt's second request, sharing its prefix, reaches its first token sooner by the
  modelled prefill time of the tokens the prefix cache now serves;
- ``synthetic_error_rate`` ends about that share of requests with a clear 500 (a JSON error, or an
  SSE error event after ``synthetic_error_after`` tokens), and the gateway goes on serving;
- a bad or unknown option stops ``quicserve serve`` before any worker starts, naming the key.
"""

from __future__ import annotations

import math
import random
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from inference.synthetic import SyntheticFaults
from inference.tokenizer import ByteTokenizer
from transport.common.prefix import chain_hashes
from transport.common.worker_options import WorkerOptions

from .test_gateway_e2e import REPO, start_gateway, stop_gateway

pytestmark = pytest.mark.timeout(120)
BLOCK = WorkerOptions().block_size
PREFILL_US, STEP_MS = 200.0, 1.0


def _first_token(client: httpx.Client, prompt: str) -> tuple[float, int]:
    """Seconds to the first streamed text, and the usage's cached prompt tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.monotonic()
    ttft, cached = None, None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = orjson.loads(line[6:])
            if ttft is None and ev["choices"] and ev["choices"][0]["text"]:
                ttft = time.monotonic() - t0
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ttft is not None and cached is not None
    return ttft, cached


def _cached_blocks(first: list[int], second: list[int]) -> int:
    """Full blocks of ``second`` that ``first`` left in the prefix cache (the chain both sides hash;
    at least one prompt token is always computed)."""
    a, b = chain_hashes(first, BLOCK), chain_hashes(second, BLOCK, limit=(len(second) - 1) // BLOCK)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_shared_prefix_cuts_the_second_requests_ttft_by_the_modelled_prefill(tmp_path: Path) -> None:
    """Three pairs of prompts: ~1600 shared bytes, then different questions. The first of a pair prefills
    every token at 200 us (~320 ms); the second only what follows its cached blocks (~16 tokens, ~3 ms).
    The modelled saving S is ~100x what the rest of the path adds on loopback (a few ms, HTTP to
    worker and back), so the measured saving must equal S to within S/2: a quarter of a second of
    unmodelled delay in one request of a pair would be needed to fail it; the median of the three
    pairs is checked."""
    g = start_gateway(tmp_path, "--no-tls", f"--worker-option=synthetic_prefill_us_per_token={PREFILL_US}",
                      f"--worker-option=synthetic_step_ms={STEP_MS}", "--worker-option=batch_window=fixed:0")
    tok = ByteTokenizer()
    measured, modelled = [], []
    try:
        with httpx.Client(base_url=g.http, timeout=30) as c:
            _first_token(c, "warm up")  # the first connection and the worker's first step
            for i in range(3):
                rng = random.Random(i)
                shared = "".join(rng.choice(string.ascii_letters + " ") for _ in range(1600))
                p1, p2 = shared + " What comes next?", shared + " And after that?"
                t1, cached1 = _first_token(c, p1)
                t2, cached2 = _first_token(c, p2)
                ids1, ids2 = tok.encode(p1), tok.encode(p2)
                assert cached1 == 0 and cached2 == _cached_blocks(ids1, ids2) * BLOCK > 1500
                m1 = (STEP_MS + PREFILL_US / 1e3 * len(ids1)) / 1e3  # one sequence in the step
                m2 = (STEP_MS + PREFILL_US / 1e3 * (len(ids2) - cached2)) / 1e3
                assert t1 >= m1 and t2 >= m2  # a step sleeps at least what it models
                measured.append(t1 - t2)
                modelled.append(m1 - m2)
                print(f"pair {i}: TTFT first {t1 * 1e3:.1f} ms (modelled {m1 * 1e3:.1f}), second "
                      f"{t2 * 1e3:.1f} ms (modelled {m2 * 1e3:.1f}, {cached2} of {len(ids2)} tokens cached)")
    finally:
        assert stop_gateway(g) == 0
    saving, s = statistics.median(measured), statistics.median(modelled)
    print(f"median saving {saving * 1e3:.1f} ms, modelled {s * 1e3:.1f} ms")
    assert abs(saving - s) <= s / 2


def _binomial_bound(n: int, p: float) -> float:
    return 4.5 * math.sqrt(n * p * (1 - p))  # a count outside it: probability ~1e-5


def test_injected_errors_come_at_the_configured_rate_as_clear_500s_and_the_gateway_goes_on(tmp_path: Path) -> None:
    """100 requests one after another on a fresh worker: its engine numbers them 1..100 in arrival
    order, so the seed picks exactly the requests SyntheticFaults predicts, about 30 of them."""
    n, rate, after, seed = 100, 0.3, 2, 7
    g = start_gateway(tmp_path, "--no-tls", f"--worker-option=synthetic_error_rate={rate}",
                      f"--worker-option=synthetic_error_after={after}", f"--worker-option=synthetic_fault_seed={seed}",
                      "--worker-option=synthetic_step_ms=1")  # fmt: skip
    faults = SyntheticFaults(error_rate=rate, error_after=after, seed=seed)
    message = f"synthetic fault: injected error after {after} tokens (synthetic_error_rate={rate:g})"
    try:
        with httpx.Client(base_url=g.http, timeout=30) as c:
            statuses = []
            for i in range(n):
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 4})
                statuses.append(r.status_code)
                if r.status_code == 500:
                    assert r.json()["error"] == {"message": message, "type": "server_error", "param": None,
                                                 "code": "internal_error"}  # fmt: skip
                else:
                    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            errors = statuses.count(500)
            print(f"{errors} of {n} requests ended with the injected error (rate {rate})")
            assert abs(errors - n * rate) <= _binomial_bound(n, rate)
            assert [s == 500 for s in statuses] == [faults.request_fault(i) is not None for i in range(1, n + 1)]
            # Streaming: the doomed request streams `after` tokens, then one SSE error event.
            nxt = next(i for i in range(n + 1, n + 100) if faults.request_fault(i) is not None)
            for i in range(n + 1, nxt + 1):
                body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": 8, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    events = [orjson.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
                if i < nxt:
                    assert "error" not in events[-1] and len("".join(texts)) == 8
                else:
                    assert len("".join(texts)) == after
                    assert events[-1] == {"error": {"message": message, "type": "server_error", "param": None,
                                                    "code": "internal_error", "status": 500}}  # fmt: skip
            pid = g.worker_pid
            assert c.get("/readyz").status_code == 200
            ok = sum(c.post("/v1/completions", json={"model": "tiny", "prompt": "still here", "max_tokens": 2})
                     .status_code == 200 for _ in range(10))  # fmt: skip
            assert ok >= 1 and g.worker_pid == pid  # the same worker serves on: no restart
    finally:
        assert stop_gateway(g) == 0


@pytest.mark.parametrize(("option", "why"), [
    ("synthetic_error_rate=2", "workers.synthetic_error_rate: must be a share in [0, 1], got 2.0"),
    ("synthetic_slowdown=-1", "workers.synthetic_slowdown: must be > 0, got -1.0"),
    ("synthetic_eror_rate=0.1", "unknown setting workers.synthetic_eror_rate"),
])  # fmt: skip
def test_a_bad_synthetic_option_stops_serve_before_any_worker_starts(tmp_path: Path, option: str, why: str) -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0",
                        "--no-tls", "--state-dir", str(tmp_path), f"--worker-option={option}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and why in r.stderr, r.stderr
