"""The Llama architecture (HF ``LlamaForCausalLM``): its weights and its forward pass over the paged KV cache.

Parameters are a plain pytree (see :func:`param_shapes`), with the HF
projections transposed to ``[in, out]`` (or kept ``[out, in]`` under
``<name>_t`` keys, see :meth:`Llama.serving_params`) and fused: ``wqkv`` =
q|k|v and ``w_gate_up`` = gate|up, so each layer does three matmuls plus the
output projections. The forward functions accept either layout, per matrix.
The KV cache is :mod:`inference.kernels.paged_cache`'s. Every operation
whose implementation depends on where it runs (attention, RoPE with the K/V
write, the projections) is the :class:`~inference.kernels.kernel_set.KernelSet`'s;
this file is only the architecture.

RoPE follows the HF ``rotate_half`` convention (the layout HF checkpoints are
already stored in, so no permutation is applied), with Llama-3 frequency
scaling when configured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels import reference
from inference.kernels.kernel_set import KernelSet
from inference.kernels.paged_cache import KVCache, LayerKV
from inference.kernels.projections import linear, rms_norm
from inference.kernels.rope import rotate_half
from inference.model.config import LlamaConfig

__all__ = ["Llama", "Params", "param_shapes", "rope_inv_freq", "random_hf_tensors", "qkv_extras",
           "prefill_forward", "decode_forward", "mixed_forward", "prompt_forward"]

Array = jax.Array
Params = dict[str, Any]  # {"embed", "layers": [ {...}, ...], "norm", "lm_head"?}
Progress = Callable[[str, int, int, str], None]
_MATRICES = frozenset({"wqkv", "wo", "w_gate_up", "w_down", "lm_head"})


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


# -- weights -----------------------------------------------------------------------------------------------


def random_hf_tensors(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under HF Llama parameter names (normal(0, 0.02), unit norms)."""
    rng = np.random.default_rng(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "self_attn.q_proj.weight"] = w(cfg.num_attention_heads * d, h)
        out[p + "self_attn.k_proj.weight"] = w(cfg.num_key_value_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = w(cfg.num_key_value_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = w(h, cfg.num_attention_heads * d)
        out[p + "mlp.gate_proj.weight"] = w(i, h)
        out[p + "mlp.up_proj.weight"] = w(i, h)
        out[p + "mlp.down_proj.weight"] = w(h, i)
        out[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w(cfg.vocab_size, h)
    return out


def load_params(cfg: LlamaConfig, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None) -> Params:
    """HF tensors (``get(name)``) -> parameters in ``dtype``, projections ``[in, out]`` and fused.

    A tensor of the wrong shape is a ``ValueError`` naming it (``inference.weights`` reports it as a
    ``WeightsError``)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = get(name)
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(arr.shape)}")
        return arr

    def dev(arr: np.ndarray) -> Any:
        return jnp.asarray(np.asarray(arr, dtype=np.float32), dtype=dtype)

    def t(arr: np.ndarray) -> np.ndarray:
        return np.asarray(arr, np.float32).T

    layers = []
    total = cfg.num_hidden_layers + 1
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        q = take(p + "self_attn.q_proj.weight", (hq * d, h))
        k = take(p + "self_attn.k_proj.weight", (kv * d, h))
        v = take(p + "self_attn.v_proj.weight", (kv * d, h))
        gate = take(p + "mlp.gate_proj.weight", (i, h))
        up = take(p + "mlp.up_proj.weight", (i, h))
        layers.append({
            "attn_norm": dev(take(p + "input_layernorm.weight", (h,))),
            "wqkv": dev(np.concatenate([t(q), t(k), t(v)], axis=1)),
            "wo": dev(t(take(p + "self_attn.o_proj.weight", (h, hq * d)))),
            "mlp_norm": dev(take(p + "post_attention_layernorm.weight", (h,))),
            "w_gate_up": dev(np.concatenate([t(gate), t(up)], axis=1)),
            "w_down": dev(t(take(p + "mlp.down_proj.weight", (h, i)))),
        })
        if progress:
            progress("load", n + 1, total, f"layer {n + 1}/{cfg.num_hidden_layers}")
    params: Params = {
        "embed": dev(take("model.embed_tokens.weight", (cfg.vocab_size, h))),
        "layers": layers,
        "norm": dev(take("model.norm.weight", (h,))),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = dev(t(take("lm_head.weight", (cfg.vocab_size, h))))
    if progress:
        progress("load", total, total, "weights loaded")
    return params


def serving_params(params: Params) -> Params:
    """The same parameters with every projection stored ``[out, in]`` (key ``<name>_t``).

    XLA on CPU multiplies ``x[B, in]`` by an ``[out, in]`` matrix (contracting
    the minor axis of both) about 20-25% faster than by ``[in, out]`` at decode
    batch sizes (8-32 rows), and no slower for prefill; the runner keeps this
    layout, and the kernel set's ``pack`` and the quantizers start from it.
    """

    def tr(group: dict[str, Any]) -> dict[str, Any]:
        return {(k + "_t" if k in _MATRICES else k): (jnp.asarray(v.T) if k in _MATRICES else v)
                for k, v in group.items()}

    out = tr({k: v for k, v in params.items() if k != "layers"})
    out["layers"] = [tr(lp) for lp in params["layers"]]
    return out


def map_projections(params: Params, fn: Callable[[Any], Any]) -> Params:
    """Serving parameters with ``fn`` applied to every ``<name>_t`` projection; a tied head (no
    ``lm_head_t``) gets ``fn`` of the embedding table as its own ``lm_head_t``, the table itself kept."""
    def each(group: dict[str, Any]) -> dict[str, Any]:
        return {k: fn(v) if k.endswith("_t") and k[:-2] in _MATRICES else v for k, v in group.items()}

    out = each({k: v for k, v in params.items() if k != "layers"})
    if "lm_head_t" not in out and "lm_head" not in out:
        out["lm_head_t"] = fn(params["embed"])
    out["layers"] = [each(lp) for lp in params["layers"]]
    return out


# -- the forward pass --------------------------------------------------------------------------------------


def _linear(x: Array, p: dict[str, Any], name: str, ks: KernelSet) -> Array:
    """``x @ W`` for ``p[name]`` stored ``[in, out]`` or ``p[name + "_t"]`` stored ``[out, in]``."""
    w = p.get(name)
    if w is not None:
        return ks.matmul(x, w)
    return ks.linear(x, p[name + "_t"], x.dtype)


def _norm_linear(x: Array, norm: Array, eps: float, p: dict[str, Any], name: str, live: Array | None,
                 ks: KernelSet) -> Array:
    """``_linear(rms_norm(x, norm, eps), p, name)``, fused where the kernel set fuses it."""
    w = p.get(name)
    if w is not None:
        return ks.matmul(rms_norm(x, norm, eps), w)
    return ks.norm_linear(x, norm, eps, p[name + "_t"], live, x.dtype)


def _residual_linear(res: Array, x: Array, p: dict[str, Any], name: str, live: Array | None, ks: KernelSet, *,
                     swiglu: bool = False) -> Array:
    """``res + _linear(x, p, name)``; with ``swiglu``, ``x`` is gate | up and ``silu(gate) * up`` is multiplied."""
    w = p.get(name)
    if w is None:
        return ks.residual_linear(res, x, p[name + "_t"], live, swiglu=swiglu)
    if swiglu:
        gate, up = jnp.split(x, 2, axis=-1)
        x = jax.nn.silu(gate) * up
    return res + ks.matmul(x, w)


def _mlp(x: Array, lp: dict[str, Any], cfg: LlamaConfig, ks: KernelSet, live: Array | None) -> Array:
    gate_up = _norm_linear(x, lp["mlp_norm"], cfg.rms_norm_eps, lp, "w_gate_up", live, ks)
    return _residual_linear(x, gate_up, lp, "w_down", live, ks, swiglu=True)


def qkv_extras(qkv: Array, lp: dict[str, Any], cfg: LlamaConfig) -> Array:
    """What a variant adds to a layer's fused q|k|v projection, by the layer's parameters: a bias
    (``bqkv``: Qwen2), an RMSNorm over each query head and key head (``q_norm``, ``k_norm``: Qwen3)."""
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"].astype(qkv.dtype)
    if "q_norm" in lp:
        hq, kv, d, lead = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, qkv.shape[:-1]
        q = rms_norm(qkv[..., : hq * d].reshape(*lead, hq, d), lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(qkv[..., hq * d: (hq + kv) * d].reshape(*lead, kv, d), lp["k_norm"], cfg.rms_norm_eps)
        qkv = jnp.concatenate([q.reshape(*lead, -1), k.reshape(*lead, -1), qkv[..., (hq + kv) * d:]], axis=-1)
    return qkv


def _attention_inputs(x: Array, lp: dict[str, Any], cfg: LlamaConfig, ks: KernelSet, rope: Any, slots: Array,
                      kc: LayerKV, vc: LayerKV, live: Array | None) -> tuple[Array, LayerKV, LayerKV]:
    """One layer's rotated queries, and its caches with the new tokens' K/V written at ``slots``."""
    if ks.window != cfg.sliding_window:  # at trace time: a kernel set built for another window
        raise ValueError(f"the kernel set's attention has window {ks.window}, the model {cfg.sliding_window}")
    qkv = qkv_extras(_norm_linear(x, lp["attn_norm"], cfg.rms_norm_eps, lp, "wqkv", live, ks), lp, cfg)
    return ks.rope_write(qkv, rope, slots, kc, vc, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads)


def _logits(params: Params, x: Array, cfg: LlamaConfig, ks: KernelSet, live: Array | None = None) -> Array:
    if "lm_head" in params:  # [in, out]
        x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
        return jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)
    head_t = params["lm_head_t"] if "lm_head_t" in params else params["embed"]  # [vocab, hidden]
    return ks.norm_linear(x, params["norm"], cfg.rms_norm_eps, head_t, live, jnp.float32)


def _layers(params: Params, cache: KVCache, x: Array, rope: Any, slots: Array, live: Array | None,
            attend: Callable[[Array, LayerKV, LayerKV], Array], cfg: LlamaConfig,
            ks: KernelSet) -> tuple[Array, KVCache]:
    """Every layer over the rows of ``x [..., hidden]``: their K/V written at ``slots``, ``attend(q, k, v)``
    the attention of their queries ``[..., H, D]`` over the layer's caches."""
    kcs, vcs = list(cache[0]), list(cache[1])
    for i, lp in enumerate(params["layers"]):
        q, kcs[i], vcs[i] = _attention_inputs(x, lp, cfg, ks, rope, slots, kcs[i], vcs[i], live)
        o = attend(q, kcs[i], vcs[i])
        x = _residual_linear(x, o.reshape(*x.shape[:-1], -1), lp, "wo", live, ks)
        x = _mlp(x, lp, cfg, ks, live)
    return x, (tuple(kcs), tuple(vcs))


def prefill_forward(params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                    block_tables: Array, q_offsets: Array, kv_lens: Array, last_idx: Array, *,
                    cfg: LlamaConfig, kernels: KernelSet) -> tuple[Array, KVCache]:
    """Run new tokens [B,T] (positions q_offsets+t), write their K/V, return last-token logits [B,V]."""
    ks = kernels
    b = tokens.shape[0]
    scale = cfg.head_dim ** -0.5
    rope = ks.rope(positions, jnp.asarray(rope_inv_freq(cfg)))
    live = kv_lens - q_offsets  # new tokens per row: the rest of its T are padding

    def attend(q: Array, kc: LayerKV, vc: LayerKV) -> Array:
        return ks.prefill(q, kc, vc, block_tables, q_offsets, kv_lens, scale=scale)

    x, cache = _layers(params, cache, params["embed"][tokens], rope, slots, live, attend, cfg, ks)
    return _logits(params, x[jnp.arange(b), last_idx], cfg, ks), cache


def decode_forward(params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                   block_tables: Array, context_lens: Array, *, cfg: LlamaConfig,
                   kernels: KernelSet) -> tuple[Array, KVCache]:
    """One token per sequence [B] at ``positions``; returns logits [B,V]."""
    ks = kernels
    scale = cfg.head_dim ** -0.5
    rope = ks.rope(positions, jnp.asarray(rope_inv_freq(cfg)))
    live = (context_lens > 0).astype(jnp.int32)  # rows with no context are a bucket's padding

    def attend(q: Array, kc: LayerKV, vc: LayerKV) -> Array:
        return ks.decode(q, kc, vc, block_tables, context_lens, scale=scale)

    x, cache = _layers(params, cache, params["embed"][tokens], rope, slots, live, attend, cfg, ks)
    return _logits(params, x, cfg, ks, live), cache


def mixed_forward(params: Params, cache: KVCache, decode: tuple[Array, ...], prefill: tuple[Array, ...], *,
                  cfg: LlamaConfig, kernels: KernelSet) -> tuple[Array, KVCache]:
    """One decode token per row and prefill chunks, through the layers as one set of rows: logits
    ``[Bd + Bp, V]`` (the decode rows, then each prefill row's last token).

    ``decode`` is :func:`decode_forward`'s ``(tokens [Bd], positions, slots, block_tables,
    context_lens)``, ``prefill`` :func:`prefill_forward`'s ``(tokens [Bp, T], positions, slots,
    block_tables, q_offsets, kv_lens, last_idx)``. Why one pass: the projections, most of a step,
    read each weight once for both; a chunk of a long prompt then rides along with the decodes of
    the running streams (chunked prefill) for little more than the decode step's own cost.
    """
    ks = kernels
    d_tok, d_pos, d_slots, d_tables, d_lens = decode
    p_tok, p_pos, p_slots, p_tables, q_offsets, kv_lens, last_idx = prefill
    bd, (bp, t) = d_tok.shape[0], p_tok.shape
    scale = cfg.head_dim ** -0.5
    positions = jnp.concatenate([d_pos, p_pos.reshape(-1)])
    slots = jnp.concatenate([d_slots, p_slots.reshape(-1)])
    rope = ks.rope(positions, jnp.asarray(rope_inv_freq(cfg)))
    # one row per group: a decode row is live with a context, a chunk's row up to its length
    p_live = jnp.arange(t)[None, :] < (kv_lens - q_offsets)[:, None]
    live = jnp.concatenate([d_lens > 0, p_live.reshape(-1)]).astype(jnp.int32)

    def attend(q: Array, kc: LayerKV, vc: LayerKV) -> Array:
        o_d = ks.decode(q[:bd], kc, vc, d_tables, d_lens, scale=scale)
        o_p = ks.prefill(q[bd:].reshape(bp, t, *q.shape[1:]), kc, vc, p_tables, q_offsets, kv_lens, scale=scale)
        return jnp.concatenate([o_d, o_p.reshape(bp * t, *q.shape[1:])])

    x0 = params["embed"][jnp.concatenate([d_tok, p_tok.reshape(-1)])]
    x, cache = _layers(params, cache, x0, rope, slots, live, attend, cfg, ks)
    last = jnp.concatenate([x[:bd], x[bd:].reshape(bp, t, -1)[jnp.arange(bp), last_idx]])
    out_live = jnp.concatenate([live[:bd], (kv_lens > q_offsets).astype(jnp.int32)])
    return _logits(params, last, cfg, ks, out_live), cache


def prompt_forward(params: Params, tokens: Array, *, cfg: LlamaConfig, kernels: KernelSet) -> tuple[Array, Array]:
    """A prompt ``tokens [T]`` through every layer on its own, no KV cache (causal attention over
    itself): its final hidden states ``[T, hidden]`` (after the final norm, as HF's
    ``last_hidden_state``) and its logits ``[T, V]`` (float32). What embeddings and prompt logprobs
    read (#31); the same projections as the served steps, the reference attention."""
    ks = kernels
    t = tokens.shape[0]
    hq, kv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    positions = jnp.arange(t, dtype=jnp.int32)[None, :]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    zeros, lens = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    x = params["embed"][tokens]
    for lp in params["layers"]:
        qkv = qkv_extras(_norm_linear(x, lp["attn_norm"], eps, lp, "wqkv", None, ks), lp, cfg)
        q = rotate_half(qkv[:, : hq * d].reshape(1, t, hq, d), positions, inv_freq).astype(x.dtype)
        k = rotate_half(qkv[:, hq * d: (hq + kv) * d].reshape(1, t, kv, d), positions, inv_freq).astype(x.dtype)
        v = qkv[:, (hq + kv) * d:].reshape(1, t, kv, d)
        o = reference.prefill_attention(q, k, v, zeros, lens, scale=d ** -0.5, window=cfg.sliding_window)
        x = _residual_linear(x, o.reshape(t, -1).astype(x.dtype), lp, "wo", None, ks)
        x = _mlp(x, lp, cfg, ks, None)
    return rms_norm(x, params["norm"], eps).astype(jnp.float32), _logits(params, x, cfg, ks)


# -- calibration -------------------------------------------------------------------------------------------


def calibrate(params: Params, tokens: np.ndarray, quantize: Callable[[Any, Array], Any], cfg: LlamaConfig, *,
              head: bool = True) -> Params:
    """Serving parameters with each projection replaced by ``quantize(w_t, x)``, ``x`` its input on
    ``tokens [B, T]``, in the order the activations reach them, and the replaced projection is what
    they flow through to the next (GPTQ's sequential order: later layers are calibrated on the inputs
    they will see when served). Per layer: ``wqkv`` (input: the attention norm), ``wo`` (the
    attention output), ``w_gate_up`` (the MLP norm), ``w_down`` (``silu(gate) * up``); then the head
    (the final norm) unless ``head=False`` (a tied head gets its own ``lm_head_t``; the embedding
    table stays float).

    The same arithmetic on every platform (the reference attention, XLA's dots), so a model
    quantizes the same way wherever it is loaded."""
    b, t = tokens.shape
    eps, inv_freq = cfg.rms_norm_eps, jnp.asarray(rope_inv_freq(cfg))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zeros, lens = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
    hq, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def proj(x: Array, w_t: Any) -> Array:
        return linear(x, w_t, x.dtype, mulreduce=False)

    x = params["embed"][jnp.asarray(tokens)]
    layers = []
    for lp in params["layers"]:
        h = rms_norm(x, lp["attn_norm"], eps)
        lp = {**lp, "wqkv_t": quantize(lp["wqkv_t"], h)}
        qkv = qkv_extras(proj(h, lp["wqkv_t"]), lp, cfg)
        q = rotate_half(qkv[..., : hq * d].reshape(b, t, hq, d), positions, inv_freq)
        k = rotate_half(qkv[..., hq * d: (hq + kv) * d].reshape(b, t, kv, d), positions, inv_freq)
        v = qkv[..., (hq + kv) * d:].reshape(b, t, kv, d)
        o = reference.prefill_attention(q, k, v, zeros, lens, scale=d ** -0.5, window=cfg.sliding_window)
        o = o.reshape(b, t, -1)
        lp["wo_t"] = quantize(lp["wo_t"], o)
        x = x + proj(o, lp["wo_t"])
        h = rms_norm(x, lp["mlp_norm"], eps)
        lp["w_gate_up_t"] = quantize(lp["w_gate_up_t"], h)
        gate, up = jnp.split(proj(h, lp["w_gate_up_t"]), 2, axis=-1)
        a = jax.nn.silu(gate) * up
        lp["w_down_t"] = quantize(lp["w_down_t"], a)
        x = x + proj(a, lp["w_down_t"])
        layers.append(lp)
    out = {**params, "layers": layers}
    if head:
        head_t = params["lm_head_t"] if "lm_head_t" in params else params["embed"]
        out["lm_head_t"] = quantize(head_t, rms_norm(x, params["norm"], eps))
    return out


# -- the registry entry ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Llama:
    """HF ``model_type`` "llama" (``LlamaForCausalLM``) as a :class:`~inference.model.registry.Model`."""

    model_type: ClassVar[str] = "llama"
    hf_architecture: ClassVar[str] = "LlamaForCausalLM"
    config: LlamaConfig

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Llama:
        return cls(LlamaConfig.from_hf(d))

    def hf_config(self) -> dict[str, Any]:
        return {**self.config.to_hf(), "architectures": [self.hf_architecture], "model_type": self.model_type}

    def random_hf_weights(self, seed: int) -> dict[str, np.ndarray]:
        return random_hf_tensors(self.config, seed)

    def load_params(self, get: Callable[[str], np.ndarray], dtype: Any, progress: Progress | None = None) -> Params:
        return load_params(self.config, get, dtype, progress)

    def serving_params(self, params: Params) -> Params:
        return serving_params(params)

    def map_projections(self, params: Params, fn: Callable[[Any], Any]) -> Params:
        return map_projections(params, fn)

    def prefill(self, params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
                block_tables: Array, q_offsets: Array, kv_lens: Array, last_idx: Array, *,
                kernels: KernelSet) -> tuple[Array, KVCache]:
        return prefill_forward(params, cache, tokens, positions, slots, block_tables, q_offsets, kv_lens, last_idx,
                               cfg=self.config, kernels=kernels)

    def decode(self, params: Params, cache: KVCache, tokens: Array, positions: Array, slots: Array,
               block_tables: Array, context_lens: Array, *, kernels: KernelSet) -> tuple[Array, KVCache]:
        return decode_forward(params, cache, tokens, positions, slots, block_tables, context_lens, cfg=self.config,
                              kernels=kernels)

    def mixed(self, params: Params, cache: KVCache, decode: tuple[Array, ...], prefill: tuple[Array, ...], *,
              kernels: KernelSet) -> tuple[Array, KVCache]:
        return mixed_forward(params, cache, decode, prefill, cfg=self.config, kernels=kernels)

    def prompt(self, params: Params, tokens: Array, *, kernels: KernelSet) -> tuple[Array, Array]:
        return prompt_forward(params, tokens, cfg=self.config, kernels=kernels)

    def calibrate(self, params: Params, tokens: np.ndarray, quantize: Callable[[Any, Array], Any], *,
                  head: bool = True) -> Params:
        return calibrate(params, tokens, quantize, self.config, head=head)
