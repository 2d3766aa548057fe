"""Wire codec: round trips and any split for every frame type, and a garbage corpus."""

from __future__ import annotations

import struct
from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.errors import ProtocolError, WireError
from transport.messages import (
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
from transport.wire import HEADER_SIZE, FrameDecoder, FrameEncoder, FrameType, SubmitRejected

u32 = st.integers(1, 2**32 - 1)
u63 = st.integers(0, 2**63 - 1)
text = st.text(max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False)

params_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(0, 2**31),
    temperature=finite,
    top_p=finite,
    top_k=st.integers(0, 2**31),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(text, max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.integers(0, 20),
)


@st.composite
def submits(draw: Any, rid: int | None = None) -> Submit:
    kind = draw(st.sampled_from(["prompt", "ids", "messages"]))
    return Submit(
        request_id=rid if rid is not None else draw(u32),
        model=draw(text),
        params=draw(params_st),
        prompt=draw(text) if kind == "prompt" else None,
        prompt_token_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)))
        if kind == "ids"
        else None,
        messages=tuple(draw(st.lists(st.dictionaries(text, text, max_size=3), max_size=3)))
        if kind == "messages"
        else None,
        deadline_ms=draw(st.integers(0, 2**40)),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        trace=draw(st.none() | st.dictionaries(text, text, max_size=2)),
        return_text=draw(st.booleans()),
    )


control_st = st.one_of(
    st.builds(
        Hello,
        version=st.integers(0, 255),
        role=text,
        identity=text,
        models=st.lists(text, max_size=3).map(tuple),
        capabilities=st.lists(text, max_size=3).map(tuple),
        initial_credit=u32,
        max_frame=st.integers(1 << 12, 1 << 31),
        max_batch=u32,
        kv_blocks=u32,
        block_size=u32,
        max_model_len=u32,
        model_id=text,
        prefix_hash=text,
    ),
    st.builds(Cancel, u32),
    st.builds(Credit, u32, u32),
    st.builds(Ping, st.integers(0, 2**64 - 1)),
    st.builds(Pong, st.integers(0, 2**64 - 1)),
    st.builds(Goodbye, text),
    st.builds(Error, st.just(0), st.sampled_from(list(ErrorCode)), text),
    st.builds(
        Stats,
        u63,
        u63,
        u63,
        u63,
        finite,
        st.lists(st.integers(0, 2**64 - 1), max_size=5).map(tuple),
        finite,
        u63,
        finite,
        u63,
        u63,
        finite,
    ),
)


@st.composite
def sessions(draw: Any) -> list[Message]:
    """A valid message sequence: control frames, Submits, token steps, and ends."""
    n_streams = draw(st.integers(1, 6))
    subs = [
        draw(submits(rid=rid))
        for rid in draw(st.lists(u32, min_size=n_streams, max_size=n_streams, unique=True))
    ]
    msgs: list[Message] = [draw(control_st)]
    msgs.extend(subs)
    for _ in range(draw(st.integers(1, 4))):
        chosen = draw(
            st.lists(st.sampled_from(subs), min_size=0, max_size=len(subs), unique_by=lambda s: s.request_id)
        )
        msgs.append(draw(batches(chosen)))
        if draw(st.booleans()):
            msgs.append(msgs[-1])  # same request list again: SAME_RIDS path
        msgs.append(draw(control_st))
    for s in subs:
        if draw(st.booleans()):
            msgs.append(
                Finish(
                    s.request_id, draw(st.sampled_from(list(FinishReason))), draw(u63), draw(u63), draw(u63)
                )
            )
        else:
            msgs.append(Error(s.request_id, draw(st.sampled_from(list(ErrorCode))), draw(text)))
    return msgs


f32 = st.floats(width=32, allow_nan=False)


@st.composite
def batches(draw: Any, subs: list[Submit]) -> TokenBatch:
    rids, counts, toks, tlens, texts = array("I"), array("I"), array("I"), array("I"), []
    lps, tids, tlps = array("f"), array("I"), array("f")
    for s in subs:
        c = draw(st.integers(0, 3))
        rids.append(s.request_id)
        counts.append(c)
        toks.extend(draw(st.lists(st.integers(0, 2**32 - 1), min_size=c, max_size=c)))
        t = draw(st.binary(max_size=12))
        texts.append(t)
        tlens.append(len(t))
        if s.params.logprobs:
            lps.extend(draw(st.lists(f32, min_size=c, max_size=c)))
        k = c * s.params.top_logprobs
        tids.extend(draw(st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k)))
        tlps.extend(draw(st.lists(f32, min_size=k, max_size=k)))
    # Per-entry option arrays as a producer fills them (only when some stream wants extras).
    has_lp = array("B", [s.params.logprobs for s in subs])
    top_ns = array("B", [s.params.top_logprobs for s in subs])
    if not any(has_lp) and not any(top_ns):
        has_lp, top_ns = array("B"), array("B")
    return TokenBatch(rids, counts, toks, tlens, b"".join(texts), has_lp, top_ns, lps, tids, tlps)


def norm(m: Message) -> Any:
    """Comparable form; TokenBatch compared through its per-request views."""
    if isinstance(m, TokenBatch):
        return (
            "tokens",
            [
                (
                    e.request_id,
                    e.token_ids.tolist(),
                    e.text,
                    None if e.logprobs is None else e.logprobs.tobytes(),
                    None if e.top_ids is None else e.top_ids.tolist(),
                    None if e.top_logprobs is None else e.top_logprobs.tobytes(),
                )
                for e in m.entries()
            ],
        )
    return m


def encode_all(msgs: list[Message]) -> bytes:
    enc = FrameEncoder()
    return b"".join(enc.encode(m) for m in msgs)


@settings(
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=60,
    deadline=None,
)
@given(sessions())
def test_round_trip_every_frame_type(msgs: list[Message]) -> None:
    data = encode_all(msgs)
    dec = FrameDecoder()
    out = dec.feed(data)
    dec.close()
    assert [norm(m) for m in out] == [norm(m) for m in msgs]


@settings(
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=60,
    deadline=None,
)
@given(sessions(), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split(msgs: list[Message], cuts: list[int]) -> None:
    data = encode_all(msgs)
    points = sorted({c % (len(data) + 1) for c in cuts})
    dec = FrameDecoder()
    out: list[Message] = []
    prev = 0
    for p in [*points, len(data)]:
        out.extend(dec.feed(data[prev:p]))
        prev = p
    dec.close()
    assert [norm(m) for m in out] == [norm(m) for m in msgs]


def test_one_byte_at_a_time_and_control_examples() -> None:
    msgs: list[Message] = [
        Hello(role="worker", models=("tiny",)),
        Submit(7, "tiny", SamplingParams(logprobs=True, top_logprobs=2), prompt_token_ids=(1, 2, 3)),
        TokenBatch(
            array("I", [7]),
            array("I", [2]),
            array("I", [70000, 5]),
            array("I", [3]),
            b"abc",
            has_logprobs=array("B", [1]),
            top_ns=array("B", [2]),
            logprobs=array("f", [-0.5, -1.0]),
            top_ids=array("I", [1, 2, 3, 4]),
            top_logprobs=array("f", [-1, -2, -3, -4]),
        ),
        Finish(7, FinishReason.STOP, 3, 2),
    ]
    data = encode_all(msgs)
    dec = FrameDecoder()
    out: list[Message] = []
    for i in range(len(data)):
        out.extend(dec.feed(data[i : i + 1]))
    assert [norm(m) for m in out] == [norm(m) for m in msgs]
    assert dec.buffered == 0


def test_hello_carries_a_workers_capacity_and_reads_an_older_peers_as_not_told() -> None:
    """The capacity group is optional trailing fields (no new wire version): a Hello from a peer
    that predates them decodes with zeros, and a newer one round-trips every field."""
    hello = Hello(role="worker", models=("tiny",), max_batch=32, kv_blocks=2048, block_size=16,
                  max_model_len=4096, model_id="tiny", prefix_hash="blake2b64-chain/u32le")
    (out,) = FrameDecoder().feed(FrameEncoder().encode(hello))
    assert out == hello
    (old,) = FrameDecoder().feed(frame(FrameType.HELLO, mp([1, "worker", "w", ["tiny"], [], 256, 1 << 24])))
    assert (old.max_batch, old.kv_blocks, old.block_size, old.max_model_len, old.model_id, old.prefix_hash) == (
        0, 0, 0, 0, "", "")
    assert old.models == ("tiny",) and old.version == 1


def test_stats_carry_engine_counters_and_read_an_older_workers_as_zeros() -> None:
    stats = Stats(1, 2, 3, 4, 0.5, (7,), 9.5, steps=10, step_seconds=0.25, step_sequences=31, preemptions=2,
                  batch_window_s=0.004)
    (out,) = FrameDecoder().feed(FrameEncoder().encode(stats))
    assert out == stats
    (old,) = FrameDecoder().feed(frame(FrameType.STATS, mp([1, 2, 3, 4, 0.5, b"", 9.5])))
    assert (old.steps, old.step_seconds, old.step_sequences, old.preemptions, old.batch_window_s) == (0, 0.0, 0, 0, 0.0)
    with pytest.raises(WireError, match="all together"):
        FrameDecoder().feed(frame(FrameType.STATS, mp([1, 2, 3, 4, 0.5, b"", 9.5, 10])))


def test_token_frame_is_compact_and_delta_coded() -> None:
    """64 single-token steps with ~4 bytes of text: the second frame omits the request ids."""
    enc = FrameEncoder()
    for rid in range(1, 65):
        enc.encode(Submit(rid, "m", prompt="p"))
    batch = TokenBatch(
        array("I", range(1, 65)),
        array("I", [1] * 64),
        array("I", [30000 + i for i in range(64)]),
        array("I", [4] * 64),
        b"abcd" * 64,
    )
    first = enc.encode(batch)
    second = enc.encode(batch)
    # header 12 + n 4 + rids 64 (u8) + tokens 256 (u32) + text_lens 64 + text 256
    assert len(first) == 12 + 4 + 64 + 256 + 64 + 256
    assert len(second) == len(first) - 64
    assert len(second) / 64 <= 16


def test_encoder_rejects_inconsistent_batches() -> None:
    enc = FrameEncoder()
    enc.encode(Submit(1, "m", SamplingParams(logprobs=True), prompt="p"))
    ok = dict(
        request_ids=array("I", [1]),
        counts=array("I", [1]),
        token_ids=array("I", [5]),
        text_lens=array("I", [1]),
        text=b"x",
        logprobs=array("f", [-1.0]),
    )
    enc.encode(TokenBatch(**ok))  # type: ignore[arg-type]
    for bad in (
        {"logprobs": array("f")},  # stream asked for logprobs
        {"counts": array("I", [2])},  # counts do not add up
        {"text": b"xy"},  # text lens do not add up
        {"request_ids": array("I", [2])},  # not open
        {"text_lens": array("I", [1, 1])},  # length mismatch
    ):
        with pytest.raises(ValueError):
            enc.encode(TokenBatch(**{**ok, **bad}))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        enc.encode(Submit(1, "m", prompt="p"))  # already open
    with pytest.raises(ValueError):
        enc.encode(Submit(2, "m", prompt="p", prompt_token_ids=(1,)))  # two prompts
    with pytest.raises(ValueError):
        enc.encode(Finish(9, FinishReason.STOP, 0, 0))  # not open


def test_encoder_refuses_params_the_decoder_would_reject() -> None:
    """Such a SUBMIT would close the whole connection at the peer; refused here it fails one request."""
    enc = FrameEncoder()
    for params in (SamplingParams(seed=1 << 63), SamplingParams(seed=-(1 << 63) - 1), SamplingParams(top_k=1 << 63),
                   SamplingParams(max_tokens=-1)):
        with pytest.raises(ValueError):
            enc.encode(Submit(1, "m", params, prompt="p"))
    edge = Submit(1, "m", SamplingParams(seed=-(1 << 63), top_k=(1 << 63) - 1), prompt="p")
    (out,) = FrameDecoder().feed(enc.encode(edge))
    assert isinstance(out, Submit) and (out.params.seed, out.params.top_k) == (-(1 << 63), (1 << 63) - 1)


# --- garbage / truncation corpus --------------------------------------------------------------


def frame(
    ftype: int, body: bytes = b"", rid: int = 0, flags: int = 0, version: int = 1, length: int | None = None
) -> bytes:
    return struct.pack("<BBHII", version, ftype, flags, rid, len(body) if length is None else length) + body


def mp(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


HELLO = FrameEncoder().encode(Hello())
GOOD_PARAMS = [16, 1.0, 1.0, 0, None, [], b"", False, False, 0]
GOOD_SUBMIT = ["m", GOOD_PARAMS, "p", None, None, 0, 0, None, True]
SUBMIT1 = frame(FrameType.SUBMIT, mp(GOOD_SUBMIT), rid=1)


def sub(**changes: object) -> bytes:
    fields = list(GOOD_SUBMIT)
    for k, v in changes.items():
        fields[int(k[1:])] = v
    return frame(FrameType.SUBMIT, mp(fields), rid=1)


def params(i: int, v: object) -> bytes:
    p = list(GOOD_PARAMS)
    p[i] = v
    return frame(FrameType.SUBMIT, mp(["m", p, "p", None, None, 0, 0, None, True]), rid=1)


def tokens(body: bytes, flags: int = 0, rid: int = 0) -> bytes:
    return SUBMIT1 + frame(FrameType.TOKENS, body, rid=rid, flags=flags)


CORPUS: dict[str, bytes] = {
    "version 0": frame(1, mp([]), version=0),
    "version 2": frame(FrameType.PING, bytes(8), version=2),
    "version 255": b"\xff" * 12,
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "tls client hello": bytes.fromhex("16030100a5010000a10303") + bytes(32),
    "type 0": frame(0),
    "type 12": frame(12),
    "type 255": frame(255),
    "oversize length": frame(FrameType.PING, b"", length=(1 << 24) + 1),
    "length 2**32-1": frame(FrameType.GOODBYE, b"", length=2**32 - 1),
    "flags on ping": frame(FrameType.PING, bytes(8), flags=1),
    "flags on hello": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 4096]), flags=0x8000),
    "reserved token flag": tokens(struct.pack("<I", 0), flags=1 << 11),
    "rid on ping": frame(FrameType.PING, bytes(8), rid=3),
    "rid on tokens": tokens(struct.pack("<I", 0), rid=1),
    "rid 0 cancel": frame(FrameType.CANCEL, rid=0),
    "rid 0 credit": frame(FrameType.CREDIT, struct.pack("<I", 5), rid=0),
    "rid 0 submit": frame(FrameType.SUBMIT, mp(GOOD_SUBMIT), rid=0),
    "rid 0 finish": frame(FrameType.FINISH, mp([1, 0, 0, 0]), rid=0),
    "credit short": frame(FrameType.CREDIT, b"\x01", rid=1),
    "credit zero": frame(FrameType.CREDIT, bytes(4), rid=1),
    "cancel body": frame(FrameType.CANCEL, b"x", rid=1),
    "ping short": frame(FrameType.PING, bytes(7)),
    "pong long": frame(FrameType.PONG, bytes(9)),
    "goodbye bad utf8": frame(FrameType.GOODBYE, b"\xff\xfe"),
    "hello not msgpack": frame(FrameType.HELLO, b"\xc1"),
    "hello map": frame(FrameType.HELLO, mp({"version": 1})),
    "hello short list": frame(FrameType.HELLO, mp([1, "w"])),
    "hello str version": frame(FrameType.HELLO, mp(["1", "w", "", [], [], 1, 4096])),
    "hello credit 0": frame(FrameType.HELLO, mp([1, "w", "", [], [], 0, 4096])),
    "hello tiny max_frame": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 16])),
    "hello models not strs": frame(FrameType.HELLO, mp([1, "w", "", [1], [], 1, 4096])),
    "hello trailing bytes": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 4096]) + b"\x00"),
    "hello ext type": frame(FrameType.HELLO, mp(msgpack.ExtType(1, b"x"))),
    "hello half the capacity fields": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 4096, 32, 512])),
    "hello negative kv blocks": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 4096, 32, -1, 16, 64, "", ""])),
    "hello model id not str": frame(FrameType.HELLO, mp([1, "w", "", [], [], 1, 4096, 32, 8, 16, 64, 7, ""])),
    "duplicate submit": SUBMIT1 + SUBMIT1,
    "finish unknown rid": frame(FrameType.FINISH, mp([1, 0, 0, 0]), rid=9),
    "finish unknown reason": SUBMIT1 + frame(FrameType.FINISH, mp([9, 0, 0, 0]), rid=1),
    "finish negative usage": SUBMIT1 + frame(FrameType.FINISH, mp([1, -1, 0, 0]), rid=1),
    "finish bool reason": SUBMIT1 + frame(FrameType.FINISH, mp([True, 0, 0, 0]), rid=1),
    "finish float usage": SUBMIT1 + frame(FrameType.FINISH, mp([1, 0, 1.0, 0]), rid=1),
    "finish usage over i63": SUBMIT1 + frame(FrameType.FINISH, mp([1, 0, 0, 2**63]), rid=1),
    "finish short": SUBMIT1 + frame(FrameType.FINISH, mp([1, 0, 0]), rid=1),
    "finish not a list": SUBMIT1 + frame(FrameType.FINISH, mp({"r": 1}), rid=1),
    "finish trailing bytes": SUBMIT1 + frame(FrameType.FINISH, mp([1, 0, 0, 0]) + b"\x00", rid=1),
    "error unknown code": frame(FrameType.ERROR, mp([99, "x"])),
    "error unknown rid": frame(FrameType.ERROR, mp([1, "x"]), rid=4),
    "error message int": frame(FrameType.ERROR, mp([1, 2])),
    "stats short": frame(FrameType.STATS, mp([1, 2, 3])),
    "stats hashes odd": frame(FrameType.STATS, mp([1, 2, 3, 4, 0.0, b"123", 0.0])),
    "tokens unknown rid": frame(
        FrameType.TOKENS, struct.pack("<I", 1) + b"\x05" + b"\x01" + b"\x00", flags=4
    ),
    "tokens same_rids first": tokens(struct.pack("<I", 1) + b"\x01", flags=1 | 2 | 4),
    "tokens body short": tokens(b"\x01"),
    "tokens trailing": tokens(struct.pack("<I", 1) + b"\x01" + b"\x05" + b"junk", flags=2 | 4),
    "tokens width 3": tokens(struct.pack("<I", 1) + bytes(8), flags=3 << 3),
    "tokens huge n": tokens(struct.pack("<I", 2**32 - 1), flags=4),
    "tokens counts exceed": tokens(struct.pack("<I", 1) + b"\x01" + b"\xff" + b"\x00", flags=4),
    "tokens text beyond body": tokens(struct.pack("<I", 1) + b"\x01" + b"\x05" + b"\x09" + b"ab", flags=2),
}


# Well-framed SUBMITs (rid 1) whose bodies are bad: each fails its request alone (transport.wire spec).
BAD_SUBMITS: dict[str, bytes] = {
    "submit no prompt": sub(_2=None),
    "submit two prompts": sub(_3=b"\x01\x00\x00\x00"),
    "submit ids not multiple of 4": sub(_2=None, _3=b"\x01\x00"),
    "submit model int": sub(_0=5),
    "submit params short": sub(_1=[1, 2]),
    "submit top_logprobs 21": params(9, 21),
    "submit negative max_tokens": params(0, -1),
    "submit temperature str": params(1, "hot"),
    "submit bool as int": params(8, 1),
    "submit messages not maps": sub(_2=None, _4=["hi"]),
    "submit trace not strs": sub(_7={"a": 1}),
    "submit int keys": sub(_2=None, _4=[{1: "x"}]),
    "submit not msgpack": frame(FrameType.SUBMIT, b"\xc1", rid=1),
    "submit not a list": frame(FrameType.SUBMIT, mp({"model": "m"}), rid=1),
    "submit short": frame(FrameType.SUBMIT, mp(GOOD_SUBMIT[:8]), rid=1),
    "submit max_tokens over i63": params(0, 2**63),
    "submit seed over i63": params(4, 2**63),
    "submit buffered with logprobs": frame(
        FrameType.SUBMIT, mp(["m", [16, 1.0, 1.0, 0, None, [], b"", False, True, 0], *GOOD_SUBMIT[2:], True]), rid=1
    ),
}


def truncations() -> dict[str, bytes]:
    enc = FrameEncoder()
    full = [
        enc.encode(Hello()),
        enc.encode(Submit(1, "m", prompt="hello")),
        enc.encode(TokenBatch(array("I", [1]), array("I", [1]), array("I", [9]), array("I", [2]), b"hi")),
        enc.encode(Finish(1, FinishReason.STOP, 1, 1)),
    ]
    out = {}
    for i, f in enumerate(full):
        prefix = b"".join(full[:i])
        for cut in (1, HEADER_SIZE - 1, HEADER_SIZE, len(f) - 1):
            if 0 < cut < len(f):
                out[f"truncated frame {i} at {cut}"] = prefix + f[:cut]
    return out


ALL_BAD = {**CORPUS, **truncations()}


def test_corpus_is_big_enough() -> None:
    assert len(ALL_BAD) >= 50


@pytest.mark.parametrize("name", sorted(ALL_BAD))
def test_garbage_ends_in_one_clean_error(name: str) -> None:
    data = ALL_BAD[name]
    for chunk in (len(data), 1, 5):  # whole, byte by byte, small pieces
        dec = FrameDecoder()
        with pytest.raises(WireError) as info:
            for i in range(0, len(data), chunk):
                dec.feed(data[i : i + chunk])
            dec.close()
        assert isinstance(info.value, ProtocolError)
        with pytest.raises(WireError):  # stays failed
            dec.feed(HELLO)


@pytest.mark.parametrize("name", sorted(BAD_SUBMITS))
def test_a_bad_submit_body_fails_its_request_alone(name: str) -> None:
    """The decoder hands back SubmitRejected for that request id, keeps its stream open for the
    ERROR that answers it, and goes on decoding the frames after it."""
    data = BAD_SUBMITS[name] + frame(FrameType.SUBMIT, mp(GOOD_SUBMIT), rid=2) + frame(FrameType.CANCEL, rid=1)
    for chunk in (len(data), 1, 5):
        dec = FrameDecoder()
        out = [m for i in range(0, len(data), chunk) for m in dec.feed(data[i : i + chunk])]
        dec.close()
        rejected, good, cancel = out
        assert isinstance(rejected, SubmitRejected) and rejected.request_id == 1
        assert rejected.reason.startswith("SUBMIT")
        assert isinstance(good, Submit) and good.request_id == 2 and cancel == Cancel(1)
        assert 1 in dec.streams and 2 in dec.streams
        with pytest.raises(WireError, match="already open"):  # a second SUBMIT for it still ends all
            dec.feed(SUBMIT1)


def test_the_error_for_a_rejected_submit_closes_its_stream_both_ways() -> None:
    """Gateway encoder -> (corrupted) -> worker decoder; worker encoder ERROR -> gateway decoder."""
    gw_enc, wk_dec = FrameEncoder(), FrameDecoder()
    gw_dec = FrameDecoder(gw_enc.streams)
    wk_enc = FrameEncoder(wk_dec.streams)
    gw_enc.encode(Submit(1, "m", prompt="p"))  # what the gateway sent; what arrives is bad
    (rejected,) = wk_dec.feed(BAD_SUBMITS["submit not msgpack"])
    assert isinstance(rejected, SubmitRejected)
    (err,) = gw_dec.feed(wk_enc.encode(Error(1, ErrorCode.INVALID_REQUEST, rejected.reason)))
    assert err == Error(1, ErrorCode.INVALID_REQUEST, rejected.reason)
    assert 1 not in gw_enc.streams and 1 not in wk_dec.streams
    (again,) = wk_dec.feed(SUBMIT1)  # the request id may be used again
    assert isinstance(again, Submit)


@settings(
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=200,
    deadline=None,
)
@given(st.binary(min_size=1, max_size=300))
def test_random_bytes_never_hang_or_crash(data: bytes) -> None:
    dec = FrameDecoder(max_frame=1 << 12)
    try:
        dec.feed(data)
        dec.close()
    except WireError:
        pass
    assert dec.buffered <= HEADER_SIZE + (1 << 12)


def test_buffering_is_bounded_by_max_frame() -> None:
    dec = FrameDecoder(max_frame=4096)
    dec.feed(frame(FrameType.GOODBYE, b"", length=4096))
    for _ in range(40):
        dec.feed(b"a" * 100)  # 4000 bytes of a 4096-byte body: still incomplete
    assert dec.buffered == HEADER_SIZE + 4000
    with pytest.raises(WireError, match="exceeds max_frame"):  # refused at the header, nothing buffered
        FrameDecoder(max_frame=4096).feed(frame(FrameType.GOODBYE, b"", length=4097))


def test_delta_state_survives_stream_reuse_with_new_options() -> None:
    """Same request list step after step (cached per-entry options), then request 3
    ends and a new request 3 asks for different options: the cache must not leak."""

    def step(rids: list[int], subs: dict[int, Submit], seed: int) -> TokenBatch:
        lp = array("f")
        tids = array("I")
        tlps = array("f")
        for r in rids:
            p = subs[r].params
            if p.logprobs:
                lp.append(-seed - r / 10)
            tids.extend([seed + r] * p.top_logprobs)
            tlps.extend([-1.5] * p.top_logprobs)
        return TokenBatch(
            array("I", rids),
            array("I", [1] * len(rids)),
            array("I", [seed * 10 + r for r in rids]),
            array("I", [1] * len(rids)),
            b"x" * len(rids),
            array("B", [subs[r].params.logprobs for r in rids]),
            array("B", [subs[r].params.top_logprobs for r in rids]),
            lp,
            tids,
            tlps,
        )

    subs = {
        1: Submit(1, "m", SamplingParams(logprobs=True), prompt="a"),
        2: Submit(2, "m", SamplingParams(top_logprobs=2), prompt="b"),
        3: Submit(3, "m", SamplingParams(), prompt="c"),
    }
    msgs: list[Message] = [*subs.values()]
    msgs += [step([1, 2, 3], subs, s) for s in range(3)]
    msgs.append(Finish(3, FinishReason.STOP, 1, 3))
    subs[3] = Submit(3, "m", SamplingParams(logprobs=True, top_logprobs=1), prompt="d")
    msgs.append(subs[3])
    msgs += [step([1, 2, 3], subs, s) for s in range(3, 6)]
    data = encode_all(msgs)
    out = FrameDecoder().feed(data)
    assert [norm(m) for m in out] == [norm(m) for m in msgs]


@given(submits())
def test_submit_body_is_the_packed_field_list(sub: Submit) -> None:
    """The encoder's spliced SUBMIT body (params packed once per SamplingParams) equals
    packing the spec's field list, on first use and from the cache."""
    from transport.wire_control import pack, submit_body, submit_fields

    assert submit_body(sub) == pack(submit_fields(sub))
    assert submit_body(sub) == pack(submit_fields(sub))
