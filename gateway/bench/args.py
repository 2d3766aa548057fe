"""The options of ``quicserve bench`` (and of ``quicserve bench compare``)."""

from __future__ import annotations

import argparse

__all__ = ["run_parser", "compare_parser", "PROTOCOLS"]

PROTOCOLS = ("http1", "h2", "h3", "grpc", "grpc-web")
_DEFAULT_URL = {"http1": "http://127.0.0.1:8080", "h2": "http://127.0.0.1:8080", "h3": "https://127.0.0.1:8443",
                "grpc": "grpc://127.0.0.1:50051"}


def default_url(protocol: str, over: str = "http1") -> str:
    return _DEFAULT_URL[over if protocol == "grpc-web" else protocol]


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicserve bench",
        description="Serving benchmark against any OpenAI-compatible server (and quicserve's gRPC API): "
                    "open or closed loop, TTFT/TPOT/ITL/E2E, goodput, a JSON result file and plots. "
                    "`quicserve bench compare A.json B.json` compares two results.")
    g = p.add_argument_group("server")
    g.add_argument("--url", help="server base URL (default http://127.0.0.1:8080; https://127.0.0.1:8443 for h3, "
                                 "grpc://127.0.0.1:50051 for grpc)")
    g.add_argument("--protocol", choices=PROTOCOLS, default="http1",
                   help="http1: HTTP/1.1 (http:// or https://); h2: HTTP/2 (h2c with prior knowledge on http://, "
                        "ALPN on https://); h3: HTTP/3 (https://, QUIC on that UDP port); grpc: quicserve.v1.Inference "
                        "(grpc:// or grpcs://); grpc-web: the same service as gRPC-Web (binary) over --grpc-web-over")
    g.add_argument("--grpc-web-over", choices=["http1", "h2", "h3"], default="http1",
                   help="the HTTP version a grpc-web run rides on (default http1)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (gRPC: a prompt or a conversation)")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the response (default; TTFT, TPOT and ITL need it)")
    g.add_argument("--model", default="tiny")
    g.add_argument("--api-key", default="", help="sent as Authorization: Bearer")
    g.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")
    g.add_argument("--cacert", metavar="PEM", help="trust this CA / self-signed certificate")
    g.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (default 600)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", metavar="RATES",
                   help="open loop: requests/s, 'inf' (all at once) or a sweep '5,10,20' (one run each)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 = Poisson, <1 burstier, >1 steadier")
    g.add_argument("--concurrency", type=int, help="closed loop: this many clients back to back "
                                                   "(the default, 8, when no rate or trace is given)")
    g.add_argument("--max-concurrency", type=int, help="open loop: at most this many requests in flight")
    g.add_argument("--trace", metavar="JSONL", help="arrivals from a trace: {'timestamp': s, 'input_length', "
                                                    "'output_length'} per line")
    g.add_argument("--trace-time-unit", choices=["s", "ms"], default="s")
    g.add_argument("--warmup", type=float, default=0.0, metavar="S",
                   help="requests started in the first S seconds are not counted")
    g.add_argument("--duration", type=float, metavar="S", help="stop starting requests after warm-up + S")
    g.add_argument("--num-requests", type=int, metavar="N",
                   help="measured requests per run (default 200 when no duration or trace)")
    g.add_argument("--processes", type=int, default=1,
                   help="client processes (the rate, concurrency and count are split between them)")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["random", "shared-prefix", "sharegpt"], default="random")
    g.add_argument("--dataset-path", metavar="JSON", help="a ShareGPT-format file (--dataset sharegpt)")
    g.add_argument("--num-prompts", type=int, help="distinct requests prepared (default: the request count, "
                                                   "at most 1000; they are reused in turn)")
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    g.add_argument("--output-len", "--max-tokens", type=int, dest="output_len",
                   help="max_tokens (default 128; sharegpt: the length of each reply in the file)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 +- r)")
    g.add_argument("--tenants", type=int, default=8, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    g.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens of each user turn")
    g.add_argument("--zipf", type=float, default=1.0, help="shared-prefix: tenant popularity exponent")
    g.add_argument("--turns", type=int, default=1, help="shared-prefix: turns per session")
    g.add_argument("--sessions", type=int, default=8, help="shared-prefix: sessions interleaved at a time")
    g.add_argument("--tokenizer", default="byte",
                   help="'byte' (quicserve's tiny model) or a Hugging Face tokenizer dir / tokenizer.json")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, quicserve)")
    g.add_argument("--min-tokens", type=int, default=0, help="send min_tokens (vLLM; quicserve refuses it)")
    g.add_argument("--temperature", type=float)

    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (keys ttft, tpot, itl, e2e)")
    g.add_argument("--result", metavar="JSON", help="write the result file here")
    g.add_argument("--plots", metavar="DIR", help="draw PNG plots into DIR")
    g.add_argument("--label", default="", help="name of this result in comparisons (default: the server URL)")
    g.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="a progress bar (auto: when stderr is a terminal)")
    g.add_argument("--raw-out", help=argparse.SUPPRESS)  # child of --processes: write the runs here
    g.add_argument("--start-at", type=float, help=argparse.SUPPRESS)  # child: start at this Unix time
    return p


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quicserve bench compare",
                                description="Compare two result files: medians with bootstrap confidence "
                                            "intervals, throughputs, and one plot of both.")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--plot", metavar="PNG", help="draw both latency CDFs on one figure here")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    return p
