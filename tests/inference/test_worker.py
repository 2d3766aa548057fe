"""The worker end to end over the real transport (TCP and Unix sockets), with
the synthetic engine: in-process, and as a ``quicserve worker`` subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from inference.batch_window import AdaptiveWindow, FixedWindow
from inference.engine import EngineConfig
from inference.kv_cache import PREFIX_HASH_SCHEME
from inference.worker import build_service, main, numa_cpus, parse_args, parse_cpus
from transport.client import connect
from transport.common.worker_options import EXIT_CONFIG, EXIT_USAGE, WorkerOptions
from transport.messages import Error, ErrorCode, Finish, FinishReason, SamplingParams, Submit, TokenEntry
from transport.server import serve

ROOT = Path(__file__).resolve().parents[2]


async def collect(stream: object) -> tuple[str, list[int], object]:
    text, toks, end = b"", [], None
    while True:
        try:
            events = await stream.next_events()  # type: ignore[attr-defined]
        except StopAsyncIteration:
            return text.decode(), toks, end
        for ev in events:
            if isinstance(ev, TokenEntry):
                text += bytes(ev.text)
                toks += list(ev.token_ids)
            else:
                assert end is None, "a stream ended twice"
                end = ev


@pytest.mark.parametrize("scheme", ["tcp", "unix"])
async def test_in_process_worker_over_transport(scheme: str, tmp_path: Path) -> None:
    args = parse_args(["--engine", "synthetic", "--num-blocks", "128", "--stats-interval", "0.05"])
    svc = build_service(args)
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"unix://{tmp_path}/w.sock"
    server = await serve(url, svc)
    svc.server = server
    loop_task = asyncio.create_task(svc.run())
    conn = await connect(server.address)
    try:
        assert conn.peer_hello.models == ("tiny",)

        def submit(
            max_tokens: int, seed: int | None = 7, prompt: str = "Hello there", **kw: object
        ) -> object:
            p = SamplingParams(max_tokens=max_tokens, seed=seed, **kw)  # type: ignore[arg-type]
            return conn.submit(Submit(conn.next_request_id(), "tiny", p, prompt=prompt))

        streams = [submit(12), submit(12), submit(30, stop=("~",)), submit(400)]
        first, second, _, long = await asyncio.gather(*(collect(s) for s in streams[:3]), asyncio.sleep(0))
        assert first[0] == second[0] and len(first[1]) == 12  # same seed, same text
        assert first[2] == Finish(1, FinishReason.LENGTH, 12, 12, first[2].cached_tokens)  # type: ignore[union-attr]
        streams[3].cancel()  # type: ignore[attr-defined]
        _, _, end = await collect(streams[3])
        assert isinstance(end, Finish | Error)
        bad = conn.submit(Submit(conn.next_request_id(), "nope", prompt="x"))
        _, _, end = await collect(bad)
        assert isinstance(end, Error) and end.code is ErrorCode.UNKNOWN_MODEL
        system = "You are a helpful assistant. " * 2  # 3 full blocks of 16 with the bos
        await collect(submit(2, prompt=system + "Q1"))
        _, _, end = await collect(submit(2, prompt=system + "Q2"))
        assert isinstance(end, Finish) and end.cached_tokens == 48
        for _ in range(100):  # Stats arrive every 50 ms
            if conn.latest_stats is not None and conn.latest_stats.prefix_hit_rate > 0:
                break
            await asyncio.sleep(0.02)
        assert conn.latest_stats is not None and conn.latest_stats.kv_blocks_total == 128
        assert conn.latest_stats.prefix_hit_rate > 0 and conn.latest_stats.prefix_hashes
    finally:
        await conn.close()
        svc.abort()
        await loop_task
        await server.close()


async def test_connection_loss_cancels_its_requests() -> None:
    svc = build_service(parse_args(["--engine", "synthetic", "--synthetic-step-ms", "2"]))
    server = await serve("tcp://127.0.0.1:0", svc)
    loop_task = asyncio.create_task(svc.run())
    try:
        conn = await connect(server.address)
        conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=2000), prompt="x"))
        for _ in range(200):
            if svc.engine.num_running:
                break
            await asyncio.sleep(0.01)
        assert svc.engine.num_running == 1
        await conn.close()
        for _ in range(200):
            if not svc.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not svc.engine.has_unfinished()
        assert svc.engine.kv.num_free == svc.engine.kv.num_blocks
    finally:
        svc.abort()
        await loop_task
        await server.close()


async def test_worker_subprocess_ready_line_serve_and_sigterm_drain() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from inference.worker import main; raise SystemExit(main(sys.argv[1:]))",
        "--engine", "synthetic", "--synthetic-step-ms", "5", "--batch-window", "fixed:1", "--cpus", "0",
        "--max-batch", "6", "--num-blocks", "64",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines = []
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, "worker exited before ready"
            msg = json.loads(line)
            lines.append(msg)
            if msg["event"] == "ready":
                break
        assert lines[0]["event"] == "progress" and msg["models"] == ["tiny"]
        conn = await connect(msg["url"])
        h = conn.peer_hello  # its capacity: the context is capped by the cache, 64 blocks x 16 tokens
        assert (h.max_batch, h.kv_blocks, h.block_size, h.max_model_len) == (6, 64, 16, 1024)
        assert h.model_id == "tiny" and h.prefix_hash == PREFIX_HASH_SCHEME
        stream = conn.submit(
            Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=40), prompt="hi")
        )
        await stream.next_events()
        proc.send_signal(signal.SIGTERM)  # drain: the in-flight request still finishes
        text, _, end = await collect(stream)
        assert isinstance(end, Finish) and end.completion_tokens == 40
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        rest = (await proc.stdout.read()).decode().strip()
        assert "ready" not in rest  # exactly one ready line
        await conn.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
def test_jax_worker_runs_a_window_of_prompts_as_one_prefill_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts gathered by a window run as one prefill call of the real runner
    and sample what single-prompt calls do: three with --max-prefill-batch 4
    (batch bucket 4, after the window), two by default (--max-prefill-batch 2:
    a full batch, admitted at once)."""
    pytest.importorskip("jax")
    from inference.model.jax_runner import JaxRunner

    # Compile lazily: only the few shapes this test runs, not every bucket.
    monkeypatch.setattr(JaxRunner, "warmup", lambda self, progress=None, threads=None: None)
    calls: list[tuple[int, int, int]] = []
    real = JaxRunner._prefill_logits

    def spy(self: JaxRunner, works: object, b: int, t: int) -> object:
        calls.append((len(works), b, t))  # type: ignore[arg-type]
        return real(self, works, b, t)  # type: ignore[arg-type]

    monkeypatch.setattr(JaxRunner, "_prefill_logits", spy)

    def first_tokens(*flags: str, prompts: int = 3) -> list[int]:
        args = parse_args(["--engine", "jax", "--max-batch", "8", "--num-blocks", "64",
                           "--batch-window", "fixed:50", *flags])  # fmt: skip
        eng = build_service(args).engine
        assert eng.runner.buckets.max_prefill_batch == eng.config.prefill_batch == args.max_prefill_batch
        for i, text in enumerate(["Hello", "Hi there", "Good morning"][:prompts]):
            eng.add(i, eng.tokenizer.encode(text), SamplingParams(max_tokens=2, temperature=0.0), 0.0,
                    return_text=False)  # fmt: skip
        events = eng.step(0.0) or eng.step(0.05)  # batched: the window waits for more; batch 1 is full at once
        return [t for ev in sorted(events, key=lambda e: e.key) for t in ev.token_ids]  # type: ignore[attr-defined]

    batched = first_tokens("--max-prefill-batch", "4")
    assert calls == [(3, 4, 16)]
    calls.clear()
    assert first_tokens("--max-prefill-batch", "1") == batched and len(batched) == 3
    assert calls == [(1, 1, 16)] * 3
    calls.clear()
    assert parse_args([]).max_prefill_batch == 2
    assert first_tokens(prompts=2) == batched[:2] and calls == [(2, 2, 16)]


def test_cli_validation(tmp_path: Path) -> None:
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("4-7,12\n")
    assert numa_cpus(1, tmp_path) == {4, 5, 6, 7, 12}
    with pytest.raises(ValueError):
        numa_cpus(2, tmp_path)
    args = parse_args(["--batch-window", "fixed:3"])
    assert type(args.batch_window) is FixedWindow and args.batch_window.window == 0.003
    args = parse_args(["--max-batch", "2"])  # a prefill call never holds more than the batch
    assert args.max_prefill_batch == 2 and args.batch_window.prefill_group == 2
    assert parse_args(["--max-prefill-batch", "8"]).batch_window.prefill_group == 8
    for bad in (["--cpus", "3-1"], ["--batch-window", "soon"], ["--max-batch", "0"], ["--max-prefill-batch", "0"],
                ["--engine", "synthetic", "--model", "/some/dir"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_flags_engine_and_runner_share_one_default_per_option() -> None:
    """The worker's flags, the engine and the runner read transport.common.worker_options (as does the
    gateway's [workers] section): no second copy of a default to drift."""
    args, d = parse_args([]), WorkerOptions()
    assert {k: getattr(args, k) for k in ("max_batch", "max_prefill_batch", "max_prefill_tokens", "dtype",
                                          "kv_cache_dtype", "weight_dtype", "attention", "block_size")} == {
        "max_batch": 32, "max_prefill_batch": 2, "max_prefill_tokens": 2048, "dtype": "float32",
        "kv_cache_dtype": "auto", "weight_dtype": "auto", "attention": "auto", "block_size": 16}
    cfg = EngineConfig()
    assert (cfg.max_batch, cfg.prefill_batch, cfg.max_prefill_tokens, cfg.enable_prefix_cache) == (
        d.max_batch, d.max_prefill_batch, d.max_prefill_tokens, d.prefix_cache)
    svc = build_service(parse_args(["--engine", "synthetic", "--max-prefill-tokens", "300", "--no-prefix-cache"]))
    assert svc.engine.config.max_prefill_tokens == 300 and not svc.engine.config.enable_prefix_cache
    assert svc.hello().prefix_hash == ""  # no prefix cache: no hashes to match
    jax_runner = pytest.importorskip("inference.model.jax_runner")
    import inspect

    sig = inspect.signature(jax_runner.JaxRunner.load).parameters
    for key in ("max_batch", "max_prefill_batch", "max_prefill_tokens", "block_size", "dtype", "kv_cache_dtype",
                "weight_dtype", "weight_quant_method", "attention"):
        assert sig[key].default == getattr(d, key), key


def test_a_usage_error_names_the_flag_for_the_supervisor_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        parse_args(["--engine", "synthetic", "--max-batch", "0", "--kv-cache-dtype", "int8"])
    assert ei.value.code == EXIT_USAGE
    out = capsys.readouterr()
    (event,) = [json.loads(line) for line in out.out.splitlines()]
    assert event["event"] == "fatal" and "--max-batch: must be >= 1, got 0" in event["message"]
    assert "--max-batch: must be >= 1" in out.err


def test_options_that_parse_but_cannot_run_exit_78_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """No machine has NUMA node 4095: the worker says so to the supervisor (which will not restart it)."""
    assert main(["--engine", "synthetic", "--numa-node", "4095"]) == EXIT_CONFIG
    (event,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert event == {"event": "fatal", "message": event["message"]} and "NUMA node 4095" in event["message"]


def test_synthetic_worker_never_imports_jax() -> None:
    import subprocess

    code = (
        "import sys; from inference.worker import build_service, parse_args; "
        "build_service(parse_args(['--engine', 'synthetic'])); print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT),
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
async def test_jax_worker_tiny_model_answers_within_a_minute() -> None:
    """The built-in tiny model: start, compile every bucket, answer — under 60 s.
    (Batched prefill buckets, --max-prefill-batch 2, take the shapes to compile
    at --max-batch 8 from 12 to 19: 17 s -> 35 s of compiling at load 4 here;
    prompt lengths at 2 per octave take them to 31: warmup 9.9 -> 14.5 s, quiet;
    at 4 per octave to 51: this test ~24 s, quiet.)"""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from inference.worker import main; raise SystemExit(main(sys.argv[1:]))",
        "--engine", "jax", "--max-batch", "8",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, cwd=str(ROOT),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        stages = set()
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line, "worker exited before ready"
            msg = json.loads(line)
            if msg["event"] == "ready":
                break
            stages.add(msg["stage"])
        assert stages == {"load", "compile"}
        conn = await connect(msg["url"])
        p = SamplingParams(max_tokens=8, temperature=0.0)
        text, toks, end = await collect(conn.submit(Submit(1, "tiny", p, prompt="Hello")))
        assert isinstance(end, Finish) and end.completion_tokens == len(toks) + (
            end.reason is FinishReason.STOP
        )
        assert loop.time() - t0 < 60
        again = await collect(conn.submit(Submit(2, "tiny", p, prompt="Hello")))
        assert again[1] == toks  # greedy is deterministic
        await conn.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


SYSTEM = "You are a helpful assistant. " * 2  # 3 full blocks of 16 with the bos


async def _serve_two(flags: list[str], caplog: pytest.LogCaptureFixture) -> list[list[int]]:
    """A JAX worker (tiny model, ``flags`` added) over TCP: two greedy requests, the second reusing
    the first's cached prefix; their tokens."""
    args = parse_args(["--engine", "jax", "--max-batch", "2", "--num-blocks", "64", "--max-prefill-batch", "1",
                       "--max-model-len", "128", *flags])  # fmt: skip
    with caplog.at_level("INFO", logger="inference.worker"):
        svc = build_service(args)
    window, buckets = svc.engine.window, svc.engine.runner.buckets  # type: ignore[attr-defined]
    assert isinstance(window, AdaptiveWindow)  # the default; its cost model sees the runner's buckets
    assert list(window.calls([40, 100])) == [buckets.prefill_shape(1, 40), buckets.prefill_shape(1, 100)]
    server = await serve("tcp://127.0.0.1:0", svc)
    loop_task = asyncio.create_task(svc.run())
    conn = await connect(server.address)
    try:
        p = SamplingParams(max_tokens=8, temperature=0.0)
        out = []
        for i, q in enumerate(("Q1", "Q2")):
            _, toks, end = await asyncio.wait_for(
                collect(conn.submit(Submit(i + 1, "tiny", p, prompt=SYSTEM + q))), 60)
            assert isinstance(end, Finish) and end.cached_tokens == 48 * i
            out.append(toks)
        return out
    finally:
        await conn.close()
        svc.abort()
        await loop_task
        await server.close()


@pytest.mark.slow
@pytest.mark.parametrize("flags,logged", [
    (["--kv-cache-dtype", "int8"], "KV cache int8: 130.0 bytes per token (512.0 in the model dtype)"),
    (["--weight-dtype", "int8"], "weights int8 (rtn): 162696 bytes (362240 in the model dtype)"),
    (["--weight-dtype", "int8", "--weight-quant-method", "gptq"],
     "weights int8 (gptq): 162696 bytes (362240 in the model dtype)"),
])  # fmt: skip
async def test_jax_worker_with_int8_serves_what_the_float_worker_does(
    flags: list[str], logged: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``--kv-cache-dtype int8`` / ``--weight-dtype int8`` (rounded, or GPTQ) end to end over TCP: the start-up log gives
    the bytes (tiny model: KV 512 per token in float32, 128 of codes + 2 of scales; weights 362,240 in
    float32, 162,696 with 1-byte projection codes and per-channel scales, worked out in
    tests/inference/model/test_weight_quant.py), and greedy requests, the second reusing the first's
    cached prefix, get the float worker's 8 tokens (the tiny model's greedy choices here are not
    near-ties: tests/inference/model/test_kv_quant.py, test_weight_quant.py)."""
    pytest.importorskip("jax")
    from inference.model.jax_runner import JaxRunner

    monkeypatch.setattr(JaxRunner, "warmup", lambda self, progress=None, threads=None: None)  # compile lazily
    quantized = await _serve_two(flags, caplog)
    assert logged in caplog.text
    assert all(len(t) == 8 for t in quantized)
    assert quantized == await _serve_two([flags[0], "auto"], caplog)


async def test_streams_whose_client_never_reads_do_not_hold_the_batch() -> None:
    """Four batch slots; eight streams from a gateway that never grants credit (8 tokens
    each) pause once their credit is spent, so another gateway's stream runs and finishes
    while they wait. Past the stall timeout each stalled stream ends with TIMEOUT and the
    engine holds nothing."""
    svc = build_service(parse_args(["--engine", "synthetic", "--synthetic-step-ms", "2", "--max-batch", "4",
                                    "--stall-timeout", "3", "--stats-interval", "0.05"]))  # fmt: skip
    server = await serve("tcp://127.0.0.1:0", svc)
    loop_task = asyncio.create_task(svc.run())
    stalled_conn = await connect(server.address, initial_credit=8)
    reader = await connect(server.address)
    try:
        p = SamplingParams(max_tokens=1000, seed=1)
        stalled = [stalled_conn.submit(Submit(stalled_conn.next_request_id(), "tiny", p, prompt=f"s{i}"))
                   for i in range(8)]  # fmt: skip
        async with asyncio.timeout(10):
            while svc.engine.num_paused < 8:
                await asyncio.sleep(0.01)
        assert svc.engine.num_running == 0
        p = SamplingParams(max_tokens=40)
        stream = reader.submit(Submit(reader.next_request_id(), "tiny", p, prompt="hi"))
        _, _, end = await asyncio.wait_for(collect(stream), 10)
        assert isinstance(end, Finish) and end.completion_tokens == 40
        assert svc.engine.num_paused == 8  # served while every stalled stream was still there
        async with asyncio.timeout(10):
            while svc.engine.has_unfinished():
                await asyncio.sleep(0.02)
        for s in stalled:
            _, toks, end = await asyncio.wait_for(collect(s), 5)
            assert len(toks) == 8
            assert end == Error(s.request_id, ErrorCode.TIMEOUT, "client stopped reading for 3 s")  # type: ignore[attr-defined]
        assert svc.engine.kv.num_free == svc.engine.kv.num_blocks
    finally:
        await stalled_conn.close()
        await reader.close()
        svc.abort()
        await loop_task
        await server.close()
