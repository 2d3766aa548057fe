"""What one TLS record costs to open and to seal through Python's ``ssl`` over memory BIOs, per
protocol version and cipher suite: callgrind's instruction count of ``SSLObject.read`` (the C method,
OpenSSL included) and ``SSLObject.write``, per ~80-byte record (one engine step's frames at c=1).

Why the transport speaks TLS 1.2 (transport/security.py): at c=1 every engine step is one record
the gateway opens, and OpenSSL 3.0 opens a TLS 1.3 record for ~1.3k instructions more than a 1.2
AES-GCM one. TLS 1.3's suites are not settable through Python's ``ssl``; ``--ctypes`` sets them
through ``SSL_CTX_set_ciphersuites`` (a measurement aid only, never in the transport). Measured on
OpenSSL 3.0.19, CPython 3.11.7 (instructions per 80-byte record; read, write):

    TLS 1.3 TLS_AES_256_GCM_SHA384 (1.3's default)   7354  8906
    TLS 1.3 TLS_AES_128_GCM_SHA256                    7270  8827
    TLS 1.3 TLS_CHACHA20_POLY1305_SHA256              9220 10542
    TLS 1.2 ECDHE-ECDSA-AES256-GCM-SHA384             6037  7379   (the transport's)
    TLS 1.2 ECDHE-ECDSA-AES128-GCM-SHA256             5970  7313
    TLS 1.2 ECDHE-ECDSA-CHACHA20-POLY1305             7280  8464

    .venv/bin/python tests/bench/tls_record_cost.py [--records 2000] [--size 80] [--ctypes]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

CONFIGS = [("1.3", "default"), ("1.3", "TLS_AES_128_GCM_SHA256"), ("1.3", "TLS_CHACHA20_POLY1305_SHA256"),
           ("1.2", "ECDHE-ECDSA-AES256-GCM-SHA384"), ("1.2", "ECDHE-ECDSA-AES128-GCM-SHA256"),
           ("1.2", "ECDHE-ECDSA-CHACHA20-POLY1305")]
C_METHODS = {"read": "_ssl__SSLSocket_read", "write": "_ssl__SSLSocket_write"}  # CPython's C functions


def _context(server: bool, version: str, suite: str, pki: Path) -> ssl.SSLContext:
    from tests.transport.certs import TestCA

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    if version == "1.3":
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        if suite != "default":
            libssl = ctypes.CDLL("libssl.so.3")
            libssl.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            ssl_ctx = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value  # PySSLContext.ctx
            if libssl.SSL_CTX_set_ciphersuites(ssl_ctx, suite.encode()) != 1:
                raise RuntimeError(f"cannot set {suite}")
    else:
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(suite)
    if not (pki / "both.crt").exists():
        TestCA(pki).issue("both", "both")
    ctx.load_cert_chain(pki / "both.crt", pki / "both.key")
    ctx.load_verify_locations(cafile=pki / "ca.crt")
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def records(version: str, suite: str, n: int, size: int, pki: Path) -> None:
    """The counted program: a handshake, then ``n`` records sealed by one end and opened by the other."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = _context(False, version, suite, pki).wrap_bio(c_in, c_out, server_side=False)
    server = _context(True, version, suite, pki).wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for obj, into, frm in ((client, s_in, c_out), (server, c_in, s_out)):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
            into.write(frm.read())
    server.write(b"x")
    c_in.write(s_out.read())
    client.read(100)  # and any tickets
    payload = b"p" * size
    read, write = client._sslobj.read, server._sslobj.write  # type: ignore[attr-defined]
    for _ in range(n):
        write(payload)
        c_in.write(s_out.read())
        if read(464) != payload:
            raise RuntimeError("a record did not come through")
    print(client.version(), (client.cipher() or ("?",))[0], file=sys.stderr)


def count(version: str, suite: str, n: int, size: int, method: str, pki: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/callgrind.out"
        subprocess.run(["valgrind", "-q", "--tool=callgrind", "--collect-atstart=no",
                        f"--toggle-collect={C_METHODS[method]}", f"--callgrind-out-file={out}", sys.executable,
                        __file__, "--run", version, suite, str(n), str(size), str(pki)],
                       check=True, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
        totals = [line for line in Path(out).read_text().splitlines() if line.startswith("totals:")]
    return float(totals[-1].split()[1]) / (n + 1)  # the warm-up record counted too


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--size", type=int, default=80, help="plaintext bytes per record")
    p.add_argument("--ctypes", action="store_true", help="TLS 1.3 suites other than the default, set through ctypes")
    p.add_argument("--run", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run:
        version, suite, n, size, pki = a.run
        records(version, suite, int(n), int(size), Path(pki))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        pki = Path(tmp)
        print(f"instructions per {a.size}-byte record ({ssl.OPENSSL_VERSION}); read = open, write = seal")
        for version, suite in CONFIGS:
            if version == "1.3" and suite != "default" and not a.ctypes:
                continue
            r, w = (count(version, suite, a.records, a.size, m, pki) for m in ("read", "write"))
            print(f"  TLS {version} {suite:<32}{r:>8.0f}{w:>8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
