"""Issue 38: no request may shorten or fail another's read. A scrape-timeout header below 1s, or
not a finite positive number, is taken as 1s and counted; the read a request shares runs under
the server's own limit (``--timeout``, a probe target's ``timeout``), and a request due sooner
answers its own timeout alone, which is no read error of the source. The same on ``/metrics`` and
``/probe``."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from mig_exporter.config.file import ProbeTarget, parse_config
from mig_exporter.core.deadline import Deadline, client_budget
from mig_exporter.core.errors import ReadError
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web.probe import Prober
from mig_exporter.web.server import SCRAPE_TIMEOUT_HEADER, ExporterServer

HEADER = SCRAPE_TIMEOUT_HEADER


@pytest.mark.parametrize(("header", "budget", "clamped"), [
    (None, 10.0, False),           # no header: the server's own limit
    ("10", 9.5, False),            # Prometheus' timeout less the offset
    ("30", 10.0, False),           # never past the server's own limit
    ("1", 0.5, False),             # the floor itself is a timeout Prometheus may send
    ("0.1", 0.5, True),            # the attack: taken as 1s
    ("0", 0.5, True),
    ("-5", 0.5, True),
    ("nan", 0.5, True),
    ("inf", 10.0, False),          # no limit of the client's own: the server's
    ("-inf", 0.5, True),
    ("abc", 0.5, True),
])
def test_a_header_below_the_floor_or_not_a_number_is_taken_as_the_floor_and_reported(
        header: str | None, budget: float, clamped: bool) -> None:
    assert client_budget(10.0, header, 0.5) == (budget, clamped)


def test_an_offset_as_large_as_the_header_still_leaves_a_least_budget() -> None:
    assert client_budget(10.0, "1", 2.0) == (0.1, False)


def test_a_deadline_a_moment_before_the_limit_is_that_limit() -> None:
    """The caller takes its deadline a moment before the shared read takes the server's limit:
    the same deadline, so the caller is due with the read (and keeps it waiting, and is counted)."""
    deadline = Deadline.after(10.0)
    assert deadline.at_least(10.0) is deadline
    assert deadline.at_least(20.0).at > deadline.at + 9


class Slow:
    """A read of ``delay_s`` that, like nvidia-smi killed at its deadline, fails when its deadline
    comes first."""

    name = "nvidia-smi"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.reads = 0
        self._lock = threading.Lock()

    def read(self, deadline: Deadline | None = None):
        with self._lock:
            self.reads += 1
        left = deadline.left_s() if deadline is not None else self.delay_s
        time.sleep(min(left, self.delay_s))
        if left < self.delay_s:
            raise ReadError(f"timed out after {left:.1f}s")
        return DemoSource().read()

    def ready(self):
        return True, "slow"

    def describe(self):
        return "slow"


def _get(url: str, header: str | None = None) -> str:
    request = urllib.request.Request(url, headers={HEADER: header} if header else {})
    with urllib.request.urlopen(request, timeout=20) as answer:
        return answer.read().decode()


def _value(body: str, name: str) -> float:
    (line,) = [row for row in body.splitlines() if row.startswith(name)]
    return float(line.rsplit(" ", 1)[1])


class SlowProber(Prober):
    def __init__(self, source: Slow) -> None:
        self.source = source  # before the targets' scrapers are made
        super().__init__(parse_config("probe_targets:\n  gpu-a: {command: ['nvidia-smi']}\n", "mig.yml"),
                         default_timeout_s=10)

    def _new_scraper(self, target: ProbeTarget) -> Scraper:
        return Scraper(self.source, name=f"probe target {target.name}")



@pytest.fixture
def server() -> Iterator[tuple[str, Scraper, SlowProber]]:
    """/metrics over a 0.4s read and /probe over another, the issue's read time."""
    scraper = Scraper(Slow(0.4))
    prober = SlowProber(Slow(0.4))
    server = ExporterServer(("127.0.0.1", 0), Exporter(scraper, prober, timeout_s=10), prober=prober)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", scraper, prober
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_clients_asking_for_0_1s_fail_no_prometheus_scrape_and_no_read(server) -> None:
    """The issue's attack at its size: two clients send a 0.1s scrape timeout back to back, each
    to /metrics and /probe in turn, while a Prometheus scrapes /metrics and probes the target 30
    times each over 0.4s reads. Before, the shared read took the attacker's 0.1s: 1 of 30 scrapes
    succeeded, and each failure was counted in read_errors_total."""
    url, scraper, _ = server
    stop = threading.Event()
    attacks: list[int] = []  # requests the attackers had answered
    attack_errors: list[BaseException] = []

    def attack() -> None:
        made = 0
        try:
            while not stop.is_set():
                _get(f"{url}/metrics", "0.1")
                _get(f"{url}/probe?target=gpu-a", "0.1")
                made += 2
        except BaseException as e:  # an attack that stops must fail the test, not pass it
            attack_errors.append(e)
        attacks.append(made)

    def prometheus(path: str, name: str, out: list[float]) -> None:
        for _ in range(30):
            out.append(_value(_get(f"{url}{path}", "10"), name))

    scrapes: list[float] = []
    probes: list[float] = []
    clients = [threading.Thread(target=attack) for _ in range(2)]
    for client in clients:
        client.start()
    time.sleep(0.2)  # an attacker's reads in flight first
    legit = [threading.Thread(target=prometheus, args=("/metrics", 'mig_exporter_read_success{source="nvidia-smi"}',
                                                       scrapes)),
             threading.Thread(target=prometheus, args=("/probe?target=gpu-a", "probe_success", probes))]
    for client in legit:
        client.start()
    for client in legit:
        client.join(120)
    stop.set()
    for client in clients:
        client.join(20)
    assert attack_errors == []
    assert len(attacks) == 2 and min(attacks) >= 10, attacks  # the attack ran throughout
    assert len(scrapes) == len(probes) == 30
    assert sum(scrapes) >= 29 and sum(probes) >= 29, (scrapes, probes)
    assert scraper.errors_total == 0
    last = _get(f"{url}/metrics", "10")
    assert _value(last, 'mig_exporter_read_errors_total{source="nvidia-smi"}') == 0
    assert _value(last, 'mig_exporter_probe_failures_total{target="gpu-a"}') == 0
    assert _value(last, "mig_exporter_scrape_timeout_clamped_total") >= sum(attacks)


def _sample(answer, name: str) -> float:
    (value,) = [sample.value for family in answer.families for sample in family.samples if sample.name == name]
    return value


def test_a_scrape_due_sooner_answers_alone_and_is_counted_as_a_client_timeout() -> None:
    """A request due in 0.3s starts a 0.8s read; a Prometheus scrape due in 10s joins it. The first
    answers read_success 0 at its own deadline, counted as a client timeout, no read error; the
    read goes on, and the second takes it."""
    scraper = Scraper(Slow(0.8))
    exporter = Exporter(scraper, timeout_s=10)
    answers = {}
    hasty = threading.Thread(target=lambda: answers.update(hasty=exporter.answer(Deadline.after(0.3))))
    hasty.start()
    while scraper.source.reads == 0:
        time.sleep(0.005)
    answers["prometheus"] = exporter.answer(Deadline.after(10))
    hasty.join(10)
    success = "mig_exporter_read_success"
    assert (_sample(answers["hasty"], success), _sample(answers["prometheus"], success)) == (0.0, 1.0)
    assert scraper.source.reads == 1
    assert scraper.errors_total == 0
    assert _sample(answers["prometheus"], "mig_exporter_scrape_client_timeouts_total") == 1.0
    assert _sample(answers["prometheus"], "mig_exporter_read_errors_total") == 0.0


def test_a_probe_due_sooner_neither_fails_the_run_nor_counts_a_failure() -> None:
    """A probe due in 0.3s starts the run of a 0.8s read; a Prometheus probe joins it with 10s.
    Before, the run took the first probe's 0.3s and the Prometheus probe got its failure."""
    source = Slow(0.8)
    prober = SlowProber(source)
    target = prober.config.probe_targets["gpu-a"]
    results: dict[str, bool] = {}
    hasty = threading.Thread(target=lambda: results.update(hasty=prober.probe(target, Deadline.after(0.3))
                                                           .outcome.success))
    hasty.start()
    while source.reads == 0:
        time.sleep(0.005)
    results["prometheus"] = prober.probe(target, Deadline.after(10)).outcome.success
    hasty.join(10)
    assert results == {"hasty": False, "prometheus": True}
    assert source.reads == 1
    failures = [family for family in prober.collect() if family.name == "mig_exporter_probe_failures"]
    assert [sample.value for sample in failures[0].samples if sample.name.endswith("_total")] == [0]
