"""Certificates made in the test with ``cryptography``: a CA, a server
certificate for 127.0.0.1 signed by it, client certificates signed by it, and
a self-signed client certificate no CA vouches for."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Pair
    server: Pair
    client: Pair          # signed by the CA, SAN DNS:prometheus
    other_client: Pair    # signed by the CA, SAN DNS:intruder
    stranger: Pair        # self-signed: no CA vouches for it


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return Pair(cert_path, key_path)


def _issue(common_name: str, issuer: x509.Name, issuer_key, *, ca: bool = False, sans=(), usage=None,
           key: ec.EllipticCurvePrivateKey | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = key or ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return cert, key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _issue("mig-exporter test CA", _name("mig-exporter test CA"), None, ca=True)
    server = _issue("127.0.0.1", ca_cert.subject, ca_key,
                    sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
                    usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _issue("prometheus", ca_cert.subject, ca_key, sans=[x509.DNSName("prometheus")],
                    usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other = _issue("intruder", ca_cert.subject, ca_key, sans=[x509.DNSName("intruder")],
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = _issue("stranger", _name("stranger"), stranger_key, sans=[x509.DNSName("prometheus")],
                      usage=ExtendedKeyUsageOID.CLIENT_AUTH, key=stranger_key)
    return Pki(
        ca=_write(directory, "ca", ca_cert, ca_key),
        server=_write(directory, "server", *server),
        client=_write(directory, "client", *client),
        other_client=_write(directory, "intruder", *other),
        stranger=_write(directory, "stranger", *stranger),
    )


def make_server_pair(directory: Path, stem: str, ca: Pair, common_name: str) -> Pair:
    """Another server certificate from the same CA (a rotated one)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), None)
    cert, key = _issue(common_name, ca_cert.subject, ca_key,
                       sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], usage=ExtendedKeyUsageOID.SERVER_AUTH)
    return _write(directory, stem, cert, key)
