"""Stop strings over text deltas split anywhere."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.stop import StopMatcher


def feed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_split_over_pieces() -> None:
    assert feed(["</end>"], ["abc</", "en", "d>tail"]) == ("abc", True)
    assert feed(["</end>"], ["abc</", "en", "x"]) == ("abc</enx", False)
    assert feed(["ab", "b"], ["xa", "b"]) == ("x", True)  # earliest match wins
    assert feed(["abc", "b"], ["ab", "c"]) == ("a", True)  # the first to complete ends it


def test_held_text_is_exactly_a_stop_prefix() -> None:
    m = StopMatcher(["hello"])
    assert m.push("oh hel") == ("oh ", False)
    assert m.push("p") == ("help", False)


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_any_split_matches_prefix_search(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:], strict=False)]
    # Reference: stop at the first piece after which the text so far contains a
    # stop string; cut at the earliest one found then.
    expected = (text, False)
    for end in points[1:]:
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            expected = (text[: min(hits)], True)
            break
    assert feed(stops, pieces) == expected
