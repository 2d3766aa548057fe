"""``quicserve bench`` against an OpenAI-compatible server that is not quicserve: Hugging Face's
``transformers serve`` (FastAPI + uvicorn, from PyPI: ``transformers[serving]``, in the test extra),
started here on a tiny model written here (``tiny_hf_model``: random weights, a tokenizer trained on
a sentence, no end-of-sequence token, so every answer runs to max_tokens). Nothing is downloaded.

The figures are checked against the server's own counts: its access log (one line a request, with
its status) and its request log (``--enable-log-requests``: the prompt tokens it counted), and the
prompt tokens it reports in ``usage`` against the bench's own count with the same tokenizer.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.bench.cli import main as bench_main
from gateway.bench.data import load_counter, random_requests
from tests.integration.test_gateway_e2e import REPO, start_gateway, stop_gateway

from .tiny_hf_model import write_tiny_model

pytest.importorskip("fastapi", reason="transformers serve needs transformers[serving] (the test extra)")
pytest.importorskip("uvicorn", reason="transformers serve needs transformers[serving] (the test extra)")

OUT = 8


@dataclass
class Other:
    url: str
    model: str
    log: Path

    def requests(self, path: str) -> int:
        """Requests to ``path`` the server answered with 200, by its access log."""
        return self.log.read_text().count(f'"POST {path} HTTP/1.1" 200')

    def prompt_tokens(self) -> list[int]:
        """Prompt tokens of every generation request, as the server counted them (its request log)."""
        return [int(n) for n in re.findall(r", (\d+) prompt tokens, generate", self.log.read_text())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Other]:
    tmp = tmp_path_factory.mktemp("other")
    model, log = tmp / "model", tmp / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    write_tiny_model(model)
    port = _free_port()
    serve = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--device", "cpu", "--enable-log-requests", "--log-level", "info", str(model)]
    with log.open("w") as out:
        proc = subprocess.Popen(serve, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"transformers serve exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"transformers serve not ready: {log.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield Other(url, str(model), log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _bench(other: Other, tmp: Path, *args: str) -> dict:  # type: ignore[type-arg]
    result = tmp / "r.json"
    assert bench_main(["--url", other.url, "--model", other.model, "--output-len", str(OUT), "--progress", "off",
                       "--result", str(result), *args]) == 0
    (run,) = orjson.loads(result.read_bytes())["runs"]
    return dict(run)


def test_streamed_completions_against_transformers_serve(other: Other, tmp_path: Path) -> None:
    n, before, logged = 8, other.requests("/v1/completions"), len(other.prompt_tokens())
    run = _bench(other, tmp_path, "--tokenizer", other.model, "--input-len", "20", "--concurrency", "2",
                 "--num-requests", str(n), "--endpoint", "completions", "--stream")
    s, records = run["summary"], run["records"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (n, 0, n * OUT)
    assert other.requests("/v1/completions") - before == n
    # the server's prompt counts (its log, and the usage the bench recorded) are the bench's own, made
    # with the same tokenizer on the same prompts
    mine = random_requests(n, input_len=20, output_len=OUT, seed=0, counter=load_counter(other.model))
    assert [r["prompt_tokens"] for r in sorted(records, key=lambda r: r["index"])] == [q.prompt_len for q in mine]
    assert sorted(other.prompt_tokens()[logged:]) == sorted(r["prompt_tokens"] for r in records)
    assert s["input_tokens"] == sum(q.prompt_len for q in mine)
    # streamed: the first text before the end; this server sends a token's text as it comes, or
    # (when two requests share it) several tokens' in one event, so there are gaps, at most one a token
    assert all(0 < r["ttft"] <= r["e2e"] and len(r["itl"]) <= OUT - 1 for r in records)
    assert s["ttft_ms"]["count"] == n and 0 < s["itl_ms"]["count"] <= n * (OUT - 1)


def test_whole_chat_completions_against_transformers_serve(other: Other, tmp_path: Path) -> None:
    n, before, logged = 6, other.requests("/v1/chat/completions"), len(other.prompt_tokens())
    run = _bench(other, tmp_path, "--endpoint", "chat", "--no-stream", "--concurrency", "3", "--num-requests",
                 str(n), "--input-len", "12")
    s, records = run["summary"], run["records"]
    assert (s["completed"], s["output_tokens"]) == (n, n * OUT)
    assert other.requests("/v1/chat/completions") - before == n
    assert sorted(other.prompt_tokens()[logged:]) == sorted(r["prompt_tokens"] for r in records)
    assert all(r["ttft"] == r["e2e"] and not r["itl"] for r in records)


def _readme_commands() -> list[list[str]]:
    """The three commands of the README's Benchmarking section, as argument lists."""
    section = (REPO / "README.md").read_text().split("\n## Benchmarking\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = (line.strip() for line in block.replace("\\\n", " ").splitlines())
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def test_the_readmes_three_commands_compare_quicserve_with_it(other: Other, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """As written, but for the servers' URLs, the other's model, and less load (fewer, shorter requests)."""
    first, second, third = _readme_commands()
    assert first[:2] == second[:2] == ["quicserve", "bench"] and third[:3] == ["quicserve", "bench", "compare"]
    n, rates = 12, "20,40"
    less = ["--num-requests", str(n), "--request-rate", rates, "--output-len", str(OUT),
            "--dataset-path", str(REPO / "tests/bench_cli/data/sharegpt_sample.json"), "--progress", "off"]
    gw = start_gateway(tmp_path / "state")
    monkeypatch.chdir(tmp_path)
    try:
        before = other.requests("/v1/completions")
        assert bench_main([*first[2:], *less, "--url", gw.http]) == 0
        assert bench_main([*second[2:], *less, "--url", other.url, "--model", other.model]) == 0
        served = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(gw.http + "/metrics").text.splitlines()
                     if line.startswith("quicserve_requests_total{") and 'route="/v1/completions"' in line
                     and 'status="200"' in line)
    finally:
        assert stop_gateway(gw) == 0
    assert served == 2 * n  # both rates of the sweep, every request answered
    assert other.requests("/v1/completions") - before == 2 * n
    capsys.readouterr()
    assert bench_main(third[2:]) == 0
    table = capsys.readouterr().out.splitlines()
    assert f"A: http1 {gw.http}" in table[0] and f"B: http1 {other.url}" in table[0] and "95% CI" in table[0]
    assert sum(1 for line in table if line.startswith("rate 20/s")) == 6  # 4 medians + 2 throughputs
    for path in ("quicserve.json", "other.json", "plots/both.png", "plots/quicserve/sweep_latency.png",
                 "plots/other/latency_cdf.png"):
        assert (tmp_path / path).stat().st_size > 1000, path
    for name in ("quicserve.json", "other.json"):
        runs = orjson.loads((tmp_path / name).read_bytes())["runs"]
        assert [r["summary"]["completed"] for r in runs] == [n, n]
        assert all(r["summary"]["output_tokens"] == n * OUT for r in runs)
