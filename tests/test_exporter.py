"""The exporter: the scrape's families then the other collectors' (the counters about probes),
one scrape for the callers in flight at once, and each encoding of its answer made once."""

from __future__ import annotations

import gzip
import threading
import time

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conftest import scenario
from mig_exporter.core import flight
from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.scrape import Scraper

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def families(value: float) -> list[GaugeMetricFamily]:
    return [GaugeMetricFamily("mig_exporter_read_success", "Whether the read succeeded.", value=value)]


class Held:
    """A source that holds each read until released."""

    name = "nvidia-smi"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = 0

    def read(self, deadline=None):
        self.reads += 1
        self.release.wait(10)
        return scenario("h100-mig-processes")

    def ready(self):
        return True, "held"

    def describe(self):
        return "held"


class Counters:
    """Another collector, as the prober's counters are."""

    def collect(self):
        counter = CounterMetricFamily("mig_exporter_probes", "Probes answered.", labels=["target"])
        counter.add_metric(["gpu-a"], 3)
        yield counter


def test_the_answer_is_the_scrapes_families_then_the_other_collectors() -> None:
    source = Held()
    source.release.set()
    answer = Exporter(Scraper(source), Counters()).answer(Deadline.after(5))
    names = [family.name for family in answer.families]
    assert names[-1] == "mig_exporter_probes" and "mig_exporter_read_success" in names[:-1]
    assert answer.outcome is not None and answer.outcome.success


def test_callers_kept_past_their_deadline_get_one_failed_read_counted_once(monkeypatch) -> None:
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    source = Held()
    scraper = Scraper(source)
    exporter = Exporter(scraper, Counters())
    answers: list[Answer] = []
    callers = [threading.Thread(target=lambda: answers.append(exporter.answer(Deadline.after(0.5))))
               for _ in range(3)]
    started = time.monotonic()
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    waited = time.monotonic() - started
    source.release.set()
    assert 0.5 <= waited < 2.0 and source.reads == 1
    assert len(answers) == 3 and all(answer is answers[0] for answer in answers)
    assert answers[0].outcome is not None
    assert answers[0].outcome.error == "the scrape in flight did not finish within 0.5s"
    body = answers[0].encoded("", False)[0]
    assert b'mig_exporter_read_success{source="nvidia-smi"} 0.0' in body
    assert b'mig_exporter_probes_total{target="gpu-a"} 3.0' in body, "the other collectors are in the late answer"
    assert scraper.errors_total == 1


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
