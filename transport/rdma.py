"""RDMA channel over pyverbs: rdma_cm setup, an RC queue pair, credit-managed rings.

The only module that imports pyverbs, lazily (:func:`import_pyverbs`). Debian's
``python3-pyverbs`` installs into ``/usr/lib/python3/dist-packages``, which a
virtualenv does not see; if ``import pyverbs`` fails we retry with that
directory appended to ``sys.path`` (the extension must match the running
CPython minor version, 3.11 here).

How the ring works (:class:`CreditRing`, sans-I/O)
--------------------------------------------------
Each side registers ``2 * depth`` receive slots and ``depth + 1`` send slots of
``slot_size`` bytes. A message is a 4-byte header (u16 credits returned, u16
flags) plus up to ``slot_size - 4`` bytes of the frame byte stream.

* Data messages spend one credit; the sender starts with ``depth`` credits.
  Each data message the receiver consumes is a credit it owes back; it
  repays them piggybacked on its next message, or in a credit-only message
  once ``depth // 2`` are owed (or as soon as it owes any and the peer flagged
  CREDIT_WANTED because it has data waiting).
* Credit-only messages spend no credit. They land in the second half of the
  receive ring: each one repays at least one data message, so at most
  ``depth`` of them can be unprocessed at the peer, and no receive is ever
  missing (no RNR retries).
The adapter posts every slot the ring hands out and feeds completions back
(RC completions arrive in posting order, so slots are tracked FIFO).

Completions are event-driven: the CQ's completion channel fd is registered
with the event loop (``loop.add_reader``); pyverbs does not expose that fd,
so it is found as the ``anon_inode:[infinibandevent]`` descriptor that appears
when the channel is created. Connection setup uses rdma_cm's synchronous API
on the active side and its event API on the passive side; both block, so they
run in worker threads (setup only, never the data path).

Not exercised on hardware in this repository's CI (no device); the adapter is
tested over a fake-verbs test double and the ring logic directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .endpoint import Endpoint
from .errors import ConnectError, RdmaUnavailable

__all__ = [
    "RdmaDevice",
    "list_devices",
    "import_pyverbs",
    "CreditRing",
    "RingError",
    "RdmaChannel",
    "rdma_connect",
    "rdma_listen",
]

log = logging.getLogger("transport.rdma")

DIST_PACKAGES = "/usr/lib/python3/dist-packages"
SYSFS_IB = "/sys/class/infiniband"
_MSG = struct.Struct("<HH")
CREDIT_ONLY = 1
CREDIT_WANTED = 2


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    name: str
    soft: bool  # soft-RoCE (rxe) or another software device
    active: bool  # some port is ACTIVE


def list_devices(sysfs: str = SYSFS_IB) -> list[RdmaDevice]:
    """RDMA devices the kernel exposes (no pyverbs needed)."""
    root = Path(sysfs)
    if not root.is_dir():
        return []
    out = []
    for dev in sorted(root.iterdir()):
        name = dev.name
        parent = (dev / "parent").read_text().strip() if (dev / "parent").exists() else ""
        soft = (
            name.startswith(("rxe", "siw")) or not (dev / "device").exists() or bool(parent and "rxe" in name)
        )
        active = False
        ports = dev / "ports"
        if ports.is_dir():
            for port in ports.iterdir():
                try:
                    active |= "ACTIVE" in (port / "state").read_text()
                except OSError:
                    pass
        out.append(RdmaDevice(name, soft, active))
    return out


def import_pyverbs() -> ModuleType:
    """Import pyverbs, looking in Debian's dist-packages if the venv lacks it."""
    try:
        return importlib.import_module("pyverbs")
    except ImportError as first:
        if DIST_PACKAGES not in sys.path and os.path.isdir(os.path.join(DIST_PACKAGES, "pyverbs")):
            sys.path.append(DIST_PACKAGES)
            try:
                return importlib.import_module("pyverbs")
            except ImportError as exc:
                raise RdmaUnavailable(f"pyverbs in {DIST_PACKAGES} does not import: {exc}") from exc
        raise RdmaUnavailable(
            f"pyverbs is not installed (apt-get install python3-pyverbs): {first}"
        ) from first


class RingError(Exception):
    """The peer broke the ring protocol (bad message, credit overrun)."""


class CreditRing:
    """Send/receive slot bookkeeping and credits for one RC connection (sans-I/O)."""

    def __init__(self, depth: int = 64, slot_size: int = 1 << 16) -> None:
        if depth < 2 or slot_size <= _MSG.size:
            raise ValueError("depth must be >= 2 and slot_size > 4")
        self.depth = depth
        self.slot_size = slot_size
        self.recv_slots = 2 * depth
        self.send_slots = depth + 1
        self.credits = depth  # data messages we may still send
        self.owed = 0  # data messages received whose credit we have not returned
        self.peer_wants = False
        self._free_send: deque[int] = deque(range(self.send_slots))
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._reposts: list[int] = []
        self._unposted_data = 0
        self._peer_data_outstanding = 0  # data messages the peer sent that we have not returned

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def initial_recvs(self) -> list[int]:
        """Receive slots to post before connecting."""
        return list(range(self.recv_slots))

    def queue(self, data: bytes) -> None:
        if data:
            self._pending.append(data)
            self._pending_bytes += len(data)

    def poll_sends(self) -> list[tuple[int, bytes]]:
        """Messages to post now, each with the send slot it occupies."""
        out: list[tuple[int, bytes]] = []
        room = self.slot_size - _MSG.size
        while self._pending and self.credits and self._free_send:
            chunk = self._take(room)
            self.credits -= 1
            flags = CREDIT_WANTED if (self._pending and not self.credits) else 0
            out.append((self._free_send.popleft(), _MSG.pack(self._return(), flags) + chunk))
        want = CREDIT_WANTED if self._pending and not self.credits else 0
        if (
            self._free_send
            and self.owed
            and (self.owed >= max(1, self.depth // 2) or self.peer_wants or want)
        ):
            self.peer_wants = False
            out.append((self._free_send.popleft(), _MSG.pack(self._return(), CREDIT_ONLY | want)))
        return out

    def on_send_complete(self, slot: int) -> None:
        if not 0 <= slot < self.send_slots or slot in self._free_send:
            raise RingError(f"send completion for slot {slot} that is not in flight")
        self._free_send.append(slot)

    def on_recv(self, slot: int, message: bytes | memoryview) -> bytes:
        """A receive completed in ``slot``; return its payload (the slot is to be reposted)."""
        if len(message) < _MSG.size:
            raise RingError("RDMA message shorter than its header")
        returned, flags = _MSG.unpack_from(message)
        if flags & ~(CREDIT_ONLY | CREDIT_WANTED):
            raise RingError(f"unknown RDMA message flags {flags:#x}")
        self.credits += returned
        if self.credits > self.depth:
            raise RingError("peer returned more credits than it was given")
        if flags & CREDIT_WANTED:
            self.peer_wants = True
        self._reposts.append(slot)
        if flags & CREDIT_ONLY:
            if len(message) != _MSG.size:
                raise RingError("credit-only RDMA message with a payload")
            return b""
        self._peer_data_outstanding += 1
        if self._peer_data_outstanding > self.depth:
            raise RingError("peer sent more data messages than its credit")
        self._unposted_data += 1
        return bytes(message[_MSG.size :])

    def take_reposts(self) -> list[int]:
        """Slots to post again. Their credits become owed now, not at receipt, so a
        returned credit always has a posted receive behind it."""
        out, self._reposts = self._reposts, []
        self.owed += self._unposted_data
        self._unposted_data = 0
        return out

    def _return(self) -> int:
        n = self.owed
        self.owed = 0
        self._peer_data_outstanding -= n
        return n

    def _take(self, room: int) -> bytes:
        parts = []
        while self._pending and room:
            head = self._pending[0]
            if len(head) <= room:
                parts.append(self._pending.popleft())
                room -= len(head)
            else:
                parts.append(head[:room])
                self._pending[0] = head[room:]
                room = 0
        chunk = b"".join(parts)
        self._pending_bytes -= len(chunk)
        return chunk


def _new_ib_event_fds(before: set[int]) -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in before:
            continue
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(fd)
        except OSError:
            pass
    return found


class RdmaChannel:
    """One RC connection: ring slots as registered MRs, completions via the loop."""

    def __init__(
        self, cmid: Any, ring: CreditRing, endpoint_factory: Callable[[], Endpoint], verbs: Any = None
    ) -> None:
        self._pv = verbs if verbs is not None else _verbs()
        self.cmid = cmid
        self.ring = ring
        self._make_endpoint = endpoint_factory
        self.endpoint: Endpoint | None = None
        self._loop = asyncio.get_running_loop()
        self._closed = False
        ctx = cmid.context
        before = {int(n) for n in os.listdir("/proc/self/fd")}
        self._chan = self._pv.cq.CompChannel(ctx)
        fd = getattr(self._chan, "fd", None)  # pyverbs does not expose it; a test double may
        if fd is None:
            fds = _new_ib_event_fds(before)
            if len(fds) != 1:
                raise RdmaUnavailable(
                    "cannot find the completion channel's fd to register with the event loop"
                )
            fd = fds[0]
        self._fd: int = fd
        self._cq = self._pv.cq.CQ(ctx, ring.recv_slots + ring.send_slots, None, self._chan, 0)
        cap = self._pv.qp.QPCap(
            max_send_wr=ring.send_slots, max_recv_wr=ring.recv_slots, max_send_sge=1, max_recv_sge=1
        )
        init = self._pv.qp.QPInitAttr(
            qp_type=self._pv.enums.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=1
        )
        cmid.create_qp(init)
        self._recv_mrs = [cmid.reg_msgs(ring.slot_size) for _ in range(ring.recv_slots)]
        self._send_mrs = [cmid.reg_msgs(ring.slot_size) for _ in range(ring.send_slots)]
        self._recv_fifo: deque[int] = deque()
        self._send_fifo: deque[int] = deque()
        for slot in ring.initial_recvs():
            self._post_recv(slot)
        self._cq.req_notify()

    def start(self) -> None:
        """After rdma_cm connect/accept: watch completions and start the endpoint."""
        self._loop.add_reader(self._fd, self._on_completion_event)
        self.endpoint = self._make_endpoint()
        self.endpoint.attach(self)

    # ByteSink
    def write(self, data: bytes) -> None:
        if self._closed:
            return
        self.ring.queue(data)
        self._pump()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        try:
            self.cmid.disconnect()
        except Exception:  # noqa: BLE001 - best effort on a dying connection
            pass
        self.cmid.close()
        if self.endpoint is not None:
            self.endpoint.channel_lost("RDMA connection closed")

    def _post_recv(self, slot: int) -> None:
        self.cmid.post_recv(self._recv_mrs[slot], self.ring.slot_size)
        self._recv_fifo.append(slot)

    def _pump(self) -> None:
        for slot, msg in self.ring.poll_sends():
            mr = self._send_mrs[slot]
            mr.write(msg, len(msg))
            self.cmid.post_send(mr, 0, len(msg))
            self._send_fifo.append(slot)

    def _on_completion_event(self) -> None:
        try:
            self._chan.get_cq_event(self._cq)
            self._cq.ack_events(1)
            self._cq.req_notify()
            self._drain_cq()
        except Exception as exc:  # noqa: BLE001 - any verbs failure ends the connection
            self._fail(f"RDMA completion error: {exc}")

    def _drain_cq(self) -> None:
        enums = self._pv.enums
        received: list[bytes] = []
        while True:
            n, wcs = self._cq.poll(32)
            if not n:
                break
            for wc in wcs:
                if wc.status != enums.IBV_WC_SUCCESS:
                    raise ConnectError(f"work completion failed with status {wc.status}")
                if wc.opcode & enums.IBV_WC_RECV:
                    slot = self._recv_fifo.popleft()
                    msg = self._recv_mrs[slot].read(wc.byte_len, 0)
                    payload = self.ring.on_recv(slot, msg)
                    if payload:
                        received.append(payload)
                else:
                    self.ring.on_send_complete(self._send_fifo.popleft())
        for slot in self.ring.take_reposts():
            self._post_recv(slot)
        self._pump()
        if received and self.endpoint is not None:
            self.endpoint.data_received(b"".join(received))

    def _fail(self, reason: str) -> None:
        if self.endpoint is not None:
            self.endpoint.channel_lost(reason)
        self.close()


_PV: ModuleType | None = None


def _verbs() -> ModuleType:
    """pyverbs with the submodules this file uses loaded as attributes."""
    global _PV
    if _PV is None:
        pv = import_pyverbs()
        for sub in ("cmid", "cq", "qp", "enums", "cm_enums"):
            importlib.import_module(f"pyverbs.{sub}")
        _PV = pv
    return _PV


def _addrinfo(pv: Any, *, passive: bool, host: str, port: int) -> Any:
    """AddrInfo across pyverbs versions (``src_service``/``dst_service`` vs ``service``)."""
    cm = pv.cm_enums
    if passive:
        kw: dict[str, Any] = {"src": host, "port_space": cm.RDMA_PS_TCP, "flags": cm.RAI_PASSIVE}
        side = "src_service"
    else:
        kw = {"dst": host, "port_space": cm.RDMA_PS_TCP}
        side = "dst_service"
    try:
        return pv.cmid.AddrInfo(**kw, **{side: str(port)})
    except TypeError:
        return pv.cmid.AddrInfo(**kw, service=str(port))


def _conn_param(pv: Any) -> Any:
    return pv.cmid.ConnParam(retry=7, rnr_retry=7)


async def rdma_connect(
    host: str,
    port: int,
    endpoint_factory: Callable[[], Endpoint],
    *,
    depth: int = 64,
    slot_size: int = 1 << 16,
) -> RdmaChannel:
    """Active side, rdma_cm's synchronous API (as pyverbs' own tests use it):
    ``rdma_create_ep`` resolves address and route and binds the device (context
    and PD), then our CQ/QP/rings are created and ``rdma_connect`` completes."""
    pv = _verbs()

    def setup() -> Any:
        return pv.cmid.CMID(creator=_addrinfo(pv, passive=False, host=host, port=port))

    try:
        cmid = await asyncio.to_thread(setup)
        chan = RdmaChannel(cmid, CreditRing(depth, slot_size), endpoint_factory)
        await asyncio.to_thread(cmid.connect, _conn_param(pv))
    except Exception as exc:
        raise ConnectError(f"rdma://{host}:{port}: {exc}") from exc
    chan.start()
    return chan


class RdmaListener:
    """Passive side, rdma_cm's event API. A thread waits for CM events (pyverbs
    has no fd for them either); each CONNECT_REQUEST becomes a child id that
    shares the listener's device context and PD, gets its CQ/QP/rings, and is
    accepted; its channel starts at ESTABLISHED. pyverbs' CMEvent does not say
    which id an event is for, so accepts are matched to ESTABLISHED in order;
    disconnects surface as flushed work completions on the child's CQ (and,
    failing that, the heartbeat timeout)."""

    def __init__(
        self, ec: Any, listen_id: Any, make_endpoint: Callable[[], Endpoint], depth: int, slot_size: int
    ) -> None:
        self._pv = _verbs()
        self._ec = ec
        self._listen_id = listen_id
        self._make_endpoint = make_endpoint
        self._depth = depth
        self._slot_size = slot_size
        self._loop = asyncio.get_running_loop()
        self._pending: deque[RdmaChannel] = deque()
        self.channels: list[RdmaChannel] = []
        self._closed = False
        self._task = self._loop.create_task(self._event_loop())

    async def _event_loop(self) -> None:
        cm = self._pv.cm_enums
        while not self._closed:
            try:
                kind, child = await asyncio.to_thread(self._next_event)
            except Exception as exc:  # noqa: BLE001 - the event channel is gone (closing)
                if not self._closed:
                    log.warning("rdma listener stopped: %s", exc)
                return
            if kind == cm.RDMA_CM_EVENT_CONNECT_REQUEST and child is not None:
                try:
                    chan = RdmaChannel(child, CreditRing(self._depth, self._slot_size), self._make_endpoint)
                    child.accept(_conn_param(self._pv))
                    self._pending.append(chan)
                except Exception as exc:  # noqa: BLE001 - refuse this peer, keep listening
                    log.warning("rdma accept failed: %s", exc)
                    with contextlib.suppress(Exception):
                        child.reject()
            elif kind == cm.RDMA_CM_EVENT_ESTABLISHED and self._pending:
                chan = self._pending.popleft()
                chan.start()
                self.channels.append(chan)
            elif kind in (cm.RDMA_CM_EVENT_REJECTED, cm.RDMA_CM_EVENT_CONNECT_ERROR) and self._pending:
                self._pending.popleft().close()

    def _next_event(self) -> tuple[int, Any]:
        """Blocking: the next CM event (and a child id for a connection request)."""
        pv = self._pv
        ev = pv.cmid.CMEvent(self._ec)
        try:
            kind = ev.event_type
            child = None
            if kind == pv.cm_enums.RDMA_CM_EVENT_CONNECT_REQUEST:
                child = pv.cmid.CMID(creator=ev, listen_id=self._listen_id)
            return kind, child
        finally:
            ev.ack_cm_event()

    def close(self) -> None:
        self._closed = True
        self._task.cancel()
        for chan in [*self.channels, *self._pending]:
            chan.close()
        with contextlib.suppress(Exception):
            self._listen_id.close()
        with contextlib.suppress(Exception):
            self._ec.close()  # wakes the event thread with an error


async def rdma_listen(
    host: str, port: int, make_endpoint: Callable[[], Endpoint], *, depth: int = 64, slot_size: int = 1 << 16
) -> RdmaListener:
    """Listen on ``host:port``: an address of the RDMA netdev (binding picks the device;
    a wildcard address has no device to share) and an explicit port."""
    if port == 0:
        raise ConnectError(f"rdma://{host}:0: RDMA listening needs an explicit port")
    pv = _verbs()

    def setup() -> tuple[Any, Any]:
        ec = pv.cmid.CMEventChannel()
        lid = pv.cmid.CMID(creator=ec)
        lid.bind_addr(_addrinfo(pv, passive=True, host=host, port=port))
        lid.listen()
        return ec, lid

    try:
        ec, lid = await asyncio.to_thread(setup)
    except Exception as exc:
        raise ConnectError(f"rdma://{host}:{port}: cannot listen: {exc}") from exc
    return RdmaListener(ec, lid, make_endpoint, depth, slot_size)
