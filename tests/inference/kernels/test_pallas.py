"""The Pallas families as the kernel set calls them (interpreted on CPU), and the block-size autotuner."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from inference.kernels import pallas, reference  # noqa: E402
from inference.kernels.autotune import Autotuner  # noqa: E402
from inference.kernels.paged_decode import DecodeBlocks  # noqa: E402
from inference.kernels.quant import quantize_blocks  # noqa: E402


def _decode_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 8, 64), np.float32))
    kc = jnp.asarray(rng.standard_normal((12, 8, 2, 64), np.float32))
    vc = jnp.asarray(rng.standard_normal((12, 8, 2, 64), np.float32))
    tables = jnp.asarray(rng.permutation(12)[:8].reshape(2, 4).astype(np.int32))
    return q, kc, vc, tables, jnp.asarray([5, 30], jnp.int32)


def test_interpreted_gpu_family_inside_jit(tmp_path: Path) -> None:
    """Interpreted: both kernels run under the caller's jit and match the reference."""
    fns = pallas.gpu_kernels(interpret=True, tuner=Autotuner(tmp_path / "t.json", enabled=False))
    prefill_fn, decode_fn = fns.prefill, fns.decode
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64), np.float32))
    k = jnp.asarray(rng.standard_normal((2, 32, 2, 64), np.float32))
    offs, lens = jnp.asarray([16, 0], jnp.int32), jnp.asarray([32, 16], jnp.int32)
    got = jax.jit(lambda *a: prefill_fn(*a, scale=0.125))(q, k, k * 0.5, offs, lens)
    want = reference.prefill_attention(q, k, k * 0.5, offs, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)

    q, kc, vc, tables, clens = _decode_inputs()
    kq, ks = quantize_blocks(kc, "int8")
    vq, vs = quantize_blocks(vc, "int8")
    got = jax.jit(lambda *a: decode_fn(*a, scale=0.125, k_scale=ks, v_scale=vs))(q, kq, vq, tables, clens)
    want = reference.paged_decode_attention(q, kq, vq, tables, clens, scale=0.125, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert not (tmp_path / "t.json").exists()  # tuning disabled: nothing written


def test_interpreted_tpu_family_inside_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mosaic-model kernels, interpreted, match too (default tiles: tuning is off when interpreted)."""
    from inference.kernels import tpu_decode, tpu_prefill

    fns = pallas.tpu_kernels(interpret=True, tuner=Autotuner(enabled=False))
    prefill_fn, decode_fn = fns.prefill, fns.decode
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 64), np.float32))
    k = jnp.asarray(rng.standard_normal((2, 32, 2, 64), np.float32))
    offs, lens = jnp.asarray([16, 0], jnp.int32), jnp.asarray([32, 16], jnp.int32)
    calls = []
    monkeypatch.setattr(pallas, "tpu_flash_prefill", lambda *a, **kw: calls.append(kw["blocks"])
                        or tpu_prefill.tpu_flash_prefill(*a, **kw))  # fmt: skip
    got = jax.jit(lambda *a: prefill_fn(*a, scale=0.125))(q, k, k * 0.5, offs, lens)
    want = reference.prefill_attention(q, k, k * 0.5, offs, lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert calls == [pallas.tpu_prefill_candidates()[0]]  # tuning off: the default tile

    q, kc, vc, tables, clens = _decode_inputs()
    kq, ks = quantize_blocks(kc, "int8")
    vq, vs = quantize_blocks(vc, "int8")
    monkeypatch.setattr(pallas, "tpu_paged_decode", lambda *a, **kw: calls.append(kw["pages_per_step"])
                        or tpu_decode.tpu_paged_decode(*a, **kw))  # fmt: skip
    got = jax.jit(lambda *a: decode_fn(*a, scale=0.125, k_scale=ks, v_scale=vs))(q, kq, vq, tables, clens)
    want = reference.paged_decode_attention(q, kq, vq, tables, clens, scale=0.125, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert calls[-1] == pallas.tpu_decode_candidates(kc.shape[1])[0].pages_per_step


class _FakeTiming:
    """Test double for ``measure``: fixed seconds per candidate, records calls, may raise."""

    def __init__(self, seconds: dict[DecodeBlocks, float], failing: tuple[DecodeBlocks, ...] = ()) -> None:
        self.seconds, self.failing, self.calls = seconds, failing, []

    def __call__(self, cand: DecodeBlocks) -> float:
        self.calls.append(cand)
        if cand in self.failing:
            raise RuntimeError("out of shared memory\nlong trace")
        return self.seconds[cand]


def test_autotuner_picks_fastest_and_caches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b, c = DecodeBlocks(4, 1), DecodeBlocks(8, 2), DecodeBlocks(16, 4)
    timing = _FakeTiming({a: 3e-3, b: 1e-3, c: 2e-3}, failing=(b,))
    path = tmp_path / "sub" / "autotune.json"
    with caplog.at_level(logging.INFO, logger="inference.kernels.autotune"):
        assert Autotuner(path, enabled=True).pick("decode/x", [a, b, c], timing) == c  # b failed: skipped
    assert timing.calls == [a, b, c]
    assert "chose" in caplog.text and "failed" in caplog.text
    entry = json.loads(path.read_text())["decode/x"]
    assert entry["params"] == {"pages_per_chunk": 16, "k_splits": 4, "num_warps": 4, "num_stages": 2}
    # A new process (new tuner) reads the cache instead of measuring again.
    timing2 = _FakeTiming({})
    assert Autotuner(path, enabled=True).pick("decode/x", [a, b, c], timing2) == c
    assert timing2.calls == []


def test_autotuner_disabled_returns_default(tmp_path: Path) -> None:
    timing = _FakeTiming({})
    tuner = Autotuner(tmp_path / "a.json", enabled=False)
    assert tuner.pick("k", [DecodeBlocks(2, 1), DecodeBlocks(4, 1)], timing) == DecodeBlocks(2, 1)
    assert timing.calls == [] and not (tmp_path / "a.json").exists()


def test_autotuner_survives_a_corrupt_cache(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text("{not json")
    tuner = Autotuner(path, enabled=True)
    assert tuner.pick("k", [DecodeBlocks(2, 1)], _FakeTiming({DecodeBlocks(2, 1): 1.0})) == DecodeBlocks(2, 1)
    assert "k" in json.loads(path.read_text())


def test_tuning_runs_at_trace_time_under_jit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first trace of a shape times real (interpreted) candidates, caches the winner by shape key."""
    cands = [DecodeBlocks(1, 1), DecodeBlocks(2, 2)]
    monkeypatch.setattr(pallas, "decode_candidates", lambda b, kv: cands)
    tuner = Autotuner(tmp_path / "t.json", enabled=True)
    decode_fn = pallas.gpu_kernels(platform="cpu", interpret=True, tuner=tuner).decode
    q, kc, vc, tables, clens = _decode_inputs(2)
    got = jax.jit(lambda *a: decode_fn(*a, scale=0.125))(q, kc, vc, tables, clens)
    want = reference.paged_decode_attention(q, kc, vc, tables, clens, scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    (key, entry), = json.loads((tmp_path / "t.json").read_text()).items()
    assert key == "decode/cpu/B2-H8-KV2-D64-N12-bs8-M4-float32-float32"
    assert DecodeBlocks(**entry["params"]) in cands and entry["seconds"] > 0


def test_compiled_decode_falls_back_for_non_power_of_two_geometry(caplog: pytest.LogCaptureFixture) -> None:
    """Head dim 80 (or a 12-token page) has no Triton tile: the compiled path uses the reference, loudly."""
    from inference.kernels.paged_decode import paged_decode, supports

    assert supports(16, 128) and not supports(16, 80) and not supports(12, 64)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 2, 80), np.float32))
    kc = jnp.asarray(rng.standard_normal((2, 16, 1, 80), np.float32))
    tables, lens = jnp.asarray([[1, 0]], jnp.int32), jnp.asarray([20], jnp.int32)
    with pytest.raises(ValueError, match="power-of-two"):
        paged_decode(q, kc, kc, tables, lens, scale=0.1, platform="gpu")
    decode_fn = pallas.gpu_kernels(tuner=Autotuner(enabled=False)).decode
    with caplog.at_level(logging.WARNING, logger="inference.kernels.pallas"):
        got = decode_fn(q, kc, kc, tables, lens, scale=0.1)
    assert "not powers of two" in caplog.text
    want = reference.paged_decode_attention(q, kc, kc, tables, lens, scale=0.1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_matmul_tuning_key_and_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight matmul tiles are tuned per (M, K, N, dtypes); interpreted candidates are timed for real."""
    from inference.kernels.quant_matmul import MatmulBlocks, pallas_quantized_matmul

    assert all(c.block_m == 16 for c in pallas.matmul_candidates(8))
    # CPU: time the candidates interpreted (on GPU they are compiled)
    monkeypatch.setattr(pallas, "pallas_quantized_matmul", functools.partial(pallas_quantized_matmul, interpret=True))
    monkeypatch.setattr(pallas, "matmul_candidates", lambda m: [MatmulBlocks(16, 16, 16), MatmulBlocks(16, 32, 32)])
    tuner = Autotuner(tmp_path / "t.json", enabled=True)
    x = jnp.ones((2, 3, 32), jnp.float32)
    chosen = pallas.tuned_matmul_blocks(tuner, x, jnp.ones((32, 48), jnp.int8), platform="cpu")
    (key, entry), = json.loads((tmp_path / "t.json").read_text()).items()
    assert key == "wmatmul/cpu/M6-K32-N48-float32-int8"
    assert MatmulBlocks(**entry["params"]) == chosen
