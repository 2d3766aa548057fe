"""The bench's plain parts: arrival times, data sources, the SSE reader, the figures."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.bench.arrivals import arrival_times, load_trace, parse_rates
from gateway.bench.compare import bootstrap_median_ci
from gateway.bench.data import (
    ByteCounter,
    load_counter,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
    zipf_weights,
)
from gateway.bench.grpc_web import GrpcWebReader
from gateway.bench.records import Record, SSEReader
from gateway.bench.stats import latency_stats, parse_slos, summarize

SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"


def _gaps(rate: float, burstiness: float, n: int) -> np.ndarray:
    it = arrival_times(rate, burstiness=burstiness, seed=1)
    return np.diff([0.0] + [next(it) for _ in range(n)])


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_burstiness(burstiness: float) -> None:
    # gamma(k, 1/(rate k)) gaps: mean 1/rate, coefficient of variation 1/sqrt(k); with n gaps the
    # sample mean's relative standard error is cv/sqrt(n): 5 of them is far beyond chance
    n, rate = 20_000, 50.0
    g = _gaps(rate, burstiness, n)
    cv = 1 / math.sqrt(burstiness)
    assert g.mean() == pytest.approx(1 / rate, rel=5 * cv / math.sqrt(n))
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.1)
    assert np.all(g >= 0)


def test_infinite_rate_sends_everything_at_once_and_rates_parse() -> None:
    it = arrival_times(math.inf)
    assert [next(it) for _ in range(3)] == [0, 0, 0]
    assert parse_rates("5, 10,inf") == [5, 10, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0")


def test_trace_is_sorted_and_made_relative(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 2500, "input_length": 10, "output_length": 3}\n\n{"timestamp": 1000}\n')
    t = load_trace(p, time_unit=0.001)
    assert [(e.at, e.input_len, e.output_len) for e in t] == [(0.0, None, None), (1.5, 10, 3)]
    p.write_text('{"time": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(p)


def test_random_lengths_stay_in_their_range() -> None:
    reqs = random_requests(500, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    ins = [r.prompt_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50
    assert all(ByteCounter().count(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)


def test_shared_prefix_sessions_grow_and_tenants_follow_zipf() -> None:
    reqs = shared_prefix_requests(3000, tenants=4, prefix_len=40, suffix_len=8, output_len=5, zipf=1.0,
                                  turns=3, sessions=6, seed=2)
    by_session: dict[int, list[int]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(len(r.messages))
        assert r.messages[0]["role"] == "system" and len(r.messages[0]["content"]) == 40
    # each session: system + user (1 turn), then + assistant + user each turn, at most 3 turns
    assert all(lens == [2, 4, 6][: len(lens)] for lens in by_session.values())
    sessions = {r.session: r.tenant for r in reqs}
    counts = np.bincount(list(sessions.values()), minlength=4) / len(sessions)
    w = zipf_weights(4, 1.0)
    assert counts == pytest.approx(w, abs=5 * math.sqrt(w[0] * (1 - w[0]) / len(sessions)))
    prefixes = {r.tenant: r.messages[0]["content"] for r in reqs}
    assert len(set(prefixes.values())) == 4


def test_sharegpt_sample_reads_the_first_turn_and_its_reply() -> None:
    convs = orjson.loads(SAMPLE.read_bytes())
    reqs = sharegpt_requests(SAMPLE, 40, seed=0)
    usable = {c["conversations"][0]["value"]: len(c["conversations"][1]["value"].encode())
              for c in convs if len(c["conversations"]) >= 2 and c["conversations"][0]["from"] == "human"
              and len(c["conversations"][0]["value"]) >= 4}
    assert len(usable) >= 30
    assert {r.prompt for r in reqs} <= set(usable) and len({r.prompt for r in reqs}) == len(usable)
    assert all(r.output_len == usable[r.prompt] for r in reqs)
    assert all(r.output_len == 12 for r in sharegpt_requests(SAMPLE, 5, output_len=12))


_STREAM = (b'data: {"choices":[{"text":"","index":0}]}\n\n'
           b'data: {"choices":[{"text":"a","index":0}]}\n\n'
           b'data: {"choices":[{"delta":{"content":"b"},"index":0}]}\n\n'
           b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n')


@given(st.lists(st.integers(0, len(_STREAM)), max_size=8))
def test_sse_reader_reads_any_split_the_same(cuts: list[int]) -> None:
    rec = Record(0, 0.0)
    reader = SSEReader(rec)
    bounds = [0, *sorted(cuts), len(_STREAM)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        reader.feed(_STREAM[a:b], float(i))
    reader.finish(99.0)
    assert not rec.error and reader.done and reader.chunks == 2
    assert (rec.output_tokens, rec.prompt_tokens) == (2, 3)


def _web_stream() -> bytes:
    from gateway.grpc.framing import FLAG_TRAILERS, encode_frame
    from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

    msgs = [pb.GenerateResponse(text="a"), pb.GenerateResponse(text=""), pb.GenerateResponse(text="bc"),
            pb.GenerateResponse(usage=pb.Usage(prompt_tokens=3, completion_tokens=3))]
    return b"".join(encode_frame(0, m.SerializeToString()) for m in msgs) + encode_frame(FLAG_TRAILERS,
                                                                                           b"grpc-status:0\r\n")


_WEB = _web_stream()


@given(st.lists(st.integers(0, len(_WEB)), max_size=8))
def test_grpc_web_reader_reads_any_split_the_same(cuts: list[int]) -> None:
    rec = Record(0, 0.0)
    reader = GrpcWebReader(rec, stream=True)
    bounds = [0, *sorted(cuts), len(_WEB)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        reader.feed(_WEB[a:b], float(i + 1))
    reader.finish(99.0)
    assert not rec.error and reader.status == 0 and reader.chunks == 2  # the empty message is no token
    assert (rec.output_tokens, rec.prompt_tokens, rec.end) == (3, 3, 99.0)
    assert rec.ttft is not None and rec.ttft >= 1 and len(rec.itl) == 1 and rec.itl[0] >= 0


def test_grpc_web_body_cut_before_its_trailer_frame_is_incomplete() -> None:
    rec = Record(0, 0.0)
    reader = GrpcWebReader(rec, stream=False)
    reader.feed(_WEB[:-5], 1.0)
    reader.finish(2.0)
    assert rec.error == "incomplete_stream" and rec.end == 2.0


def test_a_stream_that_finished_without_done_is_complete() -> None:
    """Some servers (transformers serve) end with a finish_reason and usage, and no data: [DONE]."""
    rec = Record(0, 0.0)
    r = SSEReader(rec)
    r.feed(b'data: {"choices":[{"text":"a","index":0}]}\n\n'
           b'data: {"choices":[{"text":"","index":0,"finish_reason":"length"}]}\n\n', 1.0)
    r.finish(2.0)
    assert not rec.error and rec.output_tokens == 1
    cut = Record(1, 0.0)
    r = SSEReader(cut)
    r.feed(b'data: {"choices":[{"text":"a","index":0,"finish_reason":null}]}\n\n', 1.0)
    r.finish(2.0)
    assert cut.error == "incomplete_stream"


def test_sse_error_event_is_an_error_kind() -> None:
    rec = Record(0, 0.0)
    r = SSEReader(rec)
    r.feed(b'data: {"error": {"message": "worker died"}}\n\ndata: [DONE]\n\n', 1.0)
    r.finish(1.0)
    assert (rec.error, rec.detail) == ("stream_error", "worker died")


def test_percentiles_and_slos() -> None:
    s = latency_stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (s["mean"], s["median"], s["count"]) == (pytest.approx(50.5), pytest.approx(50.5), 100)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)  # linear interpolation
    assert latency_stats([])["median"] is None
    assert parse_slos(["ttft:500 tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


def test_warmup_records_are_not_counted() -> None:
    recs = [Record(i, i * 0.1, start=i * 0.1, end=i * 0.1 + 0.05, ttft=0.01, output_tokens=4, warmup=i < 3)
            for i in range(10)]
    s = summarize(recs, warmup=0.3)
    assert s["requests"] == 7 and s["output_tokens"] == 28
    assert s["duration_s"] == pytest.approx(0.95 - 0.3)


def test_bootstrap_interval_holds_the_true_median_difference() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.exponential(10, 400), rng.exponential(10, 400) + 3
    ci = bootstrap_median_ci(a.tolist(), b.tolist(), resamples=1000)
    assert ci["diff_lo"] < ci["diff"] < ci["diff_hi"]
    assert ci["diff_lo"] > 0  # a 3 ms shift of 400 samples each is beyond resampling noise
    same = bootstrap_median_ci(a.tolist(), a.tolist(), resamples=1000)
    assert same["diff_lo"] <= 0 <= same["diff_hi"]


def test_a_hugging_face_tokenizer_counts_the_prompts(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = load_counter(str(tmp_path))
    reqs = random_requests(50, input_len=64, output_len=8, seed=4, counter=counter)
    assert all(r.prompt_len == len(tok.encode(r.prompt).ids) for r in reqs)
    lens = [r.prompt_len for r in reqs]
    assert abs(sum(lens) / len(lens) - 64) < 64 * 0.1, lens  # 64 ids decoded, encoded again: near 64
