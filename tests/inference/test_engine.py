"""Engine scheduling on a fake clock with test-double runners (no JAX)."""

from __future__ import annotations

import pytest

from inference.batch_window import FixedWindow
from inference.engine import Engine, EngineConfig, EngineError
from inference.sequence import Failed, Finished
from inference.synthetic import SyntheticRunner, expected_token
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, ScriptedRunner, run_until_done
from transport.messages import ErrorCode, FinishReason, SamplingParams

TOK = ByteTokenizer()


def b(s: str) -> list[int]:
    return list(s.encode())


def make(script: dict[int, list[int]], **kw: object) -> tuple[Engine, ScriptedRunner]:
    cfg = kw.pop("config", EngineConfig())
    runner = ScriptedRunner(script, **kw)  # type: ignore[arg-type]
    return Engine(runner, TOK, cfg), runner  # type: ignore[arg-type]


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    """Tokens "Hel","lo wo","rld!" as bytes; stop "o wor" spans two tokens, so
    the text is "Hell" and the request stops at the token that completes it."""
    eng, _ = make({1: b("Hello world! and more")})
    eng.add("a", TOK.encode("x"), SamplingParams(max_tokens=50, seed=1, stop=("o wor",)), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert col.text("a") == "Hell"
    end = col.ends["a"]
    assert isinstance(end, Finished) and end.reason is FinishReason.STOP
    assert end.completion_tokens == len("Hello wor")
    # every streamed piece is free of any stop-string prefix that later matched
    assert "o" not in "".join(d.text for d in col.deltas["a"][4:])


def test_held_prefix_released_when_match_fails_and_at_length() -> None:
    eng, _ = make({1: b("abab"), 2: b("xyzab")})
    eng.add("a", [65], SamplingParams(max_tokens=4, seed=1, stop=("abc",)), 0.0)
    eng.add("b", [65], SamplingParams(max_tokens=5, seed=2, stop=("abc",)), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert col.text("a") == "abab" and col.text("b") == "xyzab"
    assert col.ends["a"].reason is FinishReason.LENGTH  # type: ignore[union-attr]


def test_eos_and_stop_token_ids() -> None:
    eng, _ = make({1: [72, 105, 257, 33], 2: [72, 105, 257, 33, 34], 3: [72, 7, 105]})
    eng.add("eos", [65], SamplingParams(max_tokens=10, seed=1), 0.0)
    eng.add("ignore", [65], SamplingParams(max_tokens=5, seed=2, ignore_eos=True), 0.0)
    eng.add("stopid", [65], SamplingParams(max_tokens=3, seed=3, stop_token_ids=(7,)), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert col.tokens("eos") == [72, 105] and col.text("eos") == "Hi"
    assert col.ends["eos"] == Finished("eos", FinishReason.STOP, 1, 3, 0)
    assert col.tokens("ignore") == [72, 105, 257, 33, 34]
    assert col.ends["ignore"].reason is FinishReason.LENGTH  # type: ignore[union-attr]
    assert col.tokens("stopid") == [72] and col.ends["stopid"].reason is FinishReason.STOP  # type: ignore[union-attr]


def test_no_text_requested_still_honours_stop_strings() -> None:
    eng, _ = make({1: b("abcSTOPdef")})
    eng.add("a", [65], SamplingParams(max_tokens=10, seed=1, stop=("STOP",)), 0.0, return_text=False)
    col = Collector()
    run_until_done(eng, col)
    assert col.text("a") == "" and col.tokens("a") == b("abcSTOP")
    assert col.ends["a"].reason is FinishReason.STOP  # type: ignore[union-attr]


def test_multibyte_text_is_held_until_complete() -> None:
    eng, _ = make({1: list("é€x".encode())})
    eng.add("a", [65], SamplingParams(max_tokens=6, seed=1), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert [d.text for d in col.deltas["a"]] == ["", "é", "", "", "€", "x"]


def test_logprobs_and_top_logprobs() -> None:
    eng, _ = make({1: b("ab"), 2: b("ab"), 3: b("ab")})
    eng.add("lp", [65], SamplingParams(max_tokens=2, seed=1, logprobs=True, top_logprobs=3), 0.0)
    eng.add("none", [65], SamplingParams(max_tokens=2, seed=2), 0.0)
    eng.add("top", [65], SamplingParams(max_tokens=2, seed=3, top_logprobs=1), 0.0)
    col = Collector()
    run_until_done(eng, col)
    d = col.deltas["lp"][0]
    assert d.logprobs == (-0.5,) and d.top_n == 3
    assert d.top_ids == (1, 2, 0) and d.top_logprobs[:2] == (-0.5, -1.5)  # padded to top_n
    assert col.deltas["none"][0].logprobs is None and col.deltas["none"][0].top_n == 0
    top = col.deltas["top"][0]
    assert top.logprobs is None and top.top_n == 1 and top.top_ids == (1,)


def test_admission_bounded_by_max_batch_and_prefill_budget() -> None:
    script = {i: b("abcdefgh") for i in range(6)}
    eng, runner = make(script, config=EngineConfig(max_batch=2, max_prefill_tokens=100))
    for i in range(5):
        eng.add(i, [65 + i] * 10, SamplingParams(max_tokens=3, seed=i), 0.0)  # (identical ones: one prefill first)
    col = Collector()
    run_until_done(eng, col)
    assert max(p.size for p in runner.plans) == 2
    assert len(runner.plans[0].prefills) == 2
    assert len(col.ends) == 5

    eng, runner = make(script, config=EngineConfig(max_batch=8, max_prefill_tokens=25, step_tokens=0))
    for i in range(4):
        eng.add(i, [65 + i] * 10, SamplingParams(max_tokens=3, seed=i), 0.0)
    run_until_done(eng, Collector())
    assert [len(p.prefills) for p in runner.plans[:2]] == [2, 2]


def test_admission_bounded_by_kv_blocks() -> None:
    """4-token blocks, 6 blocks: each prompt of 9 tokens + 1 needs 3 blocks, so
    only two requests fit at once."""
    script = {i: b("ab") for i in range(4)}
    eng, runner = make(script, num_blocks=6, config=EngineConfig(enable_prefix_cache=False))
    for i in range(4):
        eng.add(i, [65 + i] * 9, SamplingParams(max_tokens=2, seed=i), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert len(runner.plans[0].prefills) == 2
    assert all(isinstance(e, Finished) for e in col.ends.values()) and len(col.ends) == 4
    assert eng.kv.num_free == 6


def _reference(prompt: list[int], seed: int, n: int) -> list[int]:
    ctx = list(prompt)
    out = []
    for i in range(n):
        t = expected_token(ctx, seed, i)
        out.append(t)
        ctx.append(t)
    return out


def test_preemption_recomputes_newest_and_output_is_unchanged() -> None:
    """Two sequences grow past what 8 blocks of 4 hold; the newer one is
    preempted, recomputed later, and both still produce exactly the tokens an
    unconstrained run produces (the synthetic runner reads its KV back)."""
    runner = SyntheticRunner(block_size=4, num_blocks=8, max_model_len=64)
    eng = Engine(runner, TOK, EngineConfig(max_batch=4))
    prompts = {"old": b("first prompt"), "new": b("second one!!")}
    eng.add("old", prompts["old"], SamplingParams(max_tokens=14, seed=5), 0.0)
    eng.add("new", prompts["new"], SamplingParams(max_tokens=14, seed=6), 0.0)
    col = Collector()
    t = 0.0
    preempted_first = None
    while eng.has_unfinished():
        before = eng.num_preemptions
        col.feed(eng.step(t))
        eng.kv.check_invariants()
        if eng.num_preemptions > before and preempted_first is None:
            preempted_first = [s.key for s in eng._waiting]
        t += 0.01
    assert eng.num_preemptions >= 1 and preempted_first == ["new"]
    assert col.tokens("old") == _reference(prompts["old"], 5, 14)
    assert col.tokens("new") == _reference(prompts["new"], 6, 14)
    assert eng.kv.num_free == 8


def test_cancel_frees_blocks_at_once_and_drops_in_flight_results() -> None:
    eng, runner = make({1: b("abcdefghijkl"), 2: b("abcdefghijkl")}, num_blocks=16)
    eng.add("a", [65] * 8, SamplingParams(max_tokens=10, seed=1), 0.0)
    eng.add("b", [66] * 8, SamplingParams(max_tokens=10, seed=2), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    plan, _ = eng.schedule(0.1)
    assert plan is not None
    free_before = eng.kv.num_free
    fin = eng.cancel("a")
    assert fin == Finished("a", FinishReason.CANCELLED, 8, 1, 0)
    assert eng.kv.num_free == free_before + 3  # a's 3 blocks (9 positions) came back
    assert eng.cancel("a") is None  # ends once
    events = eng.commit(plan, runner.execute(plan), 0.2)
    assert events and all(e.key == "b" for e in events)
    col.feed([fin, *events])
    run_until_done(eng, col, t0=0.3)
    assert len(col.tokens("b")) == 10 and eng.kv.num_free == 16


def test_paused_sequence_skips_decode_until_resumed() -> None:
    eng, runner = make({1: b("abcdef"), 2: b("abcdef")})
    eng.add("a", [65], SamplingParams(max_tokens=6, seed=1), 0.0)
    eng.add("b", [65], SamplingParams(max_tokens=6, seed=2), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    eng.pause("a", 0.05)
    for i in range(3):
        col.feed(eng.step(0.1 * (i + 1)))
    assert len(col.tokens("a")) == 1 and len(col.tokens("b")) == 4
    eng.resume("a")
    run_until_done(eng, col, t0=1.0)
    assert col.text("a") == "abcdef"


def test_same_seed_same_output_whatever_the_batch() -> None:
    def run(extra: int, seed: int | None) -> str:
        runner = SyntheticRunner(block_size=4, num_blocks=128)
        eng = Engine(runner, TOK, EngineConfig(seed=extra))
        for i in range(extra):
            eng.add(("x", i), b(f"other {i}"), SamplingParams(max_tokens=7, seed=i), 0.0)
        eng.add("me", b("the prompt"), SamplingParams(max_tokens=12, seed=seed), 0.0)
        col = Collector()
        run_until_done(eng, col)
        return col.text("me")

    assert run(0, 42) == run(5, 42) == run(9, 42)
    assert run(0, 42) != run(0, 43)
    assert len({run(0, None), run(1, None), run(2, None)}) > 1  # drawn seeds differ


def test_deadline_fails_with_timeout() -> None:
    eng, _ = make({1: b("abcdefgh")})
    eng.add("a", [65], SamplingParams(max_tokens=8, seed=1), 0.0, deadline=0.025)
    col = Collector()
    run_until_done(eng, col)
    end = col.ends["a"]
    assert isinstance(end, Failed) and end.code is ErrorCode.TIMEOUT
    assert 1 <= len(col.tokens("a")) < 8 and eng.kv.num_free == eng.kv.num_blocks


@pytest.mark.parametrize(
    ("prompt", "params", "code"),
    [
        ([], SamplingParams(), ErrorCode.INVALID_REQUEST),
        ([300], SamplingParams(), ErrorCode.INVALID_REQUEST),
        ([65], SamplingParams(max_tokens=0), ErrorCode.INVALID_REQUEST),
        ([65], SamplingParams(temperature=-1), ErrorCode.INVALID_REQUEST),
        ([65], SamplingParams(top_p=0), ErrorCode.INVALID_REQUEST),
        ([65], SamplingParams(top_logprobs=21), ErrorCode.INVALID_REQUEST),
        ([65] * 60, SamplingParams(max_tokens=5), ErrorCode.CONTEXT_LENGTH),
    ],
)
def test_bad_requests_are_refused(prompt: list[int], params: SamplingParams, code: ErrorCode) -> None:
    eng, _ = make({}, max_model_len=64)
    with pytest.raises(EngineError) as ei:
        eng.add("a", prompt, params, 0.0)
    assert ei.value.code is code
    assert not eng.has_unfinished()


def test_duplicate_key_and_queue_limit() -> None:
    eng, _ = make({}, config=EngineConfig(max_waiting=1))
    eng.add("a", [65], SamplingParams(), 0.0)
    with pytest.raises(EngineError) as ei:
        eng.add("a", [65], SamplingParams(), 0.0)
    assert ei.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(EngineError) as ei:
        eng.add("b", [65], SamplingParams(), 0.0)
    assert ei.value.code is ErrorCode.OVERLOADED


def test_context_limit_finishes_with_length() -> None:
    """max_model_len is capped by the cache (4 blocks x 4 = 16 positions)."""
    eng, _ = make({1: b("a" * 20)}, num_blocks=4)
    eng.add("a", [65] * 10, SamplingParams(max_tokens=6, seed=1), 0.0)
    col = Collector()
    run_until_done(eng, col)
    assert col.ends["a"].reason is FinishReason.LENGTH and len(col.tokens("a")) == 6  # type: ignore[union-attr]


def test_batch_window_delays_admission_to_batch_prefills() -> None:
    """Window 0.5 s, a full prefill is 2 requests. Request 0 (t=0) alone would
    wait until 0.5; request 1 (t=0.2) completes a full batch, so both go at
    0.2. Request 2 (t=0.6) opens a new window (until 1.1); request 3 (t=0.8)
    completes a batch and both go at once."""
    eng, runner = make({i: b("abcdefghijklmnopq") for i in range(5)},
                       config=EngineConfig(max_batch=8, prefill_batch=2))  # fmt: skip
    eng.window = FixedWindow(0.5)
    eng.add(0, [65], SamplingParams(max_tokens=16, seed=0), 0.0)
    assert eng.schedule(0.1) == (None, [])
    assert eng.next_wakeup() == 0.5
    eng.add(1, [65], SamplingParams(max_tokens=16, seed=1), 0.2)
    assert eng.next_wakeup() == 0.0  # a full prefill batch is ready: no waiting
    assert eng.step(0.2) and len(runner.plans[0].prefills) == 2
    eng.add(2, [65], SamplingParams(max_tokens=16, seed=2), 0.6)
    eng.step(0.7)
    assert not runner.plans[-1].prefills and eng.next_wakeup() == 1.1
    eng.add(3, [65], SamplingParams(max_tokens=16, seed=3), 0.8)
    eng.step(0.8)
    assert len(runner.plans[-1].prefills) == 2  # 2 and 3 make a full batch


def _synthetic(max_batch: int, num_blocks: int = 64, stall_timeout: float = 5.0) -> Engine:
    runner = SyntheticRunner(block_size=4, num_blocks=num_blocks, max_model_len=64)
    return Engine(runner, TOK, EngineConfig(max_batch=max_batch, stall_timeout=stall_timeout))


def _alone(prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    eng = _synthetic(1)
    eng.add("x", prompt, SamplingParams(max_tokens=max_tokens, seed=seed), 0.0)
    col = Collector()
    run_until_done(eng, col)
    return col.tokens("x")


def test_paused_sequences_leave_the_batch_and_resume_ahead_of_new_work() -> None:
    """Two slots. a and b run a step, then their clients stop reading: both leave the
    batch (KV kept), c and d take the slots. When a and b resume they wait for a slot
    ahead of e (added before they resumed), and every request streams exactly the tokens
    it would have alone."""
    eng = _synthetic(2)
    p = SamplingParams(max_tokens=6, seed=1)
    for k in "ab":
        eng.add(k, b("prompt " + k), p, 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    held = eng.kv.num_free
    eng.pause("a", 0.0)
    eng.pause("b", 0.0)
    assert (eng.num_running, eng.num_paused) == (0, 2) and eng.kv.num_free == held  # slots free, KV kept
    eng.add("c", b("prompt c"), SamplingParams(max_tokens=2, seed=1), 0.01)
    eng.add("d", b("prompt d"), SamplingParams(max_tokens=8, seed=1), 0.01)
    col.feed(eng.step(0.01))
    assert eng.num_running == 2 and len(col.tokens("c")) == len(col.tokens("d")) == 1
    eng.add("e", b("prompt e"), p, 0.02)
    eng.resume("a")
    eng.resume("b")
    col.feed(eng.step(0.02))  # c finishes; its slot goes to a (kept KV, no prefill), not to e
    assert "c" in col.ends and eng.num_running == 1
    col.feed(eng.step(0.03))
    assert len(col.tokens("a")) == 2 and not col.tokens("e") and eng.num_running == 2
    assert (eng.num_paused, eng.num_waiting) == (1, 1)  # b resumed, waiting for a slot ahead of e
    run_until_done(eng, col, t0=0.04)
    for k in "abcde":
        n = 2 if k == "c" else 8 if k == "d" else 6
        assert col.tokens(k) == _alone(b("prompt " + k), n, 1), k
    assert eng.kv.num_free == 64


def test_a_stalled_request_ends_with_timeout_and_frees_everything() -> None:
    eng = _synthetic(2, stall_timeout=5.0)
    eng.add("a", b("stalled"), SamplingParams(max_tokens=20, seed=1), 0.0)
    eng.add("b", b("reader"), SamplingParams(max_tokens=20, seed=1), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    eng.pause("a", 1.0)
    assert eng.next_wakeup() == 6.0
    for t in (2.0, 4.0, 5.9):
        col.feed(eng.step(t))
    assert "a" not in col.ends
    col.feed(eng.step(6.0))
    assert col.ends["a"] == Failed("a", ErrorCode.TIMEOUT, "client stopped reading for 5 s")
    assert eng.num_paused == 0 and "a" not in eng
    eng.resume("a")  # too late: nothing happens
    run_until_done(eng, col, t0=6.1)
    assert col.tokens("b") == _alone(b("reader"), 20, 1) and eng.kv.num_free == 64
    eng.kv.check_invariants()


def test_a_resumed_request_gets_a_fresh_stall_timer() -> None:
    eng = _synthetic(1, stall_timeout=5.0)
    eng.add("a", b("x"), SamplingParams(max_tokens=30, seed=1), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    eng.pause("a", 0.0)
    eng.resume("a")
    col.feed(eng.step(4.0))
    eng.pause("a", 4.0)
    col.feed(eng.step(8.0))  # 8 s since the first pause, 4 since the second
    assert "a" not in col.ends and eng.next_wakeup() == 9.0


def test_when_kv_runs_short_a_paused_sequence_is_recomputed_first() -> None:
    """Ten blocks of 4. a (prompt 14 + 1 token: 4 blocks) pauses; b needs 7 blocks, more
    than the 6 free: a's KV is dropped (not b refused, not a running sequence preempted).
    a resumes without KV, is recomputed from prompt + generated tokens ahead of new work,
    and streams what it would have alone."""
    eng = _synthetic(2, num_blocks=10)
    eng.add("a", b("a" * 14), SamplingParams(max_tokens=6, seed=1), 0.0)
    col = Collector()
    col.feed(eng.step(0.0))
    eng.pause("a", 0.0)
    assert eng.kv.num_free == 6
    eng.add("b", b("b" * 26), SamplingParams(max_tokens=2, seed=1), 0.0)
    col.feed(eng.step(0.01))
    assert eng.num_running == 1 and len(col.tokens("b")) == 1 and eng.num_preemptions == 1
    eng.resume("a")
    eng.add("c", b("c"), SamplingParams(max_tokens=2, seed=1), 0.02)
    run_until_done(eng, col, t0=0.02)
    assert col.tokens("a") == _alone(b("a" * 14), 6, 1)
    assert col.tokens("b") == _alone(b("b" * 26), 2, 1) and eng.kv.num_free == 10


def test_step_counters_for_stats() -> None:
    """Two 3-byte prompts, max_tokens=2, room for both: step 1 prefills both (2 sequences, the
    first token each), step 2 decodes both (2 sequences, the second token) and they finish.
    Each step is committed 10 ms after it was scheduled: 2 steps, 4 sequences, 0.02 s."""
    runner = SyntheticRunner(block_size=4, num_blocks=16, max_model_len=64)
    eng = Engine(runner, TOK, EngineConfig(max_batch=4))
    for key in ("a", "b"):
        eng.add(key, b("abc"), SamplingParams(max_tokens=2, seed=1), 0.0)
    t = 0.0
    while eng.has_unfinished():
        plan, _ = eng.schedule(t)
        assert plan is not None
        eng.commit(plan, runner.execute(plan), t + 0.01)
        t += 0.01
    assert (eng.steps, eng.step_sequences) == (2, 4)
    assert eng.step_seconds == pytest.approx(0.02)
