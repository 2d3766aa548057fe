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
        frame = b"\x00" + len(msg).to_bytes(4, "big") + msg
        ctype = b"application/grpc-web-text" if text else b"application/grpc-web+proto"
        async with h3_connect(listener.address[1]) as client:
            r = await client.request("POST", "/quicserve.v1.Inference/Generate",
                                     base64.b64encode(frame) if text else frame,
                                     [(b"content-type", ctype), (b"x-grpc-web", b"1")])
        assert r.status == 200
        # grpc-web-text: each write is its own base64 run (padded), concatenated: decode by quanta
        body = b"".join(base64.b64decode(r.body[i:i + 4]) for i in range(0, len(r.body), 4)) if text else r.body
        texts, trailer = [], b""
        while body:
            flag, n = body[0], int.from_bytes(body[1:5], "big")
            payload, body = body[5:5 + n], body[5 + n:]
            if flag & 0x80:
                trailer = payload
            else:
                texts.append(pb.GenerateResponse.FromString(payload))
        assert b"grpc-status:0" in trailer.replace(b" ", b"")
        assert "".join(t.text for t in texts) == "abcde" and texts[-1].usage.completion_tokens == 5
        assert len(conn.submits) == 1
    finally:
        await listener.close()
