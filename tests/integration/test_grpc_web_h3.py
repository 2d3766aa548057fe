"""gRPC-Web over HTTP/3: the same mounted route, through the QUIC listener and the one pipeline
(the real service bound to the pipeline, the ScriptedWorkerConnection double as the worker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.app import App
from gateway.grpc.mount import mount_grpc
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.http.quic_listener import start_quic_listener
from gateway.routing.pool import ModelPool
from gateway.settings import GrpcSettings
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.gateway.grpc.web_client import decode_text, frame, parse_body
from tests.gateway.http.h3_client import h3_connect, make_cert


@pytest.mark.parametrize("text", [False, True], ids=["binary", "text"])
async def test_generate_over_grpc_web_on_h3(tmp_path: Path, text: bool) -> None:
    import base64

    cert, key = make_cert(tmp_path)
    pool = ModelPool()
    conn = ScriptedWorkerConnection()
    pool.add(conn)
    app = App(pool)
    await mount_grpc(app, GrpcSettings(port=-1), "127.0.0.1")
    listener = await start_quic_listener(app.handle, "127.0.0.1", 0, cert, key)
    try:
        msg = pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=5)).SerializeToString()
        body = frame(msg)
        ctype = b"application/grpc-web-text" if text else b"application/grpc-web+proto"
        async with h3_connect(listener.address[1]) as client:
            r = await client.request("POST", "/quicserve.v1.Inference/Generate",
                                     base64.b64encode(body) if text else body,
                                     [(b"content-type", ctype), (b"x-grpc-web", b"1")])
        assert r.status == 200
        parsed = parse_body(decode_text(r.body) if text else r.body, None)
        texts = [pb.GenerateResponse.FromString(m) for m in parsed.messages]
        assert parsed.trailers["grpc-status"].strip() == "0"
        assert "".join(t.text for t in texts) == "abcde" and texts[-1].usage.completion_tokens == 5
        assert len(conn.submits) == 1
    finally:
        await listener.close()
