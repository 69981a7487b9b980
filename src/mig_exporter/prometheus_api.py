"""The client ``mig-exporter fleet`` asks a Prometheus through: instant queries against its HTTP
query API (``POST /api/v1/query``), with basic auth, a bearer token, extra headers (Mimir's
``X-Scope-OrgID``) and a CA file, over the standard library's urllib and json. Anything that
serves that API answers it too: Thanos Query, Mimir, VictoriaMetrics.

Secrets (a basic-auth password, a bearer token, header values) go into the request's headers
and nowhere else. No message names them: a URL is shown with its user information as ``***``,
and text from the server (an error body, a status line, a redirect's ``Location``) has every
secret cut out before it is escaped for a terminal and cut to a length.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import ssl
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, AnyStr

# The environment variable a basic-auth password may come from (cli.py names it in --help).
PASSWORD_ENV = "MIG_EXPORTER_PROMETHEUS_BASIC_AUTH_PASSWORD"

_ERROR_BODY_LIMIT = 64 * 1024  # what is read of an error's body
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
        forms = {form for s in kept for form in (s, json.dumps(s)[1:-1], _escaped(s))}
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
        handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
        if parsed.scheme == "https":
            handlers.append(urllib.request.HTTPSHandler(context=self._tls_context()))
        self._opener = urllib.request.build_opener(*handlers)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

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
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:  # Prometheus answers 400/422/503 with a JSON error
            raise FleetError(f"{endpoint}: {_http_error(e, redact)}") from None
        except urllib.error.URLError as e:
            raise FleetError(f"{endpoint}: {_unreachable(e.reason, self.timeout_s, redact)}") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            # A gRPC port answering garbage, a cut answer, a TLS failure after the handshake.
            raise FleetError(f"{endpoint}: {_unreachable(e, self.timeout_s, redact)}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise FleetError(f"{endpoint}: the answer is not JSON (is this a Prometheus?)") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            said = _error_of(redact.body(body), redact)
            raise FleetError(f"{endpoint}: {said or 'the answer is not a success'}")
        result = answer.get("data")
        if not isinstance(result, dict) or result.get("resultType") != "vector":
            kind = result.get("resultType") if isinstance(result, dict) else type(result).__name__
            raise FleetError(f"{endpoint}: expected an instant vector, got {redact.shown(str(kind), 40)!r}")
        elements = result.get("result")
        if not isinstance(elements, list) or not all(_is_sample(e) for e in elements):
            raise FleetError(f"{endpoint}: the answer's samples are not a Prometheus instant vector's")
        return elements


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
    except ValueError:
        return None
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
    """Outside text as a terminal line can hold it: control and other unprintable characters
    escaped (``\\x1b``), at most ``limit`` characters."""
    out = _escaped(text)
    return out if len(out) <= limit else out[: limit - 1] + "\u2026"


def _escaped(text: str) -> str:
    return "".join(c if c == " " or (c.isprintable() and unicodedata.category(c)[0] not in "CZ")
                   else ascii(c)[1:-1] for c in text)
