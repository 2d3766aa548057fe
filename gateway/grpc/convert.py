"""Protobuf messages <-> the service's plain types (:class:`GenerateSpec`, :class:`Finished`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from transport.messages import FinishReason

from ..errors import APIError
from .backend import ChatMessage, Finished, GenerateSpec
from .quicserve.v1 import quicserve_pb2 as pb

__all__ = ["spec_from", "text_metadata", "with_sampling", "chat_messages", "reason_of", "usage_of"]


def text_metadata(metadata: Mapping[str, str | bytes] | None) -> tuple[tuple[str, str], ...]:
    """A call's text metadata as :attr:`GenerateSpec.metadata` (binary ``-bin`` values left out)."""
    if metadata is None:
        return ()
    return tuple((k, v) for k, v in metadata.items() if isinstance(v, str))


def with_sampling(spec: GenerateSpec, s: pb.Sampling) -> GenerateSpec:
    """``spec`` with the sampling fields the client set (unset ones keep the server's default)."""
    return replace(
        spec,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else None,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else None,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens if s.HasField("min_tokens") else None,
    )


def chat_messages(messages: Iterable[pb.Message]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(m.role, m.content) for m in messages)


def spec_from(request: pb.GenerateRequest, deadline: float | None,
              metadata: tuple[tuple[str, str], ...] = ()) -> GenerateSpec:
    """A Generate/Complete request as a :class:`GenerateSpec`; one without input is a 400."""
    which = request.WhichOneof("input")
    if which is None:
        raise APIError(400, "Set either prompt or conversation.", param="input")
    if which == "prompt":
        spec = GenerateSpec(request.model, prompt=request.prompt, deadline=deadline, metadata=metadata)
    else:
        spec = GenerateSpec(request.model, messages=chat_messages(request.conversation.messages),
                            deadline=deadline, metadata=metadata)
    return with_sampling(spec, request.sampling)


_REASON = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


def reason_of(outcome: Finished) -> pb.FinishReason:
    return _REASON[outcome.reason]


def usage_of(outcome: Finished) -> pb.Usage:
    return pb.Usage(prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                    cached_tokens=outcome.cached_tokens)
