"""Admission costs, same run: schema engines side by side, limiter decisions, the whole stage.

* Schema check of one OpenAI chat request (valid, the hot case): the
  reference ``jsonschema`` (2020-12), ``fastjsonschema`` (the same schema
  rewritten to draft-07, its newest draft: ``$defs`` -> ``definitions``) and
  ours (:class:`SchemaRegistry` on the shipped engine, wrapper included).
  Printed in µs per request and as a ratio to the fastest.
* Limiter decisions per second: a local sliding window, and Redis-leased (a
  real ``redis-server`` started here on loopback, its renewal loop running),
  each against the same offered load, half refused.
* The admission stage per request in a warm loop, through the pipeline's own entry
  (``admit_call`` on a fresh parsed body, then ``release_completion``; the parse is printed
  alone too): each part alone, then schema + admit + release with keys, two rate rules and
  shedding on.
* The done-when figure of #18, gateway CPU per non-streaming request with
  keys + limits + schema on against admission off, measured two ways:

  - ``--process`` (the figure the issue names, as #15 defines gateway CPU per
    request): two real ``quicserve serve --engine synthetic`` gateways of this
    tree, one with ``[admission] enabled = false`` and one with an API key and
    two rate rules, both pinned to the first CPU and loaded in turn by the
    load generator on the other (c=32, non-streaming and 16-token streams, the
    key sent to both), gateway process CPU from /proc per request, alternating
    slices (``bench_gateway_ab``'s keep mode); the paired ratio and best/best.
  - in-process (stricter, the default): both through the in-process gateway of
    ``bench_gateway_path`` (h1 parser, app, pool, transport, writer) in the
    same run, alternating rounds; only our Python is counted (no kernel, no
    socket), so the stage's share is about twice what it is in the real
    process. The median of the per-round ratios. (A warm loop flatters the
    stage: inside the gateway its code and data are cold at every request.)

    .venv/bin/python -m tests.bench.bench_admission [--n 20000] [--rounds 400] [--only-pipeline]
    .venv/bin/python -m tests.bench.bench_admission --process [--slices 20] [--duration 2] [--control]
    .venv/bin/python -m tests.bench.bench_admission --process --callgrind --slices 2 --duration 10

  With ``--callgrind`` both gateways run under valgrind at c=1 and the figure
  is the gateway's user-space instructions per request, exact and repeatable
  where CPU time on a shared VM moves by 10% from slice to slice.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.admission import Admission, AdmissionContext, AdmissionSettings, RateLimits, hash_key, parse_rule
from gateway.admission.redis_limits import RedisLeases
from gateway.admission.schema import SchemaRegistry, builtin_schema, compile_schema
from gateway.api.params import parse_chat
from gateway.http.types import Request

from ..gateway.admission.redis_server import redis_server

CHAT = orjson.loads(b"""{"model": "tiny", "messages": [
  {"role": "system", "content": "You are a helpful assistant."},
  {"role": "user", "content": "Write a haiku about rate limits."}],
  "max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "stream": false, "stop": ["\\n\\n"], "seed": 7}""")


def per_call_us(fn: Callable[[], Any], n: int, repeats: int = 7) -> float:
    """Best of ``repeats`` runs of ``n`` calls, CPU µs per call (process time: other processes on
    a shared host do not count; the best run is the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - t)
    return best / n * 1e6


def draft07(schema: Any) -> Any:
    """Our 2020-12 schema in draft-07 form for fastjsonschema (no 2020-12-only keywords are used)."""
    s = copy.deepcopy(schema)
    s["$schema"] = "http://json-schema.org/draft-07/schema#"
    s.pop("$id", None)
    s["definitions"] = s.pop("$defs")
    text = orjson.dumps(s).replace(b'"#/$defs/', b'"#/definitions/')
    return orjson.loads(text)


def bench_schemas(n: int) -> None:
    import fastjsonschema
    import jsonschema

    schema = builtin_schema("chat_completions.json")
    ref = jsonschema.Draft202012Validator(schema)
    fast = fastjsonschema.compile(draft07(schema))
    reg = SchemaRegistry()
    assert ref.is_valid(CHAT) and fast(CHAT) is not None
    reg.validate("/v1/chat/completions", "tiny", CHAT)
    rows = {
        "jsonschema (reference, 2020-12)": per_call_us(lambda: ref.is_valid(CHAT), max(n // 20, 200)),
        "fastjsonschema (draft-07 form)": per_call_us(lambda: fast(CHAT), n),
        f"ours: SchemaRegistry.validate ({reg.engine})": per_call_us(
            lambda: reg.validate("/v1/chat/completions", "tiny", CHAT), n),
    }
    check = reg.checker("/v1/chat/completions")
    assert check is not None
    rows["ours: SchemaRegistry.checker (bound once)"] = per_call_us(lambda: check(CHAT), n)
    raw = compile_schema(schema).fast
    rows["  the engine's own is_valid, no wrapper"] = per_call_us(lambda: raw(CHAT), n)
    fastest = min(rows.values())
    print("schema check, one valid chat request:")
    for name, us in rows.items():
        print(f"  {name:46s} {us:9.2f} µs   {us / fastest:7.2f}x the fastest")


def _decisions(limits: RateLimits, n: int, clock: Callable[[], float]) -> tuple[float, int]:
    values = {"client": "10.0.0.1"}
    admitted = 0
    t = time.process_time()
    for _ in range(n):
        if limits.check(values, 0.0, clock()).wait == 0.0:
            admitted += 1
    return n / (time.process_time() - t), admitted


async def _redis_decisions(url: str, n: int, rule: str) -> tuple[float, int, int]:
    leases = RedisLeases.from_url(url, prefix=f"bench-{time.time_ns()}:")
    limits = RateLimits([parse_rule(rule)], leases.make)
    task = asyncio.create_task(leases.run())
    rate = admitted = 0.0
    chunk = 100
    t = time.process_time()  # the renewals run in this process too, and count
    done = 0
    while done < n:  # yield to the loop between chunks so renewals run, as a gateway would
        r, a = _decisions(limits, chunk, leases.clock)  # the loop's clock: the request clock
        admitted += a
        done += chunk
        await asyncio.sleep(0)
    rate = done / (time.process_time() - t)
    task.cancel()
    trips = leases.round_trips
    await leases.close()
    return rate, int(admitted), trips


def bench_limiters(n: int) -> None:
    rule = "client requests 1000000/1s"
    local = RateLimits([parse_rule(rule)])
    rate, admitted = _decisions(local, n, time.perf_counter)
    print("limiter decisions per CPU second (one client, one rule):")
    print(f"  local sliding window                     {rate:12,.0f} /s   ({admitted} of {n} admitted)")
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        for name, text in (("window", rule), ("bucket", rule + " bucket")):
            try:
                rrate, radmitted, trips = asyncio.run(_redis_decisions(url, n, text))
            except ValueError as e:  # a tree whose Redis limits are windows only
                print(f"  Redis-leased {name}: {e}")
                continue
            print(f"  Redis-leased {name} (loop + redis-server) {rrate:12,.0f} /s   ({radmitted} of {n} admitted, "
                  f"{trips} round trips)   {rrate / rate:.2f}x local")


BENCH_KEY = "sk-bench-0123456789"


def bench_stage(n: int) -> float:
    """Per request: each part alone, then all of it; returns the all-on figure (µs)."""
    key = BENCH_KEY
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "keys.toml"
        f.write_text(f'[[keys]]\nid = "bench"\nsha256 = "{hash_key(key)}"\nmodels = ["tiny"]\n')
        big = 1 << 40
        parts = {
            "nothing on (shedding bound only)": AdmissionSettings(queue_limit=big),
            "API key": AdmissionSettings(keys_file=str(f), queue_limit=big),
            "2 rate rules (requests/key, tokens/model)": AdmissionSettings(
                limits=["client requests 100000000/1m", "model tokens 1e12/1m"], queue_limit=big),
            "keys + 2 rules": AdmissionSettings(
                keys_file=str(f), limits=["key requests 100000000/1m", "model tokens 1e12/1m"], queue_limit=big),
        }
        reg = SchemaRegistry()
        ctx = AdmissionContext(b"Bearer " + key.encode(), "10.0.0.1", "tiny", "/v1/chat/completions", 20, 64)
        # what the pipeline hands admission: the request (its headers as HTTP/1.1 parses them) and
        # the parsed body; admit_call is the pipeline's entry (its usual case in one frame)
        req = Request("POST", ctx.route, "", [(b"host", b"gw"), (b"content-type", b"application/json"),
                                             (b"authorization", ctx.authorization or b"")], b"", "http/1.1", "http",
                      (ctx.client or "", 5000))
        print("admission stage per request, warm loop, CPU µs (admit_call + release; schema where named):")
        figures = {}
        for name, settings in parts.items():
            adm = Admission.from_settings(settings)

            def one(adm: Admission = adm) -> None:
                now = time.time()
                g = parse_chat(CHAT, default_max_tokens=16, max_tokens_limit=4096, schema_checked=True)
                adm.release_completion(adm.admit_call(req, g, now), 40, now)

            figures[name] = per_call_us(one, n)
        figures["schema alone"] = per_call_us(lambda: reg.validate(ctx.route, ctx.model, CHAT), n)
        figures["parse alone (in both)"] = per_call_us(
            lambda: parse_chat(CHAT, default_max_tokens=16, max_tokens_limit=4096, schema_checked=True), n)
        adm = Admission.from_settings(parts["keys + 2 rules"])

        def everything() -> None:
            now = time.time()
            reg.validate(ctx.route, ctx.model, CHAT)
            g = parse_chat(CHAT, default_max_tokens=16, max_tokens_limit=4096, schema_checked=True)
            adm.release_completion(adm.admit_call(req, g, now), 40, now)

        figures["keys + 2 rules + schema (all on)"] = per_call_us(everything, n)
    for name, us in figures.items():
        print(f"  {name:42s} {us:7.2f} µs")
    return figures["keys + 2 rules + schema (all on)"]


def _stage_settings(keys_file: str) -> AdmissionSettings:
    """Keys + two rate rules (requests per key, tokens per model) + shedding: admission all on."""
    return AdmissionSettings(keys_file=keys_file, limits=["key requests 100000000/1m", "model tokens 1e12/1m"])


async def _pipeline_ab(rounds: int, concurrency: int, keys_file: str) -> dict[str, list[float]]:
    """Gateway CPU µs per non-streaming request, admission all on and all off, alternating rounds."""
    from gateway.admission.setup import build_admission
    from gateway.app import App
    from gateway.loadgen import chat_request
    from gateway.observability.metrics import GatewayMetrics
    from gateway.settings import ApiSettings

    from .bench_gateway_path import _clients, _round, _setup

    off_app, conn, worker, sink, off = await _setup(concurrency)  # App(pool): admission None
    parts = build_admission(_stage_settings(keys_file), "127.0.0.1")
    assert parts.stage is not None and parts.schemas is not None
    on_app = App(off_app.pool, GatewayMetrics(), ApiSettings(), admission=parts.stage,
                 validate=parts.schemas.validate)
    on = _clients(on_app.handle, concurrency)
    # the same bytes for both sides (the key is read only where keys are on)
    req = chat_request("127.0.0.1", 8080, stream=False, max_tokens=16, api_key=BENCH_KEY)
    sides = {"off": off, "on": on}
    for _ in range(max(5, rounds // 10)):
        for clients in sides.values():
            await _round(req, conn, worker, sink, clients, True)
    out: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            out[name].append(await _round(req, conn, worker, sink, sides[name], True) / concurrency * 1e6)
    return out


def bench_pipeline(rounds: int, concurrency: int = 32) -> float:
    """The done-when figure of #18: gateway CPU per non-streaming request (bench_gateway_path's
    in-process gateway, c=32, 16 tokens) with keys + 2 rate rules + shedding + the extra-schema
    registry on, against [admission] off (the built-in schemas are checked either way), same run,
    alternating rounds. Returns the median of the per-round ratios."""
    import statistics

    import uvloop

    from gateway.serve import tune_gc

    tune_gc()
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "keys.toml"
        f.write_text(f'[[keys]]\nid = "bench"\nsha256 = "{hash_key(BENCH_KEY)}"\nmodels = ["tiny"]\n')
        xs = uvloop.run(_pipeline_ab(rounds, concurrency, str(f)))
    ratios = [b / a for a, b in zip(xs["off"], xs["on"], strict=True)]
    ratio = statistics.median(ratios)
    print(f"gateway CPU per non-streaming request (in-process path, c={concurrency}, {rounds} alternating rounds):")
    for name in ("off", "on"):
        v = xs[name]
        q = statistics.quantiles(v, n=10)
        print(f"  admission {name:<4}{statistics.median(v):8.1f} µs median  {min(v):7.1f} best  "
              f"p10 {q[0]:.1f}  p90 {q[-1]:.1f}")
    best = min(xs["on"]) / min(xs["off"])
    print(f"  on/off: {ratio:.3f} (median of per-round ratios), {best:.3f} (best/best): our Python only, where "
          "admission's share is about twice a real process's (the issue's +15% figure: --process)")
    return ratio


BENCH_KEY_DIGEST = "ebadd1f77d7caaabf8b1160a2e3c3bdb38ff59c1452ebcbd8d7a31a53d3f9abb"  # hash_key(BENCH_KEY)
PROCESS_ON_ENV = [f'QUICSERVE_ADMISSION__KEYS=["bench:{BENCH_KEY_DIGEST}"]',
                  'QUICSERVE_ADMISSION__LIMITS=["key requests 100000000/1m", "model tokens 10000000000/1m"]']
PROCESS_OFF_ENV = ["QUICSERVE_ADMISSION__ENABLED=false"]


def bench_process(slices: int, duration: float, callgrind: bool = False, control: bool = False,
                  perf_stat: bool = False) -> float:
    """The issue's figure: real gateways of this tree, admission all on ("this") against all off
    ("baseline"), alternating slices of load (``bench_gateway_ab.keep_mode``); returns the
    non-streaming CPU ratio on/off, the worse of the paired ratio and the ratio of the medians.
    ``callgrind``: both under valgrind at c=1, and the figure is user-space instructions per
    request (exact; the CPU figures of such a run mean nothing). ``control``: a second admission-off gateway alternating with the two, whose ratio to
    the first is the run's own noise floor (A/A)."""
    import os
    import statistics

    from .bench_gateway import REPO
    from .bench_gateway_ab import SCENARIOS, keep_mode

    assert hash_key(BENCH_KEY) == BENCH_KEY_DIGEST
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2
    if pin:
        os.sched_setaffinity(0, cpus[1:])
    a = argparse.Namespace(rounds=slices, duration=duration, processes=2, api_key=BENCH_KEY, perf_stat=perf_stat,
                           callgrind=callgrind, concurrency=1 if callgrind else 32)
    print(f"gateway process per request, baseline = admission off, this = on (keys + 2 rules + schema), "
          f"{slices} alternating slices x {duration:g} s, c={a.concurrency}:")
    trees, envs = {"baseline": REPO, "this": REPO}, {"baseline": PROCESS_OFF_ENV, "this": PROCESS_ON_ENV}
    if control:
        trees["control"], envs["control"] = REPO, PROCESS_OFF_ENV
    runs = keep_mode(a, trees, envs, pin, cpus)
    unary = 0.0
    for i, (name, _) in enumerate(SCENARIOS):
        off, on = [x[i] for x in runs["baseline"]], [x[i] for x in runs["this"]]
        paired = statistics.median(y / x for x, y in zip(off, on, strict=True))
        print(f"  {name:<26} off {min(off):6.1f} µs best {statistics.median(off):6.1f} med   on {min(on):6.1f} best "
              f"{statistics.median(on):6.1f} med   on/off paired {paired:.3f}, best/best {min(on) / min(off):.3f}")
        if control:
            aa = [x[i] for x in runs["control"]]
            print(f"  {'':<26} control (off again) / off: paired "
                  f"{statistics.median(y / x for x, y in zip(off, aa, strict=True)):.3f}, medians "
                  f"{statistics.median(aa) / statistics.median(off):.3f}")
        if i == 0:
            unary = max(paired, statistics.median(on) / statistics.median(off))
    if not callgrind:  # the verdict on the worse of the paired ratio and the ratio of the medians
        verdict = "meets" if unary <= 1.15 else "misses"
        print(f"  non-streaming on/off CPU: {unary:.3f} (the worse of paired and medians): {verdict} the <= +15% target")
    return unary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=400, help="alternating rounds of the in-process gateway A/B")
    ap.add_argument("--only-pipeline", action="store_true", help="only the on/off gateway figure")
    ap.add_argument("--only-limiters", action="store_true", help="only the limiter decisions per second")
    ap.add_argument("--process", action="store_true", help="only the on/off figure of real gateway processes")
    ap.add_argument("--slices", type=int, default=20, help="--process: alternating slices per side")
    ap.add_argument("--duration", type=float, default=2.0, help="--process: seconds of load per slice")
    ap.add_argument("--callgrind", action="store_true",
                    help="--process: instructions per request under valgrind (c=1) instead of CPU time")
    ap.add_argument("--control", action="store_true", help="--process: a second admission-off gateway (A/A)")
    ap.add_argument("--perf-stat", action="store_true", help="--process: syscalls and context switches per request")
    args = ap.parse_args()
    if args.process:
        bench_process(args.slices, args.duration, args.callgrind, args.control, args.perf_stat)
        return
    if args.only_limiters:
        bench_limiters(args.n * 5)
        return
    if not args.only_pipeline:
        bench_schemas(args.n)
        bench_limiters(args.n * 5)
        bench_stage(args.n)
    bench_pipeline(args.rounds)


if __name__ == "__main__":
    main()
