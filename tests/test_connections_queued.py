"""Issue 38: the answer bytes queued for clients that do not read are bounded in total. Past the
bound the writer stalled longest is closed first; a client that reads its answer gets it whole."""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.core import GaugeMetricFamily

from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web import connections
from mig_exporter.web.connections import Limits
from mig_exporter.web.server import ExporterServer

MIB = 1024 * 1024


class Big(Exporter):
    """An answer of about 1 MiB, made afresh for each request: no two share their bytes."""

    def answer(self, deadline: Deadline, arrived_at: float | None = None) -> Answer:
        family = GaugeMetricFamily("big", "A large answer.", labels=["i"])
        for i in range(20_000):
            family.add_metric([f"{i:040d}"], float(i))
        return Answer([family])


@pytest.fixture
def server() -> Iterator[ExporterServer]:
    server = ExporterServer(("127.0.0.1", 0), Big(Scraper(DemoSource()), timeout_s=10),
                            limits=Limits(max_queued_bytes=3 * MIB))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _queued(server: ExporterServer) -> dict[int, int]:
    """Bytes still to write, by client port."""
    return {conn.peer[1]: connections._queued(conn) for conn in list(server.loop.connections.values())
            if conn.out}


def test_past_the_bound_the_longest_stalled_writers_are_closed_and_a_reader_is_answered(server) -> None:
    port = server.server_address[1]
    stalled = []
    for _ in range(6):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        stalled.append(s)
        time.sleep(0.1)  # their order is the order they stalled in
    try:
        for _ in range(100):  # every answer made and queued
            if len(_queued(server)) == 6:
                break
            time.sleep(0.05)
        before = _queued(server)
        assert len(before) == 6 and sum(before.values()) > 3 * MIB, "the kernel took the answers: no test"
        time.sleep(connections._STALLED_S + 0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            body = answer.read()
        assert len(body) > MIB and body.rstrip().endswith(b"19999.0")
        after = _queued(server)
        ports = [s.getsockname()[1] for s in stalled]
        assert sum(after.values()) <= 3 * MIB
        closed = [p for p in ports if p not in after]
        assert closed and closed == ports[:len(closed)], "the longest stalled first"
    finally:
        for s in stalled:
            s.close()


def test_at_the_cap_a_stalled_writer_goes_before_an_idle_keep_alive_scraper() -> None:
    """Issue 38: at the connection cap, the idle keep-alive connection of a Prometheus between
    scrapes was closed before the clients that never read their answers."""
    server = ExporterServer(("127.0.0.1", 0), Big(Scraper(DemoSource()), timeout_s=10),
                            limits=Limits(max_connections=8))  # the least cap the loop takes
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    scraper = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    stalled: list[socket.socket] = []
    try:
        scraper.request("GET", "/metrics")
        assert len(scraper.getresponse().read()) > MIB  # read whole: idle on its keep-alive connection
        for _ in range(7):  # the cap, with the scraper's
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stalled.append(s)
            time.sleep(0.1)
        for _ in range(100):
            if len(_queued(server)) == 7:
                break
            time.sleep(0.05)
        time.sleep(connections._STALLED_S + 0.2)
        newcomer = socket.create_connection(("127.0.0.1", port), timeout=10)  # one past the cap
        try:
            for _ in range(100):
                peers = {conn.peer[1] for conn in list(server.loop.connections.values())}
                if newcomer.getsockname()[1] in peers:
                    break
                time.sleep(0.05)
            assert scraper.sock is not None and scraper.sock.getsockname()[1] in peers
            assert stalled[0].getsockname()[1] not in peers, "the longest stalled writer was closed"
            assert all(s.getsockname()[1] in peers for s in stalled[1:])
        finally:
            newcomer.close()
    finally:
        scraper.close()
        for s in stalled:
            s.close()
        server.shutdown()
        server.server_close()
        thread.join(10)
