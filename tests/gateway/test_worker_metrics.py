"""Worker Stats as gauges on the gateway's /metrics: KV usage, prefix hits, token rate."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import GatewayMetrics
from transport.messages import Hello, Stats


def _conn(identity: str, stats: Stats | None) -> SimpleNamespace:
    return SimpleNamespace(peer_hello=Hello(role="worker", identity=identity, models=("tiny",)), in_flight=2,
                           latest_stats=stats)


def test_worker_stats_become_gauges() -> None:
    m = GatewayMetrics()
    conns = [_conn("w0", Stats(queue_depth=1, running=3, kv_blocks_free=25, kv_blocks_total=100,
                                prefix_hit_rate=0.375, tokens_per_s=512.0, steps=40, step_seconds=0.5,
                                step_sequences=120, preemptions=2, batch_window_s=0.004)),
             _conn("w1", Stats(queue_depth=0, running=0, kv_blocks_free=0, kv_blocks_total=0)),  # no cache
             _conn("w2", None)]  # no Stats yet: no gauges but in-flight
    m.watch_workers(lambda: conns)
    got = {(s.name, s.labels.get("worker")): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert got[("quicserve_worker_kv_usage_ratio", "w0")] == 0.75
    assert ("quicserve_worker_kv_usage_ratio", "w1") not in got  # 0 of 0 blocks is no usage figure
    assert got[("quicserve_worker_kv_blocks", "w0")] == 100
    assert got[("quicserve_worker_prefix_hit_ratio", "w0")] == 0.375
    assert got[("quicserve_worker_tokens_per_second", "w0")] == 512.0
    assert got[("quicserve_worker_in_flight", "w2")] == 2 and ("quicserve_worker_running", "w2") not in got
    # engine counters: Prometheus counters (the _total series), a rate ratio gives step time and batch size
    assert got[("quicserve_worker_steps_total", "w0")] == 40
    assert got[("quicserve_worker_step_seconds_total", "w0")] == 0.5
    assert got[("quicserve_worker_step_sequences_total", "w0")] == 120
    assert got[("quicserve_worker_preemptions_total", "w0")] == 2
    assert got[("quicserve_worker_batch_window_seconds", "w0")] == 0.004
    models = {(s.labels["worker"], s.labels["model"]) for fam in text_string_to_metric_families(m.render().decode())
              for s in fam.samples if s.name == "quicserve_worker_info"}
    assert models == {("w0", "tiny"), ("w1", "tiny"), ("w2", "tiny")}
