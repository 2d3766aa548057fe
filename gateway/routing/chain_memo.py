"""A prompt's block-hash chain, fast for prefixes seen before (:class:`ChainMemo`).

:func:`transport.common.prefix.chain_hashes` hashes every block with BLAKE2b over its u32
little-endian token ids, chained on its parent. A gateway that routes by cache sees the same
system prompts, documents and conversation histories again and again, so :class:`ChainMemo`
remembers what it hashed in a radix tree over the prompt's bytes, and a prefix seen before costs
a dict lookup and a memory compare per run of blocks instead of a hash per block.

How it works: a node maps the bytes of a block to the edge that starts with it; an edge holds a
run of whole blocks (their bytes) and their chain hashes, and the node below it. A prompt walks
down while its bytes start with the edge's run; at the first difference inside a run it takes the
matching blocks (a binary search over the run), then hashes on from there. Given ``held`` (the
hashes any replica holds: the cache index's), it stops after the first block nobody holds (no
replica can serve the blocks after it, so a router need not know them) and remembers only the
held ones (a prompt's fresh query never grows the tree). Bounded: at ``max_blocks`` remembered
blocks or ``max_edges`` runs, it starts over empty.

:func:`u32le` turns token ids into those bytes (a compiled ``struct`` per length: faster than
``array``, which the scheme's definition uses).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Sequence

__all__ = ["ChainMemo", "u32le"]

_STRUCTS: dict[int, struct.Struct] = {}


def u32le(ids: Sequence[int]) -> bytes:
    """``ids`` as u32 little-endian bytes (``struct.error`` for one outside [0, 2**32))."""
    n = len(ids)
    s = _STRUCTS.get(n)
    if s is None:
        if len(_STRUCTS) >= 512:
            _STRUCTS.clear()
        s = _STRUCTS[n] = struct.Struct(f"<{n}I")
    return s.pack(*ids)


class _Edge:
    __slots__ = ("run", "hashes", "child")

    def __init__(self, run: bytes, hashes: tuple[int, ...], child: dict[bytes, _Edge]) -> None:
        self.run = run  # whole blocks' bytes
        self.hashes = hashes  # their chain hashes
        self.child = child  # the node after the run: the next block's bytes -> its edge


def _matching_blocks(buf: bytes, pos: int, run: bytes, blk: int, most: int) -> int:
    """How many whole blocks of ``run`` ``buf`` repeats from ``pos`` (the first is known to; at most ``most``)."""
    lo, hi = 1, most  # lo blocks match; more than hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if buf.startswith(run[: mid * blk], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChainMemo:
    """:func:`transport.common.prefix.chain_hashes` over u32le bytes, remembered (see the module)."""

    __slots__ = ("max_blocks", "max_edges", "blocks", "edges", "_roots")

    def __init__(self, max_blocks: int = 1 << 18, max_edges: int = 1 << 16) -> None:
        self.max_blocks = max_blocks
        self.max_edges = max_edges
        self.blocks = 0  # remembered
        self.edges = 0
        self._roots: dict[int, dict[bytes, _Edge]] = {}  # block size -> tree

    def chain(self, ids: Sequence[int], block_size: int, limit: int) -> tuple[int, ...]:
        """The chain over ``ids``' full blocks, at most ``limit`` of them."""
        n = limit * block_size
        return self.chain_bytes(u32le(ids[:n] if len(ids) > n else ids), block_size, limit)

    def chain_bytes(self, buf: bytes, block_size: int, limit: int, held: Container[int] | None = None
                    ) -> tuple[int, ...]:
        """The chain over ``buf``'s full blocks (``buf``: u32le token ids), at most ``limit``; with
        ``held``, only up to and including the first block not in it."""
        blk = 4 * block_size
        end = min(len(buf) // blk, limit) * blk
        if end <= 0:
            return ()
        if self.blocks >= self.max_blocks or self.edges >= self.max_edges:
            self._roots.clear()
            self.blocks = self.edges = 0
        node = self._roots.setdefault(block_size, {})
        out: list[int] = []
        pos = 0
        cut: _Edge | None = None  # an edge the prompt leaves inside its run (split it to add a branch) ...
        cut_at = 0  # ... after this many blocks
        while pos < end:
            e = node.get(buf[pos : pos + blk])
            if e is None:
                break
            run = e.run
            if pos + len(run) <= end and buf.startswith(run, pos):
                out += e.hashes
                pos += len(run)
                node = e.child
                continue
            m = _matching_blocks(buf, pos, run, blk, min(len(run), end - pos) // blk)
            out += e.hashes[:m]
            pos += m * blk
            cut, cut_at = e, m
            break
        if pos >= end:
            return tuple(out)
        first = len(out)
        parent = (out[-1] if out else 0).to_bytes(8, "little")
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        keep = end
        for o in range(pos, end, blk):
            h = blake2b(parent, digest_size=8)
            h.update(buf[o : o + blk])
            parent = h.digest()
            x = from_bytes(parent, "little")
            out.append(x)
            if held is not None and x not in held:
                keep = o  # nobody holds this block: not worth remembering, nor the ones after it
                break
        if keep > pos:
            if cut is not None:
                node = self._split(cut, cut_at, blk)
            node[buf[pos : pos + blk]] = _Edge(buf[pos:keep], tuple(out[first : first + (keep - pos) // blk]), {})
            self.blocks += (keep - pos) // blk
            self.edges += 1
        return tuple(out)

    def _split(self, e: _Edge, m: int, blk: int) -> dict[bytes, _Edge]:
        """Cut ``e`` after its first ``m`` blocks; returns the node between the two halves."""
        below = {e.run[m * blk : (m + 1) * blk]: _Edge(e.run[m * blk :], e.hashes[m:], e.child)}
        e.run, e.hashes, e.child = e.run[: m * blk], e.hashes[:m], below
        self.edges += 1
        return below

