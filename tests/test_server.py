"""The HTTP server on 127.0.0.1 with a real client: paths, formats, failures, deadlines."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MIB, fixture_bytes
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.web.server import ExporterServer, parse_listen_address


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _value(body: bytes, name: str, labels: dict[str, str]) -> float | None:
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_metrics_from_a_mig_node_through_the_fake_nvidia_smi(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    url = serve(NvidiaSmiSource(str(smi)))
    status, headers, body = _get(url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert _value(body, "mig_exporter_device_memory_used_bytes",
                  {"index": "1000", "mig_profile": "3g.40gb"}) == 3594 * MIB
    assert _value(body, "mig_exporter_process_memory_used_bytes", {"pid": "21181", "index": "1000"}) == 1272 * MIB
    assert _value(body, "mig_exporter_read_success", {"source": "nvidia-smi"}) == 1


def test_each_scrape_reads_afresh(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("a100-mig-pending.xml"), fixture_bytes("a100-mig-pending.L.txt"))
    url = serve(NvidiaSmiSource(str(smi)))
    _get(url + "/metrics")
    _get(url + "/metrics")
    calls = (smi.parent / "calls.log").read_text().splitlines()
    # pmon too: the pending card is still whole, with processes (per-process activity).
    assert sorted(line.split(" ", 1)[1] for line in calls) == ["-L", "-L", "-q -x", "-q -x", "pmon -c 1 -s u -i 0",
                                                               "pmon -c 1 -s u -i 0"]


def test_openmetrics_and_gzip_are_negotiated(serve):
    url = serve(DemoSource())
    status, headers, body = _get(url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    status, headers, body = _get(url + "/metrics", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert b"mig_exporter_device_info" in gzip.decompress(body)


def test_answers_go_out_without_waiting_for_the_clients_delayed_ack():
    # The headers and the body are two writes. With Nagle's algorithm on, the
    # body waits for the client's delayed ACK of the headers: ~40 ms added to
    # every scrape on a kept-alive connection, as Prometheus keeps them.
    server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), timeout_s=10))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        for _ in range(2):  # one connection, kept alive
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and b"mig_exporter_device_info" in response.read()
        (accepted,) = server.loop.connections.values()
        deadline = time.monotonic() + 5  # the loop takes the connection back just after the answer
        while accepted.served < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted.served == 2
        assert accepted.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_read_still_answers_200_with_read_success_zero(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(mode="fail")
    url = serve(NvidiaSmiSource(str(smi)))
    status, _, body = _get(url + "/metrics")
    assert status == 200
    assert _value(body, "mig_exporter_read_success", {"source": "nvidia-smi"}) == 0
    assert _value(body, "mig_exporter_read_errors_total", {"source": "nvidia-smi"}) == 1
    assert b"Traceback" not in body


def test_garbage_from_nvidia_smi_is_a_failed_read_not_a_500(serve, fake_nvidia_smi):
    url = serve(NvidiaSmiSource(str(fake_nvidia_smi(mode="garbage"))))
    status, _, body = _get(url + "/metrics")
    assert status == 200 and _value(body, "mig_exporter_read_success", {}) == 0


def test_a_hung_read_answers_within_prometheus_scrape_timeout(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), mode="hang")
    url = serve(NvidiaSmiSource(str(smi), timeout_s=30), timeout_s=30, offset_s=1.0)
    started = time.monotonic()
    status, _, body = _get(url + "/metrics", {"X-Prometheus-Scrape-Timeout-Seconds": "2"})
    elapsed = time.monotonic() - started
    assert status == 200 and _value(body, "mig_exporter_read_success", {}) == 0
    # The read gets 2 s less the 1 s offset; Prometheus would give up at 2 s.
    assert elapsed < 2.0, f"answered after {elapsed:.2f}s, past Prometheus' 2s scrape timeout"


def test_health_stays_up_while_reads_fail_and_ready_says_why(serve, tmp_path):
    url = serve(NvidiaSmiSource(str(tmp_path / "missing" / "nvidia-smi")))
    assert _get(url + "/-/healthy")[0] == 200
    status, _, body = _get(url + "/-/ready")
    assert status == 503 and b"no such file" in body
    ready = serve(DemoSource())
    assert _get(ready + "/-/ready")[0] == 200


def test_landing_page_names_version_source_and_links(serve):
    url = serve(DemoSource())
    status, headers, body = _get(url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "mig-exporter 0.1.0" in page and "demo" in page
    for link in ('href="/metrics"', 'href="/-/healthy"', 'href="/-/ready"'):
        assert link in page


def test_unknown_paths_and_methods(serve):
    url = serve(DemoSource())
    assert _get(url + "/nope")[0] == 404
    # POST exists for /-/reload alone; elsewhere it is a method the path does not allow.
    status, headers, _ = _get(url + "/metrics", method="POST")
    assert (status, headers["Allow"]) == (405, "GET, HEAD")
    status, headers, _ = _get(url + "/-/reload")
    assert (status, headers["Allow"]) == (405, "POST")
    assert _get(url + "/metrics", method="PUT")[0] == 501
    status, headers, body = _get(url + "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_concurrent_scrapes_are_all_answered(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h200-shared-gpu-instance.xml"),
                          fixture_bytes("h200-shared-gpu-instance.L.txt"), delay_s=0.3)
    url = serve(NvidiaSmiSource(str(smi)))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: _get(url + "/metrics"), range(8)))
    elapsed = time.monotonic() - started
    assert [r[0] for r in results] == [200] * 8
    assert all(_value(r[2], "mig_exporter_device_processes", {"index": "1001"}) == 1 for r in results)
    # Served in parallel: eight 0.3 s reads one after another would take 2.4 s.
    assert elapsed < 2.4


@pytest.mark.parametrize(
    "address, expected",
    [(":10064", ("", 10064)), ("0.0.0.0:10064", ("0.0.0.0", 10064)), ("127.0.0.1:0", ("127.0.0.1", 0)),
     ("[::1]:9", ("::1", 9)), ("[::]:9", ("::", 9))],
)
def test_listen_address(address, expected):
    assert parse_listen_address(address) == expected


@pytest.mark.parametrize("address", ["10064", "host:port", "::1:9", ":70000"])
def test_bad_listen_address(address):
    with pytest.raises(ValueError):
        parse_listen_address(address)


def test_gzip_follows_accept_encoding_q_values_and_varies(serve):
    url = serve(DemoSource())
    assert _get(url + "/metrics", {"Accept-Encoding": "gzip;q=0, identity"})[1].get("Content-Encoding") is None
    _, headers, body = _get(url + "/metrics", {"Accept-Encoding": "GZIP;q=0.5"})
    assert headers["Content-Encoding"] == "gzip" and b"mig_exporter_build_info" in gzip.decompress(body)
    assert headers["Vary"] == "Accept-Encoding"


def test_keep_alive_stays_in_step_after_a_get_with_a_body(serve):
    import http.client

    url = serve(DemoSource())
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/-/healthy", body=b"unexpected body")
    first = conn.getresponse()
    assert (first.status, first.read()) == (200, b"Healthy\n")
    conn.request("GET", "/-/healthy")
    second = conn.getresponse()
    assert (second.status, second.read()) == (200, b"Healthy\n")
    conn.close()


def test_resets_while_answering_log_no_traceback(serve, capfd):
    url = serve(DemoSource())
    host, port = url.removeprefix("http://").split(":")
    for _ in range(5):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # RST while the answer is being written
    time.sleep(0.3)
    assert _get(url + "/-/healthy")[0] == 200
    assert "Traceback" not in capfd.readouterr().err


def test_fifty_concurrent_scrapes_cause_one_nvidia_smi_run(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"),
                          delay_s=0.5)
    url = serve(NvidiaSmiSource(str(smi)))
    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(lambda _: _get(url + "/metrics"), range(50)))
    assert [r[0] for r in results] == [200] * 50
    assert all(_value(r[2], "mig_exporter_read_success", {}) == 1 for r in results)
    runs = [line.split(" ", 1)[1] for line in (smi.parent / "calls.log").read_text().splitlines()]
    # Requests that arrive after the first read has ended may start a second one.
    assert runs.count("-q -x") <= 2 and runs.count("-q -x") == runs.count("-L")


def test_concurrent_scrapes_share_one_answer_in_every_format(serve, fake_nvidia_smi):
    """Not only the read: the mapping and each encoding are made once for the scrapes in
    flight, so they carry the same read duration, to the digit."""
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"),
                          delay_s=0.5)
    url = serve(NvidiaSmiSource(str(smi)))
    formats = [{}, {"Accept-Encoding": "gzip"}, {"Accept": "application/openmetrics-text; version=1.0.0"}]
    with ThreadPoolExecutor(max_workers=30) as pool:
        results = list(pool.map(lambda i: _get(url + "/metrics", formats[i % 3]), range(30)))
    assert [r[0] for r in results] == [200] * 30
    runs = [line.split(" ", 1)[1] for line in (smi.parent / "calls.log").read_text().splitlines()]
    bodies = [gzip.decompress(r[2]) if r[1].get("Content-Encoding") == "gzip" else r[2] for r in results]
    durations = [_value(b.replace(b"# EOF\n", b""), "mig_exporter_read_duration_seconds", {}) for b in bodies]
    assert len(set(durations)) == runs.count("-q -x") <= 2
    for duration in set(durations):  # the text answers of one scrape are the same bytes
        plain = {b for r, b, d in zip(results, bodies, durations, strict=True)
                 if d == duration and "openmetrics" not in r[1]["Content-Type"]}
        assert len(plain) <= 1


def test_answers_on_a_kept_alive_connection_are_not_held_back_by_nagle(serve):
    """Headers and body go out in one write with TCP_NODELAY: two small writes would wait ~40 ms
    each for the client's delayed ACK, and Prometheus keeps its connections alive."""
    import http.client

    url = serve(DemoSource())
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    started = time.monotonic()
    for _ in range(20):
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().read() == b"Healthy\n"
    elapsed = time.monotonic() - started
    conn.close()
    assert elapsed < 0.6, f"20 kept-alive answers took {elapsed:.2f}s (Nagle and delayed ACK: >= 0.8s)"
