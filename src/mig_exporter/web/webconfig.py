"""The web config file (``--web.config.file``): TLS, basic auth, HTTP headers and a rate limit,
in the format of Prometheus' exporter-toolkit, so the file a node_exporter already uses works
here unchanged::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt; htpasswd -nBC 10 "" | tr -d ':\\n'

Loading checks the whole file, certificates and keys included, and reports every error at
once (``ConfigError.errors``). Every setting the toolkit accepts is accepted; where Python's
``ssl`` cannot do exactly what Go's ``crypto/tls`` does, the nearest safe behaviour is used and
docs/security.md says so. The YAML is read and checked as the config file's is
(``config.checks``): at most 1 MiB, no anchors or aliases, at most 32 levels deep. Each section
is checked beside what uses it (``tls.py``, ``basic_auth.py``, ``rate_limit.py``);
``WebSettings`` re-reads the file and the certificates when they change (a rotated certificate
is served from the connections after the next check on, within about a second).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mig_exporter.config.checks import (
    EMPTY_FILE,
    ConfigError,
    at,
    boolean,
    cut_short,
    mapping,
    one_line,
    parse_yaml,
    read_file,
    show,
    top_level,
    unknown,
)
from mig_exporter.web.basic_auth import BasicAuth, basic_auth_users
from mig_exporter.web.rate_limit import TokenBucket, rate_limit
from mig_exporter.web.reloader import Reloader
from mig_exporter.web.tls import TlsSettings, ssl_context, tls_settings

log = logging.getLogger("mig_exporter.web")

_TOP_LEVEL_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
_HTTP_KEYS = ("http2", "headers")

# The headers the toolkit lets a file set, with the values it allows (None: any).
HEADERS: Mapping[str, tuple[str, ...] | None] = MappingProxyType({
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
})
_RELOAD_CHECK_S = 1.0
# A re-read slower than this is stuck (/-/ready says so). Nobody waits for it: the event loop
# serves the config in force meanwhile.
_RELOAD_DEADLINE_S = 5.0


# --- the file -------------------------------------------------------------------------------------

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
        return (True, "") if self.tls is None else self.tls.client_allowed(peer_cert)


def load_web_config(path: str | os.PathLike[str], *, empty_ok: bool = True) -> WebConfig:
    """Read and check the file, certificates and keys included; raises
    ``ConfigError`` with every problem."""
    source = str(path)
    return parse_web_config(read_file(path), source, base_dir=os.path.dirname(os.path.abspath(source)),
                            empty_ok=empty_ok)


def parse_web_config(text: str | bytes, source: str = "<web config>", base_dir: str = ".", *,
                     empty_ok: bool = True) -> WebConfig:
    """Check a web config's text. A section named with nothing under it is refused as probably
    cut short (a torn ``basic_auth_users:`` would serve without auth); an empty file too,
    unless ``empty_ok`` (at start-up, as the toolkit: a reload that finds one keeps the config
    in force; ``{}`` is no settings by intent)."""
    document, errors = parse_yaml(text, source)
    if document is None and not empty_ok:
        raise ConfigError(source, [EMPTY_FILE])
    errors.extend(cut_short(document, _TOP_LEVEL_KEYS))
    settings = top_level(document, _TOP_LEVEL_KEYS, errors)
    if settings is None:
        raise ConfigError(source, errors)
    tls = tls_settings(settings.get("tls_server_config"), base_dir, errors)
    users = basic_auth_users(settings.get("basic_auth_users"), errors)
    http2, headers = _http_config(settings.get("http_server_config"), errors)
    rate_limiter = rate_limit(settings.get("rate_limit"), errors)
    context = None
    if tls is not None and not errors:
        context = ssl_context(tls, errors)
    if errors:
        raise ConfigError(source, errors)
    auth = BasicAuth(users) if users else None
    return WebConfig(source, tls, context, auth, tuple(sorted(users)), MappingProxyType(headers), rate_limiter, http2)


def _http_config(value: Any, errors: list[str]) -> tuple[bool, dict[str, str]]:
    """``http_server_config``: whether HTTP/2 is on (accepted; this server speaks HTTP/1.1) and
    the headers added to every answer."""
    where = "http_server_config"
    value = mapping(value, where, "a mapping", errors, _HTTP_KEYS)
    if value is None:
        return True, {}
    http2 = boolean(value.get("http2", True), f"{where}.http2", errors)
    return bool(http2), _headers(value.get("headers") or {}, f"{where}.headers", errors)


def _headers(value: object, where: str, errors: list[str]) -> dict[str, str]:
    """The headers a file may set (``HEADERS``), with the values allowed; an empty one is not sent."""
    headers: dict[str, str] = {}
    for name, header_value in (mapping(value, where, "a mapping of header names to values", errors) or {}).items():
        header_at = at(where, name)
        if not isinstance(name, str) or name not in HEADERS:
            errors.append(f"{header_at}: this header cannot be set (known: {', '.join(HEADERS)})")
        elif not isinstance(header_value, str) or any(c in header_value for c in "\r\n"):
            errors.append(f"{header_at}: must be a one-line string")
        elif (allowed := HEADERS[name]) is not None and header_value not in allowed:
            errors.append(unknown(header_at, f"value {show(header_value)}", allowed))
        elif header_value:
            headers[name] = header_value
    return headers


# --- watching the file --------------------------------------------------------------------------

class WebSettings:
    """The web config in force, re-read when the file or its certificates change.

    Checked at most once a second, on a connection. The check (a ``stat`` of each file) and the
    read run in the web config's ``Reloader`` (one thread, which stays while connections come),
    never in the caller: the event loop asks for the config at every connection, and a FIFO or
    a hung mount there once froze the whole server, ``/-/healthy`` included. The loop does not
    wait for the check either: the connection that starts one is served with the config in
    force, and the connections after the check with what it found. A changed file that does
    not load is logged once and the config in force is kept. Switching TLS on or off needs a
    restart (the listener was started with or without it).
    """

    def __init__(self, path: str, check_interval_s: float = _RELOAD_CHECK_S) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._config = load_web_config(path)
        self._stamp = self._stamp_of(self._config)
        self._checked_at = time.monotonic()
        self._failed_stamp: tuple[Any, ...] | None = None
        self._reloader = Reloader(f"web config {path}", self._check, _RELOAD_DEADLINE_S)

    @property
    def config(self) -> WebConfig:
        with self._lock:
            return self._config

    def current(self, wait_s: float = 0.0) -> WebConfig:
        """The config in force, after asking for a check when one is due. The event loop waits
        not at all (``wait_s`` 0); another caller may wait up to ``wait_s`` for the check."""
        with self._lock:
            now = time.monotonic()
            due = now - self._checked_at >= self.check_interval_s
            if due:
                self._checked_at = now
        if due:
            self._reloader.request(wait_s)
        return self.config

    def stuck(self) -> str | None:
        """Why re-reading the web config is stuck past its deadline, or None."""
        return self._reloader.stuck()

    def _check(self) -> bool:
        """In the reloader's thread: load the file again if it or a certificate changed;
        whether the config in force changed."""
        config_in_force = self.config
        stamp = self._stamp_of(config_in_force)
        with self._lock:
            if stamp == self._stamp or stamp == self._failed_stamp:
                return False
        try:
            config = load_web_config(self.path, empty_ok=False)
            if (config.tls is None) != (config_in_force.tls is None):
                raise ConfigError(self.path, ["TLS cannot be switched on or off without a restart"])
        except ConfigError as e:
            with self._lock:
                self._failed_stamp = stamp
            log.error("reloading %s failed; kept the web config in force: %s", self.path, "; ".join(e.errors))
            return False
        except Exception as e:  # a bug: the server keeps the config in force, and the log says so once
            with self._lock:
                self._failed_stamp = stamp
            log.error("reloading %s failed; kept the web config in force: unexpected error: %s", self.path,
                      one_line(e))
            log.debug("reloading %s failed", self.path, exc_info=True)
            return False
        new_stamp = self._stamp_of(config)
        with self._lock:
            self._config = config
            self._stamp = new_stamp
            self._failed_stamp = None
        log.info("reloaded %s: %s", self.path, config.summary())
        return True

    def _stamp_of(self, config: WebConfig) -> tuple[Any, ...]:
        files = (self.path, *(config.tls.files() if config.tls else ()))
        return tuple(_file_stamp(f) for f in files)


def _file_stamp(path: str) -> tuple[Any, ...]:
    try:
        st = os.stat(path)
    except OSError as e:
        return (path, e.errno)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns)
