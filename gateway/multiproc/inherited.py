"""Listening sockets a gateway process inherited from its supervisor, by kind and port.

The supervisor binds every listener once per process (SO_REUSEPORT) and passes each process its own
sockets; the listeners of a gateway process ask here before binding (:func:`take`: at start-up
only, never per request). With one process nothing is registered and every listener binds itself.
"""

from __future__ import annotations

import socket

__all__ = ["adopt", "take", "Key"]

Key = tuple[str, int | str]  # ("tcp", port) | ("udp", port) | ("unix", path)

_SOCKETS: dict[Key, socket.socket] = {}


def adopt(entries: list[tuple[str, int | str, int]]) -> None:
    """Register inherited file descriptors: ``(kind, port or path, fd)`` each."""
    for kind, where, fd in entries:
        sock = socket.socket(fileno=fd)  # family and type read from the descriptor
        sock.setblocking(False)
        _SOCKETS[(kind, where)] = sock


def take(kind: str, where: int | str) -> socket.socket | None:
    """The inherited socket for ``kind`` on ``where`` (a port, or a Unix socket's path), if any."""
    if not _SOCKETS:
        return None
    return _SOCKETS.pop((kind, where), None)
