"""The deployment files (``Dockerfile``, ``config/quicserve.service``) against the code.

The image is built and run for real by ``test_container.py`` (podman); here, in a
second, what can drift without a build noticing:

* every ``COPY`` source exists; every ``ENV QUICSERVE_*`` setting is a real one;
  ``ENTRYPOINT`` + ``CMD`` parse with the CLI; the ``HEALTHCHECK`` probes a route
  the gateway serves; ``EXPOSE`` matches the default ports;
* the image's install step, replayed: the package is built and installed from
  *only* the files the Dockerfile copies, into a directory of its own, and its
  ``quicserve`` console script (the image's entry point) serves a request
  through a synthetic worker from there, with the source tree off ``sys.path``;
* the systemd unit's ``ExecStart`` parses with the CLI and its ``Environment``
  settings are real ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gateway.cli import build_parser
from gateway.settings import Settings, load_settings
from tests.integration.test_gateway_e2e import wait_ready

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
UNIT = REPO / "config" / "quicserve.service"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def env_settings(pairs: dict[str, str]) -> Settings:
    return load_settings(environ={k: v for k, v in pairs.items() if k.startswith("QUICSERVE_")})


def docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def docker_copies() -> list[tuple[str, str]]:
    copies = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            *srcs, dest = shlex.split(rest)
            if not any(s.startswith("--from") for s in srcs):  # from an earlier stage, not the repo
                copies += [(s, dest) for s in srcs if not s.startswith("--")]
    return copies


def test_dockerfile_matches_the_code() -> None:
    ins = dockerfile_instructions()
    for src, _ in docker_copies():
        assert (REPO / src).exists(), f"COPY {src}: no such file in the repo"
    settings = env_settings(docker_env())  # raises SettingsError on an unknown key or bad value
    assert settings.server.host == "0.0.0.0"
    entry = json.loads(next(rest for word, rest in ins if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in ins if word == "CMD"))
    assert entry == ["quicserve"]
    args = build_parser().parse_args(cmd)  # exits (SystemExit) on an unknown flag
    assert args.command == "serve"
    exposed = {int(p.split("/")[0]) for word, rest in ins if word == "EXPOSE" for p in rest.split()}
    assert exposed == {settings.server.port, settings.server.tls_port}
    health = next(rest for word, rest in ins if word == "HEALTHCHECK")
    assert f"127.0.0.1:{settings.server.port}/readyz" in health


def test_systemd_unit_matches_the_code() -> None:
    lines = [ln.strip() for ln in UNIT.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    exec_start = next(ln.split("=", 1)[1] for ln in lines if ln.startswith("ExecStart="))
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/quicserve")
    assert build_parser().parse_args(argv[1:]).command == "serve"
    env = dict(
        item.partition("=")[::2]
        for ln in lines
        if ln.startswith("Environment=")
        for item in shlex.split(ln.split("=", 1)[1])
    )
    assert env, "the unit sets no environment"
    state = env_settings(env).server.state_dir
    assert f"ReadWritePaths={state}" in lines  # the one writable path is where the state goes
    keys = dict(ln.split("=", 1) for ln in lines if "=" in ln)
    # readiness and watchdog are spoken by gateway/observability/systemd.py (tests/integration/test_systemd_notify.py)
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main"
    assert 0 < int(keys["WatchdogSec"]) and int(keys["TimeoutStartSec"]) > load_settings().workers.ready_timeout
    for hardening in ("DynamicUser", "NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictSUIDSGID"):
        assert keys[hardening] == "yes", hardening
    assert keys["ProtectSystem"] == "strict" and "MemoryDenyWriteExecute" not in keys  # XLA's JIT needs W+X


_OPTIONAL = re.compile(r"^#((?:LoadCredential|Environment|EnvironmentFile)=.*)$", re.M)


def with_credentials(text: str) -> str:
    """The unit with its commented-out secret lines (credentials, their settings) switched on."""
    return _OPTIONAL.sub(r"\1", text)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (APT_PKGS has it)")
@pytest.mark.parametrize("credentials", [False, True], ids=["as shipped", "credentials on"])
def test_systemd_unit_verifies(tmp_path: Path, credentials: bool) -> None:
    """systemd itself parses the unit: no unknown keys or bad values (it warns and goes on, so: no output),
    also with every credential line switched on."""
    script = shutil.which("quicserve", path=str(Path(sys.executable).parent))
    assert script, "the quicserve console script is not installed next to this interpreter"
    unit = tmp_path / UNIT.name
    text = UNIT.read_text()
    unit.write_text((with_credentials(text) if credentials else text).replace("/opt/quicserve/.venv/bin/quicserve",
                                                                               script))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr + r.stdout


def test_systemd_secrets_come_as_credentials() -> None:
    """Every secret the unit hands the service is a LoadCredential= file that a setting reads at %d/ID
    (the API keys, the HTTPS and transport certificates and keys, the pre-shared key): each %d/ID has its
    credential, each credential its setting, and the settings are real ones (turned on, they load)."""
    lines = [ln.strip() for ln in with_credentials(UNIT.read_text()).splitlines() if ln.strip()
             and not ln.startswith("#")]
    creds = dict(ln.split("=", 1)[1].split(":", 1) for ln in lines if ln.startswith("LoadCredential="))
    assert {"api-keys.toml", "transport.crt", "transport.key", "transport-ca.crt", "transport.psk"} <= set(creds)
    assert all(path.startswith("/etc/quicserve/") for path in creds.values())
    env = dict(item.partition("=")[::2] for ln in lines if ln.startswith("Environment=")
               for item in shlex.split(ln.split("=", 1)[1]))
    used = {v.removeprefix("%d/") for v in env.values() if v.startswith("%d/")}
    assert used == set(creds), (used, set(creds))
    settings = env_settings({k: v.replace("%d", "/run/credentials/quicserve.service") for k, v in env.items()})
    assert settings.admission.keys_file.endswith("/api-keys.toml")
    w = settings.workers
    assert (w.transport_tls_cert, w.transport_tls_key, w.transport_tls_ca, w.transport_psk_file) == tuple(
        f"/run/credentials/quicserve.service/{n}" for n in ("transport.crt", "transport.key", "transport-ca.crt",
                                                             "transport.psk"))
    assert settings.server.tls_cert.endswith("/https.crt") and settings.server.tls_key.endswith("/https.key")


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read())


@pytest.mark.slow
def test_image_install_step_replayed(tmp_path: Path) -> None:
    """``pip install '.[worker]'`` from the copied files only, then the entry point serves."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for src, _ in docker_copies():
        p = REPO / src
        if p.is_dir():
            shutil.copytree(p, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, ctx / src)
    target = tmp_path / "site"
    # Dependencies come from this venv (no index needed); the package itself only from ctx.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ctx)], check=True, capture_output=True, timeout=300)
    script = target / "bin" / "quicserve"
    assert script.exists(), "the console script the image's ENTRYPOINT runs was not installed"
    env = {**os.environ, "PYTHONPATH": str(target), "QUICSERVE_SERVER__STATE_DIR": str(tmp_path / "state")}
    run_dir = tmp_path / "elsewhere"  # not the repo: only the installed copy is importable by path
    run_dir.mkdir()
    where = subprocess.run([sys.executable, "-c", "import gateway, inference, transport; "
                            "print(gateway.__file__, inference.__file__, transport.__file__)"],
                           cwd=run_dir, env=env, capture_output=True, text=True, check=True).stdout
    assert all(p.startswith(str(target)) for p in where.split()), where
    proc = subprocess.Popen([str(script), "serve", "--engine", "synthetic", "--port", "0", "--no-tls", "--grpc-port", "0",
                             "--progress", "lines", "--log-level", "warning"],
                            cwd=run_dir, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = wait_ready(proc).http
        assert _get(url + "/readyz")[0] == 200
        status, body = _get(url + "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_readme_deploy_section_matches_the_files() -> None:
    """The README's deploy commands name files, build arguments and flags that exist."""
    text = (REPO / "README.md").read_text().split("## Deploy", 1)[1].split("\n## ", 1)[0]
    args = {rest.split("=")[0] for word, rest in dockerfile_instructions() if word == "ARG"}
    for name in re.findall(r"`([A-Z_]+)`", text):
        if name.isupper() and name not in ("HEALTHCHECK",) and not name.startswith("QUICSERVE"):
            assert name in args, f"README names build argument {name}, the Dockerfile has {args}"
    for kustomization in re.findall(r"kubectl apply -k (\S+)", text):
        assert (REPO / kustomization / "kustomization.yaml").exists(), kustomization
    for path in re.findall(r"\b(config/\S+\.(?:service|toml|json))", text):
        assert (REPO / path).exists(), path
    for line in re.findall(r"^docker run .*? quicserve( .*?)?(?:\s+#.*)?$", text, re.M):
        cmd = shlex.split(line) or json.loads(next(r for w, r in dockerfile_instructions() if w == "CMD"))
        assert build_parser().parse_args(cmd).command == "serve", line
    uid = re.search(r"uid (\d+)", text)
    assert uid and f"--uid {uid.group(1)} " in DOCKERFILE.read_text()

