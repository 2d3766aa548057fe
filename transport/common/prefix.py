"""The prefix-cache block hash: one definition for workers and gateways.

A worker's KV cache names each full block of a prompt by a hash chained over
its parent's, ``h_i = H(h_{i-1}, tokens of block i)`` (``inference.kv_cache``),
and reports the roots it caches in ``Stats.prefix_hashes``. A gateway that
tokenizes a prompt the same way and hashes it with the same block size gets
the same chain (:func:`chain_hashes`), so a routing policy can tell which
replica already holds a prompt's prefix. ``Hello.prefix_hash`` carries
:data:`PREFIX_HASH_SCHEME`; the two sides compare names, never guess.

It lives in ``transport`` because both sides must agree on it, as on a wire
format: changing :func:`block_hash` means renaming the scheme.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["PREFIX_HASH_SCHEME", "ROOT_HASH", "block_hash", "chain_hashes"]

ROOT_HASH = 0
PREFIX_HASH_SCHEME = "blake2b64-chain/u32le"
_BIG_ENDIAN = sys.byteorder == "big"


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Stable u64 hash of one full block, chained on its parent's hash."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    a = array("I", tokens)
    if _BIG_ENDIAN:  # the scheme hashes u32 little-endian token ids on every host
        a.byteswap()
    h.update(a.tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> tuple[int, ...]:
    """The chain over ``tokens``' full blocks (a partial last block has no hash), at most
    ``limit`` of them from the first."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return tuple(out)
