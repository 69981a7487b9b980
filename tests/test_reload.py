"""Reloads cannot starve the server (issue 38): the config file and the web config are read by one
reloader each, off the event loop and off the pool, one read at a time, later requests coalesced;
a FIFO is refused at once; a read stuck past its deadline makes ``/-/ready`` not ready while
``/metrics`` and ``/-/healthy`` answer; a torn config is refused."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mig_exporter.config.file import load_config
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web import probe, webconfig
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


def test_at_most_two_requests_wait_for_a_read() -> None:
    work = Blocking()
    reloader = Reloader("test file", work, deadline_s=60)
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(reloader.request, 30.0) for _ in range(5)]
        eventually(lambda: sum(f.done() for f in futures) == 5 - MAX_WAITERS, "all but two are answered")
        assert [f.result() for f in futures if f.done()] == [None] * (5 - MAX_WAITERS)
        work.release.set()
        assert sorted(map(str, (f.result(timeout=30) for f in futures))) == ["None"] * 3 + ["read"] * 2


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
        answers = list(pool.map(lambda _: served.get("/-/reload", "POST"), range(80), timeout=50))
    assert {status for status, _ in answers} <= {400, 503}
    assert any(status == 400 and FIFO_REFUSED in body for status, body in answers)
    assert served.get("/metrics")[0] == 200
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
        answers = list(pool.map(lambda _: served.get("/-/reload", "POST"), range(80), timeout=50))
    assert {status for status, _ in answers} == {503}
    assert read.calls == 1
    eventually(lambda: served.server.reload_stuck() is not None, "the reload is past its deadline")
    assert served.get("/metrics")[0] == 200
    assert served.get("/-/healthy") == (200, "Healthy\n")
    status, body = served.get("/-/ready")
    assert status == 503
    assert body.startswith(f"Not ready: reading config file {served.config_file} has not finished after ")
    status, body = served.get("/-/reload", "POST")
    assert status == 503 and "has not finished" in body and "merged into the next read" in body
    read.release.set()
    eventually(lambda: served.get("/-/ready")[0] == 200, "ready again once the read ends")
    assert served.reload_successful() == 1


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

def test_a_fifo_as_the_web_config_freezes_nothing(serve, tmp_path: Path) -> None:
    # On 3139059 the event loop itself opened the new web config: a FIFO froze every connection,
    # /-/healthy included.
    web_file = tmp_path / "web.yml"
    web_file.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    web = WebSettings(str(web_file), check_interval_s=0)
    served = serve(web)
    assert served.get("/-/healthy") == (200, "Healthy\n")
    web_file.unlink()
    os.mkfifo(web_file)
    for _ in range(5):
        assert served.get("/-/healthy") == (200, "Healthy\n")
        assert served.get("/metrics")[0] == 200
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
