"""The rule tree (gateway/routing/rules.py): every condition, leaves, splits, compile-time problems."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.rules import RuleTree, compile_rules, rendezvous

MODELS = {"big": "big", "small": "small", "fast": "fast", "b": "big", "echo": "echo"}


@dataclass
class Facts:
    model_: str = "small"
    prompt: int = 10
    max_tok: int = 16
    stream_: bool = False
    headers: dict[bytes, bytes] = field(default_factory=dict)
    key_: tuple[str | None, str | None] = (None, None)
    text: str = "hello"
    user_: str | None = None

    def model(self) -> str:
        return self.model_

    def prompt_tokens(self) -> int:
        return self.prompt

    def max_tokens(self) -> int:
        return self.max_tok

    def stream(self) -> bool:
        return self.stream_

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)

    def key(self) -> tuple[str | None, str | None]:
        return self.key_

    def user_text(self) -> str:
        return self.text

    def user(self) -> str | None:
        return self.user_


def tree(*rules: dict[str, Any]) -> RuleTree:
    problems: list[str] = []
    t = compile_rules(list(rules), MODELS, problems)
    assert problems == [] and t is not None
    return t


# (condition table, facts that match, facts that do not)
CASES: list[tuple[dict[str, Any], Facts, Facts]] = [
    ({"model": "small"}, Facts(), Facts(model_="fast")),
    ({"model": ["b", "fast"]}, Facts(model_="big"), Facts()),  # an alias in a rule names its model
    ({"min_prompt_tokens": 4000}, Facts(prompt=4000), Facts(prompt=3999)),
    ({"max_prompt_tokens": 100}, Facts(prompt=100), Facts(prompt=101)),
    ({"min_max_tokens": 1000}, Facts(max_tok=2000), Facts(max_tok=999)),
    ({"max_max_tokens": 64}, Facts(max_tok=64), Facts(max_tok=65)),
    ({"stream": True}, Facts(stream_=True), Facts()),
    ({"stream": False}, Facts(), Facts(stream_=True)),
    ({"headers": {"X-Tier": "gold"}}, Facts(headers={b"x-tier": b"gold"}), Facts(headers={b"x-tier": b"silver"})),
    ({"headers": {"x-region": ["eu", "uk"]}}, Facts(headers={b"x-region": b"uk"}), Facts()),
    ({"key_id": "tenant1"}, Facts(key_=("tenant1", "0")), Facts(key_=("tenant2", "0"))),
    ({"key_tier": ["2"]}, Facts(key_=("t", "2")), Facts(key_=("t", "1"))),
    ({"user_regex": r"(?i)\btranslate\b"}, Facts(text="Please TRANSLATE this"), Facts(text="translated")),
    ({"user_keywords": ["SQL", "database"]}, Facts(text="a Database question"), Facts(text="databases")),
    ({"model": "small", "stream": True}, Facts(stream_=True), Facts()),  # all conditions must hold
]


@pytest.mark.parametrize("when, yes, no", CASES, ids=[",".join(c[0]) for c in CASES])
def test_every_condition(when: dict[str, Any], yes: Facts, no: Facts) -> None:
    t = tree({"name": "r", "when": when, "to": "fast"})
    d = t.decide(yes)
    assert d is not None and (d.leaf, d.models) == ("r", ("fast",))
    assert t.decide(no) is None


def test_first_matching_leaf_and_nested_rules() -> None:
    t = tree({"name": "long", "when": {"min_prompt_tokens": 1000}, "to": "big"},
             {"name": "gold", "when": {"headers": {"x-tier": "gold"}}, "routes": [
                 {"name": "gold-stream", "when": {"stream": True}, "to": "fast"},
                 {"name": "gold-code", "when": {"user_keywords": ["python"]}, "to": "big"}]},
             {"name": "chain", "when": {"model": "echo"}, "fallback": ["echo", "small"]},
             {"name": "rest", "to": "small"})
    assert t.leaves == ("long", "gold", "gold-stream", "gold-code", "chain", "rest")
    gold = {b"x-tier": b"gold"}
    for facts, leaf, models in [
        (Facts(prompt=5000, headers=gold, stream_=True), "long", ("big",)),
        (Facts(headers=gold, stream_=True), "gold-stream", ("fast",)),
        (Facts(headers=gold, text="python help"), "gold-code", ("big",)),
        (Facts(headers=gold), "rest", ("small",)),  # no child matched: the next sibling
        (Facts(model_="echo"), "chain", ("echo", "small")),
        (Facts(), "rest", ("small",)),
    ]:
        d = t.decide(facts)
        assert d is not None and (d.leaf, d.models) == (leaf, models), facts


def test_split_shares_are_exact_without_stickiness() -> None:
    t = tree({"name": "ab", "split": [{"to": "big", "weight": 95}, {"to": "small", "weight": 5}]})
    picks = Counter(t.decide(Facts()).models[0] for _ in range(10000))  # type: ignore[union-attr]
    assert picks == {"big": 9500, "small": 500}
    window = [t.decide(Facts()).models[0] for _ in range(100)]  # type: ignore[union-attr]
    assert window.count("small") == 5  # every window of sum(weights) requests


@pytest.mark.parametrize("sticky, facts", [
    ("key", lambda i: Facts(key_=(f"k{i}", "0"))),
    ("user", lambda i: Facts(user_=f"u{i}")),
    ("header:x-session", lambda i: Facts(headers={b"x-session": f"s{i}".encode()})),
])
def test_sticky_split_keeps_subjects_and_moves_few_when_weights_change(sticky: str, facts: Any) -> None:
    def run(w_big: float) -> list[str]:
        t = tree({"name": "ab", "sticky": sticky,
                  "split": [{"to": "big", "weight": w_big}, {"to": "small", "weight": 100 - w_big}]})
        return [t.decide(facts(i)).models[0] for i in range(20000)]  # type: ignore[union-attr]

    a, again, b = run(80), run(80), run(70)
    assert a == again  # the same subject, the same arm
    assert abs(a.count("big") / len(a) - 0.80) < 0.02  # the shares within 2%
    moved = sum(x != y for x, y in zip(a, b, strict=True))
    assert all(x == "big" for x, y in zip(a, b, strict=True) if x != y)  # only from the arm that lost share
    assert abs(moved / len(a) - 0.10) < 0.02  # about the 10% that had to move, no more


def test_rendezvous_ignores_zero_weights() -> None:
    assert {rendezvous(f"s{i}", ["a", "b"], [0.0, 1.0]) for i in range(100)} == {1}


def test_problems_by_path() -> None:
    problems: list[str] = []
    raw = [
        {"name": "a", "when": {"user_regex": "(unclosed", "colour": "red"}, "to": "nope"},
        {"name": "b", "to": "small"},  # matches everything ...
        {"name": "c", "to": "big"},  # ... so this is unreachable
        {"name": "a", "routes": [{"name": "d", "when": {"stream": "yes"}}]},
        {"name": "e", "split": [{"to": "big", "weight": -1}, {"to": "small", "weight": "x"}], "sticky": "ip"},
        {"name": "f", "fallback": ["big"]},
        {"name": "g", "to": "big", "split": []},
    ]
    assert compile_rules(raw, MODELS, problems) is None
    text = "\n".join(problems)
    for needle in ("routes[0].when.user_regex: not a regular expression",
                   "routes[0].when.colour: unknown condition", "routes[0].to: 'nope' is not a served model",
                   "routes[2]: unreachable: routes[1] (b)", "routes[3].name: 'a' names another rule",
                   "routes[3].routes[0].when.stream: expected true or false",
                   "routes[3].routes[0]: needs exactly one of", "routes[4].split[0].weight",
                   "routes[4].split[1].weight", "routes[4].sticky: 'ip'", "routes[5].fallback: expected two",
                   "routes[6]: needs exactly one of"):
        assert needle in text, (needle, problems)


def test_shadow_share_bound_and_problems() -> None:
    t = tree({"name": "m", "to": "small", "shadow": {"to": "big", "share": 25, "max_in_flight": 3}})
    d = t.decide(Facts())
    assert d is not None and d.shadow is not None and d.shadow.to == "big"
    turns = [d.shadow.take() for _ in range(40)]  # nothing ends: 3 copies, then skipped turns
    assert turns.count(True) == 3 and turns.count(None) == 7 and turns.count(False) == 30
    d.shadow.done()
    assert [d.shadow.take() for _ in range(4)] == [False, False, False, True]  # room again: copied
    problems: list[str] = []
    compile_rules([{"name": "a", "to": "small", "shadow": {"to": "nope", "share": 0, "max_in_flight": 0}},
                   {"name": "b", "routes": [{"name": "c", "to": "big"}], "shadow": {"to": "big"}}], MODELS, problems)
    text = "\n".join(problems)
    for needle in ("routes[0].shadow.share", "routes[0].shadow.max_in_flight", "routes[0].shadow.to: 'nope'",
                   "routes[1].shadow: only a leaf"):
        assert needle in text, (needle, problems)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.builds(
    Facts,
    model_=st.sampled_from(["small", "big", "fast", "echo"]),
    prompt=st.integers(0, 6000),
    max_tok=st.integers(1, 3000),
    stream_=st.booleans(),
    headers=st.dictionaries(st.sampled_from([b"x-tier", b"x-exp", b"x-session"]), st.sampled_from([b"gold", b"on", b"s1"])),
    key_=st.tuples(st.sampled_from([None, "tenant1", "t9"]), st.sampled_from([None, "0", "2"])),
    text=st.sampled_from(["hello", "please translate", "python and SQL", "Translation?", ""]),
    user_=st.sampled_from([None, "u1", "u2"]),
), min_size=1, max_size=30))
def test_generated_tree_decides_as_the_walk(facts: list[Facts]) -> None:
    """The generated function against the node walk (each condition its own function), over the
    benchmark's 10-leaf tree: the same leaf, models and split arm for every request in order."""
    from tests.bench.bench_rules import MODELS as BENCH_MODELS
    from tests.bench.bench_rules import TREE as BENCH_TREE

    a, b = compile_rules(BENCH_TREE, BENCH_MODELS, []), compile_rules(BENCH_TREE, BENCH_MODELS, [])
    assert a is not None and b is not None
    for f in facts:
        assert a.decide(f) == b.walk(f), f
