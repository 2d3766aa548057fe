"""Shape buckets: a bounded geometric grid, padding bounded per octave, every admissible group fits one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.model.buckets import DECODE_GRID_BASE, ROW_ALIGN, Buckets, geometric_sizes, pow2_ceil

POW2 = st.sampled_from([1, 2, 4, 8, 16])


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def test_pow2_ceil():
    assert [pow2_ceil(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]


def test_geometric_sizes_examples():
    assert geometric_sizes(16, 512, 1, 16) == (16, 32, 64, 128, 256, 512)  # the old powers of two
    assert geometric_sizes(16, 512, 2, 16) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert geometric_sizes(1, 32, 4, 8) == (1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32)
    # aligned to 8 the 8..16 octave keeps only its ends: 10, 12 and 14 rows run slower than 16 on CPU
    assert geometric_sizes(1, 64, 4, 8, align=8) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    # off the grid the maximum is the last bucket, never a larger power of two
    assert geometric_sizes(16, 1000, 2, 16)[-3:] == (512, 768, 1000)
    assert geometric_sizes(10, 10, 2, 10) == (10,) and geometric_sizes(9, 12, 2, 16) == (12,)
    assert geometric_sizes(1, 1, 4, 8) == (1,)
    with pytest.raises(ValueError, match="powers of two"):
        geometric_sizes(1, 64, 3, 8)
    with pytest.raises(ValueError, match="lo <= hi"):
        geometric_sizes(0, 64, 2, 8)


@given(st.integers(1, 300), st.integers(1, 3000), POW2, POW2, st.sampled_from([1, 2, 4, 8]))
def test_geometric_sizes_cover_every_size_with_bounded_padding(lo, span, steps, base, align):
    hi = lo + span - 1
    sizes = geometric_sizes(lo, hi, steps, base, align)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == hi and sizes[0] == min(pow2_ceil(lo), hi)
    for n in range(sizes[0], hi + 1):
        i = next(i for i, s in enumerate(sizes) if s >= n)  # the bucket: the smallest size >= n
        pad = sizes[i] - n
        assert pad < n  # never worse than powers of two
        if i and sizes[i - 1] >= base:
            p = _prev_pow2(sizes[i - 1])
            assert pad < max(p // steps, align)  # the grid's step in that octave
            if p >= steps * align:
                assert sizes[i] < n * (1 + 1 / steps)


@pytest.mark.parametrize("hi, steps, count",
                         [(512, 1, 6), (512, 2, 11), (512, 4, 19), (1024, 2, 13), (1000, 2, 13)])
def test_sizes_per_octave(hi, steps, count):
    """From 16, aligned to 8: ``min(steps, p // 8)`` sizes in each octave ``[p, 2p)`` below the
    maximum, plus the maximum: the compiles the grid costs."""
    octaves = [16 << i for i in range(10) if 16 << i < hi]
    assert count == sum(min(steps, p // 8) for p in octaves) + 1
    assert len(geometric_sizes(16, hi, steps, 16, align=8)) == count


def test_shape_sets_for_the_tiny_defaults():
    b = Buckets(max_batch=32, max_model_len=1024)
    assert b.decode_batches == (1, 2, 4, 8, 16, 24, 32)
    assert b.sample_batches == (1,) and b.sample_rows(1) == 1
    lengths = (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
               896, 1024)
    assert b.prefill_lengths == lengths and b.prefill_shapes == tuple((1, t) for t in lengths)
    assert b.num_shapes == 7 + 23 + 1


def test_worker_default_shape_count():
    """``quicserve worker --max-batch 8`` (prompts in pairs per prefill call): 4 decode, 2 x 23 prefill,
    1 sample shape."""
    b = Buckets(max_batch=8, max_model_len=1024, max_prefill_batch=2)
    assert b.decode_batches == (1, 2, 4, 8) and b.sample_batches == (2,) and b.sample_rows(1) == 2
    assert len(b.prefill_shapes) == 46 and b.num_shapes == 51


@pytest.mark.parametrize("max_batch, max_model_len, prefill, decode",
                         [(32, 512, 1, 1), (32, 512, 2, 4), (64, 1024, 4, 2), (20, 1000, 2, 4),
                          (1, 10, 2, 4)])
def test_num_shapes_is_decode_plus_prefill_plus_sample(max_batch, max_model_len, prefill, decode):
    b = Buckets(max_batch=max_batch, max_model_len=max_model_len, max_prefill_batch=4,
                max_prefill_tokens=1024, prefill_steps_per_octave=prefill, decode_steps_per_octave=decode)
    lo = min(16, max_model_len)
    lengths = geometric_sizes(lo, max_model_len, prefill, lo, ROW_ALIGN)
    batches = [x for x in (1, 2, 4) if x <= max_batch]
    assert b.prefill_lengths == lengths
    assert len(b.prefill_shapes) == sum(1 for t in lengths for x in batches if x == 1 or x * t <= 1024)
    assert b.decode_batches == geometric_sizes(1, max_batch, decode, DECODE_GRID_BASE, ROW_ALIGN)
    assert b.num_shapes == len(b.decode_batches) + len(b.prefill_shapes) + len(b.sample_batches)


@pytest.mark.parametrize("max_batch, max_model_len", [(1, 1), (1, 10), (20, 1000), (32, 512), (48, 4096)])
def test_every_size_up_to_the_maximum_gets_the_smallest_bucket_that_holds_it(max_batch, max_model_len):
    b = Buckets(max_batch=max_batch, max_model_len=max_model_len)
    for n in range(1, max_batch + 1):
        got = b.decode_batch(n)
        assert got in b.decode_batches and got >= n and not any(n <= x < got for x in b.decode_batches)
    for n in range(1, max_model_len + 1):
        _, got = b.prefill_shape(1, n)
        assert got in b.prefill_lengths and got >= n and not any(n <= x < got for x in b.prefill_lengths)
    assert b.decode_batches[-1] == max_batch and b.prefill_lengths[-1] == max_model_len


def test_padding_of_the_defaults():
    """Above 32, a prompt pads by at most a quarter (4 per octave: 32, 40, 48, ...) and a decode batch above
    16 by less than half (16, 24, 32, 40, ...); under powers of two both could nearly double."""
    b = Buckets(max_batch=128, max_model_len=2048)
    assert all(b.prefill_shape(1, n)[1] < 1.5 * n for n in range(17, 2049))
    assert all(b.prefill_shape(1, n)[1] <= 1.25 * n for n in range(33, 2049))
    assert all(b.decode_batch(n) < 1.5 * n for n in range(17, 129))
    assert b.decode_batch(17) == 24 and b.decode_batch(25) == 32 and b.prefill_shape(1, 65) == (1, 80)


def test_edge_cases():
    one = Buckets(max_batch=1, max_model_len=10)
    assert one.decode_batches == (1,) and one.sample_batches == (1,) and one.prefill_lengths == (10,)
    assert one.prefill_shape(1, 3) == (1, 10) and one.num_shapes == 3
    off = Buckets(max_batch=20, max_model_len=1000)
    assert off.decode_batches[-2:] == (16, 20) and off.sample_batches == (1,)
    assert off.prefill_shape(1, 897) == (1, 1000) and off.prefill_shape(1, 896) == (1, 896)
    with pytest.raises(ValueError, match="max_model_len"):
        off.prefill_shape(1, 1001)
    with pytest.raises(ValueError, match="power of two"):
        Buckets(max_batch=8, max_model_len=64, decode_steps_per_octave=3)


def test_batched_prefill_shapes_respect_the_token_budget():
    b = Buckets(max_batch=8, max_model_len=512, max_prefill_batch=4, max_prefill_tokens=512)
    assert all(bb == 1 or bb * t <= 512 for bb, t in b.prefill_shapes)
    assert (4, 128) in b.prefill_shapes and (4, 192) not in b.prefill_shapes and (2, 192) in b.prefill_shapes
    assert (1, 512) in b.prefill_shapes
    with pytest.raises(ValueError, match="max_model_len"):
        b.prefill_shape(1, 513)
    with pytest.raises(ValueError, match="no prefill bucket"):
        b.prefill_shape(4, 192)
    with pytest.raises(ValueError, match="decode batch"):
        b.decode_batch(9)


def test_prefill_batches_stop_at_the_largest_power_of_two_a_call_may_carry():
    """A cap of 3 prompts per call groups at most 2 (batches are powers of two): no batch-4 shape compiles."""
    b = Buckets(max_batch=8, max_model_len=64, max_prefill_batch=3)
    assert b.prefill_batches == (1, 2) and {bb for bb, _ in b.prefill_shapes} == {1, 2}
    assert max(len(g) for g in b.group_prefills([20] * 7)) == 2


@given(st.lists(st.integers(1, 512), min_size=1, max_size=40), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2, 4]))
def test_every_group_fits_a_bucket_and_covers_each_prefill_once(lengths, max_prefill_batch, steps):
    b = Buckets(max_batch=8, max_model_len=512, max_prefill_batch=max_prefill_batch, max_prefill_tokens=1024,
                prefill_steps_per_octave=steps)
    groups = b.group_prefills(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        bb, t = b.prefill_shape(len(g), max(lengths[i] for i in g))
        assert (bb, t) in b.prefill_shapes and bb >= len(g) and t >= max(lengths[i] for i in g)


def test_chunked_prefill_compiles_a_mixed_pass_per_power_of_two_chunk() -> None:
    """step_tokens 256: chunk groups of up to 256 tokens a row run mixed with the decodes, padded to
    16, 32, 64, 128 or 256 (ten more shapes for prefill pairs); none without chunking, and a group
    longer than a chunk runs on its own."""
    b = Buckets(max_batch=32, max_model_len=1024, max_prefill_batch=2, max_chunk=256)
    assert b.mixed_lengths == (16, 32, 64, 128, 256) and len(b.mixed_shapes) == 10
    assert b.num_shapes == Buckets(max_batch=32, max_model_len=1024, max_prefill_batch=2).num_shapes + 10
    assert b.mixed_shape(16, 1, 256) == (1, 256) and b.mixed_shape(3, 2, 24) == (2, 32)
    assert b.mixed_shape(3, 1, 320) is None and b.mixed_shape(33, 1, 16) is None
    assert Buckets(max_batch=32, max_model_len=1024).mixed_shape(3, 1, 16) is None
    assert Buckets(max_batch=8, max_model_len=100, max_chunk=256).mixed_lengths == (16, 32, 64, 100)
