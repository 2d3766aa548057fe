"""Answers about a prompt from a worker of its model (#31): what ``/v1/embeddings``, ``/tokenize``
and ``/detokenize`` share.

The gateway may not hold the model's checkpoint (or its tokenizer), so a worker answers: the
request goes through the model's pool like a generation (routing policy, retry before an answer),
as a Submit whose ``task`` says what is asked (transport.wire: "Tasks"), answered by one entry and
FINISH. Only a worker whose Hello lists ``"tasks"`` can (an older one would generate instead).
Each route is a coroutine (:func:`~gateway.http.common.task_entrance`) behind the same API-key
check as every ``/v1`` route and the same drain refusal as a generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from transport.messages import Finish, SamplingParams, TokenEntry

from .. import clock
from ..admission.keys import KeyStore
from ..errors import APIError, from_routing, from_wire_code
from ..http.common import task_entrance
from ..http.types import Entrance, Request, ResponseSink
from ..observability.metrics import GatewayMetrics
from ..routing.errors import RoutingError
from ..routing.pool import ModelPool
from .config import ApiSettings
from .params import GenerationRequest

__all__ = ["PromptAnswer", "PromptTasks", "TASKS"]

TASKS = "tasks"  # the worker capability
_PARAMS = SamplingParams(max_tokens=1)  # not read by a task; one shared instance


@dataclass(slots=True)
class PromptAnswer:
    """A worker's answer: the entry's token ids and text, and its FINISH (``prompt_tokens``)."""

    token_ids: list[int]
    text: str
    finish: Finish
    max_model_len: int  # the answering worker's context (its Hello)


Route = Callable[[Request], Awaitable[tuple[int, bytes]]]


class PromptTasks:
    """The routes' shared part: key check, drain refusal, one question to a worker of the model."""

    def __init__(self, pool: ModelPool, api: ApiSettings, keys: Callable[[], KeyStore | None],
                 draining: Callable[[], bool], metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics  # each request's route, status and time, as every route's
        self.api = api
        self._keys = keys
        self._draining = draining

    def entrance(self, route: Route) -> Entrance:
        """``route`` (request -> status, JSON body) as an entrance, after the key check."""

        async def handle(req: Request, sink: ResponseSink) -> None:
            t0 = clock.now()
            status = 500
            try:
                status, body = await answer(req)
            except APIError as e:
                status = e.status
                raise
            except asyncio.CancelledError:
                status = 499  # the client went away
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.request_done(req.path, status, req.protocol, clock.now() - t0)
            sink.respond(status, [(b"content-type", b"application/json")], body)

        async def answer(req: Request) -> tuple[int, bytes]:
            keys = self._keys()
            if keys is not None:
                keys.maybe_reload(clock.now())
                keys.authenticate(req.header(b"authorization"))
            if self._draining():
                raise APIError(503, "The server is shutting down; retry on another instance.", "server_error", None,
                               "shutting_down", retry_after=1.0)
            if req.method != "POST":
                raise APIError(405, f"Method {req.method} is not allowed for {req.path}; allowed: POST.",
                               "invalid_request_error", None, "method_not_allowed", headers=((b"allow", b"POST"),))
            return await route(req)

        return task_entrance(handle)

    def request(self, model: str, **fields: object) -> GenerationRequest:
        """A request of ``model`` carrying ``fields`` (task, prompt, ...), with the API's deadline."""
        g = GenerationRequest(False, model, _PARAMS, False, False, deadline_ms=int(self.api.request_timeout * 1000))
        for k, v in fields.items():
            setattr(g, k, v)
        return g

    async def ask(self, g: GenerationRequest) -> PromptAnswer:
        """``g``'s answer from a worker of its model (an APIError if there is none, or it fails)."""
        try:
            return await asyncio.wait_for(self._ask(g), self.api.request_timeout)
        except TimeoutError:
            raise APIError(504, f"The request did not finish within {self.api.request_timeout:g} s.", "server_error",
                           None, "timeout") from None

    async def _ask(self, g: GenerationRequest) -> PromptAnswer:
        if self.pool.aliases:
            g.model = self.pool.canonical(g.model)
        try:
            routed = self.pool.open(g.model, g.make_submit, g)
        except RoutingError as e:
            raise from_routing(e) from None
        try:
            while True:
                conn, stream = routed.conn, routed.stream
                if conn is not None and TASKS not in conn.peer_hello.capabilities:
                    raise APIError(501, f"The worker serving `{g.model}` predates this route; upgrade it.",
                                   "server_error", None, "unsupported_by_worker")
                assert stream is not None
                ids: list[int] = []
                text = bytearray()
                final: object = None
                while final is None:
                    for ev in await stream.next_events():
                        if type(ev) is TokenEntry:
                            ids.extend(ev.token_ids)
                            text += ev.text
                        else:
                            final = ev
                if type(final) is Finish:
                    hello = conn.peer_hello if conn is not None else None
                    return PromptAnswer(ids, text.decode("utf-8", "replace"), final,
                                        hello.max_model_len if hello is not None else 0)
                if routed.retry(final):  # its worker was lost before answering: another one
                    continue
                raise from_wire_code(final.code, final.message)  # type: ignore[attr-defined]
        finally:
            routed.close()
