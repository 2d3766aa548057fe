"""quicserve wire format, version 1 (sans-I/O encoder and decoder).

This docstring is the specification.

Stream
------
A connection is a sequence of frames in each direction. The first frame each
way is HELLO. All integers are little-endian.

Frame header (12 bytes)::

    offset size field
    0      1    version      wire version, must be 1 (WIRE_VERSION)
    1      1    type         FrameType below
    2      2    flags        per-type bits; bits not defined for the type must be 0
    4      4    request_id   u32; 0 for connection-level frames
    8      4    length       body length in bytes, <= max_frame (default 16 MiB)

Frame types and bodies
----------------------
=====  =========  ==========  ==================================================
type   name       request_id  body
=====  =========  ==========  ==================================================
1      HELLO      0           msgpack [version, role, identity, [models],
                              [capabilities], initial_credit, max_frame]
2      SUBMIT     rid (>0)    msgpack [model, params, prompt|nil,
                              prompt_token_ids (bin, u32 LE)|nil, messages|nil,
                              deadline_ms, priority, trace|nil, return_text]
                              params = [max_tokens, temperature, top_p, top_k,
                              seed|nil, [stop], stop_token_ids (bin, u32 LE),
                              ignore_eos, logprobs, top_logprobs (0..20)]
3      CANCEL     rid (>0)    empty
4      CREDIT     rid (>0)    u32 tokens granted
5      TOKENS     0           packed arrays, see below
6      FINISH     rid (>0)    msgpack [reason, prompt_tokens, completion_tokens,
                              cached_tokens]
7      ERROR      rid or 0    msgpack [code, message]; rid 0 = whole connection
8      STATS      0           msgpack [queue_depth, running, kv_blocks_free,
                              kv_blocks_total, prefix_hit_rate,
                              prefix_hashes (bin, u64 LE), tokens_per_s]
9      PING       0           u64 nonce
10     PONG       0           u64 nonce
11     GOODBYE    0           UTF-8 reason
=====  =========  ==========  ==================================================

msgpack lists may carry extra trailing elements (ignored: additive evolution);
fewer than listed is an error. Enum values outside the known set are errors.

Per-stream state (delta coding)
-------------------------------
Encoder and decoder each keep a :class:`StreamTable`: a SUBMIT (encoded or
decoded) opens stream ``rid`` with the options ``logprobs`` and
``top_logprobs`` from its params; a FINISH or ERROR with that rid closes it.
Token frames never repeat these options: a stream's logprobs and top-n
alternatives appear in a TOKENS frame exactly when its Submit asked for them.
Tokens for a stream that is not open, a second SUBMIT for an open rid, or
FINISH for a rid that is not open are protocol errors. CANCEL and CREDIT for
unknown rids are allowed (they can cross a FINISH in flight).

Both sides also remember the request-id list of the previous TOKENS frame; a
continuous-batching engine usually emits the same requests in the same order
step after step, and then the list is not resent (flag SAME_RIDS).

TOKENS frame
------------
flags::

    bit 0      SAME_RIDS   request ids = previous TOKENS frame's (not sent)
    bit 1      ONE_EACH    every entry has exactly one token (counts not sent)
    bit 2      NO_TEXT     no text deltas (text_lens and text not sent)
    bits 3-4   width of request ids   (0 = u8, 1 = u16, 2 = u32)
    bits 5-6   width of counts
    bits 7-8   width of token ids
    bits 9-10  width of text lengths
    bits 11-15 reserved, 0

body::

    u32 n                        entries (one per request in this step)
    rids[n]                      unless SAME_RIDS
    counts[n]                    unless ONE_EACH; T = sum(counts) (else T = n)
    token_ids[T]
    text_lens[n]                 unless NO_TEXT
    text[sum(text_lens)]         UTF-8 deltas, concatenated in entry order
    logprobs f32[L]              L = sum of counts of entries whose stream has logprobs
    top_ids u32[K]               K = sum of count * top_n over entries
    top_logprobs f32[K]

Widths are chosen per frame from the largest value. The encoder uses only u8
or u32 for token ids (u16 saves 2 bytes per token but its narrowing costs
more CPU than it is worth); request ids, counts and text lengths use all three.
The body must be consumed exactly. A 64-request single-token step with a
32k vocabulary and 1-6 bytes of text per token costs about 9 bytes per token
(about 6 with a byte-level vocabulary); an OpenAI SSE chunk costs about 185.

Limits and errors
-----------------
The decoder never buffers more than one header plus ``max_frame`` bytes; a
length above ``max_frame``, an unknown version, type or flag, a body that does
not parse exactly, or a stream-state violation raises :class:`WireError`
(a ``ProtocolError``), after which the decoder stays failed. A truncated frame
is simply incomplete until :meth:`FrameDecoder.close` is called, which raises
``WireError`` if a partial frame is pending.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import WireError
from .messages import (
    PROTOCOL_VERSION,
    Cancel,
    Credit,
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Goodbye,
    Hello,
    Message,
    Ping,
    Pong,
    SamplingParams,
    Stats,
    Submit,
    TokenBatch,
)

__all__ = [
    "WIRE_VERSION",
    "HEADER_SIZE",
    "DEFAULT_MAX_FRAME",
    "FrameType",
    "TokenFlags",
    "StreamOptions",
    "StreamTable",
    "FrameEncoder",
    "FrameDecoder",
    "WireError",
]

WIRE_VERSION = PROTOCOL_VERSION
HEADER = struct.Struct("<BBHII")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 1 << 24
MAX_TOP_N = 20
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BIG_ENDIAN = sys.byteorder == "big"
_WIDTH_CODES = ("B", "H", "I")
assert array("I").itemsize == 4 and array("H").itemsize == 2 and array("f").itemsize == 4
assert array("Q").itemsize == 8


class FrameType(enum.IntEnum):
    HELLO = 1
    SUBMIT = 2
    CANCEL = 3
    CREDIT = 4
    TOKENS = 5
    FINISH = 6
    ERROR = 7
    STATS = 8
    PING = 9
    PONG = 10
    GOODBYE = 11


class TokenFlags(enum.IntFlag):
    SAME_RIDS = 1
    ONE_EACH = 2
    NO_TEXT = 4


_SAME_RIDS, _ONE_EACH, _NO_TEXT = 1, 2, 4  # plain ints: IntFlag arithmetic is slow
_RID_SHIFT, _CNT_SHIFT, _TOK_SHIFT, _TL_SHIFT = 3, 5, 7, 9
_TOKEN_FLAG_MASK = (1 << 11) - 1


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


def _opts(params: SamplingParams) -> StreamOptions:
    return StreamOptions(bool(params.logprobs), int(params.top_logprobs))


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


class FrameEncoder:
    """Turns messages into frame bytes, keeping the sender's per-stream state."""

    def __init__(self, streams: StreamTable | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.streams = streams if streams is not None else StreamTable()
        self.max_frame = max_frame  # the peer's limit
        self._last_rids: bytes | None = None  # previous TOKENS frame's rids, u32 LE
        self._sizes_cache: tuple[int, int] | None = None
        self._last_removals = -1

    def _frame(self, ftype: FrameType, rid: int, body: bytes, flags: int = 0) -> bytes:
        if len(body) > self.max_frame:
            raise ValueError(f"{ftype.name} frame of {len(body)} bytes exceeds max_frame {self.max_frame}")
        return HEADER.pack(WIRE_VERSION, ftype, flags, rid, len(body)) + body

    def encode(self, msg: Message) -> bytes:
        """Encode one message. Raises ``ValueError`` for messages that break the rules."""
        if isinstance(msg, TokenBatch):
            return self._tokens(msg)
        if isinstance(msg, Credit):
            _check_rid(msg.request_id)
            if not 0 < msg.tokens < 1 << 32:
                raise ValueError("credit must be 1..2**32-1")
            return self._frame(FrameType.CREDIT, msg.request_id, _U32.pack(msg.tokens))
        if isinstance(msg, Finish):
            _check_rid(msg.request_id)
            if not self.streams.close(msg.request_id):
                raise ValueError(f"Finish for request {msg.request_id} that is not open")
            body = _pack([int(msg.reason), msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens])
            return self._frame(FrameType.FINISH, msg.request_id, body)
        if isinstance(msg, Error):
            if msg.request_id:
                _check_rid(msg.request_id)
                if not self.streams.close(msg.request_id):
                    raise ValueError(f"Error for request {msg.request_id} that is not open")
            return self._frame(FrameType.ERROR, msg.request_id, _pack([int(msg.code), msg.message]))
        if isinstance(msg, Submit):
            _check_rid(msg.request_id)
            body = _pack(_submit_fields(msg))
            if not self.streams.open(msg.request_id, _opts(msg.params)):
                raise ValueError(f"request {msg.request_id} is already open (or too many streams)")
            return self._frame(FrameType.SUBMIT, msg.request_id, body)
        if isinstance(msg, Cancel):
            _check_rid(msg.request_id)
            return self._frame(FrameType.CANCEL, msg.request_id, b"")
        if isinstance(msg, Ping):
            return self._frame(FrameType.PING, 0, _U64.pack(msg.nonce))
        if isinstance(msg, Pong):
            return self._frame(FrameType.PONG, 0, _U64.pack(msg.nonce))
        if isinstance(msg, Stats):
            hashes = array("Q", msg.prefix_hashes)
            body = _pack(
                [
                    msg.queue_depth,
                    msg.running,
                    msg.kv_blocks_free,
                    msg.kv_blocks_total,
                    float(msg.prefix_hit_rate),
                    _le(hashes),
                    float(msg.tokens_per_s),
                ]
            )
            return self._frame(FrameType.STATS, 0, body)
        if isinstance(msg, Hello):
            body = _pack(
                [
                    msg.version,
                    msg.role,
                    msg.identity,
                    list(msg.models),
                    list(msg.capabilities),
                    msg.initial_credit,
                    msg.max_frame,
                ]
            )
            return self._frame(FrameType.HELLO, 0, body)
        if isinstance(msg, Goodbye):
            return self._frame(FrameType.GOODBYE, 0, msg.reason.encode())
        raise TypeError(f"not a wire message: {type(msg).__name__}")

    def _tokens(self, b: TokenBatch) -> bytes:
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
        body = b"".join(parts)
        if len(body) > self.max_frame:
            raise ValueError(f"TOKENS frame of {len(body)} bytes exceeds max_frame {self.max_frame}")
        return HEADER.pack(WIRE_VERSION, FrameType.TOKENS, flags, 0, len(body)) + body


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


def _check_rid(rid: int) -> None:
    if not 0 < rid < 1 << 32:
        raise ValueError(f"request id {rid} outside 1..2**32-1")


def _pack(obj: object) -> bytes:
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _submit_fields(s: Submit) -> list[object]:
    p = s.params
    if not 0 <= p.top_logprobs <= MAX_TOP_N:
        raise ValueError(f"top_logprobs must be 0..{MAX_TOP_N}")
    set_count = sum(x is not None for x in (s.prompt, s.prompt_token_ids, s.messages))
    if set_count != 1:
        raise ValueError("Submit needs exactly one of prompt, prompt_token_ids, messages")
    params = [
        p.max_tokens,
        float(p.temperature),
        float(p.top_p),
        p.top_k,
        p.seed,
        list(p.stop),
        _le(array("I", p.stop_token_ids)),
        bool(p.ignore_eos),
        bool(p.logprobs),
        p.top_logprobs,
    ]
    ids = None if s.prompt_token_ids is None else _le(array("I", s.prompt_token_ids))
    msgs = None if s.messages is None else list(s.messages)
    return [s.model, params, s.prompt, ids, msgs, s.deadline_ms, s.priority, s.trace, bool(s.return_text)]


# --- decoding ------------------------------------------------------------------------------------


class _Body:
    """Validating accessors over one decoded msgpack list."""

    __slots__ = ("items", "what")

    def __init__(self, items: object, what: str, min_len: int) -> None:
        if not isinstance(items, list) or len(items) < min_len:
            raise WireError(f"{what}: expected a list of at least {min_len} fields")
        self.items: list[object] = items
        self.what = what

    def fail(self, i: int, kind: str) -> WireError:
        return WireError(f"{self.what}: field {i} must be {kind}")

    def integer(self, i: int, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
        v = self.items[i]
        if type(v) is not int or not lo <= v <= hi:
            raise self.fail(i, f"an integer in {lo}..{hi}")
        return v

    def opt_integer(self, i: int) -> int | None:
        return None if self.items[i] is None else self.integer(i, -(1 << 63))

    def number(self, i: int) -> float:
        v = self.items[i]
        if type(v) is int:
            return float(v)
        if type(v) is not float:
            raise self.fail(i, "a number")
        return v

    def flag(self, i: int) -> bool:
        v = self.items[i]
        if type(v) is not bool:
            raise self.fail(i, "a bool")
        return v

    def text(self, i: int) -> str:
        v = self.items[i]
        if type(v) is not str:
            raise self.fail(i, "a string")
        return v

    def opt_text(self, i: int) -> str | None:
        return None if self.items[i] is None else self.text(i)

    def strs(self, i: int) -> tuple[str, ...]:
        v = self.items[i]
        if not isinstance(v, list) or not all(type(x) is str for x in v):
            raise self.fail(i, "a list of strings")
        return tuple(v)

    def uints(self, i: int, itemsize: int = 4) -> tuple[int, ...]:
        v = self.items[i]
        if type(v) is not bytes or len(v) % itemsize:
            raise self.fail(i, f"bytes of u{itemsize * 8} values")
        a = array("I" if itemsize == 4 else "Q")
        a.frombytes(v)
        if _BIG_ENDIAN:
            a.byteswap()
        return tuple(a)

    def str_dict(self, i: int) -> dict[str, str] | None:
        v = self.items[i]
        if v is None:
            return None
        if not isinstance(v, dict) or not all(type(k) is str and type(x) is str for k, x in v.items()):
            raise self.fail(i, "a map of strings")
        return v

    def chat(self, i: int) -> tuple[dict[str, Any], ...] | None:
        v = self.items[i]
        if v is None:
            return None
        if not isinstance(v, list) or not all(
            isinstance(m, dict) and all(type(k) is str for k in m) for m in v
        ):
            raise self.fail(i, "a list of maps with string keys")
        return tuple(v)


def _unpack(body: memoryview, what: str, min_len: int) -> _Body:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types for bad input; all mean one thing
        raise WireError(f"{what}: body is not valid msgpack ({type(exc).__name__})") from None
    return _Body(obj, what, min_len)


def _enum(cls: type[enum.IntEnum], v: int, what: str) -> Any:
    try:
        return cls(v)
    except ValueError:
        raise WireError(f"{what}: unknown {cls.__name__} {v}") from None


class FrameDecoder:
    """Bytes in (split anywhere), messages out. Bounded buffering; one error type."""

    def __init__(self, streams: StreamTable | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.streams = streams if streams is not None else StreamTable()
        self.max_frame = max_frame  # our limit, announced in our Hello
        self._buf = bytearray()
        self._failed: WireError | None = None
        self._last_rids: array[int] | None = None
        self._last_removals = -1
        self._extras_cache: tuple[bytes, bytes, int, int] | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Add received bytes; return every message now complete."""
        if self._failed is not None:
            raise self._failed
        # Parse straight from ``data`` when nothing is pending (the common case:
        # whole frames per read), else from the pending buffer plus ``data``.
        pending = self._buf
        src: bytes | bytearray | memoryview
        if pending:
            pending += data
            src = pending
        else:
            src = data
        out: list[Message] = []
        pos = 0
        unpack = HEADER.unpack_from
        max_frame = self.max_frame
        try:
            with memoryview(src) as mv:
                end = len(mv)
                while end - pos >= HEADER_SIZE:
                    version, ftype, flags, rid, length = unpack(mv, pos)
                    if version != WIRE_VERSION:
                        raise WireError(
                            f"unsupported wire version {version} (this side speaks {WIRE_VERSION})"
                        )
                    if length > max_frame:
                        raise WireError(f"frame length {length} exceeds max_frame {max_frame}")
                    start = pos + HEADER_SIZE
                    if end - start < length:
                        break
                    out.append(self._message(ftype, flags, rid, mv[start : start + length]))
                    pos = start + length
        except WireError as exc:
            self._failed = exc
            self._buf = bytearray()  # rebind, not clear(): a traceback may still pin a view
            raise
        if src is pending:
            if pos:
                del pending[:pos]
        elif pos < len(data):
            pending += data[pos:]
        return out

    def close(self) -> None:
        """End of input: raise ``WireError`` if a frame was cut short."""
        if self._failed is not None:
            raise self._failed
        if self._buf:
            self._failed = WireError(f"connection ended inside a frame ({len(self._buf)} bytes pending)")
            raise self._failed

    def _message(self, ftype: int, flags: int, rid: int, body: memoryview) -> Message:
        if ftype == FrameType.TOKENS:
            if flags & ~_TOKEN_FLAG_MASK:
                raise WireError(f"TOKENS: reserved flag bits set ({flags:#x})")
            if rid:
                raise WireError("TOKENS: request id must be 0")
            return self._tokens(flags, body)
        if flags:
            raise WireError(f"frame type {ftype}: flags must be 0, got {flags:#x}")
        if ftype in _RID_FRAMES:
            if rid == 0:
                raise WireError(f"{FrameType(ftype).name}: request id must not be 0")
        elif ftype != FrameType.ERROR and rid != 0:
            raise WireError(f"frame type {ftype}: request id must be 0")
        if ftype == FrameType.CREDIT:
            if len(body) != 4:
                raise WireError("CREDIT: body must be 4 bytes")
            tokens = _U32.unpack(body)[0]
            if tokens == 0:
                raise WireError("CREDIT: zero tokens")
            return Credit(rid, tokens)
        if ftype == FrameType.FINISH:
            f = _unpack(body, "FINISH", 4)
            reason = _enum(FinishReason, f.integer(0), "FINISH")
            if not self.streams.close(rid):
                raise WireError(f"FINISH for request {rid} that is not open")
            return Finish(rid, reason, f.integer(1), f.integer(2), f.integer(3))
        if ftype == FrameType.ERROR:
            f = _unpack(body, "ERROR", 2)
            code = _enum(ErrorCode, f.integer(0), "ERROR")
            msg = f.text(1)
            if rid and not self.streams.close(rid):
                raise WireError(f"ERROR for request {rid} that is not open")
            return Error(rid, code, msg)
        if ftype == FrameType.CANCEL:
            if len(body):
                raise WireError("CANCEL: body must be empty")
            return Cancel(rid)
        if ftype in (FrameType.PING, FrameType.PONG):
            if len(body) != 8:
                raise WireError("PING/PONG: body must be 8 bytes")
            nonce = _U64.unpack(body)[0]
            return Ping(nonce) if ftype == FrameType.PING else Pong(nonce)
        if ftype == FrameType.SUBMIT:
            return self._submit(rid, body)
        if ftype == FrameType.STATS:
            f = _unpack(body, "STATS", 7)
            return Stats(
                f.integer(0),
                f.integer(1),
                f.integer(2),
                f.integer(3),
                f.number(4),
                f.uints(5, 8),
                f.number(6),
            )
        if ftype == FrameType.HELLO:
            f = _unpack(body, "HELLO", 7)
            return Hello(
                version=f.integer(0, 0, 255),
                role=f.text(1),
                identity=f.text(2),
                models=f.strs(3),
                capabilities=f.strs(4),
                initial_credit=f.integer(5, 1, (1 << 32) - 1),
                max_frame=f.integer(6, 1 << 12, 1 << 31),
            )
        if ftype == FrameType.GOODBYE:
            try:
                return Goodbye(bytes(body).decode())
            except UnicodeDecodeError:
                raise WireError("GOODBYE: reason is not UTF-8") from None
        raise WireError(f"unknown frame type {ftype}")

    def _submit(self, rid: int, body: memoryview) -> Submit:
        f = _unpack(body, "SUBMIT", 9)
        p = _Body(f.items[1], "SUBMIT params", 10)
        params = SamplingParams(
            max_tokens=p.integer(0),
            temperature=p.number(1),
            top_p=p.number(2),
            top_k=p.integer(3),
            seed=p.opt_integer(4),
            stop=p.strs(5),
            stop_token_ids=p.uints(6),
            ignore_eos=p.flag(7),
            logprobs=p.flag(8),
            top_logprobs=p.integer(9, 0, MAX_TOP_N),
        )
        ids = None if f.items[3] is None else f.uints(3)
        sub = Submit(
            request_id=rid,
            model=f.text(0),
            params=params,
            prompt=f.opt_text(2),
            prompt_token_ids=ids,
            messages=f.chat(4),
            deadline_ms=f.integer(5),
            priority=f.integer(6, -(1 << 31), (1 << 31) - 1),
            trace=f.str_dict(7),
            return_text=f.flag(8),
        )
        if sum(x is not None for x in (sub.prompt, sub.prompt_token_ids, sub.messages)) != 1:
            raise WireError("SUBMIT: exactly one of prompt, prompt_token_ids, messages must be set")
        if not self.streams.open(rid, _opts(params)):
            raise WireError(f"SUBMIT for request {rid} that is already open (or too many streams)")
        return sub

    def _tokens(self, flags: int, body: memoryview) -> TokenBatch:
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
            rids = array("I", last)
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
            counts = _u32_array(_ones(n))
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
            batch = TokenBatch(rids, counts, toks, tlens, text)
        if pos != size:
            raise WireError(f"TOKENS: {size - pos} trailing bytes")
        if not flags & _SAME_RIDS:
            self._last_rids = array("I", rids)  # private copy: the batch is the caller's
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
            return TokenBatch(rids, counts, toks, tlens, text), pos
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


_RID_FRAMES = frozenset({FrameType.SUBMIT, FrameType.CANCEL, FrameType.CREDIT, FrameType.FINISH})
