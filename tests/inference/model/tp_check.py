"""Greedy tokens of the engine over a JaxRunner at several tensor-parallel sizes, as JSON on stdout.

Run in a fresh process whose JAX sees 4 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``,
set before JAX starts: ``test_tensor_parallel.py`` does it)::

    python -m tests.inference.model.tp_check CHECKPOINT_DIR

Cases: the built-in tiny model (2 KV heads: at TP = 4 each is repeated on two devices) and
``CHECKPOINT_DIR`` (a checkpoint transformers wrote), each in float32, bfloat16 and with int8
weights, at TP = 1, 2 and 4. Each case prints ``{"case": ..., "tp": n, "tokens": {prompt: [...]}}``.
"""

from __future__ import annotations

import json
import sys
from itertools import product

from inference.engine import Engine, EngineConfig
from inference.model.jax_runner import JaxRunner
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, run_until_done
from transport.messages import SamplingParams

# Up to 16 tokens (one prefill shape) and max_batch 4 (one decode shape): few compiles per runner.
PROMPTS = [[(i * 31 + 7 * n) % 120 + 3 for i in range(n)] for n in (5, 11, 16)]


def greedy(model: str, tp: int, **kw: object) -> dict[int, list[int]]:
    runner = JaxRunner.load(model, tensor_parallel=tp, max_batch=4, num_blocks=64, max_model_len=128,
                            max_prefill_batch=1, **kw)  # type: ignore[arg-type]
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=4, prefill_batch=1))
    for i, p in enumerate(PROMPTS):
        eng.add(i, p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 0.0)
    col = Collector()
    run_until_done(eng, col)
    return {i: col.tokens(i) for i in range(len(PROMPTS))}


def main(argv: list[str]) -> int:
    hf = argv[0]
    kinds = {"f32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"weight_dtype": "int8"}}
    for (label, model), (kind, kw) in product((("tiny", "tiny"), ("hf", hf)), kinds.items()):
        name = f"{label}-{kind}"
        for tp in (1, 2, 4):
            print(json.dumps({"case": name, "tp": tp, "tokens": greedy(model, tp, **kw)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
