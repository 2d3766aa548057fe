"""Whole model steps lower for the accelerators, with the Pallas kernels of each, on this CPU host.

``jax.export`` lowers for a platform that is not present. With the kernel set
a worker there builds (``auto`` for platform "gpu" / "tpu": the model takes
the paths it takes there, nothing patched), a two-layer Llama's decode and
prefill steps (bf16 and float32, an int8 KV cache, int8 weights) must carry
the kernels as the platform's custom calls (Triton's for CUDA, Mosaic's for
TPU) and none of the native CPU kernels' FFI targets. Compiling them is for the
accelerator (or, for TPU, ``tests/inference/kernels/mosaic_compile.py``).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from inference.model import llama  # noqa: E402
from inference.model.config import LlamaConfig  # noqa: E402
from tests.inference.kernels.mosaic_compile import abstract_cache, abstract_params, accelerator_kernels  # noqa: E402

CFG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64)  # fmt: skip
B, T, BLOCKS, BS, WIDTH = 4, 32, 64, 16, 8
CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _abstract(tree):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tree)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype,kv_quant,weights", [(jnp.bfloat16, None, None), (jnp.float32, None, None),
                                                    (jnp.bfloat16, "int8", None), (jnp.bfloat16, None, "int8")])
def test_model_steps_lower_with_the_platforms_kernels(platform: str, dtype, kv_quant: str | None,
                                                      weights: str | None) -> None:
    """float32 too: on CPU that model would run the native kernels; traced for an accelerator it must not."""
    kernels = accelerator_kernels("gpu" if platform == "cuda" else platform, dtype, kv_quant)
    assert kernels.attention == "pallas" and kernels.pack is None
    params = abstract_params(CFG, weights, dtype)
    cache = abstract_cache(CFG, BLOCKS, BS, dtype, kv_quant)
    i32 = jnp.int32

    def decode(p, c, tokens, positions, slots, tables, lens):
        return llama.decode_forward(p, c, tokens, positions, slots, tables, lens, cfg=CFG, kernels=kernels)

    def prefill(p, c, tokens, positions, slots, tables, offs, lens, last):
        return llama.prefill_forward(p, c, tokens, positions, slots, tables, offs, lens, last, cfg=CFG,
                                     kernels=kernels)

    sd = jax.ShapeDtypeStruct
    steps = {
        "decode": (decode, [sd((B,), i32)] * 3 + [sd((B, WIDTH), i32), sd((B,), i32)]),
        "prefill": (prefill, [sd((B, T), i32)] * 3 + [sd((B, WIDTH), i32)] + [sd((B,), i32)] * 3),
    }
    disabled = [export.DisabledSafetyCheck.custom_call(CALLS["cuda"])] if platform == "cuda" else []
    for name, (fn, args) in steps.items():
        exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(
            _abstract(params), _abstract(cache), *args
        )
        text = exported.mlir_module()
        assert text.count(CALLS[platform]) >= 1, name
        assert "quicserve_" not in text, name  # no native CPU kernel
        assert exported.out_avals[0].shape == (B, CFG.vocab_size)
        if platform == "cuda" and name == "prefill":  # keys read through the table, not gathered first
            assert 'name = "paged_flash_prefill"' in text


@pytest.mark.parametrize("page_size,kernel", [(16, "paged_flash_prefill"), (12, "flash_prefill")])
def test_gpu_prefill_gathers_only_pages_triton_cannot_tile(page_size: int, kernel: str) -> None:
    """Power-of-two pages: the paged kernel. Others: the table gathered, then the dense kernel (which pads)."""
    prefill = accelerator_kernels("gpu", kv_quant="int8").prefill
    sd = jax.ShapeDtypeStruct
    cache = sd((BLOCKS, page_size, 2, 64), jnp.int8)
    scales = sd((BLOCKS, 2), jnp.float32)

    def fn(q, kc, vc, ks, vs, tables, offs, lens):
        return prefill(q, (kc, ks), (vc, vs), tables, offs, lens, scale=0.125)

    exported = export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(CALLS["cuda"])])(
        sd((B, T, 8, 64), jnp.bfloat16), cache, cache, scales, scales, sd((B, WIDTH), jnp.int32),
        sd((B,), jnp.int32), sd((B,), jnp.int32))  # fmt: skip
    assert f'name = "{kernel}"' in exported.mlir_module()
