"""KV blocks of n sequences of one prompt against one, on the JAX engine (#31's n = 8 line).

The gateway runs ``n`` > 1 as sub-generations on one replica (gateway/api/fanout.py); the engine
prefills their prompt once and the others take its blocks from the prefix cache once registered
(``Engine._follows``). Each follower owns what a cache hit cannot give it: the block holding the
prompt's last token (always computed: its logits are the follower's first sample) and the blocks
of its own output, i.e. the blocks covering positions 16 * floor((L - 1) / 16) .. L + o - 1 for an
L-token prompt and o output tokens (block size 16). A block-aligned prompt is wholly cached: the
follower shares every prompt block and runs its last token again without writing its K/V
(``SeqWork.shared_tokens``), so it owns only its output's blocks (L .. L + o - 1). So the ratio is
1 + (n - 1) * k / B (B: the blocks of one sequence, k: a follower's own, 1 or 2 for short outputs),
above 1.2 only when B < 35 k. (Before the aligned case shared its last block, L = 1024,
o = 8 had k = 2: 79 / 65 = 1.215.)

For each prompt length and output length: the peak of blocks in use over the run, n = 1 and n = 8,
and the prompt tokens prefilled; with ``--baseline``, the same with the prefix cache off (eight
prefills). The tiny model's architecture and weights with a longer context (the built-in one stops
at 1024 positions). Run: ``python -m tests.bench.bench_n_kv``.

Measured (2026-12-05, tiny model, context 4200, block size 16, n = 8; the cache-off columns are
``--baseline``'s from the run before aligned prompts shared their last block, which does not touch
a run without the prefix cache):

         L    o   n=1   n=8  ratio  prefilled n=1    n=8  cache off: blocks, prefilled
      1000    8    63    70  1.111           1000   1056    189   8000
      1000   32    65    86  1.323           1000   1056    512   8000
      1024    8    65    72  1.108           1024   1031    194   8192
      1024   32    66    80  1.212           1024   1031    524   8192
      2048    8   129   136  1.054           2048   2055    257  16384
      2048   32   130   144  1.108           2048   2055    646  16384
      4000    8   251   258  1.028           4000   4007    501  32000
      4000   32   252   266  1.056           4000   4007   1003  32000

(Before, the aligned rows were 1024: 79 and 87 blocks, 1.215 and 1.318; 2048: 143 and 151, 1.109
and 1.162; 4000: 265 and 273, 1.056 and 1.083; each follower prefilled 16 tokens, not 1.) Short
outputs (8 tokens) stay within 1.2x at every length; the prompt is prefilled once (each follower
computes at most one block, and for an aligned prompt one token) where the cache off prefills it
eight times (and holds up to 8x the blocks; its peak here is bounded by the prefill budget per step,
which staggers the admissions).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from inference.engine import Engine, EngineConfig
from inference.model.config import TINY_CONFIG
from inference.model.jax_runner import JaxRunner
from inference.model.llama import Llama
from inference.sequence import Delta
from inference.tokenizer import ByteTokenizer
from inference.weights import TINY_SEED, LoadedModel
from transport.messages import SamplingParams

__all__ = ["peak_blocks", "long_runner"]


def long_runner(context: int, num_blocks: int) -> JaxRunner:
    """The tiny model with ``context`` positions."""
    model = Llama(replace(TINY_CONFIG, max_position_embeddings=context))
    params = model.load_params(model.random_hf_weights(TINY_SEED).__getitem__, "float32")
    loaded = LoadedModel("tiny-long", model, params, TINY_CONFIG.eos_token_ids)
    return JaxRunner(loaded, max_batch=8, num_blocks=num_blocks, max_model_len=context)


def peak_blocks(runner: JaxRunner, prompt: list[int], out: int, seeds: list[int],
                prefix_cache: bool = True, temperature: float = 1.0) -> tuple[int, int, dict[int, list[int]]]:
    """(peak blocks in use, prompt tokens prefilled, each seed's tokens) of one sequence per seed of
    ``prompt``, all added at once (as the gateway's sub-generations arrive), ``out`` tokens each."""
    eng = Engine(runner, ByteTokenizer(), EngineConfig(max_batch=8, enable_prefix_cache=prefix_cache))
    for s in seeds:
        eng.add(s, prompt, SamplingParams(max_tokens=out, ignore_eos=True, seed=s, temperature=temperature), 0.0)
    tokens: dict[int, list[int]] = {s: [] for s in seeds}
    peak = prefilled = 0
    t = 0.0
    while eng.has_unfinished():
        plan, _ = eng.schedule(t)
        if plan is not None:
            prefilled += sum(len(w.token_ids) for w in plan.prefills)
            peak = max(peak, eng.kv.num_blocks - eng.kv.num_free)
            for ev in eng.commit(plan, runner.execute(plan), t):
                if isinstance(ev, Delta):
                    tokens[ev.key].extend(ev.token_ids)  # type: ignore[index]
        t += 0.01
    return peak, prefilled, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1000,1024,2048,4000", help="prompt lengths")
    ap.add_argument("--outputs", default="8,32", help="output tokens per sequence")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context", type=int, default=4200)
    ap.add_argument("--baseline", action="store_true", help="also with the prefix cache off")
    args = ap.parse_args()
    runner = long_runner(args.context, 8 * (args.context // 16 + 4))
    print(f"{'L':>6} {'o':>4} {'n=1':>5} {f'n={args.n}':>5} {'ratio':>6} {'prefilled n=1':>14} {f'n={args.n}':>6}"
          + ("  cache off: blocks, prefilled" if args.baseline else ""))
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = [(i * 37 + 11) % 250 + 1 for i in range(length)]
        for out in (int(x) for x in args.outputs.split(",")):
            one, p1, _ = peak_blocks(runner, prompt, out, [0])
            many, pn, _ = peak_blocks(runner, prompt, out, list(range(args.n)))
            line = f"{length:>6} {out:>4} {one:>5} {many:>5} {many / one:>6.3f} {p1:>14} {pn:>6}"
            if args.baseline:
                off, po, _ = peak_blocks(runner, prompt, out, list(range(args.n)), prefix_cache=False)
                line += f"  {off:>5} {po:>6}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
