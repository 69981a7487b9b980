"""Every HTTP connection, owned by one event-loop thread: accepting, the cap on open
connections, TLS handshakes, reading a request's head and body under a deadline and a
size cap, writing its answer as the socket drains under a deadline, and keep-alive
between requests.

A connection holds no thread while it waits: only a complete request is handed to a
bounded pool of worker threads (docs/reliability.md, "The port"), which make its answer
and hand the bytes back to the loop; the loop writes them. So a client that sends one
header byte every 10 s, holds thousands of connections, or never reads its answers, costs
a socket and a buffer each, within the cap, and never a thread. A pipelining client's next
request is read only once the answer before it has drained: one answer per connection is
queued, at most. ``/-/healthy`` has a pool of its own, so it answers while scrapes fill the
other.

A write that fails is the client's doing (it reset, closed or timed out; under TLS an
``SSLEOFError`` and the like): the connection is closed and that is logged at debug level,
and an answer not drained by its deadline closes its connection with one rate-limited line.

What is refused here (a malformed head, headers too large, a head too slow, a conflicting
``Content-Length``) is answered 4xx and closed, logged one line per reason and rate-limited.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import itertools
import logging
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from mig_exporter.core.malloc_tuning import release_free_memory
from mig_exporter.core.ratelog import RateLimitedLog

log = logging.getLogger("mig_exporter.http")

_TLS_HANDSHAKE_RECORD = 0x16
_PLAIN_HTTP_ON_TLS = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
    b"Content-Length: 48\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
)
_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")
_BLANK_LINES = re.compile(rb"(?:\r?\n)+")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_VERSION = re.compile(rb"HTTP/([0-9])\.[0-9]")
_RECV_BYTES = 65536
# How long a closing connection is drained so that unread request bytes do not turn the
# close into a reset that overtakes the answer.
_LINGER_S = 2.0
_ACCEPT_BACKOFF_S = 0.1
_CAP_RECOVERY_S = 10.0
_TITLES = {400: "Bad Request", 505: "HTTP Version Not Supported"}
_TICK_S = 0.25
# One TLS record's plaintext: a non-blocking SSL write that would block is retried with the same bytes.
_TLS_SEND_BYTES = 16384
_IOV_MAX = 64
# The kernel's receive buffer of each connection (inherited from the listener). A request is at
# most 128 KiB and is read only once the answer before it has drained, so a client that pipelines
# without reading its answers has no more than this waiting in the kernel for it; autotuned, it
# grows to net.ipv4.tcp_rmem's maximum (32 MiB on some hosts), and 70 such clients once took the
# host's TCP memory to its pressure limit, which stalls every connection on the host.
_RECV_BUFFER_BYTES = 256 * 1024
# What of its answers waits unsent in the kernel for a connection (TCP_NOTSENT_LOWAT): past it, the
# socket does not take more, and its next request is not read. A client that never reads then has
# this much queued for it, not the autotuned send buffer (megabytes on loopback: 70 such clients
# once cost 4.4 s of CPU answering requests into their buffers before they stalled). What is in
# flight is not counted, so a reading client is not slowed: the socket is writable again as soon
# as the unsent bytes fall under it.
_UNSENT_BYTES = 64 * 1024
# When the open connections fall to a quarter of their peak, and that peak was a crowd, the
# memory they held is given back to the system (core/malloc_tuning.py), at most this often.
_CROWD = 64
_RELEASE_EVERY_S = 10.0
# A writer whose client has taken less than _PROGRESS_BYTES of its answer in this long is stalled:
# past the bound on queued answer bytes, and at the connection cap, it is closed, the longest
# stalled first (issue 38). A reader that drains never is: a Prometheus in a GC pause, a slow WAN
# or TLS reader whose send buffer stays full for a second or two, or a loop busy for a moment, all
# take that much within the window. A sixth of the write deadline (30 s); a client that takes 16 KiB
# every 5 s to stay "draining" holds its one answer until that deadline, no longer.
_STALLED_S = 5.0
_PROGRESS_BYTES = 16 * 1024
# An answer this small is queued even past the bound: /-/healthy must answer while the bound is
# reached (a liveness probe's 503 restarts the pod), and 512 connections hold at most 2 MiB of them.
_SMALL_ANSWER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection and all of them together may hold. Go's http.Server has each as a
    setting (ReadHeaderTimeout, IdleTimeout, MaxHeaderBytes); the cap on connections is ours."""

    max_connections: int = 512
    # From a request's first byte (or a new connection's accept) to the end of its head and body.
    header_timeout_s: float = 10.0
    # A kept-alive connection between requests. Prometheus scrapes every 15-60 s on one connection.
    idle_timeout_s: float = 120.0
    max_header_bytes: int = 64 * 1024
    # A request with a larger body (none is expected) is answered and its connection closed.
    max_body_bytes: int = 64 * 1024
    tls_handshake_timeout_s: float = 10.0
    # Writing one answer, from the moment it is ready: a client that does not read it by then is
    # closed. It holds no thread meanwhile, only its connection and that answer (Go's WriteTimeout).
    write_timeout_s: float = 30.0
    # The answer bytes all writers still hold, together (issue 38), each bytes object counted once
    # however many connections write it (``metrics/exporter.py`` shares them), in full until the
    # last of them has sent it: what stays resident. Past it, the writers stalled longest are
    # closed first; a new answer that would still pass it is answered 503 instead, unless no other
    # answer is queued (one answer is always served, however large) or it is of a few KiB
    # (/-/healthy). docs/security.md.
    max_queued_bytes: int = 64 * 1024 * 1024
    workers: int = 64
    queued_requests: int = 256
    health_workers: int = 2
    # Requests whose credentials are not cached wait for a bcrypt check here (basic_auth.py), in its
    # fair queue; more wait in the loop without a thread.
    auth_workers: int = 32
    auth_queued_requests: int = 0


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one, as Go's runtime does; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return soft, hard
        except (ValueError, OSError):
            pass
    return soft, soft


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True, slots=True)
class Request:
    """A complete request as read off the wire: its head and body, and what the loop learnt of it."""

    data: bytes
    path: str
    close_after: bool  # a body the loop did not read (chunked, too large, or not sent yet): close after answering
    authorization: str | None = None
    received_at: float = 0.0  # time.monotonic() when the loop had it whole


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Head:
    path: str
    body_bytes: int | None  # None: the body is not to be read (chunked, or too large)
    close_after: bool
    authorization: str | None
    # Expect: 100-continue: the client sends its body only when told to. No handler reads a body,
    # so none is asked for: the request is answered without it and the connection closed, as Go does.
    expects_continue: bool = False


def parse_head(head: bytes, max_body_bytes: int) -> Head:
    """What framing and routing need of a request head, or BadRequest; http.server parses
    the rest in the worker."""
    if b"\0" in head or re.search(rb"\r(?!\n)", head):
        # http.client splits header lines at a bare CR; a NUL has no place in a head. Both would
        # let the loop and the handler read different headers.
        raise BadRequest(400, "a bare CR or a NUL in the request head")
    lines = re.split(rb"\r?\n", head)
    # Split as http.server does, as text: it also splits at \x85 and \xa0, which bytes.split() keeps.
    words = lines[0].decode("latin-1").split()
    if len(words) != 3:
        # "GET /path" alone is HTTP/0.9, which has no head and no status line to answer with.
        raise BadRequest(400, "no HTTP version in the request line" if len(words) == 2
                         else "malformed request line")
    version = _VERSION.fullmatch(words[2].encode("latin-1"))
    if version is None:
        # http.server would answer it as HTTP/0.9: a body without a status line.
        raise BadRequest(400, "malformed HTTP version")
    if version.group(1) != b"1":
        raise BadRequest(505, "HTTP version not supported")
    lengths: set[bytes] = set()
    chunked = False
    expects_continue = False
    authorization: str | None = None
    for line in lines[1:]:
        if not line:
            continue
        if line[:1] in (b" ", b"\t"):
            raise BadRequest(400, "folded header line")
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        name = name.lower()
        if name == b"content-length":
            for item in value.split(b","):
                item = item.strip()
                if not _DIGITS.fullmatch(item):
                    raise BadRequest(400, "invalid Content-Length")
                lengths.add(item.lstrip(b"0") or b"0")
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"authorization":
            if authorization is not None:  # the loop routes on one, the handler must check that one
                raise BadRequest(400, "more than one Authorization header")
            authorization = value.strip().decode("latin-1")
        elif name == b"expect":
            expects_continue = expects_continue or value.strip().lower() == b"100-continue"
    if len(lengths) > 1:
        # RFC 9112 6.3: differing lengths are a smuggling attempt or a broken client.
        raise BadRequest(400, "conflicting Content-Length headers")
    if chunked and lengths:
        raise BadRequest(400, "both Transfer-Encoding and Content-Length")
    try:
        path = urlsplit(words[1]).path
    except ValueError:  # "//[" and the like: an IPv6 literal that does not close
        raise BadRequest(400, "malformed request target") from None
    if chunked:
        return Head(path, None, True, authorization)
    length = int(lengths.pop()) if lengths else 0
    if length > max_body_bytes:
        return Head(path, None, True, authorization)
    return Head(path, length, False, authorization, expects_continue and length > 0)


class _Pool:
    """Daemon worker threads, started as needed up to ``size``, with a bounded queue: a hung
    read never blocks exit, and a flood gets a prompt 503 instead of an ever longer wait."""

    def __init__(self, name: str, size: int, queued: int) -> None:
        self.name = name
        self.size = size
        self.queued = queued
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # bounded by submit
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._waiting = 0  # work waiting for a thread

    def submit(self, work: Callable[[], None]) -> bool:
        """Queue ``work``; False when every thread is busy and ``queued`` are waiting already
        (with ``queued`` 0: when no thread is free or can be started)."""
        with self._lock:
            free = self._idle + self.size - len(self._threads)
            if self._waiting >= free + self.queued:
                return False
            self._waiting += 1
            if self._waiting > self._idle and len(self._threads) < self.size:
                thread = threading.Thread(target=self._run, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                self._idle += 1
                thread.start()
        self._queue.put_nowait(work)
        return True

    def has_room(self) -> bool:
        with self._lock:
            return self._waiting < self._idle + self.size - len(self._threads) + self.queued

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._waiting -= 1
            if work is None:
                return
            try:
                work()
            except Exception:  # a bug; the work logs its own failures
                log.exception("a worker of %s failed", self.name)
            with self._lock:
                self._idle += 1

    def stop(self) -> None:
        with self._lock:
            count = len(self._threads)
        for _ in range(count):
            self._queue.put_nowait(None)


# Connection states.
_HANDSHAKE = "handshake"  # TLS: waiting for the first byte, then the handshake
_HEAD = "head"  # waiting for a request, or reading one
_BUSY = "busy"  # a worker has it
_PARKED = "parked"  # a whole request waiting, without a thread, for a place in the "auth" pool
_WRITING = "writing"  # its answer going out as the socket drains; nothing more is read meanwhile
_CLOSING = "closing"  # answered; draining what the client still sends, then closed


@runtime_checkable
class Held(Protocol):
    """Bytes of an answer that want to know whether a connection still has them queued: told +1
    when a connection queues them, -1 when it has sent them all or is closed (the encodings of
    ``metrics/exporter.py``'s ``Answer``, which are given as they are to later requests while
    some client has them queued)."""

    def hold(self, delta: int) -> None: ...


class Connection:
    """One client connection, as the loop sees it."""

    __slots__ = ("buffer", "deadline", "head", "held", "in_head", "keep", "key", "opened", "out", "peer",
                 "progressed", "scanned", "served", "sock", "state", "taken", "tls_started", "watching")

    def __init__(self, sock: socket.socket, peer: tuple[str, int], now: float) -> None:
        self.sock: socket.socket = sock
        self.peer = peer
        self.opened = now
        self.buffer = bytearray()
        self.state = _HEAD
        self.deadline = now
        self.served = 0
        self.tls_started = False
        self.key: int | None = None
        self.in_head = False  # a request has begun (more than blank lines): its deadline runs
        self.scanned = 0  # bytes of the buffer known to hold no end of head
        self.head: tuple[int, Head] | None = None  # a head read whole, waiting for its body
        # The answer being written: what is left of each of its buffers (the body is the scrape's
        # shared bytes, never copied), and whether the connection is kept once it has drained.
        self.out: collections.deque[memoryview] = collections.deque()
        self.held: tuple[bytes, ...] = ()  # the bytes objects ``out`` views, each once: the loop's count holds them
        self.keep = False
        # When the client last took _PROGRESS_BYTES of its answer (or the answer came), and what it
        # has taken since.
        self.progressed = now
        self.taken = 0
        self.watching = 0  # the selector events registered for it


def _queued(conn: Connection) -> int:
    """The bytes of its answer a connection has still to write."""
    return sum(len(part) for part in conn.out)


def _stalled(conn: Connection, now: float) -> bool:
    """Whether a writer's client has taken less than ``_PROGRESS_BYTES`` in ``_STALLED_S``."""
    return conn.state == _WRITING and now - conn.progressed >= _STALLED_S


def peer_name(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


class ConnectionLoop:
    """The event loop. ``handle(conn, request)`` runs in a worker and makes the answer to one
    request: its bytes (the buffers to write, in order) and whether the connection may be kept.
    It never touches the socket: the loop writes the answer.
    ``tls()`` gives the SSL context for a new connection (None: plain HTTP) and
    ``client_allowed(cert)`` checks a verified client certificate's SANs."""

    def __init__(
        self,
        listener: socket.socket,
        limits: Limits,
        handle: Callable[[Connection, Request], tuple[list[bytes], bool]],
        tls: Callable[[], tuple[ssl.SSLContext | None, str]],
        client_allowed: Callable[[Any], tuple[bool, str]],  # getpeercert()'s dict
        route: Callable[[Request], str] | None = None,
        priority: Callable[[Connection], int] | None = None,
        tick: Callable[[float], None] | None = None,
    ) -> None:
        self.listener = listener
        self.limits = limits
        self.handle = handle
        self.tls = tls
        self.client_allowed = client_allowed
        self.max_connections = max(8, min(limits.max_connections, open_file_limit() - 64))
        with contextlib.suppress(OSError):
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECV_BUFFER_BYTES)
        self.connections: dict[int, Connection] = {}  # by id()
        self._selector = selectors.DefaultSelector()
        self._returned: queue.SimpleQueue[tuple[Connection, list[bytes], bool]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._accept_paused_until: float | None = None
        self._last_emfile = 0.0
        self._cap = self.max_connections  # what max_connections goes back up to after EMFILE
        # "main" answers the requests; "health" /-/healthy alone, so it answers while scrapes fill
        # "main"; "auth" holds requests whose credentials need a bcrypt check, so a flood of
        # guesses waits there and never in front of a scraper whose credentials are verified.
        self.pools = {
            "main": _Pool("http", limits.workers, limits.queued_requests),
            "health": _Pool("http-health", limits.health_workers, limits.queued_requests),
            "auth": _Pool("http-auth", limits.auth_workers, limits.auth_queued_requests),
        }
        self.route = route or (lambda request: "health" if request.path == "/-/healthy" else "main")
        # Which parked request goes first: the lowest (the peer with the fewest failed checks).
        self.priority = priority or (lambda conn: 0)
        self._last_sweep = 0.0
        self._peak_connections = 0  # since memory was last given back
        self._last_release = 0.0
        self.tick = tick  # called at each sweep, in the loop, with the time: the owner's housekeeping
        self._parked: collections.deque[tuple[Connection, Request]] = collections.deque()
        # The bytes objects writers hold, by id(): [the object, how many connections hold it]; and
        # their total size, each counted once (the bound on queued answer bytes).
        self._held: dict[int, list[Any]] = {}
        self.queued_bytes = 0
        # Refusals, one line per reason and a count of the rest (per server: tests start many).
        self.limited = RateLimitedLog(log)

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``stop()``; a ``stop()`` that came first is not lost."""
        if self._stop.is_set():
            return
        self._stopped.clear()
        try:
            self.listener.setblocking(False)
            self._selector.register(self.listener, selectors.EVENT_READ, None)
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception:  # a bug must not leave the port open and deaf
                    log.exception("the connection loop failed; going on")
                    time.sleep(0.01)  # and not in a tight loop, should it fail again
        finally:
            for fileobj in (self.listener, self._wake_r):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fileobj)
            self._stopped.set()

    def _turn(self) -> None:
        for key, mask in self._selector.select(_TICK_S):
            if key.fileobj is self.listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                self._drain_wake()
            else:
                self._ready(key.data, mask)
        self._take_back()
        self._unpark()
        now = time.monotonic()
        if now - self._last_sweep >= _TICK_S:
            self._last_sweep = now
            self._sweep(now)
            self.limited.flush()
            if self.tick is not None:
                self.tick(now)

    def stop(self) -> None:
        """End ``run`` and wait for it (at once, if it is not running)."""
        self._stop.set()
        self.wake()
        self._stopped.wait()

    def close(self) -> None:
        for conn in list(self.connections.values()):
            self._close(conn)
        for pool in self.pools.values():
            pool.stop()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # already woken, or closed
            self._wake_w.send(b"x")

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # --- accepting --------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._out_of_descriptors(e)
                    if self._accept_paused_until is not None:
                        return
                    continue
                # A pending network error on the new connection (EPROTO, ENETDOWN, EHOSTUNREACH, ...):
                # that connection is lost, the listener is not.
                self.limited.log(("accept", e.errno), logging.WARNING, "accepting a connection failed: %s",
                                 e.strerror or e)
                continue
            now = time.monotonic()
            if len(self.connections) >= self.max_connections and not self._evict(now):
                self.limited.log("cap", logging.WARNING, "connection from %s refused: %d connections open, "
                            "all busy (the cap)", peer_name(address), len(self.connections))
                sock.close()
                continue
            self._open(sock, address, now)

    def _out_of_descriptors(self, e: OSError) -> None:
        """EMFILE: the descriptors ran out before the cap. Lower the cap to what they allow,
        with room to spare, and close the least useful connections down to it; then each new
        connection makes room as at the cap. Only when every connection is busy does accept
        pause, briefly: a full table is never a spin on accept()."""
        now = time.monotonic()
        self._last_emfile = now
        cap = max(8, len(self.connections) - 16)
        if cap < self.max_connections:
            self.max_connections = cap
        self.limited.log("emfile", logging.WARNING, "cannot accept a connection: %s (%d open); the connection "
                         "cap is now %d", e.strerror or e, len(self.connections), self.max_connections)
        evicted = 0
        while len(self.connections) > self.max_connections or not evicted:
            if not self._evict(now):
                break
            evicted += 1
        if not evicted:  # every connection is busy, or the descriptors are held elsewhere
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self.listener)
            self._accept_paused_until = now + _ACCEPT_BACKOFF_S

    def _open(self, sock: socket.socket, address: tuple[str, int], now: float) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers go out at once
        with contextlib.suppress(OSError, AttributeError):  # Linux and macOS have it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _UNSENT_BYTES)
        conn = Connection(sock, address, now)
        conn.deadline = now + self.limits.header_timeout_s
        context, _ = self.tls()
        if context is not None:
            conn.state = _HANDSHAKE
            conn.deadline = now + self.limits.tls_handshake_timeout_s
        self.connections[id(conn)] = conn
        self._peak_connections = max(self._peak_connections, len(self.connections))
        self._watch(conn, selectors.EVENT_READ)

    def _evict(self, now: float) -> bool:
        """Close the connection that is least use to anyone: one that has not sent a whole
        request yet (a slow client's, oldest first), else a writer stalled past ``_STALLED_S``
        (the longest stalled first), else the longest idle one (a Prometheus between scrapes on
        its keep-alive connection: issue 38 found it evicted before stalled writers), and last a
        writer whose client reads. False when every connection is in a worker."""
        best: Connection | None = None
        best_rank: tuple[int, float] | None = None
        for conn in self.connections.values():
            if conn.state == _BUSY:
                continue
            # An answer being drained goes last: it is someone's scrape.
            if conn.served == 0:
                rank = (0, conn.opened)
            elif conn.state == _WRITING:
                rank = (1, conn.progressed) if _stalled(conn, now) else (3, conn.deadline)
            else:
                rank = (2, conn.deadline)
            if best_rank is None or rank < best_rank:
                best, best_rank = conn, rank
        if best is None:
            return False
        self.limited.log("evicted", logging.INFO, "connection from %s closed to make room: %d connections open "
                    "(the cap is %d)", peer_name(best.peer), len(self.connections), self.max_connections)
        self._close(best)
        return True

    # --- reading ----------------------------------------------------------------------------

    def _watch(self, conn: Connection, events: int) -> None:
        try:
            if conn.key is None:
                self._selector.register(conn.sock, events, conn)
                conn.key = conn.sock.fileno()
            elif conn.watching != events:
                self._selector.modify(conn.sock, events, conn)
            conn.watching = events
        except (ValueError, OSError, KeyError):
            self._close(conn)

    def _unwatch(self, conn: Connection) -> None:
        if conn.key is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
            conn.key = None
            conn.watching = 0

    def _ready(self, conn: Connection, mask: int) -> None:
        if id(conn) not in self.connections:
            return
        try:
            if conn.state == _HANDSHAKE:
                self._handshake(conn)
            elif conn.state == _HEAD:
                self._read(conn)
            elif conn.state == _WRITING:
                self._write(conn)
            elif conn.state == _CLOSING:
                self._drain(conn)
            elif conn.state == _PARKED:  # a client that gives up is closed; what it sends is kept, within bounds
                data = self._recv(conn)
                if data == b"":
                    self._close(conn)
                elif data:
                    conn.buffer += data
                    if len(conn.buffer) > self.limits.max_header_bytes + self.limits.max_body_bytes:
                        self._close(conn)
        except (BlockingIOError, InterruptedError):
            return  # woken for nothing
        except (ConnectionError, TimeoutError) as e:
            log.debug("connection from %s ended: %s", peer_name(conn.peer), e)
            self._close(conn)
        except OSError as e:
            log.debug("connection from %s failed: %s", peer_name(conn.peer), e)
            self._close(conn)
        except Exception:  # a bug: this connection goes, the loop and the others stay
            log.exception("connection from %s failed", peer_name(conn.peer))
            self._close(conn)

    def _handshake(self, conn: Connection) -> None:
        context, settings = self.tls()
        if not conn.tls_started:
            first = conn.sock.recv(1, socket.MSG_PEEK)
            if not first:  # a TCP check (a load balancer, a port probe): nothing to report
                self._close(conn)
                return
            if context is None:  # TLS was switched off by a reload: plain HTTP from here
                conn.state = _HEAD
                self._read(conn)
                return
            if first[0] != _TLS_HANDSHAKE_RECORD:
                self.limited.log("plain-on-tls", logging.WARNING, "connection from %s: plain HTTP sent to the HTTPS "
                            "port; answered 400", peer_name(conn.peer))
                with contextlib.suppress(OSError):
                    conn.sock.recv(_RECV_BYTES)
                self._answer_and_close(conn, _PLAIN_HTTP_ON_TLS)
                return
            self._unwatch(conn)
            conn.sock = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            conn.tls_started = True
            self._watch(conn, selectors.EVENT_READ)
        tls = conn.sock
        assert isinstance(tls, ssl.SSLSocket)
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as e:
            reason = tls_reason(e, self.limits.tls_handshake_timeout_s)
            self.limited.log(("tls", reason), logging.WARNING, "TLS handshake with %s failed: %s (%s)",
                        peer_name(conn.peer), reason, settings)
            self._close(conn)
            return
        allowed, why = self.client_allowed(tls.getpeercert())
        if not allowed:
            self.limited.log(("tls-refused", why), logging.WARNING, "TLS connection from %s refused: %s",
                        peer_name(conn.peer), why)
            self._close(conn)
            return
        conn.state = _HEAD
        conn.deadline = time.monotonic() + self.limits.header_timeout_s
        self._watch(conn, selectors.EVENT_READ)
        if tls.pending():
            self._read(conn)

    def _recv(self, conn: Connection) -> bytes | None:
        """What the socket has now: bytes, b"" at the end, None for nothing yet."""
        sock = conn.sock
        try:
            data = sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        if data and isinstance(sock, ssl.SSLSocket):
            while sock.pending():  # decrypted already: the selector will not say so
                more = sock.recv(_RECV_BYTES)
                if not more:
                    break
                data += more
        return data

    def _read(self, conn: Connection) -> None:
        data = self._recv(conn)
        if data is None:
            return
        if not data:
            self._close(conn)
            return
        conn.buffer += data
        self._next_request(conn)

    def _next_request(self, conn: Connection) -> None:
        """Hand a complete request in the buffer to a worker, refuse a bad one, or wait for more."""
        buffer = conn.buffer
        if not conn.in_head:
            blank = _BLANK_LINES.match(buffer)  # RFC 9112 2.2: empty lines before a request are ignored
            if blank:
                del buffer[: blank.end()]
            if not buffer:
                return  # they do not start a request, nor its deadline
            conn.in_head = True
            if conn.served:  # a kept-alive connection's next request: its head's clock starts now
                conn.deadline = time.monotonic() + self.limits.header_timeout_s
        if conn.head is None:
            end = _END_OF_HEAD.search(buffer, max(0, conn.scanned - 3), self.limits.max_header_bytes + 4)
            if end is None:
                conn.scanned = len(buffer)
                if len(buffer) > self.limits.max_header_bytes:
                    self._refuse(conn, 431, "Request Header Fields Too Large",
                                 f"headers over {self.limits.max_header_bytes} bytes")
                return
            try:
                conn.head = end.end(), parse_head(bytes(buffer[: end.end()]), self.limits.max_body_bytes)
            except BadRequest as e:
                self._refuse(conn, e.status, _TITLES[e.status], e.reason)
                return
        head_bytes, parsed = conn.head
        head = bytes(buffer[:head_bytes])
        length = parsed.body_bytes
        now = time.monotonic()
        if length is None or (parsed.expects_continue and len(buffer) < len(head) + length):
            # A body not to be read, or one the client waits to be asked for: answered without
            # it, and closed (what it sends meanwhile is drained, never read as a request).
            request = Request(head, parsed.path, True, parsed.authorization, now)
            del buffer[:]
        else:
            if len(buffer) < len(head) + length:
                return  # the body is still on its way, within the same deadline
            request = Request(bytes(buffer[: len(head) + length]), parsed.path, parsed.close_after,
                              parsed.authorization, now)
            del buffer[: len(head) + length]
        conn.head, conn.scanned, conn.in_head = None, 0, False
        self._dispatch(conn, request)

    def _dispatch(self, conn: Connection, request: Request) -> None:
        route = self.route(request)
        pool = self.pools[route]
        if pool.submit(lambda: self._work(conn, request)):
            conn.state = _BUSY
            self._unwatch(conn)
            return
        if route == "auth":
            # Guesses wait here, holding no thread, rather than being told 503 and coming straight
            # back: a refused flood costs the CPU the scrapers need. Evictable like a slow client.
            conn.state = _PARKED
            conn.deadline = time.monotonic() + self.limits.header_timeout_s
            self._parked.append((conn, request))
            return
        self._refuse(conn, 503, "Service Unavailable", f"{pool.size} workers busy and "
                     f"{pool.queued} requests waiting")

    def _unpark(self) -> None:
        """Hand parked requests to the "auth" pool while it takes them: first those of the peers
        with the fewest failed checks, oldest first among equals, so a peer sending guesses waits
        behind its own guesses and a new scraper does not."""
        pool = self.pools["auth"]
        while self._parked and pool.has_room():
            live = [(conn, request) for conn, request in self._parked
                    if id(conn) in self.connections and conn.state == _PARKED]
            if len(live) != len(self._parked):
                self._parked = collections.deque(live)
                if not live:
                    return
            index = min(range(len(live)), key=lambda i: self.priority(live[i][0]))
            conn, request = live[index]
            if not pool.submit(functools.partial(self._work, conn, request)):
                return
            del self._parked[index]
            conn.state = _BUSY
            self._unwatch(conn)

    def _work(self, conn: Connection, request: Request) -> None:
        """In a worker: make the answer, then hand it and the connection back to the loop."""
        answer: list[bytes] = []
        keep = False
        try:
            answer, keep = self.handle(conn, request)
            keep = keep and not request.close_after
        except Exception:  # a bug: the handler answers its own failures
            log.exception("a request from %s failed", peer_name(conn.peer))
        self._returned.put((conn, answer, keep))
        self.wake()

    def _take_back(self) -> None:
        while True:
            try:
                conn, answer, keep = self._returned.get_nowait()
            except queue.Empty:
                return
            if id(conn) not in self.connections:
                continue
            conn.served += 1
            parts = [part for part in answer if part]
            if not self._room_for(parts):
                self._refuse(conn, 503, "Service Unavailable", f"the answers queued for clients that do not read "
                             f"them are at the bound of {self.limits.max_queued_bytes >> 20} MiB")
                continue
            conn.out = collections.deque(memoryview(part) for part in parts)
            self._hold(conn, parts)
            conn.keep = keep
            conn.state = _WRITING
            conn.progressed = time.monotonic()
            conn.taken = 0
            conn.deadline = conn.progressed + self.limits.write_timeout_s
            self._ready(conn, selectors.EVENT_WRITE)  # its guards: a client fault here is not the loop's

    # --- writing ----------------------------------------------------------------------------

    def _write(self, conn: Connection) -> None:
        """Send what the socket takes now; once the answer has drained, the connection reads its
        next request (or closes). A failed write is the client gone: closed, logged at debug."""
        out = conn.out
        sock = conn.sock
        try:
            while out:
                if isinstance(sock, ssl.SSLSocket):  # no sendmsg under TLS
                    sent = sock.send(out[0][:_TLS_SEND_BYTES])
                else:
                    sent = sock.sendmsg(list(itertools.islice(out, _IOV_MAX)))
                conn.taken += sent
                if conn.taken >= _PROGRESS_BYTES:  # draining, if slowly; a trickle is not
                    conn.progressed = time.monotonic()
                    conn.taken = 0
                while sent and out:
                    first = out[0]
                    if sent >= len(first):
                        sent -= len(first)
                        out.popleft()
                    else:
                        out[0] = first[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except ssl.SSLWantReadError:
            # Only a renegotiation makes a TLS write wait for a read, and OpenSSL refuses those
            # from clients: waiting for READ could spin on the pipelined requests it never takes.
            log.debug("connection from %s closed: its TLS layer asked to read while writing", peer_name(conn.peer))
            self._close(conn)
            return
        except OSError as e:  # BrokenPipe, ConnectionReset, TimeoutError, SSLEOFError and the rest of SSLError
            log.debug("connection from %s ended while its answer was written: %s", peer_name(conn.peer), e)
            self._close(conn)
            return
        self._release(conn)  # all sent: what the client has not read is the kernel's now
        if not conn.keep:
            self._linger(conn)
            return
        conn.state = _HEAD
        conn.deadline = time.monotonic() + (self.limits.header_timeout_s if conn.buffer
                                            else self.limits.idle_timeout_s)
        self._watch(conn, selectors.EVENT_READ)
        if conn.buffer:  # a pipelined request already here
            self._next_request(conn)
        elif isinstance(sock, ssl.SSLSocket) and sock.pending():  # decrypted already: no event will say so
            self._read(conn)

    def _hold(self, conn: Connection, parts: list[bytes]) -> None:
        """Count the bytes objects of the answer ``conn`` now writes, each once however many
        connections write it; tell those that ask (``Held``) that one more connection holds them."""
        distinct = tuple({id(part): part for part in parts}.values())
        for part in distinct:
            entry = self._held.get(id(part))
            if entry is None:
                entry = self._held[id(part)] = [part, 0]
                self.queued_bytes += len(part)
            entry[1] += 1
            if isinstance(part, Held):
                part.hold(1)
        conn.held = distinct

    def _release(self, conn: Connection) -> None:
        """``conn`` holds its answer's bytes no more: sent whole, or the connection closed."""
        for part in conn.held:
            entry = self._held[id(part)]
            entry[1] -= 1
            if not entry[1]:
                del self._held[id(part)]
                self.queued_bytes -= len(part)
            if isinstance(part, Held):
                part.hold(-1)
        conn.held = ()

    def _room_for(self, parts: list[bytes]) -> bool:
        """Whether an answer of ``parts`` may be queued within ``max_queued_bytes``, counting only
        the bytes no writer holds already (a shared answer costs nothing more): past the bound,
        the writers stalled longest are closed first (never a reader that drains). False when
        it would still pass the bound, unless no other answer is queued at all (one answer is
        always served, however large) or it is a small one (``/-/healthy``, a refusal)."""
        bound = self.limits.max_queued_bytes

        def new() -> int:
            return sum(len(part) for part in {id(part): part for part in parts}.values() if id(part) not in self._held)

        def fits() -> bool:
            return self.queued_bytes + new() <= bound

        if fits() or new() <= _SMALL_ANSWER_BYTES:
            return True
        self._close_stalled(time.monotonic(), fits)
        return fits() or not self.queued_bytes

    def _close_stalled(self, now: float, done: Callable[[], bool]) -> None:
        """Close the writers stalled past ``_STALLED_S``, the longest stalled first, until ``done()``.
        Called when a new answer would pass the bound, and at each sweep while the bound is passed."""
        stalled = sorted((conn for conn in self.connections.values() if _stalled(conn, now)),
                         key=lambda conn: conn.progressed)
        for conn in stalled:
            if done():
                return
            self.limited.log(("stalled",), logging.INFO,
                             "connection from %s closed: it took under %d KiB of its answer in %.0fs while the "
                             "answers queued for clients passed %d MiB", peer_name(conn.peer),
                             _PROGRESS_BYTES >> 10, now - conn.progressed, self.limits.max_queued_bytes >> 20)
            self._close(conn)

    # --- refusing and closing ---------------------------------------------------------------

    def _refuse(self, conn: Connection, status: int, title: str, reason: str) -> None:
        self.limited.log(("refused", status, reason), logging.INFO, "request from %s refused: %s; answered %d",
                    peer_name(conn.peer), reason, status)
        body = f"{title}: {reason}\n".encode()
        head = (f"HTTP/1.1 {status} {title}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        self._answer_and_close(conn, head + body)

    def _answer_and_close(self, conn: Connection, answer: bytes) -> None:
        """Write a refusal as any answer, then close: the answer before it on a pipelining
        connection may still be unsent in the kernel, so one send() could take none of it."""
        conn.buffer = bytearray()  # nothing more is read from it as a request
        conn.head, conn.scanned, conn.in_head = None, 0, False
        self._release(conn)
        conn.out = collections.deque([memoryview(answer)])
        self._hold(conn, [answer])
        conn.keep = False
        conn.state = _WRITING
        conn.deadline = time.monotonic() + self.limits.write_timeout_s
        self._write(conn)

    def _linger(self, conn: Connection) -> None:
        """Half-close and drain for a moment: closing with unread bytes would send a reset,
        which may reach the client before the answer does."""
        conn.buffer = bytearray()
        try:
            if isinstance(conn.sock, ssl.SSLSocket):
                raise OSError  # no half-close under TLS without a blocking unwrap: just close
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = _CLOSING
        conn.deadline = time.monotonic() + _LINGER_S
        self._watch(conn, selectors.EVENT_READ)

    def _drain(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._close(conn)

    def _close(self, conn: Connection) -> None:
        self._unwatch(conn)
        conn.out = collections.deque()
        self._release(conn)
        self.connections.pop(id(conn), None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _sweep(self, now: float) -> None:
        """Deadlines: a head too slow, a connection idle too long, a linger done; and accept
        again once its pause is over."""
        if self.max_connections < self._cap and now - self._last_emfile > _CAP_RECOVERY_S:
            # No EMFILE for a while: the descriptors held elsewhere may be back; grow again.
            self.max_connections = min(self._cap, self.max_connections + max(8, self.max_connections // 8))
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            with contextlib.suppress(KeyError, ValueError):
                self._selector.register(self.listener, selectors.EVENT_READ, None)
        for conn in list(self.connections.values()):
            if conn.state == _BUSY or now < conn.deadline:
                continue
            if conn.state == _WRITING:
                self.limited.log("unread", logging.INFO, "connection from %s closed: its answer was not read within "
                                 "%gs", peer_name(conn.peer), self.limits.write_timeout_s)
                self._close(conn)
            elif conn.state == _PARKED:
                self._refuse(conn, 503, "Service Unavailable",
                             f"no place to check the credentials within {self.limits.header_timeout_s:g}s")
            elif conn.state == _HEAD and conn.buffer:
                self._refuse(conn, 408, "Request Timeout",
                             f"no whole request within {self.limits.header_timeout_s:g}s")
            elif conn.state == _HANDSHAKE:
                self.limited.log("tls-timeout", logging.WARNING, "TLS handshake with %s failed: no handshake "
                                 "within %gs", peer_name(conn.peer), self.limits.tls_handshake_timeout_s)
                self._close(conn)
            else:  # idle, or lingered long enough
                self._close(conn)
        if self.queued_bytes > self.limits.max_queued_bytes:  # one answer over it, or the bound lowered
            self._close_stalled(now, lambda: self.queued_bytes <= self.limits.max_queued_bytes)
        self._release_memory(now)

    def _release_memory(self, now: float) -> None:
        """A crowd of connections gone: give back the memory their TLS and socket buffers held,
        which glibc would keep, spread through its heap (docs/reliability.md)."""
        open_now = len(self.connections)
        if (self._peak_connections >= _CROWD and open_now <= self._peak_connections // 4
                and now - self._last_release >= _RELEASE_EVERY_S):
            self._last_release = now
            self._peak_connections = open_now
            release_free_memory()


def tls_reason(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        return f"client certificate not verified: {e.verify_message}"
    if isinstance(e, ssl.SSLError) and e.reason:
        return str(e.reason).lower().replace("_", " ")
    if isinstance(e, TimeoutError | socket.timeout):
        return f"no handshake within {timeout_s:g}s"
    return " ".join(str(e).split()) or type(e).__name__
