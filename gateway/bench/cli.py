"""``quicserve bench``: run a serving benchmark; ``quicserve bench compare A.json B.json``.

    quicserve bench --url http://127.0.0.1:8080 --request-rate 5,10,20 --num-requests 300 \\
        --dataset sharegpt --dataset-path conversations.json --goodput ttft:500 tpot:50 \\
        --result r.json --plots plots/
    quicserve bench --protocol h2 --concurrency 32 --duration 30 --no-stream
    quicserve bench --protocol h3 --url https://127.0.0.1:8443 --insecure --request-rate 50
    quicserve bench --protocol grpc-web --grpc-web-over h2 --url http://127.0.0.1:8080
    quicserve bench compare quicserve.json other.json --plot both.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from .args import compare_parser, default_url, run_parser
from .report import format_run
from .results import result_doc, write_result
from .runner import LoadSpec, RunOutcome, inf_safe
from .stats import parse_slos, summarize

__all__ = ["main", "run_all", "run_json"]


def _specs(a: argparse.Namespace) -> list[tuple[str, LoadSpec]]:
    from .arrivals import parse_rates

    common: dict[str, Any] = {"warmup": a.warmup, "duration": a.duration, "num_requests": a.num_requests,
                              "seed": a.seed, "max_concurrency": a.max_concurrency, "burstiness": a.burstiness}
    if a.trace:
        return [("trace", LoadSpec(arrivals=[e.at for e in _trace(a)], **common))]
    if a.request_rate:
        return [(f"rate {r:g}/s", LoadSpec(rate=r, **common)) for r in parse_rates(a.request_rate)]
    return [(f"concurrency {a.concurrency}", LoadSpec(concurrency=a.concurrency, **common))]


def _trace(a: argparse.Namespace) -> list[Any]:
    from .arrivals import load_trace

    return load_trace(a.trace, time_unit=0.001 if a.trace_time_unit == "ms" else 1.0)


def _requests(a: argparse.Namespace) -> list[Any]:
    from . import data

    counter = data.load_counter(a.tokenizer)
    out_len = a.output_len or 128
    if a.trace:
        entries = _trace(a)
        if any(e.input_len is not None for e in entries) and a.dataset == "random":
            out = []
            for i, e in enumerate(entries):
                (r,) = data.random_requests(1, input_len=e.input_len or a.input_len,
                                            output_len=e.output_len or out_len, seed=a.seed + i, counter=counter)
                out.append(r)
            return out
    n = a.num_prompts or min(a.num_requests or 1000, 1000)
    if a.dataset == "sharegpt":
        if not a.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        return data.sharegpt_requests(a.dataset_path, n, seed=a.seed, output_len=a.output_len, counter=counter)
    if a.dataset == "shared-prefix":
        return data.shared_prefix_requests(n, tenants=a.tenants, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
                                           output_len=out_len, zipf=a.zipf, turns=a.turns,
                                           sessions=a.sessions, seed=a.seed, counter=counter)
    return data.random_requests(n, input_len=a.input_len, output_len=out_len, range_ratio=a.range_ratio,
                                seed=a.seed, counter=counter)


def run_json(label: str, spec: LoadSpec, out: RunOutcome, warmup: float, slos: dict[str, float]) -> dict[str, Any]:
    mode = "trace" if spec.arrivals is not None else "open" if spec.rate is not None else "closed"
    return {"label": label, "mode": mode, "rate": inf_safe(spec.rate), "burstiness": spec.burstiness,
            "concurrency": spec.concurrency, "max_concurrency": spec.max_concurrency, "warmup_s": warmup,
            "started_unix": out.started_unix, "summary": summarize(out.records, warmup=warmup, slos=slos),
            "client": out.client_json(), "records": [r.to_json() for r in out.records]}


async def run_all(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run the arguments ask for (one per rate of a sweep), with one sender for all."""
    from .bodies import BodyOptions
    from .progress import Progress, want_progress
    from .runner import run_load
    from .senders import make_sender, prepare_all

    slos = parse_slos(a.goodput)
    specs = _specs(a)
    requests = _requests(a)
    sender = make_sender(a.protocol, a.url, endpoint=a.endpoint, stream=a.stream, api_key=a.api_key,
                         timeout=a.timeout, insecure=a.insecure, cacert=a.cacert,
                         concurrency_hint=a.max_concurrency or a.concurrency or 64, over=a.grpc_web_over)
    o = BodyOptions(a.model, a.endpoint, a.stream, a.ignore_eos, a.min_tokens, a.temperature)
    prepared = prepare_all(sender, a.protocol, requests, o)
    if a.start_at:
        await asyncio.sleep(max(0.0, a.start_at - time.time()))
    runs = []
    try:
        for label, spec in specs:
            total = spec.num_requests or (len(spec.arrivals) if spec.arrivals is not None else None)
            with Progress(want_progress(a.progress) and not a.raw_out, label, total) as bar:
                out = await run_load(sender, prepared, spec, progress=bar.advance)
            runs.append(run_json(label, spec, out, a.warmup, slos))
    finally:
        await sender.close()
    return runs


def _check(a: argparse.Namespace) -> None:
    a.url = (a.url or default_url(a.protocol, a.grpc_web_over)).rstrip("/")
    http = a.grpc_web_over if a.protocol == "grpc-web" else a.protocol
    if a.protocol == "grpc" and not a.url.startswith(("grpc://", "grpcs://")):
        raise ValueError("--protocol grpc takes a grpc:// or grpcs:// URL")
    if http == "h3" and not a.url.startswith("https://"):
        raise ValueError("HTTP/3 takes an https:// URL (QUIC is always TLS; the port is the server's UDP port)")
    if a.protocol != "grpc" and not a.url.startswith(("http://", "https://")):
        raise ValueError(f"--protocol {a.protocol} takes an http:// or https:// URL")
    if a.request_rate and a.concurrency:
        raise ValueError("give --request-rate (open loop) or --concurrency (closed loop), not both")
    if a.trace and (a.request_rate or a.concurrency):
        raise ValueError("a --trace sets the arrivals: no --request-rate or --concurrency with it")
    if not (a.request_rate or a.trace) and not a.concurrency:
        a.concurrency = 8
    if a.num_requests is None and a.duration is None and not a.trace:
        a.num_requests = 200
    if a.processes < 1:
        raise ValueError("--processes must be at least 1")
    parse_slos(a.goodput)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        from .compare import compare_main

        return int(compare_main(compare_parser().parse_args(argv[1:])))
    a = run_parser().parse_args(argv)
    try:
        _check(a)
        if a.processes > 1:
            from .procs import run_processes

            runs = run_processes(a, argv)
        else:
            import uvloop

            runs = uvloop.run(run_all(a))
    except (ValueError, OSError) as e:
        print(f"quicserve bench: {e}", file=sys.stderr)
        return 2
    if a.raw_out:
        write_result(a.raw_out, {"runs": runs})
        return 0
    for run in runs:
        print(format_run(run))
    doc = result_doc({k: v for k, v in vars(a).items() if k not in ("raw_out", "start_at")}, runs,
                     a.label or f"{a.protocol}{'/' + a.grpc_web_over if a.protocol == 'grpc-web' else ''} {a.url}")
    if a.result:
        write_result(a.result, doc)
        print(f"result: {a.result}")
    if a.plots:
        from .plots import draw_result

        for path in draw_result(doc, a.plots):
            print(f"plot: {path}")
    return 0 if runs and all(r["summary"]["completed"] for r in runs) else 1

