"""Tensor parallelism on 4 forced CPU devices: TP = 2 and TP = 4 give TP = 1's greedy tokens.

The check runs in a subprocess (``tp_check.py``): how many CPU devices JAX makes is fixed when it
starts, and this process's JAX already has one. The layout helpers are checked here directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from inference.model.config import TINY_CONFIG
from inference.model.tensor_parallel import Layout, gate_up_rows, qkv_rows

ROOT = Path(__file__).resolve().parents[3]
FOUR_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}


def test_each_device_gets_its_own_heads_rows() -> None:
    """Tiny: 4 heads, 2 KV heads of 16. TP = 2: device 0 has q heads 0-1 and KV head 0; TP = 4:
    device 3 has q head 3 and KV head 1 (each KV head on two devices)."""
    two = Layout.of(TINY_CONFIG, 2)
    rows = qkv_rows(two).reshape(2, -1)
    assert rows.shape == (2, (2 + 1 + 1) * 16)
    assert list(rows[0, :32]) == list(range(32)) and list(rows[0, 32:48]) == list(range(64, 80))
    assert list(rows[0, 48:]) == list(range(96, 112))
    four = Layout.of(TINY_CONFIG, 4)
    assert four.cache_kv_heads == 4 and four.local(TINY_CONFIG).num_key_value_heads == 1
    rows4 = qkv_rows(four).reshape(4, -1)
    assert list(rows4[3]) == [*range(48, 64), *range(80, 96), *range(112, 128)]
    gu = gate_up_rows(two).reshape(2, -1)
    assert list(gu[1]) == [*range(64, 128), *range(192, 256)]
    assert sorted(set(qkv_rows(two))) == list(range(128))  # TP = 2: a permutation
    with pytest.raises(ValueError, match="divide"):
        Layout.of(TINY_CONFIG, 3)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama written by transformers: GQA (2 KV heads), untied head, llama3 RoPE."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, initializer_range=0.1, rope_theta=500000.0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms of ones would hide a norm sharded wrong
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    path = tmp_path_factory.mktemp("hf-llama")
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 18 runners compiling on a shared machine
def test_tp2_and_tp4_give_tp1s_greedy_tokens(hf_checkpoint: Path) -> None:
    env = {**os.environ, **FOUR_CPUS, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.inference.model.tp_check", str(hf_checkpoint)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs: dict[str, dict[int, dict[str, list[int]]]] = defaultdict(dict)
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        runs[row["case"]][row["tp"]] = row["tokens"]
    assert set(runs) == {f"{m}-{k}" for m in ("tiny", "hf") for k in ("f32", "bf16", "int8")}
    for case, by_tp in runs.items():
        one = by_tp[1]
        assert all(len(t) == 8 for t in one.values())
        assert len({tuple(np.concatenate(list(one.values())))}) == 1
        for tp, tokens in by_tp.items():
            assert tokens == one, f"{case}: TP={tp} differs from TP=1"
        assert set(by_tp) == {1, 2, 4}


@pytest.mark.slow
def test_sharded_steps_lower_for_a_cuda_mesh_and_a_tpu_mesh() -> None:
    """Decode, prefill and mixed steps at TP = 4 (bf16, int8 weights, int8 KV) lower for CUDA and TPU
    with the platform's kernels, two all-reduces a layer and none of the native CPU kernels; where
    libtpu is installed (``make test``'s .venv/libtpu) the TPU ones compile on a v5e 2x2 too."""
    libtpu = ROOT / ".venv" / "libtpu"
    compile_tpu = libtpu.is_dir()
    path = os.pathsep.join([str(libtpu), str(ROOT)] if compile_tpu else [str(ROOT)])
    env = {**os.environ, **FOUR_CPUS, "PYTHONPATH": path}
    argv = [sys.executable, "-m", "tests.inference.model.mesh_lowering", *(["--compile-tpu"] if compile_tpu else [])]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    lowered = [r for r in rows if "devices" in r]
    assert len(lowered) == 2 * 3 * 3
    for r in lowered:
        assert r["devices"] == 4 and r["all_reduces"] == 2 * 2 and r["kernels"] >= 1 and r["native"] == 0, r
    assert len([r for r in rows if r.get("compiled")]) == (9 if compile_tpu else 0)
