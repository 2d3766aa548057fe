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
                              [capabilities], initial_credit, max_frame,
                              then optionally all of: max_batch, kv_blocks,
                              block_size, max_model_len, model_id,
                              prefix_hash (absent: 0, 0, 0, 0, "", ""),
                              then optionally challenge (bin, 0 or 32
                              bytes; absent: empty), then optionally
                              kv_epoch (u64; absent: 0), then optionally
                              startup: [] or [load, compile, warm-up]
                              seconds (absent: [])]
2      SUBMIT     rid (>0)    msgpack [model, params, prompt|nil,
                              prompt_token_ids (bin, u32 LE)|nil, messages|nil,
                              deadline_ms, priority, trace|nil, return_text,
                              buffered (optional, default false),
                              continuation (optional: nil or absent = none;
                              else [token_ids (bin, u32 LE), text_bytes]),
                              task (optional: [task, pooling, echo];
                              absent: [0, 0, false]; see Tasks)]
                              params = [max_tokens, temperature, top_p, top_k,
                              seed|nil, [stop], stop_token_ids (bin, u32 LE),
                              ignore_eos, logprobs, top_logprobs (0..20),
                              then optionally all of: presence_penalty,
                              frequency_penalty, repetition_penalty,
                              logit_bias [[id, bias]], min_tokens, guide_kind,
                              guide, tools (absent: 0, 0, 1, [], 0, "", "", "")]
3      CANCEL     rid (>0)    empty
4      CREDIT     rid (>0)    u32 tokens granted
5      TOKENS     0           packed arrays, see below
6      FINISH     rid (>0)    msgpack [reason, prompt_tokens, completion_tokens,
                              cached_tokens]
7      ERROR      rid or 0    msgpack [code, message]; rid 0 = whole connection
8      STATS      0           msgpack [queue_depth, running, kv_blocks_free,
                              kv_blocks_total, prefix_hit_rate,
                              prefix_hashes (bin, u64 LE), tokens_per_s,
                              (optional, all or none:) steps, step_seconds,
                              step_sequences, preemptions, batch_window_s,
                              (optional, both or none:) kv_epoch, kv_seq]
9      PING       0           u64 nonce
10     PONG       0           u64 nonce
11     GOODBYE    0           UTF-8 reason
12     AUTH       0           32 bytes: HMAC-SHA256 proof of the pre-shared key
13     KV_EVENTS  0           flags bit 0 FULL; u64 epoch, u64 seq, u32 n,
                              u64 stored[n], u64 evicted[rest of the body]
                              (:mod:`transport.wire_kv`)
14     KV_SUBSCRIBE 0         empty
=====  =========  ==========  ==================================================

KV events: a worker whose HELLO lists the capability ``"kv_events"`` publishes
its prefix cache's changes (blocks by their :mod:`transport.common.prefix`
chain hash) to a gateway that sent KV_SUBSCRIBE: first a FULL frame (every
cached hash, at the current ``seq``), then one frame per engine step that
changed the cache, ``seq`` one more each time, ``stored`` and ``evicted``
disjoint. ``epoch`` (also in HELLO and STATS) names the cache: a new one (a
restart, a cache reset) empties the receiver's view of that worker. A gap in
``seq`` (or a STATS ``kv_seq`` past the last frame seen) is answered with
KV_SUBSCRIBE again (a resync). A gateway never sends KV_SUBSCRIBE to a worker
without the capability, and a worker never sends KV_EVENTS unasked, so either
side may predate them.

Pre-shared key (:mod:`transport.psk`): a side configured with one opens with a
*challenge* HELLO (its role, a 32-byte nonce in ``challenge``, and nothing that
identifies it: no identity, models or capacity), answers the peer's challenge
with AUTH, and sends its full HELLO (``challenge`` empty) only once the peer's
AUTH has proved the same key. A side without a key sends its full HELLO first;
either side refuses a peer whose first HELLO does not match its own setting.

msgpack lists may carry extra trailing elements (ignored: additive evolution);
fewer than listed is an error. Enum values outside the known set are errors.
Fields marked optional were added later in this way, without a new version: an
older peer ignores them, and a newer one reads their absence as "not told".
The HELLO capacity group (a worker's max_batch .. prefix_hash) is all or none.

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

A SUBMIT with ``buffered`` set asks for the whole result at once (a
non-streaming consumer): the worker sends no TOKENS entries for it until it
ends, then all of its tokens as one entry in the TOKENS frame right before its
FINISH or ERROR. Credit does not apply to a buffered stream (its consumer takes
everything at the end; ``max_tokens`` bounds it), and it cannot ask for
logprobs or top_logprobs. (The codec carries the option and checks that rule;
:mod:`transport.hold` does the holding, above the flow core.)

A SUBMIT with a ``continuation`` resumes a request whose first replica was lost
mid-stream (mid-stream failover): ``token_ids`` are the tokens generated so far
and ``text_bytes`` how many bytes of their text the client has. The worker
treats them as its own output so far (prefilled after the prompt, counted in
``max_tokens`` and in FINISH's ``completion_tokens``; ``prompt_tokens`` is the
prompt's alone) and sends only what follows: its first text delta begins at
byte ``text_bytes`` of the whole output. A gateway sends it only to a worker
whose HELLO lists the capability ``"continuation"`` (an older worker ignores the
field and would start over).

Tasks (SUBMIT field 11, :class:`~transport.messages.Task`): ``task`` 0 is a
generation, as above. The others ask one answer about the prompt, carried as
a buffered stream's one TOKENS entry (``buffered`` must be set; credit does not
apply) followed by FINISH (``prompt_tokens`` the prompt's length,
``completion_tokens`` 0):

* 1 EMBED: the entry's text is the base64 of the pooled final hidden state
  (float32, little-endian: OpenAI's ``encoding_format: base64``), no tokens;
  ``pooling`` 0 is the mean over the prompt's positions, 1 its last position.
* 2 TOKENIZE: the entry's tokens are the prompt's ids (a chat rendered by the
  worker's template), no text.
* 3 DETOKENIZE: ``prompt_token_ids`` must be set; the entry's text is theirs.

``echo`` (a generation that is not buffered): the stream's first TOKENS entry
is the prompt itself, its ids and (with ``return_text``) its text, with
logprobs and top-n alternatives when the params ask, as every entry of the
stream; position 0 has no logprob (NaN, its alternatives are id 0, NaN). Its
tokens are not output (not in ``max_tokens``, ``completion_tokens`` or
credit: the stream's window is unlimited, as a buffered one's). A worker
that understands field 11 lists the capability ``"tasks"`` in its HELLO; an
older one ignores the field and generates, so a gateway treats the answer of
a worker without it as no answer (quicserve's: 501).

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
The decoder never buffers more than one header plus ``max_frame`` bytes (the
flow core holds it at ``HANDSHAKE_MAX_FRAME``, 64 KiB, until the peer's HELLO
is accepted, so an unauthenticated peer cannot make a side hold more); a
length above ``max_frame``, an unknown version, type or flag, a body that does
not parse exactly, or a stream-state violation raises :class:`WireError`
(a ``ProtocolError``), after which the decoder stays failed. A truncated frame
is simply incomplete until :meth:`FrameDecoder.close` is called, which raises
``WireError`` if a partial frame is pending.

One exception, so that one bad request does not take every other request of the
connection with it: a SUBMIT that is well framed (the header checks above pass,
its request id is not open and the stream table has room) but whose body does
not decode or breaks a field rule is a stream error. The decoder opens the
stream and returns :class:`SubmitRejected` in its place; the worker answers
ERROR ``INVALID_REQUEST`` with that request id (closing the stream) and the
connection carries on.
"""

from __future__ import annotations

from array import array

from .errors import WireError
from .messages import (
    Auth,
    Cancel,
    Credit,
    Error,
    Finish,
    Goodbye,
    Hello,
    KvEvents,
    KvSubscribe,
    Message,
    Ping,
    Pong,
    Stats,
    Submit,
    TokenBatch,
)
from .wire_control import check_rid, le_bytes, pack, submit_body
from .wire_decode import FrameDecoder
from .wire_frame import (
    CHALLENGE_SIZE,
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    HEADER,
    HEADER_SIZE,
    U32,
    U64,
    WIRE_VERSION,
    FrameType,
    SubmitRejected,
)
from .wire_kv import encode_kv_events
from .wire_tokens import StreamOptions, StreamTable, TokenEncoder, TokenFlags, stream_options

__all__ = [
    "WIRE_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "DEFAULT_MAX_FRAME",
    "HANDSHAKE_MAX_FRAME",
    "CHALLENGE_SIZE",
    "FrameType",
    "TokenFlags",
    "StreamOptions",
    "StreamTable",
    "FrameEncoder",
    "FrameDecoder",
    "SubmitRejected",
    "WireError",
]


class FrameEncoder:
    """Turns messages into frame bytes, keeping the sender's per-stream state."""

    def __init__(self, streams: StreamTable | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.streams = streams if streams is not None else StreamTable()
        self.max_frame = max_frame  # the peer's limit
        self._tokens = TokenEncoder(self.streams)

    def _frame(self, ftype: FrameType, rid: int, body: bytes, flags: int = 0) -> bytes:
        if len(body) > self.max_frame:
            raise ValueError(f"{ftype.name} frame of {len(body)} bytes exceeds max_frame {self.max_frame}")
        return HEADER.pack(WIRE_VERSION, ftype, flags, rid, len(body)) + body

    def encode(self, msg: Message) -> bytes:
        """Encode one message. Raises ``ValueError`` for messages that break the rules."""
        if type(msg) is Submit:  # the gateway's hot path (the general isinstance chain follows)
            check_rid(msg.request_id)
            frame = self._frame(FrameType.SUBMIT, msg.request_id, submit_body(msg))  # may raise: open after
            if not self.streams.open(msg.request_id, stream_options(msg.params)):
                raise ValueError(f"request {msg.request_id} is already open (or too many streams)")
            return frame
        if isinstance(msg, TokenBatch):
            flags, body = self._tokens.encode(msg)
            return self._frame(FrameType.TOKENS, 0, body, flags)
        if isinstance(msg, Credit):
            check_rid(msg.request_id)
            if not 0 < msg.tokens < 1 << 32:
                raise ValueError("credit must be 1..2**32-1")
            return self._frame(FrameType.CREDIT, msg.request_id, U32.pack(msg.tokens))
        if isinstance(msg, Finish):
            check_rid(msg.request_id)
            if not self.streams.close(msg.request_id):
                raise ValueError(f"Finish for request {msg.request_id} that is not open")
            body = pack([int(msg.reason), msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens])
            return self._frame(FrameType.FINISH, msg.request_id, body)
        if isinstance(msg, Error):
            if msg.request_id:
                check_rid(msg.request_id)
                if not self.streams.close(msg.request_id):
                    raise ValueError(f"Error for request {msg.request_id} that is not open")
            return self._frame(FrameType.ERROR, msg.request_id, pack([int(msg.code), msg.message]))
        if isinstance(msg, Cancel):
            check_rid(msg.request_id)
            return self._frame(FrameType.CANCEL, msg.request_id, b"")
        if isinstance(msg, Ping):
            return self._frame(FrameType.PING, 0, U64.pack(msg.nonce))
        if isinstance(msg, Pong):
            return self._frame(FrameType.PONG, 0, U64.pack(msg.nonce))
        if isinstance(msg, Stats):
            hashes = array("Q", msg.prefix_hashes)
            body = pack(
                [
                    msg.queue_depth,
                    msg.running,
                    msg.kv_blocks_free,
                    msg.kv_blocks_total,
                    float(msg.prefix_hit_rate),
                    le_bytes(hashes),
                    float(msg.tokens_per_s),
                    msg.steps,
                    float(msg.step_seconds),
                    msg.step_sequences,
                    msg.preemptions,
                    float(msg.batch_window_s),
                    msg.kv_epoch,
                    msg.kv_seq,
                ]
            )
            return self._frame(FrameType.STATS, 0, body)
        if isinstance(msg, Hello):
            body = pack(
                [
                    msg.version,
                    msg.role,
                    msg.identity,
                    list(msg.models),
                    list(msg.capabilities),
                    msg.initial_credit,
                    msg.max_frame,
                    msg.max_batch,
                    msg.kv_blocks,
                    msg.block_size,
                    msg.max_model_len,
                    msg.model_id,
                    msg.prefix_hash,
                    msg.challenge,
                    msg.kv_epoch,
                    [float(x) for x in msg.startup],
                ]
            )
            return self._frame(FrameType.HELLO, 0, body)
        if isinstance(msg, Auth):
            if len(msg.proof) != CHALLENGE_SIZE:
                raise ValueError(f"an AUTH proof is {CHALLENGE_SIZE} bytes")
            return self._frame(FrameType.AUTH, 0, msg.proof)
        if isinstance(msg, Goodbye):
            return self._frame(FrameType.GOODBYE, 0, msg.reason.encode())
        if isinstance(msg, KvEvents):
            flags, body = encode_kv_events(msg)
            return self._frame(FrameType.KV_EVENTS, 0, body, flags)
        if isinstance(msg, KvSubscribe):
            return self._frame(FrameType.KV_SUBSCRIBE, 0, b"")
        raise TypeError(f"not a wire message: {type(msg).__name__}")
