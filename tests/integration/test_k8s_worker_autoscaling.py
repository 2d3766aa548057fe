"""config/k8s worker autoscaling (#35), rendered and checked against the code: the HPA scales the worker
StatefulSet on the metric the gateways export (its name, its label, the model the workers serve),
with a scale-down stabilisation window; the gateways' settings turn the signal on without starting
workers of their own; the PodDisruptionBudget and the grace period keep a worker's drain whole; the
workers keep their compilation cache on their volume. (Schema validation of every rendered document:
tests/integration/test_k8s_manifests.py, which renders these too.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.cli import _serve_overrides, build_parser
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import load_settings
from gateway.workers.elastic_metrics import DESIRED_REPLICAS, ElasticCollector, PoolFigures
from inference.worker import DRAIN_TIMEOUT
from inference.worker import parse_args as parse_worker_args
from tests.integration.test_k8s_manifests import K8S, _container, container_env, find, render, validate

WORKER = ("StatefulSet", "quicserve-worker")


@pytest.fixture(scope="module", params=["base", "overlays/example"])
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(K8S / request.param)


def test_the_worker_hpa_scales_the_statefulset_on_the_gateways_signal(docs: list[dict[str, Any]]) -> None:
    hpa = find(docs, "HorizontalPodAutoscaler", "quicserve-worker")
    ref = hpa["spec"]["scaleTargetRef"]
    sts = find(docs, ref["kind"], ref["name"])
    assert (ref["kind"], ref["name"]) == WORKER and ref["apiVersion"] == sts["apiVersion"]
    (metric,) = hpa["spec"]["metrics"]
    ext = metric["external"]
    assert metric["type"] == "External" and ext["metric"]["name"] == DESIRED_REPLICAS
    # an AverageValue of 1: the replica count is the metric itself
    assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}
    # the label names a model the workers serve, as the gateway labels the series
    model = parse_worker_args(_container(sts)["args"][1:]).model
    assert ext["metric"]["selector"]["matchLabels"] == {"model": model}
    metrics = GatewayMetrics()
    metrics.registry.register(ElasticCollector(lambda: [PoolFigures(model, 3, 2, 1, 0, 0.5, 4, 9.0, 5.0, 2.0, 0, 0,
                                                                    1, 0)]))
    assert f'\n{DESIRED_REPLICAS}{{model="{model}"}} 3.0\n' in metrics.render().decode()
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60  # no flapping on a lull
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0  # a burst is served at once
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_gateways_export_the_signal_and_start_no_worker(docs: list[dict[str, Any]]) -> None:
    gw = find(docs, "Deployment", "quicserve-gateway")
    c = _container(gw)
    env = container_env(docs, c)
    overrides, problems = _serve_overrides(build_parser().parse_args(c["args"]))
    assert not problems
    settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("QUICSERVE_")},
                             overrides=overrides)
    w = settings.workers
    assert w.elastic and w.initial_replicas == 0 and settings.discovery.worker_dns  # advisory: DNS workers
    hpa = find(docs, "HorizontalPodAutoscaler", "quicserve-worker")
    assert w.max_replicas >= hpa["spec"]["maxReplicas"]  # the signal can ask for what the HPA may give


def test_a_scale_down_drains_one_worker_at_a_time(docs: list[dict[str, Any]]) -> None:
    sts = find(docs, *WORKER)
    pdb = find(docs, "PodDisruptionBudget", "quicserve-worker")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # SIGTERM: the worker drains for up to DRAIN_TIMEOUT before it exits; the kubelet must wait that long
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > DRAIN_TIMEOUT


def test_workers_keep_their_compilation_cache_on_their_volume(docs: list[dict[str, Any]]) -> None:
    sts = find(docs, *WORKER)
    c = _container(sts)
    cache = parse_worker_args(c["args"][1:]).compilation_cache
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    (volume,) = [name for path, name in mounts.items() if cache.startswith(path.rstrip("/") + "/")]
    assert volume in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}  # survives a restart


def test_a_broken_autoscaler_fails_validation(tmp_path: Path) -> None:
    docs = render(K8S / "base")
    assert validate(tmp_path, docs).returncode == 0
    hpa = find(docs, "HorizontalPodAutoscaler", "quicserve-worker")
    hpa["spec"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 300  # misspelt: strict validation says so
    assert validate(tmp_path, docs).returncode != 0
