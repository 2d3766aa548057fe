"""A prompt through the model on its own (#31): what embeddings and prompt logprobs read.

Not the served steps: no KV cache, no scheduler. The prompt runs as one causal pass
(:meth:`Llama.prompt`), padded at its end to a power of two so that a few shapes compile (causal
attention: padding after a position never changes it). A request that asks for neither pays
nothing: this runs only for an embedding or an echo with logprobs. Why a pass of its own rather
than the prefill's: the prefix cache skips the positions it holds (their logits are never
computed), and a pass of its own needs no change to the step's executables or their buckets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from inference.kernels.kernel_set import KernelSet
from inference.sampling import MAX_TOP_LOGPROBS
from inference.tasks import PromptResult

__all__ = ["PromptPass"]

_MIN_PAD = 16


def _prompt(params: Any, tokens: jax.Array, *, model: Any, kernels: KernelSet,
            logprobs: bool) -> tuple[jax.Array, ...]:
    hidden, logits = model.prompt(params, tokens, kernels=kernels)
    if not logprobs:
        return (hidden,)
    lsm = jax.nn.log_softmax(logits, axis=-1)
    nxt = jnp.roll(tokens, -1)  # row t predicts token t + 1
    lp = jnp.take_along_axis(lsm, nxt[:, None], axis=-1)[:, 0]
    top_lps, top_ids = jax.lax.top_k(lsm, MAX_TOP_LOGPROBS)
    return hidden, lp, top_ids, top_lps


class PromptPass:
    """A model's prompt pass over its serving parameters (a :class:`~inference.model.jax_runner.JaxRunner`'s)."""

    def __init__(self, model: Any, params: Any, kernels: KernelSet, max_len: int) -> None:
        self._params = params
        self._max_len = max_len
        self._fns = {lp: jax.jit(partial(_prompt, model=model, kernels=kernels, logprobs=lp)) for lp in (False, True)}
        self._compiled: dict[tuple[int, bool], Any] = {}  # (padded length, logprobs) -> executable
        self._lock = threading.Lock()

    def _padded(self, t: int) -> int:
        if not 0 < t <= self._max_len:
            raise ValueError(f"a prompt of {t} tokens (1..{self._max_len})")
        return max(_MIN_PAD, 1 << (t - 1).bit_length())

    def compile(self, t: int, logprobs: bool) -> Any:
        """The executable for a prompt of ``t`` tokens (compiled once per padded length; any thread:
        the worker compiles off the step thread, so a new length never stalls the running streams)."""
        key = (self._padded(t), logprobs)
        exe = self._compiled.get(key)
        if exe is None:
            exe = self._fns[logprobs].lower(self._params, jax.ShapeDtypeStruct((key[0],), jnp.int32)).compile()
            with self._lock:
                exe = self._compiled.setdefault(key, exe)
        return exe

    def run(self, ids: Sequence[int], logprobs: bool) -> PromptResult:
        t = len(ids)
        exe = self.compile(t, logprobs)
        tokens = np.zeros(self._padded(t), np.int32)
        tokens[:t] = ids
        got = jax.device_get(exe(self._params, jnp.asarray(tokens)))
        hidden = np.asarray(got[0][:t], np.float32)
        if not logprobs:
            return PromptResult(hidden)
        # position i's logprob is row i - 1's (the first position has none)
        lps = np.concatenate([[np.nan], np.asarray(got[1][: t - 1], np.float32)]).astype(np.float32)
        top_ids = np.concatenate([np.zeros((1, MAX_TOP_LOGPROBS), np.int64), np.asarray(got[2][: t - 1])])
        top_lps = np.concatenate([np.full((1, MAX_TOP_LOGPROBS), np.nan, np.float32),
                                  np.asarray(got[3][: t - 1], np.float32)])
        return PromptResult(hidden, lps, top_ids, top_lps)
