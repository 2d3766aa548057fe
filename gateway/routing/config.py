"""``[routing]`` settings: which policy chooses among a model's replicas."""

from __future__ import annotations

from dataclasses import dataclass

from .cache_aware import CacheAware
from .cache_policy import CostModel
from .health import HealthSettings
from .policy import POLICIES, PrefixAffinity, RoutingPolicy

__all__ = ["RoutingSettings"]


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    policy: str = "least_loaded"  # a name in gateway.routing.policy.POLICIES
    prefix_slack: int = 4  # prefix_affinity: how much busier (requests) a cache hit may be than the idlest
    # cache_aware: a replica takes at most this times the mean requests in flight (+1), however cheap its hit
    cache_load_bound: float = 1.3
    cache_prefill_us_per_token: float = 100.0  # cache_aware's cost model: a prefill token's time on a replica
    cache_step_ms: float = 15.0  # ... and a step's fixed time (a chunk of prefill or a decode)
    cache_index_blocks: int = 1 << 20  # cache_aware: blocks the index keeps per replica at most (memory bound)
    eject_consecutive: int = 5  # failures in a row that eject a replica
    eject_error_rate: float = 0.5  # ... or this share failed of its last 20 (with 10 at least)
    eject_seconds: float = 5.0  # first ejection; times the times ejected, up to 60
    outlier_factor: float = 3.0  # time to first token this many times the pool's median ejects too
    max_ejected_share: float = 0.1  # of a pool at once (at least one replica, never the last)
    retry_budget_share: float = 0.2  # retries in flight per request in flight
    retry_budget_floor: int = 3  # retries in flight always allowed
    heal_error_rate: float = 0.05  # a local replica failing more than this share of its requests ...
    heal_window: float = 300.0  # ... over this many seconds (the write-up's 5% over 5 minutes) ...
    heal_min_requests: int = 20  # ... with at least this many, is drained and restarted (one per pool at once)

    def _validate(self, p: list[str]) -> None:
        if self.policy not in POLICIES:
            p.append(f"routing.policy: {self.policy!r} is not one of {', '.join(sorted(POLICIES))}")
        if self.prefix_slack < 0:
            p.append("routing.prefix_slack: must be >= 0")
        if not self.cache_load_bound >= 1 or not self.cache_prefill_us_per_token > 0 or not self.cache_step_ms >= 0:
            p.append("routing.cache_load_bound must be >= 1, cache_prefill_us_per_token > 0, cache_step_ms >= 0")
        if self.cache_index_blocks < 1:
            p.append("routing.cache_index_blocks: must be >= 1")
        for name in ("eject_consecutive", "retry_budget_floor", "heal_min_requests"):
            if getattr(self, name) < 1:
                p.append(f"routing.{name}: must be >= 1")
        for name in ("eject_error_rate", "max_ejected_share", "retry_budget_share", "heal_error_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                p.append(f"routing.{name}: must be in [0, 1]")
        if not self.eject_seconds > 0 or not self.outlier_factor > 1 or not self.heal_window > 0:
            p.append("routing.eject_seconds and heal_window must be > 0, and routing.outlier_factor > 1")

    def health(self) -> HealthSettings:
        return HealthSettings(consecutive=self.eject_consecutive, error_rate=self.eject_error_rate,
                              base_ejection=self.eject_seconds, outlier_factor=self.outlier_factor,
                              max_ejected_share=self.max_ejected_share, retry_budget_share=self.retry_budget_share,
                              retry_budget_floor=self.retry_budget_floor, heal_error_rate=self.heal_error_rate,
                              heal_window=self.heal_window, heal_min_requests=self.heal_min_requests)

    def build(self) -> RoutingPolicy:
        cls = POLICIES[self.policy]
        if cls is CacheAware:
            cost = CostModel(prefill_s=self.cache_prefill_us_per_token / 1e6, decode_s=self.cache_step_ms / 1e3)
            return CacheAware(cost, self.cache_load_bound, self.cache_index_blocks)
        return PrefixAffinity(self.prefix_slack) if cls is PrefixAffinity else cls()
