"""Fixed and adaptive (DBS-Adapt) admission windows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from inference.batch_window import AdaptiveWindow, FixedWindow, bucket_calls, parse_batch_window, pow2_calls
from inference.engine import Engine, EngineConfig
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import SamplingParams


def test_fixed_window_waits_unless_batch_is_full() -> None:
    w = FixedWindow(0.01)
    assert w.admit_at(1.0, batch=1, full=4) == pytest.approx(1.01)
    assert w.admit_at(1.0, batch=4, full=4) == 1.0
    w.observe(5.0, 1.0)
    assert w.window == 0.01


def test_adaptive_window_follows_latency_error_scaled_by_load() -> None:
    w = AdaptiveWindow(0.05, initial=0.01, w_min=0.0, w_max=0.03, lr=0.5, quantile=0.5, clip=0.05)
    w.observe(0.03, load=1.0)  # 20 ms of head-room -> grow by lr * 0.02
    assert w.window == pytest.approx(0.02)
    w.observe(0.03, load=0.5)  # half the load, half the step
    assert w.window == pytest.approx(0.025)
    w.observe(0.0, load=1.0)
    assert w.window == 0.03  # clipped at w_max
    w.observe(0.06, load=0.0)  # idle: no drift
    assert w.window == 0.03
    w.observe(10.0, load=1.0)  # the error is clipped (here to 50 ms) per step
    assert w.window == pytest.approx(0.005)
    w.observe(10.0, load=1.0)
    assert w.window == 0.0  # clipped at w_min


def test_adaptive_window_tracks_a_latency_quantile() -> None:
    """Steps cost 2 ms + window x U(0, 2); target 10 ms as a p90. With a clip
    well below the latency noise each update is the pinball-loss gradient (a
    miss pulls 9x harder than head-room pushes), so about 10% of steps miss."""
    import random

    rng = random.Random(0)
    w = AdaptiveWindow(0.010, lr=0.5, w_max=0.05, quantile=0.9, clip=0.0002)
    misses = 0
    for i in range(20_000):
        latency = 0.002 + w.window * rng.uniform(0.0, 2.0)
        misses += i >= 10_000 and latency > 0.010
        w.observe(latency, load=1.0)
    assert 0.08 < misses / 10_000 < 0.12
    with pytest.raises(ValueError):
        AdaptiveWindow(0.01, quantile=1.0)


def test_a_miss_of_any_size_counts_in_full() -> None:
    """Latency is the target plus or minus a hair: were a miss weighed by its
    size (clip 1 ms, excess 1 us) against full head-room pushes, most steps
    would miss; counted in full, at most about 1 - q do."""
    import random

    rng = random.Random(1)
    w = AdaptiveWindow(0.010, lr=0.5, w_max=0.05, quantile=0.9, clip=0.001)
    misses = 0
    for i in range(20_000):
        latency = 0.002 + w.window + (1e-6 if rng.random() < 0.5 else -0.002)
        misses += i >= 10_000 and latency > 0.010
        w.observe(latency, load=1.0)
    assert misses / 10_000 < 0.12


def _cost(lengths: list[int], group: int = 8) -> float:
    """A bucketed step cost: 3 ms base, 1 ms per prefill call, 10 us per padded token."""
    ls, cost = sorted(lengths), 0.003
    for i in range(0, len(ls), group):
        chunk = ls[i : i + group]
        cost += 0.001 + 1e-5 * (1 << (len(chunk) - 1).bit_length()) * max(16, 1 << (chunk[-1] - 1).bit_length())
    return cost


def test_adaptive_window_fits_the_step_cost_and_bounds_prefills() -> None:
    import random

    rng = random.Random(2)
    # Calls of up to 8 prompts (the worked numbers below; the default is the worker's max_prefill_batch).
    w = AdaptiveWindow(0.010, w_max=0.05, lr=0.5, prefill_group=8)
    assert w.cost_model is None and w.prefill_fits([4000] * 30)  # nothing learned: no bound
    for _ in range(400):
        lengths = [rng.randint(1, 64) for _ in range(rng.choice((0, 0, 1, 2, 3, 5, 8)))]
        w.observe(_cost(lengths), load=1.0, prefill_lengths=lengths)
    model = w.cost_model
    assert model is not None
    base, per_call, per_area, per_decode = model
    assert per_decode == pytest.approx(0.0, abs=1e-9)  # no step decoded anything
    assert base == pytest.approx(0.003, rel=1e-3) and per_call == pytest.approx(0.001, rel=1e-3)
    assert per_area == pytest.approx(1e-5, rel=1e-3)
    assert w.predict([40, 40]) == pytest.approx(_cost([40, 40]), rel=1e-3)
    # 10 ms target, margin 0 (no step missed): 3 + 1 + 0.01 * area <= 10 -> area <= 600
    assert w.margin == 0.0
    assert w.prefill_fits([64] * 8) and not w.prefill_fits([65] * 8)  # 8 x 64 = 512 vs 8 x 128
    assert not w.prefill_fits([64] * 9)  # a second call: 3 + 2 + 5.12 + 0.64 ms
    # saturated, and a full call of typical (~32-token) prompts fits the bound:
    # gathering freed slots into full calls pays, so the window may grow to w_max
    assert w.window == 0.05
    w.observe(0.004, load=0.5)  # below saturation waiting longer than the 1 ms
    assert w.window == pytest.approx(0.001, rel=1e-3)  # one call costs cannot pay
    w.observe(0.02, load=1.0)  # a miss widens the margin
    assert w.margin > 0 and w.window == 0.0
    # Target 6 ms: steps of up to two prefills (<= 3 + 1 + 0.01 * 2 * 64 = 5.3 ms)
    # never miss, but a full call of 8 typical prompts (3 + 1 + 0.01 * 8 * 32 =
    # 6.6 ms) never fits, so even saturated a longer wait would only leave
    # slots empty: the window stays at one call's cost.
    w2 = AdaptiveWindow(0.006, w_max=0.05, lr=0.5, prefill_group=8)
    for _ in range(400):
        lengths = [rng.randint(1, 64) for _ in range(rng.choice((0, 0, 1, 1, 2)))]
        w2.observe(_cost(lengths), load=1.0, prefill_lengths=lengths)
    assert w2.cost_model is not None and w2.margin == 0.0
    assert w2.window == pytest.approx(0.001, rel=1e-3)


def test_the_cost_model_learns_the_mixed_step() -> None:
    """Chunked prefill: steps decode the running streams and carry chunks of prompts. A step
    costs 2 ms, 0.1 ms per decode, 1 ms per prefill call and 10 us per padded token; the fit
    recovers all four, predicts a mixed step it never saw, and bounds the chunks a step may
    carry by its decodes (they take their share of the target)."""
    import random

    rng = random.Random(3)

    def cost(lengths: list[int], decodes: int) -> float:
        return _cost(lengths, group=2) - 0.001 + 1e-4 * decodes

    w = AdaptiveWindow(0.012, lr=0.5, prefill_group=2)  # no step misses (at most 11.32 ms): no margin
    for _ in range(400):
        decodes = rng.randint(0, 32)
        lengths = [rng.choice((16, 32, 64, 128, 256)) for _ in range(rng.choice((0, 1, 1, 2)))]
        w.observe(cost(lengths, decodes), load=1.0, prefill_lengths=lengths, decodes=decodes)
    assert w.cost_model == pytest.approx((0.002, 0.001, 1e-5, 1e-4), rel=1e-3)
    assert w.predict([240], 16) == pytest.approx(cost([240], 16), rel=1e-3)
    # 12 ms: a 512-token call (2 + 1 + 5.12 ms) fits beside 32 decodes (+3.2), not beside 48 (+4.8)
    assert w.margin == 0.0 and w.prefill_fits([512], decodes=32)
    assert not w.prefill_fits([512], decodes=48)


def test_cost_model_fits_the_runners_own_shape_buckets() -> None:
    """With the runner's buckets (4 lengths per octave, prefills in pairs) the
    fitted step cost is exact; the power-of-two default misreads the padding
    (a 40-token pair pads to 2 x 64 there, 2 x 40 in the runner)."""
    import random

    from inference.model.buckets import Buckets

    calls = bucket_calls(Buckets(max_batch=32, max_model_len=512, max_prefill_batch=2))
    assert list(calls([40, 20, 100])) == [(2, 40), (1, 112)]
    assert list(calls([600])) == [(1, 512)]  # past max_model_len: counted as the longest bucket
    assert list(pow2_calls(2)([40, 20, 100])) == [(2, 64), (1, 128)]

    def cost(lengths: list[int]) -> float:
        return 0.003 + sum(0.001 + 1e-5 * b * t for b, t in calls(lengths)) if lengths else 0.003

    rng = random.Random(4)
    fitted, pow2 = AdaptiveWindow(0.01, prefill_group=2, calls=calls), AdaptiveWindow(0.01, prefill_group=2)
    for _ in range(400):
        lengths = [rng.randint(1, 200) for _ in range(rng.choice((0, 1, 2, 3, 4)))]
        for w in (fitted, pow2):
            w.observe(cost(lengths), load=1.0, prefill_lengths=lengths)
    probe = [33, 70, 150]
    assert fitted.predict(probe) == pytest.approx(cost(probe), rel=1e-4)
    assert abs(pow2.predict(probe) / cost(probe) - 1) > 0.02  # type: ignore[operator]


class _TokenBound(FixedWindow):
    """Test double: a fixed window whose prefill bound is a token count."""

    def __init__(self, window: float, tokens: int) -> None:
        super().__init__(window)
        self.tokens = tokens
        self.seen: list[list[int]] = []

    def prefill_fits(self, prefill_lengths: Sequence[int], decodes: int = 0) -> bool:
        return sum(prefill_lengths) <= self.tokens

    def observe(self, latency: float, load: float, prefill_lengths: Sequence[int] = (), decodes: int = 0) -> None:
        self.seen.append(list(prefill_lengths))


def test_engine_admits_what_the_window_bound_allows_without_waiting() -> None:
    """Window 1 s, full prefill = 8, bound = 25 tokens: three 10-token prompts
    are more than one step may carry, so the window does not wait for more
    (the prefill cannot grow) and each step takes what fits; the window sees
    every step's prefill lengths."""
    runner = SyntheticRunner(block_size=4, num_blocks=64, max_model_len=64)
    window = _TokenBound(1.0, 25)
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, prefill_batch=8), window)
    for i in range(3):
        eng.add(i, [65 + i] * 10, SamplingParams(max_tokens=4, seed=i), 0.0)
    assert eng.next_wakeup() == 0.0
    plan, _ = eng.schedule(0.0)
    assert plan is not None and [len(w.token_ids) for w in plan.prefills] == [10, 10]
    eng.commit(plan, runner.execute(plan), 0.01)
    plan, _ = eng.schedule(0.01)  # the third is alone and more could join: it waits
    assert plan is not None and not plan.prefills and eng.next_wakeup() == pytest.approx(1.0)
    eng.commit(plan, runner.execute(plan), 0.02)
    assert window.seen == [[10, 10], []]
    eng.add(3, [70] * 20, SamplingParams(max_tokens=4, seed=3), 0.03)
    wake = eng.next_wakeup()
    assert wake is not None and wake <= 0.03  # 10 + 20 > 25: the next prefill is as full as it gets
    plan, _ = eng.schedule(0.03)
    assert plan is not None and [len(w.token_ids) for w in plan.prefills] == [10]


def test_engine_does_not_wait_for_company_that_would_not_fit() -> None:
    """Window 1 s, bound 25 tokens: a lone 10-token prompt waits (a second
    like it would fit), a lone 15-token one does not (15 + 15 > 25: waiting
    cannot make its prefill bigger, it would only leave a slot empty)."""
    runner = SyntheticRunner(block_size=4, num_blocks=64, max_model_len=64)
    for n, wake in ((10, 1.0), (15, 0.0)):
        eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, prefill_batch=8), _TokenBound(1.0, 25))
        eng.add(0, [65] * n, SamplingParams(max_tokens=4, seed=0), 0.0)
        assert eng.next_wakeup() == pytest.approx(wake)
        plan, _ = eng.schedule(0.0)
        assert bool(plan) is (wake == 0.0)
    # the engine's own token cap counts the same way, for any window
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, prefill_batch=8, max_prefill_tokens=25),
                 FixedWindow(1.0))  # fmt: skip
    eng.add(0, [65] * 15, SamplingParams(max_tokens=4, seed=0), 0.0)
    assert eng.next_wakeup() == 0.0


def test_parse_batch_window() -> None:
    assert isinstance(parse_batch_window("adaptive"), AdaptiveWindow)
    assert parse_batch_window("adaptive", prefill_group=1).prefill_group == 1  # type: ignore[attr-defined]
    fixed = parse_batch_window("fixed:2.5")
    assert type(fixed) is FixedWindow and fixed.window == pytest.approx(0.0025)
    for bad in ("fixed:x", "sometimes", "fixed:-1"):
        with pytest.raises(ValueError):
            parse_batch_window(bad)


def _replay(window: FixedWindow, steps: int = 1500) -> tuple[list[float], int]:
    """Bursts of 12 prompts (30..60 tokens) every 40 ms through the engine on a
    virtual clock; a step costs ``_cost`` of its prefills (decodes are in the
    3 ms base). Returns the step latencies and the tokens generated."""
    import random

    rng = random.Random(3)
    runner = SyntheticRunner(block_size=16, num_blocks=1024, max_model_len=256, verify=False)
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=32, prefill_batch=8, step_tokens=0), window)
    now, next_burst, key = 0.0, 0.0, 0
    lat: list[float] = []
    while len(lat) < steps:
        while next_burst <= now:
            for _ in range(12):
                key += 1
                prompt = [rng.randrange(32, 127) for _ in range(rng.randint(30, 60))]
                eng.add(key, prompt, SamplingParams(max_tokens=rng.randint(5, 20), seed=key), next_burst)
            next_burst += 0.040
        plan, _ = eng.schedule(now)
        if plan is None:
            wake = eng.next_wakeup()
            now = min(next_burst, wake if wake is not None else next_burst)
            continue
        cost = _cost([len(w.token_ids) for w in plan.prefills])
        now += cost
        lat.append(cost)
        eng.commit(plan, runner.execute(plan), now)
    return lat, eng.tokens_generated


def test_dbs_adapt_holds_a_p99_that_a_zero_window_misses() -> None:
    """Each burst admitted at once makes a 12.7 ms step (calls of 8 and 4
    prompts); DBS-Adapt learns the step cost and splits bursts so its p99
    (after a warm-up) stays within the 10 ms target, at no loss of tokens."""
    def p99(lat: list[float]) -> float:
        tail = sorted(lat[len(lat) // 3 :])
        return tail[int(0.99 * (len(tail) - 1))]

    fixed, fixed_tokens = _replay(FixedWindow(0.0))
    ada, ada_tokens = _replay(AdaptiveWindow(0.010, w_max=0.02))
    assert p99(fixed) > 0.012
    assert p99(ada) <= 0.010
    assert ada_tokens >= 0.95 * fixed_tokens
