"""Admission windows: how long new requests may wait to join one prefill.

Batching prefills amortises each prefill step's fixed cost, but a wider
window delays first tokens and makes the steps that carry the prefill longer.

* :class:`FixedWindow` waits a constant ``w`` after the oldest waiting request
  arrived (``w = 0`` admits at once).
* :class:`AdaptiveWindow` (DBS-Adapt) moves ``w`` after every step by a clipped
  gradient step on the step-latency error, scaled by load::

      e = clip(target - latency, -g, g);  e *= q / (1 - q) if e < 0
      w <- clip(w + lr * e * load, w_min, w_max)

  Steps faster than the target leave head-room, so ``w`` grows and prefills
  batch up (fewer fixed costs, more throughput); steps slower than the target
  shrink ``w`` so fewer prompts join each prefill. Misses weigh
  ``q / (1 - q)`` times more than head-room (the pinball-loss gradient), so
  ``w`` settles where about ``1 - q`` of steps exceed the target (exactly so
  when the clip ``g`` is small next to the latency noise: the update is then
  the pinball-loss gradient), so the target is a ``q``-quantile (p99 by
  default), not a mean. ``load`` (0..1, the share
  of batch slots wanted) damps the drift when the engine is nearly idle.

The window opens when there is something to admit and the previous
admission is over (``start = max(oldest arrival, last admission)``), so under
load prefills happen at most once per window, each carrying the requests and
freed slots gathered meanwhile. Either way admission never waits once a full
prefill batch is ready. Pure logic; times in seconds, passed in.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BatchWindow", "FixedWindow", "AdaptiveWindow", "parse_batch_window"]


class BatchWindow(Protocol):
    window: float

    def admit_at(self, start: float, batch: int, full: int) -> float:
        """Earliest admission time for ``batch`` admissible requests when
        ``full`` make a full prefill batch; the window opened at ``start``."""
        ...

    def observe(self, latency: float, load: float) -> None:
        """Feed back one step's wall time and load (0..1)."""
        ...


class FixedWindow:
    def __init__(self, window: float = 0.0) -> None:
        if window < 0:
            raise ValueError("window must be >= 0")
        self.window = window

    def admit_at(self, start: float, batch: int, full: int) -> float:
        if batch >= full:
            return start
        return start + self.window

    def observe(self, latency: float, load: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedWindow({self.window * 1e3:.1f} ms)"


class AdaptiveWindow(FixedWindow):
    """DBS-Adapt: gradient steps on (target latency - observed latency)."""

    def __init__(
        self,
        target_latency: float = 0.05,
        *,
        initial: float = 0.0,
        w_min: float = 0.0,
        w_max: float = 0.05,
        lr: float = 0.5,
        clip: float | None = None,
        quantile: float = 0.99,
    ) -> None:
        if not (0 <= w_min <= w_max) or target_latency <= 0 or lr <= 0 or not (0 < quantile < 1):
            raise ValueError("need 0 <= w_min <= w_max, target_latency > 0, lr > 0, 0 < quantile < 1")
        super().__init__(min(max(initial, w_min), w_max))
        self.target_latency = target_latency
        self.w_min = w_min
        self.w_max = w_max
        self.lr = lr
        self.clip = clip if clip is not None else target_latency / 10
        self.miss_weight = quantile / (1 - quantile)

    def observe(self, latency: float, load: float) -> None:
        err = max(-self.clip, min(self.clip, self.target_latency - latency))
        if err < 0:
            err *= self.miss_weight
        load = max(0.0, min(1.0, load))
        self.window = max(self.w_min, min(self.w_max, self.window + self.lr * err * load))

    def __repr__(self) -> str:
        return f"AdaptiveWindow(w={self.window * 1e3:.2f} ms, target={self.target_latency * 1e3:.1f} ms)"


def parse_batch_window(spec: str, *, target_latency: float = 0.05) -> FixedWindow:
    """``"adaptive"`` or ``"fixed:<ms>"`` (the worker's ``--batch-window``)."""
    if spec == "adaptive":
        return AdaptiveWindow(target_latency)
    if spec.startswith("fixed:"):
        try:
            ms = float(spec[6:])
        except ValueError:
            raise ValueError(f"bad --batch-window {spec!r}: fixed:<ms> needs a number") from None
        return FixedWindow(ms / 1e3)
    raise ValueError(f"bad --batch-window {spec!r}: use 'adaptive' or 'fixed:<ms>'")
