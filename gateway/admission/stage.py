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
from typing import TYPE_CHECKING, cast

from .check import Grant
from .gate import PRIORITY_OF_TIER, Admission

if TYPE_CHECKING:
    from ..api.params import GenerationRequest
    from ..http.types import Request

__all__ = ["AdmissionStageAdapter", "PRIORITY_OF_TIER"]


class AdmissionStageAdapter:
    """``AdmissionStage`` over :class:`Admission`. Its three members are the callables themselves
    (the façade's bound methods, a C attribute getter), not methods that forward: each forward was
    a Python frame per request."""

    __slots__ = ("admission", "admit", "headers", "release")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        # (request, parsed request, now, deadline) -> a Grant, or APIError
        self.admit: Callable[[Request, GenerationRequest, float, float | None], Grant] = admission.admit_call
        # (grant) -> its x-ratelimit-* headers
        self.headers = cast(Callable[[object], tuple[tuple[bytes, bytes], ...]], operator.attrgetter("headers"))
        # (grant, completion tokens, now), once; the prompt estimate it reserved counts as used
        self.release: Callable[[object, int, float], None] = admission.release_completion
