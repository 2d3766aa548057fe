"""The synthetic engine's cost model and injected faults, on a fake clock: the runner's ``sleep``
advances it, so every time below is exact arithmetic, not a measurement."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Hashable

import pytest

from inference.engine import Engine, EngineConfig
from inference.sequence import Delta, EngineEvent, Failed, Finished
from inference.service import WorkerService
from inference.synthetic import SyntheticCost, SyntheticFaults, SyntheticRunner
from inference.tokenizer import ByteTokenizer
from inference.worker import build_service, parse_args
from transport.messages import Error, ErrorCode, Finish, FinishReason, SamplingParams, Submit

from .test_service import RecordingConnection, run_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Driver:
    """An engine over a SyntheticRunner whose steps advance a fake clock; records when each
    request got its first token and how it ended."""

    def __init__(self, cost: SyntheticCost | None = None, faults: SyntheticFaults | None = None,
                 config: EngineConfig | None = None) -> None:  # fmt: skip
        self.clock = FakeClock()
        self.runner = SyntheticRunner(block_size=4, num_blocks=64, max_model_len=256, sleep=self.clock.sleep,
                                      cost=cost, faults=faults)  # fmt: skip
        self.engine = Engine(self.runner, ByteTokenizer(), config or EngineConfig())
        self.arrival: dict[Hashable, float] = {}
        self.first: dict[Hashable, float] = {}
        self.tokens: dict[Hashable, int] = {}
        self.ends: dict[Hashable, Finished | Failed] = {}

    def add(self, key: Hashable, prompt: str, max_tokens: int = 3, deadline: float | None = None) -> None:
        ids = ByteTokenizer().encode(prompt)
        self.engine.add(key, ids, SamplingParams(max_tokens=max_tokens, seed=1), self.clock.now, deadline=deadline)
        self.arrival[key] = self.clock.now

    def step(self) -> bool:
        """One schedule + execute + commit; False when there was nothing to run."""
        plan, events = self.engine.schedule(self.clock.now)
        self._feed(events)
        if plan is None:
            return False
        outputs = self.runner.execute(plan)
        self._feed(self.engine.commit(plan, outputs, self.clock.now))
        self.engine.kv.check_invariants()
        return True

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("the engine did not go idle")

    def ttft(self, key: Hashable) -> float:
        return self.first[key] - self.arrival[key]

    def _feed(self, events: list[EngineEvent]) -> None:
        for ev in events:
            assert ev.key not in self.ends, f"event after the end of {ev.key!r}"
            if isinstance(ev, Delta):
                self.first.setdefault(ev.key, self.clock.now)
                self.tokens[ev.key] = self.tokens.get(ev.key, 0) + len(ev.token_ids)
            else:
                self.ends[ev.key] = ev


# -- cost model -----------------------------------------------------------------------------------


def test_a_step_costs_base_plus_per_sequence_plus_prefill_tokens_times_slowdown() -> None:
    cost = SyntheticCost(step_s=0.002, per_seq_s=0.0005, prefill_token_s=0.0001, slowdown=2.0)
    assert cost.seconds(sequences=3, prefill_tokens=50) == pytest.approx(2 * (0.002 + 3 * 0.0005 + 50 * 0.0001))
    assert cost.seconds(sequences=1, prefill_tokens=0) == pytest.approx(2 * 0.0025)
    assert SyntheticCost().free and SyntheticCost().seconds(32, 2048) == 0
    assert not SyntheticCost(prefill_token_s=1e-6).free


def test_ttft_is_queueing_plus_the_uncached_prompt_tokens_prefill() -> None:
    """Block size 4. A's prompt is BOS + 40 bytes = 41 tokens, none cached: its first step prefills 41
    tokens for one sequence, 2 x (2 + 0.5 + 41 x 0.1) ms = 13.2 ms. A computes and registers blocks
    0..9 (positions 0..39: BOS + its first 39 bytes). B = the same 40 bytes + "xyz" (44 tokens): the
    prefix cache serves blocks 0..9 (40 tokens), block 10 (byte 40, x, y, z) is new, so B prefills
    4 tokens: 2 x (2 + 0.5 + 4 x 0.1) = 5.8 ms. C arrives with B, in the same step: both pay for two
    sequences and all 8 prefill tokens, and each reports its cached 40."""
    d = Driver(SyntheticCost(step_s=0.002, per_seq_s=0.0005, prefill_token_s=0.0001, slowdown=2.0),
               config=EngineConfig(max_batch=8, prefill_batch=2))  # fmt: skip
    shared = "The quick brown fox jumps over the lazy d"  # 41 bytes; the prompts share the first 40
    d.add("a", shared[:40])
    d.run()
    assert d.ttft("a") == pytest.approx(0.0132)
    assert d.ends["a"] == Finished("a", FinishReason.LENGTH, 41, 3, 0)
    d.add("b", shared[:40] + "xyz")
    d.run()
    assert d.ttft("b") == pytest.approx(0.0058)
    assert d.ends["b"] == Finished("b", FinishReason.LENGTH, 44, 3, 40)
    d.add("c", shared[:40] + "xyz!")  # B's blocks 0..9 again, block 10 too (B registered it)
    d.add("d", shared[:40] + "uvw")
    d.run()
    # C: 45 tokens, 44 cached (at least one is always computed); D: 44 tokens, 40 cached -> 1 + 4 prefilled.
    assert d.ttft("c") == d.ttft("d") == pytest.approx(2 * (0.002 + 2 * 0.0005 + 5 * 0.0001))
    assert (d.ends["c"].cached_tokens, d.ends["d"].cached_tokens) == (44, 40)  # type: ignore[union-attr]


def test_queueing_adds_the_steps_a_request_waits_behind() -> None:
    """max_batch 1: B waits for A's three steps (one prefill of 9 tokens, two decodes), then runs its
    own prefill: TTFT_B = (1 + 9 x 0.1) + 2 x 1 + (1 + 9 x 0.1) ms = 5.8 ms."""
    d = Driver(SyntheticCost(step_s=0.001, prefill_token_s=0.0001), config=EngineConfig(max_batch=1))
    d.add("a", "12345678")
    d.add("b", "abcdefgh")
    d.run()
    assert d.ttft("a") == pytest.approx(0.0019)
    assert d.ttft("b") == pytest.approx(0.0019 + 0.002 + 0.0019)


def test_the_worker_builds_the_cost_model_and_faults_from_its_options() -> None:
    args = parse_args(["--engine", "synthetic", "--synthetic-step-ms", "3", "--synthetic-step-ms-per-seq", "0.5",
                       "--synthetic-prefill-us-per-token", "20", "--synthetic-slowdown", "1.5",
                       "--synthetic-error-rate", "0.25", "--synthetic-hang-rate", "0.5", "--synthetic-error-after",
                       "4", "--synthetic-step-fail-rate", "0.01", "--synthetic-fault-seed", "9"])  # fmt: skip
    runner = build_service(args).engine.runner
    assert runner.cost == SyntheticCost(0.003, 0.0005, 2e-5, 1.5)  # type: ignore[attr-defined]
    assert runner.faults == SyntheticFaults(0.25, 0.5, 4, 0.01, 9)  # type: ignore[attr-defined]


# -- faults ---------------------------------------------------------------------------------------


def _binomial_bound(n: int, p: float) -> float:
    """4.5 standard deviations of a count of n draws at rate p: a fixed seed lies outside it with
    probability ~1e-5 (the draws are a hash, so a seed that passes always passes)."""
    return 4.5 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_injected_shares_match_the_rates_and_each_seed_is_its_own(seed: int) -> None:
    n = 20_000
    f = SyntheticFaults(error_rate=0.1, hang_rate=0.05, step_fail_rate=0.02, seed=seed)
    fates = [f.request_fault(i) for i in range(1, n + 1)]
    errors = sum(1 for x in fates if x is not None and not x.hang)
    hangs = sum(1 for x in fates if x is not None and x.hang)
    steps = sum(f.step_fails(i) for i in range(n))
    assert abs(errors - n * 0.1) <= _binomial_bound(n, 0.1)
    assert abs(hangs - n * 0.05) <= _binomial_bound(n, 0.05)
    assert abs(steps - n * 0.02) <= _binomial_bound(n, 0.02)
    assert fates == [f.request_fault(i) for i in range(1, n + 1)]  # a pure function of (seed, id)
    other = SyntheticFaults(error_rate=0.1, hang_rate=0.05, seed=seed + 1)
    assert fates != [other.request_fault(i) for i in range(1, n + 1)]
    assert SyntheticFaults(error_rate=1.0).request_fault(7) is not None
    assert SyntheticFaults().request_fault(7) is None and not SyntheticFaults().step_fails(0)


def test_an_injected_error_comes_after_k_tokens_and_shorter_requests_finish() -> None:
    d = Driver(faults=SyntheticFaults(error_rate=1.0, error_after=3))
    d.add("long", "hello", max_tokens=10)
    d.add("short", "hello", max_tokens=3)  # done at its 3rd token, before the fault
    d.run()
    assert d.tokens["long"] == 3
    end = d.ends["long"]
    assert isinstance(end, Failed) and end.code is ErrorCode.INTERNAL
    assert end.message == "synthetic fault: injected error after 3 tokens (synthetic_error_rate=1)"
    assert d.ends["short"] == Finished("short", FinishReason.LENGTH, 6, 3, 4)  # its first block: "long"'s
    assert not d.engine.has_unfinished()


def test_errors_hit_the_requests_the_seed_picks_and_spare_the_others() -> None:
    faults = SyntheticFaults(error_rate=0.5, seed=3)
    d = Driver(faults=faults, config=EngineConfig(max_batch=16))
    for i in range(16):
        d.add(i, f"prompt {i}", max_tokens=4)
    d.run()
    doomed = {i for i in range(16) if faults.request_fault(i + 1) is not None}  # seq ids count from 1
    assert 0 < len(doomed) < 16
    assert {k for k, e in d.ends.items() if isinstance(e, Failed)} == doomed
    assert all(d.tokens.get(k, 0) == 0 for k in doomed)  # error_after 0: before the first token
    assert all(d.tokens[k] == 4 for k in set(range(16)) - doomed)


def test_a_hung_request_keeps_its_slot_silently_until_cancelled_or_its_deadline() -> None:
    d = Driver(faults=SyntheticFaults(hang_rate=1.0, error_after=2), config=EngineConfig(max_batch=2))
    d.add("cancelled", "aaaa", max_tokens=50)
    d.add("timed", "bbbb", max_tokens=50, deadline=1.0)
    d.add("queued", "cccc", max_tokens=50)
    d.run()  # returns: the engine goes idle instead of stepping the hung ones
    assert d.tokens == {"cancelled": 2, "timed": 2} and not d.ends
    steps = d.runner.steps
    for _ in range(5):
        assert d.engine.schedule(d.clock.now) == (None, [])
    assert d.runner.steps == steps and d.engine.num_running == 2 and d.engine.num_waiting == 1
    fin = d.engine.cancel("cancelled")
    assert fin is not None and fin.reason is FinishReason.CANCELLED and fin.completion_tokens == 2
    d.run()  # the freed slot admits the queued request, which hangs in turn
    assert d.tokens["queued"] == 2 and d.engine.num_running == 2
    d.clock.now = 1.0
    d.step()
    assert d.ends["timed"] == Failed("timed", ErrorCode.TIMEOUT, "deadline exceeded")
    d.engine.cancel("queued")
    assert not d.engine.has_unfinished()
    d.engine.kv.check_invariants()


def _service(faults: SyntheticFaults) -> WorkerService:
    runner = SyntheticRunner(block_size=4, num_blocks=64, faults=faults)
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, prefill_batch=4))
    return WorkerService(eng, ByteTokenizer(), served_name="tiny", stats_interval=0.05, threaded=False)


def _seed_failing_only_step(step: int, rate: float, steps: int = 8) -> int:
    """A seed under which, of the first ``steps`` steps, exactly ``step`` fails (found, not guessed)."""
    return next(s for s in range(10_000)
                if [i for i in range(steps) if SyntheticFaults(step_fail_rate=rate, seed=s).step_fails(i)] == [step])


async def test_a_failed_step_ends_every_request_the_way_a_failing_runner_does_and_the_worker_goes_on() -> None:
    """The runner raises, so the worker's own step handler (inference.service) ends every request it
    holds with INTERNAL "engine step failed: ...": the path a real model runner's exception takes."""
    seed = _seed_failing_only_step(1, rate=0.2)
    svc = _service(SyntheticFaults(step_fail_rate=0.2, seed=seed))
    conn = RecordingConnection()
    for rid in (1, 2, 3):
        svc.on_submit(conn, Submit(rid, "tiny", SamplingParams(max_tokens=20, seed=rid), prompt=f"p{rid}"))

    sent: list[int] = []

    def then_one_more() -> bool:  # after the failed step, on the same running worker
        if not sent and all(conn.ends(r) for r in (1, 2, 3)):
            sent.append(4)
            svc.on_submit(conn, Submit(4, "tiny", SamplingParams(max_tokens=5, seed=4), prompt="after"))
        return bool(conn.ends(4))

    await run_until(svc, then_one_more)
    for rid in (1, 2, 3):
        (end,) = conn.ends(rid)
        assert isinstance(end, Error) and end.code is ErrorCode.INTERNAL
        assert end.message == "engine step failed: synthetic fault: step 1 failed (synthetic_step_fail_rate=0.2)"
        assert len(conn.text(rid)) == 1  # step 0 (the prefill) streamed, step 1 failed
    assert conn.ends(4) == [Finish(4, FinishReason.LENGTH, 6, 5, 0)]


async def test_a_hung_request_is_cancelled_by_its_gateway_and_the_loop_does_not_spin() -> None:
    faults = SyntheticFaults(hang_rate=1.0, error_after=1)
    svc = _service(faults)
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=20, seed=1), prompt="hang"))
    task = asyncio.create_task(svc.run())
    try:
        async with asyncio.timeout(5):
            while not list(conn.entries(1)):
                await asyncio.sleep(0.005)
        steps = svc.engine.runner.steps  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)
        assert svc.engine.runner.steps == steps and conn.ends(1) == []  # type: ignore[attr-defined]
        svc.on_cancel(conn, 1)
        assert conn.ends(1) == [Finish(1, FinishReason.CANCELLED, 5, 1, 0)]
    finally:
        svc.abort()
        await task


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["--synthetic-error-rate", "1.5"], "--synthetic-error-rate: must be a share in [0, 1], got 1.5"),
    (["--synthetic-hang-rate", "-0.1"], "--synthetic-hang-rate: must be a share in [0, 1], got -0.1"),
    (["--synthetic-error-rate", "0.6", "--synthetic-hang-rate", "0.6"],
     "--synthetic-hang-rate: synthetic_error_rate + synthetic_hang_rate must be <= 1"),
    (["--synthetic-step-fail-rate", "nan"], "--synthetic-step-fail-rate: must be a share in [0, 1], got nan"),
    (["--synthetic-prefill-us-per-token", "-1"], "--synthetic-prefill-us-per-token: must be >= 0, got -1.0"),
    (["--synthetic-step-ms-per-seq", "inf"], "--synthetic-step-ms-per-seq: must be >= 0, got inf"),
    (["--synthetic-slowdown", "0"], "--synthetic-slowdown: must be > 0, got 0.0"),
    (["--synthetic-error-after", "-2"], "--synthetic-error-after: must be >= 0, got -2"),
    (["--synthetic-error-after", "2.5"], "--synthetic-error-after: invalid int value: '2.5'"),
    (["--synthetic-eror-rate", "0.1"], "unrecognized arguments: --synthetic-eror-rate 0.1"),
])  # fmt: skip
def test_bad_synthetic_options_stop_the_worker_at_start_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--engine", "synthetic", *argv])
    assert exc.value.code == 2
    out = capsys.readouterr().out  # the fatal event the supervisor reports
    assert '"event":"fatal"' in out and named in out
