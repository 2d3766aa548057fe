"""Tensor parallelism: one worker's model over a mesh of its devices, with JAX's own SPMD.

How it works (Megatron's split, written with ``jax.sharding`` and ``jax.shard_map``): the mesh has
one axis, ``"tp"``, of ``tp`` devices. Each device holds ``heads / tp`` query heads and their KV
heads, and ``intermediate / tp`` MLP columns:

- the fused q|k|v projection and its bias (Qwen2) are split by output rows, reordered first so
  device ``s``'s rows are its own q | k | v heads (:func:`qkv_rows`); gate|up likewise
  (:func:`gate_up_rows`): these are column-parallel, no communication;
- ``wo`` and ``w_down`` are split by input columns (row-parallel): each device multiplies its
  part in float32 and one ``psum`` over the axis adds them (in place of the kernel set's ``residual_linear``);
- the paged KV cache is split by KV head, ``[N, bs, KV', D]`` sharded on ``KV'``: the KV heads
  when ``tp`` divides them, else (``tp`` a multiple of KV) each KV head repeated ``tp / KV``
  times, so every device has the one its query heads read (what vLLM does past ``tp = KV``);
- the embedding, norms and head are replicated (the logits come out whole on every device).

Int8/fp8 weights shard the same way: codes like the float matrix, a per-output-row scale with the
rows (column-parallel) or whole (row-parallel). A step is the architecture's own ``prefill``,
``decode`` or ``mixed`` with a local configuration (``heads / tp`` heads, ``KV' / tp`` KV heads),
run under ``shard_map`` (:class:`ShardedModel`), so the kernels (the native CPU ones, Pallas)
see one device's heads and XLA places the two all-reduces per layer. Across hosts the mesh is
``jax.devices()`` after ``jax.distributed.initialize`` (one worker process per host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from inference.kernels.kernel_set import KernelSet, current_devices
from inference.kernels.paged_cache import KVCache
from inference.kernels.quant import QuantizedWeightT
from inference.model.registry import Model

__all__ = ["AXIS", "Layout", "make_mesh", "qkv_rows", "gate_up_rows", "reorder", "param_specs", "shard_params", "place", "cache_specs",
           "ShardedModel"]

AXIS = "tp"
Array = jax.Array
Params = dict[str, Any]
_ROWS = ("wqkv_t", "w_gate_up_t")  # column-parallel: split by output rows
_COLS = ("wo_t", "w_down_t")  # row-parallel: split by input columns, then one psum


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model's heads and MLP columns fall on ``tp`` devices."""

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, config: Any, tp: int) -> Layout:
        out = cls(tp, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                  config.intermediate_size)
        problem = out.problem()
        if problem:
            raise ValueError(problem)
        return out

    def problem(self) -> str:
        """Why this model cannot split ``tp`` ways ("" if it can)."""
        if self.tp < 1:
            return f"tensor parallelism must be >= 1, got {self.tp}"
        if self.heads % self.tp or self.intermediate % self.tp:
            return (f"{self.heads} attention heads and {self.intermediate} MLP columns must both divide by "
                    f"tensor_parallel={self.tp}")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:
            return f"{self.kv_heads} KV heads and tensor_parallel={self.tp}: one must divide the other"
        return ""

    @property
    def kv_repeat(self) -> int:
        """Copies of each KV head the cache holds (1 unless ``tp`` exceeds the KV heads)."""
        return max(1, self.tp // self.kv_heads)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads of the sharded cache's global shape."""
        return self.kv_heads * self.kv_repeat

    def local(self, config: Any) -> Any:
        """``config`` as one device sees it: its share of the query and KV heads."""
        return dataclasses.replace(config, num_attention_heads=self.heads // self.tp,
                                   num_key_value_heads=self.cache_kv_heads // self.tp,
                                   intermediate_size=self.intermediate // self.tp)


def make_mesh(tp: int, pool: Sequence[Any] | None = None) -> Mesh:
    """A one-axis mesh of the first ``tp`` devices of ``pool`` (default: every process's, after
    ``jax.distributed``)."""
    devs = list(pool if pool is not None else current_devices())
    if tp > len(devs):
        raise ValueError(f"tensor_parallel={tp} needs {tp} devices, {len(devs)} present")
    return Mesh(np.array(devs[:tp]), (AXIS,))


def qkv_rows(lay: Layout) -> np.ndarray:
    """Rows of the fused q|k|v output, reordered (and KV rows repeated) so that device ``s``'s
    contiguous share is its q heads, then its KV heads' k, then their v."""
    d, h, kv = lay.head_dim, lay.heads, lay.kv_heads
    hs, ks = h // lay.tp, lay.cache_kv_heads // lay.tp
    rows: list[np.ndarray] = []
    for s in range(lay.tp):
        kv_of = [(s * ks + j) // lay.kv_repeat for j in range(ks)]  # global KV heads of this device
        rows.append(np.arange(s * hs * d, (s + 1) * hs * d))
        rows += [h * d + k * d + np.arange(d) for k in kv_of]
        rows += [(h + kv) * d + k * d + np.arange(d) for k in kv_of]
    return np.concatenate(rows)


def gate_up_rows(lay: Layout) -> np.ndarray:
    """Rows of the fused gate|up output reordered so device ``s``'s share is its gate rows, then its up rows."""
    i, c = lay.intermediate, lay.intermediate // lay.tp
    return np.concatenate([np.r_[s * c:(s + 1) * c, i + s * c:i + (s + 1) * c] for s in range(lay.tp)])


def _take_rows(w: Any, rows: np.ndarray) -> Any:
    if isinstance(w, QuantizedWeightT):
        return QuantizedWeightT(w.codes[rows], w.scale[rows])
    if not hasattr(w, "ndim"):
        raise ValueError(f"tensor parallelism shards float or quantized projections, not {type(w).__name__}")
    return w[rows]


def _spec(path: tuple[Any, ...], leaf: Any) -> P:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    name = next((k for k in reversed(keys) if isinstance(k, str) and (k in _ROWS + _COLS or k == "bqkv")), None)
    scale = keys[-1] == "scale"
    if name in _ROWS or name == "bqkv":
        return P(AXIS) if scale or len(leaf.shape) == 1 else P(AXIS, None)
    if name in _COLS:
        return P() if scale else P(None, AXIS)
    return P()


def reorder(params: Params, lay: Layout) -> tuple[Params, Any]:
    """Serving parameters with the split projections' rows in device order (:func:`qkv_rows`,
    :func:`gate_up_rows`), and the PartitionSpec of every array (traceable: ``jax.eval_shape`` gives the
    abstract parameters a mesh step lowers with)."""
    rows = {"wqkv_t": qkv_rows(lay), "bqkv": qkv_rows(lay), "w_gate_up_t": gate_up_rows(lay)}
    layers = [{k: _take_rows(v, rows[k]) if k in rows else v for k, v in lp.items()} for lp in params["layers"]]
    params = {**params, "layers": layers}
    return params, param_specs(params)


def param_specs(params: Params) -> Any:
    """Each parameter's PartitionSpec over the ``"tp"`` axis (arrays or their abstract shapes)."""
    return jax.tree_util.tree_map_with_path(_spec, params)


def shard_params(params: Params, lay: Layout, mesh: Mesh) -> tuple[Params, Any]:
    """Serving parameters reordered for ``lay`` and placed on ``mesh``; and their PartitionSpecs."""
    params, specs = reorder(params, lay)
    return place(params, specs, mesh), specs


def place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``tree``'s arrays as global arrays on ``mesh`` split as ``specs`` says; each process fills the shards
    of its own devices from its copy (every process loads the same values), so it works across hosts."""
    def one(a: Any, spec: P) -> Array:
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])

    return jax.tree.map(one, tree, specs)


def cache_specs(cache: KVCache) -> Any:
    """Each layer's cache split by KV head: ``[N, bs, KV', D]`` on axis 2, a quantized one's scales ``[N, KV']`` on 1."""
    def layer(c: Any) -> Any:
        return (P(None, None, AXIS, None), P(None, AXIS)) if isinstance(c, tuple) else P(None, None, AXIS, None)

    return tuple(layer(c) for c in cache[0]), tuple(layer(c) for c in cache[1])


def _psum_residual(linear: Callable[..., Array]) -> Callable[..., Array]:
    """A row-parallel ``residual_linear``: each device's partial product in float32, summed over the mesh,
    then rounded and added to ``res`` -- one rounding, as the one-device matmul's float32 accumulator
    has (a bfloat16 partial rounded before the sum flips greedy tokens a one-device run would not)."""
    def call(res: Array, x: Array, w_t: Any, live: Array | None, *, swiglu: bool = False) -> Array:
        if swiglu:
            gate, up = jnp.split(x, 2, axis=-1)
            x = jax.nn.silu(gate) * up
        return res + jax.lax.psum(linear(x, w_t, jnp.float32), AXIS).astype(res.dtype)

    return call


@dataclass(frozen=True)
class ShardedModel:
    """A registry model's steps run on every device of ``mesh`` with its local configuration
    (:meth:`Layout.local`): same signatures as :class:`~inference.model.registry.Model`'s steps, the
    parameters and cache sharded as :func:`shard_params` and :func:`cache_specs` say."""

    local: Model
    mesh: Mesh
    param_specs: Any
    cache_specs: Any

    @classmethod
    def of(cls, model: Model, lay: Layout, mesh: Mesh, param_specs: Any, cache: KVCache) -> ShardedModel:
        local = dataclasses.replace(model, config=lay.local(model.config))  # type: ignore[type-var]
        return cls(local, mesh, param_specs, cache_specs(cache))

    def _run(self, step: Callable[..., Any], kernels: KernelSet, params: Params, cache: KVCache, *args: Any) -> Any:
        ks = dataclasses.replace(kernels, residual_linear=_psum_residual(kernels.linear))
        fn = jax.shard_map(partial(step, kernels=ks), mesh=self.mesh, check_vma=False,
                           in_specs=(self.param_specs, self.cache_specs, *(P(),) * len(args)),
                           out_specs=(P(), self.cache_specs))
        return fn(params, cache, *args)

    def prefill(self, params: Params, cache: KVCache, *args: Array, kernels: KernelSet) -> tuple[Array, KVCache]:
        return self._run(self.local.prefill, kernels, params, cache, *args)  # type: ignore[no-any-return]

    def decode(self, params: Params, cache: KVCache, *args: Array, kernels: KernelSet) -> tuple[Array, KVCache]:
        return self._run(self.local.decode, kernels, params, cache, *args)  # type: ignore[no-any-return]

    def mixed(self, params: Params, cache: KVCache, decode: tuple[Array, ...], prefill: tuple[Array, ...], *,
              kernels: KernelSet) -> tuple[Array, KVCache]:
        return self._run(self.local.mixed, kernels, params, cache, decode, prefill)  # type: ignore[no-any-return]
