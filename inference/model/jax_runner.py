"""``JaxRunner``: executes the scheduler's :class:`~inference.runner.StepPlan` on a JAX model.

How it works: each step, prefills are grouped into (batch, tokens) buckets
and decodes into batch buckets (:mod:`inference.model.buckets`); every group
is one jitted call of the model's ``prefill`` or ``decode`` (any architecture
of :mod:`inference.model.registry`, with the worker's one
:class:`~inference.kernels.kernel_set.KernelSet`) that writes the new K/V into
the paged cache (donated, so it is updated in place), computes last-position
logits and samples on device (a decode group samples inside the same
executable; a prefill group's logits go through a second, shared sampling
executable). All calls of a step are dispatched before the results are
fetched, so host work overlaps device work. Each new shape compiles once and
is logged; :meth:`JaxRunner.warmup` compiles them all up front with progress.

``attention`` picks the kernel set (:mod:`inference.kernels.kernel_set`:
``auto`` is Pallas on GPU and TPU, the native kernels on CPU); a set built
elsewhere can be passed instead (``kernels=``: the tests' interpreted Pallas).

``kv_cache_dtype="int8"|"fp8"`` keeps the KV cache quantized (codes plus
per-block, per-head scales; :mod:`inference.kernels.quant`): a quarter of the
float32 cache's bytes, so about 4x the tokens in the same memory. ``"auto"``
is the model dtype.

``weight_dtype="int8"|"fp8"`` stores every projection (attention, MLP and the
head, a tied one included; not the embedding lookup table) as 1-byte codes
``[out, in]`` with a float32 scale per output channel, dequantized inside the
matmul (``model.map_projections`` with ``quantize_weight_t``). ``"auto"`` keeps
the model dtype, laid out as the kernel set reads it best (``pack``).
``weight_quant_method="gptq"`` picks the codes with GPTQ instead of rounding
to nearest (same storage; :mod:`inference.model.calibrate`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from inference.kernels.kernel_set import KernelSet, build_kernels
from inference.kernels.paged_cache import KVCache, init_kv_cache, kv_bytes_per_token
from inference.kernels.quant import quantize_weight_t
from inference.model.buckets import Buckets
from inference.model.prompt_pass import PromptPass
from inference.model.registry import Model
from inference.model.tensor_parallel import Layout, ShardedModel, make_mesh, place, shard_params
from inference.penalties import AdjustBatch
from inference.runner import SeqFault, SeqOutput, SeqWork, StepPlan
from inference.sampling import (
    ADJUST_DTYPES,
    MAX_TOP_LOGPROBS,
    SamplingBatch,
    sample,
    sample_adjusted,
    sample_masked,
    sample_masked_adjusted,
)
from inference.tasks import PromptPassUnavailable, PromptResult
from inference.weights import LoadedModel, load_model
from transport.common import worker_options as options

__all__ = ["JaxRunner", "DTYPES", "KV_CACHE_DTYPES", "WEIGHT_DTYPES", "WEIGHT_QUANT_METHODS", "weight_bytes"]

log = logging.getLogger("inference.model")
Progress = Callable[[str, int, int, str], None]
Key = tuple[str, int, int]  # (kind, batch, tokens)
Params = dict[str, Any]
# The choices and defaults are the worker options' (transport.common.worker_options: one source for the
# `quicserve worker` flags, the gateway's [workers] settings, the engine and this runner).
KV_CACHE_DTYPES = options.KV_CACHE_DTYPES  # "auto": the model dtype
WEIGHT_DTYPES = options.WEIGHT_DTYPES  # "auto": the model dtype
WEIGHT_QUANT_METHODS = options.WEIGHT_QUANT_METHODS  # GPTQ: calibrated on random tokens (model/calibrate.py)
DTYPES = {name: getattr(jnp, name) for name in options.DTYPES}  # "float32", "bfloat16"
_D = options.WorkerOptions()


def weight_bytes(params: Params) -> int:
    """Bytes of every array in ``params`` (codes and scales of quantized projections included)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))


def _prefill_step(params: Params, cache: KVCache, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                  block_tables: jax.Array, q_offsets: jax.Array, kv_lens: jax.Array, last_idx: jax.Array,
                  *, model: Model, kernels: KernelSet, rows: int) -> Any:
    logits, cache = model.prefill(params, cache, tokens, positions, slots, block_tables, q_offsets, kv_lens,
                                  last_idx, kernels=kernels)
    return _pad_rows(logits, rows), cache


def _decode_step(params: Params, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                 block_tables: jax.Array, valid: jax.Array, *, model: Model, kernels: KernelSet,
                 block_size: int) -> Any:
    """One decode step's logits [B, V] and cache.

    Each valid row runs its last token at ``positions`` (the K/V slot looked up in its block
    table on device); invalid rows, the bucket's padding, write nothing and read no context.
    """
    slots, lens = _decode_slots(cache, positions, block_tables, valid, block_size)
    return model.decode(params, cache, tokens, positions, slots, block_tables, lens, kernels=kernels)


def _decode_slots(cache: KVCache, positions: jax.Array, block_tables: jax.Array, valid: jax.Array,
                  block_size: int) -> tuple[jax.Array, jax.Array]:
    """Decode rows' K/V slots, looked up in their tables on device, and context lengths (padding: none)."""
    oob = jax.tree.leaves(cache)[0].shape[0] * block_size
    blk = jnp.take_along_axis(block_tables, (positions // block_size)[:, None], axis=1, mode="clip")[:, 0]
    return jnp.where(valid, blk * block_size + positions % block_size, oob), jnp.where(valid, positions + 1, 0)


def _mixed_step(params: Params, cache: KVCache, tokens: jax.Array, positions: jax.Array, block_tables: jax.Array,
                valid: jax.Array, *rest: jax.Array, model: Model, kernels: KernelSet, block_size: int) -> Any:
    """Decode rows and prefill chunks in one pass (``Model.mixed``): logits ``[Bd + Bp, V]``, or with the
    sampler's arrays after the chunk's seven (``rest``), the sampler's outputs; and the cache."""
    slots, lens = _decode_slots(cache, positions, block_tables, valid, block_size)
    logits, cache = model.mixed(params, cache, (tokens, positions, slots, block_tables, lens), rest[:7],
                                kernels=kernels)
    return (tuple(sample(logits, *rest[7:])) if rest[7:] else logits), cache


def _decode_sample_step(params: Params, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                        block_tables: jax.Array, valid: jax.Array, *sampling: jax.Array, model: Model,
                        kernels: KernelSet, block_size: int) -> Any:
    """:func:`_decode_step` with sampling in the same executable: the sampler's outputs and the cache.

    Sampling inside the step instead of as a second call saves a dispatch and a pass over the
    logits in memory: on the decode bench's batch-32 run 3.45-3.48 -> 3.27-3.32 s (5%).
    """
    logits, cache = _decode_step(params, cache, tokens, positions, block_tables, valid, model=model,
                                 kernels=kernels, block_size=block_size)
    return tuple(sample(logits, *sampling)), cache


def _pad_rows(logits: jax.Array, rows: int) -> jax.Array:
    """Pad a prefill group's logits to the sampler's row count (one sampling shape for every group)."""
    return jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))


class JaxRunner:
    """A registry model behind the :class:`inference.runner.ModelRunner` protocol."""

    def __init__(self, loaded: LoadedModel, *, block_size: int = _D.block_size,
                 num_blocks: int = options.JAX_NUM_BLOCKS, max_batch: int = _D.max_batch,
                 max_model_len: int | None = None, attention: str = _D.attention,
                 max_prefill_batch: int = _D.max_prefill_batch, max_prefill_tokens: int = _D.max_prefill_tokens,
                 kv_cache_dtype: str = _D.kv_cache_dtype, weight_dtype: str = _D.weight_dtype,
                 weight_quant_method: str = _D.weight_quant_method, kernels: KernelSet | None = None,
                 step_tokens: int = _D.step_tokens, tensor_parallel: int = _D.tensor_parallel) -> None:
        if block_size < 1 or num_blocks < 1 or max_batch < 1:
            raise ValueError("block_size, num_blocks and max_batch must be >= 1")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        if weight_quant_method not in WEIGHT_QUANT_METHODS:
            raise ValueError(f"weight_quant_method must be one of {WEIGHT_QUANT_METHODS}, got {weight_quant_method!r}")
        self.model: Model = loaded.model
        cfg = self.model.config
        self.config = cfg
        self.served_name: str = loaded.name
        self.eos_token_ids: tuple[int, ...] = loaded.eos_token_ids
        self.block_size = block_size
        self.num_blocks = num_blocks
        limit = min(cfg.max_position_embeddings, num_blocks * block_size)
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in 1..{limit}, got {max_model_len}")
        self.max_model_len: int = max_model_len or limit
        self.buckets = Buckets(max_batch=max_batch, max_model_len=self.max_model_len,
                               max_prefill_batch=max_prefill_batch,
                               max_prefill_tokens=max(max_prefill_tokens, self.max_model_len),
                               max_chunk=step_tokens)
        self._max_blocks_per_seq = -(-self.max_model_len // block_size)
        dtype = loaded.params["embed"].dtype
        kv_quant = None if kv_cache_dtype == "auto" else kv_cache_dtype
        self.sliding_window: int | None = cfg.sliding_window  # the engine's KV cache frees blocks out of it
        if kernels is None:
            kernels = build_kernels(attention, dtype=dtype, kv_quant=kv_quant, window=cfg.sliding_window)
        elif (kernels.dtype, kernels.kv_quant, kernels.window) != (jnp.dtype(dtype).name, kv_quant,
                                                                   cfg.sliding_window):
            raise ValueError(f"kernels built for {kernels.dtype} with a {kernels.kv_quant or 'float'} KV cache, "
                             f"window {kernels.window}; this runner is {jnp.dtype(dtype).name} with "
                             f"{kv_quant or 'float'}, window {cfg.sliding_window}")
        self.kernels: KernelSet = kernels
        self._params = self.model.serving_params(loaded.params)
        self.weight_dtype = weight_dtype
        self.float_weight_bytes: int = weight_bytes(loaded.params)
        if weight_dtype != "auto" and weight_quant_method == "gptq":
            from inference.model.calibrate import quantize_projections_gptq

            self._params = quantize_projections_gptq(self.model, self._params, weight_dtype)
        elif weight_dtype != "auto":
            self._params = self.model.map_projections(self._params, partial(quantize_weight_t, kind=weight_dtype))
        elif kernels.pack is not None and tensor_parallel == 1:  # the native matmul's panels are one device's
            self._params = self.model.map_projections(self._params, kernels.pack)
        self.weight_bytes: int = weight_bytes(self._params)
        self.kv_cache_dtype = kv_cache_dtype
        lay = Layout.of(cfg, tensor_parallel)  # a model that cannot split this many ways: ValueError
        self.tensor_parallel = tensor_parallel
        shape = (cfg.num_hidden_layers, lay.cache_kv_heads, cfg.head_dim)
        self.kv_bytes_per_token: float = kv_bytes_per_token(*shape, block_size, dtype, kv_quant)
        self.float_kv_bytes_per_token: float = kv_bytes_per_token(*shape, block_size, dtype)
        self._cache: KVCache = init_kv_cache(*shape, num_blocks, block_size, dtype, kv_quant)
        self._step_model: Any = self.model  # what the steps call: the model, or it sharded over a mesh
        self._replicated: NamedSharding | None = None  # where a step's outputs live (None: one device)
        # Across processes (inference.model.multihost): the leader hands each plan to the followers first.
        self.broadcast: Callable[[StepPlan], None] | None = None
        if tensor_parallel > 1:
            mesh = make_mesh(tensor_parallel)
            self._params, specs = shard_params(self._params, lay, mesh)
            self._step_model = ShardedModel.of(self.model, lay, mesh, specs, self._cache)
            self._replicated = NamedSharding(mesh, PartitionSpec())
            self._cache = place(self._cache, self._step_model.cache_specs, mesh)
        sharded = tensor_parallel > 1
        spec = partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                    sharding=a.sharding if sharded else None))
        self._params_spec, self._cache_spec = spec(self._params), spec(self._cache)
        self._execs: dict[Key, Any] = {}  # shape key -> compiled executable
        self._lock = threading.Lock()
        self._guide_faults: dict[int, SeqFault] = {}  # this step's sequences whose grammar failed
        self.compile_seconds = 0.0
        self._prompt_pass = PromptPass(self.model, self._params, self.kernels, self.max_model_len)  # compiled on use

    @classmethod
    def load(cls, model: str = _D.model, *, dtype: str = _D.dtype, block_size: int = _D.block_size,
             num_blocks: int = options.JAX_NUM_BLOCKS, max_batch: int = _D.max_batch,
             max_model_len: int | None = None, attention: str = _D.attention, progress: Progress | None = None,
             max_prefill_batch: int = _D.max_prefill_batch, max_prefill_tokens: int = _D.max_prefill_tokens,
             kv_cache_dtype: str = _D.kv_cache_dtype, weight_dtype: str = _D.weight_dtype,
             weight_quant_method: str = _D.weight_quant_method, kernels: KernelSet | None = None,
             step_tokens: int = _D.step_tokens, tensor_parallel: int = _D.tensor_parallel) -> JaxRunner:
        """Load ``"tiny"`` or a local HF checkpoint directory and allocate the KV cache."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        loaded = load_model(model, dtype=DTYPES[dtype], progress=progress)
        return cls(loaded, block_size=block_size, num_blocks=num_blocks, max_batch=max_batch,
                   max_model_len=max_model_len, attention=attention, max_prefill_batch=max_prefill_batch,
                   max_prefill_tokens=max_prefill_tokens, kv_cache_dtype=kv_cache_dtype, weight_dtype=weight_dtype,
                   weight_quant_method=weight_quant_method, kernels=kernels, step_tokens=step_tokens,
                   tensor_parallel=tensor_parallel)

    @property
    def compile_count(self) -> int:
        """Shapes compiled so far (at most ``buckets.num_shapes``)."""
        return len(self._execs)

    def warmup(self, progress: Progress | None = None, *, threads: int | None = None) -> None:
        """Compile every shape bucket, several at a time (XLA compiles outside the GIL)."""
        keys: list[Key] = [("sample", s, 0) for s in self.buckets.sample_batches]
        keys += [("decode", b, 1) for b in self.buckets.decode_batches]
        keys += [("prefill", b, t) for b, t in self.buckets.prefill_shapes]
        keys += [("mixed", b, t) for b, t in self.buckets.mixed_shapes]
        keys = [k for k in keys if k not in self._execs]
        if progress:
            progress("compile", 0, len(keys), f"compiling {len(keys)} shapes")
        if threads is None:
            threads = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="compile") as pool:
            futures = {pool.submit(self._executable, k): k for k in keys}
            for i, fut in enumerate(as_completed(futures), 1):
                fut.result()
                if progress:
                    kind, b, t = futures[fut]
                    progress("compile", i, len(keys), f"{kind} batch={b} tokens={t}")

    # -- execution ---------------------------------------------------------

    def execute(self, plan: StepPlan) -> list[SeqOutput]:
        """Run prefills then decodes; one output per SeqWork, prefills first."""
        if self.broadcast is not None:
            self.broadcast(plan)
        self._guide_faults = {}
        pending = self._dispatch(plan, sample=True)
        # The top-n arrays come back only for groups where some row asked for them.
        fetched = jax.device_get([res if any(w.params.top_logprobs for _, w in rows) else res[:2]
                                  for rows, res in pending])
        by_seq: dict[int, SeqOutput] = {}
        for (rows, _), got in zip(pending, fetched, strict=True):
            tokens, lps = got[0].tolist(), got[1].tolist()
            for row, w in rows:
                n = w.params.top_logprobs
                out = SeqOutput(w.seq_id, tokens[row], lps[row])
                if n:
                    out.top_ids, out.top_logprobs = tuple(got[2][row, :n].tolist()), tuple(got[3][row, :n].tolist())
                by_seq[id(w)] = out
        if self._guide_faults:  # a grammar that failed at run time (out of fuel): that request ends
            for w in (*plan.prefills, *plan.decodes):
                if w.seq_id in self._guide_faults:
                    by_seq[id(w)] = SeqOutput(w.seq_id, 0, 0.0, fault=self._guide_faults[w.seq_id])
        return [by_seq[id(w)] for w in (*plan.prefills, *plan.decodes)]

    def prompt_pass(self, ids: Sequence[int], logprobs: bool) -> PromptResult:
        """The prompt through the model on its own (embeddings, echo's logprobs: inference.tasks)."""
        return self._prompt_pass.run(ids, logprobs)

    def prepare_prompt_pass(self, length: int, logprobs: bool) -> None:
        """Compile what :meth:`prompt_pass` needs for ``length`` tokens (any thread)."""
        if self.broadcast is not None:  # its followers would wait for a step that never comes
            raise PromptPassUnavailable("a model over several worker processes (multi-host) has no prompt pass yet")
        self._prompt_pass.compile(length, logprobs)

    def logits(self, plan: StepPlan) -> np.ndarray:
        """Like :meth:`execute` but return float32 logits [plan.size, vocab] instead of sampling.

        The K/V of the plan's tokens is written to the cache exactly as ``execute`` would.
        """
        pending = self._dispatch(plan, sample=False)
        by_seq: dict[int, np.ndarray] = {}
        for (rows, _), logits in zip(pending, jax.device_get([r for _, r in pending]), strict=True):
            for row, w in rows:
                by_seq[id(w)] = np.asarray(logits[row])
        return np.stack([by_seq[id(w)] for w in (*plan.prefills, *plan.decodes)])

    def _dispatch(self, plan: StepPlan, *, sample: bool) -> list[tuple[list[tuple[int, SeqWork]], Any]]:
        """Validate, group into buckets and launch every call of the step (results not fetched): per call,
        its (row of the result, work) pairs and its result."""
        for w in plan.prefills:
            self._check(w, decode=False)
        for w in plan.decodes:
            self._check(w, decode=True)
        pending: list[tuple[list[tuple[int, SeqWork]], Any]] = []
        prefills, decodes = list(plan.prefills), list(plan.decodes)
        for group in self.buckets.group_prefills([len(w.token_ids) for w in prefills]):
            works = [prefills[i] for i in group]
            b, t = self.buckets.prefill_shape(len(works), max(len(w.token_ids) for w in works))
            mixed = self.buckets.mixed_shape(len(decodes), b, t) if decodes else None
            if mixed and not any(_special(w) for w in (*decodes, *works)):
                # chunked prefill: the decodes ride in the first prefill group's pass
                d = self.buckets.decode_batches[-1]  # the mixed pass's decode rows, padding included
                rows = [*enumerate(decodes), *((d + i, w) for i, w in enumerate(works))]
                pending.append((rows, self._mixed(decodes, works, *mixed, sample=sample)))
                decodes = []
                continue
            logits = self._prefill_logits(works, b, t)
            pending.append((list(enumerate(works)), self._sample(logits, works, b) if sample else logits))
        step = self.buckets.max_batch
        for start in range(0, len(decodes), step):
            works = decodes[start:start + step]
            b = self.buckets.decode_batch(len(works))
            pending.append((list(enumerate(works)), self._decode(works, b, sample=sample)))
        return pending

    def _check(self, w: SeqWork, *, decode: bool) -> None:
        n = len(w.token_ids)
        if n == 0 or (decode and n != 1):
            raise ValueError(f"seq {w.seq_id}: {'decode needs exactly 1' if decode else 'prefill needs >= 1'} "
                             f"token, got {n}")
        end = w.start_pos + n
        if w.start_pos < 0 or end > self.max_model_len:
            raise ValueError(f"seq {w.seq_id}: positions {w.start_pos}..{end - 1} outside max_model_len "
                             f"{self.max_model_len}")
        if len(w.block_table) < -(-end // self.block_size):
            raise ValueError(f"seq {w.seq_id}: block table of {len(w.block_table)} blocks cannot hold {end} tokens")
        if min(w.block_table) < 0 or max(w.block_table) >= self.num_blocks:
            raise ValueError(f"seq {w.seq_id}: block id outside 0..{self.num_blocks - 1}")
        if min(w.token_ids) < 0 or max(w.token_ids) >= self.config.vocab_size:
            raise ValueError(f"seq {w.seq_id}: token id outside 0..{self.config.vocab_size - 1}")
        if not 0 <= w.params.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"seq {w.seq_id}: top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")

    def _tables(self, works: Sequence[SeqWork], b: int) -> np.ndarray:
        tables = np.zeros((b, self._max_blocks_per_seq), np.int32)
        for row, w in enumerate(works):
            bt = list(w.block_table)[: self._max_blocks_per_seq]
            tables[row, : len(bt)] = bt
        return tables

    def _sampling(self, works: Sequence[SeqWork], b: int) -> tuple[np.ndarray, ...]:
        return SamplingBatch.build(self._sampling_rows(works), b).arrays()

    @staticmethod
    def _sampling_rows(works: Sequence[SeqWork]) -> list[tuple[float, int, float, int, int, int]]:
        return [(w.params.temperature, w.params.top_k, w.params.top_p, w.seed, w.num_generated,
                 w.params.top_logprobs) for w in works]

    def _executable(self, key: Key) -> Any:
        """The compiled executable for a shape, compiling it (once, logged) if needed."""
        exe = self._execs.get(key)
        if exe is not None:
            return exe
        kind, b, t = key
        i32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        tables = i32((b, self._max_blocks_per_seq))
        t0 = time.perf_counter()
        if kind == "sample":
            lowered = jax.jit(sample).lower(jax.ShapeDtypeStruct((b, self.config.vocab_size), jnp.float32,
                                                                 sharding=self._replicated),
                                            *self._sampling_spec(b))
        elif kind == "sample_masked":  # structured output: compiled on first use, per row count
            lowered = jax.jit(sample_masked).lower(jax.ShapeDtypeStruct((b, self.config.vocab_size), jnp.float32,
                                                                        sharding=self._replicated),
                                                   i32((b, (self.config.vocab_size + 31) // 32)),
                                                   *self._sampling_spec(b))
        elif kind in ("sample_adjusted", "sample_masked_adjusted"):  # penalties etc.: per row count and width
            masked = kind == "sample_masked_adjusted"
            adjust = tuple(jax.ShapeDtypeStruct((b, t) if i < 4 else (b,), dt) for i, dt in enumerate(ADJUST_DTYPES))
            lowered = jax.jit(sample_masked_adjusted if masked else sample_adjusted).lower(
                jax.ShapeDtypeStruct((b, self.config.vocab_size), jnp.float32, sharding=self._replicated),
                *((i32((b, (self.config.vocab_size + 31) // 32)),) if masked else ()), *adjust, *self._sampling_spec(b))
        elif kind in ("mixed", "mixed_logits"):  # decodes padded to the largest decode bucket, a prefill group
            d = self.buckets.decode_batches[-1]
            fn = partial(_mixed_step, model=self._step_model, kernels=self.kernels, block_size=self.block_size)
            lowered = jax.jit(fn, donate_argnums=(1,)).lower(
                self._params_spec, self._cache_spec, i32((d,)), i32((d,)), i32((d, self._max_blocks_per_seq)),
                jax.ShapeDtypeStruct((d,), jnp.bool_), *self._prefill_spec(b, t),
                *(self._sampling_spec(d + b) if kind == "mixed" else ()))
        elif kind in ("decode", "decode_logits"):  # with sampling in the executable, or logits out
            sampled = kind == "decode"
            fn = partial(_decode_sample_step if sampled else _decode_step, model=self._step_model, kernels=self.kernels,
                         block_size=self.block_size)
            lowered = jax.jit(fn, donate_argnums=(1,)).lower(
                self._params_spec, self._cache_spec, i32((b,)), i32((b,)), tables, jax.ShapeDtypeStruct((b,), jnp.bool_),
                *(self._sampling_spec(b) if sampled else ()))
        else:
            fn = partial(_prefill_step, model=self._step_model, kernels=self.kernels, rows=self.buckets.sample_rows(b))
            lowered = jax.jit(fn, donate_argnums=(1,)).lower(self._params_spec, self._cache_spec,
                                                             *self._prefill_spec(b, t))
        exe = lowered.compile()
        dt = time.perf_counter() - t0
        with self._lock:
            exe = self._execs.setdefault(key, exe)
            self.compile_seconds += dt
            n = len(self._execs)
        log.info("compiled %s batch=%d tokens=%d in %.2fs (%d of %d shapes)", kind, b, t, dt, n,
                 self.buckets.num_shapes)
        return exe

    def _prefill_spec(self, b: int, t: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes of :meth:`_prefill_args` for a ``(b, t)`` bucket."""
        i32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        return (i32((b, t)), i32((b, t)), i32((b, t)), i32((b, self._max_blocks_per_seq)), i32((b,)), i32((b,)),
                i32((b,)))

    @staticmethod
    def _sampling_spec(b: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes of :meth:`SamplingBatch.arrays` for ``b`` rows."""
        dtypes = (jnp.float32, jnp.int32, jnp.float32, jnp.uint32, jnp.uint32, jnp.int32, jnp.bool_)
        return tuple(jax.ShapeDtypeStruct((b,), dt) for dt in dtypes)

    def _sample(self, logits: jax.Array, works: Sequence[SeqWork], b: int) -> Any:
        rows = self.buckets.sample_rows(b)
        if any(_special(w) for w in works):
            return self._sample_masked(logits, works, rows)
        return tuple(self._executable(("sample", rows, 0))(logits, *self._sampling(works, rows)))

    def _sample_masked(self, logits: jax.Array, works: Sequence[SeqWork], rows: int) -> Any:
        """Sample ``logits`` (already dispatched: the model runs while the masks are computed here)
        through the grammars of the rows that have one (inference.grammar) and the adjustments of the
        rows that have them (inference.penalties)."""
        sampling = self._sampling(works, rows)
        adjust = None
        if any(w.adjust is not None for w in works):
            adjust = AdjustBatch([(w.adjust, w.num_generated) for w in works], rows)
        if not any(w.guide is not None for w in works):
            assert adjust is not None
            exe = self._executable(("sample_adjusted", rows, adjust.width))
            return tuple(exe(logits, *adjust.arrays(), *sampling))
        from inference.grammar import fill_masks

        masks = np.full((rows, (self.config.vocab_size + 31) // 32), -1, np.int32)
        guided = [(w.guide, row) for row, w in enumerate(works) if w.guide is not None]
        for _, row in guided:
            masks[row] = 0
        fill_masks(guided, masks)  # type: ignore[arg-type]
        for guide, row in guided:
            if guide is not None and guide.error:
                self._guide_faults[works[row].seq_id] = SeqFault(f"structured output failed: {guide.error}")
        if adjust is not None:
            exe = self._executable(("sample_masked_adjusted", rows, adjust.width))
            return tuple(exe(logits, masks, *adjust.arrays(), *sampling))
        return tuple(self._executable(("sample_masked", rows, 0))(logits, masks, *sampling))

    def _prefill_logits(self, works: Sequence[SeqWork], b: int, t: int) -> Any:
        args = self._prefill_args(works, b, t)
        logits, self._cache = self._executable(("prefill", b, t))(self._params, self._cache, *args)
        return logits

    def _prefill_args(self, works: Sequence[SeqWork], b: int, t: int) -> tuple[np.ndarray, ...]:
        """A prefill group's host arrays, padded to the ``(b, t)`` bucket: tokens, positions, slots, tables,
        q_offsets, kv_lens, last_idx (each row's new tokens run at positions ``start_pos ..``)."""
        oob = self.num_blocks * self.block_size
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.full((b, t), oob, np.int32)
        q_off = np.zeros(b, np.int32)
        kv_lens = np.zeros(b, np.int32)
        last = np.zeros(b, np.int32)
        for row, w in enumerate(works):
            n = len(w.token_ids)
            pos = np.arange(w.start_pos, w.start_pos + n, dtype=np.int32)
            bt = np.asarray(w.block_table, np.int32)
            tokens[row, :n] = w.token_ids
            positions[row, :n] = pos
            slots[row, :n] = bt[pos // self.block_size] * self.block_size + pos % self.block_size
            if w.shared_tokens:  # a shared block holds their K/V (same tokens, same positions): not written; the
                slots[row, : w.shared_tokens] = oob  # attention reads the cache after the writes, so it reads those
            q_off[row], kv_lens[row], last[row] = w.start_pos, w.start_pos + n, n - 1
        return tokens, positions, slots, self._tables(works, b), q_off, kv_lens, last

    def _mixed(self, decodes: Sequence[SeqWork], works: Sequence[SeqWork], b: int, t: int, *, sample: bool) -> Any:
        """Dispatch the decodes (padded to the largest decode bucket, ``d`` rows) with a prefill group
        (``(b, t)``) as one pass: sampled outputs, or logits, for the ``d`` decode rows then the group's."""
        d = self.buckets.decode_batches[-1]
        args = (*self._decode_args(decodes, d), *self._prefill_args(works, b, t))
        if sample:
            pad = [(0.0, 0, 1.0, 0, 0, 0)] * (d - len(decodes))
            rows = [*self._sampling_rows(decodes), *pad, *self._sampling_rows(works)]
            args = (*args, *SamplingBatch.build(rows, d + b).arrays())
        out, self._cache = self._executable(("mixed" if sample else "mixed_logits", b, t))(self._params, self._cache,
                                                                                           *args)
        return out

    def _decode_args(self, works: Sequence[SeqWork], b: int) -> tuple[np.ndarray, ...]:
        """A decode group's host arrays, padded to ``b`` rows: tokens, positions, tables, valid."""
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        valid = np.zeros(b, np.bool_)
        for row, w in enumerate(works):
            tokens[row], positions[row] = w.token_ids[0], w.start_pos
        valid[: len(works)] = True
        return tokens, positions, self._tables(works, b), valid

    def _decode(self, works: Sequence[SeqWork], b: int, *, sample: bool) -> Any:
        """Dispatch one decode step for ``works`` (padded to ``b`` rows): sampled outputs, or logits."""
        tokens, positions, tables, valid = self._decode_args(works, b)
        if sample and any(_special(w) for w in works):  # logits out, then the masked / adjusted sampler
            logits, self._cache = self._executable(("decode_logits", b, 1))(
                self._params, self._cache, tokens, positions, tables, valid)
            return self._sample_masked(logits, works, b)
        args = (tokens, positions, tables, valid, *(self._sampling(works, b) if sample else ()))
        key = ("decode" if sample else "decode_logits", b, 1)
        out, self._cache = self._executable(key)(self._params, self._cache, *args)
        return out


def _special(w: SeqWork) -> bool:
    """A row the plain sampler cannot take: a grammar's mask or logit adjustments (their own executables)."""
    return w.guide is not None or w.adjust is not None
