"""Teacher-forced greedy runs of a :class:`~inference.model.jax_runner.JaxRunner`, for quantized-vs-float tests."""

from __future__ import annotations

import numpy as np

from inference.model.jax_runner import JaxRunner
from inference.runner import SeqWork, StepPlan
from transport.messages import SamplingParams

__all__ = ["GREEDY", "teacher_forced"]

GREEDY = SamplingParams(temperature=0.0)


def teacher_forced(runner: JaxRunner, prompts: list[list[int]], steps: int, blocks_per_seq: int,
                   forced: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Prefill ``prompts`` as one plan, then decode them as one batch for ``steps`` steps.

    Sequence ``i`` owns blocks ``[i * blocks_per_seq, (i + 1) * blocks_per_seq)``.
    Each step feeds ``forced[:, step]``, or the argmax of the previous logits
    when ``forced`` is None. Returns the logits ``[len(prompts), 1 + steps, V]``
    (after the prompt, then per decode step) and the tokens fed ``[len(prompts), steps]``.
    """
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    pre = runner.logits(StepPlan(prefills=tuple(SeqWork(i, p, 0, tables[i], GREEDY, 0, 0)
                                                for i, p in enumerate(prompts)), decodes=()))
    logits, tokens = [pre], []
    for step in range(steps):
        tok = logits[-1].argmax(-1) if forced is None else forced[:, step]
        tokens.append(tok)
        decodes = tuple(SeqWork(i, [int(tok[i])], len(p) + step, tables[i], GREEDY, 0, step + 1)
                        for i, p in enumerate(prompts))
        logits.append(runner.logits(StepPlan(prefills=(), decodes=decodes)))
    return np.stack(logits, 1), np.stack(tokens, 1)
