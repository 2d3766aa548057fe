"""Rule-tree routing across models: which model pool a request goes to; sans-I/O.

An operator writes ``[[routes]]`` (tests/gateway/test_rules.py shows every feature): a tree of
rules, each with a ``when`` table of conditions that must all hold, and either children
(``routes``, tried in order) or a leaf -- one model (``to``), a weighted ``split`` between models,
or a ``fallback`` chain (the next model when one has no ready replica). The first leaf whose path
matches takes the request; none matching leaves the model the request asked for. Every leaf has
a name, which each response carries (``x-quicserve-route``), with a metric label, the access log
and the trace.

Conditions (``when``): ``model`` (a name or list, as asked, aliases resolved), ``min_prompt_tokens``
/ ``max_prompt_tokens`` (the gateway's estimate), ``min_max_tokens`` / ``max_max_tokens``,
``stream`` (bool), ``headers`` (a table: name -> exact value, or a list of values), ``key_id`` /
``key_tier`` (the API key's id and tier; a name or list), ``user_regex`` (a regular expression
searched in the last user message, or the prompt) and ``user_keywords`` (any of these words, case
folded). Compiled once at load: ``config check`` rejects an unknown model, a bad pattern, an
unknown condition, a rule with neither children nor a leaf, and a rule no request can reach (after
a sibling without conditions), each by its path (``routes[1].routes[0].when.user_regex``).

Shadow: a leaf's ``shadow = { to, share, max_in_flight }`` copies that share of its requests to
another model, whose answers are read whole and dropped (:class:`Shadow`; the pipeline sends
them after the client's own call has started, outside its limits and its response).

Splits: without ``sticky`` the arms take their exact shares in every window of sum(weights)
requests (smooth weighted round robin, as nginx's upstreams); with ``sticky = "key"``, ``"user"``
(OpenAI's ``user`` field) or ``"header:NAME"``, the same subject stays on the same arm while the
weights stay, and when they change only the subjects whose arm lost share move (weighted
rendezvous hashing). A subject-less request under ``sticky`` is split like a non-sticky one.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .rule_conditions import CONDITIONS, Cond, conditions, served_model

__all__ = ["RequestFacts", "Decision", "Shadow", "RuleTree", "compile_rules", "RULE_KEYS", "CONDITIONS"]

RULE_KEYS = ("name", "when", "to", "split", "fallback", "routes", "sticky", "shadow")


class RequestFacts(Protocol):
    """What a rule may read of a request (the pipeline builds it; every method is cheap or cached)."""

    def model(self) -> str: ...
    def prompt_tokens(self) -> int: ...
    def max_tokens(self) -> int: ...
    def stream(self) -> bool: ...
    def header(self, name: bytes) -> bytes | None: ...
    def key(self) -> tuple[str | None, str | None]: ...  # (API key id, its tier)
    def user_text(self) -> str: ...  # the last user message (chat) or the prompt
    def user(self) -> str | None: ...  # OpenAI's ``user`` field


class Shadow:
    """A leaf's shadow arm: a copy of ``share`` percent of its requests (exact, a running
    remainder) goes to ``to``, answered to no one; at most ``max_in_flight`` at once (beyond it a
    copy is skipped, counted), so a slow or failing shadow pool can neither be overloaded by it
    nor hold anything of the client's."""

    __slots__ = ("to", "share", "max_in_flight", "in_flight", "_acc")

    def __init__(self, to: str, share: float, max_in_flight: int) -> None:
        self.to, self.share, self.max_in_flight = to, share, max_in_flight
        self.in_flight = 0
        self._acc = 0.0

    def take(self) -> bool | None:
        """True: copy this request (then :meth:`done` once it ends); False: not its turn;
        None: its turn, but the bound is reached (skipped)."""
        self._acc += self.share
        if self._acc < 100.0:
            return False
        self._acc -= 100.0
        if self.in_flight >= self.max_in_flight:
            return None
        self.in_flight += 1
        return True

    def done(self) -> None:
        self.in_flight -= 1


class Decision(NamedTuple):  # a tuple: a split builds one per request (a frozen dataclass costs 3x)
    leaf: str  # the leaf's name ("" when no rule matched)
    models: tuple[str, ...]  # the model, then its fallbacks in order
    shadow: Shadow | None = None  # the leaf's shadow arm, if it has one


class _Split:
    """Weighted arms; smooth weighted round robin, or rendezvous hashing by a sticky subject."""

    __slots__ = ("arms", "weights", "sticky", "_current", "_total", "_idx")

    def __init__(self, arms: tuple[str, ...], weights: tuple[float, ...], sticky: str) -> None:
        self.arms, self.weights, self.sticky = arms, weights, sticky
        self._current = [0.0] * len(arms)
        self._total = sum(weights)
        self._idx = tuple(enumerate(weights))

    def pick(self, facts: RequestFacts) -> str:
        if self.sticky:
            subject = self._subject(facts)
            if subject is not None:
                return self.arms[rendezvous(subject, self.arms, self.weights)]
        cur, best, top = self._current, 0, -math.inf
        for i, w in self._idx:
            c = cur[i] = cur[i] + w
            if c > top:
                best, top = i, c
        cur[best] = top - self._total
        return self.arms[best]

    def _subject(self, facts: RequestFacts) -> str | None:
        if self.sticky == "key":
            return facts.key()[0]
        if self.sticky == "user":
            return facts.user()
        value = facts.header(self.sticky[len("header:"):].encode("latin-1"))
        return None if value is None else value.decode("latin-1")


def rendezvous(subject: str, arms: Sequence[str], weights: Sequence[float]) -> int:
    """Weighted rendezvous (highest random weight) hashing: the arm with the largest
    ``-w / ln(u)``, ``u`` uniform in (0, 1) from a hash of (subject, arm). Each arm wins a share of
    subjects proportional to its weight, and changing one weight moves only subjects to or from
    that arm."""
    best, best_score = 0, -math.inf
    for i, (arm, w) in enumerate(zip(arms, weights, strict=True)):
        if w <= 0:
            continue
        h = int.from_bytes(hashlib.blake2b(f"{arm}\x00{subject}".encode(), digest_size=8).digest(), "big")
        u = (h + 0.5) / 2**64
        score = -w / math.log(u)
        if score > best_score:
            best, best_score = i, score
    return best


@dataclass(frozen=True, slots=True)
class _Node:
    name: str
    conds: tuple[Cond, ...]
    children: tuple[_Node, ...] = ()
    to: tuple[str, ...] = ()  # a leaf: the model and its fallbacks
    split: _Split | None = None
    shadow: Shadow | None = None


class RuleTree:
    """The compiled ``[[routes]]``: :meth:`decide` is one generated function (see :func:`_generate`)."""

    __slots__ = ("_roots", "leaves", "decide")

    def __init__(self, roots: tuple[_Node, ...], leaves: tuple[str, ...]) -> None:
        self._roots, self.leaves = roots, leaves
        self.decide: Callable[[RequestFacts], Decision | None] = _generate(roots)
        """The first leaf whose path matches, or None (the request keeps the model it asked for)."""

    def walk(self, facts: RequestFacts) -> Decision | None:
        """:meth:`decide` by walking the nodes, each condition its own function: the reference the
        generated code is tested against (tests/gateway/test_rules.py)."""
        return _walk(self._roots, facts)


def _walk(nodes: tuple[_Node, ...], facts: RequestFacts) -> Decision | None:
    for node in nodes:
        if all(c.test()(facts) for c in node.conds):
            if node.children:
                found = _walk(node.children, facts)
                if found is not None:
                    return found
                continue
            if node.split is not None:
                return Decision(node.name, (node.split.pick(facts),), node.shadow)
            return Decision(node.name, node.to, node.shadow)
    return None


def _generate(roots: tuple[_Node, ...]) -> Callable[[RequestFacts], Decision | None]:
    """The tree as one function of nested ``if``s, each condition's expression written inline with
    its constant bound by name -- generated from the configuration (never from a request) and
    ``exec``-ed once, as ``dataclasses`` writes ``__init__`` and admission its rate plans. A walk
    with a closure per condition cost 3-5 µs for a 10-leaf tree; this is a few hundred ns."""
    ns: dict[str, Any] = {"Decision": Decision}
    lines = ["def decide(f):"]

    def emit(nodes: tuple[_Node, ...], depth: int) -> None:
        pad = "    " * depth
        for node in nodes:
            test = " and ".join(f"({_bind(c, ns)})" for c in node.conds) or "True"
            lines.append(f"{pad}if {test}:")
            if node.children:
                emit(node.children, depth + 1)
                lines.append(f"{pad}    pass")
                continue
            if node.split is not None:
                k = len(ns)
                ns[f"S{k}"], ns[f"N{k}"], ns[f"H{k}"] = node.split, node.name, node.shadow
                lines.append(f"{pad}    return Decision(N{k}, (S{k}.pick(f),), H{k})")
            else:
                k = len(ns)
                ns[f"D{k}"] = Decision(node.name, node.to, node.shadow)
                lines.append(f"{pad}    return D{k}")

    emit(roots, 1)
    lines.append("    return None")
    exec("\n".join(lines), ns)  # noqa: S102 - text generated from the validated configuration
    fn: Callable[[RequestFacts], Decision | None] = ns["decide"]
    return fn


def _bind(c: Cond, ns: dict[str, Any]) -> str:
    """``c``'s expression with its constant bound to a name of its own in ``ns``."""
    name = f"C{len(ns)}"
    ns[name] = c.const
    return re.sub(r"\bC\b", name, c.expr)


def compile_rules(raw: Any, models: Mapping[str, str], p: list[str]) -> RuleTree | None:
    """``[[routes]]`` (``raw``, as TOML read it) against the served ``models`` (name or alias ->
    model); problems appended to ``p`` by path. None when there are none or any problem."""
    if raw in (None, []):
        return None
    names: list[str] = []
    before = len(p)
    roots = _nodes(raw, "routes", models, names, p)
    return RuleTree(roots, tuple(names)) if len(p) == before else None


def _nodes(raw: Any, where: str, models: Mapping[str, str], names: list[str], p: list[str]) -> tuple[_Node, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(r, Mapping) for r in raw):
        p.append(f"{where}: expected a non-empty list of rule tables, got {raw!r}")
        return ()
    out = []
    catch_all = ""
    for i, rule in enumerate(raw):
        at = f"{where}[{i}]"
        if catch_all:
            p.append(f"{at}: unreachable: {catch_all} before it matches every request")
        node = _node(rule, at, models, names, p)
        if node is not None:
            out.append(node)
            if not node.conds and not node.children:
                catch_all = f"{at} ({node.name})"
    return tuple(out)


def _node(rule: Mapping[str, Any], at: str, models: Mapping[str, str], names: list[str], p: list[str]
          ) -> _Node | None:
    for key in rule:
        if key not in RULE_KEYS:
            p.append(f"{at}.{key}: unknown key (known: {', '.join(RULE_KEYS)})")
    name = rule.get("name")
    if not isinstance(name, str) or not name or not name.isascii() or any(c.isspace() for c in name):
        p.append(f"{at}.name: every rule needs a name (ASCII, no spaces), got {name!r}")
        name = ""
    elif name in names:
        p.append(f"{at}.name: {name!r} names another rule too")
    names.append(name)
    tests = conditions(rule.get("when", {}), f"{at}.when", models, p)
    leaves = [k for k in ("to", "split", "fallback", "routes") if k in rule]
    if len(leaves) != 1:
        p.append(f"{at}: needs exactly one of to, split, fallback or routes, got {leaves or 'none'}")
        return None
    kind = leaves[0]
    if kind == "routes":
        if "shadow" in rule:
            p.append(f"{at}.shadow: only a leaf (to, split, fallback) may have a shadow")
        return _Node(name, tests, children=_nodes(rule["routes"], f"{at}.routes", models, names, p))
    shadow = _shadow(rule["shadow"], f"{at}.shadow", models, p) if "shadow" in rule else None
    if kind == "to":
        return _Node(name, tests, to=(served_model(rule["to"], f"{at}.to", models, p),), shadow=shadow)
    if kind == "fallback":
        chain = rule["fallback"]
        if not isinstance(chain, list) or len(chain) < 2:
            p.append(f"{at}.fallback: expected two or more models in order, got {chain!r}")
            return None
        return _Node(name, tests, to=tuple(served_model(m, f"{at}.fallback[{j}]", models, p) for j, m in enumerate(chain)),
                     shadow=shadow)
    return _Node(name, tests, split=_split(rule["split"], rule.get("sticky", ""), at, models, p), shadow=shadow)


def _shadow(raw: Any, at: str, models: Mapping[str, str], p: list[str]) -> Shadow | None:
    if not isinstance(raw, Mapping) or set(raw) - {"to", "share", "max_in_flight"}:
        p.append(f"{at}: expected {{ to = MODEL, share = PERCENT, max_in_flight = N }}, got {raw!r}")
        return None
    share, bound = raw.get("share", 100), raw.get("max_in_flight", 16)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 100:
        p.append(f"{at}.share: expected a percentage in (0, 100], got {share!r}")
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        p.append(f"{at}.max_in_flight: expected a whole number >= 1, got {bound!r}")
    return Shadow(served_model(raw.get("to"), f"{at}.to", models, p), float(share) if isinstance(share, int | float) else 0.0,
                  bound if isinstance(bound, int) else 1)


def _split(raw: Any, sticky: Any, at: str, models: Mapping[str, str], p: list[str]) -> _Split | None:
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(a, Mapping) for a in raw):
        p.append(f"{at}.split: expected two or more arms {{ to = MODEL, weight = N }}, got {raw!r}")
        return None
    arms, weights = [], []
    for j, arm in enumerate(raw):
        arms.append(served_model(arm.get("to"), f"{at}.split[{j}].to", models, p))
        w = arm.get("weight")
        if isinstance(w, bool) or not isinstance(w, int | float) or not (w >= 0 and math.isfinite(w)):
            p.append(f"{at}.split[{j}].weight: expected a number >= 0, got {w!r}")
            w = 0
        weights.append(float(w))
    if sum(weights) <= 0:
        p.append(f"{at}.split: the weights add up to 0")
    if not (sticky in ("", "key", "user") or (isinstance(sticky, str) and sticky.startswith("header:")
                                              and len(sticky) > 7)):
        p.append(f"{at}.sticky: {sticky!r} is not key, user or header:NAME")
        sticky = ""
    return _Split(tuple(arms), tuple(weights), str(sticky))
