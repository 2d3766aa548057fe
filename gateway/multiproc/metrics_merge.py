"""The gateway's ``/metrics`` from several processes' expositions (sans-I/O).

Each process counts what it served, so its counters, histograms and amounts in flight add up
across processes; some series are facts every process reports alike (a worker's own Stats, the
workers configured, a replica's breaker, a rollout's state): those are taken once, from the
first exposition that has them (the scraped process's own, live: the freshest). ``_created``
samples keep the earliest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["merge_expositions", "shared_fact"]

_PER_PROCESS = frozenset({"quicserve_worker_in_flight"})  # this process's requests on a worker: they add up
_SHARED_PREFIXES = ("quicserve_worker_", "quicserve_workers_", "quicserve_replica_state", "quicserve_rollout_",
                    "quicserve_retry_amplification")


def shared_fact(family: str) -> bool:
    """Whether every process reports ``family`` alike (taken once) rather than its own share (added)."""
    return family not in _PER_PROCESS and family.startswith(_SHARED_PREFIXES)


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """One exposition whose samples are the processes' added up (or taken once, see the module)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text.decode()):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            once = shared_fact(fam.name)
            acc = values[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = acc.get(key)
                if old is None:
                    acc[key] = s.value
                elif s.name.endswith("_created"):
                    acc[key] = min(old, s.value)
                else:
                    acc[key] = old if once else old + s.value
    for name, fam in families.items():
        for (sample, labels), value in values[name].items():
            fam.add_sample(sample, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry)
