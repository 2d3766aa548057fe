"""The model runner with the Pallas kernel set (kernels interpreted on CPU) gives the reference's logits.

This runs the kernels where the model calls them: inside the runner's jitted,
shape-bucketed prefill and decode, over its real paged cache and block tables.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from inference.kernels.kernel_set import build_kernels  # noqa: E402
from inference.model.jax_runner import JaxRunner  # noqa: E402
from inference.runner import SeqWork, StepPlan  # noqa: E402
from inference.weights import load_model  # noqa: E402
from transport.messages import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = list(b"The quick brown fox jumps")  # 25 tokens: two 16-token blocks


def _run(attention: str, target: str | None = None) -> list[np.ndarray]:
    runner = JaxRunner(load_model("tiny"), block_size=16, num_blocks=16, max_batch=2, max_model_len=64,
                       kernels=build_kernels(attention, interpret=True, target=target))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    tables = ([3, 7, 1], [5, 2, 9])  # scattered physical blocks
    prefill = tuple(SeqWork(i, PROMPT[i:], 0, tables[i], params, 0, 0) for i in range(2))
    out = [runner.logits(StepPlan(prefills=prefill, decodes=()))]
    tokens = [int(np.argmax(row)) for row in out[-1]]
    for step in range(3):
        decodes = tuple(
            SeqWork(i, [tokens[i]], len(PROMPT) - i + step, tables[i], params, 0, step + 1) for i in range(2)
        )
        out.append(runner.logits(StepPlan(prefills=(), decodes=decodes)))
        tokens = [int(np.argmax(row)) for row in out[-1]]
    return out


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_pallas_runner_matches_reference(target: str) -> None:
    """Either kernel family (Triton-model or Mosaic-model), interpreted, gives the reference's logits."""
    want = _run("reference")
    got = _run("pallas", target)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"step {step}")
        assert (g.argmax(-1) == w.argmax(-1)).all()
