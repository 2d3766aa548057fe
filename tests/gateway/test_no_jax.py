"""The gateway never imports JAX (or the inference package): it must start fast and stay small.

A running gateway is checked too, in tests/integration/test_gateway_e2e.py (its
/proc/<pid>/maps must not map jaxlib).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GATEWAY_MODULES = [
    "gateway.cli", "gateway.app", "gateway.serve", "gateway.settings", "gateway.loadgen",
    "gateway.api.openai", "gateway.routing.pool", "gateway.workers.supervisor", "gateway.observability.metrics",
    "gateway.http.server", "gateway.http.tls",
]


def run_ok(code: str) -> None:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_gateway_modules_do_not_import_jax_or_inference() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {GATEWAY_MODULES!r}: importlib.import_module(m)\n"
        "from gateway.cli import build_parser\n"
        "build_parser().parse_args(['serve', '--engine', 'synthetic'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'inference', 'torch'))\n"
        "assert not bad, bad\n"
        "print('ok', len(sys.modules))\n"
    )
    run_ok(code)


def test_config_check_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "x"\nbogus = 1\n')
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(bad)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "server.port: expected int" in r.stdout and "server.bogus: unknown key" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(REPO / "config/default.toml")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK")


def test_serve_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--no-tls",
                            "--engine", "synthetic"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot start" in r.stderr and "address already in use" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_rejects_bad_settings() -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", "70000"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "server.port: 70000 is not a TCP port" in r.stderr


def test_config_show_and_transport_probe_cli() -> None:
    env = {**os.environ, "QUICSERVE_SERVER__PORT": "9001"}
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "show"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "[server]\nhost = \"127.0.0.1\"\nport = 9001\n" in r.stdout
    shown = tomllib.loads(r.stdout)  # what `config show` prints is itself a valid config
    assert shown["server"]["port"] == 9001 and shown["workers"]["remote"] == []
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "transport", "probe"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "RDMA" in r.stdout


def test_prefix_routing_imports_only_the_tokenizer_from_inference() -> None:
    """``[routing] policy = "prefix_affinity"`` tokenizes prompts in the gateway: the one module of
    ``inference`` it may load is the JAX-free tokenizer."""
    code = (
        "import sys\n"
        "from gateway.routing.config import RoutingSettings\n"
        "from gateway.routing.pool import ModelPool\n"
        "from gateway.routing.policy import RouteRequest\n"
        "from transport.messages import Hello, Submit\n"
        "from transport.common.prefix import PREFIX_HASH_SCHEME\n"
        "pool = ModelPool(policy=RoutingSettings(policy='prefix_affinity').build())\n"
        "class C:\n"
        "    peer_hello = Hello(role='worker', models=('tiny',), block_size=16, model_id='tiny',"
        " prefix_hash=PREFIX_HASH_SCHEME)\n"
        "r = pool.prefix.annotate(RouteRequest('tiny'), lambda i: Submit(i, 'tiny', prompt='x' * 40), [C()])\n"
        "assert len(r.prefix_hashes) == 2, r\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'inference', 'torch'))\n"
        "assert loaded == ['inference', 'inference.tokenizer'], loaded\n"
        "print('ok')\n"
    )
    run_ok(code)
