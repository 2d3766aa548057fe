"""KV_EVENTS frame bodies (a worker's prefix-cache changes): packed u64 arrays, no msgpack.

Body (all little-endian; the spec is :mod:`transport.wire`'s)::

    u64 epoch
    u64 seq
    u32 n                 hashes stored
    u64 stored[n]
    u64 evicted[...]      the rest of the body (none when the FULL flag is set)

A batch of one engine step is a few hashes (a block fills every ``block_size`` tokens of each
running sequence), so the frame is 32 bytes plus 8 a block; a full set (the answer to
KV_SUBSCRIBE) is 8 bytes a cached block.
"""

from __future__ import annotations

import struct
import sys
from array import array

from .errors import WireError
from .messages import KvEvents

__all__ = ["KV_FULL", "KV_FLAG_MASK", "encode_kv_events", "decode_kv_events"]

KV_FULL = 1  # flags bit 0: ``stored`` is the whole cache
KV_FLAG_MASK = KV_FULL
_HEAD = struct.Struct("<QQI")
_BIG_ENDIAN = sys.byteorder == "big"
_U64_MAX = (1 << 64) - 1
assert array("Q").itemsize == 8


def _le(a: array[int]) -> bytes:
    if a.typecode != "Q" or _BIG_ENDIAN:  # a copy, never the caller's array swapped
        a = array("Q", a)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def encode_kv_events(msg: KvEvents) -> tuple[int, bytes]:
    """(flags, body) of a KV_EVENTS frame; ``ValueError`` for a batch the decoder would refuse."""
    if not (0 <= msg.epoch <= _U64_MAX and 0 <= msg.seq <= _U64_MAX):
        raise ValueError("KvEvents epoch and seq must be u64")
    if msg.full and len(msg.evicted):
        raise ValueError("a full KvEvents set evicts nothing")
    return (KV_FULL if msg.full else 0), _HEAD.pack(msg.epoch, msg.seq, len(msg.stored)) + _le(
        msg.stored
    ) + _le(msg.evicted)


def decode_kv_events(flags: int, body: memoryview) -> KvEvents:
    if flags & ~KV_FLAG_MASK:
        raise WireError(f"KV_EVENTS: reserved flag bits set ({flags:#x})")
    if len(body) < _HEAD.size:
        raise WireError(f"KV_EVENTS: body shorter than its {_HEAD.size}-byte head")
    epoch, seq, n = _HEAD.unpack_from(body)
    rest = len(body) - _HEAD.size
    if rest % 8 or n * 8 > rest:
        raise WireError("KV_EVENTS: the hashes do not fill the body exactly")
    full = bool(flags & KV_FULL)
    if full and rest != n * 8:
        raise WireError("KV_EVENTS: a full set evicts nothing")
    stored, evicted = array("Q"), array("Q")
    cut = _HEAD.size + n * 8
    stored.frombytes(body[_HEAD.size : cut])
    evicted.frombytes(body[cut:])
    if _BIG_ENDIAN:
        stored.byteswap()
        evicted.byteswap()
    return KvEvents(epoch, seq, stored, evicted, full)
