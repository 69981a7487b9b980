"""The client ``mig-exporter fleet`` asks a Prometheus through: instant queries against its HTTP
query API (``POST /api/v1/query``), with basic auth, a bearer token, extra headers (Mimir's
``X-Scope-OrgID``) and a CA file, over the standard library's urllib and json. Anything that
serves that API answers it too: Thanos Query, Mimir, VictoriaMetrics.

Secrets (a basic-auth password, a bearer token, header values) go into the request's headers
and nowhere else. No message names them: a URL is shown with its user information as ``***``,
and text from the server (an error body, a status line, a redirect's ``Location``) has every
secret cut out before it is escaped for a terminal and cut to a length.

A Prometheus that is broken or hostile cannot hold fleet, nor fill its memory: one deadline
covers every query of an exchange (``exchange()``), the name's resolution, each connect (every
address of the name together), TLS handshake, header and body byte included, over http and
https, so a trickling or endless answer stops at it; at most ``ANSWER_LIMIT`` bytes of an answer
are read, and an answer that lists more than ``MAX_SERIES`` series is refused before it is built;
an error body is read to 1 KiB. Redirects are not followed at all (stricter than "only to the same
host": a redirect is where credentials leak).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import socket
import ssl
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, AnyStr

from mig_exporter.core.visible import escaped, visible

# The environment variable a basic-auth password may come from (cli.py names it in --help).
PASSWORD_ENV = "MIG_EXPORTER_PROMETHEUS_BASIC_AUTH_PASSWORD"

_ERROR_BODY_LIMIT = 1024  # what is read of an error's body: its first line is what is shown
# What is read of an answer. Past it the answer is refused unparsed: a 1 GiB body costs no more
# than this. Decoded, an answer holding a character beyond ASCII may take up to 4 bytes a
# character, so such an answer is held to a quarter: the decoded text stays within the limit too.
ANSWER_LIMIT = 64 * 1024 * 1024
_WIDE_ANSWER_LIMIT = ANSWER_LIMIT // 4
# Series one answer may list: a fleet of this many nodes with a free device of one class is past
# what a terminal table is for. An answer listing more is refused before its objects are built
# (its braces are counted first), so 1 000 000 series cost neither memory nor time.
MAX_SERIES = 20_000
# JSON values in one answer, bounded by its commas: an array of 30 million numbers holds no
# object to count, and would cost a pointer each.
_MAX_VALUES = MAX_SERIES * 50
_CHUNK = 256 * 1024
_SHOWN_LIMIT = 200  # characters of outside text in one message
_REDACTED = "<redacted>"
_MIN_SECRET = 4  # shorter values are not cut out: they would blank digits of the message
# Headers the request's framing and auth options own: --prometheus.header may not set them.
_OWN_HEADERS = frozenset({"host", "content-type", "content-length", "transfer-encoding", "connection"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # RFC 3986's scheme, and the authority's "//"


class FleetError(Exception):
    """The Prometheus could not be asked, or answered an error: the message names the URL (its
    user information left out) and why. ``fleet`` exits 3."""


class FleetUsageError(ValueError):
    """The options cannot make a request: a bad URL, header or credential file, or two ways of
    authenticating at once. The message names no secret. ``fleet`` exits 2."""


@dataclass(frozen=True, slots=True)
class Access:
    """How to reach the Prometheus: credentials, extra headers and the CA that signs its
    certificate. Built with ``access()``, which checks each part; ``secrets()`` lists what no
    message may show."""

    # Left out of repr(): an Access in a traceback or a log shows no secret.
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)  # (user, password)
    bearer_token: str | None = field(default=None, repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    ca_file: str | None = None

    def request_headers(self) -> dict[str, str]:
        out = dict(self.headers)
        if self.basic_auth is not None:
            user, password = self.basic_auth
            out["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        elif self.bearer_token is not None:
            out["Authorization"] = f"Bearer {self.bearer_token}"
        return out

    def secrets(self) -> tuple[str, ...]:
        """Every value that must never be shown: the password, the token, the header values,
        and the Authorization header as sent."""
        found = [value for _, value in self.headers]
        if self.basic_auth is not None:
            found.append(self.basic_auth[1])
        if self.bearer_token is not None:
            found.append(self.bearer_token)
        found += [value.split(" ", 1)[1] for name, value in self.request_headers().items()
                  if name == "Authorization" and " " in value]
        return tuple(s for s in found if s)


def parse_header(text: str) -> tuple[str, str]:
    """``NAME:VALUE`` (``--prometheus.header``) as a (name, value) pair; the value is never
    named in an error."""
    name, colon, value = text.partition(":")
    if not colon:
        raise FleetUsageError("expected NAME:VALUE, e.g. X-Scope-OrgID:tenant-1 (no ':' found)")
    name, value = name.strip(), value.strip(" \t")
    if not _TOKEN.fullmatch(name):
        raise FleetUsageError("the name before ':' is not an HTTP header name "
                              "(letters, digits and !#$%&'*+-.^_`|~ only)")
    if "\r" in value or "\n" in value:
        raise FleetUsageError(f"the value of {name} holds a line break (CR or LF): refused")
    if any(unicodedata.category(c) == "Cc" and c != "\t" for c in value):
        raise FleetUsageError(f"the value of {name} holds a control character: refused")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        raise FleetUsageError(f"the value of {name} holds a character an HTTP header cannot carry "
                              "(outside Latin-1)") from None
    if name.lower() in _OWN_HEADERS:
        raise FleetUsageError(f"{name} is set by fleet itself and cannot be given")
    return name, value


def read_secret_file(path: str, option: str) -> str:
    """A password or token file's content, surrounding whitespace removed (as Prometheus reads
    its own ``password_file`` and ``bearer_token_file``). Errors name the file, never its content."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64 * 1024 + 1)
    except OSError as e:
        raise FleetUsageError(f"{option} {path}: cannot read it: {e.strerror or type(e).__name__}") from None
    if len(raw) > 64 * 1024:
        raise FleetUsageError(f"{option} {path}: over 64 KiB, not a secret")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise FleetUsageError(f"{option} {path}: not UTF-8 text") from None
    if not text:
        raise FleetUsageError(f"{option} {path}: the file is empty")
    return text


def access(*, user: str | None = None, password_file: str | None = None, password_env: str | None = None,
           bearer_token_file: str | None = None, headers: Iterable[tuple[str, str]] = (),
           ca_file: str | None = None) -> Access:
    """The options checked together: one way of authenticating at most, a password only with a
    user (the file before the environment), no header given twice."""
    given = tuple(headers)
    names = [name.lower() for name, _ in given]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise FleetUsageError(f"--prometheus.header {', '.join(twice)} given twice (one value per header: "
                              "Mimir takes several tenants as one X-Scope-OrgID, a|b)")
    if user is not None and bearer_token_file is not None:
        raise FleetUsageError("--prometheus.basic-auth-user and --prometheus.bearer-token-file together: "
                              "give one way of authenticating")
    if "authorization" in names and (user is not None or bearer_token_file is not None):
        raise FleetUsageError("--prometheus.header Authorization with --prometheus.basic-auth-user or "
                              "--prometheus.bearer-token-file: give one way of authenticating")
    basic = None
    if user is not None:
        if ":" in user or any(unicodedata.category(c) == "Cc" for c in user) or not user:
            raise FleetUsageError("--prometheus.basic-auth-user: a user name holds no ':' and no control "
                                  "character (RFC 7617)")
        if password_file is not None:
            password = read_secret_file(password_file, "--prometheus.password-file")
        elif password_env:
            password = password_env
        else:
            raise FleetUsageError(f"--prometheus.basic-auth-user needs a password: --prometheus.password-file "
                                  f"FILE, or the environment variable {PASSWORD_ENV}")
        if "\r" in password or "\n" in password:
            raise FleetUsageError("the basic-auth password holds a line break: refused")
        basic = (user, password)
    elif password_file is not None or password_env:
        where = "--prometheus.password-file" if password_file is not None else PASSWORD_ENV
        raise FleetUsageError(f"a password is given ({where}) but no --prometheus.basic-auth-user")
    token = None
    if bearer_token_file is not None:
        token = read_secret_file(bearer_token_file, "--prometheus.bearer-token-file")
        if not all("!" <= c <= "~" for c in token):
            raise FleetUsageError(f"--prometheus.bearer-token-file {bearer_token_file}: the token holds a space, "
                                  "a control or a non-ASCII character, which a bearer token cannot (RFC 6750)")
    return Access(basic, token, given, ca_file)


def _without_userinfo(url: str) -> str:
    """``url`` with everything from after its ``scheme://`` (or from its start, with no scheme)
    to its last ``@`` as ``***@``. The last, not the first, and before any parsing: a password may
    hold ``@``, and ``#``, ``/`` or ``?``, where urllib would end the user information early."""
    at = url.rfind("@")
    if at < 0:
        return url
    scheme = _SCHEME.match(url)
    start = scheme.end() if scheme else 0
    return f"{url[:start]}***@{url[at + 1:]}"


def shown_url(url: str) -> str:
    """``url`` as any message shows it: without its user information (``user:pass@`` as ``***@``),
    query or fragment, escaped to one printable line."""
    url = _without_userinfo(url)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an IPv6 address not closed: cut at the query or fragment by hand
        return for_terminal(re.split(r"[?#]", url, maxsplit=1)[0], _SHOWN_LIMIT)
    return for_terminal(urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), _SHOWN_LIMIT)


class Redactor:
    """Cuts the secrets out of text from outside (an error body, a status line, a ``Location``)
    before it is escaped and cut to a length: cut first, a long token's beginning would show; escaped
    first, a secret holding a tab would no longer match. Each secret is looked for as sent, as JSON
    writes it and as ``for_terminal`` escapes it; in bytes, as UTF-8 and Latin-1 (a header's value
    goes out in Latin-1)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        kept = {s for s in secrets if len(s) >= _MIN_SECRET}
        forms = {form for s in kept for form in (s, json.dumps(s)[1:-1], escaped(s), visible(s))}
        self._texts = sorted(forms, key=len, reverse=True)
        encoded = set()
        for form in forms:
            encoded.add(form.encode())
            with contextlib.suppress(UnicodeEncodeError):  # a password outside Latin-1
                encoded.add(form.encode("latin-1"))
        self._bytes = sorted(encoded, key=len, reverse=True)

    def body(self, data: bytes) -> bytes:
        """Raw bytes with every secret replaced, and a secret's beginning at their end (the read
        stopped inside it)."""
        for secret in self._bytes:
            data = data.replace(secret, _REDACTED.encode())
        k = _longest_prefix_at_end(data, self._bytes)
        return data[:-k] + _REDACTED.encode() if k else data

    def replace(self, text: str) -> str:
        """``text`` with every secret replaced."""
        for secret in self._texts:
            text = text.replace(secret, _REDACTED)
        return text

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced, and a secret's beginning at its end."""
        return self._trailing(self.replace(text))

    def shown(self, text: str, limit: int = _SHOWN_LIMIT) -> str:
        """Outside text as a message shows it: secrets out, then escaped and cut to ``limit``."""
        return self.cut(for_terminal(self.scrub(text), limit))

    def cut(self, shown: str) -> str:
        """Escaped, cut text with a secret's beginning that the cut left at its end replaced."""
        if shown.endswith("\u2026"):
            return self._trailing(shown[:-1]) + "\u2026"
        return self._trailing(shown)

    def _trailing(self, text: str) -> str:
        k = _longest_prefix_at_end(text, self._texts)
        return text[:-k] + _REDACTED if k else text


def _longest_prefix_at_end(text: AnyStr, secrets: Iterable[AnyStr]) -> int:
    """The length of the longest beginning (at least ``_MIN_SECRET`` long) of any secret that
    ``text`` ends with; 0 for none."""
    longest = 0
    for secret in secrets:
        for k in range(min(len(secret) - 1, len(text)), max(longest, _MIN_SECRET - 1), -1):
            if text.endswith(secret[:k]):
                longest = k
                break
    return longest


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as an error: following it would send the credentials to wherever
    it points (urllib keeps the Authorization header across hosts)."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


class _Watch:
    """One deadline over every socket an exchange opens. A socket timeout bounds one operation
    only: an answer that sends a byte a second, or headers that never end, is in time for each.
    So a timer shuts each socket at the deadline, and the blocked read returns."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._timers: list[threading.Timer] = []
        # Held while a timer shuts a socket and while a held handle is closed: a handle's number
        # is never shut after it was closed (by then it may be another file's).
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.left() <= 0

    def watch(self, sock: socket.socket) -> threading.Timer:
        """Shut ``sock`` at the deadline: the socket object that does the I/O (for https the
        ``SSLSocket``: wrapping detaches the plain one, whose shutdown would then do nothing)."""
        timer = threading.Timer(max(self.left(), 0.0), self._shut, (sock,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return timer

    def hold(self, sock: socket.socket) -> tuple[socket.socket, threading.Timer]:
        """A handle of its own on ``sock``'s connection (a duplicate), shut at the deadline. It
        bounds a TLS handshake: ``wrap_socket`` detaches ``sock`` before it, and the ``SSLSocket``
        is nowhere to be watched until the handshake is done. ``release`` it once it is."""
        handle = sock.dup()
        return handle, self.watch(handle)

    def release(self, held: tuple[socket.socket, threading.Timer]) -> None:
        handle, timer = held
        with self._lock:
            timer.cancel()
            handle.close()

    def _shut(self, sock: socket.socket) -> None:
        with self._lock, contextlib.suppress(OSError):  # closed: the answer ended in time after all
            # socket.socket's own: SSLSocket.shutdown would drop its TLS state under the reader.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def stop(self) -> None:
        for timer in self._timers:
            timer.cancel()


# Go's net.Dialer spreads a dial's timeout over a name's addresses, each given at least 2 s of it
# (or what is left, if less: dial.go, partialDeadline): one blackholed address cannot take the
# time the next one needs.
_MIN_ATTEMPT_S = 2.0

_AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]


def _resolve(host: str, port: int, within_s: float) -> Sequence[_AddrInfo]:
    """``getaddrinfo`` within ``within_s``. The resolver keeps its own timeouts (5 s a try, and
    retries), not ours: it asks in a daemon thread, which is left behind if it has not answered."""
    with contextlib.suppress(socket.gaierror):  # an address already: nothing to ask
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    found: list[_AddrInfo] = []
    failed: list[Exception] = []
    done = threading.Event()

    def ask() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except Exception as e:  # raised in the caller, as getaddrinfo's own
            failed.append(e)
        finally:
            done.set()

    try:
        threading.Thread(target=ask, name="fleet-resolve", daemon=True).start()
    except RuntimeError:  # no thread to be had: ask here, unbounded, as urllib would
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    if not done.wait(max(within_s, 0.0)):
        raise TimeoutError(f"the name was not resolved within {within_s:.3g} s")
    if failed:
        raise failed[0]
    return found


def _connect(address: tuple[str, int], watch: _Watch, source_address: tuple[str, int] | None) -> socket.socket:
    """``socket.create_connection`` inside the exchange's deadline: the name resolved, and each of
    its addresses tried in turn with its share of the time left (create_connection gives each the
    whole timeout, so N blackholed addresses took N times it)."""
    host, port = address
    found = _resolve(host, port, watch.left())
    if not found:
        raise OSError("getaddrinfo returns an empty list")
    failure: OSError = TimeoutError("connect timed out")
    for i, (family, kind, proto, _, addr) in enumerate(found):
        left = watch.left()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(max(left / (len(found) - i), min(left, _MIN_ATTEMPT_S)))
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(addr)
        except OSError as e:
            sock.close()
            failure = e
            continue
        # Each later operation within what is left; the timers shut the socket at the deadline.
        sock.settimeout(max(watch.left(), 0.001))
        return sock
    raise failure


def _watched(base: type[http.client.HTTPConnection],
             current: Callable[[], _Watch | None]) -> type[http.client.HTTPConnection]:
    """``base`` under the exchange's deadline (``current()``): its connect (name, addresses, TLS
    handshake) bounded by it, then the socket that does the I/O shut at it."""

    class Watched(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # http.client sets this on the instance (socket.create_connection): a method would not
            # take its place.
            self._create_connection = self._connect_in_time
            self._held: tuple[socket.socket, threading.Timer] | None = None

        def _connect_in_time(self, address: tuple[str, int], timeout: float,
                             source_address: tuple[str, int] | None = None) -> socket.socket:
            watch = current()
            if watch is None:
                return socket.create_connection(address, timeout, source_address)
            sock = _connect(address, watch, source_address)
            self._held = watch.hold(sock)
            return sock

        def connect(self) -> None:
            watch = current()
            try:
                super().connect()  # for https, the handshake too
            finally:
                if self._held is not None and watch is not None:
                    watch.release(self._held)
                    self._held = None
            if watch is not None:
                watch.watch(self.sock)

    return Watched


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, current: Callable[[], _Watch | None]) -> None:
        super().__init__()
        self._current = current

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPConnection, self._current), req)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, current: Callable[[], _Watch | None], context: ssl.SSLContext) -> None:
        super().__init__(context=context)
        self._current = current
        self._tls = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPSConnection, self._current), req, context=self._tls)


class PrometheusClient:
    """Instant queries against one Prometheus (or anything that serves its query API:
    Thanos Query, Mimir, VictoriaMetrics)."""

    def __init__(self, url: str, timeout_s: float = 10.0, access: Access | None = None) -> None:
        self.access = access or Access()
        self._redactor = Redactor(self.access.secrets())
        self.shown = shown_url(url)
        # Before urllib parses it: urllib ends the user information at the first '#', '/' or '?',
        # so "http://user:pa#ss@host" would read as host "user", port "pa".
        if "@" in url:
            raise FleetUsageError(f"{self.shown}: credentials in the URL are refused (they would show in process "
                                  "lists and logs): give --prometheus.basic-auth-user with --prometheus.password-file "
                                  f"or {PASSWORD_ENV} (an '@' in a path prefix is written %40)")
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as e:
            # urllib's words quote the URL's text: name the fault in ours.
            said = str(e)
            why = ("its port is not a number 0-65535" if "Port" in said else
                   "its [IPv6 address] is not closed" if "IPv6" in said else "urllib cannot split it")
            raise FleetUsageError(f"{self.shown}: not a URL: {why}") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FleetUsageError(f"{self.shown}: not an http:// or https:// URL")
        if parsed.query or parsed.fragment:
            raise FleetUsageError(f"{self.shown}: the URL is the API's base (http://prometheus:9090, or with its "
                                  "path prefix): no ?query or #fragment")
        if self.access.ca_file is not None and parsed.scheme != "https":
            raise FleetUsageError(f"{self.shown}: --prometheus.ca-file verifies an https:// server; this URL is "
                                  "http://")
        handlers: list[urllib.request.BaseHandler] = [_NoRedirects(), _WatchedHTTP(self._current_watch)]
        if parsed.scheme == "https":
            handlers.append(_WatchedHTTPS(self._current_watch, self._tls_context()))
        self._opener = urllib.request.build_opener(*handlers)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._watch: _Watch | None = None  # the exchange under way

    def _current_watch(self) -> _Watch | None:
        return self._watch

    @contextlib.contextmanager
    def exchange(self) -> Iterator[None]:
        """Every query inside shares one deadline, ``timeout_s`` from now: fleet's ``--timeout``
        bounds the whole exchange, not each socket operation. A query outside an exchange is one
        of its own."""
        if self._watch is not None:  # nested: the outer deadline holds
            yield
            return
        self._watch = _Watch(self.timeout_s)
        try:
            yield
        finally:
            self._watch.stop()
            self._watch = None

    def _tls_context(self) -> ssl.SSLContext:
        ca_file = self.access.ca_file
        try:
            return ssl.create_default_context(cafile=ca_file)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: a file that is not PEM
            reason = (e.reason if isinstance(e, ssl.SSLError) else e.strerror if isinstance(e, OSError) else None)
            reason = reason or type(e).__name__
            raise FleetUsageError(f"--prometheus.ca-file {ca_file}: cannot load it as PEM certificates: "
                                  f"{reason}") from None

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector ``promql`` gives at ``at`` (seconds since the epoch; now when
        ``None``): each element's ``metric`` (a dict) and ``value`` ([time, "number"])."""
        try:
            with self.exchange():
                return self._query(promql, at)
        except FleetError as e:
            # Each piece of outside text was scrubbed as it came in; this pass is the last guard.
            raise FleetError(self._redactor.replace(str(e))) from None

    def _query(self, promql: str, at: float | None) -> list[dict[str, Any]]:
        endpoint = f"{self.shown.rstrip('/')}/api/v1/query"
        form = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=data, method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded",
                                                  **self.access.request_headers()})
        redact = self._redactor
        watch = self._watch
        assert watch is not None  # query() opens the exchange
        late = f"{endpoint}: no answer within {watch.timeout_s:g} s (fleet's --timeout, for the whole exchange)"
        if watch.passed:
            raise FleetError(late)
        try:
            with self._opener.open(request, timeout=watch.left()) as response:
                text = _read_answer(response, watch)
        except urllib.error.HTTPError as e:  # Prometheus answers 400/422/503 with a JSON error
            if watch.passed:
                raise FleetError(late) from None
            raise FleetError(f"{endpoint}: {_http_error(e, redact)}") from None
        except urllib.error.URLError as e:
            if watch.passed:
                raise FleetError(late) from None
            raise FleetError(f"{endpoint}: {_unreachable(e.reason, watch.timeout_s, redact)}") from None
        except _Refused as e:
            raise FleetError(f"{endpoint}: {e}") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            # A gRPC port answering garbage, a cut answer, a TLS failure after the handshake, or
            # the socket shut at the deadline.
            if watch.passed:
                raise FleetError(late) from None
            raise FleetError(f"{endpoint}: {_unreachable(e, watch.timeout_s, redact)}") from None
        if watch.passed:  # the timer may have cut the body short, so that it parses wrong
            raise FleetError(late)
        # Each series is two JSON objects (itself and its metric), each opened by a "{": a text
        # with more braces lists more series (or holds braces in its strings) and is refused before
        # the parser builds a thing. Only commas bound the values of an array of numbers.
        if text.count("{") > 2 * MAX_SERIES + 16:
            raise FleetError(f"{endpoint}: {_too_many()}")
        if text.count(",") > _MAX_VALUES:
            raise FleetError(f"{endpoint}: the answer holds more than {_MAX_VALUES} values: refused unparsed (a "
                             f"Prometheus answer of {MAX_SERIES} series holds far fewer)")
        try:
            answer = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: [[[[... nested past Python's stack
            raise FleetError(f"{endpoint}: the answer is not JSON (is this a Prometheus?)") from None
        del text
        if not isinstance(answer, dict) or answer.get("status") != "success":
            said = _said(answer, redact)
            raise FleetError(f"{endpoint}: {said or 'the answer is not a success'}")
        result = answer.get("data")
        if not isinstance(result, dict) or result.get("resultType") != "vector":
            kind = result.get("resultType") if isinstance(result, dict) else type(result).__name__
            raise FleetError(f"{endpoint}: expected an instant vector, got '{redact.shown(str(kind), 40)}'")
        elements = result.get("result")
        if isinstance(elements, list) and len(elements) > MAX_SERIES:
            raise FleetError(f"{endpoint}: {_too_many()}")
        if not isinstance(elements, list) or not all(_is_sample(e) for e in elements):
            raise FleetError(f"{endpoint}: the answer's samples are not a Prometheus instant vector's "
                             "(each a metric of string labels and a [time, \"number\"] value)")
        return elements


class _Refused(Exception):
    """An answer refused before it is read whole; the message says why, in fleet's words."""


def _too_many() -> str:
    return (f"the answer lists more than {MAX_SERIES} series: refused (fleet reads a fleet's worth; ask a "
            "Prometheus, or a tenant, that holds fewer nodes)")


def _read_answer(response: http.client.HTTPResponse, watch: _Watch) -> str:
    """The answer's body as text, read in pieces to ``ANSWER_LIMIT`` at most: past it, or past a
    ``Content-Length`` that says so, refused unread."""
    too_big = f"the answer is over {ANSWER_LIMIT // 2**20} MiB: refused unread"
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > ANSWER_LIMIT:
        raise _Refused(too_big)
    body = bytearray()
    while not watch.passed:
        piece = response.read(min(_CHUNK, ANSWER_LIMIT + 1 - len(body)))
        if not piece:
            break
        body += piece
        if len(body) > ANSWER_LIMIT:
            raise _Refused(too_big)
    if body.isascii():
        return body.decode("ascii")
    if len(body) > _WIDE_ANSWER_LIMIT:
        raise _Refused(f"the answer holds non-ASCII text and is over {_WIDE_ANSWER_LIMIT // 2**20} MiB: refused "
                       "(decoded, it would take four times that)")
    return body.decode("utf-8", errors="replace")


def _http_error(e: urllib.error.HTTPError, redact: Redactor) -> str:
    """``HTTP 401: no org id``, from the body Prometheus (JSON) or a proxy (text) gave, with a hint
    for the errors an option fixes."""
    try:
        body = redact.body(e.read(_ERROR_BODY_LIMIT))
    except (OSError, http.client.HTTPException, ValueError):
        body = b""
    said = _error_of(body, redact) or _first_line(body, redact) or redact.shown(str(e.reason or ""))
    text = f"HTTP {e.code}" + (f": {said}" if said else "")
    if 300 <= e.code < 400:
        location = e.headers.get("Location") if e.headers is not None else None
        to = f" to {redact.cut(shown_url(redact.scrub(location)))}" if location else ""
        return f"{text} (a redirect{to}; fleet follows none: give the URL it points to)"
    if e.code == 401 and "no org id" in said.lower():
        return f"{text} (Mimir and Cortex ask for a tenant: --prometheus.header X-Scope-OrgID:TENANT)"
    if e.code in (401, 403):
        return (f"{text} (credentials: --prometheus.basic-auth-user with --prometheus.password-file, "
                "--prometheus.bearer-token-file, or --prometheus.header)")
    return text


def _unreachable(reason: object, timeout_s: float, redact: Redactor) -> str:
    """Why no answer came, in words: TLS, a timeout, a refused connection."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"TLS: the server's certificate is not trusted ({reason.verify_message or reason.reason}): give "
                "the CA that signs it with --prometheus.ca-file")
    if isinstance(reason, ssl.SSLError):
        return f"TLS: {reason.reason or type(reason).__name__} (is the server serving TLS, and this URL https://?)"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, OSError):
        return f"cannot reach it: {reason.strerror or type(reason).__name__}"
    # http.client's exceptions quote what the server sent (BadStatusLine): outside text.
    return f"cannot reach it: {redact.shown(str(reason)) or type(reason).__name__}"


def _is_sample(element: object) -> bool:
    """``{"metric": {...}, "value": [time, "number"]}``, the number parseable."""
    if not isinstance(element, dict) or not isinstance(element.get("metric"), dict):
        return False
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in element["metric"].items()):
        return False
    value = element.get("value")
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], str):
        return False
    try:
        float(value[1])
    except ValueError:
        return False
    return True


def _error_of(body: bytes, redact: Redactor) -> str | None:
    """Prometheus' JSON error (``bad_data: parse error ...``), secrets out, escaped and cut."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _said(answer, redact)


def _said(answer: object, redact: Redactor) -> str | None:
    """What a parsed JSON error says (``errorType: error``), secrets out, escaped and cut."""
    if isinstance(answer, dict) and answer.get("error"):
        return redact.shown(f"{answer.get('errorType', 'error')}: {answer['error']}")
    return None


def _first_line(body: bytes, redact: Redactor) -> str:
    """A plain-text error's first line (Go's http.Error: ``no org id``), secrets out, escaped and
    cut; nothing for an HTML page (a proxy's 502), whose status line says more."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text or text.startswith("<"):
        return ""
    return redact.shown(text.splitlines()[0])


def for_terminal(text: str, limit: int) -> str:
    """Outside text as a terminal line can hold it: every unprintable character escaped
    (``\\x1b``) and a backslash written ``\\\\`` (``core/visible.escaped``, as status and doctor
    show names), at most ``limit`` characters, cut between escapes, never inside one."""
    head = text[:limit + 1]  # an escape is never shorter than its character: no more is needed
    out = escaped(head)
    if len(out) <= limit:
        return out
    kept: list[str] = []
    used = 0
    for c in head:
        piece = escaped(c)
        if used + len(piece) > limit - 1:
            break
        kept.append(piece)
        used += len(piece)
    return "".join(kept) + "\u2026"
