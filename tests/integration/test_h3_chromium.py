"""An independent HTTP/3 stack: headless Chromium fetches a completion from the gateway over h3.

Debian's ``chromium`` (``make test`` installs it: Makefile ``APT_PKGS``; this test
installs it too when it can). QUIC is forced on the gateway's origin and the
self-signed test certificate is trusted by its SPKI hash. The page, served by the
gateway over h3, POSTs a chat completion and writes the ``nextHopProtocol`` of
the navigation and of the API call, which ``--dump-dom`` hands back.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.app import App
from gateway.http.quic_listener import start_quic_listener
from gateway.http.types import Call, Request, ResponseSink
from gateway.routing.pool import ModelPool
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.gateway.http.h3_client import make_cert

pytestmark = pytest.mark.timeout(600)  # room to install chromium where `make sysdeps` did not

PAGE = b"""<!doctype html><html><body><pre id="out">pending</pre><script>
fetch('/v1/chat/completions', {method: 'POST', headers: {'content-type': 'application/json'},
  body: JSON.stringify({model: 'tiny', messages: [{role: 'user', content: 'hi'}], max_tokens: 5})})
 .then(r => r.json()).then(j => {
   const api = performance.getEntriesByType('resource').find(e => e.name.endsWith('/v1/chat/completions'));
   const nav = performance.getEntriesByType('navigation')[0];
   document.getElementById('out').textContent = JSON.stringify({text: j.choices[0].message.content,
     api: api.nextHopProtocol, page: nav.nextHopProtocol});
 }).catch(err => { document.getElementById('out').textContent = JSON.stringify({error: String(err)}); });
</script></body></html>"""


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=240)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=240)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("Debian's chromium is not installed and could not be (apt-get install chromium)")
    return found


def spki_hash(cert_pem: bytes) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)), what --ignore-certificate-errors-spki-list takes."""
    key = x509.load_pem_x509_certificate(cert_pem).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


class _Answered:
    def cancel(self) -> bool:
        return False


async def test_chromium_fetches_a_completion_over_h3(tmp_path: Path) -> None:
    browser = chromium()
    cert = make_cert(tmp_path / "tls")
    pool = ModelPool()
    pool.add(ScriptedWorkerConnection())
    app = App(pool)
    loop = asyncio.get_running_loop()

    def entrance(req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        if req.path == "/page":  # the test's page; everything else is the gateway's pipeline
            sink.respond(200, [(b"content-type", b"text/html; charset=utf-8")], PAGE)
            loop.call_soon(done)
            return _Answered()
        return app.handle(req, sink, done)

    listener = await start_quic_listener(entrance, "127.0.0.1", 0, *cert)
    port = listener.address[1]
    try:
        with tempfile.TemporaryDirectory() as profile:
            proc = await asyncio.create_subprocess_exec(
                browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--enable-quic", f"--origin-to-force-quic-on=127.0.0.1:{port}",
                f"--ignore-certificate-errors-spki-list={spki_hash(Path(cert[0]).read_bytes())}",
                "--virtual-time-budget=20000", "--dump-dom", f"https://127.0.0.1:{port}/page",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 90)
    finally:
        await listener.close()
    found = re.findall(rb'<pre id="out">(.*?)</pre>', out)
    assert found, (out[-500:], err[-2000:])
    result = orjson.loads(found[0].replace(b"&quot;", b'"'))
    assert result == {"text": "abcde", "api": "h3", "page": "h3"}, err[-2000:]
