"""The Llama forward pass over a paged KV cache (pure functions; the runner jits them).

Parameters are a plain pytree (see :func:`param_shapes`), with the HF
projections transposed to ``[in, out]`` (or kept ``[out, in]`` under
``<name>_t`` keys, see :func:`transpose_weights`) and fused: ``wqkv`` = q|k|v and
``w_gate_up`` = gate|up, so each layer does three matmuls plus the output
projections. The KV cache is one ``[num_blocks, block_size, KV, D]`` array
per layer for keys and one for values; a token's K/V is written to flat slot
``block * block_size + offset``, and a slot index ``>= num_blocks*block_size``
means "padding, drop the write". A quantized cache (``kv_quant="int8"|"fp8"``)
holds a ``(codes, scales)`` pair per layer instead (see
:mod:`inference.kernels.quant`): written through the quantizing write,
dequantized when prefill gathers its blocks and inside the decode attention.
Which one a layer holds is known at trace time, so the float path compiles
to the same program as before.

RoPE follows the HF ``rotate_half`` convention (the layout HF checkpoints are
already stored in), with Llama-3 frequency scaling when configured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.quant import (
    QuantizedWeightT,
    code_dtype,
    init_quantized_cache,
    quantize_weight_t,
    write_quantized_kv_flat,
)
from inference.model.attention import AttentionFns, gather_block_rows, native_prefill_serves
from inference.model.config import LlamaConfig

__all__ = [
    "Params",
    "KVCache",
    "param_shapes",
    "rope_inv_freq",
    "init_kv_cache",
    "kv_bytes_per_token",
    "prefill_forward",
    "decode_forward",
    "transpose_weights",
    "quantize_projections",
    "PackedWeightT",
    "pack_weight",
    "pack_projections",
    "weight_bytes",
]

Array = jax.Array
Params = dict[str, Any]  # {"embed", "layers": [ {...}, ...], "norm", "lm_head"?}
LayerKV = Array | tuple[Array, Array]  # float [N,bs,KV,D], or (codes [N,bs,KV,D], scales [N,KV])
KVCache = tuple[tuple[LayerKV, ...], tuple[LayerKV, ...]]  # (keys per layer, values per layer)


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's parameters (and the top-level ones, unprefixed)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return {
        "embed": (cfg.vocab_size, h),
        "norm": (h,),
        "lm_head": (h, cfg.vocab_size),
        "attn_norm": (h,),
        "wqkv": (h, qkv),
        "wo": (cfg.num_attention_heads * d, h),
        "mlp_norm": (h,),
        "w_gate_up": (h, 2 * i),
        "w_down": (i, h),
    }


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float32), Llama-3 / linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def init_kv_cache(cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: Any,
                  kv_quant: str | None = None) -> KVCache:
    """Zeroed cache: float ``dtype`` arrays, or ``(codes, scales)`` pairs with ``kv_quant``."""
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)

    def layer() -> LayerKV:
        return jnp.zeros(shape, dtype) if kv_quant is None else init_quantized_cache(*shape, kv_quant)

    n = cfg.num_hidden_layers
    return tuple(layer() for _ in range(n)), tuple(layer() for _ in range(n))


def kv_bytes_per_token(cfg: LlamaConfig, block_size: int, dtype: Any, kv_quant: str | None = None) -> float:
    """Cache bytes one token takes over all layers, K and V (a quantized block's scales shared by its tokens)."""
    per_head = cfg.head_dim * jnp.dtype(dtype if kv_quant is None else code_dtype(kv_quant)).itemsize
    if kv_quant is not None:
        per_head += 4 / block_size  # one float32 scale per (block, KV head)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_head


def _rms_norm(x: Array, w: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """x [..., heads, D]; positions [...]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., 1, D]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x.dtype)


def transpose_weights(params: Params) -> Params:
    """The same parameters with every projection stored ``[out, in]`` (key ``<name>_t``).

    XLA on CPU multiplies ``x[B, in]`` by an ``[out, in]`` matrix (contracting
    the minor axis of both) about 20-25% faster than by ``[in, out]`` at decode
    batch sizes (8-32 rows), and no slower for prefill; the runner keeps this
    layout. The forward functions accept either layout, per matrix.
    """

    def tr(group: dict[str, Any]) -> dict[str, Any]:
        return {(k + "_t" if k in _MATRICES else k): (jnp.asarray(v.T) if k in _MATRICES else v)
                for k, v in group.items()}

    out = tr({k: v for k, v in params.items() if k != "layers"})
    out["layers"] = [tr(lp) for lp in params["layers"]]
    return out


_MATRICES = frozenset({"wqkv", "wo", "w_gate_up", "w_down", "lm_head"})


def quantize_projections(params: Params, kind: str) -> Params:
    """Transposed parameters (see :func:`transpose_weights`) with every projection quantized.

    Each ``<name>_t`` matrix becomes a :class:`~inference.kernels.quant.QuantizedWeightT`
    (``kind`` codes ``[out, in]``, one float32 scale per output channel). A
    tied head (no ``lm_head_t``: the embedding table is the head) gets its own
    quantized ``lm_head_t``, while the embedding lookup table stays float.
    """
    return _map_projections(params, lambda w: quantize_weight_t(w, kind))


def _map_projections(params: Params, fn: Any) -> Params:
    """Transposed parameters with ``fn`` applied to every ``<name>_t`` projection; a tied head (no
    ``lm_head_t``) gets ``fn`` of the embedding table as its own ``lm_head_t``, the table itself kept."""
    def each(group: dict[str, Any]) -> dict[str, Any]:
        return {k: fn(v) if k.endswith("_t") and k[:-2] in _MATRICES else v for k, v in group.items()}

    out = each({k: v for k, v in params.items() if k != "layers"})
    if "lm_head_t" not in out and "lm_head" not in out:
        out["lm_head_t"] = fn(params["embed"])
    out["layers"] = [each(lp) for lp in params["layers"]]
    return out


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeightT:
    """A float32 projection ``W [n, in]`` in the native CPU matmul's layout (``cpu_matmul.cc``):
    ``panels [ceil(n/16), in, 16]``, 16 output columns per contiguous panel, zero-padded."""

    panels: Array
    n: int = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, int(self.panels.shape[1])


def pack_weight(w_t: Array | np.ndarray) -> PackedWeightT:
    """``w_t [out, in]`` (float32) as :class:`PackedWeightT`."""
    w = np.asarray(w_t, np.float32)
    n, k = w.shape
    p = -(-n // 16)
    padded = np.zeros((p * 16, k), np.float32)
    padded[:n] = w
    return PackedWeightT(jnp.asarray(padded.reshape(p, 16, k).transpose(0, 2, 1)), n)


def pack_projections(params: Params) -> Params:
    """Transposed float32 parameters (:func:`transpose_weights`) with every projection packed for the
    native CPU matmul; a tied head gets its own packed ``lm_head_t`` (the lookup table stays as is).

    Why: the projections are most of a step, and the native kernel streams each packed panel once
    while it prefetches the next (``inference/kernels/cpu_matmul.cc``): bench model, 8-layer chain,
    two threads, 32 rows 13.7 -> ~11.8 ms, 64-256 rows ~150 -> 179-190 GFLOP/s.
    """
    return _map_projections(params, pack_weight)


def weight_bytes(params: Params) -> int:
    """Bytes of every array in ``params`` (codes and scales of quantized projections included)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))


# Row counts for which x @ W.T runs as a fused multiply-reduce instead of a dot (see _matmul_t), on CPU.
MULREDUCE_ROWS = (2, 64)


def _mulreduce(rows: int) -> bool:
    """Whether ``rows`` rows take the multiply-reduce: only on XLA:CPU. On an accelerator it would read the
    whole weight once per row (a reduction kernel, not a GEMM); there every projection is a dot."""
    return jax.default_backend() == "cpu" and MULREDUCE_ROWS[0] <= rows <= MULREDUCE_ROWS[1]


def _matmul_t(x: Array, w_t: Array | QuantizedWeightT, out_dtype: Any) -> Array:
    """``x @ w_t.T`` for ``w_t`` stored ``[out, in]``, accumulated in float32.

    For a few rows (decode batches, short prefills) XLA:CPU's dot packs the
    whole weight matrix on every call, which costs more than the multiply
    itself; a broadcast multiply-reduce over the shared minor axis reads each
    weight row in place. Laid out ``[rows, out, in]`` (output already
    ``[rows, out]``, no transpose) it beats the ``[out, rows, in]`` layout too.
    Measured on the bench model's chained projections (8 layers + head), one
    core, ms per step: 8 rows 19.4 dot / 15.7 [out, rows] / 13.8 [rows, out];
    32 rows 35.1 / 30.3 / 25.0; 64 rows 49.0 / 49.3 / 43.1; at 128 rows the
    dot catches up and past that it wins; one row stays a dot (a
    matrix-vector product XLA does well).

    A quantized ``w_t`` goes to :func:`_quantized_matmul_t`; a float one
    compiles exactly as it did before weights could be quantized.
    """
    if isinstance(w_t, QuantizedWeightT):
        return _quantized_matmul_t(x, w_t, out_dtype)
    rows = math.prod(x.shape[:-1])
    if isinstance(w_t, PackedWeightT):
        from inference.kernels.cpu_ffi import matmul_packed_cpu

        y = matmul_packed_cpu(x.reshape(rows, x.shape[-1]), w_t.panels, w_t.n)
        return y.reshape(*x.shape[:-1], w_t.n).astype(out_dtype)
    if not _mulreduce(rows):
        return jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    y = (w_t.astype(jnp.float32)[None, :, :] * x2[:, None, :]).sum(-1)  # [rows, out]
    return y.reshape(*x.shape[:-1], w_t.shape[0]).astype(out_dtype)


def _quantized_matmul_t(x: Array, w: QuantizedWeightT, out_dtype: Any) -> Array:
    """``x @ (codes * scale[:, None]).T`` as ``(x @ codes.T) * scale``: the codes are converted in the matmul.

    Up to 64 rows: the fused multiply-reduce of :func:`_matmul_t` with the
    code-to-float32 convert inside the fusion, so a step reads the 1-byte
    codes and no float copy of the weight exists (checked on the compiled
    HLO: no ``f32[out, in]`` array outside a fusion); the scale multiplies
    the ``[rows, out]`` result. One row runs as two (the row repeated):
    XLA:CPU emits a one-row reduce of a converted operand as scalar code,
    ~13x slower, and a dot would convert the whole weight to a float copy
    first (bench-model projections, one row, at load ~8: dot on converted
    codes 123 ms, one-row reduce 100-150 ms, two-row reduce 7.7 ms, float
    dot 10 ms). Past 64 rows: a dot against the converted codes (a float
    copy of the weight per call, small next to a prefill's multiply), then
    the scale. These are XLA:CPU's trade-offs; on an accelerator every call
    is the dot on converted codes, which XLA fuses into the GEMM's operand.
    """
    rows = math.prod(x.shape[:-1])
    if rows > MULREDUCE_ROWS[1] or jax.default_backend() != "cpu":
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        y = jax.lax.dot_general(x, w.codes.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * w.scale).astype(out_dtype)
    x2 = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
    if rows == 1:
        x2 = jnp.concatenate([x2, x2])
    y = (w.codes.astype(jnp.float32)[None, :, :] * x2[:, None, :]).sum(-1)[:rows] * w.scale  # [rows, out]
    return y.reshape(*x.shape[:-1], w.codes.shape[0]).astype(out_dtype)


def _linear(x: Array, p: dict[str, Array], name: str) -> Array:
    """``x @ W`` for ``p[name]`` stored ``[in, out]`` or ``p[name + "_t"]`` stored ``[out, in]``."""
    w = p.get(name)
    if w is not None:
        return x @ w
    return _matmul_t(x, p[name + "_t"], x.dtype)


def _packed(p: dict[str, Any], name: str) -> PackedWeightT | None:
    w = p.get(name + "_t")
    return w if isinstance(w, PackedWeightT) else None


def _norm_linear(x: Array, norm: Array, eps: float, p: dict[str, Any], name: str,
                 live: Array | None) -> Array:
    """``_linear(_rms_norm(x, norm, eps), p, name)``. A packed weight norms each row inside the native
    matmul as it packs x (``cpu_matmul.cc``), so XLA runs no reduce and no scale of its own, and
    multiplies only the ``live`` rows (per group of rows, how many lead ones are real: see
    :func:`inference.kernels.cpu_ffi.matmul_packed_cpu`)."""
    w = _packed(p, name)
    if w is None:
        return _linear(_rms_norm(x, norm, eps), p, name)
    from inference.kernels.cpu_ffi import matmul_packed_cpu

    y = matmul_packed_cpu(x.reshape(-1, x.shape[-1]), w.panels, w.n, live=live, norm=norm, eps=eps)
    return y.reshape(*x.shape[:-1], w.n).astype(x.dtype)


def _residual_linear(res: Array, x: Array, p: dict[str, Any], name: str, live: Array | None, *,
                     swiglu: bool = False) -> Array:
    """``res + _linear(x, p, name)``; with ``swiglu``, ``x`` is gate | up and ``silu(gate) * up`` is
    multiplied. A packed weight does both inside the native matmul (the SwiGLU as it packs x, the add as
    it stores y), for the ``live`` rows only."""
    w = _packed(p, name)
    if w is None:
        if swiglu:
            gate, up = jnp.split(x, 2, axis=-1)
            x = jax.nn.silu(gate) * up
        return res + _linear(x, p, name)
    from inference.kernels.cpu_ffi import matmul_packed_cpu

    y = matmul_packed_cpu(x.reshape(-1, x.shape[-1]), w.panels, w.n, live=live, residual=res.reshape(-1, w.n),
                          swiglu=swiglu)
    return y.reshape(res.shape).astype(res.dtype)


def _write_cache(cache: LayerKV, slots: Array, new: Array) -> LayerKV:
    """Write ``new`` [..., KV, D] at flat ``slots`` (``>= N*block_size``: dropped), in place.

    A quantized ``(codes, scales)`` layer goes through the quantizing write.

    Indexed as (block, offset) pairs, not through a flat ``[N*bs, KV, D]``
    view: with one row XLA turns the flat-view scatter into a
    dynamic-update-slice it duplicates per consumer, which copies every
    layer's whole cache on each batch-1 decode step (~600 ms on the bench
    model instead of ~10 ms).
    """
    if isinstance(cache, tuple):
        return write_quantized_kv_flat(*cache, new, slots)
    bs, kv, d = cache.shape[1:]
    flat = slots.reshape(-1)
    return cache.at[flat // bs, flat % bs].set(new.reshape(-1, kv, d), mode="drop")


def _gather_blocks(cache: LayerKV, block_tables: Array, dtype: Any) -> Array:
    """The blocks of each row's table, as ``[B, M*block_size, KV, D]`` (dequantized to ``dtype``)."""
    codes, scales = cache if isinstance(cache, tuple) else (cache, None)
    kv, d = codes.shape[2:]
    rows = gather_block_rows(codes, scales, block_tables)
    return rows.astype(dtype).reshape(block_tables.shape[0], -1, kv, d)


def _prefill_keys(prefill_fn: Any, q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array,
                  kv_lens: Array) -> tuple[Array, Array]:
    """Each row's keys and values ``[B, M*block_size, KV, D]`` for ``prefill_fn``, gathered from the cache
    (dequantized). Where the native CPU prefill kernel serves a float cache, only the blocks that hold
    a row's first ``kv_lens`` keys are copied (it reads no further); a whole table is ``max_model_len``
    keys, whatever the prompt's length."""
    if not isinstance(kc, tuple) and not isinstance(vc, tuple) and native_prefill_serves(prefill_fn, q, kc):
        from inference.kernels.cpu_ffi import gather_live_cpu

        return gather_live_cpu(kc, vc, block_tables, kv_lens)
    return _gather_blocks(kc, block_tables, q.dtype), _gather_blocks(vc, block_tables, q.dtype)


def _paged_attention(fn: Any, q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array, *lens: Array,
                     scale: float) -> Array:
    """A kernel over the paged cache (``fn(q, k, v, tables, *lens, scale=, k_scale=, v_scale=)``): a float
    cache, or codes with their scales (dequantized inside the kernel)."""
    if isinstance(kc, tuple) and isinstance(vc, tuple):
        return fn(q, kc[0], vc[0], block_tables, *lens, scale=scale, k_scale=kc[1], v_scale=vc[1])
    return fn(q, kc, vc, block_tables, *lens, scale=scale)


def _decode_attention(decode_fn: Any, q: Array, kc: LayerKV, vc: LayerKV, block_tables: Array,
                      context_lens: Array, scale: float) -> Array:
    """``decode_fn`` over a float cache, or over codes with their scales (dequantized inside the kernel)."""
    return _paged_attention(decode_fn, q, kc, vc, block_tables, context_lens, scale=scale)


def _mlp(x: Array, lp: dict[str, Array], cfg: LlamaConfig, live: Array | None = None) -> Array:
    gate_up = _norm_linear(x, lp["mlp_norm"], cfg.rms_norm_eps, lp, "w_gate_up", live)
    return _residual_linear(x, gate_up, lp, "w_down", live, swiglu=True)


def _qkv_projection(x: Array, lp: dict[str, Array], cfg: LlamaConfig, live: Array | None = None) -> Array:
    """A layer's fused q | k | v projection of its normed input."""
    return _norm_linear(x, lp["attn_norm"], cfg.rms_norm_eps, lp, "wqkv", live)


def _qkv(x: Array, lp: dict[str, Array], cfg: LlamaConfig, positions: Array,
         inv_freq: Array) -> tuple[Array, Array, Array]:
    hq, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = _qkv_projection(x, lp, cfg)
    lead = qkv.shape[:-1]
    q = qkv[..., : hq * d].reshape(*lead, hq, d)
    k = qkv[..., hq * d: (hq + kv) * d].reshape(*lead, kv, d)
    v = qkv[..., (hq + kv) * d:].reshape(*lead, kv, d)
    return _rope(q, positions, inv_freq), _rope(k, positions, inv_freq), v


# RoPE and the K/V cache write of a float32 layer on CPU run as one native call
# (inference/kernels/cpu_rope.cc) when the kernels build; False keeps the jnp rotation and scatters.
native_cpu_rope = True


def _native_rope(x: Array, cache: KVCache) -> bool:
    """Whether this call's layers go through :func:`_rope_write_native`: float32 activations and caches
    (not quantized) on CPU, kernels built."""
    if not native_cpu_rope or isinstance(cache[0][0], tuple):
        return False
    from inference.kernels import cpu_ffi  # lazy: builds (once) only when a CPU float32 call is traced

    return cpu_ffi.serves(x.dtype, cache[0][0].dtype)


def _rope_half_tables(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
    """cos and sin ``[rows, D/2]`` of every position (flattened) times the inverse frequencies."""
    freqs = positions.reshape(-1).astype(jnp.float32)[:, None] * inv_freq
    return jnp.cos(freqs), jnp.sin(freqs)


def _rope_write_native(x: Array, lp: dict[str, Array], cfg: LlamaConfig, tables: tuple[Array, Array],
                       slots: Array, kc: Array, vc: Array, live: Array | None) -> tuple[Array, Array, Array]:
    """:func:`_qkv` then :func:`_write_cache` of k and v, with the rotation and the writes in one native
    call. ``tables`` come from :func:`_rope_half_tables`, once per call: as a native call's operands XLA
    computes them once instead of per head element inside every layer's fused rotation."""
    from inference.kernels.cpu_ffi import rope_write_kv_cpu

    qkv = _qkv_projection(x, lp, cfg, live)
    lead = qkv.shape[:-1]
    q, kc, vc = rope_write_kv_cpu(qkv.reshape(-1, qkv.shape[-1]), *tables, slots.reshape(-1), kc, vc,
                                  heads=cfg.num_attention_heads)
    return q.reshape(*lead, cfg.num_attention_heads, cfg.head_dim).astype(x.dtype), kc, vc


def _attention_inputs(x: Array, lp: dict[str, Array], cfg: LlamaConfig, positions: Array, inv_freq: Array,
                      tables: tuple[Array, Array] | None, slots: Array, kc: LayerKV, vc: LayerKV,
                      live: Array | None) -> tuple[Array, LayerKV, LayerKV]:
    """One layer's rotated queries, and its caches with the new tokens' K/V written at ``slots``."""
    if tables is not None:
        assert not isinstance(kc, tuple) and not isinstance(vc, tuple)
        return _rope_write_native(x, lp, cfg, tables, slots, kc, vc, live)
    q, k, v = _qkv(x, lp, cfg, positions, inv_freq)
    return q, _write_cache(kc, slots, k), _write_cache(vc, slots, v)


def _logits(params: Params, x: Array, cfg: LlamaConfig, live: Array | None = None) -> Array:
    if _packed(params, "lm_head") is not None:
        return _norm_linear(x, params["norm"], cfg.rms_norm_eps, params, "lm_head", live).astype(jnp.float32)
    x = _rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if "lm_head" in params:
        return jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)
    head_t = params["lm_head_t"] if "lm_head_t" in params else params["embed"]  # [vocab, hidden]
    return _matmul_t(x, head_t, jnp.float32)


def prefill_forward(params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                    block_tables: Array, q_offsets: Array, kv_lens: Array, last_idx: Array, *,
                    cfg: LlamaConfig, attn: AttentionFns) -> tuple[Array, KVCache]:
    """Run new tokens [B,T] (positions q_offsets+t), write their K/V, return last-token logits [B,V]."""
    prefill_fn = attn[0]
    paged = getattr(prefill_fn, "paged", None)  # the Pallas backends' variant over the paged cache
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    b, t = tokens.shape
    scale = cfg.head_dim ** -0.5
    x = params["embed"][tokens]
    tables = _rope_half_tables(positions, inv_freq) if _native_rope(x, cache) else None
    live = kv_lens - q_offsets  # new tokens per row: the rest of its T are padding
    ks, vs = list(cache[0]), list(cache[1])
    for i, lp in enumerate(params["layers"]):
        q, ks[i], vs[i] = _attention_inputs(x, lp, cfg, positions, inv_freq, tables, slots, ks[i], vs[i],
                                            live)
        if paged is not None:  # a kernel that reads the paged cache itself: no gathered copy
            o = _paged_attention(paged, q, ks[i], vs[i], block_tables, q_offsets, kv_lens, scale=scale)
        else:
            kg, vg = _prefill_keys(prefill_fn, q, ks[i], vs[i], block_tables, kv_lens)
            o = prefill_fn(q, kg, vg, q_offsets, kv_lens, scale=scale)
        x = _residual_linear(x, o.reshape(b, t, -1), lp, "wo", live)
        x = _mlp(x, lp, cfg, live)
    last = x[jnp.arange(b), last_idx]
    return _logits(params, last, cfg), (tuple(ks), tuple(vs))


def decode_forward(params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                   block_tables: Array, context_lens: Array, *, cfg: LlamaConfig,
                   attn: AttentionFns) -> tuple[Array, KVCache]:
    """One token per sequence [B] at ``positions``; returns logits [B,V]."""
    decode_fn = attn[1]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    b = tokens.shape[0]
    scale = cfg.head_dim ** -0.5
    x = params["embed"][tokens]
    tables = _rope_half_tables(positions, inv_freq) if _native_rope(x, cache) else None
    live = (context_lens > 0).astype(jnp.int32)  # rows with no context are a bucket's padding
    ks, vs = list(cache[0]), list(cache[1])
    for i, lp in enumerate(params["layers"]):
        q, ks[i], vs[i] = _attention_inputs(x, lp, cfg, positions, inv_freq, tables, slots, ks[i], vs[i],
                                            live)
        o = _decode_attention(decode_fn, q, ks[i], vs[i], block_tables, context_lens, scale)
        x = _residual_linear(x, o.reshape(b, -1), lp, "wo", live)
        x = _mlp(x, lp, cfg, live)
    return _logits(params, x, cfg, live), (tuple(ks), tuple(vs))
