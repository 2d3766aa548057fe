"""``quicserve transport probe``: what this machine offers for the transport."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from . import rdma
from .errors import RdmaUnavailable

__all__ = ["probe_report"]


def _netdevs() -> list[str]:
    root = Path("/sys/class/net")
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.name != "lo")


def probe_report() -> str:
    """A human-readable report: RDMA devices, pyverbs, rxe support, and what to do."""
    lines = ["quicserve transport probe", ""]
    devices = rdma.list_devices()
    if devices:
        for d in devices:
            kind = "soft-RoCE/software" if d.soft else "hardware"
            lines.append(f"  RDMA device {d.name}: {kind}, {'ACTIVE' if d.active else 'no active port'}")
    else:
        lines.append("  RDMA devices: none (/sys/class/infiniband is empty or missing)")
    try:
        pv = rdma.import_pyverbs()
        lines.append(f"  pyverbs: importable ({os.path.dirname(pv.__file__ or '?')})")
    except RdmaUnavailable as exc:
        lines.append(f"  pyverbs: unavailable: {exc}")
    rxe_mod = any(
        Path(p).exists()
        for p in (
            "/sys/module/rdma_rxe",
            f"/lib/modules/{os.uname().release}/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko",
            f"/lib/modules/{os.uname().release}/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz",
        )
    )
    lines.append(f"  soft-RoCE kernel module (rdma_rxe): {'available' if rxe_mod else 'not found'}")
    lines.append(
        f"  unix sockets: {'yes' if hasattr(socket, 'AF_UNIX') else 'no'}; python {sys.version.split()[0]}"
    )
    lines.append("")
    usable = [d for d in devices if d.active]
    if usable:
        best = next((d for d in usable if not d.soft), usable[0])
        lines.append(f"rdma:// URLs will use {best.name}.")
    else:
        netdev = (_netdevs() or ["eth0"])[0]
        lines.append("rdma:// URLs will fall back to TCP on the same host:port.")
        lines.append("To try soft-RoCE (needs the rdma_rxe kernel module and rdma-core/iproute2):")
        lines.append("  modprobe rdma_rxe")
        lines.append(f"  rdma link add rxe0 type rxe netdev {netdev}")
        lines.append("  apt-get install -y python3-pyverbs   # pyverbs must match the system libibverbs")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(probe_report())
