"""The kernel seam: which implementation of every operation the model runs, chosen once per worker.

How it works: :func:`build_kernels` takes the platform (:func:`current_platform`, the one place in
inference/ that asks JAX which backend it is on; or one given, to lower for another), the model's
dtype, the KV cache's quantization and the ``attention`` option, and returns a :class:`KernelSet`:
frozen data holding plain functions. A model's ``prefill`` and ``decode`` call only these; the
runner builds the set once and asks it how to lay out the weights (``pack``). Every choice is made
here, at build time, so a step traces to the program that choice alone compiles to, and nothing
downstream asks where it runs.

``attention`` (the worker's ``--attention``) names a family:

- ``auto``: ``pallas`` on GPU and TPU, ``native`` on CPU.
- ``pallas``: the Pallas kernels of the platform's family (Triton on GPU, Mosaic on TPU),
  compiled there with autotuned block sizes. On another platform only with ``interpret=True``
  (the CPU tests), ``target`` naming the family. Projections and RoPE: XLA.
- ``native``: the native CPU kernels (:mod:`~inference.kernels.cpu_ffi`): attention, RoPE with the
  K/V write, and the projections packed for the native matmul, for float32 models; XLA's kernels
  where they do not serve (bfloat16; a quantized cache's decode and RoPE), and everywhere when the
  kernels cannot be built (no compiler: logged once).
- ``xla``: attention as ``jnp`` code XLA compiles (:mod:`~inference.kernels.xla_attention`),
  projections and RoPE in XLA's own ops: any platform.
- ``reference``: the ground truth (:mod:`~inference.kernels.reference`: every key gathered, one
  masked softmax); slow, for checking numerics.

``window`` (a model's sliding window: a query sees its last ``window`` keys) is built into the set's
attention, which never reads the blocks before a row's window (the KV cache may have released
them). The native, XLA and reference kernels take it; the Pallas ones do not, so a window turns
``pallas`` into ``xla`` (logged), never into attention over the whole context.

On every platform the projections are XLA's dot, except on XLA:CPU where a few rows take the
multiply-reduce (:func:`inference.kernels.projections.linear`) and fp8 codes are scattered as bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from inference.kernels import cpu_ffi, paged_cache, pallas, projections, reference, rope, xla_attention
from inference.kernels.autotune import Autotuner
from inference.kernels.paged_cache import LayerKV
from inference.kernels.quant import quantized_matmul

__all__ = ["ATTENTION", "KernelSet", "build_kernels", "current_platform", "current_devices"]

log = logging.getLogger(__name__)
ATTENTION = ("auto", "pallas", "native", "xla", "reference")
Array = jax.Array
PagedAttention = Callable[..., Array]  # (q, k: LayerKV, v: LayerKV, block_tables, *lens, scale=) -> out
RopeOperand = Callable[[Array, Array], Any]  # (positions, inv_freq) -> what rope_write reads, once per call
RopeWrite = Callable[..., tuple[Array, LayerKV, LayerKV]]  # (qkv, operand, slots, k, v, *, heads, kv_heads)


@dataclass(frozen=True, slots=True)
class KernelSet:
    """The operations a model's forward pass calls, each already chosen for one platform, dtype and
    KV cache; signatures as in :mod:`inference.kernels.paged_cache`, :mod:`~inference.kernels.rope`
    and :mod:`~inference.kernels.projections`."""

    platform: str  # "cpu", "gpu", "tpu": where the steps run (or are lowered for)
    attention: str  # the family that runs: "pallas", "native", "xla" or "reference"
    dtype: str  # the model's dtype the set was built for, e.g. "float32"
    kv_quant: str | None  # the KV cache's codes ("int8", "fp8") or None (the model dtype)
    window: int | None  # the sliding window the attention applies (None: the whole context)
    prefill: PagedAttention  # (q [B,T,H,D], k, v, block_tables, q_offsets, kv_lens, *, scale) -> [B,T,H,D]
    decode: PagedAttention  # (q [B,H,D], k, v, block_tables, context_lens, *, scale) -> [B,H,D]
    rope: RopeOperand
    rope_write: RopeWrite  # rotated q [..., H, D], and the layer's caches with k and v written at slots
    linear: Callable[..., Array]  # (x, w_t [out, in], out_dtype) -> x @ w_t.T
    norm_linear: Callable[..., Array]  # (x, norm, eps, w_t, live, out_dtype) -> linear(rms_norm(x), w_t)
    residual_linear: Callable[..., Array]  # (res, x, w_t, live, *, swiglu) -> res + linear(x or SwiGLU(x))
    matmul: Callable[[Array, Any], Array]  # (x, w [in, out]: an array or a QuantizedWeight) -> x @ w
    pack: Callable[[Array], Any] | None  # a float projection [out, in] -> the layout `linear` reads best


def current_platform() -> str:
    """The platform JAX runs on here: "cpu", "gpu" or "tpu" (inference/ asks nowhere else)."""
    return jax.default_backend()


def current_devices() -> list[Any]:
    """The devices a worker's mesh may span: every process's, once ``jax.distributed`` has joined them."""
    return list(jax.devices())


def build_kernels(attention: str = "auto", *, dtype: Any = jnp.float32, kv_quant: str | None = None,
                  platform: str | None = None, interpret: bool = False, target: str | None = None,
                  tuner: Autotuner | None = None, window: int | None = None) -> KernelSet:
    """The kernel set for ``attention`` (module docstring) on ``platform`` (default: this one).

    ``interpret`` and ``target`` are the ``pallas`` family's: kernels run interpreted (on any
    platform), and which family (``"gpu"`` or ``"tpu"``; default the platform's own, else ``"gpu"``).
    ``tuner`` picks their block sizes (default: tuning on when they compile, off when interpreted).
    """
    platform = platform or current_platform()
    family = _family(attention, platform, interpret)
    if window is not None and family == "pallas":
        log.info("kernels: xla attention in place of pallas (the Pallas kernels have no sliding window; "
                 "this model's is %d)", window)
        family = "xla"
    name = jnp.dtype(dtype).name
    on_cpu = platform == "cpu"
    base = dict(platform=platform, dtype=name, kv_quant=kv_quant, window=window, rope=rope.positions_operand,
                rope_write=partial(rope.rope_write, as_bytes=on_cpu),
                linear=partial(projections.linear, mulreduce=on_cpu),
                norm_linear=partial(projections.norm_linear, mulreduce=on_cpu),
                residual_linear=partial(projections.residual_linear, mulreduce=on_cpu), matmul=quantized_matmul,
                pack=None)  # fmt: skip
    if family == "pallas":
        target = target or (platform if platform in pallas.FAMILIES else "gpu")
        if target not in pallas.FAMILIES:
            raise ValueError(f"unknown Pallas family {target!r}; expected one of {pallas.FAMILIES}")
        if not interpret and target != platform:
            raise ValueError(f"the {target} Pallas kernels compile on {target} only, not {platform} "
                             f"(interpret=True runs them anywhere)")
        make = pallas.tpu_kernels if target == "tpu" else pallas.gpu_kernels
        kernels = make(platform=platform, interpret=interpret, tuner=tuner or Autotuner(enabled=not interpret))
        log.info("kernels: pallas, %s family %s on %s", target, "interpreted" if interpret else "compiled",
                 platform)
        return KernelSet(attention="pallas", prefill=paged_cache.over_cache(kernels.paged_prefill),
                         decode=paged_cache.over_cache(kernels.decode), **{**base, "matmul": kernels.matmul})
    if family == "native" and name == "float32" and cpu_ffi.available():
        log.info("kernels: native CPU kernels (%s KV cache)", kv_quant or "float32")
        native = {**base, "attention": "native", "prefill": partial(_native_prefill, window=window),
                  "pack": projections.pack_weight}
        if kv_quant is not None:  # the native decode and RoPE write read float32 caches only
            xla_decode = partial(xla_attention.paged_decode_attention, window=window)
            return KernelSet(decode=paged_cache.over_cache(xla_decode), **native)
        return KernelSet(decode=partial(_native_decode, window=window),
                         **{**native, "rope": rope.rope_tables, "rope_write": rope.rope_write_native})
    if family == "native":
        why = f"they are float32 kernels, the model is {name}" if name != "float32" else "they did not build"
        log.info("kernels: xla in place of the native CPU kernels (%s)", why)
        family = "xla"
    dense = reference.prefill_attention if family == "reference" else xla_attention.prefill_attention
    decode = reference.paged_decode_attention if family == "reference" else xla_attention.paged_decode_attention
    if family == "reference":
        log.info("kernels: reference attention (the ground truth, slow) on %s", platform)
    return KernelSet(attention=family, prefill=_gathered(partial(dense, window=window)),
                     decode=paged_cache.over_cache(partial(decode, window=window)), **base)


def _family(attention: str, platform: str, interpret: bool) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention kernels {attention!r}; expected one of {ATTENTION}")
    if attention == "auto":
        return "pallas" if platform in pallas.FAMILIES else "native"
    if attention == "native" and platform != "cpu":
        raise ValueError(f"the native kernels are CPU kernels; on {platform} use auto, pallas or xla")
    if attention == "pallas" and platform not in pallas.FAMILIES and not interpret:
        raise ValueError(f"the Pallas kernels compile for GPU and TPU, not {platform}; use auto, native or xla "
                         f"(interpret=True runs them interpreted, as the tests do)")
    return attention


def _gathered(dense: Callable[..., Array]) -> PagedAttention:
    """A prefill kernel over contiguous keys, fed each row's table gathered (and dequantized) from the cache."""
    def prefill(q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array, q_offsets: Array, kv_lens: Array, *,
                scale: float) -> Array:
        k, v = paged_cache.gather(kc, block_tables, q.dtype), paged_cache.gather(vc, block_tables, q.dtype)
        return dense(q, k, v, q_offsets, kv_lens, scale=scale)

    return prefill


def _native_prefill(q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array, q_offsets: Array, kv_lens: Array, *,
                    scale: float, window: int | None) -> Array:
    """The native prefill over each row's keys: only the key tiles each query tile sees, over XLA's
    threads (bench model, 8 layers' attention, two threads: 128 tokens 6.3 -> 1.4 ms, 512 tokens 50 ->
    18 ms against the XLA loop). From a float cache only the blocks that hold a row's first ``kv_lens``
    keys are copied (the kernel reads no further; a whole table is ``max_model_len`` keys, whatever the
    prompt's length); a quantized one is gathered and dequantized whole."""
    if isinstance(kc, tuple) or isinstance(vc, tuple):
        k, v = paged_cache.gather(kc, block_tables, q.dtype), paged_cache.gather(vc, block_tables, q.dtype)
    else:
        k, v = cpu_ffi.gather_live_cpu(kc, vc, block_tables, kv_lens)
    return cpu_ffi.prefill_attention_cpu(q, k, v, q_offsets, kv_lens, scale=scale, window=window)


def _native_decode(q: Array, kc: Array, vc: Array, block_tables: Array, context_lens: Array, *,
                   scale: float, window: int | None) -> Array:
    """The native decode over a float32 cache (each sequence's K/V rows read in place through its table).

    Bench model, batch 32, contexts 100-200, two threads, whole decode step: 31.9 -> 24.7 ms against
    the XLA loop; batch 8 12.8 -> 11.3; batch 1 7.1 -> 6.7 (one layer alone at batch 32: 1.67 -> 0.54 ms).
    """
    return cpu_ffi.paged_decode_cpu(q, kc, vc, block_tables, context_lens, scale=scale, window=window)
