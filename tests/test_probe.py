"""``/probe?target=NAME`` on a real server on 127.0.0.1, through fake nvidia-smi binaries that log
every run: what runs, what is refused before anything runs, deadlines, the concurrency limit, shared
runs, reloads and the exporter's own counters on ``/metrics``."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MIB, FakeSmi, calls, fixture_bytes, left_behind
from mig_exporter.config.file import ProbeTarget, load_config, parse_config
from mig_exporter.core import flight
from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics import exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web.probe import Prober
from mig_exporter.web.server import ExporterServer
from test_flight import fail_thread_start_once

pytestmark = pytest.mark.timeout(60)

DRIVER_ERROR = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
H100_USED = {"1000": 3594 * MIB, "1001": 17 * MIB, "1002": 7493 * MIB, "1003": 9 * MIB}


# --- helpers -----------------------------------------------------------------------------------

@dataclass
class Exporter:
    url: str
    server: ExporterServer
    config_file: Path

    @property
    def prober(self) -> Prober:
        assert self.server.prober is not None
        return self.server.prober

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def get(self, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read().decode()

    def probe(self, target: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        status, _, body = self.get(f"/probe?target={urllib.parse.quote(target)}", headers)
        return status, body

    def raw(self, request_target: bytes) -> tuple[int, dict[str, str], bytes]:
        """GET with the request target exactly as given, bytes and all: no client library
        normalises or refuses it first."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(b"GET " + request_target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in header_lines)
        return int(status_line.split()[1]), headers, body

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        status, _, body = self.get("/metrics")
        assert status == 200
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(body) for s in f.samples}

    def write_config(self, targets: dict[str, tuple[list[str], str | None]]) -> None:
        self.config_file.write_text(config_text(targets))


def config_text(targets: dict[str, tuple[list[str], str | None]]) -> str:
    lines = ["probe_targets:"]
    for name, (command, timeout) in targets.items():
        lines.append(f"  {name}:")
        lines.append(f"    command: [{', '.join(repr(arg) for arg in command)}]")
        if timeout:
            lines.append(f"    timeout: {timeout}")
    return "\n".join(lines) + "\n"


Serve = Callable[..., Exporter]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Serve /probe for the given targets, from a config file loaded the way serve loads it."""
    servers: list[ExporterServer] = []

    def start(targets: dict[str, tuple[list[str], str | None]], *, max_concurrent: int = 4,
              default_timeout_s: float = 10.0, offset_s: float = 0.5) -> Exporter:
        config_file = tmp_path / f"mig-exporter-{len(servers)}.yml"
        config_file.write_text(config_text(targets))
        prober = Prober(load_config(config_file), max_concurrent=max_concurrent,
                        default_timeout_s=default_timeout_s, config_file=str(config_file))
        server = ExporterServer(("127.0.0.1", 0), exporter.Exporter(Scraper(DemoSource()), prober, timeout_s=10.0),
                                timeout_offset_s=offset_s, prober=prober)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return Exporter(server.url, server, config_file)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def parse(body: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


def value(parsed: dict, name: str, **labels: str) -> float | None:
    found = [v for (n, ls), v in parsed.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
    return found[0] if found else None


def names(parsed: dict) -> set[str]:
    return {n for n, _ in parsed}


def h100(fake_nvidia_smi: FakeSmi, **kwargs) -> Path:
    return fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"),
                           **kwargs)


def a100(fake_nvidia_smi: FakeSmi, **kwargs) -> Path:
    return fake_nvidia_smi(fixture_bytes("a100-mig-pending.xml"), fixture_bytes("a100-mig-pending.L.txt"), **kwargs)


def timed(func: Callable[[], tuple]) -> tuple[tuple, float]:
    started = time.monotonic()
    result = func()
    return result, time.monotonic() - started


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# --- a probe reads the target's command --------------------------------------------------------

def test_a_probe_answers_with_the_targets_devices_and_probe_success(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], "5s"), "gpu-b": ([str(a100(fake_nvidia_smi))], None)})

    status, body = exp.probe("gpu-a")
    assert status == 200
    a = parse(body)
    assert value(a, "probe_success") == 1
    assert 0 < value(a, "probe_duration_seconds") < 5
    assert value(a, "probe_read_problems") == 0
    used = {dict(ls)["index"]: v for (n, ls), v in a.items() if n == "mig_exporter_device_memory_used_bytes"}
    assert used == H100_USED
    assert value(a, "mig_exporter_process_memory_used_bytes", pid="21198", index="1002",
                 mig_profile="1g.10gb") == 7484 * MIB
    assert value(a, "mig_exporter_card_mig_instances", card="0") == 4
    # The exporter's own series stay on /metrics.
    assert not {n for n in names(a) if n.startswith(("mig_exporter_read_", "mig_exporter_build", "mig_exporter_probe"))}

    status, body = exp.probe("gpu-b")
    b = parse(body)
    assert status == 200 and value(b, "probe_success") == 1
    assert value(b, "mig_exporter_device_memory_used_bytes", index="0", mig_profile="") == 5371854848
    assert value(b, "mig_exporter_process_info", pid="900", process_name="/usr/bin/python3") == 1
    assert value(b, "mig_exporter_device_memory_used_bytes", index="1000") is None


def test_each_probe_runs_the_target_afresh(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake)], None)})
    assert exp.probe("gpu-a")[0] == 200
    assert exp.probe("gpu-a")[0] == 200
    assert sorted(args for _, args in calls(fake)) == ["-L", "-L", "-q -x", "-q -x"]


def test_the_command_is_an_argv_prefix_the_probe_appends_to(serve: Serve, fake_nvidia_smi: FakeSmi,
                                                             fake_wrapper) -> None:
    # Like ["ssh", "gpu-07", "nvidia-smi"]: the wrapper gets its own arguments, then -q -x or -L.
    fake = h100(fake_nvidia_smi)
    wrapper = fake_wrapper(fake, fixed_args=2)
    exp = serve({"gpu-07": ([str(wrapper), "gpu-07", "--"], None)})

    status, body = exp.probe("gpu-07")

    assert status == 200 and value(parse(body), "probe_success") == 1
    wrapped = sorted(line.split(" ", 1)[1] for line in (wrapper.parent / "wrapper.log").read_text().splitlines())
    assert wrapped == ["gpu-07 -- -L", "gpu-07 -- -q -x"]


def test_a_percent_encoded_name_is_the_same_name(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake)], None)})
    status, _, body = exp.raw(b"/probe?target=%67pu%2Da")
    assert status == 200 and b"probe_success 1.0" in body


def test_openmetrics_and_gzip_are_negotiated_on_probe(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], None)})
    status, headers, body = exp.get("/probe?target=gpu-a", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF") and "probe_success 1.0" in body


# --- refused before anything runs --------------------------------------------------------------

FAKE_PATH = "{fake}"  # replaced by the configured fake's own absolute path

REFUSED = [
    # (request target, reason in the answer)
    (b"/probe", "missing target"),
    (b"/probe?", "missing target"),
    (b"/probe?target=", "empty target"),
    (b"/probe?target", "empty target"),
    (b"/probe?target=gpu-a&target=gpu-a", "target is given 2 times"),
    (b"/probe?target=gpu-a&target=gpu-b", "target is given 2 times"),
    (b"/probe?target=gpu-a&target=", "target is given 2 times"),
    (b"/probe?target={fake}", "is not a target name"),
    (b"/probe?target={fake_encoded}", "is not a target name"),
    (b"/probe?target=nvidia-smi", "unknown target 'nvidia-smi'"),
    (b"/probe?target=/usr/bin/nvidia-smi", "is not a target name"),
    (b"/probe?target=GPU-A", "unknown target 'GPU-A'"),
    (b"/probe?target=gpu-c", "unknown target 'gpu-c': not in probe_targets (gpu-a, gpu-b)"),
    (b"/probe?target=gpu-a;id", "is not a target name"),
    (b"/probe?target=gpu-a%3Bid", "is not a target name"),
    (b"/probe?target=gpu-a|id", "is not a target name"),
    (b"/probe?target=%24(id)", "is not a target name"),
    (b"/probe?target=%60id%60", "is not a target name"),
    (b"/probe?target=gpu-a%26%26id", "is not a target name"),
    (b"/probe?target=gpu-a+id", "is not a target name"),
    (b"/probe?target=gpu-a%20", "is not a target name"),
    (b"/probe?target=%20gpu-a", "is not a target name"),
    (b"/probe?target=-q", "is not a target name"),
    (b"/probe?target=--help", "is not a target name"),
    (b"/probe?target=../gpu-a", "is not a target name"),
    (b"/probe?target=..%2Fgpu-a", "is not a target name"),
    (b"/probe?target=%2E%2E%2Fgpu-a", "is not a target name"),
    (b"/probe?target=gpu-a%2F..", "is not a target name"),
    (b"/probe?target=.%2Fgpu-a", "is not a target name"),
    (b"/probe?target=%2Fbin%2Fsh", "is not a target name"),
    (b"/probe?target=%252E%252E%252Fgpu-a", "is not a target name"),  # encoded twice
    (b"/probe?target=gpu-a%00", "is not a target name"),
    (b"/probe?target=gpu-a%00.sh", "is not a target name"),
    (b"/probe?target=gpu-a%0A", "is not a target name"),
    (b"/probe?target=gpu-a%0D%0AX-Evil:%201", "is not a target name"),
    (b"/probe?target=gpu-%D0%B0", "is not a target name"),  # Cyrillic a
    (b"/probe?target=gpu%E2%80%90a", "is not a target name"),  # U+2010 hyphen
    (b"/probe?target=%EF%BD%87pu-a", "is not a target name"),  # fullwidth g
    (b"/probe?target=gpu-a%E2%80%8B", "is not a target name"),  # zero-width space
    (b"/probe?target=gpu-\xd0\xb0", "is not a target name"),  # raw UTF-8 bytes, not encoded
    (b"/probe?target=%C0%AE%C0%AE%2Fgpu-a", "not valid UTF-8"),  # overlong dots
    (b"/probe?target=%FF", "not valid UTF-8"),
    (b"/probe?target=" + b"a" * 65, "is not a target name"),
    (b"/probe?target=" + b"a" * 5000, "is not a target name"),
    (b"/probe?Target=gpu-a", "unknown parameter 'Target'"),
    (b"/probe?target=gpu-a&module=nvidia", "unknown parameter 'module'"),
    (b"/probe?target%00=gpu-a", "unknown parameter 'target\\x00'"),
    (b"/probe?" + b"&".join([b"x=1"] * 17), "more than 16 query parameters"),
]


@pytest.mark.parametrize("request_target, reason", REFUSED, ids=[r[0].decode("latin-1")[:60] for r in REFUSED])
def test_anything_but_one_configured_name_gets_400_and_runs_nothing(
    serve: Serve, fake_nvidia_smi: FakeSmi, request_target: bytes, reason: str
) -> None:
    fake_a, fake_b = h100(fake_nvidia_smi), a100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake_a)], None), "gpu-b": ([str(fake_b)], None)})
    request_target = request_target.replace(b"{fake}", str(fake_a).encode()).replace(
        b"{fake_encoded}", urllib.parse.quote(str(fake_a), safe="").encode())

    status, headers, body = exp.raw(request_target)

    assert status == 400
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    text = body.decode("ascii")  # client input is echoed escaped, never raw
    assert text.endswith("\n") and text.count("\n") == 1, f"not one line: {text!r}"
    assert reason in text
    assert len(text) < 200
    for fake in (fake_a, fake_b):
        assert not (fake.parent / "calls.log").exists(), f"{request_target!r} ran {fake}"
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="bad_request") == 1
    assert value(metrics, "mig_exporter_probes_total", target="gpu-a") == 0
    assert value(metrics, "mig_exporter_probes_total", target="gpu-b") == 0


def test_methods_other_than_get_run_nothing(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake)], None)})
    status, headers, _ = exp.get("/probe?target=gpu-a", method="POST")
    assert (status, headers["Allow"]) == (405, "GET, HEAD")
    assert exp.get("/probe?target=gpu-a", method="PUT")[0] == 501
    assert exp.get("/probe/gpu-a")[0] == 404
    assert not (fake.parent / "calls.log").exists()


def test_without_a_config_file_probe_and_reload_say_so(tmp_path: Path) -> None:
    server = ExporterServer(("127.0.0.1", 0), exporter.Exporter(Scraper(DemoSource()), timeout_s=10.0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        exp = Exporter(server.url, server, tmp_path / "none.yml")
        assert exp.probe("gpu-a") == (400, "no probe targets: serve was started without --config.file\n")
        status, _, body = exp.get("/-/reload", method="POST")
        assert (status, body) == (400, "no config file to reload: serve was started without --config.file\n")
        assert not {n for n in names(exp.metrics()) if "probe" in n or "config" in n}
    finally:
        server.shutdown()
        server.server_close()


# --- failures are data -------------------------------------------------------------------------

def test_a_failing_target_is_probe_success_0_with_the_reason_logged(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    exp = serve({"broken": ([str(h100(fake_nvidia_smi, mode="fail", stderr=DRIVER_ERROR))], None),
                 "gpu-b": ([str(a100(fake_nvidia_smi))], None)})

    status, body = exp.probe("broken")

    assert status == 200
    parsed = parse(body)
    assert value(parsed, "probe_success") == 0
    assert value(parsed, "probe_duration_seconds") > 0
    assert names(parsed) == {"probe_success", "probe_duration_seconds"}  # nothing reported as 0
    assert any("probe target broken failed" in r.getMessage() and DRIVER_ERROR in r.getMessage()
               for r in caplog.records)
    assert exp.probe("gpu-b")[0] == 200
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_total", target="broken") == 1
    assert value(metrics, "mig_exporter_probe_failures_total", target="broken") == 1
    assert value(metrics, "mig_exporter_probes_total", target="gpu-b") == 1
    assert value(metrics, "mig_exporter_probe_failures_total", target="gpu-b") == 0
    assert "Traceback" not in caplog.text


def test_a_target_printing_garbage_is_probe_success_0(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture
) -> None:
    exp = serve({"junk": ([str(fake_nvidia_smi(mode="garbage", list_mode="garbage"))], None)})
    for _ in range(3):  # different random bytes each time
        status, body = exp.probe("junk")
        assert status == 200
        assert names(parse(body)) == {"probe_success", "probe_duration_seconds"}
        assert value(parse(body), "probe_success") == 0
    assert value(exp.metrics(), "mig_exporter_probe_failures_total", target="junk") == 3
    assert "probe target junk failed" in caplog.text
    assert "Traceback" not in caplog.text


def test_a_target_whose_binary_is_missing_is_probe_success_0(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "driver" / "usr" / "bin" / "nvidia-smi"
    exp = serve({"driver-root": ([str(missing)], None)})
    status, body = exp.probe("driver-root")
    assert status == 200 and value(parse(body), "probe_success") == 0
    assert f"{missing}: no such file" in caplog.text


def test_a_failed_listing_keeps_the_probe_and_counts_a_problem(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi, list_mode="fail"))], None)})
    parsed = parse(exp.probe("gpu-a")[1])
    assert value(parsed, "probe_success") == 1
    assert value(parsed, "probe_read_problems") == 1
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002", mig_profile="") == 7493 * MIB


# --- deadlines ---------------------------------------------------------------------------------

def test_a_hung_target_is_killed_at_its_timeout(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture
) -> None:
    fake = h100(fake_nvidia_smi, mode="hang", list_mode="hang")
    exp = serve({"hung": ([str(fake)], "1s")})

    (status, body), elapsed = timed(lambda: exp.probe("hung"))

    assert status == 200
    parsed = parse(body)
    assert value(parsed, "probe_success") == 0
    duration = value(parsed, "probe_duration_seconds")
    assert 1.0 <= duration <= elapsed
    # The bound is deadline + 100 ms; shared machines are noisy, so the test allows 1 s.
    assert 1.0 <= elapsed < 1.0 + 1.0, f"answered after {elapsed:.3f}s for a 1s deadline"
    pgids = [pid for pid, _ in calls(fake)]
    assert len(pgids) == 2
    live, zombies = left_behind(pgids)
    assert live == [] and zombies == []
    assert any("probe target hung failed" in r.getMessage() and "timed out" in r.getMessage()
               and "process group killed" in r.getMessage() for r in caplog.records)
    assert value(exp.metrics(), "mig_exporter_probe_failures_total", target="hung") == 1


def test_prometheus_scrape_timeout_less_the_offset_wins_when_shorter(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi, mode="hang")
    exp = serve({"hung": ([str(fake)], "2500ms")}, offset_s=0.5)

    (status, body), elapsed = timed(lambda: exp.probe("hung", {"X-Prometheus-Scrape-Timeout-Seconds": "2"}))

    assert status == 200 and value(parse(body), "probe_success") == 0
    assert 1.5 <= elapsed < 1.5 + 1.0, f"answered after {elapsed:.3f}s for a 1.5s deadline"
    # The run itself goes on to the target's own timeout (another probe may be due with it), then
    # is killed; the probe's own deadline is no failure of the target's (issue 38).
    wait_until(lambda: left_behind([pid for pid, _ in calls(fake)])[0] == [])
    assert value(exp.metrics(), "mig_exporter_probe_failures_total", target="hung") == 0


def test_the_target_timeout_wins_when_shorter_than_prometheus(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"hung": ([str(h100(fake_nvidia_smi, mode="hang"))], "500ms")})
    (status, body), elapsed = timed(lambda: exp.probe("hung", {"X-Prometheus-Scrape-Timeout-Seconds": "10"}))
    assert status == 200 and value(parse(body), "probe_success") == 0
    assert 0.5 <= elapsed < 0.5 + 1.0


def test_without_a_timeout_in_the_config_serves_timeout_applies(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"hung": ([str(h100(fake_nvidia_smi, mode="hang"))], None)}, default_timeout_s=0.7)
    (status, body), elapsed = timed(lambda: exp.probe("hung"))
    assert status == 200 and value(parse(body), "probe_success") == 0
    assert 0.7 <= elapsed < 0.7 + 1.0


def test_a_probe_sharing_a_run_still_answers_by_its_own_deadline(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture
) -> None:
    fake = h100(fake_nvidia_smi, mode="hang")
    exp = serve({"hung": ([str(fake)], "4s")}, offset_s=0.5)
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(timed, lambda: exp.probe("hung"))
        wait_until(lambda: len(calls(fake)) == 2)
        # Prometheus gives this one 1.5 s: it must not wait for the first run's 4 s.
        (status, body), elapsed = timed(lambda: exp.probe("hung", {"X-Prometheus-Scrape-Timeout-Seconds": "1.5"}))
        assert status == 200 and value(parse(body), "probe_success") == 0
        assert 1.0 <= elapsed < 1.0 + 1.0
        assert not first.done()
        (status, body), first_elapsed = first.result(timeout=10)
    assert status == 200 and value(parse(body), "probe_success") == 0
    assert 4.0 <= first_elapsed < 4.0 + 1.0
    assert len(calls(fake)) == 2, "the second probe started a run of its own"
    # The second probe's deadline came before the run's: its own timeout, neither a failure of the
    # target's nor a WARNING (issue 38); the first probe takes the run's own failure.
    assert [r.getMessage() for r in caplog.records if "own deadline" in r.getMessage()
            and r.levelno >= logging.WARNING] == []
    assert value(exp.metrics(), "mig_exporter_probe_failures_total", target="hung") == 1


# --- concurrency -------------------------------------------------------------------------------

def test_twenty_concurrent_probes_of_one_target_cause_one_run(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi, delay_s=1.0)
    # One slot: probes that share a run take none, so none of the twenty is refused.
    exp = serve({"gpu-a": ([str(fake)], None)}, max_concurrent=1)
    barrier = threading.Barrier(20)

    def probe(_: int) -> tuple[int, str]:
        barrier.wait(timeout=10)
        return exp.probe("gpu-a")

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(probe, range(20)))

    assert [status for status, _ in results] == [200] * 20
    for _, body in results:
        parsed = parse(body)
        assert value(parsed, "probe_success") == 1
        assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * MIB
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"]
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_total", target="gpu-a") == 20
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="busy") == 0


def test_beyond_the_limit_a_probe_gets_a_fast_503_and_runs_nothing(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    slow = h100(fake_nvidia_smi, mode="hang")
    other = a100(fake_nvidia_smi)
    exp = serve({"slow": ([str(slow)], "2s"), "other": ([str(other)], None)}, max_concurrent=1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(exp.probe, "slow")
        wait_until(lambda: len(calls(slow)) == 2)

        (status, body), elapsed = timed(lambda: exp.probe("other"))

        assert status == 503
        assert body == "1 probes are running already (--probe.max-concurrent); try again later\n"
        assert elapsed < 1.0, f"503 took {elapsed:.3f}s"
        assert not (other.parent / "calls.log").exists()
        assert not running.done()
        assert running.result(timeout=10)[0] == 200
    # The slot is free again once the hung run was killed.
    status, body = exp.probe("other")
    assert status == 200 and value(parse(body), "probe_success") == 1
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="busy") == 1
    assert value(metrics, "mig_exporter_probes_total", target="other") == 1  # the 503 was no probe


def test_failed_and_timed_out_probes_give_their_slot_back(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"broken": ([str(h100(fake_nvidia_smi, mode="fail"))], None),
                 "hung": ([str(h100(fake_nvidia_smi, mode="hang"))], "300ms"),
                 "junk": ([str(fake_nvidia_smi(mode="garbage"))], None),
                 "gpu-a": ([str(h100(fake_nvidia_smi))], None)}, max_concurrent=1)
    for _ in range(3):
        for name in ("broken", "hung", "junk"):
            assert exp.probe(name)[0] == 200
    assert exp.probe("gpu-a")[0] == 200
    assert value(exp.metrics(), "mig_exporter_probes_rejected_total", reason="busy") == 0


def test_a_probe_whose_run_cannot_start_gets_a_503_and_gives_its_slot_back(
    serve: Serve, fake_nvidia_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread for the run (a pids limit): the probe is refused as a busy one is, nothing is left
    in flight and its slot is free again, so the next probe runs."""
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], None)}, max_concurrent=1)
    fail_thread_start_once(monkeypatch, "probe")
    status, body = exp.probe("gpu-a")
    assert status == 503
    assert body == "could not start a thread for the probe: can't start new thread; try again later\n"
    status, body = exp.probe("gpu-a")
    assert status == 200 and value(parse(body), "probe_success") == 1
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_total", target="gpu-a") == 1
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="busy") == 0


class _HeldSource:
    """A read that holds until released: a run that overruns its deadline (a bug; a command is
    killed at it)."""

    name = "nvidia-smi"

    def __init__(self) -> None:
        self.release = threading.Event()

    def read(self, deadline=None):
        self.release.wait(10)
        return DemoSource().read()

    def ready(self):
        return True, "held"

    def describe(self):
        return "held"


def test_a_probe_its_own_run_kept_past_its_deadline_says_so(
    fake_nvidia_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe that started the run was not waiting for a run already in progress: its log line
    says its run did not finish; a probe that joined it says it waited for one."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 0.05)
    held = _HeldSource()

    class HeldProber(Prober):
        def _new_scraper(self, target: ProbeTarget) -> Scraper:
            return Scraper(held, name=f"probe target {target.name}")

    # The target's timeout is the probes' deadline: the run is due with them, and keeps them waiting.
    prober = HeldProber(parse_config(f"probe_targets:\n  gpu-a: {{command: ['{h100(fake_nvidia_smi)}']}}\n", "mig.yml"),
                        default_timeout_s=0.2)
    target = prober.config.probe_targets["gpu-a"]
    try:
        for _ in range(2):  # the second joins the run the first started, long overdue
            assert not prober.probe(target, Deadline.after(0.2)).outcome.success
    finally:
        held.release.set()
    lines = [r.getMessage() for r in caplog.records if r.name == "mig_exporter.web.probe"]
    assert lines == ["read from probe target gpu-a failed: its run did not finish within the deadline of 0.2s",
                     "read from probe target gpu-a failed: deadline of 0.2s passed while waiting for the run "
                     "already in progress"]


def test_different_targets_run_in_parallel_up_to_the_limit(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    targets = {f"gpu-{i}": ([str(h100(fake_nvidia_smi, delay_s=0.5))], None) for i in range(4)}
    exp = serve(targets, max_concurrent=4)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(exp.probe, targets))
    assert [status for status, _ in results] == [200] * 4
    assert all(value(parse(body), "probe_success") == 1 for _, body in results)


# --- the exporter's own metrics and reloads ----------------------------------------------------

def test_counters_are_there_for_every_target_before_any_probe(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], None), "gpu-b": (["nvidia-smi"], "2s")})
    metrics = exp.metrics()
    for target in ("gpu-a", "gpu-b"):
        assert value(metrics, "mig_exporter_probes_total", target=target) == 0
        assert value(metrics, "mig_exporter_probe_failures_total", target=target) == 0
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="bad_request") == 0
    assert value(metrics, "mig_exporter_probes_rejected_total", reason="busy") == 0
    assert value(metrics, "mig_exporter_config_last_reload_successful") == 1
    assert abs(value(metrics, "mig_exporter_config_last_reload_success_timestamp_seconds") - time.time()) < 60
    assert value(metrics, "mig_exporter_read_success", source="demo") == 1  # /metrics itself unchanged
    assert not {n for n in names(metrics) if n.startswith("probe_")}


def test_reload_adds_keeps_and_removes_targets(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake_a, fake_new = h100(fake_nvidia_smi), a100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake_a)], None), "gpu-old": ([str(fake_a)], None)})
    assert exp.probe("gpu-a")[0] == 200
    assert exp.probe("gpu-new")[0] == 400

    exp.write_config({"gpu-a": ([str(fake_a)], None), "gpu-new": ([str(fake_new)], "3s")})
    status, _, body = exp.get("/-/reload", method="POST")

    assert (status, body) == (200, f"reloaded {exp.config_file}: 2 probe targets (gpu-a, gpu-new); "
                                   "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm\n")
    status, body = exp.probe("gpu-new")
    assert status == 200 and value(parse(body), "mig_exporter_device_memory_used_bytes", index="0") == 5371854848
    assert exp.probe("gpu-old")[0] == 400
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_total", target="gpu-a") == 1  # kept across the reload
    assert value(metrics, "mig_exporter_probes_total", target="gpu-new") == 1
    assert value(metrics, "mig_exporter_probes_total", target="gpu-old") is None  # gone with its target


def test_a_bad_reload_keeps_the_old_config_and_says_why(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture
) -> None:
    fake = h100(fake_nvidia_smi)
    exp = serve({"gpu-a": ([str(fake)], None)})
    loaded_at = value(exp.metrics(), "mig_exporter_config_last_reload_success_timestamp_seconds")
    exp.config_file.write_text("probe_targets:\n  gpu-a:\n    command: nvidia-smi\n    timeout: 5\n  '../x': {}\n")

    status, _, body = exp.get("/-/reload", method="POST")

    assert status == 400
    assert body.splitlines() == [
        f"reloading {exp.config_file} failed; kept the previous config, 1 probe target (gpu-a); "
            "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm:",
        "  probe_targets.gpu-a.command: must be a list of arguments (no shell is used), e.g. ['nvidia-smi']",
        "  probe_targets.gpu-a.timeout: must be a duration such as 5s or 500ms, not a number (write 5s)",
        "  probe_targets.'../x': not a valid target name "
        "(a letter or digit, then letters, digits, '_', '.' or '-'; at most 64 characters)",
    ]
    assert "Traceback" not in body
    status, probe_body = exp.probe("gpu-a")
    assert status == 200 and value(parse(probe_body), "probe_success") == 1
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_config_last_reload_successful") == 0
    assert value(metrics, "mig_exporter_config_last_reload_success_timestamp_seconds") == loaded_at
    assert any(r.levelno == logging.ERROR and "kept the previous config" in r.getMessage()
               and "probe_targets.gpu-a.command" in r.getMessage() for r in caplog.records)

    exp.config_file.unlink()
    status, _, body = exp.get("/-/reload", method="POST")
    assert status == 400 and "cannot read: No such file or directory" in body
    assert exp.probe("gpu-a")[0] == 200

    exp.write_config({"gpu-a": ([str(fake)], None)})
    assert exp.get("/-/reload", method="POST")[0] == 200
    assert value(exp.metrics(), "mig_exporter_config_last_reload_successful") == 1


def test_a_reload_while_a_probe_runs_lets_it_finish(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100(fake_nvidia_smi, delay_s=1.0)
    exp = serve({"gpu-a": ([str(fake)], None)})
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(exp.probe, "gpu-a")
        wait_until(lambda: len(calls(fake)) >= 1)
        exp.write_config({"gpu-b": ([str(fake)], None)})
        assert exp.get("/-/reload", method="POST")[0] == 200
        status, body = running.result(timeout=10)
    assert status == 200 and value(parse(body), "probe_success") == 1
    metrics = exp.metrics()
    assert value(metrics, "mig_exporter_probes_total", target="gpu-a") is None
    assert value(metrics, "mig_exporter_probes_total", target="gpu-b") == 0


def test_the_landing_page_links_the_probe_targets(serve: Serve, fake_nvidia_smi: FakeSmi) -> None:
    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], None), "host": (["chroot", "/host", "nvidia-smi"], None)})
    status, _, page = exp.get("/")
    assert status == 200
    assert 'href="/probe?target=gpu-a"' in page and 'href="/probe?target=host"' in page
    assert "chroot" not in page  # names only; commands stay in the config file


def test_a_reload_hands_the_new_config_to_the_engine_watch(tmp_path):
    from mig_exporter.config.file import load_config

    path = tmp_path / "mig-exporter.yml"
    path.write_text("engines:\n  presets: {vllm: false}\n")
    seen = []
    prober = Prober(load_config(path), config_file=str(path), on_reload=seen.append)
    assert "vllm" not in load_config(path).engines.engines
    path.write_text("engines:\n  presets: {vllm: true}\n")
    ok, _ = prober.reload()
    assert ok and len(seen) == 1 and "vllm" in seen[0].engines.engines
    path.write_text("engines:\n  presets: {vllm: maybe}\n")
    ok, _ = prober.reload()
    assert not ok and len(seen) == 1, "a bad file is not handed on"


def test_an_unexpected_error_in_a_reload_is_a_failed_reload_in_one_line(
    serve: Serve, fake_nvidia_smi: FakeSmi, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mig_exporter.web.probe

    exp = serve({"gpu-a": ([str(h100(fake_nvidia_smi))], None)})

    def broken(path):
        raise MemoryError

    monkeypatch.setattr(mig_exporter.web.probe, "load_config", broken)
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        status, _, body = exp.get("/-/reload", method="POST")

    assert status == 400
    assert body.splitlines() == [
        f"reloading {exp.config_file} failed; kept the previous config, 1 probe target (gpu-a); "
        "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm:",
        "  unexpected error: MemoryError",
    ]
    assert value(exp.metrics(), "mig_exporter_config_last_reload_successful") == 0
    assert exp.probe("gpu-a")[0] == 200
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1 and problems[0].exc_info is None, [r.getMessage() for r in problems]
    assert problems[0].getMessage().endswith("kept the previous config, 1 probe target (gpu-a); engines: llama.cpp, "
                                             "ollama, vllm, sglang, tgi, triton, tensorrt-llm: unexpected error: "
                                             "MemoryError")


def test_a_failing_reload_hook_is_a_failed_reload_that_keeps_the_targets(tmp_path, caplog):
    path = tmp_path / "mig-exporter.yml"
    path.write_text("probe_targets:\n  gpu-a: {command: [nvidia-smi]}\n")

    def broken(config):
        raise ValueError("engine watch refused it")

    prober = Prober(load_config(path), config_file=str(path), on_reload=broken)
    path.write_text("probe_targets:\n  gpu-b: {command: [nvidia-smi]}\n")
    ok, message = prober.reload()
    assert not ok and message.splitlines()[-1] == "  unexpected error: ValueError: engine watch refused it"
    assert list(prober.config.probe_targets) == ["gpu-a"]
    assert value(parse_metrics(prober), "mig_exporter_config_last_reload_successful") == 0


def parse_metrics(prober: Prober) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for f in prober.collect() for s in f.samples}
