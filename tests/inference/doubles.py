"""Test doubles for engine tests (named as such): a runner that replays a
script of token ids per seed, and helpers to drive an engine on a fake clock."""

from __future__ import annotations

from collections.abc import Hashable

from inference.engine import Engine
from inference.runner import SeqOutput, StepPlan
from inference.sequence import Delta, EngineEvent, Failed, Finished


class ScriptedRunner:
    """Test double: request with seed ``s`` samples ``script[s][num_generated]``."""

    def __init__(self, script: dict[int, list[int]], *, block_size: int = 4, num_blocks: int = 64,
                 max_model_len: int = 1024, eos_token_ids: tuple[int, ...] = (257,)) -> None:  # fmt: skip
        self.script = script
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.sliding_window: int | None = None
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        self.plans.append(plan)
        outs = []
        for w in plan.prefills + plan.decodes:
            toks = self.script[w.seed]
            outs.append(SeqOutput(w.seq_id, toks[w.num_generated], -0.5, (1, 2), (-0.5, -1.5)))
        return outs


class Collector:
    """Groups engine events by request and checks each request ends once."""

    def __init__(self) -> None:
        self.deltas: dict[Hashable, list[Delta]] = {}
        self.ends: dict[Hashable, Finished | Failed] = {}

    def feed(self, events: list[EngineEvent]) -> None:
        for ev in events:
            assert ev.key not in self.ends, f"event after the end of {ev.key!r}: {ev}"
            if isinstance(ev, Delta):
                self.deltas.setdefault(ev.key, []).append(ev)
            else:
                self.ends[ev.key] = ev

    def text(self, key: Hashable) -> str:
        return "".join(d.text for d in self.deltas.get(key, []))

    def tokens(self, key: Hashable) -> list[int]:
        return [t for d in self.deltas.get(key, []) for t in d.token_ids]


def run_until_done(engine: Engine, col: Collector, *, t0: float = 0.0, dt: float = 0.01,
                   max_steps: int = 10_000) -> float:  # fmt: skip
    t = t0
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return t
        col.feed(engine.step(t))
        engine.kv.check_invariants()
        t += dt
    raise AssertionError("engine did not finish")
