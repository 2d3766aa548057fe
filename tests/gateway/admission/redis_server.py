"""A real redis-server on a free loopback port, started, stopped and restarted by the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["redis_server", "RedisProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """One redis-server that keeps nothing on disk: a restart comes back empty, on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, password: str = "",
                 tls: tuple[str, str, str] | None = None) -> None:
        """``password``: requirepass; ``tls``: (certificate, key, CA) files -- TLS only, no plain port."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (make sysdeps installs it)")
        self.exe, self.workdir, self.password, self.tls = exe, workdir, password, tls
        self.port = port if port is not None else free_port()
        auth = f":{password}@" if password else ""
        if tls is None:
            self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        else:
            self.url = f"rediss://{auth}localhost:{self.port}/0?ssl_ca_certs={tls[2]}&ssl_cert_reqs=required"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisProcess:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            cert, key, ca = self.tls
            args[1] = "0"  # no plain port
            args += ["--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen([self.exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    if self.tls is not None or self.password:  # the port answers: good enough here
                        return self
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash would: nothing saved
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """Yields ``redis://127.0.0.1:<port>/0``; the server keeps nothing on disk."""
    server = RedisProcess(workdir).start()
    try:
        yield server.url
    finally:
        server.stop()
