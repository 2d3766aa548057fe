"""Admission windows: how long new requests may wait to join one prefill,
and how much prefill one step may carry.

Batching prefills amortises each prefill call's fixed cost, but a wider
window delays first tokens and makes the steps that carry the prefill longer.

* :class:`FixedWindow` waits a constant ``w`` after the oldest waiting request
  arrived (``w = 0`` admits at once) and leaves the per-step prefill size to
  the engine's static ``max_prefill_tokens``.
* :class:`AdaptiveWindow` (DBS-Adapt) moves ``w`` after every step by a clipped
  gradient step on the step-latency error, scaled by load::

      e = min(target - latency, g);  e = -g * q / (1 - q) on a miss
      w <- clip(w + lr * e * load, w_min, top);  top = w_max or min(w_max, c)

  Steps faster than the target leave head-room, so ``w`` grows and prefills
  batch up (fewer fixed costs); a step slower than the target shrinks ``w``
  so fewer prompts join each prefill. A miss of any size pulls ``q / (1 - q)``
  times as hard as the most head-room pushes (the sign-based pinball-loss
  gradient), so at most about ``1 - q`` of steps exceed the target whatever
  the latency distribution: the target is a ``q``-quantile (p99 by default),
  not a mean. (Weighing a miss by its size, as a first version did, lets
  many small misses through: with bucketed step costs most misses are small.)
  ``load`` (0..1, the share of batch slots wanted) damps the drift when the
  engine is nearly idle. ``c`` is the fitted fixed cost of one prefill call.
  Below saturation a request joining a prefill saves at most ``c``, so
  waiting longer cannot pay: ``top = min(w_max, c)``. At saturation (load 1)
  admission waits for batch slots to free up, and gathering them into full
  calls shares each call's fixed cost, so ``top = w_max`` there, but only if
  the step's prefill bound (below) lets a full call of typical prompts
  through; otherwise a longer wait would leave slots empty without making
  any prefill bigger, a loss the latency feedback cannot see.

  The window alone cannot hold a latency target: it changes how often
  prefills run, not how big the one that runs is (a burst of arrivals is
  admitted at once whatever ``w``). So DBS-Adapt also bounds each step's
  prefill (:meth:`AdaptiveWindow.prefill_fits`, which the engine asks before
  adding each request to a step): it fits ``latency ~ base + c * calls +
  k * padded_area + r * decodes`` over recent steps (exponentially weighted least squares;
  ``calls`` says which calls the runner makes for a step's prefills and the
  shape each is padded to: the JAX runner's own shape buckets
  (:func:`bucket_calls`), or by default calls of up to ``prefill_group``
  padded to powers of two (:func:`pow2_calls`); ``decodes`` the sequences
  the step also decodes) and admits while the predicted step stays within
  ``target - m`` (the first request always runs, alone if need be). With
  chunked prefill a step is mixed, a few decodes and the chunks of prompts
  (the engine's ``step_tokens``): the same fit, its ``decodes`` term the
  cost of the running streams' rows, predicts it and bounds which chunks
  join (the first always does). The margin ``m`` takes the same quantile step as ``w``, 100x
  smaller and with the opposite sign, so misses the fit did not foresee
  widen it.

The window opens when there is something to admit and the previous
admission is over (``start = max(oldest arrival, last admission)``), so under
load prefills happen at most once per window, each carrying the requests and
freed slots gathered meanwhile. Either way admission never waits once a full
prefill batch is ready (the engine also counts a batch as full when the next
ready request, or one more like the last, would not fit the step's prefill
bound). Pure logic; times in seconds, passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from transport.common.worker_options import WorkerOptions, batch_window_ms

_PREFILL_GROUP = WorkerOptions().max_prefill_batch  # the runner's max_prefill_batch unless told

__all__ = ["BatchWindow", "FixedWindow", "AdaptiveWindow", "PrefillCalls", "bucket_calls", "pow2_calls",
           "parse_batch_window"]  # fmt: skip

# The runner's prefill calls for a step's prefills (new-token counts): one (batch, tokens) shape per call.
PrefillCalls = Callable[[Sequence[int]], Sequence[tuple[int, int]]]


def pow2_calls(group: int) -> PrefillCalls:
    """Calls of up to ``group`` prefills, shortest first, each padded to powers
    of two in batch and length (16 tokens at least)."""

    def calls(lengths: Sequence[int]) -> list[tuple[int, int]]:
        ls = sorted(lengths)
        return [(_pow2(len(chunk)), max(16, _pow2(chunk[-1])))
                for chunk in (ls[i : i + group] for i in range(0, len(ls), group))]  # fmt: skip

    return calls


def bucket_calls(buckets: Any) -> PrefillCalls:
    """The calls the JAX runner makes: ``buckets`` (its
    :class:`~inference.model.buckets.Buckets`) groups the prefills and pads
    each group to its shape bucket. Lengths past ``max_model_len`` count as
    that (the engine refuses such prompts)."""

    def calls(lengths: Sequence[int]) -> list[tuple[int, int]]:
        ls = [min(n, buckets.max_model_len) for n in lengths]
        return [buckets.prefill_shape(len(g), max(ls[i] for i in g)) for g in buckets.group_prefills(ls)]

    return calls


class BatchWindow(Protocol):
    window: float

    def admit_at(self, start: float, batch: int, full: int) -> float:
        """Earliest admission time for ``batch`` admissible requests when
        ``full`` make a full prefill batch; the window opened at ``start``."""
        ...

    def observe(self, latency: float, load: float, prefill_lengths: Sequence[int] = (), decodes: int = 0) -> None:
        """Feed back one step's wall time, load (0..1), the new-token
        counts of the prefills (or chunks) it carried and how many sequences it decoded."""
        ...

    def prefill_fits(self, prefill_lengths: Sequence[int], decodes: int = 0) -> bool:
        """Whether one step that decodes ``decodes`` sequences may carry prefills of these
        new-token counts (the engine always lets the first one through)."""
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

    def observe(self, latency: float, load: float, prefill_lengths: Sequence[int] = (), decodes: int = 0) -> None:
        pass

    def prefill_fits(self, prefill_lengths: Sequence[int], decodes: int = 0) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FixedWindow({self.window * 1e3:.1f} ms)"


class AdaptiveWindow(FixedWindow):
    """DBS-Adapt: gradient steps on (target latency - observed latency), and
    a per-step prefill bound from a fitted step-cost model."""

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
        prefill_group: int = _PREFILL_GROUP,
        cost_halflife: float = 256.0,
        calls: PrefillCalls | None = None,
    ) -> None:
        if not (0 <= w_min <= w_max) or target_latency <= 0 or lr <= 0 or not (0 < quantile < 1):
            raise ValueError("need 0 <= w_min <= w_max, target_latency > 0, lr > 0, 0 < quantile < 1")
        if cost_halflife <= 0 or prefill_group < 1:
            raise ValueError("cost_halflife must be > 0 (steps) and prefill_group >= 1")
        super().__init__(min(max(initial, w_min), w_max))
        self.target_latency = target_latency
        self.w_min = w_min
        self.w_max = w_max
        self.lr = lr
        self.clip = clip if clip is not None else target_latency / 10
        self.miss_weight = quantile / (1 - quantile)
        self.prefill_group = prefill_group
        self.calls: PrefillCalls = calls or pow2_calls(prefill_group)  # the runner's calls (cost features)
        self.margin = 0.0  # seconds the prefill bound keeps below the target
        self._mean_len = 0.0  # recent new tokens per prefill (moving average)
        self._decay = 0.5 ** (1.0 / cost_halflife)
        self._xtx = [[0.0] * 4 for _ in range(4)]  # weighted X'X and X'y, X = (1, calls, area, decodes)
        self._xty = [0.0] * 4
        self._coef: tuple[float, float, float, float] | None = None
        self._decodes = 0.0  # recent decodes per step (moving average): the full-call check's

    def observe(self, latency: float, load: float, prefill_lengths: Sequence[int] = (), decodes: int = 0) -> None:
        # A miss of any size counts as a full clipped miss: then a miss pulls
        # at least q / (1 - q) times harder than any head-room pushes, so at
        # most about 1 - q of steps miss whatever the latency distribution.
        err = min(self.clip, self.target_latency - latency)
        if err < 0:
            err = -self.clip * self.miss_weight
        load = max(0.0, min(1.0, load))
        w = self.window + self.lr * err * load
        # Below saturation a request waits for nothing but company, and one
        # joining a prefill saves at most a call's fixed cost: waiting longer
        # cannot pay. At saturation (load 1) the wait is for batch slots to
        # free up; gathering a full call of them pays (each call's fixed cost
        # is shared) if the step's prefill bound lets a full call of typical
        # prompts through. If it does not, a longer wait only leaves slots
        # empty, and the latency feedback cannot see that.
        if prefill_lengths:
            self._mean_len += (sum(prefill_lengths) / len(prefill_lengths) - self._mean_len) / 16
        self._decodes += (decodes - self._decodes) / 16
        top = self.w_max
        if self._coef is not None and not (
            load >= 1.0
            and self.prefill_fits([max(1, round(self._mean_len))] * self.prefill_group, round(self._decodes))
        ):
            top = min(self.w_max, max(self.w_min, self._coef[1]))
        self.window = max(self.w_min, min(top, w))
        # The same quantile step, 100x smaller and with the opposite sign,
        # widens the prefill bound's margin on misses the cost fit did not
        # foresee (bucket padding, noise) and narrows it on head-room.
        self.margin = max(0.0, min(self.target_latency, self.margin - self.lr / 100 * err))
        self._fit_step(self._features(prefill_lengths, decodes), latency)

    def _features(self, lengths: Sequence[int], decodes: int) -> tuple[float, float, float, float]:
        """(1, prefill calls, padded prefill area, decodes) of the calls the runner makes (``self.calls``)."""
        if not lengths:
            return 1.0, 0.0, 0.0, float(decodes)
        shapes = self.calls(lengths)
        return 1.0, float(len(shapes)), float(sum(b * t for b, t in shapes)), float(decodes)

    def _fit_step(self, x: tuple[float, ...], y: float) -> None:
        d = self._decay
        for i in range(4):
            self._xty[i] = self._xty[i] * d + x[i] * y
            for j in range(4):
                self._xtx[i][j] = self._xtx[i][j] * d + x[i] * x[j]
        if self._xtx[0][2] > 0:  # some step carried a prefill
            coef = _solve(self._xtx, self._xty, ridge=1e-9)
            if coef is not None and coef[2] > 0:
                self._coef = (coef[0], max(0.0, coef[1]), coef[2], max(0.0, coef[3]))

    @property
    def cost_model(self) -> tuple[float, float, float, float] | None:
        """``(base, per_call, per_area, per_decode)`` of the fitted step latency
        ``base + per_call * calls + per_area * padded_area + per_decode * decodes``, once known."""
        return self._coef

    def predict(self, prefill_lengths: Sequence[int], decodes: int = 0) -> float | None:
        """Predicted latency of a step that carries these prefills (or chunks) and ``decodes`` decodes."""
        if self._coef is None:
            return None
        x = self._features(prefill_lengths, decodes)
        return sum(c * v for c, v in zip(self._coef, x, strict=True))

    def prefill_fits(self, prefill_lengths: Sequence[int], decodes: int = 0) -> bool:
        pred = self.predict(prefill_lengths, decodes)
        return pred is None or pred <= self.target_latency - self.margin

    def __repr__(self) -> str:
        return f"AdaptiveWindow(w={self.window * 1e3:.2f} ms, target={self.target_latency * 1e3:.1f} ms)"


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _solve(a: list[list[float]], b: list[float], *, ridge: float) -> list[float] | None:
    """Solve (a + ridge * trace * I) x = b (n x n, Gaussian elimination); None if singular."""
    n = len(b)
    lam = ridge * max(1e-30, sum(a[i][i] for i in range(n)))
    m = [[a[i][j] + (lam if i == j else 0.0) for j in range(n)] + [b[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def parse_batch_window(
    spec: str, *, target_latency: float = 0.05, prefill_group: int = _PREFILL_GROUP
) -> FixedWindow:
    """``"adaptive"`` or ``"fixed:<ms>"`` (the worker's ``--batch-window``);
    ``prefill_group``: prefills the runner runs per call (its ``max_prefill_batch``). Once the runner
    is loaded, an adaptive window's ``calls`` can be set to its shapes (:func:`bucket_calls`)."""
    ms = batch_window_ms(spec)  # the syntax is the worker option's (transport.common.worker_options)
    if ms is None:
        return AdaptiveWindow(target_latency, prefill_group=prefill_group)
    return FixedWindow(ms / 1e3)
