"""The native CPU kernels: their build (cached per source and level, a clean fallback when it cannot
build) and their results on every instruction-set level this host executes, against float64
references with derived error bounds (``float64_bounds``)."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("jax")

from inference.kernels import cpu_ffi, cpu_isa  # noqa: E402
from tests.inference.kernels import float64_bounds as f64  # noqa: E402

_HOST = cpu_isa.host_levels()


@pytest.fixture(params=[pytest.param(lv.name, marks=pytest.mark.skipif(
    lv not in _HOST, reason=f"this CPU cannot execute {lv.name}")) for lv in cpu_isa.LEVELS])
def level(request: pytest.FixtureRequest) -> str:
    """Each level the host executes: one machine checks the AVX-512, AVX2 and portable code paths."""
    assert cpu_ffi.available(request.param), f"the {request.param} kernels did not build (is g++ installed?)"
    return str(request.param)


@pytest.fixture
def uncached() -> Iterator[None]:
    """available() asks again (its answer is cached per level name, None included)."""
    cpu_ffi.available.cache_clear()
    yield
    cpu_ffi.available.cache_clear()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path, uncached: None) -> None:
    """An empty build cache (registration itself still happens once per process and level)."""
    monkeypatch.setenv("QUICSERVE_CACHE_DIR", str(tmp_path))


@pytest.fixture
def tiny_sources(fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path) -> list:
    """Two one-line sources in place of the kernels: the build's mechanics (a compiler per source, one
    link, the rename, the cache) in a second, where the kernels take half a minute a level. The level
    fixture builds the real ones."""
    src = tmp_path / "src"
    src.mkdir()
    files = [src / "a.cc", src / "b.cc"]
    files[0].write_text('extern "C" int quicserve_a() { return 7; }\n')
    files[1].write_text('extern "C" int quicserve_b() { return 11; }\n')
    monkeypatch.setattr(cpu_isa, "SOURCES", tuple(files))
    monkeypatch.setattr(cpu_isa, "HEADERS", ())
    monkeypatch.setenv("QUICSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return files


def test_builds_into_the_cache_dir_once(tiny_sources: list, tmp_path) -> None:
    lv = cpu_isa.LEVELS[-1]
    lib = cpu_isa.build(lv)
    assert lib.parent == tmp_path / "cache" and lib.name.startswith(f"cpu_kernels-{lv.name}-")
    loaded = ctypes.CDLL(str(lib))
    assert loaded.quicserve_a() == 7 and loaded.quicserve_b() == 11  # both sources, one library
    mtime = lib.stat().st_mtime_ns
    assert cpu_isa.build(lv) == lib and lib.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert list(lib.parent.iterdir()) == [lib]  # no build leftovers
    tiny_sources[1].write_text('extern "C" int quicserve_b() { return 12; }\n')
    assert cpu_isa.build(lv) != lib  # another source, another library


def test_a_compile_error_is_a_clear_error(tiny_sources: list) -> None:
    tiny_sources[1].write_text("int broken( {\n")
    with pytest.raises(RuntimeError, match=r"building the CPU kernels \(generic\) failed: .*b\.cc"):
        cpu_isa.build(cpu_isa.LEVELS[-1])
    assert not list(cpu_isa._cache_dir().glob("*.so"))


def test_no_compiler_is_a_clear_error(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        cpu_isa.build(cpu_isa.level())


def test_a_failed_build_means_the_xla_kernels_with_a_warning(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(level: str) -> None:
        raise RuntimeError("building cpu_decode.cc failed: boom")

    monkeypatch.setattr(cpu_ffi, "_load_and_register", fail)
    with caplog.at_level(logging.WARNING, logger=cpu_ffi.__name__):
        assert not cpu_ffi.available()
    assert "the kernel set takes the XLA ones" in caplog.text and "boom" in caplog.text
    from inference.kernels.kernel_set import build_kernels

    ks = build_kernels("native", platform="cpu")  # what a worker started now would run
    assert (ks.attention, ks.pack) == ("xla", None)


def test_switched_off_by_environment(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICSERVE_CPU_KERNELS", "0")
    assert not cpu_ffi.available()


def test_the_environment_picks_the_level_that_runs(uncached: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """QUICSERVE_CPU_ISA decides which level's handlers a traced call binds; a bad value is a clear error."""
    import jax
    import jax.numpy as jnp

    q = jnp.zeros((1, 2, 8), jnp.float32)
    kc = jnp.zeros((2, 4, 1, 8), jnp.float32)
    args = (q, kc, kc, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32))
    for lv in _HOST:
        monkeypatch.setenv(cpu_isa.ENV_VAR, lv.name)
        hlo = jax.jit(lambda *a: cpu_ffi.paged_decode_cpu(*a, scale=0.5)).lower(*args).as_text()
        assert f"quicserve_paged_decode_f32_{lv.name}" in hlo
    monkeypatch.setenv(cpu_isa.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="QUICSERVE_CPU_ISA='sse9'"):
        cpu_ffi.available()


def test_a_block_id_outside_the_cache_is_an_error_not_a_wild_read() -> None:
    import jax.numpy as jnp
    import numpy as np

    assert cpu_ffi.available()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 8), dtype=np.float32))
    kc = jnp.asarray(rng.standard_normal((3, 4, 2, 8), dtype=np.float32))
    ctx = jnp.asarray([5, 2], jnp.int32)
    ok = cpu_ffi.paged_decode_cpu(q, kc, kc, jnp.asarray([[0, 1], [2, 0]], jnp.int32), ctx, scale=0.3)
    assert np.isfinite(np.asarray(ok)).all()
    for bad in ([[0, 3], [2, 0]], [[0, 1], [-1, 0]]):
        with pytest.raises(Exception, match="outside the cache"):
            np.asarray(cpu_ffi.paged_decode_cpu(q, kc, kc, jnp.asarray(bad, jnp.int32), ctx, scale=0.3))
    # a block past a row's context is never read, so it is not checked
    np.asarray(cpu_ffi.paged_decode_cpu(q, kc, kc, jnp.asarray([[0, 1], [2, 99]], jnp.int32), ctx, scale=0.3))


def test_exp_matches_float64_on_every_level(level: str) -> None:
    """The softmax's vectorised exp (cpu_simd.h), as each level compiles it, within EXP_ERROR of float64
    exp over its whole range [-87, 0] (a million points, both ends included); exactly 1 at 0 (the
    row max's weight), 0 below -87. Before the association barrier the generic level (no FMA to
    contract the range reduction) was 62 u off near -72."""
    lib = ctypes.CDLL(str(cpu_isa.build(cpu_isa.level(level))))
    fn = lib.QuicserveExpNonpositive
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], None
    x = np.concatenate([np.linspace(-87.0, 0.0, 1_000_001, dtype=np.float32),
                        -np.random.default_rng(0).exponential(3.0, 100_000).astype(np.float32).clip(0, 87)])
    y = x.copy()
    fn(y.ctypes.data, y.size)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(y - want) / want
    worst = int(rel.argmax())
    assert rel[worst] <= f64.EXP_ERROR, f"exp({x[worst]!r}) = {y[worst]!r}: {rel[worst] / f64.U:.2f} u off"
    edge = np.asarray([0.0, -0.0, -87.5, -1e4, -np.inf], np.float32)
    fn(edge.ctypes.data, edge.size)
    assert edge.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("d,h,kv,bs", [(64, 8, 4, 16), (128, 8, 1, 16), (12, 4, 4, 8), (8, 6, 2, 5), (72, 2, 2, 16)])
def test_native_decode_matches_float64_attention(level: str, d: int, h: int, kv: int, bs: int) -> None:
    """Head dims on and off the 8-wide path, GQA 1/2/4/8, ragged contexts ending mid-block, blocks
    in scattered order, and scores spread over ~80 nats (the vectorised exp's whole range), within
    the float32 bound of float64 attention; a row with no context gets zeros."""
    import jax.numpy as jnp

    rng = np.random.default_rng(d + h + kv + bs)
    n, m, b = 40, 6, 5
    q = rng.standard_normal((b, h, d), dtype=np.float32)
    kc = rng.standard_normal((n, bs, kv, d), dtype=np.float32)
    vc = rng.standard_normal((n, bs, kv, d), dtype=np.float32)
    tables = rng.permutation(n)[: b * m].reshape(b, m).astype(np.int32)
    ctx = np.asarray([1, bs - 1, bs + 3, m * bs, 0], np.int32)
    for scale in (d ** -0.5, 4.0):
        got = np.asarray(cpu_ffi.paged_decode_cpu(*map(jnp.asarray, (q, kc, vc, tables, ctx)), scale=scale,
                                                  level=level))
        want, bound = f64.paged_decode(q, kc, vc, tables, ctx, scale, tile=bs)  # online over the blocks
        f64.assert_within(got, want, bound, f"scale {scale:.3g}")
        assert not got[4].any()  # no context: zeros


def _prefill_inputs(seed: int, b: int, t: int, s: int, h: int, kv: int, d: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
                 for shape in ((b, t, h, d), (b, s, kv, d), (b, s, kv, d)))


_PREFILL_KEY_TILE = 64  # cpu_prefill.cc kKeyTile: keys per online-softmax step


@pytest.mark.parametrize("d,h,kv", [(64, 8, 4), (128, 8, 1), (12, 4, 4), (72, 6, 3), (8, 16, 2)])
def test_native_prefill_matches_float64_attention(level: str, d: int, h: int, kv: int) -> None:
    """Head dims on and off the 8- and 16-wide paths, GQA 1/2/8, 53 queries (no multiple of any tile),
    rows with and without a cached prefix, ending before their last query (padding), and one with
    no keys at all; scores spread over ~80 nats at scale 4. Real queries are within the float32
    bound of float64 causal attention, padding queries are zeros."""
    import jax.numpy as jnp

    b, t, s = 6, 53, 260
    q, k, v = (np.asarray(x) for x in _prefill_inputs(d + h + kv, b, t, s, h, kv, d))
    q_off = np.asarray([0, 0, 70, 130, 200, 0], np.int32)
    kv_len = np.asarray([53, 17, 123, 131, 260, 0], np.int32)  # rows 1 and 3 end before their last query, row 4 after; row 5 is empty
    for scale in (d ** -0.5, 4.0):
        got = np.asarray(cpu_ffi.prefill_attention_cpu(*map(jnp.asarray, (q, k, v, q_off, kv_len)), scale=scale,
                                                       level=level))
        want, bound, real = f64.prefill(q, k, v, q_off, kv_len, scale, tile=_PREFILL_KEY_TILE)
        f64.assert_within(got[real], want[real], bound[real], f"scale {scale:.3g}")
        assert not got[~real].any(), "padding queries must be zeros"


def test_native_prefill_never_reads_keys_past_the_sequence(level: str) -> None:
    """NaN keys and values past each row's kv_len (and past S's end of the cache) change nothing."""
    import jax.numpy as jnp

    prefill = functools.partial(cpu_ffi.prefill_attention_cpu, level=level)
    q, k, v = _prefill_inputs(1, 3, 40, 96, 8, 4, 64)
    q_off, kv_len = jnp.asarray([0, 30, 50], jnp.int32), jnp.asarray([40, 65, 96], jnp.int32)
    clean = np.asarray(prefill(q, k, v, q_off, kv_len, scale=0.125))
    for row, n in enumerate(np.asarray(kv_len)):
        k, v = k.at[row, n:].set(jnp.nan), v.at[row, n:].set(jnp.nan)
    poisoned = np.asarray(prefill(q, k, v, q_off, kv_len, scale=0.125))
    np.testing.assert_array_equal(poisoned, clean)
    # kv_lens past the gathered keys are clamped to them
    np.testing.assert_array_equal(
        np.asarray(prefill(q, k, v, q_off, kv_len.at[2].set(500), scale=0.125)), clean)


@pytest.mark.parametrize("bs,kv,d", [(16, 4, 64), (4, 2, 32), (1, 1, 8)])
def test_gather_live_copies_each_rows_live_blocks_for_the_prefill_kernel(level: str, bs: int, kv: int, d: int) -> None:
    """The live gather holds XLA's gather's values for every key below a row's kv_len (blocks
    shuffled, a partly filled last block, an empty row); block ids past a row's keys may point
    anywhere (even outside the cache) and are not read, and the prefill kernel over it gives what it
    gives over the full gather."""
    import jax.numpy as jnp

    from inference.kernels.xla_attention import gather_block_rows

    rng = np.random.default_rng(bs + kv + d)
    b, m = 4, -(-100 // bs)
    nb = b * m + 3
    kc = jnp.asarray(rng.standard_normal((nb, bs, kv, d), dtype=np.float32))
    vc = jnp.asarray(rng.standard_normal((nb, bs, kv, d), dtype=np.float32))
    tables = rng.permutation(nb)[: b * m].reshape(b, m).astype(np.int32)
    kv_len = np.asarray([100, 37, 0, 1], np.int32)
    full = [np.asarray(gather_block_rows(c, None, jnp.asarray(tables))).reshape(b, m * bs, kv, d) for c in (kc, vc)]
    for row, n in enumerate(kv_len):
        tables[row, -(-n // bs) :] = rng.integers(-5, 2 * nb, m - -(-n // bs))  # never read
    live = [np.asarray(x) for x in cpu_ffi.gather_live_cpu(kc, vc, jnp.asarray(tables), jnp.asarray(kv_len), level=level)]
    for got, want in zip(live, full, strict=True):
        assert got.shape == want.shape
        for row, n in enumerate(kv_len):
            np.testing.assert_array_equal(got[row, :n], want[row, :n])
    q = jnp.asarray(rng.standard_normal((b, 9, 2 * kv, d), dtype=np.float32))
    q_off, lens = jnp.asarray(np.maximum(kv_len - 9, 0)), jnp.asarray(kv_len)
    np.testing.assert_array_equal(
        np.asarray(cpu_ffi.prefill_attention_cpu(q, *map(jnp.asarray, live), q_off, lens, scale=0.2, level=level)),
        np.asarray(cpu_ffi.prefill_attention_cpu(q, *map(jnp.asarray, full), q_off, lens, scale=0.2, level=level)))
    with pytest.raises(Exception, match="inconsistent shapes"):
        cpu_ffi.gather_live_cpu(kc, vc[:, :, :, :1], jnp.asarray(tables), jnp.asarray(kv_len), level=level)[0].block_until_ready()


@pytest.mark.parametrize("shapes", [
    ((2, 5, 8, 16), (2, 9, 4, 16), (2, 9, 4, 8), 2),  # v's head dim differs from k's
    ((2, 5, 8, 16), (3, 9, 4, 16), (3, 9, 4, 16), 2),  # k's batch differs from q's
    ((2, 5, 6, 16), (2, 9, 4, 16), (2, 9, 4, 16), 2),  # 6 query heads over 4 KV heads
    ((2, 5, 8, 16), (2, 9, 4, 12), (2, 9, 4, 12), 2),  # head dims differ
    ((2, 5, 8, 16), (2, 9, 4, 16), (2, 9, 4, 16), 3),  # three offsets for two rows
])
def test_native_prefill_rejects_inconsistent_shapes(shapes) -> None:
    import jax.numpy as jnp

    assert cpu_ffi.available()
    qs, ks, vs, n = shapes
    args = [jnp.zeros(x, jnp.float32) for x in (qs, ks, vs)] + [jnp.zeros(n, jnp.int32)] * 2
    with pytest.raises(Exception, match="inconsistent shapes"):
        cpu_ffi.prefill_attention_cpu(*args, scale=0.25).block_until_ready()


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 13, 32, 64, 65])
@pytest.mark.parametrize("n,k", [(1, 7), (16, 1), (17, 512), (100, 33), (48, 1030)])
def test_packed_matmul_matches_float64(level: str, m: int, n: int, k: int) -> None:
    """Every row-tile height (1-6; rows spread evenly over the tiles), panels with padding columns, K of any
    size, within gamma_K |x| |W|.T of the float64 product."""
    import jax.numpy as jnp

    from inference.kernels.projections import pack_weight

    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    packed = pack_weight(w)
    assert packed.panels.shape == (-(-n // 16), k, 16) and packed.shape == (n, k)
    got = np.asarray(cpu_ffi.matmul_packed_cpu(jnp.asarray(x), packed.panels, n, level=level))
    f64.assert_within(got, x.astype(np.float64) @ w.T.astype(np.float64), f64.matmul_bound(x, w), "x @ W.T")


def test_packed_matmul_rejects_inconsistent_shapes() -> None:
    import jax.numpy as jnp

    assert cpu_ffi.available()
    x = jnp.ones((3, 8), jnp.float32)
    for panels, n in ((jnp.ones((1, 9, 16), jnp.float32), 16), (jnp.ones((1, 8, 8), jnp.float32), 8),
                      (jnp.ones((1, 8, 16), jnp.float32), 17)):
        with pytest.raises(Exception, match="matmul_packed"):
            np_result = cpu_ffi.matmul_packed_cpu(x, panels, n)
            np_result.block_until_ready()


@pytest.mark.parametrize("r,h,kv,d", [(1, 8, 4, 64), (33, 8, 4, 64), (70, 6, 2, 8), (5, 2, 1, 128),
                                     (40, 4, 4, 12)])
def test_native_rope_write_matches_float64_rotation_and_scatter(level: str, r: int, h: int, kv: int, d: int) -> None:
    """Rotated queries and the cache after the write, against llama's rotate-half RoPE in float64 from
    the same cos/sin tables (``rope.rope_tables``) and the same scatter, within gamma_2 of each
    product pair, over GQA 1/2/3/4, head dims 8-128, row counts across the 32-row tasks, positions
    up to 4096, and padding rows (slots past the cache or negative) that write nothing; values are
    copied exactly and every slot not written keeps its old value bit for bit."""
    import jax.numpy as jnp

    from inference.kernels import rope

    rng = np.random.default_rng(r * 100 + h + kv + d)
    n, bs = 20, 4
    qkv = rng.standard_normal((r, (h + 2 * kv) * d), dtype=np.float32)
    pos = jnp.asarray(rng.integers(0, 4096, r).astype(np.int32))
    slots = rng.permutation(n * bs)[:r].astype(np.int32)
    slots[::7] = n * bs + 3  # padding rows
    slots[3::11] = -1
    kc, vc = (rng.standard_normal((n, bs, kv, d), dtype=np.float32) for _ in range(2))
    inv_freq = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d)))
    cos, sin = (np.asarray(t) for t in rope.rope_tables(pos, inv_freq))
    q, k2, v2 = (np.asarray(x) for x in cpu_ffi.rope_write_kv_cpu(
        *map(jnp.asarray, (qkv, cos, sin, slots, kc, vc)), heads=h, level=level))
    want_q, bound_q = f64.rope(qkv[:, : h * d].reshape(r, h, d), cos, sin)
    f64.assert_within(q, want_q, bound_q, "q")
    want_k, bound_k = f64.rope(qkv[:, h * d: (h + kv) * d].reshape(r, kv, d), cos, sin)
    want_kc, bound_kc, want_vc = kc.astype(np.float64), np.zeros(kc.shape), vc.copy()
    for i, at in enumerate(slots):
        if 0 <= at < n * bs:
            want_kc[at // bs, at % bs], bound_kc[at // bs, at % bs] = want_k[i], bound_k[i]
            want_vc[at // bs, at % bs] = qkv[i, (h + kv) * d:].reshape(kv, d)
    f64.assert_within(k2, want_kc, bound_kc, "k cache")
    np.testing.assert_array_equal(v2, want_vc)


def test_native_rope_write_rejects_inconsistent_shapes() -> None:
    import jax.numpy as jnp

    assert cpu_ffi.available()
    cache = jnp.zeros((4, 2, 2, 8), jnp.float32)
    ok = (jnp.zeros((3, 64), jnp.float32), jnp.zeros((3, 4), jnp.float32), jnp.zeros((3, 4), jnp.float32),
          jnp.zeros(3, jnp.int32))
    cpu_ffi.rope_write_kv_cpu(*ok, cache, cache, heads=4)[0].block_until_ready()
    for bad, heads in ((ok[:1] + (jnp.zeros((3, 3), jnp.float32),) * 2 + ok[3:], 4),  # cos of D/2 - 1
                       ((jnp.zeros((3, 60), jnp.float32),) + ok[1:], 4),  # qkv narrower than (H + 2 KV) D
                       (ok[:3] + (jnp.zeros(2, jnp.int32),), 4),  # two slots for three rows
                       (ok, 3)):  # heads disagree with the qkv width
        with pytest.raises(Exception, match="rope_write_kv"):
            cpu_ffi.rope_write_kv_cpu(*bad, cache, cache, heads=heads)[0].block_until_ready()


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))



# Row counts and live rows: x's rows are len(live) groups; the first live[g] rows of group g are real.
_LIVE = {1: None, 7: [5], 32: [1, 0] * 16, 200: [100, 37]}  # 200 rows: packed over the threads


@pytest.mark.parametrize("m", sorted(_LIVE))
@pytest.mark.parametrize("n,k", [(17, 33), (100, 512)])
def test_packed_matmul_fusions_match_float64(level: str, m: int, n: int, k: int) -> None:
    """The plain product and the fused prologues and epilogue against float64 numpy, on the live rows:
    ``x @ W.T``, ``rms_norm(x, norm, eps) @ W.T``, ``res + x @ W.T`` and ``res + (silu(gate) * up) @
    W.T`` with gates out to +-100 (the sigmoid's saturated ends) and a row of zeros (its norm is eps
    alone). Rows past a group's live count (a bucket's padding) come out zero.

    Bounds: the product's gamma_K |x| |W|.T, on inputs that carry the prologue's own relative error:
    the RMSNorm's sum of K squares (gamma_K, halved by the square root), the mean, eps, sqrt,
    reciprocal and two multiplies (5 u); SwiGLU's exp (EXP_ERROR, twice through 1 + e and the
    quotient), the add, the divide and two multiplies (4 u). A residual is one more term of the sum."""
    import jax.numpy as jnp

    from inference.kernels.projections import pack_weight

    rng = np.random.default_rng(m + n + k)
    x = rng.standard_normal((m, 2 * k), dtype=np.float32)
    x[0, :k] = np.linspace(-100, 100, k, dtype=np.float32)
    if m > 1:
        x[-1, :k] = 0.0
    w = rng.standard_normal((n, k), dtype=np.float32)
    norm = rng.uniform(0.5, 1.5, k).astype(np.float32)
    res = rng.standard_normal((m, n), dtype=np.float32)
    panels = pack_weight(w).panels
    live = None if _LIVE[m] is None else jnp.asarray(_LIVE[m], jnp.int32)
    counts = [m] if live is None else _LIVE[m]
    real = np.concatenate([np.arange(m // len(counts)) < c for c in counts])
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    xk = x64[:, :k]
    normed = norm * (xk / np.sqrt((xk * xk).mean(-1, keepdims=True) + 1e-5))
    act = _silu(x64[:, :k]) * x64[:, k:]
    xs = jnp.asarray(x[:, :k])
    mm = functools.partial(cpu_ffi.matmul_packed_cpu, panels=panels, n=n, live=live, level=level)
    with_res = f64.gamma(k + 1) * np.abs(res)  # the residual as the sum's (K+1)-th term
    cases = {
        "plain": (mm(xs), xk @ w64.T, f64.matmul_bound(xk, w64)),
        "norm": (mm(xs, norm=jnp.asarray(norm), eps=1e-5), normed @ w64.T,
                 f64.matmul_bound(normed, w64, rel_x=float(f64.gamma(k)) / 2 + 5 * f64.U)),
        "residual": (mm(xs, residual=jnp.asarray(res)), res + xk @ w64.T,
                     with_res + f64.matmul_bound(xk, w64, rel_x=f64.U)),
        "swiglu": (mm(jnp.asarray(x), residual=jnp.asarray(res), swiglu=True), res + act @ w64.T,
                   with_res + f64.matmul_bound(act, w64, rel_x=f64.U + 2 * f64.EXP_ERROR + 4 * f64.U)),
    }
    for name, (got, want, bound) in cases.items():
        got = np.asarray(got)
        f64.assert_within(got[real], want[real], bound[real], name)
        assert not got[~real].any(), f"{name}: padding rows must be zeros"


def test_packed_matmul_fusions_reject_inconsistent_shapes() -> None:
    import jax.numpy as jnp

    assert cpu_ffi.available()
    x, panels = jnp.ones((3, 8), jnp.float32), jnp.ones((1, 8, 16), jnp.float32)
    cases = [dict(norm=jnp.ones(7, jnp.float32)),  # a norm weight of K - 1
             dict(residual=jnp.ones((3, 15), jnp.float32)),  # a residual narrower than y
             dict(residual=jnp.ones((3, 16), jnp.float32), swiglu=True),  # SwiGLU of an x K wide, not 2K
             dict(live=jnp.ones(2, jnp.int32))]  # two groups of 3 rows
    for kwargs in cases:
        with pytest.raises(Exception, match="matmul_packed"):
            cpu_ffi.matmul_packed_cpu(x, panels, 16, **kwargs).block_until_ready()
    with pytest.raises(ValueError, match="only with a residual"):
        cpu_ffi.matmul_packed_cpu(jnp.ones((3, 16), jnp.float32), panels, 16, swiglu=True)
