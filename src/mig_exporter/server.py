"""HTTP: ``/`` (landing page), ``/metrics``, ``/-/healthy`` and ``/-/ready``.

Every scrape reads the source afresh; scrapes are served concurrently, one
thread each. A failed read still answers 200 with ``read_success 0``; no
request ever gets a traceback.
"""

from __future__ import annotations

import gzip
import html
import logging
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from mig_exporter import __version__
from mig_exporter.exposition import render
from mig_exporter.scrape import Scraper

log = logging.getLogger("mig_exporter.http")

DEFAULT_PORT = 10064
DEFAULT_LISTEN_ADDRESS = f":{DEFAULT_PORT}"
SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        scraper: Scraper,
        *,
        timeout_s: float,
        timeout_offset_s: float = 0.5,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.scraper = scraper
        self.timeout_s = timeout_s
        self.timeout_offset_s = timeout_offset_s
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"

    def scrape_timeout(self, header: str | None) -> float:
        """The read's budget: ``--timeout``, or Prometheus' scrape timeout less
        the offset when that is shorter, so the answer arrives in time."""
        if header:
            try:
                offered = float(header) - self.timeout_offset_s
            except ValueError:
                return self.timeout_s
            if offered > 0:
                return min(self.timeout_s, offered)
            return min(self.timeout_s, 0.1)
        return self.timeout_s


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    server_version = f"mig-exporter/{__version__}"
    protocol_version = "HTTP/1.1"
    # The headers and the body go out in two writes; with Nagle's algorithm the
    # body waits for the client's delayed ACK of the headers, ~40 ms a scrape.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch(send_body=False)

    def _dispatch(self, send_body: bool) -> None:
        try:
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._metrics(send_body)
            elif path == "/":
                self._landing(send_body)
            elif path == "/-/healthy":
                self._send(200, b"Healthy\n", "text/plain; charset=utf-8", send_body)
            elif path == "/-/ready":
                ok, reason = self.server.scraper.source.ready()
                body = f"{'Ready' if ok else 'Not ready'}: {reason}\n".encode()
                self._send(200 if ok else 503, body, "text/plain; charset=utf-8", send_body)
            else:
                self._send(404, b"Not found\n", "text/plain; charset=utf-8", send_body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; nothing to answer
        except Exception:
            log.exception("request %s failed", self.path)
            try:
                self._send(503, b"Request failed; see the exporter's log\n", "text/plain; charset=utf-8", send_body)
            except OSError:
                pass

    def _metrics(self, send_body: bool) -> None:
        timeout = self.server.scrape_timeout(self.headers.get(SCRAPE_TIMEOUT_HEADER))
        families = self.server.scraper.families(timeout)
        body, content_type = render(families, self.headers.get("Accept", ""))
        extra = {}
        if "gzip" in self.headers.get("Accept-Encoding", ""):
            # Level 1, as nginx's default: a third of level 6's time for a
            # body ~15% larger, on a scrape that must cost next to nothing.
            body = gzip.compress(body, compresslevel=1)
            extra["Content-Encoding"] = "gzip"
        self._send(200, body, content_type, send_body, extra)

    def _landing(self, send_body: bool) -> None:
        source = html.escape(self.server.scraper.source.describe())
        page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>mig-exporter</title></head>
<body>
<h1>mig-exporter {html.escape(__version__)}</h1>
<p>NVIDIA GPU memory per card, per MIG instance and per process, read at every scrape.</p>
<p>Source: {source}</p>
<ul>
<li><a href="/metrics">/metrics</a></li>
<li><a href="/-/healthy">/-/healthy</a></li>
<li><a href="/-/ready">/-/ready</a></li>
</ul>
</body></html>
"""
        self._send(200, page.encode(), "text/html; charset=utf-8", send_body)

    def _send(self, status: int, body: bytes, content_type: str, send_body: bool, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)


def parse_listen_address(address: str) -> tuple[str, int]:
    """``:10064``, ``0.0.0.0:10064``, ``127.0.0.1:0`` or ``[::1]:10064``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {address!r} is not HOST:PORT")
    host = host.strip("[]") if host.startswith("[") else host
    if ":" in host and not address.startswith("["):
        raise ValueError(f"listen address {address!r}: write IPv6 hosts in brackets, [::1]:PORT")
    return host or "0.0.0.0", int(port)
