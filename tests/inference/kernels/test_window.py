"""Sliding-window attention (Mistral's ``sliding_window``): every kernel that takes a window against
float64 attention over exactly the keys the window shows, the blocks before a row's window never
changing a result, and the seam refusing to let a kernel without a window run a windowed model.

A query at position p sees the keys at positions ``p - window + 1 .. p`` (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference.kernels import cpu_ffi, reference, xla_attention
from inference.kernels.autotune import Autotuner
from inference.kernels.kernel_set import build_kernels
from tests.inference.kernels import float64_bounds as f64

IMPLS = {"native": (cpu_ffi.prefill_attention_cpu, cpu_ffi.paged_decode_cpu),
         "xla": (xla_attention.prefill_attention, xla_attention.paged_decode_attention),
         "reference": (reference.prefill_attention, reference.paged_decode_attention)}


@pytest.fixture(params=list(IMPLS))
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        assert cpu_ffi.available(), "the native CPU kernels did not build (is g++ installed?)"
    return str(request.param)


def windowed(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, window: int,
             scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Float64 attention of queries ``q [Q, H, D]`` at ``positions`` over the keys ``[S, H, D]`` each one's
    window shows, and the float32 bound. The bound counts every key as its own online-softmax step
    (``tile=1``): no kernel takes more steps over a window than it has keys, whatever its tiling."""
    want, bound = np.zeros(q.shape), np.zeros(q.shape)
    for i, p in enumerate(positions):
        lo = max(0, int(p) - window + 1)
        (want[i],), (bound[i],) = f64.attention(q[i][None], keys[lo:p + 1], values[lo:p + 1], scale, tile=1)
    return want, bound


@pytest.mark.parametrize("window", [1, 5, 16, 70])
def test_prefill_sees_only_the_window(impl: str, window: int) -> None:
    """Rows with and without a cached prefix (a chunk starting mid-sequence), windows shorter and longer
    than the chunk, than a native key tile (64) and than the whole row; GQA 8/2."""
    rng = np.random.default_rng(window)
    b, t, s, h, kv, d = 3, 40, 140, 8, 2, 16
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, s, kv, d), dtype=np.float32) for _ in range(2))
    q_off, kv_len = np.asarray([0, 37, 100], np.int32), np.asarray([40, 77, 140], np.int32)
    scale = d ** -0.5
    got = np.asarray(IMPLS[impl][0](*map(jnp.asarray, (q, k, v, q_off, kv_len)), scale=scale, window=window))
    for row in range(b):
        pos = q_off[row] + np.arange(t)
        want, bound = windowed(q[row], k[row].repeat(h // kv, 1), v[row].repeat(h // kv, 1), pos, window, scale)
        f64.assert_within(got[row], want, bound, f"{impl} row {row} window {window}")


@pytest.mark.parametrize("window", [1, 3, 8, 21, 200])
def test_decode_sees_only_the_window(impl: str, window: int) -> None:
    """Contexts shorter and longer than the window, ending mid-block and on a block's end; a row with no
    context is zeros (the reference's is don't-care)."""
    rng = np.random.default_rng(window)
    n, bs, m, h, kv, d = 40, 4, 8, 4, 2, 16
    q = rng.standard_normal((5, h, d), dtype=np.float32)
    kc, vc = (rng.standard_normal((n, bs, kv, d), dtype=np.float32) for _ in range(2))
    tables = rng.permutation(n)[: 5 * m].reshape(5, m).astype(np.int32)
    ctx = np.asarray([1, 7, 12, 32, 0], np.int32)
    scale = d ** -0.5
    got = np.asarray(IMPLS[impl][1](*map(jnp.asarray, (q, kc, vc, tables, ctx)), scale=scale, window=window))
    for row, c in enumerate(ctx):
        if c == 0:
            assert impl == "reference" or not got[row].any()
            continue
        keys, values = (x[tables[row]].reshape(-1, kv, d).repeat(h // kv, 1) for x in (kc, vc))
        want, bound = windowed(q[row][None], keys, values, np.asarray([c - 1]), window, scale)
        f64.assert_within(got[row][None], want, bound, f"{impl} row {row} window {window}")


def test_blocks_before_the_window_change_nothing(impl: str) -> None:
    """The KV cache releases the blocks wholly before a row's window and points their table entries at
    the first block it still holds. The result is the same, bit for bit; the native kernels never read
    those entries at all (here they name a block of NaN)."""
    rng = np.random.default_rng(3)
    n, bs, h, kv, d, window = 12, 4, 4, 2, 8, 6
    q = jnp.asarray(rng.standard_normal((2, h, d), dtype=np.float32))
    kc, vc = (rng.standard_normal((n, bs, kv, d), dtype=np.float32) for _ in range(2))
    kc[11], vc[11] = np.nan, np.nan
    tables = np.asarray([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], np.int32)
    ctx = jnp.asarray([19, 11], jnp.int32)  # windows: keys 13..18 (blocks 3, 4) and 5..10 (blocks 1, 2)
    released = tables.copy()
    released[0, :3], released[1, :1] = (11, 11) if impl == "native" else (3, 6)

    def run(t: np.ndarray) -> np.ndarray:
        return np.asarray(IMPLS[impl][1](q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(t), ctx, scale=0.3,
                                         window=window))

    np.testing.assert_array_equal(run(released), run(tables))


def test_native_prefill_skips_key_tiles_before_the_window() -> None:
    """NaN keys in the whole 64-key tiles before every query's window change nothing (inside a tile a
    masked key's value is still multiplied, by zero: the cache's placeholders are finite)."""
    assert cpu_ffi.available()
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 8, 4, 8), dtype=np.float32))
    k, v = (rng.standard_normal((1, 300, 2, 8), dtype=np.float32) for _ in range(2))
    args = (jnp.asarray([290], jnp.int32), jnp.asarray([298], jnp.int32))
    clean = cpu_ffi.prefill_attention_cpu(q, jnp.asarray(k), jnp.asarray(v), *args, scale=0.3, window=10)
    k[0, :256], v[0, :256] = np.nan, np.nan  # the first query (position 290) sees 281..290: tile 256..319
    got = cpu_ffi.prefill_attention_cpu(q, jnp.asarray(k), jnp.asarray(v), *args, scale=0.3, window=10)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


def test_a_window_turns_pallas_into_xla_never_into_the_whole_context() -> None:
    """The Pallas kernels have no window: the seam runs the jnp loops with it instead (on every platform,
    compiled or interpreted), and every family carries the window it applies."""
    for platform, interpret in (("gpu", False), ("tpu", False), ("cpu", True)):
        ks = build_kernels("pallas", platform=platform, interpret=interpret, tuner=Autotuner(enabled=False),
                           window=8)
        assert (ks.attention, ks.window) == ("xla", 8)
        assert build_kernels("pallas", platform=platform, interpret=interpret,
                             tuner=Autotuner(enabled=False)).attention == "pallas"
    for family in ("native", "xla", "reference"):
        assert build_kernels(family, platform="cpu", window=8).window == 8


def test_the_native_kernel_set_passes_its_window_to_the_native_calls() -> None:
    """Decode through a windowed native set is the native call with that window."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 4, 8), dtype=np.float32))
    kc, vc = (jnp.asarray(rng.standard_normal((6, 4, 2, 8), dtype=np.float32)) for _ in range(2))
    tables, ctx = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.asarray([11, 5], jnp.int32)
    native = build_kernels("native", platform="cpu", window=3)
    hlo = jax.jit(lambda *a: native.decode(*a, scale=0.3)).lower(q, kc, vc, tables, ctx).as_text()
    assert "quicserve_paged_decode_f32" in hlo
    got = np.asarray(native.decode(q, kc, vc, tables, ctx, scale=0.3))
    np.testing.assert_array_equal(got, np.asarray(cpu_ffi.paged_decode_cpu(q, kc, vc, tables, ctx, scale=0.3,
                                                                          window=3)))
    assert not np.array_equal(got, np.asarray(cpu_ffi.paged_decode_cpu(q, kc, vc, tables, ctx, scale=0.3)))
