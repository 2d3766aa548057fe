"""Request bodies, rendered once before a run: OpenAI JSON and quicserve's gRPC message."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .data import BenchRequest

__all__ = ["BodyOptions", "openai_body", "grpc_body", "ENDPOINTS"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class BodyOptions:
    model: str
    endpoint: str = "completions"  # or "chat"
    stream: bool = True
    ignore_eos: bool = False  # vLLM's and quicserve's extension
    min_tokens: int = 0  # vLLM's extension (quicserve's schema refuses it): sent only when set
    temperature: float | None = None


def openai_body(req: BenchRequest, o: BodyOptions) -> bytes:
    d: dict[str, object] = {"model": o.model, "max_tokens": req.output_len, "stream": o.stream}
    if o.endpoint == "chat":
        d["messages"] = list(req.messages)
    else:
        d["prompt"] = req.prompt
    if o.stream:
        d["stream_options"] = {"include_usage": True}
    if o.ignore_eos:
        d["ignore_eos"] = True
    if o.min_tokens:
        d["min_tokens"] = o.min_tokens
    if o.temperature is not None:
        d["temperature"] = o.temperature
    return orjson.dumps(d)


def grpc_body(req: BenchRequest, o: BodyOptions) -> bytes:
    """A serialized ``quicserve.v1.GenerateRequest`` (chat: a conversation; completions: a prompt)."""
    from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

    sampling = pb.Sampling(max_tokens=req.output_len)
    if o.temperature is not None:
        sampling.temperature = o.temperature
    if o.endpoint == "chat":
        conv = pb.Conversation(messages=[pb.Message(role=m["role"], content=m["content"]) for m in req.messages])
        msg = pb.GenerateRequest(model=o.model, conversation=conv, sampling=sampling)
    else:
        msg = pb.GenerateRequest(model=o.model, prompt=req.prompt, sampling=sampling)
    out: bytes = msg.SerializeToString()
    return out
