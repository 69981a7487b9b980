"""Issue 38: a finished read's answer is given as it is to requests arriving within ``REUSE_S``
of its end while a connection still has its bytes queued. The connection loop counts those
connections itself (``web/connections.Held``): nothing else holding the bytes (a copy, a view, a
traceback) makes an answer "queued", and the count does not depend on the interpreter's reference
counts (CPython 3.14's borrowed references, free-threaded builds). A failed read is never reused."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.core import GaugeMetricFamily

from conftest import scenario
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.metrics import exporter as exporter_module
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web import connections
from mig_exporter.web.server import ExporterServer
from slow_clients import eventually, non_reader

MIB = 1024 * 1024


class Counted(DemoSource):
    """The demo sample, counting its reads; failing them while ``fail`` is set."""

    def __init__(self) -> None:
        self.reads = 0
        self.fail = False

    def read(self, deadline: Deadline | None = None):
        self.reads += 1
        if self.fail:
            raise ReadError("NVML call failed: GPU is lost")
        return scenario("h100-mig-processes")


def big_answer() -> Answer:
    family = GaugeMetricFamily("big", "A large answer.", labels=["i"])
    for i in range(20_000):
        family.add_metric([f"{i:040d}"], float(i))
    return Answer([family])


class Fixed(Exporter):
    """Answers every request with the same 1.1 MiB answer."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(Scraper(DemoSource()), timeout_s=10)
        self.fixed = answer

    def answer(self, deadline: Deadline, arrived_at: float | None = None) -> Answer:
        return self.fixed




@pytest.fixture
def served(serve) -> Callable[[Exporter], ExporterServer]:
    """conftest's ``serve`` of an exporter made here, giving the server itself (its loop is checked)."""
    def start(exporter: Exporter) -> ExporterServer:
        serve(exporter)
        return serve.servers[-1]
    return start




def test_only_a_connection_that_queues_the_bytes_makes_an_answer_queued() -> None:
    """On 0ae2a05 ``queued()`` read ``sys.getrefcount`` of the body: this test's own references
    (the body, a view of it, the (body, type) pair) read as a client holding it."""
    answer = big_answer()
    body, content_type = answer.encoded("", False)
    pair, view = (body, content_type), memoryview(body)
    assert not answer.queued()
    assert isinstance(body, connections.Held)
    body.hold(1)  # what the connection loop does when a connection queues it
    assert answer.queued()
    zipped = answer.encoded("", True)[0]
    zipped.hold(1)
    body.hold(-1)  # that connection has sent it all: another still writes the gzipped one
    assert answer.queued()
    zipped.hold(-1)
    assert not answer.queued()
    assert pair[0] is body and view.obj is body and bytes(view) == body


def test_the_loop_counts_a_client_that_does_not_read_until_it_has_read(served) -> None:
    answer = big_answer()
    server = served(Fixed(answer))
    port = server.server_address[1]
    reader = non_reader(port)
    try:
        eventually(answer.queued)  # written in part: the rest waits in the loop for the client
        assert server.loop.queued_bytes >= len(answer.encoded("", False)[0])
        got = b""
        reader.settimeout(10)
        while not got.endswith(b"19999.0\n"):
            chunk = reader.recv(1 << 16)
            assert chunk
            got += chunk
        eventually(lambda: not answer.queued())
        assert server.loop.queued_bytes == 0
        closer = non_reader(port)  # one that never reads and then goes: closed, it holds nothing
        eventually(answer.queued)
        closer.close()
        eventually(lambda: not answer.queued())
    finally:
        reader.close()


def test_a_read_is_reused_only_while_queued_within_the_window_and_a_failed_one_never(monkeypatch) -> None:
    source = Counted()
    exporter = Exporter(Scraper(source), timeout_s=10)

    def answer() -> Answer:
        return exporter.answer(Deadline.after(10))

    def held(answer: Answer, delta: int) -> None:
        """What the connection loop does as a client queues its bytes (+1) or is done (-1)."""
        answer.encoded("", False)[0].hold(delta)

    first = answer()
    assert source.reads == 1 and first.outcome is not None and first.outcome.success
    kept = first.encoded("", False)  # this test's own reference: no client's
    second = answer()
    assert second is not first and source.reads == 2, "nothing queued: a read afresh"
    held(second, 1)  # a client that does not read it
    assert answer() is second and source.reads == 2, "the same answer, no read"
    held(second, -1)
    assert answer() is not second and source.reads == 3
    assert kept[0]

    source.fail = True
    failed = answer()
    assert source.reads == 4 and failed.outcome is not None and not failed.outcome.success
    held(failed, 1)
    assert answer() is not failed and source.reads == 5, "a failed read's answer is never given again"
    held(failed, -1)

    source.fail = False
    fresh = answer()
    held(fresh, 1)
    monkeypatch.setattr(exporter_module, "REUSE_S", 0.05)
    time.sleep(0.1)
    assert answer() is not fresh and source.reads == 7, "past the window: a read afresh, held or not"
    held(fresh, -1)


def test_a_prometheus_that_reads_its_answers_gets_a_read_at_each_scrape(served) -> None:
    source = Counted()
    server = served(Exporter(Scraper(source), timeout_s=10))
    durations = []
    for _ in range(5):
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            body = response.read().decode()
        (line,) = [row for row in body.splitlines() if row.startswith("mig_exporter_read_duration_seconds{")]
        durations.append(line)
    assert source.reads == 5
    assert len(set(durations)) == 5
