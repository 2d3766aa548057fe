"""``cache_aware``'s counters on ``/metrics``, read at scrape time (nothing on the request path).

* ``quicserve_cache_routing_unhashed_total``: requests routed by load alone, their prompt not
  hashable here (no tokenizer for the model, a template error, a token id out of range).
* ``quicserve_cache_routing_resyncs_total``: KV event resubscriptions (a gap in a replica's batch
  sequence, or its Stats naming a batch never seen; a new epoch is one too).
* ``quicserve_cache_routing_epochs_total``: replicas' index entries emptied by a new epoch (a
  worker's cache reset or restart, seen in its events or Stats).
* ``quicserve_cache_index_hashes``: distinct block hashes the index holds now (bounded by
  ``cache_index_blocks`` per replica).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .cache_aware import CacheAware
from .pool import ModelPool

__all__ = ["cache_routing_metrics"]


def cache_routing_metrics(pool: ModelPool) -> Iterator[Metric]:
    """The pool's cache-aware figures (none for another policy)."""
    policy = pool.policy
    if not isinstance(policy, CacheAware):
        return
    feed = policy.feed
    yield CounterMetricFamily("quicserve_cache_routing_unhashed", "Requests cache_aware routed by load alone (the "
                              "prompt could not be hashed here)", value=policy.unhashed)
    yield CounterMetricFamily("quicserve_cache_routing_resyncs", "KV event resubscriptions after a gap, a Stats "
                              "kv_seq past the last batch seen, or a new epoch", value=feed.resyncs)
    yield CounterMetricFamily("quicserve_cache_routing_epochs", "Replicas' index entries emptied by a new epoch "
                              "(a worker's cache reset or restart)", value=feed.epochs)
    yield GaugeMetricFamily("quicserve_cache_index_hashes", "Distinct prefix block hashes the cache index holds",
                            value=len(policy.index))
