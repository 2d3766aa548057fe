"""The admission stage of the request pipeline: :class:`~gateway.admission.gate.Admission`
behind the pipeline's :class:`~gateway.api.generate.AdmissionStage` seam.

The pipeline calls :meth:`AdmissionStageAdapter.admit` once per generation request, after
parsing (admission needs the model, the prompt-size estimate and ``max_tokens``) and before
routing, and :meth:`~AdmissionStageAdapter.release` exactly once when the request ends. A
refusal is an :class:`~gateway.errors.APIError` (401/403/429/503, with ``Retry-After`` and the
``x-ratelimit-*`` headers), rendered by the route's writer like any other error; an admitted
request's ``x-ratelimit-*`` headers go on its response.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import cast

from ..api.openai import prompt_estimate
from ..api.params import GenerationRequest
from ..http.types import Request
from .gate import Admission, Grant

__all__ = ["AdmissionStageAdapter", "PRIORITY_OF_TIER"]

# OpenAI's service_tier as a priority hint (it may lower a key's class, never raise it)
PRIORITY_OF_TIER = {"flex": 0, "default": 1, "auto": 1, "priority": 2}


class AdmissionStageAdapter:
    """``AdmissionStage`` over :class:`Admission`. ``headers`` and ``release`` are the callables
    themselves (a C item getter, the façade's bound method), not methods that forward: each forward
    was a Python frame per request."""

    __slots__ = ("admission", "headers", "release")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        # (grant) -> its x-ratelimit-* headers
        self.headers = cast(Callable[[object], tuple[tuple[bytes, bytes], ...]], operator.itemgetter(2))
        assert Grant._fields[2] == "headers"
        # (grant, completion tokens, now), once; the prompt estimate it reserved counts as used
        self.release: Callable[[object, int, float], None] = admission.release_completion

    def admit(self, req: Request, g: GenerationRequest, now: float) -> Grant:
        adm = self.admission
        client = req.client
        tier = g.service_tier
        return adm.admit_request(req.header(b"authorization") if adm.auth_required else None,
                                 None if client is None else client[0], g.model, req.path, prompt_estimate(g),
                                 g.params.max_tokens, None if tier is None else PRIORITY_OF_TIER.get(tier), now)
