"""Issue 38: the answer bytes queued for clients that do not read are bounded in total, each bytes
object counted once however many connections write it. Past the bound the writer stalled longest
is closed first; a new answer that would still pass it is answered 503; the bound is checked again
at each tick of the loop. A client that reads its answer gets it whole, and one that drains,
however slowly, is never taken for stalled."""

from __future__ import annotations

import collections
import dataclasses
import http.client
import selectors
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.core import GaugeMetricFamily

from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web import connections
from mig_exporter.web.connections import Limits
from mig_exporter.web.server import ExporterServer
from slow_clients import answer_status as status
from slow_clients import eventually, non_reader

MIB = 1024 * 1024
STALLED_S = 0.2  # the stall window, for these tests: 5 s in service


def big_answer() -> Answer:
    family = GaugeMetricFamily("big", "A large answer.", labels=["i"])
    for i in range(20_000):
        family.add_metric([f"{i:040d}"], float(i))
    return Answer([family])


class Big(Exporter):
    """An answer of 1.1 MiB, made afresh for each request: no two share their bytes."""

    def answer(self, deadline: Deadline, arrived_at: float | None = None) -> Answer:
        return big_answer()


class Shared(Exporter):
    """The same 1.1 MiB answer for every request, as a scrape's is shared."""

    fixed = big_answer()

    def answer(self, deadline: Deadline, arrived_at: float | None = None) -> Answer:
        return self.fixed


@pytest.fixture
def serve(serve) -> Callable[..., ExporterServer]:
    """conftest's ``serve`` of a ``Big`` answer (or ``exporter``) under ``limits``, giving the server."""
    def start(exporter: type[Exporter] = Big, **limits: int | float) -> ExporterServer:
        serve(exporter(Scraper(DemoSource()), timeout_s=10), limits=Limits(**limits))  # type: ignore[arg-type]
        return serve.servers[-1]
    return start


@pytest.fixture
def short_stall(monkeypatch) -> None:
    monkeypatch.setattr(connections, "_STALLED_S", STALLED_S)






def writers(server: ExporterServer) -> dict[int, connections.Connection]:
    """The connections writing an answer, by client port."""
    return {conn.peer[1]: conn for conn in list(server.loop.connections.values()) if conn.state == "writing"}


def stalled(server: ExporterServer, port: int) -> bool:
    conn = writers(server).get(port)
    return conn is not None and connections._stalled(conn, time.monotonic())




def test_past_the_bound_the_longest_stalled_writer_is_closed_and_a_reader_is_answered(serve, short_stall) -> None:
    server = serve(max_queued_bytes=3 * MIB)
    port = server.server_address[1]
    clients = []
    try:
        for _ in range(2):  # 2.2 MiB: under the bound
            clients.append(non_reader(port))
            eventually(lambda: clients[-1].getsockname()[1] in writers(server))
        ports = [s.getsockname()[1] for s in clients]
        eventually(lambda: all(stalled(server, p) for p in ports))
        assert server.loop.queued_bytes > 2 * MIB, "the kernel took the answers: no test"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            body = answer.read()
        assert len(body) > MIB and body.rstrip().endswith(b"19999.0")
        assert ports[0] not in writers(server), "the longest stalled, closed to make room"
        assert ports[1] in writers(server), "one was enough"
        assert server.loop.queued_bytes <= 3 * MIB
    finally:
        for s in clients:
            s.close()


def test_a_burst_of_clients_that_do_not_read_never_passes_the_bound(serve) -> None:
    """On 0ae2a05 only writers stalled for 1 s could be closed: answers that all came within the
    second were queued past the bound, 5 x 1.1 MiB against 3 MiB. None is stalled here (the window
    is 5 s), so what would pass the bound is answered 503."""
    server = serve(max_queued_bytes=3 * MIB)
    port = server.server_address[1]
    clients = [non_reader(port) for _ in range(5)]
    try:
        statuses = sorted(status(s) for s in clients)
        assert statuses == [200, 200, 503, 503, 503]
        # Once the loop has written the refusals (the clients may read them before it is done):
        eventually(lambda: len(writers(server)) == 2)
        assert all(connections._queued(conn) > MIB for conn in writers(server).values())
        assert 2 * MIB < server.loop.queued_bytes <= 3 * MIB
        # Full to the byte: /-/healthy still answers (a liveness probe's 503 restarts the pod).
        server.loop.limits = dataclasses.replace(server.loop.limits, max_queued_bytes=server.loop.queued_bytes)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/healthy", timeout=10) as answer:
            assert answer.status == 200 and answer.read() == b"Healthy\n"
    finally:
        for s in clients:
            s.close()


def test_an_answer_over_the_bound_is_served_alone_and_rechecked_at_each_tick(serve, short_stall) -> None:
    """One answer is always served, however large. A stalled writer that holds the loop over its
    bound is closed at the next tick, with no new answer to trigger it (on 0ae2a05 it stayed
    until its write deadline, 30 s)."""
    server = serve(max_queued_bytes=MIB)
    port = server.server_address[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.read().rstrip().endswith(b"19999.0")
    client = non_reader(port)
    try:
        assert status(client) == 200
        mine = client.getsockname()[1]
        started = time.monotonic()
        eventually(lambda: mine not in writers(server), timeout_s=5)
        assert time.monotonic() - started < 3
        assert server.loop.queued_bytes == 0
    finally:
        client.close()


def test_bytes_shared_by_many_writers_count_once(serve) -> None:
    server = serve(Shared, max_queued_bytes=3 * MIB)
    port = server.server_address[1]
    clients = [non_reader(port) for _ in range(12)]  # 13 MiB counted per connection
    try:
        assert [status(s) for s in clients] == [200] * 12
        assert len(writers(server)) == 12
        body = len(Shared.fixed.encoded("", False)[0])
        assert body < server.loop.queued_bytes < body + 12 * 1024  # the body once, and 12 heads
    finally:
        for s in clients:
            s.close()
    eventually(lambda: server.loop.queued_bytes == 0)
    assert not Shared.fixed.queued()


class Trickle:
    """A socket whose peer takes ``size`` bytes each time it is written to."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.taken = 0
        self.room = 0

    def sendmsg(self, buffers: list[memoryview]) -> int:
        if not self.room:
            raise BlockingIOError
        self.room = 0
        self.taken += self.size
        return min(self.size, sum(len(b) for b in buffers))


def test_a_writer_is_draining_by_the_bytes_its_client_takes_not_by_any_byte(serve) -> None:
    """On 0ae2a05 one byte taken in a second was progress: a client taking 100 bytes at a time
    held its answer as a reader. Now progress is 16 KiB taken; a pause under 5 s (a Prometheus in
    a GC pause, a slow TLS reader) is no stall."""
    server = serve()
    loop = server.loop
    sock = Trickle(100)
    conn = connections.Connection(sock, ("127.0.0.1", 1), time.monotonic())  # type: ignore[arg-type]
    conn.state = "writing"
    conn.out = collections.deque([memoryview(b"x" * MIB)])
    conn.key, conn.watching = -1, selectors.EVENT_WRITE  # watched already: the loop's selector is not asked
    conn.progressed = mark = time.monotonic() - 4.9
    assert not connections._stalled(conn, time.monotonic()), "4.9 s without progress: not yet stalled"
    while sock.taken < 16_000:
        sock.room = 1
        loop._write(conn)
    assert conn.progressed == mark, "a trickle is no progress"
    time.sleep(0.15)
    assert connections._stalled(conn, time.monotonic())
    while sock.taken < 17_000:
        sock.room = 1
        loop._write(conn)
    assert conn.progressed > mark and not connections._stalled(conn, time.monotonic())


def test_at_the_cap_a_stalled_writer_goes_before_an_idle_keep_alive_scraper(serve, short_stall) -> None:
    """Issue 38: at the connection cap, the idle keep-alive connection of a Prometheus between
    scrapes was closed before the clients that never read their answers."""
    server = serve(max_connections=8)  # the least cap the loop takes
    port = server.server_address[1]
    scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    clients: list[socket.socket] = []
    try:
        scraper.request("GET", "/metrics")
        assert len(scraper.getresponse().read()) > MIB  # read whole: idle on its keep-alive connection
        for _ in range(7):  # the cap, with the scraper's
            clients.append(non_reader(port))
            eventually(lambda: clients[-1].getsockname()[1] in writers(server))
        ports = [s.getsockname()[1] for s in clients]
        eventually(lambda: all(stalled(server, p) for p in ports))
        newcomer = socket.create_connection(("127.0.0.1", port), timeout=10)  # one past the cap
        try:
            def peers() -> set[int]:
                return {conn.peer[1] for conn in list(server.loop.connections.values())}
            eventually(lambda: newcomer.getsockname()[1] in peers())
            assert scraper.sock is not None and scraper.sock.getsockname()[1] in peers()
            assert ports[0] not in peers(), "the longest stalled writer was closed"
            assert all(p in peers() for p in ports[1:])
        finally:
            newcomer.close()
    finally:
        scraper.close()
        for s in clients:
            s.close()
