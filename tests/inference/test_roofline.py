"""The decode bench's roofline counts work correctly (hand-counted on a small shape)."""

from __future__ import annotations

import pytest

from inference.runner import SeqWork, StepPlan
from tests.bench.roofline import Machine, ModelShape, Recorder, floor_seconds, step_cost
from transport.messages import SamplingParams

# hidden 8, intermediate 16, 2 layers, 2 heads / 1 KV head of dim 4, vocab 10, float32
SHAPE = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)


def test_shape_counts() -> None:
    # q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192; gate, up, down 3 * 8 * 16 = 384
    assert SHAPE.layer_matmul_params == 576
    assert SHAPE.head_params == 80
    assert SHAPE.weight_bytes == (2 * 576 + 80) * 4
    assert SHAPE.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4


def test_decode_step_cost() -> None:
    flops, moved = step_cost(SHAPE, [], [5, 7])
    per_token = 2 * 2 * 576 + 2 * 80
    attn = 4 * 2 * 2 * 4 * (5 + 7)  # 4 * layers * heads * head_dim * keys
    assert flops == 2 * per_token + attn
    assert moved == SHAPE.weight_bytes + (6 + 8) * SHAPE.kv_bytes_per_token


def test_prefill_step_cost_is_causal_and_counts_the_head_once() -> None:
    flops, moved = step_cost(SHAPE, [(3, 2)], [])
    keys = 3 + 4 + 5  # tokens at positions 2, 3, 4 see 3, 4, 5 keys
    assert flops == 3 * 2 * 2 * 576 + 2 * 80 + 4 * 2 * 2 * 4 * keys
    assert moved == SHAPE.weight_bytes + (2 + 6) * SHAPE.kv_bytes_per_token
    assert step_cost(SHAPE, [], []) == (0.0, 0.0)


def test_floor_is_the_larger_of_compute_and_memory_per_step() -> None:
    steps = [([], [5, 7]), ([(3, 2)], [])]
    compute_bound = Machine(peak_flops=1.0, peak_bandwidth=1e30)
    memory_bound = Machine(peak_flops=1e30, peak_bandwidth=1.0)
    assert floor_seconds(SHAPE, compute_bound, steps) == pytest.approx(
        sum(step_cost(SHAPE, p, d)[0] for p, d in steps))
    assert floor_seconds(SHAPE, memory_bound, steps) == pytest.approx(
        sum(step_cost(SHAPE, p, d)[1] for p, d in steps))


def test_recorder_records_what_the_runner_ran() -> None:
    class Runner:
        num_blocks = 4

        def execute(self, plan: StepPlan) -> list[int]:
            return [w.seq_id for w in (*plan.prefills, *plan.decodes)]

    rec = Recorder(Runner())
    sp = SamplingParams(temperature=0.0)
    plan = StepPlan(prefills=(SeqWork(1, [4, 5, 6], 2, [0], sp, 0, 0),),
                    decodes=(SeqWork(2, [9], 6, [1], sp, 0, 3),))
    assert rec.execute(plan) == [1, 2]
    assert rec.num_blocks == 4
    assert rec.steps == [([(3, 2)], [7])]
