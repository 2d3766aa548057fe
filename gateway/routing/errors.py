"""Routing errors: why no replica took a request. The edge renders them (``gateway.errors.from_routing``);
routing never speaks HTTP."""

from __future__ import annotations

__all__ = ["RoutingError", "UnknownModel", "NoReplica", "Unroutable"]


class RoutingError(Exception):
    """No replica can take this request."""


class UnknownModel(RoutingError):
    """No worker has ever announced the model (while some worker has announced something)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"unknown model {model!r}")
        self.model = model


class NoReplica(RoutingError):
    """The model is known, but no replica serving it can take a request now."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no ready replica for {model!r}")
        self.model = model


class Unroutable(RoutingError):
    """The request breaks a wire rule (an encoder check): no replica could ever take it."""
