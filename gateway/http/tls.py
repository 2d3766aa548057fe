"""TLS for the gateway: configured cert/key files, or a self-signed
certificate generated once into the state directory and reused afterwards."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["load_or_create_tls", "make_server_context", "SELF_SIGNED_CERT", "SELF_SIGNED_KEY"]

SELF_SIGNED_CERT = "tls-cert.pem"
SELF_SIGNED_KEY = "tls-key.pem"


def load_or_create_tls(cert: str | None, key: str | None, state_dir: Path) -> tuple[ssl.SSLContext, str]:
    """Server context with ALPN ``h2``, ``http/1.1`` and the certificate's SHA-256
    fingerprint (hex). Without ``cert``/``key``, use or create a self-signed one."""
    if (cert is None) != (key is None):
        raise ValueError("TLS needs both a certificate and a key file (or neither)")
    if cert is None or key is None:
        state_dir = Path(state_dir)
        cert_path, key_path = state_dir / SELF_SIGNED_CERT, state_dir / SELF_SIGNED_KEY
        if not (cert_path.exists() and key_path.exists()):
            _write_self_signed(cert_path, key_path)
    else:
        cert_path, key_path = Path(cert), Path(key)
        for p in (cert_path, key_path):
            if not p.is_file():
                raise FileNotFoundError(f"TLS file not found: {p}")
    ctx = make_server_context(cert_path, key_path)
    return ctx, fingerprint(cert_path)


def make_server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    ctx.load_cert_chain(str(cert_path), str(key_path))
    return ctx


def fingerprint(cert_path: Path) -> str:
    """SHA-256 of the (first) certificate's DER encoding, lower-case hex."""
    pem = cert_path.read_bytes()
    der = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def _write_self_signed(cert_path: Path, key_path: Path) -> None:
    cert_path.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quicserve self-signed")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=825))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # write the key readable by the owner only, and both files atomically
    tmp_key = key_path.with_suffix(".tmp")
    fd = os.open(tmp_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    tmp_cert = cert_path.with_suffix(".tmp")
    tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp_key, key_path)
    os.replace(tmp_cert, cert_path)
