"""Whole results (``Submit.buffered``): what the option means, on both sides of the flow core.

How it works
------------
A gateway that wants a request's result in one piece (a non-streaming
response, read once at its end) sets ``Submit.buffered``. The flow core
(:mod:`transport.flow`) carries the option without knowing what it means; this
module gives it its meaning:

* **Credit does not apply** to such a request (its consumer takes everything at
  the end; ``max_tokens`` bounds it): both sides open its window as
  :data:`~transport.flow.UNLIMITED` -- the gateway when it submits
  (:func:`window`, used by ``ClientConnection.submit``), the worker when the
  Submit arrives (:meth:`ResultHold.observe`). That window is all the core is
  told.
* **The worker holds its tokens** (:class:`ResultHold`, a sans-I/O layer between
  the engine and the worker's core): they are kept out of the step batches and,
  when the request ends, sent as one entry right before its FINISH/ERROR.
  Results that end together (one engine step's) share one TOKENS frame:
  :meth:`ResultHold.flush` runs before the endpoint takes the core's bytes, and
  before anything else is sent through the layer, so frames keep the order their
  messages were sent in. A request the gateway cancelled keeps nothing and sends
  only its end.

The gateway reads such a stream in collect mode (``ClientStream.collect``): one
wake-up per request.
"""

from __future__ import annotations

from array import array

from .flow import UNLIMITED, CancelReceived, ConnectionEnded, Event, FlowConnection, SubmitReceived
from .messages import Error, Finish, Stats, Submit, TokenBatch

__all__ = ["ResultHold", "window"]


def window(submit: Submit) -> int | None:
    """The token window ``submit`` opens with: :data:`UNLIMITED` for a whole result, None for the
    connection's initial credit."""
    return UNLIMITED if submit.buffered or submit.echo else None  # echo: the prompt's entry is not output


class _Held:
    """What a held request has produced so far (sent when it ends)."""

    __slots__ = ("tokens", "text", "dropped")

    def __init__(self) -> None:
        self.tokens: array[int] = array("I")
        self.text: list[bytes] = []
        self.dropped = False  # cancelled by the gateway: keep nothing, send nothing


class ResultHold:
    """The worker's sends to one gateway, through the core, holding whole results (module docstring).

    Sends go through :meth:`send_tokens`, :meth:`send_finish`, :meth:`send_error` and
    :meth:`send_stats` (the core's own, with the same rules); the core's events go through
    :meth:`observe` before the engine sees them; :meth:`flush` before the core's bytes are taken.
    """

    __slots__ = ("core", "_held", "_ending")

    def __init__(self, core: FlowConnection) -> None:
        self.core = core
        self._held: dict[int, _Held] = {}  # open requests whose result is held -> their tokens so far
        self._ending: list[tuple[_Held, Finish | Error]] = []  # held results ended, not yet in the core

    def observe(self, events: list[Event]) -> None:
        """The core's events: a Submit for a whole result opens without credit and is held; a
        cancelled one drops what it holds; a closed connection forgets everything."""
        for ev in events:
            t = type(ev)
            if t is SubmitReceived:
                sub = ev.submit  # type: ignore[union-attr]
                if sub.buffered:
                    self._held[sub.request_id] = _Held()
                    self.core.set_window(sub.request_id, UNLIMITED)
                elif sub.echo:  # its first entry is the prompt, outside credit (transport.wire: Tasks)
                    self.core.set_window(sub.request_id, UNLIMITED)
            elif t is CancelReceived:
                h = self._held.get(ev.request_id)  # type: ignore[union-attr]
                if h is not None:
                    h.dropped = True  # the gateway ended it: its tokens will never be read
            elif t is ConnectionEnded:
                self._held.clear()
                self._ending.clear()

    @property
    def holding(self) -> int:
        """Requests whose result is held now (ended ones not yet flushed included)."""
        return len(self._held) + len(self._ending)

    def send_tokens(self, batch: TokenBatch) -> None:
        """One engine step's tokens; entries of held requests are kept until they end."""
        if self._ending:
            self.flush()
        if self._held:
            rest = self._hold(batch)
            if rest is None:
                return
            batch = rest
        self.core.send_tokens(batch)

    def send_finish(self, finish: Finish) -> None:
        self._end(finish)

    def send_error(self, error: Error) -> None:
        """A request's error (its end), or ``request_id`` 0: the connection's (what is held and
        ended goes out first)."""
        if error.request_id == 0:
            self.flush()
            self.core.send_error(error)
            return
        self._end(error)

    def send_stats(self, stats: Stats) -> None:
        if self._ending:
            self.flush()
        self.core.send_stats(stats)

    def flush(self) -> None:
        """Every held result that ended: one TOKENS frame, then their FINISH/ERROR frames."""
        ending, self._ending = self._ending, []
        if not ending:
            return
        rids, counts, toks, tlens = array("I"), array("I"), array("I"), array("I")
        texts: list[bytes] = []
        for h, msg in ending:
            text = b"".join(h.text)
            rids.append(msg.request_id)
            counts.append(len(h.tokens))
            toks += h.tokens
            tlens.append(len(text))
            texts.append(text)
        core = self.core
        core.send_tokens(TokenBatch(rids, counts, toks, tlens, b"".join(texts)))
        for _, msg in ending:
            if type(msg) is Finish:
                core.send_finish(msg)
            else:
                core.send_error(msg)  # type: ignore[arg-type]

    def _end(self, msg: Finish | Error) -> None:
        h = self._held.pop(msg.request_id, None)
        if h is not None and (h.tokens or h.text) and not h.dropped:  # its tokens go right before its end
            self._ending.append((h, msg))  # those ending together share one TOKENS frame
            return
        if self._ending:
            self.flush()
        if type(msg) is Finish:
            self.core.send_finish(msg)
        else:
            self.core.send_error(msg)  # type: ignore[arg-type]

    def _hold(self, batch: TokenBatch) -> TokenBatch | None:
        """Keep the entries of held requests; return the rest (None if nothing is left).

        Held streams never have logprobs (the wire refuses a buffered Submit that asks for
        them), so the packed logprob arrays belong to the entries that stay and pass through.
        """
        held = self._held
        rids = batch.request_ids
        if not any(rid in held for rid in rids):
            return batch
        counts, toks, tlens, text = batch.counts, batch.token_ids, batch.text_lens, batch.text
        k_rids, k_counts, k_toks, k_tlens = array("I"), array("I"), array("I"), array("I")
        k_text: list[bytes] = []
        k_idx: list[int] = []
        if getattr(toks, "typecode", "") != "I":
            toks = array("I", toks)
        t = s = 0
        for i, rid in enumerate(rids):
            n = counts[i]
            ln = tlens[i] if tlens else 0
            h = held.get(rid)
            if h is not None:
                if not h.dropped:  # a cancelled one keeps nothing
                    if n == 1:
                        h.tokens.append(toks[t])
                    else:
                        h.tokens.extend(toks[t : t + n])
                    if ln:
                        h.text.append(bytes(text[s : s + ln]))
            else:
                k_idx.append(i)
                k_rids.append(rid)
                k_counts.append(n)
                k_toks.extend(toks[t : t + n])
                k_tlens.append(ln)
                k_text.append(bytes(text[s : s + ln]))
            t += n
            s += ln
        if not k_idx:
            return None
        has_lp, top_ns = batch.has_logprobs, batch.top_ns
        return TokenBatch(
            k_rids, k_counts, k_toks, k_tlens, b"".join(k_text),
            array("B", [has_lp[i] for i in k_idx]) if len(has_lp) else has_lp,
            array("B", [top_ns[i] for i in k_idx]) if len(top_ns) else top_ns,
            batch.logprobs, batch.top_ids, batch.top_logprobs,
        )
