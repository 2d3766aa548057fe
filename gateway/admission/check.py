"""What an admission check is: the :class:`Check` protocol, the request it decides
(:class:`AdmissionContext`) and what an admitted request holds (:class:`Grant`).

How it works: :class:`~gateway.admission.gate.Admission` runs its checks in order on one
request; each reads the context and what the checks before it wrote on the grant (the key's
record, the priority class), then refuses with :class:`~gateway.errors.APIError` holding nothing,
or takes what it must and writes it on the grant. When a later check refuses, the ones that
admitted are undone in reverse order, so a refused request holds nothing anywhere; an admitted
one is released exactly once, by every check, when it ends. Sans-I/O: the clock is ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .keys import KeyRecord
from .ratelimit_headers import Headers
from .rules import Reservation

__all__ = ["AdmissionContext", "Check", "Grant"]


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """What admission needs of a request; ``authorization`` is the raw header value, never logged."""

    authorization: bytes | None
    client: str | None  # client address
    model: str
    route: str
    prompt_tokens: int  # estimate
    max_tokens: int  # output tokens the request may generate
    deadline: float | None = None  # seconds from now
    priority: int | None = None  # hint from the request; may lower the key's class, never raise it
    headers: Sequence[tuple[bytes, bytes]] = ()  # the request's (names lower-case), for checks that read one

    def __repr__(self) -> str:
        auth = "None" if self.authorization is None else "<redacted>"
        return (f"AdmissionContext(authorization={auth}, client={self.client!r}, model={self.model!r}, "
                f"route={self.route!r}, prompt_tokens={self.prompt_tokens}, max_tokens={self.max_tokens}, "
                f"deadline={self.deadline!r}, priority={self.priority!r}, "
                f"headers=<{', '.join(n.decode('latin-1') for n, _ in self.headers)}>)")


@dataclass(slots=True, eq=False)
class Grant:
    """An admitted request: what the checks decided and hold, released once at its end."""

    key_id: str | None  # who (a key id, never the key)
    priority: int  # its shedding class
    headers: Headers  # x-ratelimit-* for the response
    reservation: Reservation | None  # the tokens reserved, settled at release
    pool: str  # the model pool whose slot it holds
    capped_key: str | None  # the key id when its concurrency is capped
    prompt: int  # the prompt-size estimate reserved with the output (release_completion adds it back)
    key: KeyRecord | None = field(default=None, repr=False)  # the key's record (its cap, its own rules)
    released: bool = False  # a second release is an error
    held: dict[str, object] | None = None  # what registered checks hold, by check name (theirs to fill)


class Check(Protocol):
    """One step of admission (see the module doc). ``name`` places it (``Admission.register``'s
    ``before``) and keys what it keeps in ``grant.held``."""

    name: str

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        """Refuse (raise :class:`~gateway.errors.APIError`, holding nothing), or take what the request
        holds and write it on ``grant``."""

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        """A later check refused: give back what :meth:`admit` took at ``now`` (nothing completed)."""

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        """The request ended (once per grant; its prompt estimate counts as used): settle, free."""
