"""A request resumed on a second replica (``Submit.continuation``, mid-stream failover #30): the
engine and the worker service go on from any token of an undisturbed run and the client's text
continues byte for byte -- multi-byte characters split over tokens, stop strings across the cut,
max_tokens and usage over the whole output, seeded sampling at the same positions."""

from __future__ import annotations

import asyncio

import pytest

from inference.engine import Engine, EngineConfig
from inference.service import WorkerService
from inference.synthetic import SyntheticRunner
from inference.tokenizer import ByteTokenizer
from tests.inference.doubles import Collector, ScriptedRunner, run_until_done
from tests.inference.test_service import RecordingConnection, make_service, run_until
from transport.messages import Continuation, Error, ErrorCode, Finish, FinishReason, SamplingParams, Submit

TOK = ByteTokenizer()
PROMPT = TOK.encode("tell me")
# "a é € 😀 ok stop here": characters of 1 to 4 bytes, each byte a token of the byte-level tokenizer
SCRIPT = list("a é € 😀 ok stop here and on".encode()) + [257]


def run(params: SamplingParams, cont: Continuation | None = None,
        runner: object = None) -> tuple[list[int], bytes, list[bytes], Finish]:
    """(tokens, text, text per token, end) of one request on a fresh engine."""
    eng = Engine(runner or ScriptedRunner({7: SCRIPT}), TOK, EngineConfig())  # type: ignore[arg-type]
    eng.add("r", PROMPT, params, 0.0, continuation=cont)
    col = Collector()
    run_until_done(eng, col)
    end = col.ends["r"]
    assert not isinstance(end, Error)
    per_token: list[bytes] = []
    for d in col.deltas.get("r", []):
        if d.token_ids:
            per_token.append(d.text.encode())
        elif per_token:
            per_token[-1] += d.text.encode()  # the end's flush, with the last token
    fin = Finish(1, end.reason, end.prompt_tokens, end.completion_tokens, end.cached_tokens)  # type: ignore[union-attr]
    return col.tokens("r"), col.text("r").encode(), per_token, fin


def resumed_everywhere(params: SamplingParams, runner: object = None) -> None:
    """Cut the undisturbed run after every token: the resumed run sends exactly the rest."""
    toks, text, per_token, fin = run(params, runner=runner)
    assert len(per_token) == len(toks)
    for k in range(1, len(toks)):
        sent = b"".join(per_token[:k])
        rest_toks, rest_text, _, rest_fin = run(params, Continuation(tuple(toks[:k]), len(sent)), runner)
        assert rest_toks == toks[k:], k
        assert sent + rest_text == text, k
        assert (rest_fin.reason, rest_fin.prompt_tokens, rest_fin.completion_tokens) == (
            fin.reason, fin.prompt_tokens, fin.completion_tokens), k


@pytest.mark.parametrize("stop", [(), ("stop",), ("p here",), ("😀 o",), ("é €",)])
def test_a_resumed_request_goes_on_byte_for_byte_from_any_token(stop: tuple[str, ...]) -> None:
    resumed_everywhere(SamplingParams(max_tokens=64, seed=7, stop=stop))


def test_max_tokens_counts_the_whole_output() -> None:
    resumed_everywhere(SamplingParams(max_tokens=9, seed=7))  # ends inside "€"
    _, text, _, fin = run(SamplingParams(max_tokens=9, seed=7), Continuation(tuple(SCRIPT[:5]), 4))
    assert fin.completion_tokens == 9 and fin.prompt_tokens == len(PROMPT) and fin.reason is FinishReason.LENGTH


def test_seeded_sampling_resumes_at_the_same_positions() -> None:
    """The synthetic runner samples from the context, the seed and the position (temperature 1):
    a resumed request draws what the undisturbed one drew."""
    resumed_everywhere(SamplingParams(max_tokens=24, seed=12345, temperature=1.0), SyntheticRunner())
    resumed_everywhere(SamplingParams(max_tokens=24, temperature=0.0), SyntheticRunner())


@pytest.mark.parametrize("delta", [-4, -3, 1, 5])
def test_the_client_text_offset_wins_over_what_this_replica_would_have_sent(delta: int) -> None:
    """A replica whose detokenizer would have held back more, or less, than the lost one did: the
    next delta adds what the client lacks, or drops what it has (``text_bytes``; a client only ever
    has whole characters, so it falls between two)."""
    params = SamplingParams(max_tokens=64, seed=7)
    toks, text, per_token, _ = run(params)
    k = 8  # after "a é €" (8 bytes); the offsets below fall after "a é", "a é ", "a é € ", "a é € 😀"
    sent = len(b"".join(per_token[:k]))
    _, rest, _, _ = run(params, Continuation(tuple(toks[:k]), sent + delta))
    assert rest == text[sent + delta:]


def test_a_continuation_with_no_text_wanted_sends_none() -> None:
    toks, _, _, _ = run(SamplingParams(max_tokens=64, seed=7))
    eng = Engine(ScriptedRunner({7: SCRIPT}), TOK, EngineConfig())  # type: ignore[arg-type]
    eng.add("r", PROMPT, SamplingParams(max_tokens=64, seed=7), 0.0, return_text=False,
            continuation=Continuation(tuple(toks[:5]), 0))
    col = Collector()
    run_until_done(eng, col)
    assert col.text("r") == "" and col.tokens("r") == toks[5:]


def _service_run(svc: WorkerService, conn: RecordingConnection, sub: Submit) -> None:
    async def go() -> None:
        svc.on_submit(conn, sub)
        await run_until(svc, lambda: conn.ends(sub.request_id))
    asyncio.run(go())


def test_the_worker_says_it_can_and_resumes_over_its_handler() -> None:
    svc = make_service()
    assert "continuation" in svc.hello().capabilities
    p = SamplingParams(max_tokens=20, temperature=0.0)
    whole, part = RecordingConnection(), RecordingConnection()
    _service_run(svc, whole, Submit(1, "tiny", p, prompt="hello"))
    toks = [t for e in whole.entries(1) for t in e.token_ids]  # type: ignore[attr-defined]
    text = whole.text(1).encode()
    cut = 7
    _service_run(make_service(), part, Submit(2, "tiny", p, prompt="hello",
                                              continuation=Continuation(tuple(toks[:cut]), cut)))
    assert [t for e in part.entries(2) for t in e.token_ids] == toks[cut:]  # type: ignore[attr-defined]
    assert part.text(2).encode() == text[cut:]
    (a,), (b,) = whole.ends(1), part.ends(2)
    assert isinstance(a, Finish) and isinstance(b, Finish)
    assert (b.prompt_tokens, b.completion_tokens) == (a.prompt_tokens, a.completion_tokens) == (6, 20)


def test_a_continuation_already_at_max_tokens_ends_at_once_and_bad_ids_are_refused() -> None:
    svc, conn = make_service(), RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=3), prompt="hi",
                               continuation=Continuation((65, 66, 67), 3)))
    assert conn.sent == [Finish(1, FinishReason.LENGTH, 3, 3)]
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=8), prompt="hi",
                               continuation=Continuation((65, 999), 1)))
    (err,) = conn.ends(2)
    assert isinstance(err, Error) and err.code is ErrorCode.INVALID_REQUEST
    assert not svc.engine.has_unfinished()
