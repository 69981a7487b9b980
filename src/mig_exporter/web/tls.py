"""``tls_server_config`` of the web config file: its settings, checked, and the server's SSL context.

The settings are exporter-toolkit's, with Go's names (``crypto/tls``); the tables here turn them
into Python's ``ssl`` (OpenSSL). Where Python cannot do exactly what Go does, the nearest
behaviour that is never less strict is used, and docs/security.md says so.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

from mig_exporter.config.checks import boolean, mapping, show, string, strings, unknown

WHERE = "tls_server_config"
TLS_KEYS = (
    "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
    "client_allowed_sans", "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
    "curve_preferences",
)
_STRING_KEYS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file", "client_auth_type",
                "min_version", "max_version")
# The toolkit turns TLS on when any of these is set; the rest alone do not.
_TURN_TLS_ON = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file", "client_auth_type")

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's client auth policies and what Python's ssl makes of them. Python
# cannot ask for a certificate without verifying it (RequestClientCert,
# RequireAnyClientCert): the first grants nothing in Go either and becomes
# CERT_NONE; the second is enforced strictly, the certificate verified
# against client_ca_file, which it therefore needs.
CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_NONE,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireClientCert": ssl.CERT_REQUIRED,  # the toolkit's old name for RequireAnyClientCert
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_REQUIRES_CERT = ("RequireAnyClientCert", "RequireClientCert", "RequireAndVerifyClientCert")
_REQUIRES_CERT_UNVERIFIED = ("RequireAnyClientCert", "RequireClientCert")

# Go's names (crypto/tls CipherSuites()) for the TLS 1.2 suites, in OpenSSL's.
# The TLS 1.3 suites are accepted and, as in Go, not configurable.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
CURVES = ("CurveP256", "CurveP384", "CurveP521", "X25519")
_SHOWN_PATH_CHARS = 400


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """``tls_server_config``, paths made absolute."""

    cert_file: str | None = None
    key_file: str | None = None
    cert: str | None = None
    key: str | None = None
    client_ca_file: str | None = None
    client_ca: str | None = None
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    curve_preferences: tuple[str, ...] = ()

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)

    def client_allowed(self, peer_cert: dict[str, Any] | None) -> tuple[bool, str]:
        """Whether a verified client certificate carries one of ``client_allowed_sans``."""
        if self.client_allowed_sans is None:
            return True, ""
        sans = [_san_as_go_prints_it(kind_of, value) for kind_of, value in (peer_cert or {}).get("subjectAltName", ())]
        if any(san in self.client_allowed_sans for san in sans):
            return True, ""
        return False, f"client certificate's SANs {sans or 'none'} match none of client_allowed_sans"


def _san_as_go_prints_it(kind_of: str, value: str) -> str:
    """A SAN as Go prints it: IPv6 addresses compressed (``ssl`` writes them in full)."""
    if kind_of == "IP Address":
        try:
            return str(ipaddress.ip_address(value.strip()))
        except ValueError:
            return value
    return value


# --- the settings ----------------------------------------------------------------------------------

def tls_settings(value: Any, base_dir: str, errors: list[str]) -> TlsSettings | None:
    """``tls_server_config`` checked, relative paths taken from ``base_dir``; None when TLS is
    off (or, with the errors, when the settings are wrong)."""
    found = len(errors)
    value = mapping(value, WHERE, "a mapping", errors, TLS_KEYS)
    if value is None:
        return None
    given = {key: string(value.get(key), f"{WHERE}.{key}", errors) for key in _STRING_KEYS}
    if not any(given[key] for key in _TURN_TLS_ON):
        return None
    _check_cert_and_key(given, errors)
    auth_type, sans = _client_auth(given, value.get("client_allowed_sans"), errors)
    min_version, max_version = _versions(given, errors)
    ciphers = _cipher_suites(value.get("cipher_suites"), errors)
    curves = _curves(value.get("curve_preferences"), errors)
    prefer = boolean(value.get("prefer_server_cipher_suites", True), f"{WHERE}.prefer_server_cipher_suites", errors)
    if len(errors) > found:
        return None

    def absolute(path: str | None) -> str | None:
        return os.path.join(base_dir, path) if path else None

    return TlsSettings(
        cert_file=absolute(given["cert_file"]), key_file=absolute(given["key_file"]),
        cert=given["cert"], key=given["key"],
        client_ca_file=absolute(given["client_ca_file"]), client_ca=given["client_ca"], client_auth_type=auth_type,
        client_allowed_sans=sans, min_version=min_version, max_version=max_version,
        cipher_suites=ciphers, prefer_server_cipher_suites=bool(prefer), curve_preferences=curves,
    )


def _check_cert_and_key(given: dict[str, str | None], errors: list[str]) -> None:
    """Each of cert, key and client_ca given once, inline or as a file; cert and key given."""
    for name in ("cert", "key", "client_ca"):
        if given[name] and given[f"{name}_file"]:
            errors.append(f"{WHERE}: give {name} or {name}_file, not both")
    for name in ("cert", "key"):
        if not given[name] and not given[f"{name}_file"]:
            errors.append(f"{WHERE}: missing one of {name} or {name}_file")


def _client_auth(given: dict[str, str | None], allowed_sans: object,
                 errors: list[str]) -> tuple[str, tuple[str, ...] | None]:
    """``client_auth_type`` (default NoClientCert) and ``client_allowed_sans``, checked against
    each other and against the client CA."""
    auth_type = given["client_auth_type"] or "NoClientCert"
    if auth_type not in CLIENT_AUTH_TYPES:
        errors.append(unknown(f"{WHERE}.client_auth_type", f"value {show(auth_type)}", CLIENT_AUTH_TYPES))
    has_ca = bool(given["client_ca"] or given["client_ca_file"])
    if has_ca and auth_type == "NoClientCert":
        ca_key = "client_ca" if given["client_ca"] else "client_ca_file"
        errors.append(f"{WHERE}.{ca_key}: set, but client_auth_type is NoClientCert, so no client "
                      "certificate would be checked; set client_auth_type: RequireAndVerifyClientCert")
    if auth_type in _REQUIRES_CERT_UNVERIFIED and not has_ca:
        errors.append(f"{WHERE}.client_auth_type: {auth_type} needs client_ca_file here: Python's ssl cannot "
                      "require a client certificate without verifying it (use RequireAndVerifyClientCert with "
                      "client_ca_file)")
    sans = strings(allowed_sans, f"{WHERE}.client_allowed_sans", errors)
    if sans is not None and auth_type not in _REQUIRES_CERT:
        errors.append(f"{WHERE}.client_allowed_sans: needs client_auth_type RequireAnyClientCert or "
                      "RequireAndVerifyClientCert (with any other, a client may send no certificate)")
    return auth_type, None if sans is None else tuple(sans.values())


def _versions(given: dict[str, str | None], errors: list[str]) -> tuple[str, str]:
    """``min_version`` (default TLS12) and ``max_version`` (default TLS13), in order."""
    min_version, max_version = given["min_version"] or "TLS12", given["max_version"] or "TLS13"
    for key, name in (("min_version", min_version), ("max_version", max_version)):
        if name not in TLS_VERSIONS:
            errors.append(unknown(f"{WHERE}.{key}", f"value {show(name)}", TLS_VERSIONS))
    if min_version in TLS_VERSIONS and max_version in TLS_VERSIONS and \
            TLS_VERSIONS[min_version] > TLS_VERSIONS[max_version]:
        errors.append(f"{WHERE}: min_version {min_version} is above max_version {max_version}")
    return min_version, max_version


def _cipher_suites(value: object, errors: list[str]) -> tuple[str, ...]:
    names = strings(value, f"{WHERE}.cipher_suites", errors) or {}
    for path, name in names.items():
        if name not in CIPHER_SUITES:
            errors.append(f"{path}: unknown cipher suite {show(name)} (Go's names, e.g. "
                          "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
    return tuple(names.values())


def _curves(value: object, errors: list[str]) -> tuple[str, ...]:
    names = strings(value, f"{WHERE}.curve_preferences", errors) or {}
    errors.extend(unknown(path, f"curve {show(name)}", CURVES) for path, name in names.items() if name not in CURVES)
    return tuple(names.values())


# --- the context -----------------------------------------------------------------------------------

def ssl_context(tls: TlsSettings, errors: list[str]) -> ssl.SSLContext | None:
    """The server context; every file is read now, so a bad one is reported at start."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _set_versions_and_ciphers(context, tls, errors)
    found = len(errors)
    with tempfile.TemporaryDirectory(prefix="mig-exporter-tls-") as inline_dir:
        cert = _pem_file(tls.cert_file, tls.cert, "cert", inline_dir, errors)
        key = _pem_file(tls.key_file, tls.key, "key", inline_dir, errors)
        ca = _pem_file(tls.client_ca_file, tls.client_ca, "client_ca", inline_dir, errors)
        if len(errors) > found:
            return None
        assert cert is not None and key is not None
        _load_cert_and_key(context, cert, key, errors)
        ca_key = "client_ca" if tls.client_ca else "client_ca_file"
        _set_client_verification(context, tls.client_auth_type, ca, ca_key, errors)
    return None if len(errors) > found else context


def _set_versions_and_ciphers(context: ssl.SSLContext, tls: TlsSettings, errors: list[str]) -> None:
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    openssl_ciphers = [openssl for name in tls.cipher_suites if (openssl := CIPHER_SUITES[name])]
    if openssl_ciphers:
        try:
            context.set_ciphers(":".join(openssl_ciphers))
        except ssl.SSLError:
            errors.append(f"{WHERE}.cipher_suites: none of them is available in this Python's OpenSSL")


def _pem_file(path: str | None, inline: str | None, name: str, inline_dir: str, errors: list[str]) -> str | None:
    """The file to load ``name`` from: its ``name_file``, or the inline PEM written to ``inline_dir``
    (``ssl`` loads only files); None when neither is given, or the file is missing (an error)."""
    if path is not None:
        if not os.path.isfile(path):
            errors.append(f"{WHERE}.{name}_file: no such file: {show(path, _SHOWN_PATH_CHARS)}")
            return None
        return path
    if inline is None:
        return None
    written = os.path.join(inline_dir, name)
    fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(inline)
    return written


def _load_cert_and_key(context: ssl.SSLContext, cert: str, key: str, errors: list[str]) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError, ValueError) as e:
        errors.append(f"{WHERE}: cannot load the certificate and key ({_ssl_reason(e)}); are they PEM files, "
                      "and is the key the certificate's?")


def _set_client_verification(context: ssl.SSLContext, auth_type: str, ca: str | None, ca_key: str,
                             errors: list[str]) -> None:
    context.verify_mode = CLIENT_AUTH_TYPES[auth_type]
    if context.verify_mode == ssl.CERT_NONE:
        return
    if ca is None:
        context.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # as Go: the system's roots
        return
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError, ValueError) as e:
        errors.append(f"{WHERE}.{ca_key}: cannot load ({_ssl_reason(e)}); is it a PEM file of "
                      "CA certificates?")


def _ssl_reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
    return " ".join(str(reason).split())[:200]
