"""Messages exchanged between the gateway and inference workers.

These are the *decoded* forms of the frames in :mod:`transport.wire`. They are
small frozen dataclasses (control messages) plus one packed, array-backed
message for tokens (:class:`TokenBatch`), so that one engine step becomes one
frame with no per-token Python objects on the hot path.

The messages built once per request or per engine step (``Submit``,
``TokenBatch``, ``Finish``) are slotted but *not* frozen: a frozen
dataclass's ``__init__`` sets each field through ``object.__setattr__`` and
costs about four times as much. Treat them as immutable all the same.

Direction:
  gateway -> worker: Hello, Submit, Cancel, Credit, Ping, Pong, Goodbye, KvSubscribe
  worker -> gateway: Hello, TokenBatch, Finish, Error, Stats, Ping, Pong, Goodbye, KvEvents
  both, with a pre-shared key: Hello (challenge), Auth, then Hello (full)

Every request (identified by a ``request_id`` the gateway assigns, unique per
connection, u32) ends exactly once on the worker side: a ``Finish`` or an
``Error`` carrying its id.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FinishReason",
    "SamplingParams",
    "Task",
    "Pooling",
    "Continuation",
    "Hello",
    "Submit",
    "Cancel",
    "Credit",
    "TokenBatch",
    "TokenEntry",
    "Finish",
    "Error",
    "Stats",
    "Ping",
    "Pong",
    "Goodbye",
    "Auth",
    "KvEvents",
    "KvSubscribe",
    "Message",
]

PROTOCOL_VERSION = 1


class ErrorCode(enum.IntEnum):
    """One error enum for the whole wire. The gateway maps each to HTTP/gRPC."""

    INTERNAL = 1  # worker bug; HTTP 500
    INVALID_REQUEST = 2  # bad parameters the gateway could not catch; HTTP 400
    UNKNOWN_MODEL = 3  # model not served by this worker; HTTP 404
    OVERLOADED = 4  # worker queue full; HTTP 503 (retryable)
    CANCELLED = 5  # cancelled by either side
    CONTEXT_LENGTH = 6  # prompt + max_tokens exceed the model context; HTTP 400
    SHUTTING_DOWN = 7  # worker draining; HTTP 503 (retryable)
    CONNECTION_LOST = 8  # produced locally when the peer dies; HTTP 502
    PROTOCOL = 9  # malformed frame / version mismatch; HTTP 502
    TIMEOUT = 10  # deadline exceeded; HTTP 504


class FinishReason(enum.IntEnum):
    STOP = 1  # eos token, stop token id or stop string
    LENGTH = 2  # max_tokens or context limit
    CANCELLED = 3


class Task(enum.IntEnum):
    """What a Submit asks of the worker (transport.wire: SUBMIT field 11)."""

    GENERATE = 0  # sample tokens (every request before #31)
    EMBED = 1  # the prompt's pooled final hidden state, as base64 float32 LE text
    TOKENIZE = 2  # the prompt's token ids
    DETOKENIZE = 3  # the text of prompt_token_ids


class Pooling(enum.IntEnum):
    """How an EMBED task pools the prompt's final hidden states."""

    MEAN = 0
    LAST = 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the engine needs to sample one request. Defaults = greedy-ish OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # 0..20 alternatives per token
    # The rarer settings (#31). The wire carries them only when one differs from its default
    # (transport.wire: SUBMIT params 10..17), so a request that sets none costs nothing more.
    presence_penalty: float = 0.0  # -2..2, OpenAI's: subtracted once from a token that appeared
    frequency_penalty: float = 0.0  # -2..2, OpenAI's: subtracted per appearance
    repetition_penalty: float = 1.0  # > 0, the CTRL/HF one (1 = off): divides positive logits
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to the logits
    min_tokens: int = 0  # no end (eos, stop ids) before this many tokens
    # Structured output (inference.grammar): "json" (a JSON Schema), "regex", "lark", "choice"; "" = none
    guide_kind: str = ""
    guide: str = ""  # the schema / pattern / grammar / JSON array of choices
    tools: str = ""  # a chat's tool definitions as a JSON array, which the chat template renders; "" = none

    @property
    def extended(self) -> bool:
        """Whether any of the rarer settings is set (the wire's optional params group)."""
        return bool(self.guide_kind or self.tools or self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame each way. ``models`` is what the sender serves (workers)."""

    version: int = PROTOCOL_VERSION
    role: str = "gateway"  # "gateway" | "worker"
    identity: str = ""  # e.g. "worker-0@host:pid"
    models: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()  # e.g. ("logprobs", "text", "chat")
    # Max tokens in flight per request before the receiver must grant credit.
    initial_credit: int = 256
    max_frame: int = 1 << 24
    # A worker's capacity, so the gateway can size and route without asking (0 / "" = not told: a
    # gateway's Hello, or a worker that predates these fields; they ride as optional trailing fields).
    max_batch: int = 0  # sequences one engine step runs
    kv_blocks: int = 0  # KV-cache blocks in all
    block_size: int = 0  # tokens per KV block (the prefix cache's unit)
    max_model_len: int = 0  # longest context (prompt + completion) in tokens
    model_id: str = ""  # the model the worker loaded ("tiny" or its checkpoint), beside the served names
    prefix_hash: str = ""  # the prefix cache's block-hash scheme (inference.kv_cache); "" = no prefix cache
    # Pre-shared-key authentication (transport.psk): the sender's fresh nonce in its *challenge* Hello,
    # which says nothing else about it; b"" in a full Hello and when no key is configured.
    challenge: bytes = b""
    # The worker's KV-cache epoch (KvEvents): new at every start or cache reset; 0 = not told.
    kv_epoch: int = 0
    # Seconds the worker's start-up took, by phase: (load, compile, warm-up); () = not told. The gateway
    # keeps a distribution of them per model (elastic pools size their cold-start horizon from it).
    startup: tuple[float, ...] = ()


@dataclass(slots=True)  # not frozen: built per request/step (module docstring)
class Submit:
    """A new request. Exactly one of prompt / prompt_token_ids / messages is set.

    ``messages`` is a chat (list of {"role","content"} dicts); the worker renders
    it with its model's chat template. ``trace`` carries W3C traceparent etc.
    """

    request_id: int
    model: str
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    deadline_ms: int = 0  # 0 = none; relative to receipt
    priority: int = 0
    trace: dict[str, str] | None = None
    return_text: bool = True  # worker sends detokenized text deltas
    # The consumer wants the whole result at once (non-streaming): the worker sends
    # all tokens as one entry right before the end, outside credit (transport.hold gives
    # the option its meaning on both sides; the flow core only carries it).
    buffered: bool = False
    # Mid-stream failover: the request is resumed here after the replica that began it was lost
    # (None: a new request, as from a gateway that predates the field).
    continuation: Continuation | None = None
    # What is asked (#31): generation (default), or an embedding, tokenization or detokenization of the
    # prompt, answered as one entry then FINISH (transport.wire: "Tasks"); ``pooling`` is EMBED's.
    task: Task = Task.GENERATE
    pooling: Pooling = Pooling.MEAN
    # The stream's first entry is the prompt itself (its ids, text, and logprobs when the params ask)
    echo: bool = False


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a request resumed on a second replica stands: ``token_ids`` were generated by the
    replicas before (their text delivered to the client, ``text_bytes`` bytes of UTF-8). The worker
    prefills prompt + ``token_ids``, counts them as output (``max_tokens``, usage, the sampler's
    position), and primes its detokenizer and stop matcher with them, so its first text delta starts
    at byte ``text_bytes`` of the whole output. Only to a worker whose Hello lists the
    ``"continuation"`` capability (an older one would ignore the field and start over)."""

    token_ids: tuple[int, ...]
    text_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: int


@dataclass(frozen=True, slots=True)
class Credit:
    """Receiver grants ``tokens`` more tokens of budget for ``request_id``."""

    request_id: int
    tokens: int


class TokenEntry(NamedTuple):
    """A view of one request's slice of a TokenBatch (made on demand).

    A NamedTuple rather than a frozen dataclass: one is built per request per
    engine step on the gateway's hot path, and a tuple constructs about four
    times faster. It is immutable all the same.
    """

    request_id: int
    token_ids: memoryview  # uint32
    text: bytes  # utf-8 text delta for these tokens ("" if not requested)
    logprobs: memoryview | None  # float32, one per token, if requested
    top_ids: memoryview | None  # uint32, top_n per token, row-major
    top_logprobs: memoryview | None  # float32, top_n per token


@dataclass(slots=True)  # not frozen: built per request/step (module docstring)
class TokenBatch:
    """Tokens produced by one engine step for many requests (packed arrays).

    ``request_ids[i]`` produced ``counts[i]`` tokens, which are
    ``token_ids[sum(counts[:i]) : ...]``; its text delta is
    ``text[sum(text_lens[:i]) : ...]``. ``logprobs`` holds one float per token
    *only for entries whose request asked for logprobs* (in entry order), and
    ``top_ids``/``top_logprobs`` hold ``top_n`` per token for entries whose
    request asked for ``top_logprobs = top_n`` — the request's options are per
    stream state, sent once in Submit, never repeated per token. ``flags`` per
    entry is a bit set: bit 0 = has logprobs; the top_n per entry is ``top_ns``.
    """

    request_ids: array[int]  # 'I'
    counts: array[int]  # 'I'
    token_ids: array[int]  # 'I'
    text_lens: array[int]  # 'I'
    text: bytes = b""
    has_logprobs: array[int] = field(default_factory=lambda: array("B"))  # 0/1 per entry
    top_ns: array[int] = field(default_factory=lambda: array("B"))  # per entry
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    top_ids: array[int] = field(default_factory=lambda: array("I"))
    top_logprobs: array[float] = field(default_factory=lambda: array("f"))

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def entries(self) -> Iterator[TokenEntry]:
        """Per-request views (memoryviews into the packed arrays)."""
        tok = memoryview(self.token_ids)
        lp = memoryview(self.logprobs)
        tid = memoryview(self.top_ids)
        tlp = memoryview(self.top_logprobs)
        text = self.text
        has_lp = self.has_logprobs
        top_ns = self.top_ns
        t = s = lpi = topi = 0
        for i, rid in enumerate(self.request_ids):
            n = self.counts[i]
            ln = self.text_lens[i]
            lps = None
            ti = tl = None
            if has_lp and has_lp[i]:
                lps = lp[lpi : lpi + n]
                lpi += n
            k = top_ns[i] if top_ns else 0
            if k:
                ti = tid[topi : topi + n * k]
                tl = tlp[topi : topi + n * k]
                topi += n * k
            yield TokenEntry(rid, tok[t : t + n], text[s : s + ln], lps, ti, tl)
            t += n
            s += ln


@dataclass(slots=True)  # not frozen: built per request/step (module docstring)
class Finish:
    request_id: int
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Error:
    """Ends a request (``request_id`` > 0) or the connection (``request_id`` 0)."""

    request_id: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Stats:
    """Load report from a worker, sent periodically; used for routing."""

    queue_depth: int
    running: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_hit_rate: float = 0.0
    # A compact summary of cached prefixes: hashes of the first block(s) of
    # cached chains (u64), newest first, bounded length.
    prefix_hashes: tuple[int, ...] = ()
    tokens_per_s: float = 0.0
    # Engine counters since the worker started (optional trailing fields: a worker that predates
    # them sends 0s). Cumulative, so a scraper's rates give the mean step time and batch size
    # over any window without the worker choosing one.
    steps: int = 0
    step_seconds: float = 0.0  # wall time of those steps, schedule to commit
    step_sequences: int = 0  # sequences those steps carried (prefills + decodes)
    preemptions: int = 0
    batch_window_s: float = 0.0  # the batch window in effect now (the adaptive one moves with load)
    # KV events (optional trailing fields, both or neither; 0s: not told): the cache's epoch and the
    # sequence number of the last KvEvents batch published before these stats (a gap: resubscribe).
    kv_epoch: int = 0
    kv_seq: int = 0


@dataclass(frozen=True, slots=True)
class Ping:
    nonce: int


@dataclass(frozen=True, slots=True)
class Pong:
    nonce: int


@dataclass(frozen=True, slots=True)
class Auth:
    """The sender's proof that it holds the pre-shared key: an HMAC over both challenges
    (:mod:`transport.psk`); never the key itself."""

    proof: bytes


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Sender is draining: no new Submits please; in-flight ones still finish."""

    reason: str = ""


@dataclass(slots=True)  # not frozen: one per engine step
class KvEvents:
    """The prefix-cache blocks a worker gained (``stored``) and lost (``evicted``) since its previous
    batch, by their :mod:`transport.common.prefix` chain hashes (u64 arrays, ``'Q'``); the two are
    disjoint (a block's last change wins). ``seq`` numbers the batches of one ``epoch`` (the worker's
    cache: new at a restart or cache reset). ``full``: ``stored`` is the whole cache, which replaces
    whatever the receiver held for this worker (the answer to :class:`KvSubscribe`), at ``seq``;
    the next batch is ``seq + 1``. Sent only to a gateway that subscribed, by a worker whose Hello
    lists the ``"kv_events"`` capability."""

    epoch: int
    seq: int
    stored: array[int]  # 'Q'
    evicted: array[int] = field(default_factory=lambda: array("Q"))
    full: bool = False


@dataclass(frozen=True, slots=True)
class KvSubscribe:
    """Gateway: send me your whole prefix cache now (a full :class:`KvEvents`), then every change.
    Sent again after a gap in ``seq`` or a new epoch (a resync)."""


Message = Hello | Submit | Cancel | Credit | TokenBatch | Finish | Error | Stats | Ping | Pong | Goodbye | Auth | KvEvents | KvSubscribe
