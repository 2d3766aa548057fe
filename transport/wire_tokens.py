"""TOKENS frame bodies: packed arrays, delta-coded against per-stream state.

The layout and flags are specified in :mod:`transport.wire`. This module holds
the per-connection state that makes the coding a delta (:class:`StreamTable`,
the previous frame's request ids) and the array packing, which works on whole
byte strings (slicing, ``array.frombytes``) rather than per-token objects.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from .errors import WireError
from .messages import SamplingParams, TokenBatch

__all__ = [
    "TokenFlags",
    "TOKEN_FLAG_MASK",
    "StreamOptions",
    "StreamTable",
    "stream_options",
    "TokenEncoder",
    "TokenDecoder",
]

_U32 = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"
_WIDTH_CODES = ("B", "H", "I")
assert array("I").itemsize == 4 and array("H").itemsize == 2 and array("f").itemsize == 4


class TokenFlags(enum.IntFlag):
    SAME_RIDS = 1
    ONE_EACH = 2
    NO_TEXT = 4


_SAME_RIDS, _ONE_EACH, _NO_TEXT = 1, 2, 4  # plain ints: IntFlag arithmetic is slow
_RID_SHIFT, _CNT_SHIFT, _TOK_SHIFT, _TL_SHIFT = 3, 5, 7, 9
TOKEN_FLAG_MASK = (1 << 11) - 1


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What is constant for a stream and therefore never sent per token."""

    logprobs: bool
    top_n: int


class StreamTable:
    """Open streams of one connection endpoint (shared by its encoder and decoder)."""

    def __init__(self, max_streams: int = 1 << 16) -> None:
        self.max_streams = max_streams
        self.options: dict[int, StreamOptions] = {}
        self.with_extras = 0  # open streams that want logprobs or top-n
        self.removals = 0  # bumps on every close, to revalidate cached rid lists

    def open(self, rid: int, opts: StreamOptions) -> bool:
        if rid in self.options or len(self.options) >= self.max_streams:
            return False
        self.options[rid] = opts
        if opts.logprobs or opts.top_n:
            self.with_extras += 1
        return True

    def close(self, rid: int) -> bool:
        opts = self.options.pop(rid, None)
        if opts is None:
            return False
        if opts.logprobs or opts.top_n:
            self.with_extras -= 1
        self.removals += 1
        return True

    def __contains__(self, rid: object) -> bool:
        return rid in self.options

    def __len__(self) -> int:
        return len(self.options)


def stream_options(params: SamplingParams) -> StreamOptions:
    if not params.logprobs and not params.top_logprobs:
        return _PLAIN  # most requests: one shared instance
    return StreamOptions(bool(params.logprobs), int(params.top_logprobs))


_PLAIN = StreamOptions(False, 0)


def _le(a: array[Any]) -> bytes:
    if _BIG_ENDIAN:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _zeros(n: int) -> bytes:
    z = _ZEROS.get(n)
    if z is None:
        z = bytes(n)
        if n <= 4096:
            _ZEROS[n] = z
    return z


_ZEROS: dict[int, bytes] = {}


def _pack_uints(a: array[int], allow16: bool = True) -> tuple[int, bytes]:
    """Narrowest of u8/u16/u32 that holds every value (byte slicing: no per-item objects).

    Token ids skip u16 (``allow16=False``): narrowing to and widening from u16
    costs more CPU per step than the 2 bytes per token it saves.
    """
    if a.typecode != "I":
        if any(x < 0 or x >= 1 << 32 for x in a):
            raise ValueError("token batch value outside u32")
        a = array("I", a)
    raw = _le(a)
    n = len(a)
    z = _zeros(n)
    if raw[2::4] != z or raw[3::4] != z:
        return 2, raw
    if raw[1::4] != z:
        if not allow16:
            return 2, raw
        out = bytearray(2 * n)
        out[0::2] = raw[0::4]
        out[1::2] = raw[1::4]
        return 1, bytes(out)
    return 0, raw[0::4]


def _ones(n: int) -> bytes:
    """``n`` u32 ones, little-endian."""
    o = _ONES.get(n)
    if o is None:
        o = b"\x01\x00\x00\x00" * n
        if n <= 4096:
            _ONES[n] = o
    return o


_ONES: dict[int, bytes] = {}
_ONES_ARRAYS: dict[int, array[int]] = {}

# Decoded batches without logprobs share these empty arrays (building five per
# frame through default factories cost more than decoding the frame). Nobody
# mutates a received batch; keep it that way.
_NO_B: array[int] = array("B")
_NO_I: array[int] = array("I")
_NO_F: array[float] = array("f")


def _ones_array(n: int) -> array[int]:
    """A fresh ``array('I')`` of ``n`` ones (copied from a cached one)."""
    a = _ONES_ARRAYS.get(n)
    if a is None:
        a = _u32_array(_ones(n))
        if n <= 4096:
            _ONES_ARRAYS[n] = a
    return a[:]


def _unpack_uints(data: memoryview, n: int, code: int) -> array[int]:
    """Widen ``n`` packed u8/u16/u32 values to an ``array('I')``."""
    if code == 2:
        return _u32_array(data)
    out = bytearray(4 * n)
    if code == 0:
        out[0::4] = data
    else:
        out[0::4] = data[0::2]
        out[1::4] = data[1::2]
    return _u32_array(out)


def _u32_array(data: bytes | bytearray | memoryview) -> array[int]:
    out = array("I")
    out.frombytes(data)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _f32_array(data: bytes | memoryview) -> array[float]:
    out = array("f")
    out.frombytes(data)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


class TokenEncoder:
    """Sender side of the token delta coding for one connection."""

    def __init__(self, streams: StreamTable) -> None:
        self.streams = streams
        self._last_rids: bytes | None = None  # previous TOKENS frame's rids, u32 LE
        self._sizes_cache: tuple[int, int] | None = None
        self._last_removals = -1

    def encode(self, b: TokenBatch) -> tuple[int, bytes]:
        """(flags, body) of the TOKENS frame for this step; ``ValueError`` if inconsistent."""
        rids, counts, toks, tlens = b.request_ids, b.counts, b.token_ids, b.text_lens
        n = len(rids)
        if len(counts) != n or len(tlens) != n:
            raise ValueError("TokenBatch request_ids, counts and text_lens differ in length")
        streams = self.streams
        rid_bytes = _le(rids if rids.typecode == "I" else array("I", rids))
        same = rid_bytes == self._last_rids and self._last_removals == streams.removals
        if not same:
            opts = streams.options
            missing = [r for r in rids if r not in opts]
            if missing:
                raise ValueError(f"tokens for request {missing[0]} that is not open")
        flags = 0
        parts: list[bytes] = [_U32.pack(n)]
        if same:
            flags |= _SAME_RIDS
        else:
            code, data = _pack_uints(rids)
            flags |= code << _RID_SHIFT
            parts.append(data)
        ntok = len(toks)
        if ntok == n and (counts.tobytes() if counts.typecode == "I" else b"") == _ones(n):
            flags |= _ONE_EACH
        else:
            if sum(counts) != ntok:
                raise ValueError("TokenBatch counts do not add up to len(token_ids)")
            code, data = _pack_uints(counts)
            flags |= code << _CNT_SHIFT
            parts.append(data)
        code, data = _pack_uints(toks, allow16=False)
        flags |= code << _TOK_SHIFT
        parts.append(data)
        text = b.text
        if not text:
            if n and tlens.tobytes() != _zeros(n * tlens.itemsize):
                raise ValueError("TokenBatch text_lens do not add up to len(text)")
            flags |= _NO_TEXT
        else:
            if sum(tlens) != len(text):
                raise ValueError("TokenBatch text_lens do not add up to len(text)")
            code, data = _pack_uints(tlens)
            flags |= code << _TL_SHIFT
            parts.append(data)
            parts.append(bytes(text))
        if not streams.with_extras:
            n_lp = n_top = 0
        elif same and flags & _ONE_EACH and self._sizes_cache is not None:
            n_lp, n_top = self._sizes_cache  # same requests, one token each: same sizes
        else:
            n_lp, n_top = _extras_sizes(streams, rids, counts, n)
        self._sizes_cache = (n_lp, n_top) if flags & _ONE_EACH else None
        if len(b.logprobs) != n_lp or len(b.top_ids) != n_top or len(b.top_logprobs) != n_top:
            raise ValueError(
                f"TokenBatch carries {len(b.logprobs)} logprobs / {len(b.top_ids)} top ids, "
                f"its streams' options need {n_lp} / {n_top}"
            )
        if n_lp:
            parts.append(_le(b.logprobs if b.logprobs.typecode == "f" else array("f", b.logprobs)))
        if n_top:
            parts.append(_le(b.top_ids if b.top_ids.typecode == "I" else array("I", b.top_ids)))
            tl = b.top_logprobs
            parts.append(_le(tl if tl.typecode == "f" else array("f", tl)))
        if not same:
            self._last_rids = rid_bytes
        self._last_removals = streams.removals
        return flags, b"".join(parts)


def _extras_sizes(
    streams: StreamTable, rids: array[int], counts: array[int] | None, n: int
) -> tuple[int, int]:
    """(logprob floats, top-n slots) the options of these streams call for."""
    n_lp = n_top = 0
    opts = streams.options
    for i in range(n):
        o = opts.get(rids[i])
        if o is None:
            continue
        c = counts[i] if counts is not None else 1
        if o.logprobs:
            n_lp += c
        n_top += c * o.top_n
    return n_lp, n_top


class TokenDecoder:
    """Receiver side of the token delta coding for one connection."""

    def __init__(self, streams: StreamTable) -> None:
        self.streams = streams
        self._last_rids: array[int] | None = None
        self._last_removals = -1
        self._extras_cache: tuple[bytes, bytes, int, int] | None = None

    def decode(self, flags: int, body: memoryview) -> TokenBatch:
        """The TokenBatch of one TOKENS body; ``WireError`` if it does not parse exactly."""
        # Straight-line on purpose: this runs once per engine step per connection.
        size = len(body)
        if size < 4:
            raise WireError("TOKENS: body too short")
        n = _U32.unpack_from(body, 0)[0]
        pos = 4
        streams = self.streams
        if flags & _SAME_RIDS:
            last = self._last_rids
            if last is None or len(last) != n:
                raise WireError("TOKENS: SAME_RIDS without a matching previous frame")
            rids = last[:]  # a copy: the batch is the caller's (slicing copies ~3x faster than array())
            check = self._last_removals != streams.removals
        else:
            code = (flags >> _RID_SHIFT) & 3
            nb = n << code
            if code > 2 or nb > size - pos:
                raise WireError("TOKENS: request ids do not fit the body")
            rids = _unpack_uints(body[pos : pos + nb], n, code)
            pos += nb
            check = True
        if check:
            opts = streams.options
            missing = [r for r in rids if r not in opts]
            if missing:
                raise WireError(f"TOKENS: request {missing[0]} is not open")
        if flags & _ONE_EACH:
            counts = _ones_array(n)
            ntok = n
        else:
            code = (flags >> _CNT_SHIFT) & 3
            nb = n << code
            if code > 2 or nb > size - pos:
                raise WireError("TOKENS: counts do not fit the body")
            counts = _unpack_uints(body[pos : pos + nb], n, code)
            pos += nb
            ntok = sum(counts)
        code = (flags >> _TOK_SHIFT) & 3
        nb = ntok << code
        if code > 2 or nb > size - pos:
            raise WireError("TOKENS: token ids do not fit the body")
        toks = _unpack_uints(body[pos : pos + nb], ntok, code)
        pos += nb
        if flags & _NO_TEXT:
            tlens = _u32_array(_zeros(4 * n))
            text = b""
        else:
            code = (flags >> _TL_SHIFT) & 3
            nb = n << code
            if code > 2 or nb > size - pos:
                raise WireError("TOKENS: text lengths do not fit the body")
            raw = body[pos : pos + nb]
            tlens = _unpack_uints(raw, n, code)
            pos += nb
            nb = sum(raw) if code == 0 else sum(tlens)
            if nb > size - pos:
                raise WireError("TOKENS: text does not fit the body")
            text = body[pos : pos + nb].tobytes()
            pos += nb
        if streams.with_extras:
            one_each = bool(flags & _ONE_EACH)
            batch, pos = self._extras(rids, counts, toks, tlens, text, body, pos, one_each, not check)
        else:
            batch = TokenBatch(rids, counts, toks, tlens, text, _NO_B, _NO_B, _NO_F, _NO_I, _NO_F)
        if pos != size:
            raise WireError(f"TOKENS: {size - pos} trailing bytes")
        if not flags & _SAME_RIDS:
            self._last_rids = rids[:]  # private copy: the batch is the caller's
        self._last_removals = streams.removals
        return batch

    def _extras(
        self,
        rids: array[int],
        counts: array[int],
        toks: array[int],
        tlens: array[int],
        text: bytes,
        body: memoryview,
        pos: int,
        one_each: bool,
        same: bool,
    ) -> tuple[TokenBatch, int]:
        """Logprob arrays, sized by the options of each entry's stream.

        With the same requests as the previous frame (no stream closed since) and
        one token each, the per-entry options and sizes are the previous ones.
        """
        cached = self._extras_cache
        if same and one_each and cached is not None:
            has_lp, top_ns = array("B", cached[0]), array("B", cached[1])  # bytes -> fresh arrays
            n_lp, n_top = cached[2], cached[3]
        else:
            opts = self.streams.options
            has_lp = array("B")
            top_ns = array("B")
            n_lp = n_top = 0
            for i, rid in enumerate(rids):
                o = opts[rid]
                c = counts[i]
                has_lp.append(o.logprobs)
                top_ns.append(o.top_n)
                if o.logprobs:
                    n_lp += c
                n_top += c * o.top_n
        has_bytes, top_bytes = has_lp.tobytes(), top_ns.tobytes()
        self._extras_cache = (has_bytes, top_bytes, n_lp, n_top) if one_each else None
        if not has_bytes.strip(b"\0") and not top_bytes.strip(b"\0"):
            return TokenBatch(rids, counts, toks, tlens, text, _NO_B, _NO_B, _NO_F, _NO_I, _NO_F), pos
        need = 4 * n_lp + 8 * n_top
        if need > len(body) - pos:
            raise WireError("TOKENS: logprobs do not fit the body")
        lps = _f32_array(body[pos : pos + 4 * n_lp])
        pos += 4 * n_lp
        tids = _u32_array(body[pos : pos + 4 * n_top])
        pos += 4 * n_top
        tlps = _f32_array(body[pos : pos + 4 * n_top])
        pos += 4 * n_top
        return TokenBatch(rids, counts, toks, tlens, text, has_lp, top_ns, lps, tids, tlps), pos
