"""What a spend leaves to settle, for each kind of leased limiter (the lease itself: :mod:`.lease`).

A window keeps its spends per slice with their latest time and settles them into the store's
slices at those times; a bucket's lease units already left the shared bucket, so only spends on
credit, refunds and unspent units going back are sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .lease import LeasedLimiter, Renewal
from .limits import RateRule

__all__ = ["LeasedWindow", "LeasedBucket", "LEASED"]


class LeasedWindow(LeasedLimiter):
    """The shared sliding window: spends are kept per slice with their latest time and settled into
    the store's slices at those times; a lease counts in full in the store until it is settled."""

    kind = "window"

    __slots__ = ("_width", "_spent", "_corrections", "_sent")

    def __init__(self, rule: RateRule, key: str, ttl: float, lease_share: float, fail_open: bool,
                 ids: Callable[[], str], on_hungry: Callable[[LeasedLimiter], None]) -> None:
        super().__init__(rule, key, ttl, lease_share, fail_open, ids, on_hungry)
        self._width = rule.window / rule.slices
        self._spent: dict[int, list[float]] = {}  # local slice -> [units, latest time], since the last settle
        self._corrections: dict[int, list[float]] = {}  # local slice -> [units to give back, its latest time]
        self._sent: dict[int, float] = {}  # local slice -> latest time sent, while the store may hold it

    def _spend(self, cost: float, now: float, credit: bool) -> None:
        k = int(now // self._width)
        cell = self._spent.get(k)
        if cell is None:
            self._spent[k] = [cost, now]
        else:
            cell[0] += cost
            cell[1] = now

    def untake(self, cost: float, now: float) -> None:
        """Undo the take just made: the units go back to the lease, the spend is forgotten."""
        cell = self._spent.get(int(now // self._width))
        if cell is not None:
            cell[0] = max(0.0, cell[0] - cost)
            if now < self.until:
                self.units += cost
                if self._in_flight is not None:
                    self._in_flight -= cost

    def refund(self, amount: float, at: float, now: float) -> None:
        k = int(at // self._width)
        cell = self._spent.get(k)
        if cell is not None:  # not settled yet: correct locally
            cell[0] = max(0.0, cell[0] - amount)
            return
        latest = self._sent.get(k)
        if latest is None:
            return  # that slice left the window: nothing counted to correct
        corr = self._corrections.get(k)
        if corr is None:
            self._corrections[k] = [amount, latest]
        else:
            corr[0] += amount

    def _unsettled(self) -> bool:
        return bool(self._spent or self._corrections)

    def _urgent(self) -> bool:
        return bool(self._corrections)

    def _settle(self, renewal: Renewal, dropped: float) -> Renewal:
        del dropped  # the store drops the old lease's entry: its unspent units are free again
        now, window = renewal.now, self.rule.window
        deltas = [(now - last, units, True) for units, last in self._spent.values()]
        deltas += [(now - last, -units, False) for units, last in self._corrections.values()]
        sent = self._sent
        for k, (_, last) in self._spent.items():
            sent[k] = last
        if len(sent) > self.rule.slices:  # forget what the store no longer counts
            for k in [k for k, last in sent.items() if last <= now - window]:
                del sent[k]
        self._spent.clear()
        self._corrections.clear()
        return replace(renewal, deltas=tuple(deltas))


class LeasedBucket(LeasedLimiter):
    """The shared token bucket (GCRA in the store): a lease's units leave the shared bucket when it
    is granted, so spending them needs no settlement; a lease that ends unspent gives its units
    back, and spends on credit (a cold key's, until the store's first answer) and refunds go as one
    debit.

    Why the bucket's bound holds across gateways: every unit admitted was taken from the one
    shared bucket before it was spent (or, on credit, right after), and units go back only if
    they were never spent -- so the admissions of all gateways are a subset of what one bucket
    would admit. A give-back lands after the bucket refilled in the meantime and is capped at a
    full bucket: a loss, never an excess.
    """

    kind = "bucket"

    __slots__ = ("_debit", "_credit")

    def __init__(self, rule: RateRule, key: str, ttl: float, lease_share: float, fail_open: bool,
                 ids: Callable[[], str], on_hungry: Callable[[LeasedLimiter], None]) -> None:
        super().__init__(rule, key, ttl, lease_share, fail_open, ids, on_hungry)
        self._debit = 0.0
        self._credit = False  # the take just made was on credit (for untake)

    def _spend(self, cost: float, now: float, credit: bool) -> None:
        self._credit = credit
        if credit:
            self._debit += cost

    def untake(self, cost: float, now: float) -> None:
        if self._credit:
            self._debit -= cost
        elif now < self.until:
            self.units += cost
            if self._in_flight is not None:
                self._in_flight -= cost

    def refund(self, amount: float, at: float, now: float) -> None:
        del at  # a bucket has no slices: a refund refills it now (capped at full)
        self._debit -= amount

    def _unsettled(self) -> bool:
        return self._debit != 0.0

    def _urgent(self) -> bool:
        return self._debit < 0.0

    def _settle(self, renewal: Renewal, dropped: float) -> Renewal:
        debit, self._debit = self._debit, 0.0
        return replace(renewal, returned=dropped, debit=debit)


LEASED: dict[str, type[LeasedLimiter]] = {"window": LeasedWindow, "bucket": LeasedBucket}
"""The leased limiter for each rule algorithm."""
