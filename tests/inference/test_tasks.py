"""The worker's answers about a prompt (#31, inference/tasks.py) through WorkerService, with the
synthetic runner (its made-up hidden states and prompt logprobs, a pure function of the prompt):
tokenize, detokenize, embeddings, echo (its prompt entry first, max_tokens 0), a resumed echo, and
a cancel during a prompt pass."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest

from inference.synthetic import SyntheticRunner
from inference.tasks import PromptPassUnavailable, pooled
from transport.messages import (
    Continuation,
    Error,
    ErrorCode,
    Finish,
    FinishReason,
    Pooling,
    SamplingParams,
    Submit,
    Task,
)

from .test_service import RecordingConnection, make_service, run_until


@pytest.mark.parametrize("threaded", [True, False])
async def test_tokenize_detokenize_and_embed(threaded: bool) -> None:
    svc = make_service(threaded=threaded)
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", prompt="hé", buffered=True, task=Task.TOKENIZE))
    svc.on_submit(conn, Submit(2, "tiny", prompt_token_ids=(104, 195, 169), buffered=True, task=Task.DETOKENIZE))
    svc.on_submit(conn, Submit(3, "tiny", prompt="hé", buffered=True, task=Task.EMBED, pooling=Pooling.LAST))
    svc.on_submit(conn, Submit(4, "tiny", prompt_token_ids=(104, 999), buffered=True, task=Task.DETOKENIZE))
    await run_until(svc, lambda: all(conn.ends(r) for r in (1, 2, 3, 4)))
    ids = [256, 104, 195, 169]  # the byte tokenizer: BOS, then UTF-8 bytes
    assert [list(e.token_ids) for e in conn.entries(1)] == [ids]  # type: ignore[attr-defined]
    assert conn.ends(1) == [Finish(1, FinishReason.STOP, 4, 0)]
    assert conn.text(2) == "hé" and conn.ends(2) == [Finish(2, FinishReason.STOP, 3, 0)]
    vec = np.frombuffer(base64.b64decode(conn.text(3)), "<f4")
    runner = svc.engine.runner
    assert isinstance(runner, SyntheticRunner)
    want = pooled(runner.prompt_pass(ids, False).hidden, Pooling.LAST)
    assert vec.shape == (SyntheticRunner.hidden_size,) and np.array_equal(vec, want)
    assert math.isclose(float(np.linalg.norm(vec)), 1.0, rel_tol=1e-6)
    (err,) = conn.ends(4)
    assert isinstance(err, Error) and err.code == ErrorCode.INVALID_REQUEST


async def test_echo_sends_the_prompt_first_then_generates() -> None:
    svc = make_service()
    conn = RecordingConnection()
    lp = SamplingParams(max_tokens=3, seed=1, logprobs=True, top_logprobs=2)
    svc.on_submit(conn, Submit(1, "tiny", lp, prompt="abc", echo=True))
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=0, logprobs=True), prompt="abc", echo=True))
    svc.on_submit(conn, Submit(3, "tiny", SamplingParams(max_tokens=3, seed=1), prompt="abc", echo=True))
    svc.on_submit(conn, Submit(4, "tiny", SamplingParams(max_tokens=3, seed=1), prompt="abc"))
    await run_until(svc, lambda: all(conn.ends(r) for r in (1, 2, 3, 4)))
    first = next(iter(conn.entries(1)))
    assert list(first.token_ids) == [256, 97, 98, 99] and bytes(first.text) == b"abc"  # type: ignore[attr-defined]
    lps = list(first.logprobs)  # type: ignore[attr-defined]
    assert math.isnan(lps[0]) and all(x < 0 for x in lps[1:])
    assert list(first.top_ids)[2:4] == [97, 98]  # type: ignore[attr-defined]  # position 1: its own token first
    (end,) = conn.ends(1)
    assert isinstance(end, Finish) and (end.reason, end.prompt_tokens, end.completion_tokens) == (FinishReason.LENGTH, 4, 3)
    # the same prompt prefilled first for request 4 is shared whole (one aligned block: all but the last
    # token, which is recomputed) -- or not at all if request 1 went first
    assert end.cached_tokens in (0, 3)
    assert conn.text(1) == "abc" + conn.text(4)  # the prompt, then what the same request generates
    assert conn.text(3) == conn.text(1) and next(iter(conn.entries(3))).logprobs is None  # type: ignore[attr-defined]
    assert conn.text(2) == "abc" and conn.ends(2) == [Finish(2, FinishReason.LENGTH, 4, 0)]


async def test_what_the_engine_would_refuse_is_refused_before_anything_is_sent() -> None:
    svc = make_service()  # max_model_len 4096 (the synthetic runner's default)
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=10), prompt="x" * 4090, echo=True))
    svc.on_submit(conn, Submit(2, "tiny", prompt_token_ids=(1, 300), buffered=True, task=Task.EMBED))
    svc.on_submit(conn, Submit(3, "tiny", SamplingParams(logprobs=True), prompt_token_ids=(), echo=True))
    svc.on_submit(conn, Submit(4, "tiny", prompt_token_ids=(65,) * 5000, buffered=True, task=Task.DETOKENIZE))
    await run_until(svc, lambda: all(conn.ends(r) for r in (1, 2, 3, 4)))
    assert [m.code for r in (1, 2, 3) for m in conn.ends(r)] == [  # type: ignore[attr-defined]
        ErrorCode.CONTEXT_LENGTH, ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_REQUEST]
    assert not any(list(conn.entries(r)) for r in (1, 2, 3))
    assert conn.text(4) == "A" * 5000  # detokenizing is not bound by the context


async def test_a_resumed_echo_does_not_repeat_its_prompt() -> None:
    first, conn = make_service(), RecordingConnection()  # the request's first replica (run to its end)
    first.on_submit(conn, Submit(4, "tiny", SamplingParams(max_tokens=4, seed=1), prompt="abc"))
    await run_until(first, lambda: conn.ends(4))
    whole = conn.text(4)
    done = [int(t) for e in conn.entries(4) for t in e.token_ids][:2]  # type: ignore[attr-defined]
    svc = make_service()  # the replica it resumes on, with two tokens delivered after the prompt
    cont = Continuation((256, 97, 98, 99, *done), 3 + len(whole[:2].encode()))
    svc.on_submit(conn, Submit(5, "tiny", SamplingParams(max_tokens=4, seed=1), prompt="abc", echo=True,
                               continuation=cont))
    svc.on_submit(conn, Submit(6, "tiny", SamplingParams(max_tokens=4), prompt="abc", echo=True,
                               continuation=Continuation((1, 2), 0)))
    await run_until(svc, lambda: conn.ends(5) and conn.ends(6))
    assert conn.text(5) == whole[2:]
    assert conn.ends(5) == [Finish(5, FinishReason.LENGTH, 4, 4, 0)]
    (err,) = conn.ends(6)
    assert isinstance(err, Error) and err.code == ErrorCode.INVALID_REQUEST


async def test_a_cancel_during_the_prompt_pass_ends_it_once() -> None:
    svc = make_service()
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", prompt="abc", buffered=True, task=Task.EMBED))
    svc.on_cancel(conn, 1)
    await run_until(svc, lambda: svc.tasks.pending == 0)
    assert conn.ends(1) == [Finish(1, FinishReason.CANCELLED, 0, 0)] and not list(conn.entries(1))


async def test_a_runner_that_cannot_run_the_pass_refuses_the_request_and_serves_on() -> None:
    svc = make_service()
    conn = RecordingConnection()

    def unavailable(length: int, logprobs: bool) -> None:
        raise PromptPassUnavailable("not here")

    svc.engine.runner.prepare_prompt_pass = unavailable  # type: ignore[attr-defined]
    svc.on_submit(conn, Submit(1, "tiny", prompt="abc", buffered=True, task=Task.EMBED))
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=2), prompt="abc"))
    await run_until(svc, lambda: conn.ends(1) and conn.ends(2))
    (err,) = conn.ends(1)
    assert isinstance(err, Error) and err.code == ErrorCode.INVALID_REQUEST and err.message == "not here"
    assert conn.ends(2) == [Finish(2, FinishReason.LENGTH, 4, 2, 0)]
