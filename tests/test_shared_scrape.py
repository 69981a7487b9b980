"""Requests in flight at once share one scrape and each encoding of its answer;
a request never waits on a scrape past its own deadline, and never gets an
answer from a scrape that had ended before it arrived."""

from __future__ import annotations

import gzip
import threading
import time

import pytest
from prometheus_client.core import GaugeMetricFamily

from mig_exporter.web import shared_scrape
from mig_exporter.web.shared_scrape import Answer, ScrapeFailed, SharedScrapes

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def families(value: float) -> list[GaugeMetricFamily]:
    return [GaugeMetricFamily("mig_exporter_read_success", "Whether the read succeeded.", value=value)]


class Scrapes:
    """A scrape that counts its runs and, when told to, holds until released."""

    def __init__(self, hold: bool = False, error: Exception | None = None) -> None:
        self.runs: list[float] = []
        self.late: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()
        self.hold = hold
        self.error = error
        self.shared = SharedScrapes(self.scrape, self.failed)

    def scrape(self, budget_s: float) -> Answer:
        self.runs.append(budget_s)
        self.started.set()
        if self.hold:
            self.release.wait(10)
        if self.error is not None:
            raise self.error
        return Answer(families(len(self.runs)))

    def failed(self, reason: str, started: float) -> Answer:
        self.late.append(reason)
        return Answer(families(0))

    def wait_joined(self, count: int) -> None:
        """Until ``count`` requests wait on the scrape in flight: releasing it earlier
        would let a slow thread start a scrape of its own."""
        deadline = time.monotonic() + 10
        while self.shared.joined() < count:
            assert time.monotonic() < deadline, f"{self.shared.joined()} of {count} requests joined"
            time.sleep(0.005)


def in_thread(scrapes: Scrapes, budget_s: float, results: list) -> threading.Thread:
    def ask() -> None:
        try:
            results.append(scrapes.shared.answer(budget_s))
        except Exception as e:
            results.append(e)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def finish(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_requests_that_arrive_while_a_scrape_runs_get_its_answer():
    scrapes = Scrapes(hold=True)
    results: list = []
    leader = in_thread(scrapes, 5.0, results)
    assert scrapes.started.wait(5)
    joiners = [in_thread(scrapes, 5.0, results) for _ in range(20)]
    scrapes.wait_joined(20)
    scrapes.release.set()
    finish(leader, *joiners)
    assert len(scrapes.runs) == 1
    assert len(results) == 21 and all(answer is results[0] for answer in results)


def test_a_scrape_that_has_ended_is_not_reused():
    scrapes = Scrapes()
    first = scrapes.shared.answer(5.0)
    second = scrapes.shared.answer(5.0)
    assert len(scrapes.runs) == 2
    assert first.encoded("", False)[0] != second.encoded("", False)[0]


def test_a_request_with_an_earlier_deadline_scrapes_on_its_own_and_later_requests_join_that():
    """Behind a scrape with a 8 s budget (a read hung for all of it), a request with 1.5 s
    must not wait 8 s; one that comes after it with the same 1.5 s joins it."""
    scrapes = Scrapes(hold=True)
    results: list = []
    slow = in_thread(scrapes, 8.0, results)
    assert scrapes.started.wait(5)
    short = in_thread(scrapes, 1.5, results)
    deadline = time.monotonic() + 5
    while len(scrapes.runs) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scrapes.runs == [8.0, 1.5]
    joiner = in_thread(scrapes, 1.5, results)
    scrapes.wait_joined(1)
    scrapes.release.set()
    finish(slow, short, joiner)
    assert scrapes.runs == [8.0, 1.5], "the third request joined the second scrape"
    assert len(results) == 3 and len({id(answer) for answer in results}) == 2


def test_every_request_on_a_scrape_that_raised_gets_the_error():
    scrapes = Scrapes(hold=True, error=RuntimeError("mapping bug"))
    results: list = []
    threads = [in_thread(scrapes, 5.0, results)]
    assert scrapes.started.wait(5)
    threads += [in_thread(scrapes, 5.0, results) for _ in range(3)]
    scrapes.wait_joined(3)
    scrapes.release.set()
    finish(*threads)
    assert len(scrapes.runs) == 1
    leader_error = next(e for e in results if type(e) is RuntimeError)
    joined = [e for e in results if e is not leader_error]
    # Each joiner raises an exception of its own, caused by the one error: raising the one
    # object in every thread would pile every thread's frames onto its traceback.
    assert len(joined) == 3 and all(isinstance(e, ScrapeFailed) and e.__cause__ is leader_error for e in joined)
    assert str(joined[0]) == "the shared scrape failed: mapping bug"


def test_requests_kept_past_their_deadline_by_a_joined_scrape_get_one_failed_read(monkeypatch):
    monkeypatch.setattr(shared_scrape, "JOIN_GRACE_S", 0.05)
    scrapes = Scrapes(hold=True)
    results: list = []
    leader = in_thread(scrapes, 1.0, results)  # a bug: it holds past its 1 s
    assert scrapes.started.wait(5)
    started = time.monotonic()
    joiners = [in_thread(scrapes, 1.1, results) for _ in range(3)]
    finish(*joiners)
    waited = time.monotonic() - started
    assert 1.1 <= waited < 2.5, f"waited {waited:.2f}s"  # their own 1.1 s and the grace
    # Counted and logged once for the three, as one failed read.
    assert scrapes.late == ["the scrape in flight did not finish within 1.1s"]
    assert len(results) == 3 and all(answer is results[0] for answer in results)
    assert b"mig_exporter_read_success 0.0" in results[0].encoded("", False)[0]
    scrapes.release.set()
    finish(leader)
    assert len(scrapes.runs) == 1


def test_a_scrape_already_past_its_deadline_is_not_joined():
    """A request that comes after a scrape's deadline has passed would only wait for it to
    fail; it scrapes on its own and answers in its own time."""
    scrapes = Scrapes(hold=True)
    results: list = []
    leader = in_thread(scrapes, 0.2, results)  # a bug: it holds past its 0.2 s
    assert scrapes.started.wait(5)
    time.sleep(0.3)
    scrapes.hold = False
    started = time.monotonic()
    answer = scrapes.shared.answer(1.0)
    assert time.monotonic() - started < 0.9
    assert scrapes.runs == [0.2, 1.0] and scrapes.late == []
    assert b"mig_exporter_read_success 2.0" in answer.encoded("", False)[0]
    scrapes.release.set()
    finish(leader)


@pytest.mark.parametrize("accept, content_type", [
    ("", "text/plain; version=0.0.4"),
    (OPENMETRICS, "application/openmetrics-text; version=1.0.0"),
])
def test_each_encoding_is_made_once_per_scrape(accept, content_type):
    answer = Answer(families(1))
    body, kind = answer.encoded(accept, False)
    assert kind.startswith(content_type)
    assert b"mig_exporter_read_success 1.0\n" in body
    assert answer.encoded(accept, False)[0] is body
    zipped, zipped_kind = answer.encoded(accept, True)
    assert zipped_kind == kind and gzip.decompress(zipped) == body
    assert answer.encoded(accept, True)[0] is zipped


def test_accept_headers_that_ask_for_the_same_format_share_its_encoding():
    answer = Answer(families(1))
    body = answer.encoded("application/openmetrics-text; version=1.0.0", False)[0]
    assert answer.encoded("application/openmetrics-text;version=1.0.0,text/plain;q=0.5", False)[0] is body
    assert answer.encoded("text/plain", False)[0] is not body
