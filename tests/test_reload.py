"""Reloads cannot starve the server (issue 38): the config file and the web config are read by one
reloader each, off the event loop and off the pool, one read at a time, later requests coalesced,
every caller of a read that goes well given its outcome; a FIFO is refused at once; a read stuck
past its deadline makes ``/-/ready`` not ready while ``/metrics`` and ``/-/healthy`` answer; the
event loop waits for no web config check; a torn config is refused."""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mig_exporter.config.file import load_config
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web import probe, webconfig
from mig_exporter.web import reloader as reloader_module
from mig_exporter.web.probe import Prober
from mig_exporter.web.reloader import MAX_WAITERS, Reloader
from mig_exporter.web.server import ExporterServer
from mig_exporter.web.webconfig import WebSettings

pytestmark = pytest.mark.timeout(60)

CONFIG = "probe_targets:\n  host:\n    command: [nvidia-smi]\n"
FIFO_REFUSED = "cannot read: a FIFO, not a regular file (a config file is read whole, once per reload)"


def eventually(check: Callable[[], bool], what: str) -> None:
    """Wait (10 s at most) for what another thread does; not a timing assertion."""
    for _ in range(1000):
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


class Blocking:
    """A read that blocks until released, as an open of a FIFO or of a file on a hung mount does."""

    def __init__(self, result: object = "read") -> None:
        self.result = result
        self.release = threading.Event()
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def __call__(self) -> object:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.release.wait(30)
        with self._lock:
            self.running -= 1
        return self.result


# --- the reloader ---------------------------------------------------------------------------------

def test_requests_during_a_read_are_coalesced_into_one_read_after_it() -> None:
    work = Blocking()
    reloader = Reloader("test file", work, deadline_s=60)
    assert reloader.request() is None  # started; nobody waits
    eventually(lambda: work.calls == 1, "the first read starts")
    results = [reloader.request() for _ in range(80)]
    assert results == [None] * 80 and work.calls == 1
    work.release.set()
    # A read that starts after this request: the 80 ride on the read after the first, this one
    # on that read or the next. Never 81 reads, never two at once.
    assert reloader.request(wait_s=30) == "read"
    assert 2 <= work.calls <= 3 and work.most_at_once == 1


def test_twenty_callers_at_once_all_get_the_outcome_of_a_read_that_goes_well() -> None:
    # On 0ae2a05 the third caller was answered "not done" at once, however fast the read.
    reads: list[threading.Thread] = []

    def work() -> str:
        reads.append(threading.current_thread())
        return "read"

    reloader = Reloader("test file", work, deadline_s=60)
    with ThreadPoolExecutor(20) as pool:
        assert list(pool.map(lambda _: reloader.request(wait_s=30), range(20), timeout=30)) == ["read"] * 20
    assert 1 <= len(reads) <= 20 and len(set(reads)) == 1, "one thread, which stays, reads for them all"


def test_beyond_two_callers_nobody_waits_long_for_a_slow_read() -> None:
    # A read that is slow, not yet stuck: two callers wait for its outcome, the others only while
    # it is young, and their requests still ride on the read after it.
    work = Blocking()
    reloader = Reloader("test file", work, deadline_s=60)
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(reloader.request, 30.0) for _ in range(5)]
        eventually(lambda: sum(f.done() for f in futures) == 5 - MAX_WAITERS, "all but two are answered")
        assert [f.result() for f in futures if f.done()] == [None] * (5 - MAX_WAITERS)
        assert reloader.stuck() is None and work.running == 1
        work.release.set()
        assert sorted(map(str, (f.result(timeout=30) for f in futures))) == ["None"] * 3 + ["read"] * 2
    assert work.calls <= 2 and work.most_at_once == 1


def test_a_stuck_read_makes_nobody_wait_and_says_so() -> None:
    work = Blocking()
    reloader = Reloader("config file /etc/mig.yml", work, deadline_s=0)
    reloader.request()
    eventually(lambda: reloader.stuck() is not None, "the read is past its deadline")
    assert reloader.stuck().startswith("reading config file /etc/mig.yml has not finished after ")  # type: ignore[union-attr]
    with ThreadPoolExecutor(16) as pool:  # each would wait 30 s if it waited at all
        assert list(pool.map(lambda _: reloader.request(wait_s=30), range(80), timeout=20)) == [None] * 80
    assert work.calls == 1
    work.release.set()
    eventually(lambda: reloader.stuck() is None and work.running == 0 and work.calls == 2, "the read after it")


def test_a_read_that_raises_ends_and_the_next_request_gets_a_read() -> None:
    calls = []

    def broken() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return "read"

    reloader = Reloader("test file", broken, deadline_s=60)
    assert reloader.request(wait_s=30) is None  # the failed read's result
    assert reloader.request(wait_s=30) == "read"


def test_a_thread_that_cannot_start_fails_that_request_and_the_next_one_starts_it(monkeypatch, caplog) -> None:
    # On 0ae2a05 the thread was kept before it started: one "can't start new thread" (a pids
    # limit) and no read ever ran again, while /-/ready said ready.
    start = threading.Thread.start
    refusals = [RuntimeError("can't start new thread")]

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("reload ") and refusals:
            raise refusals.pop()
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    reloader = Reloader("config file /etc/mig.yml", lambda: "read", deadline_s=60)
    with caplog.at_level(logging.WARNING, logger="mig_exporter"):
        assert reloader.request(wait_s=30) is None
    assert reloader.stuck() == "cannot start a thread to read config file /etc/mig.yml: can't start new thread"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "cannot start a thread to read config file /etc/mig.yml: can't start new thread; "
                          "the next request tries again")]
    assert reloader.request(wait_s=30) == "read"
    assert reloader.stuck() is None


def test_the_thread_ends_when_idle_and_the_next_request_starts_another(monkeypatch) -> None:
    monkeypatch.setattr(reloader_module, "IDLE_S", 0.05)
    reads: list[threading.Thread] = []

    def work() -> str:
        reads.append(threading.current_thread())
        return "read"

    reloader = Reloader("test file", work, deadline_s=60)
    assert reloader.request(wait_s=30) == "read"
    eventually(lambda: not reads[0].is_alive(), "the idle thread ends")
    assert reloader.request(wait_s=30) == "read"
    assert len(reads) == 2 and reads[1] is not reads[0]


# --- the server -----------------------------------------------------------------------------------

class Served:
    def __init__(self, server: ExporterServer, config_file: Path) -> None:
        self.server = server
        self.config_file = config_file

    def get(self, path: str, method: str = "GET") -> tuple[int, str]:
        request = urllib.request.Request(self.server.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics_times(self, meanwhile: list[Future[tuple[int, str]]]) -> list[float]:
        """How long each ``/metrics`` took, asked one after another until ``meanwhile`` are all
        answered (three at least)."""
        times: list[float] = []
        while len(times) < 3 or not all(f.done() for f in meanwhile):
            began = time.monotonic()
            assert self.get("/metrics")[0] == 200
            times.append(time.monotonic() - began)
        return times

    def reload_successful(self) -> float:
        status, body = self.get("/metrics")
        assert status == 200
        return next(s.value for f in text_string_to_metric_families(body) for s in f.samples
                    if s.name == "mig_exporter_config_last_reload_successful")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    servers: list[ExporterServer] = []

    def start(web: WebSettings | None = None) -> Served:
        config_file = tmp_path / "mig.yml"
        config_file.write_text(CONFIG)
        prober = Prober(load_config(config_file), config_file=str(config_file))
        server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), prober, timeout_s=10),
                                prober=prober, web=web)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return Served(server, config_file)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_fifo_as_the_config_file_is_refused_and_80_reloads_leave_metrics_answered(serve) -> None:
    # On 3139059 each reload opened the FIFO and waited for a writer: 80 filled the pool and
    # /metrics, /probe and / timed out while /-/healthy said 200.
    served = serve()
    served.config_file.unlink()
    os.mkfifo(served.config_file)
    with ThreadPoolExecutor(80) as pool:
        reloads = [pool.submit(served.get, "/-/reload", "POST") for _ in range(80)]
        assert all(took < 1.0 for took in served.metrics_times(reloads)), "/metrics answered within 1 s"
        answers = [reload.result(timeout=50) for reload in reloads]
    # 202: the read took longer than a quarter of a second (a loaded machine); never 503.
    assert {status for status, _ in answers} <= {400, 202}
    assert any(status == 400 and FIFO_REFUSED in body for status, body in answers)
    assert served.reload_successful() == 0
    assert served.get("/-/healthy") == (200, "Healthy\n")
    assert served.get("/-/ready")[0] == 200  # refused at once: nothing is stuck
    assert list(served.server.prober.config.probe_targets) == ["host"]  # type: ignore[union-attr]


def test_a_stuck_reload_turns_ready_off_while_metrics_and_healthy_answer(serve, monkeypatch) -> None:
    # A read no O_NONBLOCK can save (a hung mount): the reloader's thread waits in it, nobody else.
    read = Blocking()
    monkeypatch.setattr(probe, "RELOAD_DEADLINE_S", 0.2)
    monkeypatch.setattr(probe, "load_config", lambda path: (read(), load_config(path))[1])
    served = serve()
    with ThreadPoolExecutor(80) as pool:
        reloads = [pool.submit(served.get, "/-/reload", "POST") for _ in range(80)]
        assert all(took < 1.0 for took in served.metrics_times(reloads)), "/metrics answered within 1 s"
        answers = [reload.result(timeout=50) for reload in reloads]
    assert {status for status, _ in answers} == {503}
    assert read.calls == 1
    assert served.server.reload_stuck() is not None
    assert served.get("/-/healthy") == (200, "Healthy\n")
    status, body = served.get("/-/ready")
    assert status == 503
    assert body.startswith(f"Not ready: reading config file {served.config_file} has not finished after ")
    status, body = served.get("/-/reload", "POST")
    assert status == 503 and "has not finished" in body and "merged into the next read" in body
    read.release.set()
    eventually(lambda: served.get("/-/ready")[0] == 200, "ready again once the read ends")
    assert served.reload_successful() == 1


def test_twenty_reloads_at_once_of_a_good_config_all_succeed(serve) -> None:
    # On 0ae2a05 the third concurrent reload was answered 503 "Reload not done", however healthy.
    served = serve()
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: served.get("/-/reload", "POST"), range(20), timeout=50))
    assert [status for status, _ in answers] == [200] * 20
    assert all(body.startswith(f"reloaded {served.config_file}: ") for _, body in answers)
    assert served.reload_successful() == 1


def test_a_slow_reload_is_accepted_beyond_two_callers_and_its_outcome_given_to_two(serve, monkeypatch) -> None:
    # Slow, not stuck: two wait for the outcome (up to the 5 s deadline), the others are
    # answered 202 once the read has run a quarter of a second; /-/ready stays ready.
    read = Blocking()
    monkeypatch.setattr(probe, "load_config", lambda path: (read(), load_config(path))[1])
    served = serve()
    with ThreadPoolExecutor(5) as pool:
        reloads = [pool.submit(served.get, "/-/reload", "POST") for _ in range(5)]
        eventually(lambda: sum(r.done() for r in reloads) == 5 - MAX_WAITERS, "all but two are answered")
        accepted = [r.result() for r in reloads if r.done()]
        assert [status for status, _ in accepted] == [202] * (5 - MAX_WAITERS)
        assert "merged into the next read of the file" in accepted[0][1]
        assert served.get("/-/ready")[0] == 200
        read.release.set()
        answers = [r.result(timeout=30) for r in reloads]
    assert sorted(status for status, _ in answers) == [200] * MAX_WAITERS + [202] * (5 - MAX_WAITERS)
    assert read.calls <= 2, "the 202s rode on a read that ran anyway"


def test_a_torn_config_is_refused_on_reload(serve) -> None:
    # On 3139059 an empty file was applied as "0 probe targets" and reload_successful stayed 1.
    served = serve()
    for torn in ("", "probe_targets:\n"):
        served.config_file.write_text(torn)
        status, body = served.get("/-/reload", "POST")
        assert status == 400 and "refused as probably" in body
        assert served.reload_successful() == 0
        assert list(served.server.prober.config.probe_targets) == ["host"]  # type: ignore[union-attr]
    served.config_file.write_text("{}\n")  # empty by intent
    assert served.get("/-/reload", "POST")[0] == 200
    assert served.reload_successful() == 1


# --- the web config -------------------------------------------------------------------------------

def test_a_fifo_as_the_web_config_is_refused_and_the_config_in_force_kept(serve, tmp_path: Path, caplog) -> None:
    # On 3139059 the event loop itself opened the new web config: a FIFO froze every connection,
    # /-/healthy included. (That the loop never reads it is the stuck-read test's, below.)
    web_file = tmp_path / "web.yml"
    web_file.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    web = WebSettings(str(web_file), check_interval_s=0)
    served = serve(web)
    assert served.get("/-/healthy") == (200, "Healthy\n")
    web_file.unlink()
    os.mkfifo(web_file)
    refused = f"reloading {web_file} failed; kept the web config in force: {FIFO_REFUSED}"
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        for _ in range(5):
            assert served.get("/-/healthy") == (200, "Healthy\n")
            assert served.get("/metrics")[0] == 200
        eventually(lambda: served.get("/-/healthy")[0] == 200 and refused in caplog.messages, "the FIFO is refused")
    assert caplog.messages.count(refused) == 1, "refused once, not at every check"
    assert web.current().headers == {"X-Frame-Options": "deny"}  # the config in force is kept
    assert served.get("/-/ready")[0] == 200


def test_a_stuck_web_config_read_leaves_the_loop_free_and_ready_off(serve, tmp_path: Path, monkeypatch) -> None:
    web_file = tmp_path / "web.yml"
    web_file.write_text("{}\n")
    read = Blocking()
    monkeypatch.setattr(webconfig, "_RELOAD_DEADLINE_S", 0.2)
    web = WebSettings(str(web_file), check_interval_s=0)
    served = serve(web)
    monkeypatch.setattr(webconfig, "load_web_config", lambda path, **options: read())
    web_file.write_text("# changed\n{}\n")
    assert served.get("/-/healthy") == (200, "Healthy\n")  # a connection: the check starts, and blocks
    eventually(lambda: web.stuck() is not None, "the web config read is stuck")
    for _ in range(5):
        assert served.get("/-/healthy") == (200, "Healthy\n")
        assert served.get("/metrics")[0] == 200
    status, body = served.get("/-/ready")
    assert status == 503 and f"reading web config {web_file} has not finished" in body
    read.release.set()  # its result is not a WebConfig: logged as a failed reload, config kept
    eventually(lambda: served.get("/-/ready")[0] == 200, "ready again once the read ends")
    assert web.current().headers == {}


def test_the_loop_answers_healthy_at_once_while_a_web_config_check_is_slow(serve, tmp_path: Path,
                                                                           monkeypatch) -> None:
    # A slow mount, not a hung one: each check's stat takes 0.4 s. On 0ae2a05 the connection that
    # found a check due waited for it (up to 0.5 s), in the event loop: 10 /-/healthy took 4 s.
    web_file = tmp_path / "web.yml"
    web_file.write_text("{}\n")
    web = WebSettings(str(web_file), check_interval_s=0)
    served = serve(web)
    stat = webconfig._file_stamp

    def slow_stat(path: str) -> tuple[object, ...]:
        time.sleep(0.4)
        return stat(path)

    monkeypatch.setattr(webconfig, "_file_stamp", slow_stat)
    took = []
    for _ in range(10):
        began = time.monotonic()
        assert served.get("/-/healthy") == (200, "Healthy\n")
        took.append(time.monotonic() - began)
    assert max(took) < 1.0 and sum(took) < 2.0, took
    monkeypatch.setattr(webconfig, "_file_stamp", stat)
    web_file.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    eventually(lambda: served.get("/-/healthy") == (200, "Healthy\n") and web.config.headers != {},
               "a later connection gets the changed file")
    assert web.config.headers == {"X-Frame-Options": "deny"}
