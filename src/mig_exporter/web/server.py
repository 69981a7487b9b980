"""HTTP: ``/`` (landing page: the cards' live MIG layout, ``landing.py``),
``/metrics``, ``/probe``, ``/-/healthy``, ``/-/ready`` and ``POST /-/reload``;
HTTPS and basic auth with a web config file (``webconfig.py``).

Connections are owned by one event loop (``connections.py``): it accepts,
caps, times out and reads each request whole, then a bounded pool of workers
makes its answer here, and the loop writes it as the client reads. The
answers come from the exporter (``metrics/exporter.py``), as client_python's
handler asks a registry: every scrape reads the source afresh, requests that
arrive while a scrape is in flight share it and its encoded answer, and ``/``
draws the same shared scrape. This module knows only HTTP: paths, methods,
headers, the deadline Prometheus' header gives. A failed read
still answers 200 with ``read_success 0``; no request ever gets a traceback. ``/probe`` and
``/-/reload`` exist when serve has a config file (``probe.py``). Every answer
that is not a success is logged, one line with its reason, rate-limited per
reason.
"""

from __future__ import annotations

import errno
import io
import logging
import socket
import ssl
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from mig_exporter import __version__
from mig_exporter.core.deadline import Deadline, client_budget
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.web import landing
from mig_exporter.web.connections import Connection, ConnectionLoop, Limits, Request, peer_name
from mig_exporter.web.probe import BadProbeRequest, ProbeBusy, Prober
from mig_exporter.web.webconfig import WebConfig, WebSettings

log = logging.getLogger("mig_exporter.http")

DEFAULT_PORT = 10064
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"
_TEXT = "text/plain; charset=utf-8"
_PATHS = ("/", "/metrics", "/probe", "/-/healthy", "/-/ready", "/-/reload")
# socketserver's default backlog of 5 drops connections when many probes
# arrive at once; the client then retries only after a second.
_BACKLOG = 128


def _accepts_gzip(header: str) -> bool:
    """Whether Accept-Encoding admits gzip: ``gzip;q=0`` refuses it, wherever its ``q`` stands
    among its parameters (``gzip;level=1;q=0``), and so does a ``q`` that is not a number."""
    for item in header.split(","):
        name, *params = item.split(";")
        if name.strip().lower() not in ("gzip", "*"):
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    return float(value.strip()) > 0
                except ValueError:
                    return False
        return True
    return False


class ExporterServer:
    """The exporter's HTTP server: a listening socket, the connection loop that owns every
    connection (``connections.py``), and the handler that answers a complete request in a
    worker. ``serve_forever``, ``shutdown`` and ``server_close`` as socketserver's."""

    def __init__(
        self,
        address: tuple[str, int],
        exporter: Exporter,
        *,
        timeout_offset_s: float = 0.5,
        prober: Prober | None = None,
        web: WebSettings | None = None,
        limits: Limits | None = None,
        node_name: str | None = None,
    ) -> None:
        """``exporter`` answers ``/metrics`` and ``/``, within its ``timeout_s`` or Prometheus'
        scrape timeout less ``timeout_offset_s``; ``prober`` answers ``/probe`` and
        ``/-/reload`` (its counters are the exporter's to serve); ``node_name`` names the node on
        ``/`` (this host's name where ``None``)."""
        self.exporter = exporter
        self.node_name = node_name
        self.prober = prober
        self.web = web
        self.tls = web is not None and web.config.tls is not None
        self.timeout_offset_s = timeout_offset_s
        self.limits = limits or Limits()
        self.socket = _listen(address)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.loop = ConnectionLoop(self.socket, self.limits, self._handle, self._tls, self._client_allowed,
                                   self._route, self._auth_priority, tick=self._tick)

    def serve_forever(self) -> None:
        self.loop.run()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait for it (from another thread)."""
        self.loop.stop()

    def server_close(self) -> None:
        self.loop.close()
        self.socket.close()

    def __enter__(self) -> ExporterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server_close()

    def _handle(self, conn: Connection, request: Request) -> tuple[list[bytes], bool]:
        """The answer to one request (in a worker): its bytes, and whether the connection may be kept."""
        handler = _Handler(conn, request, self)
        return handler.wfile.parts, not handler.close_connection

    def _tick(self, now: float) -> None:
        """The loop's housekeeping, every quarter second: let go of a finished scrape no waiting
        request can still join, and of probe answers past their reuse window."""
        self.exporter.forget_finished(now)
        if self.prober is not None:
            self.prober.forget_finished(now)

    def _route(self, request: Request) -> str:
        """The worker pool for a request: credentials that need a bcrypt check wait in "auth"."""
        web = self.web_config()
        if web is not None and web.auth is not None and web.auth.needs_check(request.authorization):
            return "auth"
        return "health" if request.path == "/-/healthy" else "main"

    def _auth_priority(self, conn: Connection) -> int:
        web = self.web_config()
        return web.auth.failures_of(conn.peer) if web is not None and web.auth is not None else 0

    def _tls(self) -> tuple[ssl.SSLContext | None, str]:
        web = self.web_config()
        if web is None or web.ssl_context is None:
            return None, ""
        settings = f"min_version {web.tls.min_version}, client_auth_type {web.tls.client_auth_type}" if web.tls else ""
        return web.ssl_context, settings

    def _client_allowed(self, cert: Any) -> tuple[bool, str]:
        web = self.web_config()
        return (True, "") if web is None else web.client_allowed(cert)

    @property
    def url(self) -> str:
        """A URL that reaches the server from this host."""
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        return _url("https" if self.tls else "http", str(host), int(port))

    @property
    def listening(self) -> str:
        """What the socket is bound to, as the start-up log says it."""
        host, port = self.server_address[:2]
        url = _url("https" if self.tls else "http", str(host), int(port))
        if host == "0.0.0.0":
            return f"{url} (every IPv4 address)"
        if host == "::":
            v6_only = self.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            return f"{url} (every IPv6 address)" if v6_only else f"{url} (every IPv4 and IPv6 address)"
        return url

    def reload_stuck(self) -> str | None:
        """Why a reload of the config file or the web config is stuck past its deadline, or None
        (/-/ready is not ready meanwhile; /-/healthy still answers: the server does)."""
        stuck = [why for why in (self.prober.reload_stuck() if self.prober is not None else None,
                                 self.web.stuck() if self.web is not None else None) if why is not None]
        return "; ".join(stuck) or None

    def web_config(self) -> WebConfig | None:
        return self.web.current() if self.web is not None else None

    def scrape_deadline(self, header: str | None) -> Deadline:
        """The read's deadline: ``--timeout`` from now, or Prometheus' scrape
        timeout less the offset when that is sooner, so the answer arrives in time."""
        return self.request_deadline(self.exporter.timeout_s, header)

    def request_deadline(self, limit_s: float, header: str | None) -> Deadline:
        """A request's own deadline within ``limit_s``; a header below the floor or not a number
        is clamped (``core/deadline.client_budget``) and counted. The read it shares runs under
        the server's limit whatever this deadline (``metrics/exporter.py``, ``probe.py``)."""
        budget_s, clamped = client_budget(limit_s, header, self.timeout_offset_s)
        if clamped:
            self.exporter.count_clamped()
        return Deadline.after(budget_s)


def _listen(address: tuple[str, int]) -> socket.socket:
    """The listening socket. An empty host is every address, as Go's net.Listen(":PORT"):
    one IPv6 socket that takes IPv4 too, or IPv4 alone where the kernel has no IPv6."""
    host, port = address
    if host == "" and socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=_BACKLOG,
                                        dualstack_ipv6=True)
        except OSError as e:
            if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            log.debug("IPv6 is not available (%s); listening on IPv4 only", e.strerror or e)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host or "0.0.0.0", port), family=family, backlog=_BACKLOG)


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    """Answers one complete request, read by the connection loop, in a worker thread.

    http.server parses it (from memory: the loop has read it whole) and calls do_GET and
    the like; the answer's bytes (head, then the body as the scrape encoded it, not copied)
    are collected in ``wfile`` for the loop to write: no worker waits on a client."""

    # Not a socketserver.BaseServer: the loop reads requests, the handler only answers them.
    server: ExporterServer  # type: ignore[assignment]
    wfile: _AnswerBuffer  # the answer's bytes, for the loop to write
    server_version = f"mig-exporter/{__version__}"
    protocol_version = "HTTP/1.1"

    def __init__(self, conn: Connection, request: Request, server: ExporterServer) -> None:
        # Not BaseRequestHandler's __init__: there is no socket to read, only the request.
        self.server = server
        self.request = conn.sock
        self.connection = conn.sock
        self.client_address = conn.peer
        self.rfile = io.BytesIO(request.data)
        self.wfile = _AnswerBuffer()
        self.close_connection = True
        self._arrived_at = request.received_at
        self._close_after = request.close_after
        self.handle_one_request()

    def handle_expect_100(self) -> bool:
        """No 100 Continue: no handler reads a body, so none is asked for. The loop handed over the
        head alone and closes the connection after the answer, as Go does for a body it never reads."""
        return True

    def do_GET(self) -> None:  # do_GET, do_HEAD, do_POST: http.server's naming
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        send_body = method != "HEAD"
        self._extra_headers: dict[str, str] = {}
        try:
            url = urlsplit(self.path)
            path = url.path
            allowed = ("POST",) if path == "/-/reload" else ("GET", "HEAD")
            web = self.server.web_config()
            if web is not None and not self._admitted(web, send_body):
                return
            if path not in _PATHS:
                self._fail(404, "Not found", send_body)
            elif method not in allowed:
                allow = ", ".join(allowed)
                self._fail(405, f"Method not allowed: use {allow}", send_body, {"Allow": allow})
            elif path == "/metrics":
                self._metrics(send_body)
            elif path == "/probe":
                self._probe(url.query, send_body)
            elif path == "/-/reload":
                self._reload()
            elif path == "/":
                self._landing(send_body)
            elif path == "/-/healthy":
                self._send(200, b"Healthy\n", _TEXT, send_body)
            else:  # /-/ready
                ok, reason = self.server.exporter.source.ready()
                if ok and (stuck := self.server.reload_stuck()) is not None:
                    ok, reason = False, stuck
                if ok:
                    self._send(200, f"Ready: {reason}\n".encode(), _TEXT, send_body)
                else:  # asked every few seconds by a readiness probe: not a warning each time
                    self._fail(503, f"Not ready: {reason}", send_body, level=logging.INFO)
        except Exception:  # a bug of ours: the client is answered 503 and the log says why
            log.exception("%s %s from %s failed; answered 503", self.command, _shown_path(self.path),
                          peer_name(self.client_address))
            self.wfile.parts.clear()
            self._send(503, b"Request failed; see the exporter's log\n", _TEXT, send_body)

    def _admitted(self, web: WebConfig, send_body: bool) -> bool:
        """The web config's headers, rate limit and basic auth, for every path
        (as in the exporter-toolkit: /-/healthy too)."""
        self._extra_headers = dict(web.headers)
        if web.rate_limiter is not None and not web.rate_limiter.allow():
            self._fail(429, "Too many requests (rate_limit in the web config)", send_body)
            return False
        if web.auth is None:
            return True
        result = web.auth.check(self.headers.get("Authorization"), peer=self.client_address)
        if result.ok:
            return True
        self._fail(401, "Unauthorized", send_body, {"WWW-Authenticate": 'Basic realm="mig-exporter"'},
                   reason=result.reason)
        return False

    def _fail(self, status: int, message: str, send_body: bool, headers: dict[str, str] | None = None,
              reason: str | None = None, level: int | None = None) -> None:
        """Answer an error, and log it: one line, with the reason, rate-limited per
        status and reason (a flood of them is a few lines and a count)."""
        if level is None:
            level = logging.WARNING if status in (401, 429) or status >= 500 else logging.INFO
        self.server.loop.limited.log((status, reason or message), level, "%s %s from %s: answered %d: %s",
                                     self.command, _shown_path(self.path), peer_name(self.client_address), status,
                                     reason or message)
        self._send(status, f"{message}\n".encode(), _TEXT, send_body, headers)

    def _metrics(self, send_body: bool) -> None:
        self._send_answer(self._shared_answer(), send_body)

    def _shared_answer(self) -> Answer:
        """This request's share of a scrape: the one in flight, else a new one."""
        return self.server.exporter.answer(self.server.scrape_deadline(self.headers.get(SCRAPE_TIMEOUT_HEADER)),
                                           arrived_at=self._arrived_at or None)

    def _probe(self, query: str, send_body: bool) -> None:
        prober = self.server.prober
        if prober is None:
            self._fail(400, "no probe targets: serve was started without --config.file", send_body)
            return
        try:
            target = prober.target_for_query(query)
        except BadProbeRequest as e:
            self._fail(400, str(e), send_body)
            return
        header = self.headers.get(SCRAPE_TIMEOUT_HEADER)
        deadline = self.server.request_deadline(prober.timeout_for(target), header)
        try:
            answer = prober.probe(target, deadline).answer()
        except ProbeBusy as e:
            self._fail(503, f"{e}; try again later", send_body)
            return
        self._send_answer(answer, send_body)

    def _reload(self) -> None:
        prober = self.server.prober
        if prober is None:
            self._fail(400, "no config file to reload: serve was started without --config.file", True)
            return
        outcome = prober.request_reload()
        if outcome is None:  # the reloader's own thread reads on; this pool thread goes back
            if (why := prober.reload_stuck()) is not None:
                self._fail(503, f"Reload not done: {why}; this request is merged into the next read of the file "
                           "(mig_exporter_config_last_reload_successful says how it went)", True)
            else:  # a slow read, not yet past its deadline: accepted, for the read that covers it
                self._send(202, b"Reload accepted: the read in progress has not finished yet; this request is merged "
                           b"into the next read of the file (mig_exporter_config_last_reload_successful says how "
                           b"it went)\n", _TEXT, True)
            return
        ok, message = outcome
        if ok:
            self._send(200, f"{message}\n".encode(), _TEXT, True)
        else:
            # Prober.reload has logged every error; the answer carries them too.
            self._send(400, f"{message}\n".encode(), _TEXT, True)

    def _send_answer(self, answer: Answer, send_body: bool) -> None:
        compress = _accepts_gzip(self.headers.get("Accept-Encoding", ""))
        body, content_type = answer.encoded(self.headers.get("Accept", ""), compress)
        extra = {"Vary": "Accept-Encoding"}
        if compress:
            extra["Content-Encoding"] = "gzip"
        self._send(200, body, content_type, send_body, extra)

    def _landing(self, send_body: bool) -> None:
        """The live layout (``landing.py``), drawn from the same shared scrape as ``/metrics``."""
        answer = self._shared_answer()
        if answer.outcome is None:  # every answer of the exporter carries its read; a 503 if not
            raise RuntimeError("the shared scrape answered without its read")
        probes = None
        prober = self.server.prober
        if prober is not None:
            config = prober.config
            probes = landing.ProbeLinks(config.source, tuple(config.probe_targets), prober.max_concurrent)
        page = landing.page(answer.outcome, version=__version__, source=self.server.exporter.source.describe(),
                            probes=probes, node=self.server.node_name)
        # No script may run on the page; a web config's own policy, if it sets one, wins.
        configured = {name.lower() for name in self._extra_headers}
        headers = {name: value for name, value in (("Content-Security-Policy", landing.CONTENT_SECURITY_POLICY),
                                                   ("X-Content-Type-Options", "nosniff"))
                   if name.lower() not in configured}
        self._send(200, page.encode(), "text/html; charset=utf-8", send_body, headers)

    def _send(self, status: int, body: bytes, content_type: str, send_body: bool,
              headers: dict[str, str] | None = None) -> None:
        # The head and the body as two buffers, which the loop writes in one sendmsg (a Go
        # server's single write): the body is the scrape's encoding, shared, never copied.
        # http.server writes the head to self.wfile at end_headers(): here, into a buffer. An
        # HTTP/0.9 request ("GET /path" alone) gets no head at all, as from http.server itself.
        wfile = self.wfile
        self.wfile = head = _AnswerBuffer()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in {**getattr(self, "_extra_headers", {}), **(headers or {})}.items():
                self.send_header(name, value)
            if self._close_after:  # a body left unread: the connection closes, and says so
                self.send_header("Connection", "close")
            self.end_headers()
        finally:
            self.wfile = wfile
        wfile.write(b"".join(head.parts))
        if send_body:
            wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: object) -> None:
        """http.server's own refusals (a malformed request line, an unsupported
        method, too many headers): one line each, rate-limited."""
        reason = " ".join((format % args).split())
        self.server.loop.limited.log(("http.server", format), logging.INFO, "request from %s refused: %s",
                                     peer_name(self.client_address), reason)


class _AnswerBuffer(io.BufferedIOBase):
    """Where the handler writes its answer: each write kept as it came, for the loop to send."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]  # bytes-like in, all of it kept
        self.parts.append(bytes(b) if not isinstance(b, bytes) else b)
        return len(self.parts[-1])


def _shown_path(path: str) -> str:
    """A request path as it can be logged: printable ASCII, bounded."""
    shown = ascii(path)[1:-1]
    return shown if len(shown) <= 200 else shown[:197] + "..."


def parse_listen_address(address: str) -> tuple[str, int]:
    """``:10064`` (every address, IPv4 and IPv6: the host is ``""``),
    ``0.0.0.0:10064``, ``127.0.0.1:0``, ``[::]:10064`` or ``[::1]:10064``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address {address!r} is not HOST:PORT")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r}: port {int(port)} is out of range (0 to 65535)")
    host = host.strip("[]") if host.startswith("[") else host
    if ":" in host and not address.startswith("["):
        raise ValueError(f"listen address {address!r}: write IPv6 hosts in brackets, [::1]:PORT")
    return host, int(port)
