"""One model over the devices of several worker processes (``jax.distributed``): the first process
runs the engine, the others follow its steps.

How it works: every process calls :func:`initialize` (``jax.distributed.initialize``: one
coordinator, at process 0's address), so ``jax.devices()`` lists every process's devices and the
tensor-parallel mesh (:mod:`inference.model.tensor_parallel`) spans them. JAX is multi-controller:
each process must launch the same computations in the same order. Only process 0 (the leader)
has a transport, an engine and a scheduler; before each step it broadcasts the step's
:class:`~inference.runner.StepPlan` (:func:`send_plan`, through JAX's own
``multihost_utils.broadcast_one_to_all``: a collective over the same devices), and every other
process (a follower, :func:`follow`) runs the same plan through its own runner, whose
collectives then meet the leader's. ``None`` ends the followers. A plan travels pickled, padded
to a power of two of at least 4 KiB, so the broadcast compiles for a few sizes only.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import numpy as np

from inference.runner import StepPlan

__all__ = ["initialize", "send_plan", "receive_plan", "follow"]

log = logging.getLogger("inference.multihost")
_MIN_BYTES = 4096


def initialize(coordinator: str, processes: int, process_id: int) -> None:
    """Join the ``processes``-process JAX runtime whose coordinator is process 0, at ``coordinator``."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)
    log.info("process %d of %d (coordinator %s): %d devices, %d local", process_id, processes, coordinator,
             jax.device_count(), jax.local_device_count())


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def send_plan(plan: StepPlan | None) -> None:
    """The leader's side: every follower receives ``plan`` (None: stop)."""
    payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    size = max(_MIN_BYTES, 1 << (len(payload) - 1).bit_length())
    _broadcast(np.array([size, len(payload)], np.int32))
    buf = np.zeros(size, np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    _broadcast(buf)


def receive_plan() -> StepPlan | None:
    """A follower's side of :func:`send_plan`."""
    size, n = (int(v) for v in _broadcast(np.zeros(2, np.int32)))
    buf = _broadcast(np.zeros(size, np.uint8))
    plan: StepPlan | None = pickle.loads(buf[:n].tobytes())
    return plan


def follow(runner: Any) -> int:
    """Run every plan the leader sends through ``runner`` until it sends None; the steps run."""
    steps = 0
    while (plan := receive_plan()) is not None:
        runner.execute(plan)
        steps += 1
    log.info("the leader stopped after %d steps", steps)
    return steps
