"""What one ``quicserve bench`` client process costs, against ``quicserve serve --engine synthetic``.

Not a test: run it by hand (``python -m tests.bench_cli.client_cost [--duration 5] [--only http1]``).
For each protocol, non-streamed (16 tokens) and streamed (256 tokens) at concurrency 64, it
prints what was achieved and the client's own CPU: requests and tokens per CPU-second of the
client, which is what one client process (one core) could sustain if the server were not the
limit (on a small host the gateway and its worker share the cores with the client, so the
achieved rate is the server's), and whether that meets issue #34's bar: 3,000 non-streamed
requests/s and 50,000 streamed tokens/s. ``--profile`` prints where the client's time goes
(cProfile, top functions).
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

PROTOCOLS = ["http1", "h2", "h3", "grpc", "grpc-web"]
CASES = [(proto, mode, out_len) for proto in PROTOCOLS for mode, out_len in (("--no-stream", 16), ("--stream", 256))]
BAR_REQUESTS, BAR_TOKENS = 3_000, 50_000  # per second, one client process (issue #34)


@contextlib.contextmanager
def _gateway() -> Iterator[dict[str, str]]:
    from tests.integration.test_gateway_e2e import start_gateway, stop_gateway

    with tempfile.TemporaryDirectory() as tmp:
        gw = start_gateway(Path(tmp))
        urls = {"http": gw.http}
        for line in gw.lines:
            if "grpc://" in line:
                urls["grpc"] = line.split("listening on ")[1].split()[0]
            elif "(h3, UDP)" in line:
                urls["h3"] = line.split("listening on ")[1].split()[0]
        try:
            yield urls
        finally:
            stop_gateway(gw)


def measure(urls: dict[str, str], duration: float, profile: bool, only: list[str]) -> None:
    print(f"{'protocol':<8} {'mode':<12} {'req/s':>8} {'tok/s':>9} {'client CPU':>10} "
          f"{'req/CPU-s':>10} {'tok/CPU-s':>10}  bar   errors")
    for proto, mode, out_len in CASES:
        if only and proto not in only:
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            url = urls.get(proto, urls["http"])
            argv = ["--protocol", proto, "--url", url, mode, "--insecure", "--output-len",
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
        per_req, per_tok = s["completed"] / cpu, s["output_tokens"] / cpu
        meets = per_tok >= BAR_TOKENS if mode == "--stream" else per_req >= BAR_REQUESTS
        print(f"{proto:<8} {mode[2:] + f' {out_len}':<12} {s['request_throughput']:>8,.0f} "
              f"{s['output_throughput']:>9,.0f} {c['cpu_fraction_of_one_core']:>10.0%} "
              f"{per_req:>10,.0f} {per_tok:>10,.0f}  {'yes' if meets else 'NO':<5} {s['errors'] or ''}")
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running gateway's http:// URL (default: start one); --grpc-url, --h3-url with it")
    p.add_argument("--grpc-url", default="grpc://127.0.0.1:50051")
    p.add_argument("--h3-url", default="https://127.0.0.1:8443")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--only", nargs="+", choices=PROTOCOLS, default=[])
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    if a.url:
        measure({"http": a.url, "grpc": a.grpc_url, "h3": a.h3_url}, a.duration, a.profile, a.only)
    else:
        with _gateway() as urls:
            measure(urls, a.duration, a.profile, a.only)


if __name__ == "__main__":
    main()
