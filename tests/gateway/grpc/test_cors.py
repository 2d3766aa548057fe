"""CORS headers for gRPC-Web callers in browsers."""

from __future__ import annotations

from gateway.grpc.cors import preflight_headers, response_headers


def test_preflight_allows_post_with_the_grpc_web_headers() -> None:
    h = dict(preflight_headers(b"https://app.example"))
    assert h[b"access-control-allow-origin"] == b"*"
    assert b"POST" in h[b"access-control-allow-methods"]
    allowed = set(h[b"access-control-allow-headers"].split(b","))
    assert {b"content-type", b"x-grpc-web", b"grpc-timeout", b"x-user-agent"} <= allowed


def test_responses_expose_grpc_status_and_message() -> None:
    h = dict(response_headers(b"https://app.example"))
    assert {b"grpc-status", b"grpc-message"} <= set(h[b"access-control-expose-headers"].split(b","))


def test_an_allow_list_echoes_allowed_origins_and_refuses_others() -> None:
    allowed = {b"https://app.example"}
    assert dict(preflight_headers(b"https://app.example", allowed))[b"access-control-allow-origin"] == \
        b"https://app.example"
    assert preflight_headers(b"https://evil.example", allowed) == []
    assert response_headers(b"https://evil.example", allowed) == []
    assert response_headers(None) == []  # same-origin requests carry no Origin
