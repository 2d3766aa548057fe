"""What one ``quicserve bench`` client process costs, against ``quicserve serve --engine synthetic``.

Not a test: run it by hand (``python -m tests.bench_cli.client_cost [--url URL] [--duration 5]``).
For each protocol, non-streamed (16 tokens) and streamed (256 tokens) at concurrency 64, it
prints what was achieved and the client's own CPU: requests and tokens per CPU-second of the
client, which is what one client core could sustain if the server were not the limit (on a
small host the gateway and its worker share the cores with the client, so the achieved rate
is the server's). ``--profile`` prints where the client's time goes (cProfile, top functions).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import tempfile
from collections.abc import Iterator
from pathlib import Path

import orjson

from gateway.bench.cli import main as bench_main

CASES = [("http1", "--no-stream", 16), ("http1", "--stream", 256), ("h2", "--no-stream", 16), ("h2", "--stream", 256),
         ("grpc", "--no-stream", 16), ("grpc", "--stream", 256)]


@contextlib.contextmanager
def _gateway() -> Iterator[tuple[str, str]]:
    from tests.integration.test_gateway_e2e import start_gateway, stop_gateway

    with tempfile.TemporaryDirectory() as tmp:
        gw = start_gateway(Path(tmp))
        grpc = next(line.split("listening on ")[1].split()[0] for line in gw.lines if "grpc://" in line)
        try:
            yield gw.http, grpc
        finally:
            stop_gateway(gw)


def measure(http: str, grpc: str, duration: float, profile: bool) -> None:
    print(f"{'protocol':<8} {'mode':<12} {'req/s':>8} {'tok/s':>9} {'client CPU':>10} "
          f"{'req/CPU-s':>10} {'tok/CPU-s':>10}  errors")
    for proto, mode, out_len in CASES:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            argv = ["--protocol", proto, "--url", grpc if proto == "grpc" else http, mode, "--output-len",
                    str(out_len), "--input-len", "32", "--concurrency", "64", "--duration", str(duration),
                    "--progress", "off", "--result", f.name]
            prof = cProfile.Profile() if profile else None
            with contextlib.redirect_stdout(io.StringIO()):
                if prof is not None:
                    prof.enable()
                bench_main(argv)
                if prof is not None:
                    prof.disable()
            run = orjson.loads(Path(f.name).read_bytes())["runs"][0]
        s, c = run["summary"], run["client"]
        cpu = c["cpu_user_s"] + c["cpu_sys_s"]
        print(f"{proto:<8} {mode[2:] + f' {out_len}':<12} {s['request_throughput']:>8,.0f} "
              f"{s['output_throughput']:>9,.0f} {c['cpu_fraction_of_one_core']:>10.0%} "
              f"{s['completed'] / cpu:>10,.0f} {s['output_tokens'] / cpu:>10,.0f}  {s['errors'] or ''}")
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running gateway's http:// URL (default: start one); --grpc-url with it")
    p.add_argument("--grpc-url", default="grpc://127.0.0.1:50051")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    if a.url:
        measure(a.url, a.grpc_url, a.duration, a.profile)
    else:
        with _gateway() as (http, grpc):
            measure(http, grpc, a.duration, a.profile)


if __name__ == "__main__":
    main()
