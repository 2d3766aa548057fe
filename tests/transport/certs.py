"""Test certificates made on the spot with ``cryptography``: a CA, and leaves it signs for gateways
(extendedKeyUsage clientAuth) and workers (serverAuth), written as PEM files."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Leaf", "TestCA", "write_psk"]

_DAY = datetime.timedelta(days=1)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


@dataclass(frozen=True)
class Leaf:
    cert: str
    key: str
    ca: str  # the CA file of the CA that signed it (what its holder trusts)

    def worker_flags(self) -> list[str]:
        return [f"--transport-tls-cert={self.cert}", f"--transport-tls-key={self.key}",
                f"--transport-tls-ca={self.ca}"]

    def settings(self) -> dict[str, str]:
        return {"transport_tls_cert": self.cert, "transport_tls_key": self.key, "transport_tls_ca": self.ca}


class TestCA:
    """A CA in ``directory``; :meth:`issue` writes a leaf certificate and key beside it."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "quicserve transport CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                    critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_file = self.dir / "ca.crt"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, role: str) -> Leaf:
        """A leaf for ``role`` "gateway" (clientAuth), "worker" (serverAuth) or "both" (a gateway whose
        local workers read the same [workers] files)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
        usage = usage[:1] if role == "gateway" else usage[1:] if role == "worker" else usage
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
                .sign(self.key, hashes.SHA256()))
        cert_file, key_file = self.dir / f"{cn}.crt", self.dir / f"{cn}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_file)
        return Leaf(str(cert_file), str(key_file), str(self.ca_file))


def write_psk(path: Path, key: str = "0123456789abcdef0123456789abcdef") -> str:
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)
