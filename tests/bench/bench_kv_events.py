"""What KV events cost a worker: their share of its step time at batch 32 (issue #29: <= 2%).

The real engine over the real ``JaxRunner`` (the built-in tiny model, or ``--engine synthetic``
for the double), ``--batch`` sequences always running (a finished one is replaced at once by a
prompt that shares a tenant's prefix), a KV cache small enough to evict. Per step it times the
step itself (schedule, runner, commit) and, apart, what the events add: the publisher's batch
(``KvPublisher.publish``: the cache's noted changes, the KvEvents) and its frame, encoded as the
transport would (``FrameEncoder``), for one subscribed gateway. The hook in the cache itself (a
dict insert per block cached or dropped) runs inside the step: ``--ab`` also times steps with
tracking on and off, alternately, as a check of that.

    .venv/bin/python -m tests.bench.bench_kv_events [--steps 300] [--batch 32] [--engine tiny|synthetic] [--ab]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inference.engine import Delta, Engine, EngineConfig
from inference.kv_events import KvPublisher
from inference.tokenizer import ByteTokenizer
from transport.messages import KvEvents, SamplingParams
from transport.wire import FrameEncoder


class _Gateway:
    """A subscriber that encodes every batch as the transport would (the bytes are dropped)."""

    closed = False

    def __init__(self) -> None:
        self.enc = FrameEncoder()
        self.bytes = self.batches = self.hashes = 0

    def send_kv_events(self, ev: KvEvents) -> None:
        self.bytes += len(self.enc.encode(ev))
        self.batches += 1
        self.hashes += len(ev.stored) + len(ev.evicted)


def _runner(engine: str, batch: int, blocks: int) -> object:
    if engine == "synthetic":
        from inference.synthetic import SyntheticRunner

        return SyntheticRunner(block_size=16, num_blocks=blocks, max_model_len=2048, verify=False)
    from inference.model.jax_runner import JaxRunner

    return JaxRunner.load("tiny", block_size=16, num_blocks=blocks, max_batch=batch, attention="auto")


def run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    tenants = [[rng.randrange(32, 127) for _ in range(96)] for _ in range(16)]
    blocks = args.batch * 16 + 64  # room for the batch's own blocks and a little cache: it evicts
    eng = Engine(_runner(args.engine, args.batch, blocks), ByteTokenizer(),  # type: ignore[arg-type]
                 EngineConfig(max_batch=args.batch, max_prefill_tokens=8192))  # fmt: skip
    pub = KvPublisher(eng.kv)
    gw = _Gateway()
    pub.subscribe(gw)  # type: ignore[arg-type]
    n = 0

    def add() -> None:
        nonlocal n
        prompt = rng.choice(tenants) + [rng.randrange(32, 127) for _ in range(rng.randrange(8, 64))]
        eng.add(n, prompt, SamplingParams(max_tokens=rng.randrange(32, 160), temperature=0.0, ignore_eos=True), 0.0)
        n += 1

    for _ in range(args.batch):
        add()
    step_s: list[float] = []
    pub_s: list[float] = []
    ab: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.warmup + args.steps):
        tracking = not args.ab or i % 2 == 0
        if args.ab:
            eng.kv.changes = {} if tracking else None
        t0 = time.perf_counter()
        events = eng.step(time.perf_counter())
        t1 = time.perf_counter()
        if tracking:
            pub.publish()
        t2 = time.perf_counter()
        for ev in events:
            if not isinstance(ev, Delta):  # an end: the batch stays full
                add()
        while eng.num_running + eng.num_waiting < args.batch:
            add()
        if i >= args.warmup:
            step_s.append(t1 - t0)
            ab[tracking].append(t1 - t0)
            if tracking:
                pub_s.append(t2 - t1)
    step, pub_t = statistics.median(step_s), statistics.median(pub_s)
    print(f"{args.engine}, batch {args.batch}, {args.steps} steps, {eng.kv.evictions} evictions: "
          f"step p50 {step * 1e3:.3f} ms, events p50 {pub_t * 1e6:.1f} us (mean {statistics.fmean(pub_s) * 1e6:.1f})"
          f" = {pub_t / step:.2%} of the step; {gw.batches} batches, {gw.hashes / max(1, gw.batches):.1f} hashes "
          f"and {gw.bytes / max(1, gw.batches):.0f} bytes a batch")  # fmt: skip
    if args.ab:
        on, off = statistics.median(ab[True]), statistics.median(ab[False])
        print(f"  A/B steps with the cache's tracking on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms: {on / off:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--engine", choices=["tiny", "synthetic"], default="tiny")
    ap.add_argument("--ab", action="store_true")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
