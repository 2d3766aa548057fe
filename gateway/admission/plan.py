"""Compiled rate-limit plans: a rule set's usual admission as one straight-line function.

Why: :meth:`~gateway.admission.limits.RateLimits.take` decides every case for any rules --
scope values that may be absent, match filters, any limiter type, refusals, the tightest rule
of each unit -- and that generality costs about 140 bytecodes per rule per request, the
largest part of admission's cost. Yet the rule set is fixed by the configuration, and the
usual case is known in advance: every rule applies, and each one's limiter is a sliding
window on its fast path (the newest slice, no expiry due, room left). :func:`compile_plan`
writes that case out for one rule set, the way ``dataclasses`` writes ``__init__`` and
``fastjsonschema`` a validator: Python source generated from the configuration (never from
a request) and ``exec``-ed once, at startup.

The compiled function checks every rule first and takes from them only if all allow it, so
when it answers ``None`` nothing has been taken and the caller asks ``RateLimits.take``,
which decides the same way for every case. tests/gateway/admission/test_plan.py drives both
with random rules and requests and asserts the same answers, headers and limiter state. The
steps and answers are the types of :mod:`.rules`, which both modules import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .ratelimit_headers import REMAINING_REQUESTS, REMAINING_TOKENS
from .rules import Admitted, Step
from .window import SlidingWindowLimiter

__all__ = ["Plan", "compile_plan"]

Plan = Callable[[str | None, str | None, str, str, float, float], Admitted | None]
"""(key id, client address, model, route -- the scope values in ``limits.SCOPES`` order --, token cost, now)
-> the admission's headers and reservation, or None: not the usual case, nothing taken (ask
``RateLimits.take``)."""


def compile_plan(steps: tuple[Step, ...], scopes: tuple[str, ...]) -> Plan:
    """The usual case of ``steps`` (a ``RateLimits`` plan) as one function, its parameters named by
    ``scopes`` (``limits.SCOPES``, the order of a step's scope index); see the module doc."""
    ns: dict[str, Any] = {"W": SlidingWindowLimiter, "RR": REMAINING_REQUESTS, "RT": REMAINING_TOKENS}
    check: list[str] = []
    take: list[str] = []
    units: dict[bool, list[int]] = {False: [], True: []}
    for i, (idx, match, get, _, on_tokens, pair, _, full, _) in enumerate(steps):
        ns[f"get{i}"], ns[f"P{i}"], ns[f"F{i}"] = get, pair, full
        cost = "tokens" if on_tokens else "1.0"
        value = scopes[idx]
        if match is None:
            check.append(f"if {value} is None: return None")
        else:
            ns[f"M{i}"] = match
            check.append(f"if {value} != M{i}: return None")
        check.append(f"l{i} = get{i}({value})\n"
                     f"if type(l{i}) is not W or not l{i}._hl <= now < l{i}._until or {cost} > l{i}.limit - l{i}._total:\n"
                     f"    return None")
        # SlidingWindowLimiter.try_take's fast path (its remaining clamped at 0 the same way)
        take.append(f"l{i}._hc += {cost}\nt = l{i}._total = l{i}._total + {cost}\nl{i}._hl = now\n"
                    f"r{i} = l{i}.limit - t\nif r{i} < 0.0: r{i} = 0.0")
        units[on_tokens].append(i)
    headers: list[str] = []
    for on_tokens, name, label in ((False, "q", "RR"), (True, "k", "RT")):
        idxs = units[on_tokens]
        if not idxs:
            continue
        r, p, f = f"r{idxs[0]}", f"P{idxs[0]}", f"F{idxs[0]}"
        if len(idxs) > 1:  # the tightest rule of the unit, the first of equals (as RateLimits.take)
            take.append(f"r{name}, p{name}, f{name} = {r}, {p}, {f}")
            take += [f"if r{i} < r{name}: r{name}, p{name}, f{name} = r{i}, P{i}, F{i}" for i in idxs[1:]]
            r, p, f = f"r{name}", f"p{name}", f"f{name}"
        headers.append(f"{p}, ({label}, b'%d' % {r}), {f}")
    held = "".join(f"l{i}, " for i in units[True])
    reservation = f"(tokens, now, ({held}))" if held else "None"
    result = f"return ({', '.join(headers)}{',' if len(headers) == 1 else ''}), {reservation}" if headers \
        else "return (), None"
    body = "\n".join(check + take + [result]).replace("\n", "\n    ")
    src = f"def plan({', '.join(scopes)}, tokens, now):\n    {body}\n"
    exec(compile(src, f"<rate plan of {len(steps)} rules>", "exec"), ns)  # our own source, from the configuration
    fn: Plan = ns["plan"]
    fn.__doc__ = src  # the source, for whoever debugs it
    return fn
