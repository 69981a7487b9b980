"""``fleet`` against a broken or hostile Prometheus (issue 38): an answer that never ends, trickles
or never finishes its headers, over http and https; a TLS handshake that trickles; a name that
never resolves, or resolves to blackholed addresses; a 1 GiB body; 1 000 000 series; NaN, +Inf and
labels that are not strings; a 50 MB error body; redirects to ftp:// and to another port; names
made of terminal controls. Each server is a real one on 127.0.0.1, written with raw sockets so
that it can misbehave as a real one would; big bodies are generated as they are sent, never stored.

fleet runs in this process, through its command's own entry point (``cli.main``), except where
its peak RSS is measured: there it runs as a subprocess. An exchange that must stop at its
--timeout runs in a thread bounded at several times that timeout (``_within``): one that does not
stop fails the test by running past the bound, while each server drags on for far longer.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import resource
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from unittest import mock

import pytest

from certs import Pki, make_pki
from mig_exporter.cli import main
from mig_exporter.fleet import ClassInFleet, Fleet, FreeDevice, Node, NodeWithFree, read_fleet, render_text
from mig_exporter.prometheus_api import (
    ANSWER_LIMIT,
    MAX_SERIES,
    FleetError,
    PrometheusClient,
    _Watch,
    _watched,
    for_terminal,
)

HOST = "127.0.0.1"
MiB = 2**20
# How long a dragging server drags: far past any bound below, so that only fleet's own deadline
# can end the exchange in time.
DRAG_S = 60.0
# Bound on an exchange under --timeout 1: room for a loaded CI machine, well short of DRAG_S.
BOUND_S = 8.0

Answer = Callable[[socket.socket], None]
T = TypeVar("T")


class _Handler(socketserver.BaseRequestHandler):
    """Reads a request (over TLS when the server has a context), then runs the server's answer."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30)
        try:
            tls: ssl.SSLContext | None = self.server.tls  # type: ignore[attr-defined]
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=True)
            seen = b""
            while b"\r\n\r\n" not in seen:
                piece = sock.recv(65536)
                if not piece:
                    return
                seen += piece
            head, _, body = seen.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += sock.recv(65536)
            self.server.answer(sock)  # type: ignore[attr-defined]
        except OSError:  # the client gave up: what these servers are for
            pass


class _Raw(socketserver.BaseRequestHandler):
    """Runs the server's answer on the connection as it comes: before any TLS or request."""

    def handle(self) -> None:
        self.request.settimeout(30)
        with contextlib.suppress(OSError):  # the client gave up
            self.server.answer(self.request)  # type: ignore[attr-defined]


@contextmanager
def serving(answer: Answer, tls: ssl.SSLContext | None = None, *, handler: type[socketserver.BaseRequestHandler]
            = _Handler, scheme: str | None = None) -> Iterator[str]:
    """A server on 127.0.0.1 that reads each request (over TLS with ``tls``) and then runs
    ``answer`` on its socket; its URL."""
    server = socketserver.ThreadingTCPServer((HOST, 0), handler)
    server.daemon_threads = True
    server.answer = answer  # type: ignore[attr-defined]
    server.tls = tls  # type: ignore[attr-defined]
    # Polled often: shutdown() waits for the poll, and every test shuts a server down.
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"{scheme or ('https' if tls else 'http')}://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls(pki: Pki) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server.cert, pki.server.key)
    return context


def _streamed(pieces: Iterable[bytes], length: int | None = None, status: bytes = b"200 OK") -> Answer:
    """An answer whose body is sent piece by piece as ``pieces`` makes it (with its length, if given)."""

    def answer(sock: socket.socket) -> None:
        framing = b"Content-Length: %d\r\n" % length if length is not None else b"Connection: close\r\n"
        sock.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + framing + b"\r\n")
        for piece in pieces:
            sock.sendall(piece)

    return answer


def _json_answer(body: bytes) -> Answer:
    return _streamed([body], len(body))


def _vector(*elements: dict) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": list(elements)}}).encode()


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


def _fleet_here(*args: str) -> Run:
    """``mig-exporter fleet ARGS`` in this process, through the command's entry point, with none
    of the caller's MIG_EXPORTER_* variables."""
    out, err = io.StringIO(), io.StringIO()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MIG_EXPORTER_")}
    code = 0
    with mock.patch.dict(os.environ, clean, clear=True), redirect_stdout(out), redirect_stderr(err):
        try:
            main(["fleet", *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Run(code, out.getvalue(), err.getvalue())


def _within(bound_s: float, run: Callable[[], T]) -> T:
    """``run()`` in a thread; the test fails if it is still running after ``bound_s``."""
    done: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            done.append(run())
        except BaseException as e:  # raised again in the test's thread
            failed.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"still running after {bound_s} s: the deadline did not hold"
    if failed:
        raise failed[0]
    return done[0]


# A wrapper that runs fleet and prints, last, its peak RSS in KiB (the children's ru_maxrss,
# which counts only fleet: the wrapper has started no other child).
_PEAK = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(done.returncode)
"""


def _fleet_peak(*args: str, bound_s: float = 60) -> tuple[Run, int]:
    """``mig-exporter fleet ARGS`` as a subprocess: the run and its peak RSS in MiB."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MIG_EXPORTER_")}
    done = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "mig_exporter", "fleet", *args],
                          capture_output=True, text=True, timeout=bound_s, env=clean)
    out, _, peak = done.stdout.rstrip("\n").rpartition("\n")
    if not out and not peak.isdigit():
        out, peak = peak, "0"
    return Run(done.returncode, out, done.stderr), int(peak) // 1024


def _cannot_ask(done: Run) -> str:
    """fleet exited 3 with one error line and no traceback; its stderr."""
    assert done.code == 3, (done.code, done.stdout, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith("mig-exporter: error: cannot ask the Prometheus: "), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]
    return done.stderr


# --- one deadline for the whole exchange ----------------------------------------------------------


def _endless(sock: socket.socket) -> None:
    """A 200 with no length that never ends: JSON's opening, then spaces, 10 KiB a second (each
    send in time for any per-operation timeout, and each of fleet's 256 KiB reads past the bound:
    only the deadline ends one)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{")
    until = time.monotonic() + DRAG_S
    while time.monotonic() < until:
        sock.sendall(b" " * 512)
        time.sleep(0.05)


def _trickling(sock: socket.socket) -> None:
    """A right answer, a byte every 0.2 s: the whole of it would take minutes."""
    body = _vector(*({"metric": {"class": f"c{i}"}, "value": [1, "1"]} for i in range(50)))
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    for byte in body:
        sock.sendall(bytes([byte]))
        time.sleep(0.2)


def _slow_headers(sock: socket.socket) -> None:
    """A status line, then headers that never end, a byte every 0.2 s."""
    sock.sendall(b"HTTP/1.1 200 OK\r\n")
    until = time.monotonic() + DRAG_S
    while time.monotonic() < until:
        sock.sendall(b"X")
        time.sleep(0.2)


def _slow_handshake(sock: socket.socket) -> None:
    """A TLS server that takes the ClientHello, then sends its answer's record a byte every 0.2 s:
    a record header that announces 16 KiB, then the record itself."""
    sock.recv(65536)
    sock.sendall(b"\x16\x03\x03\x40\x00")
    until = time.monotonic() + DRAG_S
    while time.monotonic() < until:
        sock.sendall(b"\x00")
        time.sleep(0.2)


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("answer", [_endless, _trickling, _slow_headers], ids=["endless", "trickling", "slow-headers"])
def test_fleet_stops_at_its_timeout_however_the_answer_drags(answer, scheme, tls, pki):
    """--timeout bounds the whole exchange (every query of it), not each socket operation: on
    3139059 each of these ran until the server stopped (60 s in the campaign), and over https on
    0ae2a05 (the timer shut the plain socket the TLS one had detached). Each piece comes well
    within --timeout; only the exchange's deadline ends it within the bound."""
    ca = ("--prometheus.ca-file", str(pki.ca.cert)) if scheme == "https" else ()
    with serving(answer, tls if scheme == "https" else None) as url:
        started = time.monotonic()
        done = _within(BOUND_S, lambda: _fleet_here("--prometheus", url, "--timeout", "1", *ca))
        took = time.monotonic() - started
    said = _cannot_ask(done)
    assert f"{url}/api/v1/query: no answer within 1 s (fleet's --timeout, for the whole exchange)" in said
    assert took >= 1.0, took  # the deadline, not an error before it, ended the exchange


def test_fleet_stops_at_its_timeout_when_the_tls_handshake_trickles(pki):
    with serving(_slow_handshake, handler=_Raw, scheme="https") as url:
        done = _within(BOUND_S, lambda: _fleet_here("--prometheus", url, "--timeout", "1",
                                                    "--prometheus.ca-file", str(pki.ca.cert)))
    assert f"{url}/api/v1/query: no answer within 1 s (fleet's --timeout, for the whole exchange)" in _cannot_ask(done)


def test_the_deadline_ends_a_trickling_tls_handshake_whatever_the_socket_timeout(pki):
    """The handshake runs inside connect, after wrap_socket has detached the plain socket: the
    deadline reaches it through a handle of its own. Here the socket timeout (30 s) is no bound:
    only the deadline (1 s) is."""
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    watch = _Watch(1.0)
    with serving(_slow_handshake, handler=_Raw, scheme="https") as url:
        port = int(url.rsplit(":", 1)[1])
        connection = _watched(http.client.HTTPSConnection, lambda: watch)(HOST, port, timeout=30, context=context)
        with pytest.raises(OSError):
            _within(BOUND_S, connection.connect)
    watch.stop()
    assert watch.passed


def test_a_name_that_never_resolves_is_inside_the_deadline(monkeypatch):
    """getaddrinfo has its own timeouts (5 s a try, retries), not fleet's: it is asked in a thread
    that fleet stops waiting for at the deadline."""
    answered = threading.Event()
    real = socket.getaddrinfo

    def hung(host, port, *args, **kwargs):
        if host == "prometheus.hung.test" and not (args[3:4] and args[3] & socket.AI_NUMERICHOST):
            answered.wait(DRAG_S)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    try:
        done = _within(BOUND_S, lambda: _fleet_here("--prometheus", "http://prometheus.hung.test:9090",
                                                    "--timeout", "1"))
    finally:
        answered.set()
    assert ("http://prometheus.hung.test:9090/api/v1/query: no answer within 1 s (fleet's --timeout, for the "
            "whole exchange)") in _cannot_ask(done)


@contextmanager
def _blackhole() -> Iterator[tuple[str, int]]:
    """An address whose connects hang: a listener whose accept queue is full drops each SYN."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(0)
    address = listener.getsockname()
    fill = [socket.socket() for _ in range(3)]
    for sock in fill:
        sock.setblocking(False)
        sock.connect_ex(address)
    try:
        yield address
    finally:
        for sock in fill:
            sock.close()
        listener.close()


def _resolving_to(monkeypatch, name: str, addresses: list[tuple[str, int]]) -> None:
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host != name:
            return real(host, port, *args, **kwargs)
        if args[3:4] and args[3] & socket.AI_NUMERICHOST:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", a) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def test_a_name_of_eight_blackholed_addresses_takes_one_timeout_not_eight(monkeypatch):
    """socket.create_connection gives each address the whole timeout: 8 s here on 0ae2a05."""
    with _blackhole() as hole:
        _resolving_to(monkeypatch, "prometheus.blackholed.test", [hole] * 8)
        done = _within(BOUND_S - 2, lambda: _fleet_here("--prometheus", "http://prometheus.blackholed.test:9090",
                                                        "--timeout", "1"))
    assert "no answer within 1 s (fleet's --timeout, for the whole exchange)" in _cannot_ask(done)


def test_a_blackholed_first_address_leaves_the_next_its_share_of_the_time(monkeypatch):
    """As Go's dialer does, each address gets its share of what is left, 2 s at least: the second
    address answers within a 3 s timeout (create_connection gave the first all 3 s)."""
    body = _vector({"metric": {"class": "a100-80g-mig-1g.10gb"}, "value": [1, "1"]})
    with _blackhole() as hole, serving(_json_answer(body)) as url:
        _resolving_to(monkeypatch, "prometheus.half.test", [hole, (HOST, int(url.rsplit(":", 1)[1]))])
        started = time.monotonic()
        answer = _within(BOUND_S, lambda: PrometheusClient("http://prometheus.half.test:9090", 3.0).query("up"))
    assert answer == [{"metric": {"class": "a100-80g-mig-1g.10gb"}, "value": [1, "1"]}]
    assert 2.0 <= time.monotonic() - started < 3.0


def test_a_slow_exchange_of_many_queries_shares_one_deadline():
    """Each query answers in 0.4 s, within a 1 s timeout; fleet asks six. With a timeout per
    query all six are asked and answered (2.4 s); with one deadline the exchange stops in the
    third at the latest, since three take 1.2 s."""
    body = _vector({"metric": {"class": "a100-80g-mig-1g.10gb"}, "value": [1, "1"]})
    asked: list[float] = []

    def slow(sock: socket.socket) -> None:
        asked.append(time.monotonic())
        time.sleep(0.4)
        _json_answer(body)(sock)

    with serving(slow) as url, pytest.raises(FleetError, match=r"no answer within 1 s"):
        read_fleet(PrometheusClient(url, 1.0))
    assert 1 <= len(asked) <= 3, asked


# --- memory: at most 64 MiB read, series bounded ------------------------------------------------


_GIB_HEAD = b'{"status": "success", "data": {"resultType": "vector", "result": ['
_GIB_CHUNK = b'{"metric": {"class": "x"}, "value": [1, "1"]}, ' * 20000


def _gib() -> Iterator[bytes]:
    yield _GIB_HEAD
    for _ in range(2**30 // len(_GIB_CHUNK)):
        yield _GIB_CHUNK


def test_a_1_gib_answer_is_refused_at_64_mib_and_fleet_stays_under_200_mib():
    """On 3139059 a 1 GiB body took 5.16 GiB of RSS. Now at most 64 MiB of it is read and
    refused unparsed."""
    with serving(_streamed(_gib())) as url:
        done, peak_mib = _fleet_peak("--prometheus", url, "--timeout", "30", bound_s=60)
    assert f"the answer is over {ANSWER_LIMIT // MiB} MiB: refused unread" in _cannot_ask(done)
    assert 0 < peak_mib < 200, peak_mib


def test_an_answer_whose_content_length_says_1_gib_is_refused_unread():
    """Nothing of its body is read: the server sends none, and fleet does not wait for any (it
    answers at once, not at its 30 s timeout)."""

    def headers_only(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
        time.sleep(DRAG_S)

    with serving(headers_only) as url:
        done = _within(BOUND_S, lambda: _fleet_here("--prometheus", url, "--timeout", "30"))
    assert f"{url}/api/v1/query: the answer is over {ANSWER_LIMIT // MiB} MiB: refused unread" in _cannot_ask(done)


def _many(element: bytes, count: int, head: bytes, tail: bytes) -> tuple[Iterator[bytes], int]:
    """``head``, ``count`` copies of ``element`` joined by commas, ``tail``: pieces and length.
    One piece of 100 000 copies is made, and sent again and again."""
    per_piece = 100_000
    piece = (element + b",") * per_piece

    def pieces() -> Iterator[bytes]:
        yield head
        for _ in range((count - 1) // per_piece):
            yield piece
        yield (element + b",") * ((count - 1) % per_piece) + element + tail

    return pieces(), len(head) + count * len(element) + (count - 1) + len(tail)


def test_an_answer_of_a_million_series_is_refused_with_a_reason_before_it_is_built():
    """1 000 000 series in a compact 38 MB answer (under the 64 MiB read): on 3139059 it took
    1.17 GiB and 37 s. Its braces are counted before it is parsed, and it is refused unparsed."""
    pieces, length = _many(b'{"metric":{"class":"x"},"value":[1,"1"]}', 1_000_000,
                           b'{"status":"success","data":{"resultType":"vector","result":[', b"]}}")
    assert length < ANSWER_LIMIT
    with serving(_streamed(pieces, length)) as url:
        done, peak_mib = _fleet_peak("--prometheus", url, "--timeout", "30", bound_s=60)
    assert f"the answer lists more than {MAX_SERIES} series: refused" in _cannot_ask(done)
    assert 0 < peak_mib < 200, peak_mib


def test_thirty_million_numbers_in_one_array_are_refused_unparsed():
    """No object to count, but a pointer each once parsed: the commas bound the values."""
    pieces, length = _many(b"1", 30_000_001, b'{"status":"success","data":{"resultType":"vector","result":[',
                           b"]}}")
    with serving(_streamed(pieces, length)) as url:
        done, peak_mib = _fleet_peak("--prometheus", url, "--timeout", "30", bound_s=60)
    assert "the answer holds more than 1000000 values: refused unparsed" in _cannot_ask(done)
    assert 0 < peak_mib < 200, peak_mib


def test_json_nested_past_pythons_stack_is_not_json_not_a_traceback():
    with serving(_json_answer(b"[" * 1_000_000)) as url:
        done = _fleet_here("--prometheus", url)
    assert f"{url}/api/v1/query: the answer is not JSON (is this a Prometheus?)" in _cannot_ask(done)


# --- NaN, Inf and odd labels ------------------------------------------------------------------


def test_nan_and_infinite_counts_read_as_unknown_not_as_a_traceback():
    """Every query answers NaN, +Inf or -Inf for a class: fleet prints its table, with those
    counts as 0 and the memory as unknown."""
    body = _vector({"metric": {"class": "a100-80g-mig-1g.10gb"}, "value": [1, "NaN"]},
                   {"metric": {"class": "a100-80g-mig-2g.20gb"}, "value": [1, "+Inf"]},
                   {"metric": {"class": "a100-80g-mig-3g.40gb"}, "value": [1, "-Inf"]})
    with serving(_json_answer(body)) as url:
        done = _fleet_here("--prometheus", url)
    assert done.code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["CLASS", "DEVICES", "FREE", "IN", "USE", "UNKNOWN", "MEMORY", "FREE"]
    assert lines[1].split() == ["a100-80g-mig-1g.10gb", "0", "0", "0", "0", "?"]
    assert lines[2].split() == ["a100-80g-mig-2g.20gb", "0", "0", "0", "0", "?"]
    assert lines[3].split() == ["a100-80g-mig-3g.40gb", "0", "0", "0", "0", "?"]


@pytest.mark.parametrize("metric", [{"class": 5}, {"class": None}, {"class": ["x"]}, {"class": {"a": "b"}}])
def test_labels_that_are_not_strings_are_refused_with_a_reason(metric):
    with serving(_json_answer(_vector({"metric": metric, "value": [1, "1"]}))) as url:
        done = _fleet_here("--prometheus", url)
    assert "not a Prometheus instant vector's (each a metric of string labels" in _cannot_ask(done)


@pytest.mark.parametrize(("data", "named"), [
    ({"resultType": "matrix", "result": []}, "'matrix'"),
    # Escaped and cut to 40 characters between escapes: 14 for \x1b[2J\u202ex, 25 y, the mark.
    ({"resultType": "\x1b[2J\u202ex" + "y" * 100, "result": []}, "'\\x1b[2J\\u202ex" + "y" * 25 + "\u2026'"),
    ([1, 2], "'list'"),
], ids=["matrix", "hostile-type", "list"])
def test_an_answer_that_is_not_a_vector_is_refused_and_says_what_it_is(data, named):
    body = json.dumps({"status": "success", "data": data}).encode()
    with serving(_json_answer(body)) as url:
        done = _fleet_here("--prometheus", url)
    assert f"{url}/api/v1/query: expected an instant vector, got {named}\n" in _cannot_ask(done)


# --- error bodies, redirects -------------------------------------------------------------------


HOSTILE = "\x1b]0;pwned\x07\x1b[2J\r\x85\x9b31m\u202eALL GPUS HEALTHY\u2028\nERROR forged line"


def _no_raw_controls(text: str) -> None:
    """Nothing a terminal may obey or draw as nothing: no byte below 0x20 but the layout's
    newlines, no DEL, no C1, no format character (bidi controls, zero-width ones, the BOM), no
    separator but the space, no surrogate."""
    bad = [c for c in text if c != "\n" and not c.isprintable()]
    assert not bad, (bad, text)


def test_a_50_mb_error_body_is_cut_to_one_escaped_line():
    """On 3139059 it was echoed whole, controls and all."""
    first = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eALL GPUS HEALTHY\rERROR forged line\n".encode()
    error = _streamed([first, *([b"x" * MiB] * 50)], 50 * 10**6, status=b"500 Internal Server Error")
    with serving(error) as url:
        done = _fleet_here("--prometheus", url)
    said = _cannot_ask(done)
    assert len(said) < 400
    # Its first line only (a CR ends a line too), every control in it escaped.
    assert said.endswith("HTTP 500: \\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202eALL GPUS HEALTHY\n"), said
    _no_raw_controls(said)


@pytest.mark.parametrize("location", ["ftp://anonymous@127.0.0.1:21/pub", "http://127.0.0.1:1/api/v1/query"])
def test_a_redirect_is_not_followed_to_ftp_nor_to_another_port(location):
    """Stricter than following it only within the host: followed nowhere, the place it names shown."""
    asked: list[float] = []

    def redirect(sock: socket.socket) -> None:
        asked.append(time.monotonic())
        sock.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + location.encode()
                     + b"\r\nContent-Length: 0\r\n\r\n")

    with serving(redirect) as url:
        done = _fleet_here("--prometheus", url)
    said = _cannot_ask(done)
    shown = location.replace("anonymous@", "***@")
    assert said.endswith(f"{url}/api/v1/query: HTTP 307: Temporary Redirect (a redirect to {shown}; fleet follows "
                         "none: give the URL it points to)\n"), said
    assert "anonymous" not in said
    assert len(asked) == 1  # asked once, and not again where it points


# --- names on the terminal --------------------------------------------------------------------


def test_hostile_label_values_reach_the_text_output_made_visible():
    """A class, an instance, a label, a device and a UUID made of terminal controls: the table
    shows each escaped (``\\x1b``, ``\\u202e``), one line per row."""
    node = Node(f"node{HOSTILE}:10064", (("cluster", HOSTILE), ("job", "mig-exporter")))
    fleet = Fleet((ClassInFleet(HOSTILE, 1, 1),), (node,), HOSTILE,
                  (NodeWithFree(node.instance, 1, node.labels),),
                  (FreeDevice(node, f"card0/{HOSTILE}", 0, f"MIG-{HOSTILE}", 1, 0, 2**30),))
    text = render_text(fleet)
    _no_raw_controls(text)
    assert "\\x1b]0;pwned\\x07" in text and "\\u202eALL GPUS HEALTHY\\u2028\\x0aERROR forged line" in text
    # The layout's own lines only: the table's two, a blank, the silent nodes, a blank, the title,
    # the devices' header and its row.
    assert len(text.splitlines()) == 8, text
    nodes_view = render_text(Fleet(fleet.classes, fleet.not_reporting, HOSTILE, fleet.nodes))
    _no_raw_controls(nodes_view)
    assert len(nodes_view.splitlines()) == 7, nodes_view


def test_hostile_names_from_a_prometheus_answer_reach_the_terminal_escaped():
    """The same end to end, from the answer of a server: fleet's stdout holds no raw control, a
    zero-width space or a lone surrogate (JSON can carry one) shows as its escape, and a
    backslash as two, so that a name holding the text ``\\x1b`` does not read as one holding ESC."""
    body = _vector({"metric": {"class": HOSTILE, "instance": HOSTILE}, "value": [1, "2"]},
                   {"metric": {"class": "gpu\u200b\ud800\\x1b"}, "value": [1, "1"]})
    with serving(_json_answer(body)) as url:
        done = _fleet_here("--prometheus", url)
    assert done.code == 0, done.stderr
    _no_raw_controls(done.stdout)
    done.stdout.encode("utf-8")  # what a terminal's encoder must take: no surrogate left
    assert "\\u202eALL GPUS HEALTHY" in done.stdout
    assert "gpu\\u200b\\ud800\\\\x1b " in done.stdout


def test_outside_text_is_cut_between_escapes_never_inside_one():
    """for_terminal escapes as status and doctor show names (a backslash doubled), and its cut
    to a length keeps each escape whole."""
    assert for_terminal("\x1b" * 10, 10) == "\\x1b\\x1b\u2026"
    assert for_terminal("ab\\", 3) == "ab\u2026"
    assert for_terminal("a\\x1b", 10) == "a\\\\x1b"
    assert for_terminal("x" * 300, 200) == "x" * 199 + "\u2026"
    assert for_terminal("x" * 200, 200) == "x" * 200


def test_peak_rss_wrapper_counts_the_child():
    """The RSS figures above come from the children's ru_maxrss: a child that holds 100 MiB shows."""
    done = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-c", "x = b'1' * (100 * 2**20)"],
                          capture_output=True, text=True, timeout=30)
    assert int(done.stdout.split()[-1]) // 1024 >= 100
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_the_pki_fixture_serves_what_the_client_trusts(tls, pki):
    """The https cases above fail at the deadline, not at the certificate: a right answer over
    the same server and CA reads."""
    body = _vector({"metric": {"class": "a100-80g-mig-1g.10gb"}, "value": [1, "1"]})
    with serving(_json_answer(body), tls) as url:
        done = _fleet_here("--prometheus", url, "--prometheus.ca-file", str(Path(pki.ca.cert)), "--output", "json")
    assert done.code == 0, done.stderr
    assert [c["class"] for c in json.loads(done.stdout)["classes"]] == ["a100-80g-mig-1g.10gb"]
