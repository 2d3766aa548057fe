"""KV-cache and weight-only quantization.

KV cache (``"int8"`` or ``"fp8"`` = float8 e4m3fn): the paged cache holds codes
``[num_blocks, block_size, KV, D]`` and one float32 scale per (block, KV head)
``[num_blocks, KV]``; a value is ``code * scale``. Tokens are quantized when
written (:func:`write_quantized_kv`) and dequantized inside the decode kernel.

How writing keeps per-block scales correct: a block is filled a few tokens at
a time, so a new token may be larger than anything the block's scale was
chosen for. The scale only grows (``max(old, kv_scale(amax(new)))``); when
it grows, the block's existing codes are re-encoded with ``old / new``, which
is exact when the scale is unchanged (and for fp8 always, see below) and
costs int8 at most one extra rounding per growth. A write to slot 0 starts a
fresh block (the allocator hands out blocks that are filled from slot 0; full
blocks shared by the prefix cache are never written), so a reused block does
not inherit a stale scale.

Scales: int8 maps a block's amax to 127 (``scale = amax / 127``). fp8 uses
the smallest power of two ``>= amax / 448`` (amax lands in (224, 448]), the
shared-exponent convention of the OCP MX formats: e4m3's relative precision
does not depend on where amax lands, and a growing scale then changes by a
power of two, so re-encoding a block's codes only shifts their exponents and
is exact (bar codes that fall into the subnormal range, |code| < 2**-6). With
``amax / 448`` scales every growth re-rounded the block's 3-bit mantissas;
on the random Llama of ``tests/inference/kernels/test_quant_quality.py``
that double rounding raised the median logits error by about 35%.

Weights: symmetric, round-to-nearest codes in int8 or fp8 with a float32
scale per output channel (``scale[out]``, amax of the column -> qmax), or,
with ``group_size=g``, per output channel and per group of ``g`` input rows
(``scale[in // g, out]``), the group-wise scheme of GPTQ/AWQ-style kernels:
a smaller group has a smaller amax, so a finer step. The matmul runs on the
codes converted to the activation dtype and scales the float32 output,
``x @ (codes * s) == (x @ codes) * s`` (per group: ``sum_g (x_g @ codes_g) *
s_g``), so no dequantized copy of the weight is materialised (XLA fuses the
convert into the dot's operand). Group scales cost ``4 / g`` bytes per weight
on top of the 1-byte code (6% at g = 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.reference import Array

__all__ = [
    "QuantKind",
    "QMAX",
    "code_dtype",
    "kv_scale",
    "init_quantized_cache",
    "quantize_blocks",
    "dequantize_blocks",
    "write_quantized_kv",
    "write_quantized_kv_flat",
    "gather_dequantized",
    "kv_read_bytes",
    "QuantizedWeight",
    "quantize_weight",
    "quantized_matmul",
    "QuantizedWeightT",
    "quantize_weight_t",
]

QuantKind = Literal["int8", "fp8"]
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
_TINY = 1e-12


def code_dtype(kind: str) -> jnp.dtype:
    """Storage dtype of a quantization kind."""
    if kind == "int8":
        return jnp.dtype(jnp.int8)
    if kind == "fp8":
        return jnp.dtype(jnp.float8_e4m3fn)
    raise ValueError(f"unknown quantization kind {kind!r}; expected 'int8' or 'fp8'")


def _encode(x: Array, kind: str) -> Array:
    qmax = QMAX[kind]
    if kind == "int8":
        return jnp.clip(jnp.round(x), -qmax, qmax).astype(jnp.int8)
    return jnp.clip(x, -qmax, qmax).astype(code_dtype(kind))


def kv_scale(amax: Array, kind: str) -> Array:
    """KV-cache scale for blocks whose largest magnitude is ``amax`` (0 where amax is 0).

    int8: ``amax / 127``. fp8: the smallest power of two ``>= amax / 448``, so
    that scale growth re-encodes codes exactly (see the module docstring).
    """
    s = jnp.asarray(amax, jnp.float32) / QMAX[kind]
    if kind == "int8":
        return s
    mant, exp = jnp.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
    return jnp.where(s > 0, jnp.ldexp(jnp.ones_like(s), exp - (mant == 0.5).astype(exp.dtype)), 0.0)


def _kind_of(codes: Array) -> str:
    if codes.dtype == jnp.int8:
        return "int8"
    if codes.dtype == jnp.float8_e4m3fn:
        return "fp8"
    raise ValueError(f"cache dtype {codes.dtype} is not a quantized KV dtype (int8, float8_e4m3fn)")


def init_quantized_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kind: str
) -> tuple[Array, Array]:
    """Zeroed codes ``[N,bs,KV,D]`` and scales ``[N,KV]`` for one of K or V."""
    codes = jnp.zeros((num_blocks, block_size, kv_heads, head_dim), code_dtype(kind))
    return codes, jnp.zeros((num_blocks, kv_heads), jnp.float32)


def quantize_blocks(cache: Array, kind: str) -> tuple[Array, Array]:
    """Quantize a whole float cache ``[N,bs,KV,D]`` -> (codes, scales[N,KV])."""
    x = cache.astype(jnp.float32)
    scales = kv_scale(jnp.max(jnp.abs(x), axis=(1, 3)), kind)
    safe = jnp.where(scales > 0, scales, 1.0)
    return _encode(x / safe[:, None, :, None], kind), scales


def dequantize_blocks(codes: Array, scales: Array) -> Array:
    """Codes ``[N,bs,KV,D]`` and scales ``[N,KV]`` -> float32 values."""
    return codes.astype(jnp.float32) * scales[:, None, :, None]


def write_quantized_kv(
    codes: Array,
    scales: Array,
    new: Array,
    block_ids: Array,
    slots: Array,
    valid: Array | None = None,
    *,
    as_bytes: bool = False,
) -> tuple[Array, Array]:
    """Quantize ``new[T,KV,D]`` into ``codes`` at ``(block_ids[t], slots[t])``.

    Returns the updated (codes, scales). ``valid[T]`` (bool) drops padding
    tokens. ``as_bytes`` scatters float8 codes as their uint8 bit patterns
    (XLA:CPU's way round its missing float8 scatter: the kernel set passes it
    on CPU). Pure function: jit it and donate the cache for in-place updates.
    """
    kind = _kind_of(codes)
    n = codes.shape[0]
    if new.ndim != 3 or new.shape[1:] != codes.shape[2:]:
        raise ValueError(f"new tokens {new.shape} do not match cache {codes.shape}")
    blk = block_ids.astype(jnp.int32)
    if valid is not None:
        blk = jnp.where(valid, blk, n)  # out of range: dropped by mode="drop"
    blk_c = jnp.minimum(blk, n - 1)
    x = new.astype(jnp.float32)
    amax = kv_scale(jnp.max(jnp.abs(x), axis=-1), kind)  # [T, KV]: the scale each token asks for
    fresh = jnp.zeros((n,), jnp.int32).at[blk].max((slots == 0).astype(jnp.int32), mode="drop")
    base = jnp.where(fresh[:, None] > 0, 0.0, scales)
    new_scales = base.at[blk].max(amax, mode="drop")
    old_s, new_s = base[blk_c], new_scales[blk_c]  # [T, KV]
    ratio = jnp.where(new_s > 0, old_s / jnp.maximum(new_s, _TINY), 0.0)
    rescaled = codes[blk_c].astype(jnp.float32) * ratio[:, None, :, None]  # [T,bs,KV,D]
    tok = _encode(x / jnp.maximum(new_s, _TINY)[:, :, None], kind)
    # fp8 on CPU (as_bytes): scatter the bytes. XLA:CPU has no float8 scatter: it converts the
    # whole cache to f16 and back around each one (a batch-32 write: 13.7 ms at 8192
    # blocks, int8 0.06 ms). Scattering a uint8 bitcast still copies the cache twice
    # (XLA:CPU materialises the bitcast) but converts nothing: 2.6 ms. int8 is
    # untouched (the bitcast would cost it 0.05 -> 0.21 ms at 512 blocks), and so is
    # the accelerator path, which was not measured here.
    raw_of = _bytes_of if as_bytes and codes.dtype != jnp.int8 else _same
    raw = raw_of(codes).at[blk].set(raw_of(_encode(rescaled, kind)), mode="drop")
    raw = raw.at[blk, slots.astype(jnp.int32)].set(raw_of(tok), mode="drop")
    return (raw if raw.dtype == codes.dtype else jax.lax.bitcast_convert_type(raw, codes.dtype)), new_scales


def _bytes_of(codes: Array) -> Array:
    return jax.lax.bitcast_convert_type(codes, jnp.uint8)


def _same(codes: Array) -> Array:
    return codes


def write_quantized_kv_flat(codes: Array, scales: Array, new: Array, slots: Array, *,
                            as_bytes: bool = False) -> tuple[Array, Array]:
    """:func:`write_quantized_kv` addressed like the model's float write.

    ``new`` is ``[..., KV, D]`` and ``slots`` the matching flat slot indices
    ``block * block_size + offset``; a slot ``>= num_blocks * block_size`` is
    padding and is dropped (the convention of :mod:`inference.kernels.paged_cache`).
    """
    n, bs = codes.shape[:2]
    flat = slots.reshape(-1).astype(jnp.int32)
    tokens = new.reshape(-1, *codes.shape[2:])
    return write_quantized_kv(codes, scales, tokens, flat // bs, flat % bs, valid=flat < n * bs, as_bytes=as_bytes)


def gather_dequantized(codes: Array, scales: Array, block_tables: Array, dtype: Any = jnp.float32) -> Array:
    """Pages of ``block_tables[B, M]`` as contiguous ``[B, M*bs, KV, D]`` values (for prefill)."""
    pages = codes[block_tables].astype(jnp.float32) * scales[block_tables][:, :, None, :, None]
    b, m, bs = pages.shape[:3]
    return pages.reshape(b, m * bs, *pages.shape[3:]).astype(dtype)


def kv_read_bytes(
    context_lens: np.ndarray | list[int],
    *,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: str | np.dtype,
    quantized: bool = False,
) -> int:
    """Bytes of K and V one decode step reads (whole pages, plus scales if any)."""
    pages = sum(-(-int(n) // block_size) for n in context_lens)
    itemsize = jnp.dtype(dtype).itemsize
    total = 2 * pages * block_size * kv_heads * head_dim * itemsize
    if quantized:
        total += 2 * pages * kv_heads * 4
    return total


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """Weight-only quantized matrix: ``codes[in, out]`` and ``scale[out]`` or ``scale[in // g, out]``.

    A 2-D scale means group-wise: rows ``[i * g, (i + 1) * g)`` of ``codes``
    share ``scale[i]``, with ``g = in // scale.shape[0]``. ``x @ w`` is the
    XLA matmul (:func:`quantized_matmul`); the Pallas kernel for it is the
    kernel set's ``matmul`` (:mod:`inference.kernels.kernel_set`).
    """

    codes: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def group_size(self) -> int | None:
        """Input rows per scale group, or None for one scale per output channel."""
        return None if self.scale.ndim == 1 else self.codes.shape[0] // self.scale.shape[0]

    def __rmatmul__(self, x: Array) -> Array:
        """``x @ w`` works unchanged in model code written for plain arrays."""
        return quantized_matmul(x, self)


def quantize_weight(w: Array, kind: str, *, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric quantization of ``w[in, out]`` (as used in ``x @ w``).

    One scale per output channel, or with ``group_size`` one per output
    channel and group of that many input rows (a power of two dividing ``in``).
    """
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [in, out], got shape {w.shape}")
    k, n = w.shape
    g = k if group_size is None else group_size
    if group_size is not None and (g < 1 or g & (g - 1) or k % g):
        raise ValueError(f"group_size {group_size} must be a power of two dividing the input dim {k}")
    x = jnp.asarray(w, jnp.float32).reshape(k // g, g, n)
    scale = jnp.max(jnp.abs(x), axis=1) / QMAX[kind]  # [groups, out]
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = _encode(x / safe[:, None, :], kind).reshape(k, n)
    return QuantizedWeight(codes, scale[0] if group_size is None else scale)


def quantized_matmul(x: Array, w: QuantizedWeight | Array) -> Array:
    """``x[..., in] @ w`` where ``w`` may be a :class:`QuantizedWeight` (XLA: the codes converted in the dot)."""
    if not isinstance(w, QuantizedWeight):
        return x @ w
    if w.scale.ndim == 1:
        y = jnp.matmul(x, w.codes.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scale).astype(x.dtype)
    groups, (k, n) = w.scale.shape[0], w.codes.shape
    xg = x.reshape(*x.shape[:-1], groups, k // groups)
    cg = w.codes.reshape(groups, k // groups, n).astype(x.dtype)
    y = jnp.einsum("...gi,gio->...go", xg, cg, preferred_element_type=jnp.float32)  # [..., groups, out]
    return jnp.sum(y * w.scale, axis=-2).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeightT:
    """A projection quantized in the serving layout: ``codes[out, in]`` and one ``scale[out]`` per row.

    The model runner stores projections ``[out, in]`` (see
    ``inference.model.llama.Llama.serving_params``) and multiplies them with
    the kernel set's ``linear`` (:mod:`inference.kernels.projections`), which
    converts the codes inside the multiply and scales the float32 output
    rows: ``x @ (codes * s[:, None]).T == (x @ codes.T) * s``. ``codes`` is
    the 1-byte array (int8 or float8_e4m3fn) that the compiled step reads.
    """

    codes: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size * self.codes.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)


def quantize_weight_t(w_t: Array | np.ndarray, kind: str) -> QuantizedWeightT:
    """Symmetric round-to-nearest codes of ``w_t[out, in]``, one scale per output row (amax -> qmax).

    The same codes as :func:`quantize_weight` of ``w_t.T``, transposed.
    """
    if w_t.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w_t.shape}")
    q = quantize_weight(jnp.asarray(w_t).T, kind)
    return QuantizedWeightT(q.codes.T, q.scale)
