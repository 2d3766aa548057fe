"""DBS-Adapt vs the best fixed admission window at a p99 step-latency target.

1. Measure the real ``JaxRunner``'s step cost (tiny model by default): decode
   steps per batch bucket and batched prefills per (batch, length) bucket.
2. Replay a bursty closed-loop workload (the number of active clients swings
   between phases; short chat-like prompts) through the real engine on a
   virtual clock, where each step costs what the measured table says (the
   ``MeasuredCostRunner`` bench double: tokens from the synthetic runner,
   time from the table).
3. For each fixed window and for DBS-Adapt: throughput (generated tokens per
   second) and p99 step latency. The best fixed window is the fastest one
   whose p99 meets the target; the printed ratio is DBS-Adapt / that.

    .venv/bin/python tests/bench/bench_batch_window.py [--model tiny] [--target-ms 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference.batch_window import AdaptiveWindow, FixedWindow  # noqa: E402
from inference.engine import Engine, EngineConfig, Finished  # noqa: E402
from inference.runner import SeqOutput, SeqWork, StepPlan  # noqa: E402
from inference.synthetic import SyntheticRunner  # noqa: E402
from inference.tokenizer import ByteTokenizer  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

MAX_BATCH = 32
PREFILL_BATCH = 8
DECODE_B = (1, 2, 4, 8, 16, 32)
PREFILL_B = (1, 2, 4, 8)
PREFILL_T = (16, 32, 64)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def measure(model: str, reps: int = 5) -> tuple[dict[int, float], dict[tuple[int, int], float]]:
    from inference.model.runner import JaxRunner

    r = JaxRunner.load(
        model, block_size=16, num_blocks=512, max_batch=MAX_BATCH, max_prefill_batch=PREFILL_BATCH
    )
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=1)

    def table(i: int, n: int) -> tuple[int, ...]:
        return tuple(range(i * 8, i * 8 + -(-n // 16)))

    def best(plan: StepPlan) -> float:
        r.execute(plan)  # compile
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            r.execute(plan)
            ts.append(time.perf_counter() - t)
        return min(ts)

    dec = {
        b: best(StepPlan((), tuple(SeqWork(i, (65,), 63, table(i, 64), sp, 1, 1) for i in range(b))))
        for b in DECODE_B
    }
    pre = {
        (b, t): best(StepPlan(tuple(SeqWork(i, (66,) * t, 0, table(i, t), sp, 1, 0) for i in range(b)), ()))
        for b in PREFILL_B
        for t in PREFILL_T
    }
    return dec, pre


class MeasuredCostRunner(SyntheticRunner):
    """Bench double: synthetic tokens, step time looked up in a table measured
    from the real runner (same bucketing: pow2 batch/length, prefill batch <= 8)."""

    def __init__(self, dec: dict[int, float], pre: dict[tuple[int, int], float]) -> None:
        super().__init__(block_size=16, num_blocks=1024, max_model_len=512)
        self.dec, self.pre = dec, pre
        self.last_cost = 0.0

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        cost = 0.0
        pf = list(plan.prefills)
        for i in range(0, len(pf), PREFILL_BATCH):
            group = pf[i : i + PREFILL_BATCH]
            t = min(max(pow2(max(len(w.token_ids) for w in group)), PREFILL_T[0]), PREFILL_T[-1])
            cost += self.pre[(pow2(len(group)), t)]
        if plan.decodes:
            cost += self.dec[pow2(len(plan.decodes))]
        self.last_cost = cost
        return super().execute(plan)


def simulate(window: FixedWindow, dec: dict[int, float], pre: dict[tuple[int, int], float],
             duration: float, wl: argparse.Namespace, seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """(tokens/s, p99 step latency, mean TTFT) of a closed-loop bursty workload."""
    rng = random.Random(seed)
    runner = MeasuredCostRunner(dec, pre)
    eng = Engine(
        runner, ByteTokenizer(), EngineConfig(max_batch=MAX_BATCH, prefill_batch=PREFILL_BATCH), window
    )
    phase = duration / 8
    clients = [wl.heavy if i % 2 == 0 else wl.light for i in range(8)]
    think = wl.think_ms / 1e3
    next_submit: dict[int, float] = {c: rng.uniform(0, think) for c in range(max(clients))}
    owner: dict[int, int] = {}
    arrivals: dict[int, float] = {}
    ttfts: list[float] = []
    lat: list[float] = []
    now, tokens, rid = 0.0, 0, 0
    while now < duration:
        active = clients[min(int(now // phase), len(clients) - 1)]
        for c, t in list(next_submit.items()):
            if t <= now and c < active:
                rid += 1
                plen, out = rng.randint(*wl.prompt), rng.randint(*wl.output)
                prompt = [rng.randrange(32, 127) for _ in range(plen)]
                eng.add(rid, prompt, SamplingParams(max_tokens=out, seed=rid), now)
                owner[rid], arrivals[rid] = c, now
                del next_submit[c]
        plan, _ = eng.schedule(now)
        if plan is None:
            wake = [t for c, t in next_submit.items() if c < active] + [now + 1e-3]
            w = eng.next_wakeup()
            now = max(now + 1e-6, min(wake + ([w] if w is not None else [])))
            continue
        outs = runner.execute(plan)
        now += runner.last_cost
        lat.append(runner.last_cost)
        for ev in eng.commit(plan, outs, now):
            if isinstance(ev, Finished):
                next_submit[owner.pop(ev.key)] = now + rng.expovariate(1 / think)  # type: ignore[call-overload]
                continue
            tokens += len(ev.token_ids)  # type: ignore[union-attr]
            if ev.key in arrivals:
                ttfts.append(now - arrivals.pop(ev.key))
    lat.sort()
    p99 = lat[int(0.99 * (len(lat) - 1))] if lat else 0.0
    return tokens / duration, p99, sum(ttfts) / max(1, len(ttfts))


def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | medium | a checkpoint directory")
    ap.add_argument("--duration", type=float, default=20.0, help="virtual seconds per run")
    ap.add_argument("--target-ms", type=float, default=0.0, help="p99 step-latency target (default: derived)")
    ap.add_argument("--prompt", type=_range, default=(8, 40), help="prompt tokens lo:hi")
    ap.add_argument("--output", type=_range, default=(8, 48), help="generated tokens lo:hi")
    ap.add_argument("--heavy", type=int, default=48, help="clients in heavy phases")
    ap.add_argument("--light", type=int, default=6, help="clients in light phases")
    ap.add_argument("--think-ms", type=float, default=20.0)
    ap.add_argument("--table", default=None, help="JSON file: reuse a measured cost table, or save one there")
    args = ap.parse_args()
    model = args.model
    if model == "medium":  # the random Llama of bench_prefix_cache, written to a temp dir
        import tempfile

        from bench_prefix_cache import MEDIUM  # type: ignore[import-not-found]

        from inference.weights import write_hf_checkpoint

        model = str(write_hf_checkpoint(Path(tempfile.mkdtemp()) / "medium", MEDIUM, seed=0))
    if args.table and Path(args.table).exists():
        raw = json.loads(Path(args.table).read_text())
        dec = {int(k): v for k, v in raw["decode"].items()}
        pre = {(int(k.split("x")[0]), int(k.split("x")[1])): v for k, v in raw["prefill"].items()}
    else:
        dec, pre = measure(model)
        if args.table:
            Path(args.table).write_text(json.dumps(
                {"decode": dec, "prefill": {f"{b}x{t}": v for (b, t), v in pre.items()}}))  # fmt: skip
    print("measured step cost (ms): decode " + ", ".join(f"b{b}={v * 1e3:.2f}" for b, v in dec.items()))
    print("  prefill " + ", ".join(f"{b}x{t}={v * 1e3:.2f}" for (b, t), v in pre.items()))
    # default target: a full decode step plus one full batched prefill of short prompts
    target = args.target_ms / 1e3 or dec[MAX_BATCH] + pre[(PREFILL_BATCH, 32)]
    print(f"p99 step-latency target: {target * 1e3:.2f} ms, workload: closed loop, {args.heavy} <-> {args.light}"
          f" clients, prompts {args.prompt}, outputs {args.output}, think {args.think_ms} ms")  # fmt: skip
    results = []
    for w_ms in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
        tps, p99, ttft = simulate(FixedWindow(w_ms / 1e3), dec, pre, args.duration, args)
        ok = p99 <= target
        results.append((tps, w_ms, ok))
        print(f"  fixed {w_ms:5.1f} ms: {tps:9.0f} tok/s  p99 {p99 * 1e3:6.2f} ms  TTFT {ttft * 1e3:6.2f} ms"
              f"{'' if ok else '  (misses target)'}")  # fmt: skip
    adaptive = AdaptiveWindow(target, w_min=0.0, w_max=0.032, lr=0.5, quantile=0.99)
    a_tps, a_p99, a_ttft = simulate(adaptive, dec, pre, args.duration, args)
    print(f"  DBS-Adapt     : {a_tps:9.0f} tok/s  p99 {a_p99 * 1e3:6.2f} ms  TTFT {a_ttft * 1e3:6.2f} ms"
          f"{'' if a_p99 <= target else '  (misses target)'}  final w={adaptive.window * 1e3:.2f} ms")  # fmt: skip
    eligible = [r for r in results if r[2]]
    if not eligible:
        print("no fixed window meets the target")
        return
    best_tps, best_w, _ = max(eligible)
    print(f"best fixed window meeting the target: {best_w} ms at {best_tps:.0f} tok/s")
    print(f"DBS-Adapt / best fixed throughput: {a_tps / best_tps:.2f}x  (target >= 1.25x)")


if __name__ == "__main__":
    main()
