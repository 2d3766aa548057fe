"""``quicserve bench`` against a real ``quicserve serve --engine synthetic``, over every protocol it
speaks, its counts checked against the server's own (/metrics); its plots checked as images.

The synthetic engine never ends a generation early (no end-of-sequence token), so every request
generates exactly max_tokens, and the server's token counter must move by exactly what the
bench counted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from gateway.bench.cli import main as bench_main
from tests.integration.test_gateway_e2e import REPO, Gateway, start_gateway, stop_gateway

SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"
N, OUT = 24, 12


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("state"), "--worker-option=synthetic_step_ms=1")
    yield g
    assert stop_gateway(g) == 0


def _listening(gw: Gateway, pattern: str) -> str:
    (url,) = {m.group(1) for line in gw.lines if (m := re.search(pattern, line))}
    return url


def _url(gw: Gateway, http: str, tls: bool) -> str:
    if http == "grpc":
        return _listening(gw, r"listening on (grpc://\S+)")
    if http == "h3":
        return _listening(gw, r"listening on (https://\S+) \(h3")
    return gw.https if tls else gw.http


def _counters(gw: Gateway) -> dict[str, float]:
    """Successful requests by protocol, output tokens in all."""
    out: dict[str, float] = {"tokens": 0.0}
    for line in httpx.get(gw.http + "/metrics").text.splitlines():
        generation = 'route="/v1/' in line or 'route="grpc:' in line  # not this very /metrics request
        if line.startswith("quicserve_requests_total{") and 'status="200"' in line and generation:
            proto = re.search(r'protocol="([^"]+)"', line)
            assert proto is not None
            out[proto.group(1)] = out.get(proto.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("quicserve_output_tokens_total{"):
            out["tokens"] += float(line.rsplit(" ", 1)[1])
    return out


CASES = [  # protocol (grpc-web: over which HTTP), TLS, stream, endpoint, the server's protocol label
    ("http1", False, True, "completions", "http/1.1"),
    ("http1", True, False, "chat", "http/1.1"),
    ("h2", False, True, "chat", "h2"),
    ("h2", True, True, "completions", "h2"),
    ("h2", False, False, "completions", "h2"),
    ("h3", True, True, "chat", "h3"),
    ("h3", True, False, "completions", "h3"),
    ("grpc", False, True, "completions", "grpc"),
    ("grpc", False, False, "chat", "grpc"),
    ("grpc-web/http1", False, True, "chat", "grpc"),  # gRPC-Web is counted as gRPC by the server
    ("grpc-web/http1", True, False, "completions", "grpc"),
    ("grpc-web/h2", False, True, "completions", "grpc"),
    ("grpc-web/h2", True, False, "chat", "grpc"),
    ("grpc-web/h3", True, True, "completions", "grpc"),
    ("grpc-web/h3", True, False, "chat", "grpc"),
]


@pytest.mark.parametrize(("protocol", "tls", "stream", "endpoint", "label"), CASES,
                         ids=[f"{c[0]}-{'tls' if c[1] else 'clear'}-{'stream' if c[2] else 'whole'}-{c[3]}"
                              for c in CASES])
def test_counts_match_the_servers(gw: Gateway, tmp_path: Path, protocol: str, tls: bool, stream: bool,
                                  endpoint: str, label: str) -> None:
    protocol, _, over = protocol.partition("/")
    url = _url(gw, over or protocol, tls)
    before = _counters(gw)
    result = tmp_path / "r.json"
    openai = protocol not in ("grpc", "grpc-web")
    rc = bench_main(["--protocol", protocol, "--grpc-web-over", over or "http1", "--url", url, "--endpoint", endpoint,
                     "--stream" if stream else "--no-stream", "--insecure", "--concurrency", "4",
                     "--num-requests", str(N), "--input-len", "16", "--output-len", str(OUT),
                     "--ignore-eos" if openai else "--seed=1", "--result", str(result), "--progress", "off"])
    assert rc == 0
    after = _counters(gw)
    (run,) = orjson.loads(result.read_bytes())["runs"]
    s = run["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (N, 0, N * OUT)
    assert after.get(label, 0) - before.get(label, 0) == N
    assert after["tokens"] - before["tokens"] == N * OUT
    assert len(run["records"]) == N and all(r["output_tokens"] == OUT for r in run["records"])
    if stream:  # a token a step: each request's text came in pieces, the first before the last
        assert s["ttft_ms"]["count"] == N and s["tpot_ms"]["count"] == N and s["itl_ms"]["count"] > 0
        assert all(0 < r["ttft"] < r["e2e"] for r in run["records"])
    else:
        assert s["itl_ms"]["count"] == 0 and s["ttft_ms"]["median"] == pytest.approx(s["e2e_ms"]["median"])
    assert run["client"]["cpu_fraction_of_one_core"] > 0


def _image_checks(path: Path, size: tuple[int, int]) -> None:
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.shape[:2] == (size[1], size[0]), path  # figsize x dpi
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    inked = np.mean(np.any(img[..., :3] < 0.9, axis=-1))
    assert len(colours) > 20 and 0.02 < inked < 0.6, (path, len(colours), inked)  # drawn on, not filled


def test_cli_sweep_in_two_processes_with_plots_and_compare(gw: Gateway, tmp_path: Path) -> None:
    before = _counters(gw)
    plots = tmp_path / "plots"
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "--url", gw.http, "--dataset", "sharegpt",
           "--dataset-path", str(SAMPLE), "--output-len", "8", "--request-rate", "150,300", "--num-requests", "60",
           "--processes", "2", "--goodput", "ttft:1000", "tpot:100", "--result", str(tmp_path / "a.json"),
           "--plots", str(plots), "--label", "two processes"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rate 150/s" in out.stdout and "rate 300/s" in out.stdout and "Request goodput" in out.stdout
    doc = orjson.loads((tmp_path / "a.json").read_bytes())
    assert doc["args"]["processes"] == 2 and doc["environment"]["python"]
    assert [r["rate"] for r in doc["runs"]] == [150.0, 300.0]
    for run in doc["runs"]:
        assert run["summary"]["completed"] == 60 and run["client"]["processes"] == 2
        assert run["summary"]["goodput"]["requests"] <= 60
        assert sorted(r["index"] for r in run["records"]) == list(range(60))
    after = _counters(gw)
    assert after["http/1.1"] - before.get("http/1.1", 0) == 120
    assert after["tokens"] - before["tokens"] == 120 * 8
    for name, size in (("latency_cdf", (1100, 800)), ("inflight", (1100, 500)), ("sweep_latency", (1100, 450)),
                       ("sweep_throughput", (800, 500))):
        _image_checks(plots / f"{name}.png", size)

    b = tmp_path / "b.json"
    assert bench_main(["--url", gw.http, "--protocol", "h2", "--request-rate", "150,300", "--num-requests", "40",
                       "--output-len", "8", "--result", str(b), "--progress", "off"]) == 0
    cmp = subprocess.run([sys.executable, "-m", "gateway.cli", "bench", "compare", str(tmp_path / "a.json"), str(b),
                          "--plot", str(tmp_path / "cmp.png"), "--resamples", "500"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    table = cmp.stdout.splitlines()
    assert "A: two processes" in table[0] and "95% CI" in table[0]
    assert sum(1 for line in table if line.startswith("rate 150/s")) == 6  # 4 medians + 2 throughputs
    assert any("median TTFT (ms)" in line and "[" in line for line in table)
    _image_checks(tmp_path / "cmp.png", (1100, 800))


def test_client_cost_bench_reports_its_rows(gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    """The client-cost bench (README: the client's cost) runs and reports each row; how fast is not
    checked here (it depends on the machine), only that each row was measured, without errors."""
    from tests.bench_cli.client_cost import CASES, measure

    urls = {"http": gw.http, "grpc": _url(gw, "grpc", False), "h3": _url(gw, "h3", True)}
    measure(urls, 0.2, False, ["http1", "grpc-web"])  # the others cost more time than they would show
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1], int(r[2])) for r in rows] == [(p, m[2:], n) for p, m, n in CASES if p in ("http1", "grpc-web")]
    for r in rows:
        assert len(r) == 9 and r[8] in ("yes", "NO"), r  # no errors column
        assert float(r[3].replace(",", "")) > 0 and float(r[7].replace(",", "")) > 0, r
