"""A tensor-parallel model step lowered for a CUDA mesh and a TPU mesh, on this CPU host.

``jax.export`` lowers for a platform that is not present, for as many devices as the mesh has
(4 forced CPU devices stand in for them: export keeps only their count). With the kernel set a
worker there builds, a two-layer model's decode, prefill and mixed steps under ``shard_map``
(:class:`~inference.model.tensor_parallel.ShardedModel`: bf16, int8 weights, an int8 KV cache;
8 heads and 2 KV heads at TP = 4, so each KV head is on two devices) must carry the platform's
kernels and the all-reduces. With ``--compile-tpu`` (libtpu importable: ``make test`` puts it in
``.venv/libtpu``) the TPU steps also compile, on compile-only devices of a v5e 2x2 topology.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.inference.model.mesh_lowering

Prints one JSON line per case.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax import export
from jax.sharding import Mesh, NamedSharding

from inference.model import llama
from inference.model.config import LlamaConfig
from inference.model.tensor_parallel import Layout, ShardedModel, cache_specs, make_mesh, param_specs, reorder
from tests.inference.kernels.mosaic_compile import abstract_cache, abstract_params, accelerator_kernels

CFG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64)  # fmt: skip
TP, B, T, BLOCKS, BS, WIDTH = 4, 4, 32, 64, 16, 8
CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def steps(mesh: Mesh, platform: str, weights: str | None, kv_quant: str | None) -> dict[str, tuple[Any, list[Any]]]:
    """Name -> (jitted step, abstract arguments placed on ``mesh``)."""
    lay = Layout.of(CFG, TP)
    kernels = accelerator_kernels("gpu" if platform == "cuda" else platform, jnp.bfloat16, kv_quant)
    params = jax.eval_shape(lambda: reorder(_zeros(abstract_params(CFG, weights)), lay)[0])
    specs = param_specs(params)
    cache = abstract_cache(dataclasses.replace(CFG, num_key_value_heads=lay.cache_kv_heads), BLOCKS, BS,
                           jnp.bfloat16, kv_quant)
    model = ShardedModel(llama.Llama(lay.local(CFG)), mesh, specs, cache_specs(cache))

    def on_mesh(tree: Any, sp: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                            tree, sp)

    i32 = jnp.int32
    sd = jax.ShapeDtypeStruct
    head = [on_mesh(params, specs), on_mesh(cache, model.cache_specs)]
    dec = [sd((B,), i32)] * 3 + [sd((B, WIDTH), i32), sd((B,), i32)]
    pre = [sd((B, T), i32)] * 3 + [sd((B, WIDTH), i32)] + [sd((B,), i32)] * 3

    def decode(p: Any, c: Any, *a: Any) -> Any:
        return model.decode(p, c, *a, kernels=kernels)

    def prefill(p: Any, c: Any, *a: Any) -> Any:
        return model.prefill(p, c, *a, kernels=kernels)

    def mixed(p: Any, c: Any, d: Any, q: Any) -> Any:
        return model.mixed(p, c, d, q, kernels=kernels)

    return {"decode": (jax.jit(decode), [*head, *dec]), "prefill": (jax.jit(prefill), [*head, *pre]),
            "mixed": (jax.jit(mixed), [*head, tuple(dec), tuple(pre)])}


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


CASES = [("bf16", None, None), ("int8 weights", "int8", None), ("int8 KV", None, "int8")]


def main(argv: list[str]) -> int:
    mesh = make_mesh(TP)
    for platform in ("cuda", "tpu"):
        disabled = [export.DisabledSafetyCheck.custom_call(CALLS["cuda"])] if platform == "cuda" else []
        for label, weights, kv in CASES:
            for name, (fn, args) in steps(mesh, platform, weights, kv).items():
                exp = export.export(fn, platforms=[platform], disabled_checks=disabled)(*args)
                text = exp.mlir_module()
                print(json.dumps({"platform": platform, "case": label, "step": name, "devices": exp.nr_devices,
                                  "all_reduces": text.count("all_reduce"), "kernels": text.count(CALLS[platform]),
                                  "native": text.count("quicserve_")}), flush=True)
    if "--compile-tpu" in argv:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc("v5e:2x2", "tpu").devices
        tpu = make_mesh(TP, devices)
        for label, weights, kv in CASES:
            for name, (fn, args) in steps(tpu, "tpu", weights, kv).items():
                fn.lower(*args).compile()
                print(json.dumps({"platform": "tpu", "case": label, "step": name, "compiled": True}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
