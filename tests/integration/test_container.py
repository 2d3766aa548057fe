"""The Dockerfile, built and run for real with podman (the same CLI as ``docker build``/``docker run``).

No image registry is reachable from the machines the suite runs on, so the base image is
made here: ``debootstrap --variant=minbase`` of Debian bookworm from the mirror apt uses,
imported with ``podman import`` and kept under the tag ``localhost/quicserve-base:bookworm``
(checked before debootstrap runs: only the first run pays for it). The image is then built
from the repo with its default arguments (JAX, g++) on that base, and run with the synthetic
engine (the model itself is tested elsewhere): a chat completion and ``/metrics`` through the
published port, the HEALTHCHECK, a non-root user, and a SIGTERM while a stream is open,
which must finish the stream and exit 0.

Podman on these machines: ``runc`` as the runtime, cgroupfs, no default ulimits (written
to a ``CONTAINERS_CONF`` file); builds use the host network, and pip inside the build
gets the host's CA bundle (mounted, ``PIP_CERT``), as a TLS-inspecting proxy needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_TAG = "localhost/quicserve-base:bookworm"
IMAGE_TAG = "localhost/quicserve:test"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quicserve"
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""
STEP_MS = 50  # the synthetic worker's time per decode step: a 40-token stream lasts 2 s

# cold (debootstrap, then a build that installs JAX) is minutes; warm (both cached) about one
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.skipif(shutil.which("podman") is None,
                                                   reason="podman not installed (APT_PKGS has it)")]


def podman(*args: str, timeout: float = 120, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=check, **kw)  # type: ignore[call-overload]


def debian_mirror() -> str:
    """The first Debian mirror URI apt uses here (deb822 ``.sources`` or one-line ``sources.list``)."""
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for f in files:
        if f.exists():
            text = f.read_text()
            m = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(r"^deb\s+(\S+/debian)\s", text, re.M)
            if m:
                return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_base_image() -> float:
    """The debootstrapped base, made once and then found by its tag; returns the seconds spent."""
    t0 = time.monotonic()
    if podman("image", "exists", BASE_TAG, check=False).returncode == 0:
        return time.monotonic() - t0
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("no base image and cannot debootstrap one (needs root and debootstrap)")
    with tempfile.TemporaryDirectory(prefix="quicserve-rootfs-") as d:
        root = Path(d) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(root), debian_mirror()], check=True, capture_output=True, timeout=900)
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        podman("import", "--change", "CMD [\"/bin/bash\"]", "-", BASE_TAG, stdin=tar.stdout, timeout=600)
        assert tar.wait() == 0
    return time.monotonic() - t0


def ca_bundle() -> str:
    return os.environ.get("PIP_CERT") or ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    base_s = ensure_base_image()
    old = podman("image", "inspect", "--format", "{{.Id}}", IMAGE_TAG, check=False).stdout.strip()
    t0 = time.monotonic()
    r = podman("build", "--network=host", "--format", "docker", "-v", f"{ca_bundle()}:/etc/ssl/certs/host-ca.crt:ro",
               "--build-arg", f"BASE={BASE_TAG}", "--build-arg", "PIP_CERT=/etc/ssl/certs/host-ca.crt",
               "-t", IMAGE_TAG, str(REPO), timeout=1500, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    new = podman("image", "inspect", "--format", "{{.Id}}", IMAGE_TAG).stdout.strip()
    if old and old != new:  # the previous build's image, now untagged: do not let them pile up
        podman("rmi", old, check=False)
    print(f"container: base image {base_s:.0f} s, build {time.monotonic() - t0:.0f} s")
    yield IMAGE_TAG


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, str]]:
    """(name, base URL) of a running container whose gateway is ready."""
    name = f"quicserve-test-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "-p", "127.0.0.1::8080", image, "serve", "--engine", "synthetic",
           "--progress", "lines", "--worker-option", f"synthetic_step_ms={STEP_MS}")
    try:
        port = podman("port", name, "8080/tcp").stdout.strip().rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running" and time.monotonic() < deadline, podman("logs", name).stderr
            time.sleep(0.5)
        yield name, url
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)


def test_image_serves_reports_health_and_drains_on_sigterm(container: tuple[str, str]) -> None:
    name, url = container
    user = podman("inspect", "--format", "{{.Config.User}}", name).stdout.strip()
    assert user and user not in ("root", "0")
    assert podman("healthcheck", "run", name, check=False).returncode == 0  # the image's HEALTHCHECK passes
    # the default extras are in: JAX for the workers, OpenTelemetry for traces
    assert podman("exec", name, "python3", "-c", "import jax, opentelemetry.sdk", check=False).returncode == 0

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(r'^quicserve_requests_total\{[^}]*route="/v1/chat/completions"[^}]*status="200"', metrics, re.M)

    # SIGTERM with a stream open: the stream gets all its tokens, then the container exits 0
    events: list[dict[str, object]] = []
    first = threading.Event()

    def stream() -> None:
        body = {**chat, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    t_term = time.monotonic()
    podman("kill", "--signal", "TERM", name)
    t.join(60)
    assert podman("wait", name, timeout=60).stdout.strip() == "0"
    logs = podman("logs", name).stdout
    finish = [c["finish_reason"] for e in events for c in e["choices"]]  # type: ignore[attr-defined]
    assert finish[-1] == "length", events[-3:]  # all 40 tokens, not cut short
    assert time.monotonic() - t_term < 45  # well within `docker stop -t 45`
    assert "quicserve: draining" in logs and logs.rstrip().endswith("quicserve: stopped"), logs
