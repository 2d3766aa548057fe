"""The store the gateway processes of one host share their rate limits in, without a Redis of
the operator's: a ``redis-server`` the supervisor starts on a Unix socket in its runtime directory.

Why a local Redis and not shared memory: the limits shared across hosts already go through Redis
with local leases (:mod:`gateway.admission.lease`): no round trip on the request path, one
pipeline per loop wake-up for every key, the server's clock only, and an accuracy argument
(never above the limit, 99.75-100 % of it reached) tested with real processes. Pointing the same
code at a local store gives N processes exactly those properties, at the cost per request of one
process with ``redis_url`` (none on the request path; a renewal per lease). A shared-memory store
would need a second implementation of the window and the bucket, cross-process locking on every
request (the request path takes no lock today) and its own accuracy argument, for a gain of one
Unix-socket round trip per lease, off the request path. Without ``redis-server`` on the host the
processes limit alone (each the whole limit) and the supervisor says so at start. (Keys'
concurrency caps are the other way round: a cap is taken and given back by every request of the
key, exactly, so they are counted in shared memory, :mod:`.key_slots`, not through a round trip.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from typing import Any

__all__ = ["LocalStore"]

log = logging.getLogger("quicserve.processes")


class LocalStore:
    """``redis-server`` for the processes' shared limits, when admission is on and no ``redis_url``
    is configured; :attr:`url` is what the processes use ("" = nothing to share or no server)."""

    def __init__(self, settings: Any, runtime: str) -> None:
        adm = settings.admission
        # rate rules in the settings, or keys whose records may carry their own (a reload may add them)
        self.wanted = bool(adm.enabled and not adm.redis_url and (adm.limits or adm.keys or adm.keys_file))
        self.path = os.path.join(runtime, "redis.sock")
        self.url = ""
        self.warning = ""
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 10.0) -> None:
        if not self.wanted:
            return
        exe = shutil.which("redis-server")
        if exe is None:
            self.warning = ("admission: no redis-server on this host: each gateway process applies the rate "
                            "limits alone (set [admission] redis_url to share them)")
            return
        self._proc = await asyncio.create_subprocess_exec(
            exe, "--port", "0", "--unixsocket", self.path, "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--daemonize", "no", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, start_new_session=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await _answers(self.path):
            if self._proc.returncode is not None or loop.time() > deadline:
                raise RuntimeError(f"the local redis-server for shared limits did not start ({self.path})")
            await asyncio.sleep(0.02)
        self.url = f"unix://{self.path}"

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _answers(path: str) -> bool:
    try:
        reader, writer = await asyncio.open_unix_connection(path)
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        return await asyncio.wait_for(reader.readline(), 1.0) == b"+PONG\r\n"
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
