"""``mig-exporter fleet``: the fleet by device class, asked of a Prometheus that scrapes the
exporters, through its HTTP query API (``/api/v1/query``, the standard library's urllib and
json: no PromQL result is parsed by hand). The planner's question, "is there one free 3g.40gb
instance, and which?", answered from the metrics.

It asks the capacity recording rules' own expressions (``capacity_rules``), not their recorded
names, so it answers from a Prometheus that does not load the rules too: one definition of free
(``mig_exporter_device_state``, on a node that reports now), in use and unknown.

    CLASS                 DEVICES  FREE  IN USE  UNKNOWN  MEMORY FREE
    a100-80g-mig-3g.40gb        4     2       1        1    106.3 GiB

    Nodes not reporting (seen within 1h, not now): gpu-node-4:10064

    Nodes with a free a100-80g-mig-3g.40gb now:
      gpu-node-1:10064 {cluster="eu-1"}  1 free
      gpu-node-2:10064 {cluster="eu-1"}  1 free

Secrets (a basic-auth password, a bearer token, header values) go into the request's headers
and nowhere else: no message names them, and a URL is shown without its user information.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import re
import ssl
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_exporter import capacity_rules
from mig_exporter.capacity_rules import (
    DEVICE_LABELS,
    DEVICES_PER_NODE,
    FREE_PER_NODE,
    FRESH_WITHIN,
    IN_USE_PER_NODE,
    MEMORY_FREE_PER_NODE,
    NOT_REPORTING,
    SEEN_WITHIN,
    UNKNOWN_PER_NODE,
)

# The rules' freshness window as shipped: --capacity.fresh-within's default.
DEFAULT_FRESH_WITHIN = FRESH_WITHIN
# The environment variable a basic-auth password may come from (cli.py names it in --help).
PASSWORD_ENV = "MIG_EXPORTER_PROMETHEUS_BASIC_AUTH_PASSWORD"

_GIB = 1024**3
_ERROR_BODY_LIMIT = 64 * 1024  # what is read of an error's body
_SHOWN_LIMIT = 200  # characters of outside text in one message
# The labels of a device series that are the device's, not its node's.
_DEVICE_ONLY = frozenset(label.strip() for label in DEVICE_LABELS.split(",")) | {"class"}
# Headers the request's framing and auth options own: --prometheus.header may not set them.
_OWN_HEADERS = frozenset({"host", "content-type", "content-length", "transfer-encoding", "connection"})
_DURATION = re.compile(r"[1-9][0-9]*(s|m|h)")  # as the chart's capacityFreshWithin takes it
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)


class FleetError(Exception):
    """The Prometheus could not be asked, or answered an error: the message names the URL (its
    user information left out) and why. ``fleet`` exits 3."""


class FleetUsageError(ValueError):
    """The options cannot make a request: a bad URL, header or credential file, or two ways of
    authenticating at once. The message names no secret. ``fleet`` exits 2."""


# --- asking ------------------------------------------------------------------------------------


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


def shown_url(url: str) -> str:
    """``url`` as any message shows it: without its user information (``user:pass@``), query
    or fragment, escaped to one printable line."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return _for_terminal(url.split("@")[-1], _SHOWN_LIMIT)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return _for_terminal(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")), _SHOWN_LIMIT)


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
        self.shown = shown_url(url)
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as e:
            raise FleetUsageError(f"{self.shown}: not a URL: {e}") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FleetUsageError(f"{self.shown}: not an http:// or https:// URL")
        if parsed.username is not None or parsed.password is not None:
            raise FleetUsageError(f"{self.shown}: credentials in the URL are refused (they would show in process "
                                  "lists and logs): give --prometheus.basic-auth-user with --prometheus.password-file "
                                  f"or {PASSWORD_ENV}")
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
            raise FleetError(self._scrub(str(e))) from None

    def _query(self, promql: str, at: float | None) -> list[dict[str, Any]]:
        endpoint = f"{self.shown.rstrip('/')}/api/v1/query"
        form = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(f"{self.url}/api/v1/query", data=data, method="POST",
                                         headers={"Content-Type": "application/x-www-form-urlencoded",
                                                  **self.access.request_headers()})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:  # Prometheus answers 400/422/503 with a JSON error
            raise FleetError(f"{endpoint}: {_http_error(e)}") from None
        except urllib.error.URLError as e:
            raise FleetError(f"{endpoint}: {_unreachable(e.reason, self.timeout_s)}") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            # A gRPC port answering garbage, a cut answer, a TLS failure after the handshake.
            raise FleetError(f"{endpoint}: {_unreachable(e, self.timeout_s)}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise FleetError(f"{endpoint}: the answer is not JSON (is this a Prometheus?)") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise FleetError(f"{endpoint}: {_error_of(body) or 'the answer is not a success'}")
        result = answer.get("data")
        if not isinstance(result, dict) or result.get("resultType") != "vector":
            kind = result.get("resultType") if isinstance(result, dict) else type(result).__name__
            raise FleetError(f"{endpoint}: expected an instant vector, got {_for_terminal(str(kind), 40)!r}")
        elements = result.get("result")
        if not isinstance(elements, list) or not all(_is_sample(e) for e in elements):
            raise FleetError(f"{endpoint}: the answer's samples are not a Prometheus instant vector's")
        return elements

    def _scrub(self, message: str) -> str:
        """The message with every secret cut out: a server may echo a request's header in its
        error body. Values under 4 characters are left (they would blank digits of the message)."""
        for secret in sorted(self.access.secrets(), key=len, reverse=True):
            if len(secret) >= 4:
                message = message.replace(secret, "<redacted>")
        return message


def _http_error(e: urllib.error.HTTPError) -> str:
    """``HTTP 401: no org id``, from the body Prometheus (JSON) or a proxy (text) gave, with a hint
    for the errors an option fixes."""
    try:
        body = e.read(_ERROR_BODY_LIMIT)
    except (OSError, http.client.HTTPException, ValueError):
        body = b""
    said = _error_of(body) or _first_line(body) or str(e.reason or "")
    text = f"HTTP {e.code}" + (f": {said}" if said else "")
    if 300 <= e.code < 400:
        location = e.headers.get("Location") if e.headers is not None else None
        to = f" to {shown_url(location)}" if location else ""
        return f"{text} (a redirect{to}; fleet follows none: give the URL it points to)"
    if e.code == 401 and "no org id" in said.lower():
        return f"{text} (Mimir and Cortex ask for a tenant: --prometheus.header X-Scope-OrgID:TENANT)"
    if e.code in (401, 403):
        return (f"{text} (credentials: --prometheus.basic-auth-user with --prometheus.password-file, "
                "--prometheus.bearer-token-file, or --prometheus.header)")
    return text


def _unreachable(reason: object, timeout_s: float) -> str:
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
    return f"cannot reach it: {_for_terminal(str(reason), _SHOWN_LIMIT) or type(reason).__name__}"


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


def _error_of(body: bytes) -> str | None:
    """Prometheus' JSON error (``bad_data: parse error ...``), escaped and cut."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict) and answer.get("error"):
        return _for_terminal(f"{answer.get('errorType', 'error')}: {answer['error']}", _SHOWN_LIMIT)
    return None


def _first_line(body: bytes) -> str:
    """A plain-text error's first line (Go's http.Error: ``no org id``), escaped and cut; nothing
    for an HTML page (a proxy's 502), whose status line says more."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text or text.startswith("<"):
        return ""
    return _for_terminal(text.splitlines()[0], _SHOWN_LIMIT)


def _for_terminal(text: str, limit: int) -> str:
    """Outside text as a terminal line can hold it: control and other unprintable characters
    escaped (``\\x1b``), at most ``limit`` characters."""
    out = "".join(c if c == " " or (c.isprintable() and unicodedata.category(c)[0] not in "CZ")
                  else ascii(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[: limit - 1] + "\u2026"


# --- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Queries:
    """The expressions fleet asks: the capacity rules' (``capacity_rules``), with their freshness
    window where the rules run with another (``fresh_within``)."""

    devices: str = DEVICES_PER_NODE
    free: str = FREE_PER_NODE
    in_use: str = IN_USE_PER_NODE
    unknown: str = UNKNOWN_PER_NODE
    memory_free: str = MEMORY_FREE_PER_NODE
    not_reporting: str = NOT_REPORTING
    free_devices: Callable[[str], str] = field(default=capacity_rules.free_devices)

    def fresh_within(self, window: str) -> Queries:
        """The same expressions, counting a node while its newest read is younger than ``window``
        (a Prometheus duration: 45s, 2m) in place of the rules' ``FRESH_WITHIN``: what the chart's
        ``prometheusRule.capacityFreshWithin`` does to the rules file, so fleet counts as they do."""
        if not _DURATION.fullmatch(window):
            raise FleetUsageError(f"--capacity.fresh-within {window!a}: give a Prometheus duration such as 45s, "
                                  "1m or 2m (two scrape intervals, plus the federation interval)")
        old, new = f"[{FRESH_WITHIN}]", f"[{window}]"
        listed = self.free_devices
        return Queries(self.devices.replace(old, new), self.free.replace(old, new), self.in_use.replace(old, new),
                       self.unknown.replace(old, new), self.memory_free.replace(old, new),
                       self.not_reporting.replace(old, new), lambda c: listed(c).replace(old, new))


QUERIES = Queries()


@dataclass(frozen=True, slots=True)
class ClassInFleet:
    device_class: str
    devices: int
    free: int
    in_use: int = 0
    unknown: int = 0
    # Memory free on the class's reporting devices, each GPU instance once; None when none reports it.
    memory_free_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Node:
    """A node as the Prometheus names it: its ``instance``, and its other labels (``job``, and
    external ones such as ``cluster``), so two clusters' nodes of one name stay two."""

    instance: str
    labels: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"instance": self.instance, "labels": dict(self.labels)}

    def describe(self) -> str:
        """``gpu-node-1:10064`` and, beyond its job, its other labels: ``{cluster="eu-1"}``."""
        others = [f'{_for_terminal(k, 40)}="{_for_terminal(v, 80)}"' for k, v in self.labels if k != "job"]
        name = _for_terminal(self.instance, 120) or "(no instance)"
        return name + (f" {{{', '.join(others)}}}" if others else "")


@dataclass(frozen=True, slots=True)
class NodeWithFree:
    instance: str
    free: int
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def node(self) -> Node:
        return Node(self.instance, self.labels)


@dataclass(frozen=True, slots=True)
class FreeDevice:
    """One free device: what a planner hands to ``CUDA_VISIBLE_DEVICES`` (``uuid``), where it is,
    and its memory free. The same fields as ``status --output json`` gives for the device."""

    node: Node
    device: str  # card/migN, or the card's index for a whole card
    index: int | None
    uuid: str
    gpu_instance: int | None
    compute_instance: int | None
    memory_free_bytes: int | None

    def as_json(self) -> dict[str, Any]:
        return {**self.node.as_json(), "device": self.device, "uuid": self.uuid, "gpu_instance": self.gpu_instance,
                "compute_instance": self.compute_instance, "memory_free_bytes": self.memory_free_bytes}


@dataclass(frozen=True, slots=True)
class Fleet:
    classes: tuple[ClassInFleet, ...]
    # Exporters seen within the last hour that do not report now (their devices count unknown).
    not_reporting: tuple[Node, ...] = ()
    # With a class asked for: it, and each node with at least one free device of it, most free first.
    device_class: str | None = None
    nodes: tuple[NodeWithFree, ...] | None = None
    # With --devices: each free device of the class, node by node as ``nodes`` orders them.
    devices: tuple[FreeDevice, ...] | None = None

    def knows(self, device_class: str) -> bool:
        """Whether the Prometheus has a device of ``device_class`` (reporting, or seen within the hour)."""
        return any(c.device_class == device_class for c in self.classes)

    @property
    def any_free(self) -> bool:
        """With a class: whether a device of it is free now."""
        return bool(self.nodes)


def _number(element: Mapping[str, Any]) -> int | None:
    value = float(element["value"][1])
    return int(value) if math.isfinite(value) else None


def _node_of(metric: Mapping[str, str], drop: Iterable[str] = ()) -> Node:
    gone = {"instance", "__name__", *drop}
    return Node(metric.get("instance", ""), tuple(sorted((k, v) for k, v in metric.items() if k not in gone)))


def _id(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def read_fleet(client: PrometheusClient, device_class: str | None = None, *, devices: bool = False,
               queries: Queries = QUERIES) -> Fleet:
    """Devices, free, in use, unknown and memory free per class; the nodes not reporting; with
    ``device_class`` (one the Prometheus has) the nodes with a free one, and with ``devices``
    each free device. Every query at one instant: free never counts another moment than devices."""
    at = time.time()

    def per_class(expression: str) -> dict[str, int | None]:
        return {e["metric"].get("class", ""): _number(e) for e in client.query(f"sum by (class) ({expression})", at)}

    counted = per_class(queries.devices)
    free, in_use, unknown = per_class(queries.free), per_class(queries.in_use), per_class(queries.unknown)
    memory = per_class(queries.memory_free)
    classes = tuple(ClassInFleet(name, count or 0, free.get(name) or 0, in_use.get(name) or 0,
                                 unknown.get(name) or 0, memory.get(name))
                    for name, count in sorted(counted.items()))
    silent = tuple(sorted({_node_of(e["metric"], drop=("version",))
                           for e in client.query(queries.not_reporting, at)},
                          key=lambda n: (n.instance, n.labels)))
    found = Fleet(classes, silent, device_class)
    if device_class is None or not found.knows(device_class):
        return found
    # Per node, keeping its target and external labels (job, cluster): not merged by instance name.
    # The class is matched here, not in PromQL: any class name matches as it is.
    per_node = [e for e in client.query(f"({queries.free}) > 0", at) if e["metric"].get("class") == device_class]
    nodes = tuple(sorted((NodeWithFree(e["metric"].get("instance", ""), _number(e) or 0,
                                       _node_of(e["metric"], drop=("class",)).labels) for e in per_node),
                         key=lambda n: (-n.free, n.instance, n.labels)))
    found = Fleet(classes, silent, device_class, nodes)
    if not devices:
        return found
    rank = {n.node: i for i, n in enumerate(nodes)}
    listed = []
    for e in client.query(queries.free_devices(device_class), at):
        metric = e["metric"]
        listed.append(FreeDevice(_node_of(metric, drop=_DEVICE_ONLY), metric.get("device", ""),
                                 _id(metric.get("index")), metric.get("uuid", ""), _id(metric.get("gpu_instance")),
                                 _id(metric.get("compute_instance")), _number(e)))
    listed.sort(key=lambda d: (rank.get(d.node, len(rank)), d.node.instance, d.node.labels,
                               d.index if d.index is not None else -1, d.device))
    return Fleet(classes, silent, device_class, nodes, tuple(listed))


# --- output ------------------------------------------------------------------------------------


def as_json(fleet: Fleet) -> dict[str, Any]:
    """``classes`` (as ``status`` gives a node's), ``not_reporting``; with a class, ``class`` and
    ``nodes``; with --devices, ``devices``."""
    out: dict[str, Any] = {
        "classes": [{"class": c.device_class, "devices": c.devices, "free": c.free, "in_use": c.in_use,
                     "unknown": c.unknown, "memory_free_bytes": c.memory_free_bytes} for c in fleet.classes],
        "not_reporting": [n.as_json() for n in fleet.not_reporting],
    }
    if fleet.nodes is not None:
        out["class"] = fleet.device_class
        out["nodes"] = [{"instance": n.instance, "free": n.free, "labels": dict(n.labels)} for n in fleet.nodes]
    if fleet.devices is not None:
        out["devices"] = [d.as_json() for d in fleet.devices]
    return out


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def _table(rows: list[tuple[str, ...]], right: set[int], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                               for i, cell in enumerate(row)).rstrip() for row in rows]


def render_text(fleet: Fleet, device_class: str | None = None) -> str:
    device_class = device_class if device_class is not None else fleet.device_class
    if not fleet.classes:
        lines = ["No devices: the Prometheus has no mig-exporter device series (is it scraping the exporters?)"]
    else:
        rows: list[tuple[str, ...]] = [("CLASS", "DEVICES", "FREE", "IN USE", "UNKNOWN", "MEMORY FREE")]
        rows += [(_for_terminal(c.device_class, 80) or "(unknown class)", str(c.devices), str(c.free),
                  str(c.in_use), str(c.unknown), _gib(c.memory_free_bytes)) for c in fleet.classes]
        lines = _table(rows, right={1, 2, 3, 4, 5})
    lines.append("")
    silent = ", ".join(n.describe() for n in fleet.not_reporting) or "none"
    lines.append(f"Nodes not reporting (seen within {SEEN_WITHIN}, not now): {silent}")
    shown_class = _for_terminal(device_class or "", 80)
    if fleet.devices is not None:
        lines.append("")
        if fleet.devices:
            lines.append(f"Free {shown_class} devices now:")
            rows = [("NODE", "DEVICE", "UUID", "GPU INSTANCE", "MEMORY FREE")]
            rows += [(d.node.describe(), _for_terminal(d.device, 20), _for_terminal(d.uuid, 80),
                      "-" if d.gpu_instance is None else str(d.gpu_instance), _gib(d.memory_free_bytes))
                     for d in fleet.devices]
            lines += _table(rows, right={3, 4}, indent="  ")
        else:
            lines.append(f"No {shown_class} is free now.")
    elif fleet.nodes is not None:
        lines.append("")
        if fleet.nodes:
            lines.append(f"Nodes with a free {shown_class} now:")
            lines += [f"  {n.node.describe()}  {n.free} free" for n in fleet.nodes]
        else:
            lines.append(f"No node has a free {shown_class} now.")
    return "\n".join(lines) + "\n"


def known_classes(fleet: Fleet) -> str:
    """The classes the Prometheus has, for the message naming an unknown one."""
    return ", ".join(_for_terminal(c.device_class, 80) or "(unknown class)" for c in fleet.classes) or "none"
