"""KV events (#29): what a worker publishes mirrors its prefix cache exactly, step after step, for
every subscriber, through evictions; nothing is tracked without a subscriber."""

from __future__ import annotations

import random

from inference.engine import Engine, EngineConfig
from inference.kv_events import KvPublisher
from inference.service import WorkerService
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from transport.messages import KvEvents, SamplingParams

TOK = ByteTokenizer()


class Subscriber:
    """A gateway's view built from the batches alone (what cache_feed does with a CacheIndex)."""

    closed = False

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.batches: list[KvEvents] = []

    def send_kv_events(self, ev: KvEvents) -> None:
        if ev.full:
            self.held = set(ev.stored)
        else:
            assert ev.seq == self.batches[-1].seq + 1, "a gap"
            assert not set(ev.stored) & set(ev.evicted)
            self.held -= set(ev.evicted)
            self.held |= set(ev.stored)
        self.batches.append(ev)


def engine(num_blocks: int = 24) -> Engine:
    return Engine(SyntheticRunner(block_size=4, num_blocks=num_blocks, max_model_len=128), TOK,
                  EngineConfig(max_batch=4))  # fmt: skip


def test_every_subscriber_mirrors_the_cache_through_evictions() -> None:
    eng = engine()
    pub = KvPublisher(eng.kv, epoch=42)
    rng = random.Random(1)
    shared = [rng.randrange(32, 127) for _ in range(12)]  # three blocks every prompt begins with
    first, late = Subscriber(), Subscriber()
    pub.subscribe(first)  # type: ignore[arg-type]
    assert first.batches[0].full and first.held == set() and first.batches[0].epoch == 42
    t = 0.0
    for i in range(40):
        prompt = shared + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 20))]
        eng.add(i, prompt, SamplingParams(max_tokens=rng.randrange(1, 8), seed=i), t)
        if i == 10:
            pub.subscribe(late)  # type: ignore[arg-type]
            assert late.batches[0].full and late.batches[0].seq == pub.seq
        while eng.has_unfinished() and rng.random() < 0.8:
            eng.step(t)
            pub.publish()
            t += 0.01
            held = set(eng.kv.cached_hashes())
            assert first.held == held
            if late.batches:
                assert late.held == held
    assert eng.kv.evictions > 0, "the test must see evictions"
    assert {b.epoch for b in first.batches} == {42} and first.batches[-1].seq == pub.seq > 10


def test_nothing_is_tracked_without_a_subscriber() -> None:
    eng = engine()
    pub = KvPublisher(eng.kv)
    assert pub.epoch > 0 and eng.kv.changes is None
    eng.add("a", list(b"0123456789abcdef"), SamplingParams(max_tokens=2), 0.0)
    eng.step(0.0)
    pub.publish()
    assert pub.seq == 0 and eng.kv.changes is None
    sub = Subscriber()
    pub.subscribe(sub)  # type: ignore[arg-type]
    assert sub.held == set(eng.kv.cached_hashes()) and sub.held  # what came before is in the full set
    pub.unsubscribe(sub)  # type: ignore[arg-type]
    assert eng.kv.changes is None


def test_the_worker_announces_kv_events_with_its_epoch() -> None:
    svc = WorkerService(engine(), TOK, served_name="m", threaded=False)
    hello = svc.hello()
    assert "kv_events" in hello.capabilities and hello.kv_epoch == svc.kv_events.epoch > 0
    st = svc.stats()
    assert (st.kv_epoch, st.kv_seq) == (svc.kv_events.epoch, 0)
    off = Engine(SyntheticRunner(block_size=4, num_blocks=8), TOK, EngineConfig(enable_prefix_cache=False))
    assert "kv_events" not in WorkerService(off, TOK, served_name="m", threaded=False).hello().capabilities
