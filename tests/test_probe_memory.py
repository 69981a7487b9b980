"""Issue 38, ``/probe``: clients that never read their probe answers pin one answer a window, not
one each. On 0ae2a05 every probe built its own ``Answer``, even the probes sharing one run, so N
stalled readers of a big target held N copies of its body (and, the queued-bytes bound reached,
the readers after them were refused). The probes of one run share its answer, and a successful
run's answer is given again, as ``/metrics`` does, while a connection still has it queued."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, FakeSmi, calls
from mig_exporter.config.file import load_config
from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics import exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web.probe import Prober
from mig_exporter.web.server import ExporterServer
from slow_clients import answer_status, non_reader

sys.path.insert(0, str(REPO))
from benchmarks.scenarios import BIG_MIG, listing, query_xml

pytestmark = pytest.mark.timeout(60)

CLIENTS = 200  # each answer of big-mig is 410 KB: 80 MB if each pinned its own, past the 64 MiB bound


@pytest.fixture
def big_target(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> Iterator[tuple[ExporterServer, Path]]:
    smi = fake_nvidia_smi(query_xml(BIG_MIG), listing(BIG_MIG))
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  big:\n    command: [{str(smi)!r}]\n")
    prober = Prober(load_config(config), config_file=str(config))
    server = ExporterServer(("127.0.0.1", 0), exporter.Exporter(Scraper(DemoSource()), prober, timeout_s=10),
                            prober=prober)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, smi
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)




def test_probes_that_never_read_share_their_answers_bytes(big_target) -> None:
    server, smi = big_target
    port = server.server_address[1]
    with urllib.request.urlopen(f"{server.url}/probe?target=big", timeout=30) as answer:
        size = len(answer.read())
    assert size > 300_000
    clients = []
    try:
        for _ in range(CLIENTS):
            clients.append(non_reader(port, "/probe?target=big"))
        assert [answer_status(s, 30) for s in clients] == [200] * CLIENTS, "none refused at the queued-bytes bound"
        runs = sum(1 for _, args in calls(smi) if args == "-q -x") - 1
        writing = [c for c in list(server.loop.connections.values()) if c.state == "writing"]
        assert len(writing) == CLIENTS, "each still has most of its answer to write"
        bodies = {id(part) for conn in writing for part in conn.held if len(part) > 100_000}
        # One body a run: the probes that come before the loop has queued the first of a run's
        # answers start or join another run; those after take the queued one.
        assert 1 <= len(bodies) <= runs and len(bodies) <= CLIENTS // 10
        assert server.loop.queued_bytes < len(bodies) * size + CLIENTS * 1024  # the bodies once, and the heads
    finally:
        for s in clients:
            s.close()


def test_a_run_shared_by_probes_makes_one_answer_and_a_failed_one_is_never_reused(fake_nvidia_smi, tmp_path):
    smi = fake_nvidia_smi(query_xml(BIG_MIG), listing(BIG_MIG), delay_s=0.3)
    broken = fake_nvidia_smi(mode="fail")
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  big:\n    command: [{str(smi)!r}]\n"
                      f"  broken:\n    command: [{str(broken)!r}]\n")
    prober = Prober(load_config(config))
    big, failing = prober.config.probe_targets["big"], prober.config.probe_targets["broken"]
    results = []
    threads = [threading.Thread(target=lambda: results.append(prober.probe(big, Deadline.after(10))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 3 and all(r.outcome.success for r in results)
    answers = {id(r.answer()) for r in results}
    assert len(answers) == 1, "one answer for the run the three probes shared"
    body = results[0].answer().encoded("", False)[0]
    assert results[1].answer().encoded("", False)[0] is body
    assert prober.probe(big, Deadline.after(10)).answer() is not results[0].answer(), "nothing queued: a run"
    queued = prober.probe(big, Deadline.after(10))
    queued.answer().encoded("", False)[0].hold(1)  # a client that does not read it
    again = prober.probe(big, Deadline.after(10))
    assert again.answer() is queued.answer(), "queued: given again, nothing runs"
    queued.answer().encoded("", False)[0].hold(-1)
    assert sum(1 for _, args in calls(smi) if args == "-q -x") == 3

    failed = prober.probe(failing, Deadline.after(10))
    assert not failed.outcome.success
    failed_answer = failed.answer()
    failed_answer.encoded("", False)[0].hold(1)
    assert prober.probe(failing, Deadline.after(10)).answer() is not failed_answer
    assert sum(1 for _, args in calls(broken) if args == "-q -x") == 2, "a failed run's answer is never reused"
    failed_answer.encoded("", False)[0].hold(-1)


def test_the_server_s_tick_lets_go_of_probe_answers_past_their_window(fake_nvidia_smi, tmp_path):
    """A target's last answer (about 2 MiB on big-mig) is not kept between probes: the loop's
    housekeeping drops it once no probe may reuse it."""
    smi = fake_nvidia_smi(query_xml(BIG_MIG), listing(BIG_MIG))
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  big:\n    command: [{str(smi)!r}]\n")
    prober = Prober(load_config(config))
    server = ExporterServer(("127.0.0.1", 0), exporter.Exporter(Scraper(DemoSource()), prober), prober=prober)
    try:
        prober.probe(prober.config.probe_targets["big"], Deadline.after(10))
        assert prober._answers
        server._tick(time.monotonic())
        assert prober._answers, "within its window: kept"
        server._tick(time.monotonic() + exporter.REUSE_S + 0.1)
        assert not prober._answers
    finally:
        server.server_close()
