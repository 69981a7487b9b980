"""A free 3g.40gb instance is counted the same in every view: the recording rules, the
overview dashboard's "Capacity by class" table (drawn by Grafana's own code), the landing
page, doctor, status and fleet.

One scenario: the demo node with its 3g.40gb instance's process gone (so 0/mig0 is free),
served by two exporters, and one more exporter serving the demo as it is (its 3g.40gb in
use). A /probe job reads the first node again, so a view that counted a probe's read would
count 3g.40gb instances twice. One real Prometheus scrapes them all with the shipped rules.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import MIB, SAMPLES
from mig_exporter.fleet import DEVICES_PER_NODE, FREE_PER_NODE, FleetError, PrometheusClient
from mig_exporter.model.capacity import TIMES, ClassCount, count_by_class, summary
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from test_grafana import panels_through_grafana, rows
from test_prometheus import (
    STARTUP_S,
    _prometheus_binary,
    _target_after_scrapes,
    exporter,
    prometheus,
    with_probe_config,
)

pytestmark = pytest.mark.prometheus

THREE_G = "a100-80g-mig-3g.40gb"
ONE_G = "a100-80g-mig-1g.10gb"
ALERTS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"


def free_three_g_xml() -> bytes:
    """demo.xml without pid 48213, the one process on 0/mig0 (3g.40gb): that instance is free."""
    xml = (SAMPLES / "demo.xml").read_text()
    blocks = re.findall(r"[ \t]*<process_info>.*?</process_info>\n", xml, re.S)
    (mine,) = [b for b in blocks if "<pid>48213</pid>" in b]
    return xml.replace(mine, "").encode()


LISTING = (SAMPLES / "demo.L.txt").read_bytes()


def test_the_scenario_is_a_free_3g_instance_and_capacity_counts_it():
    snapshot = snapshot_from_smi(free_three_g_xml(), LISTING)
    by_class = {c.device_class: c for c in count_by_class(snapshot)}
    assert by_class[THREE_G] == ClassCount(THREE_G, devices=1, free=1, in_use=0, unknown=0,
                                           memory_free_bytes=snapshot.device(1000).memory.free_bytes)
    assert by_class[ONE_G].free == 1 and by_class["a100-80g"].in_use == 1
    assert summary(count_by_class(snapshot)) == (
        f"1 {TIMES} {THREE_G} (1 free), 1 {TIMES} a100-80g-mig-2g.20gb (in use), "
        f"1 {TIMES} {ONE_G} (1 free), 1 {TIMES} a100-80g (in use)")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mig_exporter", *args], capture_output=True, text=True, timeout=60)


def test_status_doctor_and_the_landing_page_count_the_free_3g_instance(fake_nvidia_smi, tmp_path):
    smi = str(fake_nvidia_smi(free_three_g_xml(), LISTING))
    status = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", str(tmp_path),
                  "--no-kubernetes", "--output", "json")
    assert status.returncode == 0, status.stderr
    answer = json.loads(status.stdout)
    assert {"class": THREE_G, "devices": 1, "free": 1}.items() <= next(
        c for c in answer["classes"] if c["class"] == THREE_G).items()
    (mig0,) = [d for d in answer["devices"] if d["device"] == "0/mig0"]
    assert mig0 == {"device": "0/mig0", "index": 1000, "class": THREE_G, "state": "free",
                    "memory_used_bytes": mig0["memory_used_bytes"], "memory_total_bytes": 40192 * MIB,
                    "processes": 0}
    text = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", str(tmp_path),
                "--no-kubernetes")
    assert text.returncode == 0, text.stderr
    assert f"1 {TIMES} {THREE_G} (1 free)" in text.stdout
    assert re.search(r"^0/mig0\s+a100-80g-mig-3g\.40gb\s+[\d.]+ / 39\.2 GiB\s+0$", text.stdout, re.M), text.stdout
    # The biggest process on the node: 50102, 20 GiB on whole card 1.
    assert "Top process: 50102 /usr/local/bin/llama-server, 20.0 GiB on 1" in text.stdout

    doctor = _cli("doctor", "--nvidia-smi", smi, "--format", "json")
    report = json.loads(doctor.stdout)
    assert {c["class"]: (c["devices"], c["free"]) for c in report["classes"]}[THREE_G] == (1, 1)
    assert f"devices by class: 1 {TIMES} {THREE_G} (1 free)" in _cli("doctor", "--nvidia-smi", smi).stdout

    with exporter(Path(smi), tmp_path, "--no-kubernetes", "--proc.root", str(tmp_path)) as exp, \
            urllib.request.urlopen(f"http://{exp.address}/", timeout=10) as response:
        page = response.read().decode()
    assert f'<li data-class="{THREE_G}" data-devices="1" data-free="1">1 {TIMES} {THREE_G} (1 free)</li>' in page


def test_status_of_a_failed_read_exits_1_and_says_why(fake_nvidia_smi, tmp_path):
    smi = str(fake_nvidia_smi(mode="fail"))
    done = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", str(tmp_path),
                "--no-kubernetes", "--output", "json")
    assert done.returncode == 1
    answer = json.loads(done.stdout)
    assert answer["devices"] == [] and answer["classes"] == [] and "exit status 9" in answer["error"]


def test_the_rules_the_dashboard_and_fleet_count_it_once_though_a_probe_reads_it_again(fake_nvidia_smi, tmp_path):
    _prometheus_binary()
    free = fake_nvidia_smi(free_three_g_xml(), LISTING)
    busy = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), LISTING)
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  node-a-again:\n    command: ['{free}']\n")
    rules = tmp_path / "rules.yml"
    rules.write_text(ALERTS.read_text())
    common = ("--no-kubernetes", "--proc.root", str(tmp_path))
    with exporter(free, tmp_path, *common, "--config.file", str(config)) as a, \
            exporter(free, tmp_path, *common) as b, exporter(busy, tmp_path, *common) as c:
        config = with_probe_config([a.address, b.address, c.address], "node-a-again", a.address, rules)
        with prometheus("", tmp_path, config) as prom:
            for address in (a.address, b.address, c.address, "node-a-again"):
                assert _target_after_scrapes(prom, address)["health"] == "up"
            # The probe's read is stored: a view that counted it would see three free 3g.40gb.
            assert len(prom.query('mig_exporter_device_processes{instance="node-a-again",index="1000"} == 0')) == 1

            def recorded(name: str) -> dict[str, float]:
                return {r["metric"]["class"]: float(r["value"][1]) for r in prom.query(name)}

            deadline = time.monotonic() + STARTUP_S
            while time.monotonic() < deadline and len(recorded("class:mig_exporter_devices_free:count")) < 4:
                time.sleep(0.2)
            # Rules: three 3g.40gb instances in the fleet, two free; each node's own.
            assert recorded("class:mig_exporter_devices:count")[THREE_G] == 3
            assert recorded("class:mig_exporter_devices_free:count") == {
                THREE_G: 2, "a100-80g-mig-2g.20gb": 0, ONE_G: 3, "a100-80g": 0}
            per_node = {(r["metric"]["instance"], r["metric"]["class"]): float(r["value"][1])
                        for r in prom.query("instance_class:mig_exporter_devices_free:count")}
            assert {node: n for (node, cls), n in per_node.items() if cls == THREE_G} == {
                a.address: 1, b.address: 1, c.address: 0}
            memory = recorded("class:mig_exporter_device_memory_free_bytes:sum")
            three_g_free = snapshot_from_smi(free_three_g_xml(), LISTING).device(1000).memory.free_bytes
            busy_free = snapshot_from_smi((SAMPLES / "demo.xml").read_bytes(), LISTING).device(1000).memory.free_bytes
            assert memory[THREE_G] == 2 * three_g_free + busy_free

            # fleet, through Prometheus' query API: the same counts, and where the free ones are.
            fleet = _cli("fleet", "--prometheus", prom.url, "--class", THREE_G, "--output", "json")
            assert fleet.returncode == 0, fleet.stderr
            answer = json.loads(fleet.stdout)
            assert {"class": THREE_G, "devices": 3, "free": 2} in answer["classes"]
            assert {"class": ONE_G, "devices": 3, "free": 3} in answer["classes"]
            assert [(n["instance"], n["free"], n["labels"]) for n in answer["nodes"]] == sorted(
                (address, 1, {"job": "mig-exporter"}) for address in (a.address, b.address))
            text = _cli("fleet", "--prometheus", prom.url, "--class", THREE_G)
            assert re.search(rf"^{re.escape(THREE_G)}\s+3\s+2$", text.stdout, re.M), text.stdout
            assert f"Nodes with a free {THREE_G} now:" in text.stdout and f"  {a.address}  1 free" in text.stdout
            nowhere = json.loads(_cli("fleet", "--prometheus", prom.url, "--class", "h200-141g", "--output",
                                      "json").stdout)
            assert nowhere["nodes"] == []

            # The dashboard, as Grafana draws it: one row per class, the probe not counted.
            names = {a.address: "A", b.address: "B", c.address: "C"}
            drawn = panels_through_grafana(prom, names)
        capacity = rows(drawn[("overview.json", "table", "Capacity by class")])
        assert {r["Class"]: (r["Devices"], r["Free"], r["In use"]) for r in capacity} == {
            THREE_G: (3, 2, 1), "a100-80g-mig-2g.20gb": (3, 0, 3), ONE_G: (3, 3, 0), "a100-80g": (3, 0, 3)}
        assert {r["Class"]: r["Memory free"] for r in capacity}[THREE_G] == memory[THREE_G]
        nodes = rows(drawn[("overview.json", "table", "Nodes with a free device of the chosen class")])
        assert [(r["Node"], r["Free"]) for r in nodes if r["Class"] == THREE_G] == [("A", 1), ("B", 1)]


def test_fleet_asks_the_recording_rules_own_expressions():
    """One definition of free: fleet's queries are the node rules', so a Prometheus without the
    rules loaded answers what one with them records."""
    rules = {r["record"]: " ".join(r["expr"].split())
             for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "record" in r}
    assert rules["instance_class:mig_exporter_devices:count"] == DEVICES_PER_NODE
    assert rules["instance_class:mig_exporter_devices_free:count"] == FREE_PER_NODE


def test_fleet_names_the_url_and_the_reason_when_it_cannot_ask(tmp_path):
    refused = _cli("fleet", "--prometheus", "http://127.0.0.1:9")
    assert refused.returncode == 1
    assert "http://127.0.0.1:9/api/v1/query: cannot reach it" in refused.stderr
    assert "not an http:// or https:// URL" in _cli("fleet", "--prometheus", "prometheus:9090").stderr


def test_fleet_says_what_a_prometheus_error_was(fake_nvidia_smi, tmp_path):
    """Something that answers the query API with an error, or not as Prometheus: an exporter's
    own port (it has no /api/v1/query) and a real Prometheus refusing a query."""
    _prometheus_binary()
    with exporter(None, tmp_path) as exp:
        not_prometheus = _cli("fleet", "--prometheus", f"http://{exp.address}")
        assert not_prometheus.returncode == 1
        assert f"http://{exp.address}/api/v1/query: HTTP 404" in not_prometheus.stderr
        with prometheus(exp.address, tmp_path) as prom:
            # A class name no PromQL string can hold breaks nothing: it is quoted, and simply matches no node.
            odd = _cli("fleet", "--prometheus", prom.url, "--class", 'x"} or vector(1) #', "--output", "json")
            assert odd.returncode == 0, odd.stderr
            assert json.loads(odd.stdout)["nodes"] == []
            with pytest.raises(FleetError, match=r"/api/v1/query: HTTP 400: bad_data: .*parse error"):
                PrometheusClient(prom.url).query("sum(")


@pytest.mark.parametrize(("body", "says"), [
    (b'{"status": "success", "data": []}', "expected an instant vector, got 'list'"),
    (b'{"status": "success", "data": {"resultType": "matrix", "result": []}}', "got 'matrix'"),
    (b'{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "x"]}]}}',
     "not a Prometheus instant vector's"),
    (b"<html>not json</html>", "the answer is not JSON"),
    (b'{"status": "error", "errorType": "timeout", "error": "query timed out"}', "timeout: query timed out"),
])
def test_fleet_refuses_an_answer_that_is_not_prometheus_with_a_reason(body, says):
    """Something at the URL that answers 200 but not as Prometheus does (a proxy, another API)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(FleetError, match=re.escape(says)) as raised:
            PrometheusClient(url).query("up")
        assert f"{url}/api/v1/query: " in str(raised.value)
    finally:
        server.shutdown()
        server.server_close()


def test_fleet_refuses_a_url_with_a_bad_port_without_a_traceback():
    done = _cli("fleet", "--prometheus", "http://prom:90x0")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "http://prom:90x0: not a URL" in done.stderr
