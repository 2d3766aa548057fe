"""Stop strings over a stream of text deltas (pure logic).

A stop string may be split across tokens, so the matcher holds back the
longest tail of the text seen so far that is still a prefix of some stop
string; that tail is released once it can no longer start a match, or at the
end of the request. The stop string itself is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    __slots__ = ("_stops", "_held", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return buf[:cut], True
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held text (the request ended for another reason)."""
        held, self._held = self._held, ""
        return held
