"""The web config file (``--web.config.file``): TLS and basic auth, in the
format of Prometheus' exporter-toolkit, so the file a node_exporter already
uses works here unchanged::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt; htpasswd -nBC 10 "" | tr -d ':\\n'

Loading checks the whole file, certificates and keys included, and reports
every error at once (``WebConfigError.errors``). Every setting the toolkit
accepts is accepted; where Python's ``ssl`` cannot do exactly what Go's
``crypto/tls`` does, the nearest safe behaviour is used and docs/security.md
says so. The YAML itself is read as the config file's is (``config._Loader``):
at most 1 MiB, no anchors or aliases, at most 32 levels deep. ``WebSettings``
re-reads the file and the certificates when they change (a rotated
certificate is served from the next connection on).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import re
import secrets
import ssl
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import bcrypt
import yaml

from mig_exporter.config.file import (
    _kind,
    _one_line,
    _parse_yaml,
    _read_file,
    _show,
    _yaml_error,
    parse_duration,
)
from mig_exporter.core.logs import shown

log = logging.getLogger("mig_exporter.web")

_TOP_LEVEL_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_TLS_KEYS = (
    "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
    "client_allowed_sans", "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
    "curve_preferences",
)
_HTTP_KEYS = ("http2", "headers")
_RATE_LIMIT_KEYS = ("interval", "burst")

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

# The headers the toolkit lets a file set, with the values it allows (None: any).
HEADERS: Mapping[str, tuple[str, ...] | None] = MappingProxyType({
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
})

_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
_BCRYPT_MAX_PASSWORD = 72  # bcrypt reads no further; Go's and OpenBSD's compare the same prefix
AUTH_CACHE_SIZE = 100  # verified (user, password) pairs; only a verified pair can push one out
AUTH_FAILED_CACHE_SIZE = 100  # wrong pairs, so a scraper with a stale secret costs one check
AUTH_BCRYPT_SLOTS = 1  # bcrypt checks at once: a flood of guesses costs one core
AUTH_PEERS_TRACKED = 4096  # peers whose failed checks are counted for the fair queue
_BCRYPT_ALPHABET = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_RELOAD_CHECK_S = 1.0
BCRYPT_HINT = "make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n'"


class WebConfigError(Exception):
    """The web config cannot be used; ``errors`` has one line per problem."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = tuple(errors)
        super().__init__("; ".join(f"{source}: {e}" for e in self.errors))


# --- basic auth ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AuthResult:
    ok: bool
    reason: str  # for the log: who, and why not


class BasicAuth:
    """Checks ``Authorization: Basic`` headers against bcrypt hashes.

    bcrypt costs about 70 ms at cost 10; a scrape every 15 s must not pay it
    each time, and a flood of guesses must not make it pay again:

    - Only verified pairs are cached (bounded, least recently used out first),
      under the user and an HMAC of the password, keyed with a secret made at
      start, so the cache holds no password. A wrong password goes to a
      cache of its own, so guesses can never push a verified pair out.
    - A cache hit takes no lock that a bcrypt check holds.
    - The same pair presented at once by several requests is checked once.
    - At most ``bcrypt_slots`` checks run at once (one core for a flood).
      When they are busy, the next free slot goes to the waiting peer (a
      host; an IPv6 /64) with the fewest failed checks, so a peer sending
      guesses queues behind its own guesses, and a peer that has not failed
      waits only for the checks already running.
    - Every check does the same work whoever is named: one bcrypt check at
      each cost among the configured users, the user's own hash at its cost
      and a decoy at the others (an unknown user: decoys at all), so the
      time taken does not tell which users exist or what their cost is.
    """

    def __init__(
        self,
        users: Mapping[str, bytes],
        *,
        cache_size: int = AUTH_CACHE_SIZE,
        failed_cache_size: int = AUTH_FAILED_CACHE_SIZE,
        bcrypt_slots: int = AUTH_BCRYPT_SLOTS,
        peers_tracked: int = AUTH_PEERS_TRACKED,
        verify: Callable[[bytes, bytes], bool] = bcrypt.checkpw,
    ) -> None:
        self._users = {name.encode("utf-8"): hashed for name, hashed in users.items()}
        self._verify = verify
        self._key = os.urandom(32)
        self._lock = threading.Lock()  # the caches and the checks in flight; never held during bcrypt
        self._verified = _Lru(cache_size)
        self._failed = _Lru(failed_cache_size)
        self._flights: dict[tuple[bytes, bytes], _Flight] = {}
        self._gate = _FairGate(bcrypt_slots, peers_tracked)
        # One decoy per cost: a random salt and digest, so no hashing at load (a reload holds up no
        # connection); checkpw hashes at the decoy's cost and never matches.
        self._decoys = {cost: _decoy(cost) for cost in sorted({_bcrypt_cost(h) for h in self._users.values()})}
        if not self._decoys:
            self._decoys = {4: _decoy(4)}

    def check(self, header: str | None, peer: object = None) -> AuthResult:
        """``peer``: the client's address (a socket address or a host), for the fair queue."""
        parsed = _basic_credentials(header)
        if isinstance(parsed, AuthResult):
            return parsed
        user, password = parsed
        who = _shown(user.decode("utf-8", errors="replace"))
        known = user in self._users
        if self._outcome(self._key_of(user, password), password, peer):
            return AuthResult(True, f"user {who}")
        return AuthResult(False, f"wrong password for user {who}" if known else f"unknown user {who}")

    def needs_check(self, header: str | None) -> bool:
        """Whether ``check(header)`` would run bcrypt: well-formed Basic credentials that are
        in neither cache. The server routes those to a pool of their own."""
        parsed = _basic_credentials(header)
        if isinstance(parsed, AuthResult):
            return False
        key = self._key_of(*parsed)
        with self._lock:
            return not (self._verified.peek(key) or self._failed.peek(key))

    def failures_of(self, peer: object) -> int:
        """Failed checks counted against ``peer``'s group: who waits least for a check."""
        return self._gate.failures(_peer_group(peer))

    def _key_of(self, user: bytes, password: bytes) -> tuple[bytes, bytes]:
        return user, hmac.new(self._key, password, hashlib.sha256).digest()

    def _outcome(self, key: tuple[bytes, bytes], password: bytes, peer: object) -> bool:
        with self._lock:
            if self._verified.get(key):
                return True
            if self._failed.get(key):
                return False
            flight = self._flights.get(key)
            leading = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leading:  # the same pair is being checked: its outcome, without a second check
            flight.done.wait()
            return flight.ok
        group = _peer_group(peer)
        ok = False
        try:
            self._gate.acquire(group)
            try:
                ok = self._bcrypt(key[0], password)
            finally:
                self._gate.release(group, failed=not ok)
            with self._lock:
                (self._verified if ok else self._failed).put(key)
            flight.ok = ok
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
        return ok

    def _bcrypt(self, user: bytes, password: bytes) -> bool:
        """The same checks for everyone: one at each configured cost, in the same order."""
        hashed = self._users.get(user)
        own = _bcrypt_cost(hashed) if hashed is not None else None
        ok = False
        for cost, decoy in self._decoys.items():
            if cost == own:
                assert hashed is not None
                ok = self._checkpw(password, hashed)
            else:
                self._checkpw(password, decoy)
        return ok

    def _checkpw(self, password: bytes, hashed: bytes) -> bool:
        try:
            return self._verify(password[:_BCRYPT_MAX_PASSWORD], hashed)
        except ValueError:
            return False


def _basic_credentials(header: str | None) -> tuple[bytes, bytes] | AuthResult:
    """(user, password) of an ``Authorization: Basic`` header, or the failure it is."""
    if not header:
        return AuthResult(False, "no credentials")
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return AuthResult(False, f"{_shown(scheme)} credentials, not Basic")
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return AuthResult(False, "Basic credentials that are not valid base64")
    user, colon, password = decoded.partition(b":")
    if not colon:
        return AuthResult(False, "Basic credentials without a ':' between user and password")
    return user, password


@dataclass(slots=True)
class _Flight:
    """A check in progress; requests for the same pair wait for its outcome."""

    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class _Lru:
    """A bounded set, least recently used out first. Not locked: ``BasicAuth._lock`` guards it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()

    def get(self, key: tuple[bytes, bytes]) -> bool:
        if key not in self._items:
            return False
        self._items.move_to_end(key)
        return True

    def peek(self, key: tuple[bytes, bytes]) -> bool:
        """Whether ``key`` is held, without making it recent."""
        return key in self._items

    def put(self, key: tuple[bytes, bytes]) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(list(self._items))


class _FairGate:
    """At most ``slots`` holders at once. A released slot goes straight to the
    waiting peer with the fewest failures on record (ties: the one waiting
    longest), so a peer's failures queue it behind everyone else's first
    tries. Failures are kept for ``peers_tracked`` peers, the least recently
    failing forgotten first; a success clears a peer's record."""

    def __init__(self, slots: int, peers_tracked: int) -> None:
        self._lock = threading.Lock()
        self._free = max(1, slots)
        self._waiting: dict[str, deque[tuple[int, threading.Event]]] = {}
        self._failures: OrderedDict[str, int] = OrderedDict()
        self._peers_tracked = peers_tracked
        self._tickets = itertools.count()

    def acquire(self, peer: str) -> None:
        with self._lock:
            if self._free > 0:  # then no one waits: a release hands its slot straight over
                self._free -= 1
                return
            ticket = threading.Event()
            self._waiting.setdefault(peer, deque()).append((next(self._tickets), ticket))
        ticket.wait()

    def release(self, peer: str, *, failed: bool) -> None:
        with self._lock:
            if failed:
                self._failures[peer] = self._failures.get(peer, 0) + 1
                self._failures.move_to_end(peer)
                while len(self._failures) > self._peers_tracked:
                    self._failures.popitem(last=False)
            else:
                self._failures.pop(peer, None)
            if not self._waiting:
                self._free += 1
                return
            chosen = min(self._waiting, key=lambda p: (self._failures.get(p, 0), self._waiting[p][0][0]))
            queue = self._waiting[chosen]
            _, ticket = queue.popleft()
            if not queue:
                del self._waiting[chosen]
            ticket.set()

    def waiting(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._waiting.values())

    def failures(self, peer: str) -> int:
        with self._lock:
            return self._failures.get(peer, 0)


def _peer_group(peer: object) -> str:
    """Whom a request counts against: its host, an IPv4-mapped address as IPv4, IPv6 by /64 (one
    machine has a whole /64 to send from)."""
    host = peer[0] if isinstance(peer, tuple) and peer else peer
    if host is None:
        return ""
    text = str(host)
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _bcrypt_cost(hashed: bytes) -> int:
    return int(hashed[4:6])


def _decoy(cost: int) -> bytes:
    """A well-formed bcrypt hash of the given cost that no password matches."""
    digest = "".join(secrets.choice(_BCRYPT_ALPHABET) for _ in range(31))
    return bcrypt.gensalt(rounds=cost) + digest.encode("ascii")


# --- rate limit -----------------------------------------------------------------------------------

class TokenBucket:
    """``rate_limit``: one request per ``interval_s``, bursts of ``burst``."""

    def __init__(self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.interval_s)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


# --- the file -------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class WebConfig:
    """A loaded web config, ready to serve with."""

    source: str
    tls: TlsSettings | None = None
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False)
    auth: BasicAuth | None = field(default=None, compare=False)
    users: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    rate_limiter: TokenBucket | None = field(default=None, compare=False)
    http2: bool = True

    def summary(self) -> str:
        """``TLS (TLS12+, client certificates: RequireAndVerifyClientCert); basic auth: 2 users``."""
        parts = []
        if self.tls is None:
            parts.append("no TLS")
        else:
            parts.append(f"TLS ({self.tls.min_version}+, client certificates: {self.tls.client_auth_type})")
        parts.append(f"basic auth: {len(self.users)} user{'' if len(self.users) == 1 else 's'}" if self.users
                     else "no basic auth")
        if self.rate_limiter is not None:
            parts.append(f"rate limit: 1 per {self.rate_limiter.interval_s:g}s, burst {self.rate_limiter.burst}")
        return "; ".join(parts)

    def client_allowed(self, peer_cert: dict[str, Any] | None) -> tuple[bool, str]:
        """Whether a verified client certificate carries one of ``client_allowed_sans``."""
        allowed = self.tls.client_allowed_sans if self.tls else None
        if allowed is None:
            return True, ""
        sans = [_san_value(kind, value) for kind, value in (peer_cert or {}).get("subjectAltName", ())]
        if any(san in allowed for san in sans):
            return True, ""
        return False, f"client certificate's SANs {sans or 'none'} match none of client_allowed_sans"


def _san_value(kind: str, value: str) -> str:
    """A SAN as Go prints it: IPv6 addresses compressed (``ssl`` writes them in full)."""
    if kind == "IP Address":
        try:
            return str(ipaddress.ip_address(value.strip()))
        except ValueError:
            return value
    return value


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and check the file, certificates and keys included; raises
    ``WebConfigError`` with every problem."""
    source = str(path)
    try:
        text = _read_file(path)
    except ValueError as e:
        raise WebConfigError(source, [str(e)]) from None
    return parse_web_config(text, source, base_dir=os.path.dirname(os.path.abspath(source)))


def parse_web_config(text: str | bytes, source: str = "<web config>", base_dir: str = ".") -> WebConfig:
    try:
        document, errors = _parse_yaml(text)
    except yaml.YAMLError as e:
        raise WebConfigError(source, [_yaml_error(e)]) from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise WebConfigError(source, [*errors, f"the file must be a mapping, not {_kind(document)}"])
    _unknown_keys(document, _TOP_LEVEL_KEYS, "", errors)
    tls = _tls_settings(document.get("tls_server_config"), base_dir, errors)
    users = _users(document.get("basic_auth_users"), errors)
    http2, headers = _http_config(document.get("http_server_config"), errors)
    rate_limiter = _rate_limit(document.get("rate_limit"), errors)
    context = None
    if tls is not None and not errors:
        context = _ssl_context(tls, errors)
    if errors:
        raise WebConfigError(source, errors)
    auth = BasicAuth(users) if users else None
    return WebConfig(source, tls, context, auth, tuple(sorted(users)), MappingProxyType(headers), rate_limiter, http2)


def _unknown_keys(body: Mapping[Any, Any], known: tuple[str, ...], where: str, errors: list[str]) -> None:
    for key in body:
        if key not in known:
            errors.append(f"{where}{_show(key)}: unknown setting (known: {', '.join(known)})")


def _string(body: Mapping[str, Any], key: str, where: str, errors: list[str]) -> str | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        errors.append(f"{where}.{key}: must be a string, not {_kind(value)}")
        return None
    return value


def _strings(body: Mapping[str, Any], key: str, where: str, errors: list[str]) -> tuple[str, ...] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        errors.append(f"{where}.{key}: must be a list of strings, not {_kind(value)}")
        return None
    return tuple(value)


def _tls_settings(value: Any, base_dir: str, errors: list[str]) -> TlsSettings | None:
    where = "tls_server_config"
    if value is None:
        return None
    if not isinstance(value, dict):
        errors.append(f"{where}: must be a mapping, not {_kind(value)}")
        return None
    found = len(errors)
    _unknown_keys(value, _TLS_KEYS, f"{where}.", errors)
    s = {key: _string(value, key, where, errors) for key in (
        "cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file", "client_auth_type",
        "min_version", "max_version")}
    # The toolkit turns TLS on when any of these is set; the rest alone do not.
    if not any(s[k] for k in ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file",
                              "client_auth_type")):
        return None
    for name in ("cert", "key", "client_ca"):
        if s[name] and s[f"{name}_file"]:
            errors.append(f"{where}: give {name} or {name}_file, not both")
    if not s["cert"] and not s["cert_file"]:
        errors.append(f"{where}: missing one of cert or cert_file")
    if not s["key"] and not s["key_file"]:
        errors.append(f"{where}: missing one of key or key_file")
    auth_type = s["client_auth_type"] or "NoClientCert"
    if auth_type not in CLIENT_AUTH_TYPES:
        errors.append(f"{where}.client_auth_type: {_show(auth_type)} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    has_ca = bool(s["client_ca"] or s["client_ca_file"])
    if has_ca and auth_type == "NoClientCert":
        errors.append(f"{where}: client_ca_file is set but client_auth_type is NoClientCert, so no client "
                      "certificate would be checked; set client_auth_type: RequireAndVerifyClientCert")
    if auth_type in ("RequireAnyClientCert", "RequireClientCert") and not has_ca:
        errors.append(f"{where}.client_auth_type: {auth_type} needs client_ca_file here: Python's ssl cannot "
                      "require a client certificate without verifying it (use RequireAndVerifyClientCert with "
                      "client_ca_file)")
    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = s[key] or default
        if name not in TLS_VERSIONS:
            errors.append(f"{where}.{key}: {_show(name)} is not one of {', '.join(TLS_VERSIONS)}")
        versions[key] = name
    if all(v in TLS_VERSIONS for v in versions.values()) and \
            TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        errors.append(f"{where}: min_version {versions['min_version']} is above max_version {versions['max_version']}")
    ciphers = _strings(value, "cipher_suites", where, errors) or ()
    for name in ciphers:
        if name not in CIPHER_SUITES:
            errors.append(f"{where}.cipher_suites: unknown cipher suite {_show(name)} (Go's names, e.g. "
                          "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
    curves = _strings(value, "curve_preferences", where, errors) or ()
    for name in curves:
        if name not in CURVES:
            errors.append(f"{where}.curve_preferences: unknown curve {_show(name)} (one of {', '.join(CURVES)})")
    sans = _strings(value, "client_allowed_sans", where, errors)
    if sans is not None and auth_type not in _REQUIRES_CERT:
        errors.append(f"{where}.client_allowed_sans: needs client_auth_type RequireAnyClientCert or "
                      "RequireAndVerifyClientCert (with any other, a client may send no certificate)")
    prefer = value.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        errors.append(f"{where}.prefer_server_cipher_suites: must be true or false, not {_kind(prefer)}")
    if len(errors) > found:
        return None

    def absolute(path: str | None) -> str | None:
        return os.path.join(base_dir, path) if path else None

    return TlsSettings(
        cert_file=absolute(s["cert_file"]), key_file=absolute(s["key_file"]), cert=s["cert"], key=s["key"],
        client_ca_file=absolute(s["client_ca_file"]), client_ca=s["client_ca"], client_auth_type=auth_type,
        client_allowed_sans=sans, min_version=versions["min_version"], max_version=versions["max_version"],
        cipher_suites=ciphers, prefer_server_cipher_suites=bool(prefer), curve_preferences=curves,
    )


def _users(value: Any, errors: list[str]) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.append(f"basic_auth_users: must be a mapping of user names to bcrypt hashes, not {_kind(value)}")
        return {}
    users = {}
    for name, hashed in value.items():
        where = f"basic_auth_users.{_show(name)}"
        if not isinstance(name, str):
            errors.append(f"{where}: the user name is {_kind(name)}; quote it to make it a string")
        elif not isinstance(hashed, str) or not _BCRYPT_HASH.fullmatch(hashed):
            errors.append(f"{where}: not a bcrypt hash ($2y$, $2b$ or $2a$ and 56 more characters; {BCRYPT_HINT})")
        elif not 4 <= int(hashed[4:6]) <= 31:
            errors.append(f"{where}: bcrypt cost {int(hashed[4:6])} is out of range (4 to 31)")
        else:
            users[name] = hashed.encode("ascii")
    return users


def _http_config(value: Any, errors: list[str]) -> tuple[bool, dict[str, str]]:
    where = "http_server_config"
    if value is None:
        return True, {}
    if not isinstance(value, dict):
        errors.append(f"{where}: must be a mapping, not {_kind(value)}")
        return True, {}
    _unknown_keys(value, _HTTP_KEYS, f"{where}.", errors)
    http2 = value.get("http2", True)
    if not isinstance(http2, bool):
        errors.append(f"{where}.http2: must be true or false, not {_kind(http2)}")
    headers: dict[str, str] = {}
    raw = value.get("headers") or {}
    if not isinstance(raw, dict):
        errors.append(f"{where}.headers: must be a mapping of header names to values, not {_kind(raw)}")
        return bool(http2), {}
    for name, header_value in raw.items():
        allowed = HEADERS.get(name, ()) if isinstance(name, str) else ()
        if isinstance(name, str) and name not in HEADERS:
            errors.append(f"{where}.headers.{_show(name)}: this header cannot be set (one of {', '.join(HEADERS)})")
        elif not isinstance(header_value, str) or any(c in header_value for c in "\r\n"):
            errors.append(f"{where}.headers.{_show(name)}: must be a one-line string")
        elif allowed is not None and header_value not in allowed:
            errors.append(f"{where}.headers.{name}: {_show(header_value)} is not one of {', '.join(allowed)}")
        elif header_value:
            headers[name] = header_value
    return bool(http2), headers


def _rate_limit(value: Any, errors: list[str]) -> TokenBucket | None:
    where = "rate_limit"
    if value is None:
        return None
    if not isinstance(value, dict):
        errors.append(f"{where}: must be a mapping with interval and burst, not {_kind(value)}")
        return None
    found = len(errors)
    _unknown_keys(value, _RATE_LIMIT_KEYS, f"{where}.", errors)
    interval = value.get("interval", "0s")
    seconds = 0.0
    if isinstance(interval, int) and not isinstance(interval, bool) and interval == 0:
        seconds = 0.0
    elif not isinstance(interval, str):
        errors.append(f"{where}.interval: must be a duration such as 1s or 500ms, not {_kind(interval)}")
    elif interval.strip() not in ("0", "0s"):
        try:
            seconds = parse_duration(interval.strip())
        except ValueError as e:
            errors.append(f"{where}.interval: {e}")
    burst = value.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        errors.append(f"{where}.burst: must be a whole number, not {_kind(burst)}")
    elif seconds > 0 and burst < 1:
        errors.append(f"{where}.burst: must be at least 1 when interval is set (0 would refuse every request)")
    if len(errors) > found or seconds <= 0:
        return None
    return TokenBucket(seconds, burst)


def _ssl_context(tls: TlsSettings, errors: list[str]) -> ssl.SSLContext | None:
    """The server context; every file is read now, so a bad one is reported at start."""
    where = "tls_server_config"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[tls.min_version]
    context.maximum_version = TLS_VERSIONS[tls.max_version]
    if tls.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    openssl_ciphers = [openssl for name in tls.cipher_suites if (openssl := CIPHER_SUITES[name])]
    if openssl_ciphers:
        try:
            context.set_ciphers(":".join(openssl_ciphers))
        except ssl.SSLError:
            errors.append(f"{where}.cipher_suites: none of them is available in this Python's OpenSSL")
    found = len(errors)
    with tempfile.TemporaryDirectory(prefix="mig-exporter-tls-") as inline_dir:
        def file_for(path: str | None, inline: str | None, name: str) -> str | None:
            if path is not None:
                if not os.path.isfile(path):
                    errors.append(f"{where}.{name}_file: {path}: no such file")
                    return None
                return path
            if inline is None:
                return None
            written = os.path.join(inline_dir, name)
            fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(inline)
            return written

        cert = file_for(tls.cert_file, tls.cert, "cert")
        key = file_for(tls.key_file, tls.key, "key")
        ca = file_for(tls.client_ca_file, tls.client_ca, "client_ca")
        if len(errors) > found:
            return None
        assert cert is not None and key is not None
        try:
            context.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError, ValueError) as e:
            errors.append(f"{where}: cannot load the certificate and key ({_ssl_reason(e)}); are they PEM files, "
                          "and is the key the certificate's?")
        context.verify_mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
        if context.verify_mode != ssl.CERT_NONE:
            if ca is not None:
                try:
                    context.load_verify_locations(cafile=ca)
                except (ssl.SSLError, OSError, ValueError) as e:
                    errors.append(f"{where}: cannot load client_ca_file ({_ssl_reason(e)}); is it a PEM file of "
                                  "CA certificates?")
            else:
                context.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # as Go: the system's roots
    return None if len(errors) > found else context


def _ssl_reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
    return " ".join(str(reason).split())[:200]


def _shown(text: str) -> str:
    return shown(text, 66)


# --- watching the file --------------------------------------------------------------------------

class WebSettings:
    """The web config in force, re-read when the file or its certificates change.

    Checked at most once a second, on a connection; a changed file that does
    not load is logged once and the config in force is kept. Switching TLS on
    or off needs a restart (the listener was started with or without it).
    """

    def __init__(self, path: str, check_interval_s: float = _RELOAD_CHECK_S) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._config = load_web_config(path)
        self._stamp = self._stamp_of(self._config)
        self._checked_at = time.monotonic()
        self._failed_stamp: tuple[Any, ...] | None = None

    @property
    def config(self) -> WebConfig:
        with self._lock:
            return self._config

    def current(self) -> WebConfig:
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < self.check_interval_s:
                return self._config
            self._checked_at = now
            stamp = self._stamp_of(self._config)
            if stamp == self._stamp or stamp == self._failed_stamp:
                return self._config
            try:
                config = load_web_config(self.path)
                if (config.tls is None) != (self._config.tls is None):
                    raise WebConfigError(self.path, ["TLS cannot be switched on or off without a restart"])
            except WebConfigError as e:
                self._failed_stamp = stamp
                log.error("reloading %s failed; kept the web config in force: %s", self.path, "; ".join(e.errors))
                return self._config
            except Exception as e:  # a bug: the server keeps the config in force, and the log says so once
                self._failed_stamp = stamp
                log.error("reloading %s failed; kept the web config in force: unexpected error: %s", self.path,
                          _one_line(e))
                log.debug("reloading %s failed", self.path, exc_info=True)
                return self._config
            self._config = config
            self._stamp = self._stamp_of(config)
            self._failed_stamp = None
            log.info("reloaded %s: %s", self.path, config.summary())
            return config

    def _stamp_of(self, config: WebConfig) -> tuple[Any, ...]:
        files = (self.path, *(config.tls.files() if config.tls else ()))
        return tuple(_file_stamp(f) for f in files)


def _file_stamp(path: str) -> tuple[Any, ...]:
    try:
        st = os.stat(path)
    except OSError as e:
        return (path, e.errno)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns)
