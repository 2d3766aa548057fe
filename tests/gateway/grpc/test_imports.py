"""The gateway's gRPC code runs on protobuf + grpclib alone: no grpcio, no grpc_tools, no JAX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_grpc_package_imports_without_grpcio_or_jax() -> None:
    code = (
        "import sys\n"
        "for name in ('grpc', 'grpc_tools', 'jax'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "import gateway.grpc.native_server, gateway.grpc.grpc_web_route, gateway.grpc.quicserve.v1.quicserve_grpc\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
