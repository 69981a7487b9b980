"""The exporter: the scrape's families then the other collectors' (the counters about probes),
one scrape for the callers in flight at once, and each encoding of its answer made once."""

from __future__ import annotations

import gzip
import logging
import threading
import time

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conftest import scenario
from mig_exporter.core import flight
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoProcs
from test_flight import fail_thread_start_once

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def families(value: float) -> list[GaugeMetricFamily]:
    return [GaugeMetricFamily("mig_exporter_read_success", "Whether the read succeeded.", value=value)]


class Held:
    """A source that holds each read until released."""

    name = "nvidia-smi"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = 0
        self.threads: list[threading.Thread] = []

    def read(self, deadline=None):
        self.reads += 1
        self.threads.append(threading.current_thread())
        self.release.wait(10)
        return scenario("h100-mig-processes")

    def ready(self):
        return True, "held"

    def describe(self):
        return "held"


class Failing(Held):
    """A source whose read, once released, fails: a driver call that overran, then gave up."""

    def read(self, deadline=None):
        super().read(deadline)
        raise ReadError("NVML call failed: GPU is lost")


class CountedProcs(DemoProcs):
    """The demo host's /proc, counting its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self):
        self.reads += 1
        return super().read()


def value(answer: Answer, line: bytes) -> float:
    """The value of the sample ``line`` names (up to its value) in the answer's text."""
    (found,) = [row for row in answer.encoded("", False)[0].splitlines() if row.startswith(line + b" ")]
    return float(found.rsplit(b" ", 1)[1])


def finished(source: Held) -> None:
    """Release the source and wait until its reads have ended."""
    source.release.set()
    for thread in source.threads:
        thread.join(10)
        assert not thread.is_alive()


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
    # Last, what the answer costs: its samples counted, the other collectors' and the exporter's own
    # counts of clamped deadline headers and of requests answered at their own deadline included.
    assert names[-4:] == ["mig_exporter_probes", "mig_exporter_scrape_timeout_clamped",
                          "mig_exporter_scrape_client_timeouts", "mig_exporter_scrape_series"]
    assert "mig_exporter_read_success" in names[:-4]
    samples = sum(len(family.samples) for family in answer.families[:-1])
    assert answer.families[-1].samples[0].value == samples + 1
    assert answer.outcome is not None and answer.outcome.success


def test_callers_kept_past_their_deadline_get_one_failed_read_counted_once(monkeypatch) -> None:
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    source = Held()
    scraper = Scraper(source)
    exporter = Exporter(scraper, Counters(), timeout_s=0.5)  # due with the scrape: it keeps them waiting
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


ERRORS = b'mig_exporter_read_errors_total{source="nvidia-smi"}'


def test_a_read_that_fails_after_its_callers_answered_late_is_counted_and_logged_once(monkeypatch, caplog) -> None:
    """The caller answered a failed read at its deadline, counted and logged; the read failing
    later is no answer of its own: its reason is logged for the record, at info, and not counted."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    caplog.set_level(logging.INFO, logger="mig_exporter")
    source = Failing()
    scraper = Scraper(source)
    answer = Exporter(scraper, timeout_s=0.2).answer(Deadline.after(0.2))
    assert answer.outcome is not None and answer.outcome.error == "the scrape in flight did not finish within 0.2s"
    assert value(answer, ERRORS) == 1
    finished(source)
    assert scraper.errors_total == 1
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "mig_exporter"]
    assert logged == [
        ("WARNING", "read from nvidia-smi failed: the scrape in flight did not finish within 0.2s"),
        ("INFO", "read from nvidia-smi, answered late by every caller, failed: NVML call failed: GPU is lost"),
    ]


def test_each_failed_answer_counts_once_the_late_one_and_the_runs_own() -> None:
    """Prometheus reads read_errors_total as the failed reads it was answered: a caller that
    answered late, kept past the scrape's own deadline, and the one still waiting, which takes the
    read's own failure, are two."""
    source = Failing()
    scraper = Scraper(source)
    exporter = Exporter(scraper, timeout_s=0.2)
    lates: list[Answer] = []
    answers: list[Answer] = []
    starter = threading.Thread(target=lambda: lates.append(exporter.answer(Deadline.after(0.2))))
    starter.start()  # the scrape is due with it, at --timeout, and overruns
    while source.reads == 0:
        time.sleep(0.005)
    waiting = threading.Thread(target=lambda: answers.append(exporter.answer(Deadline.after(10))))
    waiting.start()
    while exporter.joined() == 0:
        time.sleep(0.005)
    starter.join(10)
    (late,) = lates
    assert late.outcome is not None and late.outcome.error == "the scrape in flight did not finish within 0.2s"
    finished(source)
    waiting.join(10)
    (own,) = answers
    assert own.outcome is not None and own.outcome.error == "NVML call failed: GPU is lost"
    assert (value(late, ERRORS), value(own, ERRORS), scraper.errors_total) == (1, 2, 2)


def test_a_callers_short_deadline_neither_cuts_the_scrape_short_nor_counts_a_read_error(caplog) -> None:
    """Issue 38: a client asking for 0.1s (the scrape-timeout header) used to give the shared scrape
    its own deadline, failing every Prometheus that joined it, each failure counted in
    read_errors_total and logged. The scrape runs under --timeout; that client answers its own
    timeout alone, uncounted and not logged as a WARNING; the caller due later takes the read."""
    caplog.set_level(logging.INFO, logger="mig_exporter")
    source = Held()
    scraper = Scraper(source)
    exporter = Exporter(scraper, timeout_s=10)
    hasty = exporter.answer(Deadline.after(0.1))  # starts the scrape, then gives up on it
    answers: list[Answer] = []
    prometheus = threading.Thread(target=lambda: answers.append(exporter.answer(Deadline.after(10))))
    prometheus.start()
    while exporter.joined() == 0:
        time.sleep(0.005)
    source.release.set()
    prometheus.join(10)
    (read,) = answers
    assert hasty.outcome is not None and hasty.outcome.error == (
        "this request's own deadline of 0.1s passed while the scrape went on within --timeout")
    assert read.outcome is not None and read.outcome.success
    assert source.reads == 1
    assert (value(hasty, ERRORS), value(read, ERRORS), scraper.errors_total) == (0, 0, 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_late_answer_carries_the_engine_reading_the_scrape_began_with(monkeypatch) -> None:
    """As a read that fails in time, a late answer says how many engine processes run and whether
    the exporter sees the host's PIDs, from the /proc read of the scrape it waited for: one /proc
    read for the scrape and its late answer."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    procs = CountedProcs()
    source = Held()
    late = Exporter(Scraper(source, EngineReader(DEFAULT_SETTINGS, procs)), timeout_s=0.2).answer(Deadline.after(0.2))
    finished(source)
    assert late.outcome is not None and late.outcome.error == "the scrape in flight did not finish within 0.2s"
    assert procs.reads == 1
    failing = Failing()
    failing.release.set()
    failed = Exporter(Scraper(failing, EngineReader(DEFAULT_SETTINGS, DemoProcs()))).answer(Deadline.after(5))
    assert failed.outcome is not None and failed.outcome.error == "NVML call failed: GPU is lost"
    engine_lines = [row for row in failed.encoded("", False)[0].splitlines()
                    if row.startswith((b"mig_exporter_engine_processes{", b"mig_exporter_host_pid_namespace "))]
    assert len(engine_lines) >= 2
    assert all(row in late.encoded("", False)[0].splitlines() for row in engine_lines)


def test_a_proc_reading_older_than_a_scrapes_budget_is_left_out_of_a_late_answer(monkeypatch) -> None:
    """The scrape in flight took it as it began; kept past --timeout, it is no longer the host's."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    source = Held()
    exporter = Exporter(Scraper(source, EngineReader(DEFAULT_SETTINGS, DemoProcs())), timeout_s=0.05)
    starter = threading.Thread(target=lambda: exporter.answer(Deadline.after(0.05)))
    starter.start()
    starter.join(10)  # the scrape it started, and its /proc read, are past --timeout now
    time.sleep(0.1)
    late = exporter.answer(Deadline.after(0.1))  # joins the overdue scrape
    finished(source)
    names = {family.name for family in late.families}
    assert "mig_exporter_read_success" in names and "mig_exporter_engine_processes" not in names


def test_a_scrape_that_cannot_start_answers_a_failed_read_and_the_next_reads(monkeypatch) -> None:
    fail_thread_start_once(monkeypatch, "scrape")
    source = Held()
    source.release.set()
    exporter = Exporter(Scraper(source))
    failed = exporter.answer(Deadline.after(5))
    assert failed.outcome is not None
    assert failed.outcome.error == "could not start a thread for the scrape: can't start new thread"
    assert value(failed, b'mig_exporter_read_success{source="nvidia-smi"}') == 0 and value(failed, ERRORS) == 1
    answer = exporter.answer(Deadline.after(5))
    assert answer.outcome is not None and answer.outcome.success and source.reads == 1


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
