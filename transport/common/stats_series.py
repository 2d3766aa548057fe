"""A worker's :class:`~transport.messages.Stats` as Prometheus series: one table, two exporters.

Why here: the gateway's ``/metrics`` exports every connected worker's Stats, and a
remote worker serves its own ``/metrics`` for scrapers that do not go through a
gateway; both must use the same names, kinds and help texts, and imports flow
``gateway -> transport <- inference``. Pure data: no prometheus_client here.

Counters are the worker's own cumulative counts (they restart at 0 with the worker,
which Prometheus' rate() treats as a reset); rates of steps, step seconds and step
sequences give the mean step time and batch size over any window.
"""

from __future__ import annotations

from collections.abc import Callable

from ..messages import Stats

__all__ = ["STATS_SERIES"]

STATS_SERIES: tuple[tuple[str, str, str, Callable[[Stats], float | None]], ...] = (
    # (name, "gauge" | "counter", help, value; None leaves the series out)
    ("quicserve_worker_running", "gauge", "Sequences running, the batch size (worker Stats)", lambda s: s.running),
    ("quicserve_worker_queue_depth", "gauge", "Requests waiting (worker Stats)", lambda s: s.queue_depth),
    ("quicserve_worker_kv_blocks_free", "gauge", "Free KV blocks (worker Stats)", lambda s: s.kv_blocks_free),
    ("quicserve_worker_kv_blocks", "gauge", "KV blocks in the cache (worker Stats)", lambda s: s.kv_blocks_total),
    ("quicserve_worker_kv_usage_ratio", "gauge", "Fraction of KV blocks in use, 0-1 (worker Stats)",
     lambda s: 1.0 - s.kv_blocks_free / s.kv_blocks_total if s.kv_blocks_total > 0 else None),
    ("quicserve_worker_prefix_hit_ratio", "gauge",
     "Fraction of prompt tokens served from the prefix cache since the worker started, 0-1 (worker Stats)",
     lambda s: s.prefix_hit_rate),
    ("quicserve_worker_tokens_per_second", "gauge", "Tokens generated per second, recent average (worker Stats)",
     lambda s: s.tokens_per_s),
    ("quicserve_worker_batch_window_seconds", "gauge", "Batch window in effect (worker Stats)",
     lambda s: s.batch_window_s),
    ("quicserve_worker_steps", "counter", "Engine steps run (worker Stats)", lambda s: s.steps),
    ("quicserve_worker_step_seconds", "counter", "Wall time of engine steps, schedule to commit (worker Stats)",
     lambda s: s.step_seconds),
    ("quicserve_worker_step_sequences", "counter", "Sequences carried by engine steps (worker Stats)",
     lambda s: s.step_sequences),
    ("quicserve_worker_preemptions", "counter", "Sequences preempted for KV space (worker Stats)",
     lambda s: s.preemptions),
)
