"""Shape buckets: bounded, powers of two, every admissible prefill group fits one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.model.buckets import Buckets, pow2_ceil, pow2_range


def test_pow2_helpers():
    assert [pow2_ceil(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
    assert pow2_range(16, 1000) == (16, 32, 64, 128, 256, 512, 1024)


def test_shape_sets_for_the_tiny_defaults():
    b = Buckets(max_batch=32, max_model_len=1024)
    assert b.decode_batches == (1, 2, 4, 8, 16, 32)
    assert b.sample_batches == (8, 32) and b.sample_rows(1) == 8 and b.sample_rows(16) == 32
    assert b.prefill_shapes == tuple((1, t) for t in (16, 32, 64, 128, 256, 512, 1024))
    assert b.num_shapes == 6 + 7 + 2


def test_batched_prefill_shapes_respect_the_token_budget():
    b = Buckets(max_batch=8, max_model_len=512, max_prefill_batch=4, max_prefill_tokens=512)
    assert all(bb == 1 or bb * t <= 512 for bb, t in b.prefill_shapes)
    assert (4, 128) in b.prefill_shapes and (4, 256) not in b.prefill_shapes and (1, 512) in b.prefill_shapes
    with pytest.raises(ValueError, match="max_model_len"):
        b.prefill_shape(1, 513)
    with pytest.raises(ValueError, match="decode batch"):
        b.decode_batch(9)


@given(st.lists(st.integers(1, 512), min_size=1, max_size=40), st.sampled_from([1, 2, 4, 8]))
def test_every_group_fits_a_bucket_and_covers_each_prefill_once(lengths, max_prefill_batch):
    b = Buckets(max_batch=8, max_model_len=512, max_prefill_batch=max_prefill_batch, max_prefill_tokens=1024)
    groups = b.group_prefills(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        bb, t = b.prefill_shape(len(g), max(lengths[i] for i in g))
        assert (bb, t) in b.prefill_shapes and bb >= len(g) and t >= max(lengths[i] for i in g)
