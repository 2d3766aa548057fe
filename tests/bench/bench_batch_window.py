"""DBS-Adapt vs the best fixed admission window: throughput at a p99 step-latency target.

The issue's figure is "throughput at a p99 step-latency target": for each
SLO, the most load a configuration sustains while its p99 step latency stays
within the SLO. (An earlier version of this bench replayed a few fixed
offered loads and compared tokens/s; every configuration that keeps up with
an open-loop load produces the same tokens/s, so that ratio was ~1.00x by
construction and said nothing about the SLO.)

1. Measure the real ``JaxRunner``'s step cost (tiny model by default):
   decode calls per batch bucket, prefill calls per (batch, length) bucket,
   and whole mixed steps (decode 16 or 32 + one prefill call of each bucket),
   all interleaved over 30 rounds; the lower quartile, as a neighbour's burst
   inflates some rounds. A step's calls overlap (the host prepares one while
   the previous runs), so the replay charges a step the sum of its calls less
   the overlap measured for each prefill bucket beside a decode-32 call, and
   is checked on the held-out decode-16 mixed steps.
2. Replay open-loop Poisson arrivals through the real engine on a virtual
   clock (``MeasuredCostRunner`` groups prefills with the runner's own
   :class:`~inference.model.buckets.Buckets`, ``--prefill-batch`` per call,
   default the worker's 4). Every configuration sees the same requests.
   Then run a replay's own steps (plans, block tables) on the real runner and
   compare their wall time with what the replay charged.
3. For each SLO, each configuration's score is the highest arrival rate at
   and below which every swept rate was sustained (at most one batch left
   waiting at the end) with p99 step latency within the SLO: a 0.1 grid from
   0.3x the window-0 capacity, refined in 0.02 steps. DBS-Adapt (that SLO as
   its target, tracking p99.5) vs (a) the best fixed window (0-32 ms) at the
   engine's default per-step prefill cap, the issue's baseline, and (b) the
   best fixed window x static prefill-token cap (32-4096), a stronger one.

    .venv/bin/python tests/bench/bench_batch_window.py [--model tiny] [--table FILE] [--seed N]

Last measured (tiny model, 2-core box shared with three others), SLOs from
1.05x to 2x the tightest one (a decode-32 step plus one lone prompt), seeds
0-2, 15 (SLO, seed) cells per table; min / median / max of DBS-Adapt's max
sustainable throughput over the best fixed configuration's:

  table B (measured at load 3.8; decode-32 step 3.36 ms, a prompt adds
  1.14-1.66 ms alone, 0.77-1.23 ms in a call of 2, 0.52-1.01 ms in a call
  of 4), SLOs 5.3-10.0 ms, --prefill-batch 2 (the worker's default):
    vs the best fixed window            1.00 / 1.61 / 1.74
    vs the best fixed window x cap      1.00 / 1.02 / 1.12
  --prefill-batch 4: table B 1.00 / 1.62 / 1.74 and 0.98 / 1.02 / 1.11;
  table A (load 7; decode-32 2.80 ms, a prompt adds 0.95-1.39 ms alone,
  SLOs 4.4-8.4 ms) 1.00 / 1.45 / 1.58 and 1.00 / 1.03 / 1.09.
  Table A, seed 0, --prefill-batch 8: 1.01 / 1.35 / 1.51 and 1.01 / 1.01 /
  1.06; --prefill-batch 1 (every prompt its own call, as the worker ran
  before it passed a batch to the runner): 1.00 / 1.43 / 1.47 and 1.00 /
  1.06 / 1.29. Before this version's window rule (table A, --prefill-batch
  4, seed 0): 0.97 / 1.35 / 1.51 and 0.97 / 1.01 / 1.06. The old
  fixed-offered-load design: 0.98-1.03x, median 1.00x.

2026-11-30 (session 5), after the native CPU kernels (packed projection
matmul, native prefill attention) and the finer shape buckets, tiny model,
quiet (load ~1.1), seed 0, --prefill-batch 2: a decode-32 step 2.11 ms, a
prompt adds 0.50-0.76 ms alone, 0.35-0.56 ms in a call of 2 (session 3's
table B: 3.36 ms and 1.14-1.66 ms); SLOs 3.02-5.74 ms. Two runs: vs the
best fixed window 1.00 / 1.04 / 1.36 and 1.00 / 1.08 / 1.27 (1.27x and
1.26x at the two tightest SLOs, 1.00-1.08x from 1.2x the tightest up); vs
the best fixed window x cap 1.00 / 1.00 / 1.08 and 1.00 / 1.01 / 1.09. With
prompts this much cheaper next to a decode step, a fixed window's burst of
prompts no longer pushes its p99 past the looser SLOs, so the median
advantage that made the issue's >= 1.25x is gone; only the tightest SLOs
keep it.

2026-11-30 (session 6), DBS-Adapt's cost model now on the runner's own
buckets (``bucket_calls``; no measurable change against the powers of two:
1.31 / 1.29 vs 1.31 / 1.31 at the two tightest SLOs), tiny model, table
measured at load ~1.7 (decode-32 2.07 ms, a prompt adds 0.43-0.71 ms alone),
SLOs 2.88-5.49 ms, vs the best fixed window, min / median / max over the 5
SLOs:

  Poisson arrivals, seeds 0 / 1 / 2: 1.00 / 1.12 / 1.31, 1.00 / 1.12 / 1.31,
    1.00 / 1.11 / 1.29 (vs window x cap: medians 1.01, maxima 1.10-1.11);
  bursty arrivals (--burst 0.25, CV 2), seed 0: 1.00 / 1.30 / 1.54
    (1.50x, 1.54x, 1.30x at the three tightest SLOs; vs window x cap 1.00).

The bench now also prints the SLOs that bind (below the p99 the best fixed
window reaches at its own capacity) and the ratio over those: Poisson, seed
0: 3 of 5 (below 3.67 ms), min 1.12x, median 1.29x, max 1.31x.

Per SLO (Poisson, seed 0): 1.31x at 2.88 ms, 1.29x at 3.16, 1.12x at 3.57,
1.00x at 4.12 and 5.49 ms. The last two lie above the p99 every fixed window
reaches at its own capacity (3.61-3.87 ms): no configuration is held back by
them, all run at capacity (1.08x of window 0), and no window policy can gain
there; between, DBS-Adapt runs at capacity from 3.16 ms on. So on this runner
the >= 1.25x holds where the target binds hard (within ~1.1x of the tightest
SLO with Poisson arrivals, ~1.25x with bursty ones), not over the grid. Longer
prompts do not change that (--prompt 32:768 --output 16:160, powers-of-two
cost model: 1.10x at the two tightest SLOs, 0.98x above): prefill there is
compute-bound and batching it buys nothing. ``--model medium`` (hidden 256,
4 layers; decode-32 4.72 ms, a prompt adds 2.9-4.6 ms alone, near session
3's proportions), Poisson, seeds 0 / 1: 1.00 / 1.30 / 1.44 and 0.99 / 1.23 /
1.32 (1.38, 1.44, 1.30, 1.13, 1.00 and 1.32, 1.32, 1.23, 1.10, 0.99 by SLO,
9.78-18.62 ms); vs window x cap medians 1.01. Bursty arrivals (--burst
0.25): tiny seed 1 1.00 / 1.37 / 1.66 (binding SLOs 3 of 5: median 1.50);
medium seed 0 1.02 / 1.91 / 2.87 (all 5 bind); vs window x cap medians
1.01-1.02. So over the SLO grid the median reaches 1.25x with bursty
arrivals (1.30-1.91) and on the medium model (1.23-1.30), not on the tiny
model with Poisson arrivals (1.11-1.12).

2026-11-30 (session 7), tiny model, table measured quiet (load 0.6;
decode-32 1.98 ms, a 16-token prompt adds 0.45 ms alone, 0.14 ms each in
a call of 8), SLOs 2.75-5.24 ms; by SLO, DBS-Adapt / the best fixed window:
Poisson seeds 0 / 1 / 2: 1.31, 1.25, 1.00, 1.00, 1.00 / 1.26, 1.23, 1.01,
1.00, 1.00 / 1.25, 1.22, 1.00, 1.00, 1.00 (2 of 5 SLOs bind, below 3.25
ms); bursty (--burst 0.25) seed 0: 1.61, 1.38, 1.02, 1.00, 1.00. The bench
now prints DBS-Adapt's throughput against the ceiling (the most any fixed
configuration sustains at any p99): 98-100% at every SLO, down to the
tightest. So DBS-Adapt is at the runner's capacity everywhere, and the
ratio is set by how far the best fixed window falls below it: 18-22% at
1.05x the tightest step, 14-16% at 1.15x, none from 1.3x up.

Replay vs whole measured steps: -3%..+6% on the held-out decode-16 steps; a
replay's own steps on the real runner: median real/replay 0.86-1.20 across
runs (load 2-7), the p99 step -15% to +93% (the real tail is the neighbours'
bursts: worst at load 7; the table is a lower quartile).

Reading it (session 3's tables): the issue's >= 1.25x held against its baseline, the best fixed
window, in the median (1.45x-1.62x), but that margin is DBS-Adapt's per-step
prefill bound, not its window: at the engine's default cap a burst of
prompts lands in one step, so a fixed window's p99 crosses a tight SLO at
0.55-0.75x of capacity, while DBS-Adapt holds it to 0.94-1.10x. Against a
fixed window with a hand-picked static prefill-token cap (a knob the issue
does not ask for) it is 0.98-1.12x, median 1.02-1.03x, because batching
prompts cannot buy more on this runner: at saturation 1.14 prompts join
each step and gathering them into calls of 2 or 4 (padded to the longest)
shortens a step by 1.08-1.12x at best (the ceiling line), less the slots
left empty while they gather; the best fixed windows reach 1.04-1.10x of
window-0 capacity at loose SLOs and so does DBS-Adapt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference.batch_window import AdaptiveWindow, FixedWindow, bucket_calls, pow2_calls  # noqa: E402
from inference.engine import Engine, EngineConfig, Finished  # noqa: E402
from inference.model.buckets import Buckets, pow2_ceil  # noqa: E402  (no JAX import)
from inference.runner import SeqOutput, SeqWork, StepPlan  # noqa: E402
from inference.tokenizer import ByteTokenizer  # noqa: E402
from transport.common.worker_options import WorkerOptions  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

MAX_BATCH = 32
PREFILL_BATCH = WorkerOptions().max_prefill_batch  # the worker's default (2)
DEFAULT_CAP = 4096  # this bench's prefill-token cap per step (the worker's default is 2048)
DECODE_B = (1, 2, 4, 8, 16, 32)
PREFILL_B = (1, 2, 4, 8)
MAX_PREFILL_TOKENS = WorkerOptions().max_prefill_tokens  # the runner's (2048): a call of b > 1 prompts holds b x t <= this
CHECK_DECODE = 16  # held-out check: decode 16 + k prefills (the replay is fitted on decode 32 + k)

# decode cost per batch bucket; prefill call cost per (batch, tokens) bucket;
# whole mixed steps: (decode batch, prefill batch, prefill tokens) -> cost
Table = tuple[dict[int, float], dict[tuple[int, int], float], dict[tuple[int, int, int], float]]


def prefill_lengths(longest_prompt: int) -> tuple[int, ...]:
    """The prompt lengths the table measures: powers of two from 16 up to the workload's longest prompt's."""
    return tuple(1 << i for i in range(4, pow2_ceil(max(16, longest_prompt)).bit_length()))


def measured_shapes(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(b, t) for b in PREFILL_B for t in lengths if b == 1 or b * t <= MAX_PREFILL_TOKENS]


def measure(model: str, lengths: tuple[int, ...], rounds: int = 30) -> Table:
    from inference.model.jax_runner import JaxRunner

    stride = -(-max(lengths) // 16) + 4  # blocks per sequence: the longest prompt, or a 64-token context
    r = JaxRunner.load(model, block_size=16, num_blocks=48 * stride, max_batch=MAX_BATCH,
                       max_prefill_batch=max(PREFILL_B))  # its max_prefill_tokens: 2048  # fmt: skip
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    shapes = measured_shapes(lengths)

    def table(i: int, n: int) -> tuple[int, ...]:
        return tuple(range(i * stride, i * stride + -(-n // 16)))

    def dec_work(b: int) -> tuple[SeqWork, ...]:
        return tuple(SeqWork(i, (65,), 63, table(i, 64), sp, 1, 1) for i in range(b))

    def pre_work(b: int, t: int, base: int = 0) -> tuple[SeqWork, ...]:
        return tuple(SeqWork(base + i, (66,) * t, 0, table(base + i, t), sp, 1, 0) for i in range(b))

    plans: dict[tuple, StepPlan] = {("d", b): StepPlan((), dec_work(b)) for b in DECODE_B}
    plans.update({("p", b, t): StepPlan(pre_work(b, t), ()) for b, t in shapes})
    for d in (MAX_BATCH, CHECK_DECODE):
        plans.update({("m", d, b, t): StepPlan(pre_work(b, t, base=40), dec_work(d)) for b, t in shapes})
    for plan in plans.values():
        r.execute(plan)  # compile
    times: dict[tuple, list[float]] = {k: [] for k in plans}
    keys = list(plans)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(keys)
        for k in keys:
            t0 = time.perf_counter()
            r.execute(plans[k])
            times[k].append(time.perf_counter() - t0)
    # The lower quartile: on a shared box a neighbour's burst inflates some
    # rounds (and per-call overheads most), which a dedicated server would not see.
    low = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items()}
    return (
        {b: low[("d", b)] for b in DECODE_B},
        {(b, t): low[("p", b, t)] for b, t in shapes},
        {k[1:]: v for k, v in low.items() if k[0] == "m"},
    )


def overlaps(table: Table) -> dict[tuple[int, int], float]:
    """How much of a prefill call of each bucket hides behind the decode call
    of the same step: a whole measured step (decode 32 + one prefill call)
    costs less than its two calls measured alone, by this much."""
    dec, pre, mixed = table
    return {(b, t): dec[MAX_BATCH] + pre[(b, t)] - v for (d, b, t), v in mixed.items() if d == MAX_BATCH}


def _between(table: dict[int, float], x: int) -> float:
    """The table at ``x``, linear between the measured sizes either side (the table holds the powers
    of two; the runner's buckets between them, e.g. 24 and 48, were not measured)."""
    lo, hi = max(k for k in table if k <= x), min(k for k in table if k >= x)
    return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


class MeasuredCostRunner:
    """Bench double for the model runner: a constant token (requests end at
    ``max_tokens``), step time from the measured table for the calls the real
    runner would make (prefills grouped by its Buckets, decodes per bucket),
    less what each prefill call of that bucket was measured to overlap."""

    def __init__(self, table: Table, prefill_batch: int, overlap: bool = True) -> None:
        self.block_size, self.num_blocks, self.max_model_len = 16, 4096, 1024
        self.eos_token_ids: tuple[int, ...] = (257,)
        self.sliding_window: int | None = None
        self.dec, self.pre, _ = table
        self.overlap = overlaps(table) if overlap else {}
        self.buckets = Buckets(max_batch=MAX_BATCH, max_model_len=self.max_model_len,
                               max_prefill_batch=prefill_batch, max_prefill_tokens=MAX_PREFILL_TOKENS)  # fmt: skip
        # per prefill batch, the measured lengths' call cost and overlap (built once: cost() runs every step)
        self.calls: dict[int, tuple[dict[int, float], dict[int, float]]] = {}
        for (b, t), v in self.pre.items():
            call, hidden = self.calls.setdefault(b, ({}, {}))
            call[t], hidden[t] = v, self.overlap.get((b, t), 0.0)
        self.last_cost = 0.0

    def cost(self, plan: StepPlan) -> float:
        lengths = [len(w.token_ids) for w in plan.prefills]
        cost = 0.0
        for i in range(0, len(plan.decodes), MAX_BATCH):
            cost += _between(self.dec, self.buckets.decode_batch(len(plan.decodes[i : i + MAX_BATCH])))
        for group in self.buckets.group_prefills(lengths) if lengths else []:
            b, t = self.buckets.prefill_shape(len(group), max(lengths[i] for i in group))
            call, hidden = self.calls[b]
            tt = min(t, max(call))  # longer (recomputed) prompts: scale the longest measured
            cost += _between(call, tt) * t / tt - (_between(hidden, tt) if cost > 0 else 0.0)
        return cost

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        self.last_cost = self.cost(plan)
        return [SeqOutput(w.seq_id, 65, -0.1) for w in (*plan.prefills, *plan.decodes)]


class Arrivals:
    """Open-loop arrivals at ``rate``: Poisson, or burstier with gamma
    inter-arrival times of shape ``args.burst`` < 1 (coefficient of variation
    ``1 / sqrt(shape)``). The same seed gives every configuration the same
    requests at the same times (common random numbers)."""

    def __init__(self, args: argparse.Namespace, rate: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.args, self.rate = args, rate
        self.next = self._gap()

    def _gap(self) -> float:
        k = self.args.burst
        return self.rng.expovariate(self.rate) if k == 1 else self.rng.gammavariate(k, 1 / (k * self.rate))

    def due(self, now: float, submit: Callable[[list[int], int], None]) -> None:
        while self.next <= now:
            plen, out = self.rng.randint(*self.args.prompt), self.rng.randint(*self.args.output)
            submit([self.rng.randrange(32, 127) for _ in range(plen)], out)
            self.next += self._gap()


@dataclass(frozen=True, slots=True)
class Replay:
    tps: float  # generated tokens per second
    p99: float  # p99 step latency, seconds
    backlog: int  # requests still waiting for admission at the end
    ttft: float  # mean time to first token, seconds


def simulate(window: FixedWindow, runner: MeasuredCostRunner, cap: int, rate: float,
             args: argparse.Namespace, record: list[tuple[StepPlan, float]] | None = None) -> Replay:  # fmt: skip
    """One open-loop replay on the virtual clock; the first tenth is warm-up
    (not counted in throughput or latency). ``record`` collects every step's
    plan and replayed cost."""
    cfg = EngineConfig(max_batch=MAX_BATCH, prefill_batch=args.prefill_batch, max_prefill_tokens=cap)
    eng = Engine(runner, ByteTokenizer(), cfg, window)  # type: ignore[arg-type]
    arrivals = Arrivals(args, rate, args.seed)
    start_of: dict[int, float] = {}
    ttfts: list[float] = []
    lat: list[float] = []
    now, tokens, count = 0.0, 0, 0
    warm = args.duration / 10

    def submit(prompt: list[int], out: int) -> None:
        nonlocal count
        count += 1
        eng.add(count, prompt, SamplingParams(max_tokens=out, seed=count), now, return_text=False)
        start_of[count] = now

    while now < args.duration:
        arrivals.due(now, submit)
        plan, _ = eng.schedule(now)
        if plan is None:
            w = eng.next_wakeup()
            now = max(now + 1e-6, min(arrivals.next, w if w is not None else float("inf")))
            continue
        outs = runner.execute(plan)
        if record is not None:
            record.append((plan, runner.last_cost))
        now += runner.last_cost
        counted = now - runner.last_cost >= warm
        if counted:
            lat.append(runner.last_cost)
        for ev in eng.commit(plan, outs, now):
            if isinstance(ev, Finished):
                continue
            if counted:
                tokens += len(ev.token_ids)  # type: ignore[union-attr]
            if ev.key in start_of:
                t = now - start_of.pop(ev.key)  # type: ignore[call-overload]
                if counted:
                    ttfts.append(t)
    lat.sort()
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
    return Replay(tokens / (args.duration - warm), p99, eng.num_waiting, sum(ttfts) / max(1, len(ttfts)))


def sustained(r: Replay) -> bool:
    """The engine kept up: no more than one batch of requests left waiting
    (an overloaded engine's queue grows by the excess rate x duration)."""
    return r.backlog <= MAX_BATCH


class Sweep:
    """One configuration's replays over arrival rates (cached: a fixed
    configuration is scored at every SLO from the same replays)."""

    def __init__(self, make: Callable[[], FixedWindow], runner: MeasuredCostRunner, cap: int,
                 unit: float, args: argparse.Namespace) -> None:  # fmt: skip
        self.make, self.runner, self.cap, self.unit, self.args = make, runner, cap, unit, args
        self.runs: dict[float, Replay] = {}

    def run(self, f: float) -> Replay:
        f = round(f, 3)
        if f not in self.runs:
            self.runs[f] = simulate(self.make(), self.runner, self.cap, f * self.unit, self.args)
        return self.runs[f]

    def ok(self, f: float, slo: float) -> bool:
        r = self.run(f)
        return sustained(r) and r.p99 <= slo

    def max_rate(self, slo: float) -> float:
        """The highest rate (a fraction of ``unit``) at and below which every
        swept rate was sustained with p99 step latency within ``slo``: a coarse
        walk up the grid, then steps of ``fine`` past the last coarse pass."""
        a = self.args
        best = 0.0
        for f in a.rates:
            if not self.ok(f, slo):
                break
            best = f
        else:
            return best
        step = a.rates[1] - a.rates[0] if len(a.rates) > 1 else a.fine
        f = best + a.fine if best else a.rates[0] / 2
        while f < (best or a.rates[0]) + step - 1e-9 and self.ok(f, slo):
            best, f = f, f + a.fine
        return best


def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def _floats(spec: str) -> tuple[float, ...]:
    return tuple(float(x) for x in spec.split(","))


def resolve_model(args: argparse.Namespace) -> str:
    """The model to load: ``medium`` is the random Llama of bench_prefix_cache, written to a temp dir."""
    if args.model != "medium":
        return str(args.model)
    import tempfile

    from bench_prefix_cache import MEDIUM  # type: ignore[import-not-found]

    from inference.weights import write_hf_checkpoint

    return str(write_hf_checkpoint(Path(tempfile.mkdtemp()) / "medium", MEDIUM, seed=0))


def load_table(args: argparse.Namespace) -> Table:
    if args.table and Path(args.table).exists():
        raw = json.loads(Path(args.table).read_text())
        if "mixed3" in raw:
            dec = {int(k): v for k, v in raw["decode"].items()}
            pre = {(int(k.split("x")[0]), int(k.split("x")[1])): v for k, v in raw["prefill"].items()}
            mixed = {tuple(int(x) for x in k.split("x")): v for k, v in raw["mixed3"].items()}
            return dec, pre, mixed  # type: ignore[return-value]
    dec, pre, mixed = measure(resolve_model(args), prefill_lengths(args.prompt[1]))
    if args.table:
        Path(args.table).write_text(json.dumps({
            "decode": dec, "prefill": {f"{b}x{t}": v for (b, t), v in pre.items()},
            "mixed3": {"x".join(map(str, k)): v for k, v in mixed.items()}}))  # fmt: skip
    return dec, pre, mixed


def check_replay(model: str, steps: list[tuple[StepPlan, float]], prefill_batch: int, passes: int = 3) -> str:
    """Run a replay's own steps (its plans, block tables included) on the real
    runner, ``passes`` times interleaved (the fastest pass of each step, as the
    table takes a low quantile), and compare with what the replay charged:
    decode-only steps and steps that carry prefills apart."""
    from inference.model.jax_runner import JaxRunner

    r = JaxRunner.load(model, block_size=16, num_blocks=4096, max_batch=MAX_BATCH, max_prefill_batch=prefill_batch)
    for plan, _ in steps:  # compile every shape the steps use
        r.execute(plan)
    real = [float("inf")] * len(steps)
    for _ in range(passes):
        for i, (plan, _) in enumerate(steps):
            t0 = time.perf_counter()
            r.execute(plan)
            real[i] = min(real[i], time.perf_counter() - t0)
    out = []
    for name, keep in (("decode only", False), ("with prefills", True)):
        idx = [i for i, (plan, _) in enumerate(steps) if bool(plan.prefills) is keep]
        if not idx:
            continue
        ratio = sorted(real[i] / steps[i][1] for i in idx)
        a, b = sorted(real[i] for i in idx), sorted(steps[i][1] for i in idx)
        q = int(0.99 * (len(idx) - 1))
        out.append(f"{name} ({len(idx)}): real/replay median {statistics.median(ratio):.2f} (p10 "
                   f"{ratio[len(ratio) // 10]:.2f}, p90 {ratio[9 * len(ratio) // 10]:.2f}), p99 real "
                   f"{a[q] * 1e3:.2f} ms vs replay {b[q] * 1e3:.2f} ms")  # fmt: skip
    return "; ".join(out)


def report_table(table: Table, runner: MeasuredCostRunner) -> None:
    dec, pre, mixed = table
    print("measured step cost (ms, lower quartile of interleaved rounds): decode " + ", ".join(f"b{b}={v * 1e3:.2f}" for b, v in dec.items()))
    print("  prefill calls alone " + ", ".join(f"{b}x{t}={v * 1e3:.2f}" for (b, t), v in pre.items()))
    print("  replay model vs whole measured steps (decode d + one prefill call of b x t), ms:")
    errs = {MAX_BATCH: [], CHECK_DECODE: []}  # type: dict[int, list[float]]
    for (d, b, t), v in sorted(mixed.items()):
        if b > runner.buckets.max_prefill_batch:
            continue  # measured as one call; the replay's runner would make two
        sp = StepPlan(tuple(SeqWork(i, (66,) * t, 0, (), None, 0, 0) for i in range(b)),  # type: ignore[arg-type]
                      tuple(SeqWork(100 + i, (65,), 63, (), None, 0, 1) for i in range(d)))  # type: ignore[arg-type]
        model = runner.cost(sp)
        errs[d].append(model / v - 1)
        if t == 32:
            print(f"    d{d} + {b}x{t}: measured {v * 1e3:.2f}, replay {model * 1e3:.2f} ({model / v - 1:+.0%})")
    print(f"  replay error: fitted on decode {MAX_BATCH} (exact there by construction); held-out decode "
          f"{CHECK_DECODE}: {min(errs[CHECK_DECODE]):+.0%} .. {max(errs[CHECK_DECODE]):+.0%}")  # fmt: skip
    for t in sorted({t for _, t in pre}):
        adds = {b: mixed[(MAX_BATCH, b, t)] - dec[MAX_BATCH] for b in PREFILL_B if (MAX_BATCH, b, t) in mixed}
        print(f"  in a decode-{MAX_BATCH} step a {t}-token-bucket prefill adds " + ", ".join(
            f"{adds[b] / b * 1e3:.2f} ms each in a call of {b}" for b in adds))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | medium | a checkpoint directory")
    ap.add_argument("--duration", type=float, default=4.0, help="virtual seconds per replay")
    ap.add_argument("--slo-ms", type=_floats, default=None, help="p99 step-latency SLOs (default: from the table)")
    ap.add_argument("--rates", type=_floats, default=tuple(round(0.3 + 0.1 * i, 1) for i in range(13)),
                    help="coarse grid of open-loop arrival rates, as fractions of the window-0 capacity")  # fmt: skip
    ap.add_argument("--fine", type=float, default=0.02, help="finer rate steps past the last coarse pass")
    ap.add_argument("--windows-ms", type=_floats, default=(0, 2, 4, 8, 16, 32))
    ap.add_argument("--caps", type=_floats, default=(32, 64, 128, DEFAULT_CAP), help="prefill tokens per step")
    ap.add_argument("--prefill-batch", type=int, default=PREFILL_BATCH, help="prefills per runner call")
    ap.add_argument("--prompt", type=_range, default=(8, 40), help="prompt tokens lo:hi")
    ap.add_argument("--output", type=_range, default=(8, 48), help="generated tokens lo:hi")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--burst", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 is Poisson, < 1 burstier (CV 1/sqrt(shape))")
    ap.add_argument("--no-overlap", action="store_true", help="a step costs the plain sum of its calls")
    # A quantile tracker oscillates about its miss rate, so to hold a p99 SLO
    # DBS-Adapt aims at p99.5.
    ap.add_argument("--quantile", type=float, default=0.995, help="the latency quantile DBS-Adapt tracks")
    ap.add_argument("--pow2-cost-model", action="store_true",
                    help="DBS-Adapt's cost model pads to powers of two (as before session 6), not the runner's buckets")
    ap.add_argument("--no-check", action="store_true", help="skip running replayed steps on the real runner")
    ap.add_argument("--table", default=None, help="JSON file: reuse a measured cost table, or save one there")
    args = ap.parse_args()
    table = load_table(args)
    dec, pre, _ = table
    runner = MeasuredCostRunner(table, args.prefill_batch, overlap=not args.no_overlap)
    # DBS-Adapt's step-cost model sees the runner's prefill calls, as the worker wires it
    calls = pow2_calls(args.prefill_batch) if args.pow2_cost_model else bucket_calls(runner.buckets)
    print(f"load average {os.getloadavg()[0]:.2f}")
    report_table(table, runner)
    # At saturation every step admits r = max_batch / mean output requests.
    # Window 0 runs them about one call each; a window that gathers k runs
    # them in calls of k, each padded to its longest prompt's bucket. The
    # mean cost each adds to a full decode step, over prompts drawn as in
    # the workload, bounds what batching can buy (before the slots that
    # stay empty while k gather).
    r = MAX_BATCH / (sum(args.output) / 2)
    rng = random.Random(1)

    def added(k: int, n: int = 400) -> float:
        total = 0.0
        for _ in range(n):
            sp = StepPlan(tuple(SeqWork(i, (66,) * rng.randint(*args.prompt), 0, (), None, 0, 0)  # type: ignore[arg-type]
                                for i in range(k)),
                          tuple(SeqWork(100 + i, (65,), 63, (), None, 0, 1) for i in range(MAX_BATCH)))  # type: ignore[arg-type]
            total += runner.cost(sp) - dec[MAX_BATCH]
        return total / n / k

    single = dec[MAX_BATCH] + r * added(1)
    steps = {k: dec[MAX_BATCH] + r * added(k) for k in (2, 4, 8)}
    print(f"ceiling of prefill batching at saturation ({r:.2f} admissions/step): step {single * 1e3:.2f} ms -> "
          + ", ".join(f"{v * 1e3:.2f}" for v in steps.values())
          + f" ms if 2, 4, 8 gather (in calls of up to {args.prefill_batch}) = "
          + ", ".join(f"{single / v:.2f}x" for v in steps.values()) + " (before slots idle while they gather)")
    cap_rps = r / single  # window-0 capacity, requests/s (the unit of the rate sweep)
    lone = (1, min(pow2_ceil(max(16, args.prompt[1])), max(t for _, t in pre)))  # the longest prompt, alone
    tight = dec[MAX_BATCH] + pre[lone] - runner.overlap.get(lone, 0.0)
    slos = args.slo_ms or tuple(round(tight * m * 1e3, 2) for m in (1.05, 1.15, 1.3, 1.5, 2.0))
    print(f"prompts {args.prompt}, outputs {args.output}; open-loop Poisson at {args.rates[0]:.2f}..{args.rates[-1]:.2f}"
          f" x the window-0 capacity ({cap_rps:.0f} req/s); {args.duration:.0f} virtual s per replay; seed {args.seed}")
    print(f"SLOs (p99 step, ms): {slos}; the score of a configuration at an SLO is the highest swept rate at and "
          "below which it kept up with p99 within the SLO")  # fmt: skip
    if not args.no_check:
        steps: list[tuple[StepPlan, float]] = []
        short = argparse.Namespace(**{**vars(args), "duration": 1.0})
        simulate(AdaptiveWindow(slos[2] / 1e3, w_max=0.032, quantile=args.quantile, prefill_group=args.prefill_batch,
                                calls=calls),
                 runner, DEFAULT_CAP, cap_rps, short, steps)  # fmt: skip
        simulate(FixedWindow(0.032), runner, DEFAULT_CAP, cap_rps, short, steps)
        print(f"check: a replay's own steps (DBS-Adapt at {slos[2]} ms and a fixed 32 ms window, both at 1.0x) on "
              f"the real runner: {check_replay(resolve_model(args), steps, args.prefill_batch)} "
              f"(load average {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    fixed = {(w_ms, int(cap)): Sweep(lambda w=w_ms: FixedWindow(w / 1e3), runner, int(cap), cap_rps, args)
             for cap in args.caps for w_ms in args.windows_ms}  # fmt: skip
    vs_all: list[float] = []
    vs_window: list[float] = []
    by_slo: list[tuple[float, float]] = []  # (SLO ms, DBS-Adapt / the best fixed window)
    ada_tps: list[float] = []  # DBS-Adapt's throughput at its highest sustained rate, per SLO
    for slo in slos:
        s = slo / 1e3
        ada = Sweep(lambda s=s: AdaptiveWindow(s, w_min=0.0, w_max=0.032, lr=0.5, quantile=args.quantile,
                                               prefill_group=args.prefill_batch, calls=calls),
                    runner, DEFAULT_CAP, cap_rps, args)  # fmt: skip
        a_f = ada.max_rate(s)
        a_tps = ada.run(a_f).tps if a_f else 0.0
        ada_tps.append(a_tps)
        scores = {key: sw.max_rate(s) for key, sw in fixed.items()}
        line = f"  SLO {slo:6.2f} ms: DBS-Adapt {a_f:.2f}x ({a_tps:5.0f} tok/s)"
        for name, keys, acc in (("best fixed window", [k for k in fixed if k[1] == DEFAULT_CAP], vs_window),
                                ("best fixed window x cap", list(fixed), vs_all)):  # fmt: skip
            key = max(keys, key=lambda k: (scores[k], fixed[k].run(scores[k]).tps if scores[k] else 0.0))
            f = scores[key]
            if not f:
                line += f" | {name}: none meets it"
                continue
            tps = fixed[key].run(f).tps
            acc.append(a_tps / tps)
            if acc is vs_window:
                by_slo.append((slo, a_tps / tps))
            line += f" | {name} (w {key[0]:g} ms, cap {key[1]}) {f:.2f}x ({tps:5.0f}) -> {a_tps / tps:.2f}x"
        print(line, flush=True)
    print("highest rate each fixed configuration keeps up with (any p99), and its p99 there:")
    at_capacity: dict[tuple[float, int], tuple[float, float]] = {}  # config -> (its highest rate, p99 there)
    for (w_ms, cap), sw in fixed.items():
        f = sw.max_rate(float("inf"))
        if f:
            x = sw.run(f)
            at_capacity[(w_ms, cap)] = (f, x.p99)
            print(f"  fixed {w_ms:3g} ms cap {cap:5d}: {f:.2f}x ({x.tps:5.0f} tok/s), p99 {x.p99 * 1e3:5.2f} ms, "
                  f"TTFT {x.ttft * 1e3:5.1f} ms")  # fmt: skip
    # An SLO at or above the p99 that the best fixed window reaches at its own capacity holds no
    # configuration back: there every one runs at capacity and no window policy can gain. Below it, it binds.
    window_caps = [v for k, v in at_capacity.items() if k[1] == DEFAULT_CAP]
    if window_caps and by_slo:
        top = max(f for f, _ in window_caps)
        bound = min(p99 for f, p99 in window_caps if f == top) * 1e3
        binding = [r for slo, r in by_slo if slo < bound]
        print(f"SLOs below {bound:.2f} ms (the best fixed window's p99 at its capacity) bind: {len(binding)} of "
              f"{len(by_slo)}" + (f"; DBS-Adapt / the best fixed window there: min {min(binding):.2f}x, median "
                                  f"{statistics.median(binding):.2f}x, max {max(binding):.2f}x" if binding else ""))
    if ada_tps and at_capacity:
        # The ceiling: the most any configuration sustains with no latency bound. A window policy that
        # sustains it at an SLO cannot be beaten there by any other window policy by more than the gap.
        ceiling = max(fixed[key].run(f).tps for key, (f, _) in at_capacity.items())
        shares = [tps / ceiling for tps in ada_tps]
        print(f"DBS-Adapt sustains {min(shares):.0%}-{max(shares):.0%} of the ceiling ({ceiling:.0f} tok/s, the most "
              f"any fixed configuration keeps up with at any p99) at every SLO here, down to {slos[0]:.2f} ms")
    for name, acc in (("the best fixed window (engine's default prefill cap)", vs_window),
                      ("the best fixed window x static prefill-token cap", vs_all)):  # fmt: skip
        if acc:
            print(f"DBS-Adapt / {name}: max sustainable throughput at the SLO over {len(acc)} SLOs: "
                  f"min {min(acc):.2f}x, median {statistics.median(acc):.2f}x, max {max(acc):.2f}x")
    print(f"({time.perf_counter() - t0:.0f} s of replays; load average {os.getloadavg()[0]:.2f})")

if __name__ == "__main__":
    main()
