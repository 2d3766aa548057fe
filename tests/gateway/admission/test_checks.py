"""Admission as a list of checks: a check added through the public API (one class, one register
call) runs in the pipeline's admit, refuses with nothing held anywhere, and is released once."""

from __future__ import annotations

import pytest

from gateway.admission import Admission, AdmissionContext, AdmissionSettings, Grant
from gateway.api.params import GenerationRequest, parse_chat
from gateway.errors import APIError
from gateway.http.types import Request

ROUTE = "/v1/chat/completions"


class TenantCheck:
    """The example check of docs/ARCHITECTURE.md's recipe, kept here: refuses a blocked tenant
    (``x-tenant`` header) with 403 and counts each tenant's requests in flight."""

    name = "tenant"

    def __init__(self, blocked: bytes) -> None:
        self.blocked = blocked
        self.in_flight: dict[bytes, int] = {}
        self.undone = 0

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        tenant = next((v for n, v in ctx.headers if n == b"x-tenant"), b"")
        if tenant == self.blocked:
            raise APIError(403, "This tenant may not use the API.", "invalid_request_error", None, "tenant_blocked")
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        if grant.held is None:
            grant.held = {}
        grant.held[self.name] = tenant

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        self.undone += 1
        self._leave(grant)

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        self._leave(grant)

    def _leave(self, grant: Grant) -> None:
        assert grant.held is not None
        tenant = grant.held[self.name]
        assert isinstance(tenant, bytes)
        self.in_flight[tenant] -= 1


class Refuse:
    """A check that refuses every request with 503 (to see what the checks before it leave)."""

    name = "refuse"

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        raise APIError(503, "no", "server_error", None, "overloaded", 1.0)

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        raise AssertionError("a refusing check holds nothing")

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        raise AssertionError("never admitted")


def _call(tenant: bytes | None = None, *, key: str | None = None, max_tokens: int = 16
          ) -> tuple[Request, GenerationRequest]:
    headers = [(b"host", b"gw"), (b"content-type", b"application/json")]
    if tenant is not None:
        headers.append((b"x-tenant", tenant))
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key.encode()))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return (Request("POST", ROUTE, "", headers, b"", "http/1.1", "http", ("10.0.0.1", 5000)),
            parse_chat(body, default_max_tokens=16, max_tokens_limit=4096))


def _limited() -> Admission:
    return Admission.from_settings(AdmissionSettings(limits=["client requests 3/1s", "model tokens 1000/1s"]))


def test_a_registered_check_runs_in_the_pipelines_admit_and_is_released_once() -> None:
    adm = _limited()
    tenants = TenantCheck(b"blocked")
    adm.register(tenants)
    assert [c.name for c in adm.checks] == ["shed", "limits", "tenant"]
    with pytest.raises(APIError) as refused:
        adm.admit_call(*_call(b"blocked"), 0.0)
    assert (refused.value.status, refused.value.code) == (403, "tenant_blocked")
    # the slot and the units the checks before it took are given back: 3 requests still fit the second
    assert adm.outstanding() == 0 and tenants.in_flight == {}
    grants = [adm.admit_call(*_call(b"acme"), 0.0) for _ in range(3)]
    assert tenants.in_flight == {b"acme": 3} and adm.outstanding() == 3
    assert dict(grants[-1].headers)[b"x-ratelimit-remaining-requests"] == b"0"
    assert dict(grants[0].headers)[b"x-ratelimit-remaining-tokens"] == b"%d" % (1000 - grants[0].prompt - 16)
    for g in grants:
        adm.release_completion(g, 4, 0.1)
    assert tenants.in_flight == {b"acme": 0} and adm.outstanding() == 0 and tenants.undone == 0
    with pytest.raises(RuntimeError, match="twice"):
        adm.release_completion(grants[0], 4, 0.2)
    assert tenants.in_flight == {b"acme": 0}


def test_a_cheap_check_goes_first_and_a_late_refusal_undoes_every_check_before_it() -> None:
    adm = _limited()
    tenants = TenantCheck(b"blocked")
    adm.register(tenants, before="shed")
    adm.register(Refuse())
    assert [c.name for c in adm.checks] == ["tenant", "shed", "limits", "refuse"]
    for _ in range(5):  # more than the client's 3 requests: each one's take was undone
        with pytest.raises(APIError) as refused:
            adm.admit_call(*_call(b"acme"), 0.0)
        assert refused.value.status == 503
    assert tenants.undone == 5 and tenants.in_flight == {b"acme": 0} and adm.outstanding() == 0
    assert adm.shedder.shed == 0  # the shedder admitted each time; nothing was counted as shed
    requests, tokens = adm.limits.tables()
    assert requests.items["10.0.0.1"].remaining(0.0) == 3 and tokens.items["tiny"].remaining(0.0) == 1000


def test_register_names_each_check_once() -> None:
    adm = _limited()
    adm.register(TenantCheck(b"x"))
    with pytest.raises(ValueError, match="registered already"):
        adm.register(TenantCheck(b"y"))
    with pytest.raises(ValueError, match="no admission check named 'keys'"):
        adm.register(Refuse(), before="keys")  # auth is off: no key check


def test_the_usual_case_never_reaches_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """admit_call's fast path stays: once a pool and its limiters exist, the usual request is
    admitted without :meth:`Admission.admit`; a registered check sends every request there."""
    adm = _limited()
    adm.release_completion(adm.admit_call(*_call(), 0.0), 1, 0.0)  # creates the pool and the limiters
    general: list[AdmissionContext] = []
    admit = Admission.admit

    def counted(self: Admission, ctx: AdmissionContext, now: float) -> Grant:
        general.append(ctx)
        return admit(self, ctx, now)

    monkeypatch.setattr(Admission, "admit", counted)
    adm.release_completion(adm.admit_call(*_call(), 0.001), 1, 0.001)
    assert general == []
    adm.register(TenantCheck(b"blocked"))
    adm.release_completion(adm.admit_call(*_call(b"acme"), 0.002), 1, 0.002)
    assert [ctx.headers[-1] for ctx in general] == [(b"x-tenant", b"acme")]
