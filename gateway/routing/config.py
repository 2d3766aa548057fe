"""``[routing]`` settings: which policy chooses among a model's replicas."""

from __future__ import annotations

from dataclasses import dataclass

from .policy import POLICIES, PrefixAffinity, RoutingPolicy

__all__ = ["RoutingSettings"]


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    policy: str = "least_loaded"  # a name in gateway.routing.policy.POLICIES
    prefix_slack: int = 4  # prefix_affinity: how much busier (requests) a cache hit may be than the idlest

    def _validate(self, p: list[str]) -> None:
        if self.policy not in POLICIES:
            p.append(f"routing.policy: {self.policy!r} is not one of {', '.join(sorted(POLICIES))}")
        if self.prefix_slack < 0:
            p.append("routing.prefix_slack: must be >= 0")

    def build(self) -> RoutingPolicy:
        cls = POLICIES[self.policy]
        return PrefixAffinity(self.prefix_slack) if cls is PrefixAffinity else cls()
