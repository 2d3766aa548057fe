"""The cost of structured output on decode: batch 32, every sequence held to a JSON Schema, against
the same batch unconstrained, on the tiny model's JaxRunner (CPU) through the engine.

Figures, from the same run (rounds alternate plain and constrained; the best round of each counts,
the machine being shared):

- mask share: time computing the masks (inference.grammar.fill_masks) per decode step over the
  whole step's time, constrained rounds (target <= 10%);
- throughput ratio: constrained tokens/s over plain tokens/s (target >= 0.9);
- CPU time per token of each (process CPU: what descheduling by other users does not inflate).

The schema keeps every sequence generating for the whole round (an array of at least 200 small
integers: never complete before max_tokens), so both modes run the same number of steps at
batch 32. Both modes draw their tokens by sampling (temperature 1, seeded).

    .venv/bin/python tests/bench/bench_structured.py [--batch 32] [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inference import grammar  # noqa: E402
from inference.engine import Engine, EngineConfig  # noqa: E402
from inference.grammar import GrammarCompiler  # noqa: E402
from inference.model.jax_runner import JaxRunner  # noqa: E402
from inference.tokenizer import ByteTokenizer  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

SCHEMA = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                     "minItems": 200})


class MaskClock:
    """Wraps fill_masks to add up its time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._fill = grammar.fill_masks

    def __call__(self, rows, masks):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        self._fill(rows, masks)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def one_round(runner: JaxRunner, compiler: GrammarCompiler, batch: int, tokens: int, constrained: bool,
              clock: MaskClock) -> tuple[float, float, int, int]:
    """(decode wall seconds, decode CPU seconds, decode steps, tokens) for one round."""
    tok = ByteTokenizer()
    engine = Engine(runner, tok, EngineConfig(max_batch=batch, prefill_batch=batch, max_prefill_tokens=8192))
    for i in range(batch):
        guide = compiler.guide("json", SCHEMA) if constrained else None
        engine.add(i, tok.encode(f"request {i}: "), SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True),
                   0.0, guide=guide)
    wall = cpu = 0.0
    steps = 0
    n = 0
    clock.seconds = 0.0
    while engine.has_unfinished():
        plan, _ = engine.schedule(0.0)
        assert plan is not None
        if plan.prefills:  # not timed: the same in both modes
            engine.commit(plan, runner.execute(plan), 0.0)
            clock.seconds = 0.0
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        out = runner.execute(plan)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        engine.commit(plan, out, 0.0)
        steps += 1
        n += len(out)
    return wall, cpu, steps, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    runner = JaxRunner.load("tiny", max_batch=a.batch, num_blocks=1024, max_prefill_batch=a.batch)
    compiler = GrammarCompiler(ByteTokenizer(), runner.eos_token_ids)
    clock = MaskClock()
    grammar.fill_masks = clock  # type: ignore[assignment]
    for constrained in (False, True):  # warm: every shape compiled before timing
        one_round(runner, compiler, a.batch, 8, constrained, clock)
    best: dict[bool, tuple[float, float, int, int, float]] = {}
    for r in range(a.rounds):
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            wall, cpu, steps, n = one_round(runner, compiler, a.batch, a.tokens, constrained, clock)
            mask = clock.seconds if constrained else 0.0
            if constrained not in best or wall < best[constrained][0]:
                best[constrained] = (wall, cpu, steps, n, mask)
    (pw, pc, ps, pn, _), (cw, cc, cs, cn, cm) = best[False], best[True]
    print(f"tiny model, batch {a.batch}, {a.tokens} tokens each, best of {a.rounds} rounds, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  plain:       {pn / pw:8.0f} tok/s  step {1e3 * pw / ps:6.2f} ms  CPU/token {1e6 * pc / pn:6.1f} us")
    print(f"  constrained: {cn / cw:8.0f} tok/s  step {1e3 * cw / cs:6.2f} ms  CPU/token {1e6 * cc / cn:6.1f} us")
    print(f"  mask per step {1e3 * cm / cs:.3f} ms = {100 * cm / cw:.1f}% of the constrained step (target <= 10%)")
    print(f"  throughput constrained/plain {(cn / cw) / (pn / pw):.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
