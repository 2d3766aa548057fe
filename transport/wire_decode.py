"""The wire's decoder: bytes in (split anywhere), messages out (the spec is :mod:`transport.wire`'s)."""

from __future__ import annotations

import math
from array import array
from dataclasses import replace

import msgpack

from .errors import WireError
from .messages import (
    Auth,
    Cancel,
    Credit,
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Goodbye,
    Hello,
    KvSubscribe,
    Message,
    Ping,
    Pong,
    SamplingParams,
    Stats,
    Submit,
)
from .wire_control import (
    INT64_MAX,
    MAX_TOP_N,
    Fields,
    continuation,
    enum_value,
    params_extension,
    task_fields,
    task_problem,
    unpack_fields,
)
from .wire_frame import (
    CHALLENGE_SIZE,
    DEFAULT_MAX_FRAME,
    HEADER,
    HEADER_SIZE,
    U32,
    U64,
    U64_MAX,
    WIRE_VERSION,
    FrameType,
    SubmitRejected,
    version_problem,
)
from .wire_kv import decode_kv_events
from .wire_tokens import TOKEN_FLAG_MASK, StreamOptions, StreamTable, TokenDecoder, stream_options

__all__ = ["FrameDecoder"]

_FINISH_REASONS = {int(r): r for r in FinishReason}
_unpackb = msgpack.unpackb  # its defaults are our settings: raw=False, strict_map_key, use_list
assert array("Q").itemsize == 8


def _startup(v: object) -> tuple[float, ...]:
    """HELLO field 15: a worker's start-up phases, [] or three finite seconds >= 0."""
    if not isinstance(v, list) or len(v) not in (0, 3) or not all(
            type(x) in (int, float) and 0 <= x < math.inf for x in v):
        raise WireError("HELLO: field 15 must be [] or [load, compile, warm-up] seconds")
    return tuple(float(x) for x in v)


class FrameDecoder:
    """Bytes in (split anywhere), messages out. Bounded buffering; one error type."""

    def __init__(self, streams: StreamTable | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.streams = streams if streams is not None else StreamTable()
        self.max_frame = max_frame  # our limit, announced in our Hello
        self._buf = bytearray()
        self._failed: WireError | None = None
        self._tokens = TokenDecoder(self.streams)
        # Stop after each HELLO (the rest waits in the buffer for the next feed), so that whoever
        # reads it can change max_frame before the frames that follow it are checked.
        self.stop_after_hello = False

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message | SubmitRejected]:
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
        out: list[Message | SubmitRejected] = []
        pos = 0
        unpack = HEADER.unpack_from
        max_frame = self.max_frame
        stop = self.stop_after_hello
        try:
            with memoryview(src) as mv:
                end = len(mv)
                while end - pos >= HEADER_SIZE:
                    version, ftype, flags, rid, length = unpack(mv, pos)
                    if version != WIRE_VERSION:
                        raise WireError(version_problem(version))
                    if length > max_frame:
                        raise WireError(f"frame length {length} exceeds max_frame {max_frame}")
                    start = pos + HEADER_SIZE
                    if end - start < length:
                        break
                    out.append(self._message(ftype, flags, rid, mv[start : start + length]))
                    pos = start + length
                    if stop and ftype == _HELLO:
                        break
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

    def _message(self, ftype: int, flags: int, rid: int, body: memoryview) -> Message | SubmitRejected:
        if ftype == FrameType.TOKENS:
            if flags & ~TOKEN_FLAG_MASK:
                raise WireError(f"TOKENS: reserved flag bits set ({flags:#x})")
            if rid:
                raise WireError("TOKENS: request id must be 0")
            return self._tokens.decode(flags, body)
        if ftype == FrameType.KV_EVENTS:  # its flags: decode_kv_events checks them
            if rid:
                raise WireError("KV_EVENTS: request id must be 0")
            return decode_kv_events(flags, body)
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
            tokens = U32.unpack(body)[0]
            if tokens == 0:
                raise WireError("CREDIT: zero tokens")
            return Credit(rid, tokens)
        if ftype == FrameType.FINISH:
            # Fast path (one per request): a well-formed body, checked field by field;
            # anything else goes through the validating decoder for its exact error.
            try:
                items = _unpackb(body)
            except Exception:
                items = None
            if type(items) is list and len(items) >= 4:
                r, p, c, k = items[0], items[1], items[2], items[3]
                if (type(r) is int and type(p) is int and type(c) is int and type(k) is int
                        and r in _FINISH_REASONS and 0 <= p <= INT64_MAX and 0 <= c <= INT64_MAX and 0 <= k <= INT64_MAX):
                    if not self.streams.close(rid):
                        raise WireError(f"FINISH for request {rid} that is not open")
                    return Finish(rid, _FINISH_REASONS[r], p, c, k)
            f = unpack_fields(body, "FINISH", 4)
            reason = enum_value(FinishReason, f.integer(0), "FINISH")
            if not self.streams.close(rid):
                raise WireError(f"FINISH for request {rid} that is not open")
            return Finish(rid, reason, f.integer(1), f.integer(2), f.integer(3))
        if ftype == FrameType.ERROR:
            f = unpack_fields(body, "ERROR", 2)
            code = enum_value(ErrorCode, f.integer(0), "ERROR")
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
            nonce = U64.unpack(body)[0]
            return Ping(nonce) if ftype == FrameType.PING else Pong(nonce)
        if ftype == FrameType.SUBMIT:
            return self._submit(rid, body)
        if ftype == FrameType.STATS:
            f = unpack_fields(body, "STATS", 7)
            n = len(f.items)
            base = (f.integer(0), f.integer(1), f.integer(2), f.integer(3), f.number(4), f.uints(5, 8), f.number(6))
            if n == 7:
                return Stats(*base)  # a worker that predates the engine counters
            if n < 12 or n == 13:
                raise WireError("STATS: the engine counters (7..11) and the KV-event fields (12, 13) come all "
                                "together or not at all")
            # one constructor call (a worker sends these every stats_interval; replace() costs ten times it)
            return Stats(*base, f.integer(7), f.number(8), f.integer(9), f.integer(10), f.number(11),
                         *((f.integer(12, 0, U64_MAX), f.integer(13, 0, U64_MAX)) if n > 12 else ()))
        if ftype == FrameType.HELLO:
            f = unpack_fields(body, "HELLO", 7)
            hello = Hello(
                version=f.integer(0, 0, 255),
                role=f.text(1),
                identity=f.text(2),
                models=f.strs(3),
                capabilities=f.strs(4),
                initial_credit=f.integer(5, 1, (1 << 32) - 1),
                max_frame=f.integer(6, 1 << 12, 1 << 31),
            )
            if len(f.items) == 7:
                return hello  # a peer that predates the capacity fields
            if len(f.items) < 13:
                raise WireError("HELLO: the capacity fields (7..12) come all together or not at all")
            hello = replace(hello, max_batch=f.integer(7), kv_blocks=f.integer(8), block_size=f.integer(9),
                            max_model_len=f.integer(10), model_id=f.text(11), prefix_hash=f.text(12))
            if len(f.items) > 13:
                challenge = f.items[13]
                if type(challenge) is not bytes or len(challenge) not in (0, CHALLENGE_SIZE):
                    raise WireError(f"HELLO: field 13 must be empty or {CHALLENGE_SIZE} bytes")
                hello = replace(hello, challenge=challenge)
            if len(f.items) > 14:
                hello = replace(hello, kv_epoch=f.integer(14, 0, U64_MAX))
            if len(f.items) > 15:
                hello = replace(hello, startup=_startup(f.items[15]))
            return hello
        if ftype == FrameType.AUTH:
            if len(body) != CHALLENGE_SIZE:
                raise WireError(f"AUTH: body must be {CHALLENGE_SIZE} bytes")
            return Auth(bytes(body))
        if ftype == FrameType.KV_SUBSCRIBE:
            if len(body):
                raise WireError("KV_SUBSCRIBE: body must be empty")
            return KvSubscribe()
        if ftype == FrameType.GOODBYE:
            try:
                return Goodbye(bytes(body).decode())
            except UnicodeDecodeError:
                raise WireError("GOODBYE: reason is not UTF-8") from None
        raise WireError(f"unknown frame type {ftype}")

    def _submit(self, rid: int, body: memoryview) -> Submit | SubmitRejected:
        try:
            sub = _submit_body(rid, body)
        except WireError as exc:  # a stream error (see the spec), once its stream can be opened
            self._open(rid, _NO_OPTIONS)
            return SubmitRejected(rid, str(exc))
        self._open(rid, stream_options(sub.params))
        return sub

    def _open(self, rid: int, opts: StreamOptions) -> None:
        if not self.streams.open(rid, opts):
            raise WireError(f"SUBMIT for request {rid} that is already open (or too many streams)")



def _submit_body(rid: int, body: memoryview) -> Submit:
    """A SUBMIT body, every field checked (``WireError`` if any is bad); opens nothing."""
    f = unpack_fields(body, "SUBMIT", 9)
    p = Fields(f.items[1], "SUBMIT params", 10)
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
        **params_extension(p),
    )
    ids = None if f.items[3] is None else f.uints(3)
    buffered = f.flag(9) if len(f.items) > 9 else False
    if buffered and (params.logprobs or params.top_logprobs):
        raise WireError("SUBMIT: a buffered request cannot ask for logprobs")
    task, pooling, echo = task_fields(f)
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
        buffered=buffered,
        continuation=continuation(f),
        task=task,
        pooling=pooling,
        echo=echo,
    )
    if sum(x is not None for x in (sub.prompt, sub.prompt_token_ids, sub.messages)) != 1:
        raise WireError("SUBMIT: exactly one of prompt, prompt_token_ids, messages must be set")
    problem = task_problem(sub)
    if problem:
        raise WireError(f"SUBMIT: {problem}")
    return sub


_HELLO = int(FrameType.HELLO)
_RID_FRAMES = frozenset({FrameType.SUBMIT, FrameType.CANCEL, FrameType.CREDIT, FrameType.FINISH})
_NO_OPTIONS = StreamOptions(False, 0)
