"""VictoriaMetrics in place of Prometheus, over the same fleet, gives the same answers.

Debian's ``victoria-metrics`` package (1.79): ``vmagent`` scrapes the exporters with the
scrape config a real Prometheus runs beside it, and remote-writes to a single-node
``victoria-metrics``; ``vmalert`` evaluates the rules file against it (the copy Prometheus
loads: deploy/prometheus/alerts.yml with the ``for:`` of tests/test_e2e.py's three alerts
cut to 2s), writes the recording rules back to it and notifies a local sink, as it would an
Alertmanager; ``mig-exporter fleet``'s code asks its Prometheus API.

The fleet: tests/test_capacity.py's scenario (a node with a free 3g.40gb instance served by
two exporters, one of them read again through /probe, and a node whose 3g.40gb is in use),
tests/test_e2e.py's alerting node (pods, engines, its own /probe target). Every recorded
series, every alert (state, labels, annotations) and fleet's answer must be Prometheus' own,
and the scenario's values; a synthetic node raises every alert the others do not, so every
annotation template runs in both. Then one node's nvidia-smi fails, and both must count its
devices unknown. docs/scale.md ("VictoriaMetrics") says why each flag that is not
a default is set, and what differs.

Without Debian's ``victoria-metrics`` (``vmagent``, ``vmalert``) or ``prometheus`` this test
fails; ``-m "not prometheus"`` leaves it out.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import SAMPLES, require_tool
from mig_exporter.fleet import as_json, read_fleet
from mig_exporter.prometheus_api import PrometheusClient
from proc_tree import make_proc
from test_capacity import LISTING, ONE_G, THREE_G, free_three_g_xml
from test_e2e import PROBED, _rules_with_short_for, e2e_exporter
from test_prometheus import HOST, JOB, _free_port, _stop, exporter, prometheus, wait_ready

pytestmark = pytest.mark.prometheus

TWO_G = "a100-80g-mig-2g.20gb"
WHOLE = "a100-80g"
PROBE_JOB = "mig-exporter-probe"
AGAIN = "node-a-again"  # the free node, read again through its exporter's /probe
SETTLE_S = 45.0  # bound on VictoriaMetrics catching up: new series, vmalert's 5 s write flush, two rule hops
# The flags this test sets beyond addresses, paths and the rules, and why (docs/scale.md):
LATENCY_OFFSET = "-search.latencyOffset=1s"  # one scrape interval: VM answers "now" as of 30 s ago by default
EVALUATION_INTERVAL = "-evaluationInterval=1s"  # the Prometheus beside it evaluates every second too


def scrape_config(exporters: list[str], probes: dict[str, str]) -> dict:
    """The fleet's scrape config, as Prometheus and vmagent both run it: ``exporters`` on
    /metrics, and each probe target read through the exporter ``probes`` names, with
    docs/probe.md's blackbox-style relabelling (the exporter's address rides on a label)."""
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": exporters}]},
            {"job_name": PROBE_JOB, "metrics_path": "/probe",
             "static_configs": [{"targets": [name], "labels": {"__via": via}} for name, via in probes.items()],
             "relabel_configs": [
                 {"source_labels": ["__address__"], "target_label": "__param_target"},
                 {"source_labels": ["__param_target"], "target_label": "instance"},
                 {"source_labels": ["__via"], "target_label": "__address__"},
             ]},
        ],
    }


# --- VictoriaMetrics' three binaries, and a notifier for vmalert -------------------------------


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextmanager
def _serve(name: str, argv: list[str], port: int, cwd: Path) -> Iterator[Server]:
    """Run one of VictoriaMetrics' binaries on 127.0.0.1:``port`` (its log to a file) until its
    /health answers, and stop it at the end."""
    log_path = cwd / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*argv, f"-httpListenAddr={HOST}:{port}"], stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd)
    server = Server(name, process, f"http://{HOST}:{port}", log_path)
    try:
        wait_ready(name, process, f"{server.url}/health", server.log, interval_s=0.1)
        yield server
    finally:
        _stop(process)


class _Notifications(BaseHTTPRequestHandler):
    """Takes alerts as Alertmanager's ``POST /api/v2/alerts`` does, and keeps them."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/api/v2/alerts":
            self.server.received.extend(json.loads(body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def _notifier() -> Iterator[tuple[str, list[dict]]]:
    """vmalert 1.79 will not start with alerting rules and no -notifier.url: a local sink."""
    server = ThreadingHTTPServer((HOST, 0), _Notifications)
    received: list[dict] = []
    server.received = received  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class VictoriaMetrics:
    storage: Server
    agent: Server
    alert: Server
    notified: list[dict] = field(default_factory=list)

    def query(self, promql: str) -> list[dict]:
        return PrometheusClient(self.storage.url).query(promql)

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.alert.url}/api/v1/alerts", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["alerts"] or []

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log()}" for s in (self.storage, self.agent, self.alert))


@contextmanager
def victoriametrics(config: dict, rules: Path, tmp_path: Path) -> Iterator[VictoriaMetrics]:
    """A single-node victoria-metrics; vmagent scraping ``config`` into it; vmalert evaluating
    ``rules`` against it, writing the recording rules back to it, notifying a local sink."""
    binary = {name: require_tool(name) for name in ("victoria-metrics", "vmagent", "vmalert")}
    home = tmp_path / "victoriametrics"
    home.mkdir()
    (home / "scrape.yml").write_text(yaml.safe_dump(config))
    with ExitStack() as stack:
        storage = stack.enter_context(_serve("victoria-metrics", [
            binary["victoria-metrics"], f"-storageDataPath={home / 'storage'}", LATENCY_OFFSET,
        ], _free_port(), home))
        agent = stack.enter_context(_serve("vmagent", [
            binary["vmagent"], f"-promscrape.config={home / 'scrape.yml'}",
            f"-remoteWrite.url={storage.url}/api/v1/write", f"-remoteWrite.tmpDataPath={home / 'vmagent-queue'}",
        ], _free_port(), home))
        notifier, notified = stack.enter_context(_notifier())
        alert = stack.enter_context(_serve("vmalert", [
            binary["vmalert"], f"-rule={rules}", f"-datasource.url={storage.url}",
            f"-remoteWrite.url={storage.url}", f"-notifier.url={notifier}", EVALUATION_INTERVAL,
        ], _free_port(), home))
        yield VictoriaMetrics(storage, agent, alert, notified)


# --- one view of a ruler and its store, to compare ---------------------------------------------


def _labels(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """A label set as both engines mean it: a label with an empty value is no label (Prometheus
    drops it; vmalert 1.79 keeps the rules' `namespace: ""` on its alerts); vmalert's own
    `alertgroup` (-disableAlertgroupLabel) and the series name aside."""
    return tuple(sorted((k, v) for k, v in labels.items() if v != "" and k not in ("alertgroup", "__name__")))


def _number(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


def view(query: Callable[[str], list[dict]], alerts: list[dict], records: list[str]) -> dict[str, Any]:
    """Every recorded series of ``records`` with its value, and every alert (pending or firing)
    with its labels and annotations (which print the values a person reads: an alert's value
    itself is an increase() here, which the two engines extrapolate differently)."""
    seen: dict[str, Any] = {
        name: sorted((_labels(r["metric"]), _number(r["value"][1])) for r in query(name)) for name in records}
    seen["alerts"] = sorted((_labels(a["labels"]), a["state"], tuple(sorted(a["annotations"].items())))
                            for a in alerts)
    return seen


def per_class(seen: dict[str, Any], record: str) -> dict[str, float]:
    return {dict(labels)["class"]: value for labels, value in seen[record]}


def firing(seen: dict[str, Any]) -> list[tuple[str, ...]]:
    return sorted(tuple(dict(labels).get(k, "") for k in ("alertname", "pid", "namespace", "pod", "index"))
                  for labels, state, _ in seen["alerts"] if state == "firing")


def active(seen: dict[str, Any]) -> set[str]:
    """The names of the alerts pending or firing."""
    return {dict(labels)["alertname"] for labels, _, _ in seen["alerts"]}


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    lines = []
    for key in sorted(a.keys() | b.keys()):
        only_a = [x for x in a.get(key, []) if x not in b.get(key, [])]
        only_b = [x for x in b.get(key, []) if x not in a.get(key, [])]
        if only_a or only_b:
            lines.append(f"{key}:\n  Prometheus only: {only_a}\n  VictoriaMetrics only: {only_b}")
    return "\n".join(lines)


# --- a node that raises every other alert -------------------------------------------------------

SYNTHETIC_CLASS = "h100-80g-mig-1g.10gb"


def synthetic_exposition(started: float, scrape: int) -> str:
    """What an exporter would serve for a node in every trouble the demo is not in, so that every
    alert's annotation template runs (humanize1024, humanizePercentage, humanizeTimestamp,
    `first | value`, `eq $value 2.0`, `query` with `sortByLabel`, `range $i, $w`): card 0 in MIG mode,
    its instance 1000 nearly full with Slurm job 77's process on it but mapped to job 88 and measured
    idle, its instance 1001 holding 5 GB with no process listed, mapped to job 99, its activity
    unknown; card 1 in MIG mode with nothing carved and its mode change pending, in every health
    trouble (unreadable, its PCIe link narrowed, a recovery action unknown), its XIDs recent. The
    uncorrectable ECC counts step from 0 to 2 at ``scrape`` 3 of each scraper (an increase in the
    window whenever it starts to scrape)."""
    ecc = 0 if scrape < 3 else 2
    xid_at = f"{started - 60:.3f}"
    device = 'card="0",index="{i}",mig_profile="1g.10gb"'
    lines = [
        'mig_exporter_build_info{version="synthetic"} 1',
        'mig_exporter_read_success{source="nvml"} 1',
        "mig_exporter_host_pid_namespace 1",
        "mig_exporter_slurm_job_map_read_success 1",
        'mig_exporter_card_mig_mode{card="0",state="current"} 1',
        'mig_exporter_card_mig_mode{card="0",state="pending"} 1',
        'mig_exporter_card_mig_instances{card="0"} 2',
    ]
    for i, gi, used, processes, job, state in ((1000, 7, 9.9e9, 1, "88", "in_use"), (1001, 8, 5e9, 0, "99", "unknown")):
        at = device.format(i=i)
        lines += [
            f'mig_exporter_device_info{{card="0",class="{SYNTHETIC_CLASS}",compute_instance="0",'
            f'device="0/mig{i - 1000}",gpu_instance="{gi}",index="{i}",mig_profile="1g.10gb",'
            f'name="NVIDIA H100 80GB HBM3 MIG 1g.10gb",uuid="MIG-00000000-0000-0000-0000-00000000{i}"}} 1',
            f"mig_exporter_device_memory_used_bytes{{{at}}} {used:.0f}",
            f"mig_exporter_device_memory_total_bytes{{{at}}} 10000000000",
            f"mig_exporter_device_memory_free_bytes{{{at}}} {1e10 - used:.0f}",
            f"mig_exporter_device_processes{{{at}}} {processes}",
            f'mig_exporter_device_allocation_info{{container="",index="{i}",namespace="",pod="",resource="slurm",'
            f'slurm_job="{job}"}} 1',
            *(f'mig_exporter_device_state{{{at},state="{s}"}} {int(s == state)}'
              for s in ("free", "in_use", "unknown")),
        ]
    lines += [
        'mig_exporter_process_info{card="0",container="",container_id="",index="1000",mig_profile="1g.10gb",'
        'namespace="",pid="4077",pod="",process_name="/opt/train/bin/train",process_type="C",slurm_job="77",'
        'slurm_step="0",systemd_unit="",user="alice"} 1',
        'mig_exporter_process_memory_used_bytes{card="0",index="1000",mig_profile="1g.10gb",pid="4077"} 9800000000',
        'mig_exporter_slurm_job_memory_used_bytes{slurm_job="77"} 9800000000',
        # Its instance 1000 measured idle (GPM): GPUMemoryHeldIdle goes pending, naming job 77.
        f'mig_exporter_device_graphics_activity_ratio{{{device.format(i=1000)}}} 0.002',
        f'mig_exporter_device_sm_activity_ratio{{{device.format(i=1000)}}} 0.001',
        f'mig_exporter_device_activity_window_seconds{{{device.format(i=1000)}}} 30',
        f'mig_exporter_device_activity_unknown{{{device.format(i=1001)},reason="first_sample"}} 1',
        'mig_exporter_card_mig_mode{card="1",state="current"} 1',
        'mig_exporter_card_mig_mode{card="1",state="pending"} 0',
        'mig_exporter_card_mig_instances{card="1"} 0',
        'mig_exporter_card_recovery_action{card="1"} 2',
        'mig_exporter_card_row_remap_failure{card="1"} 1',
        'mig_exporter_card_row_remap_pending{card="1"} 1',
        'mig_exporter_card_temperature_margin_celsius{card="1"} 3',
        *(f'mig_exporter_card_clock_event_active{{card="1",reason="{r}"}} {int(r != "gpu_idle")}'
          for r in ("gpu_idle", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap")),
        'mig_exporter_card_power_limit_watts{card="1",limit="current"} 300',
        'mig_exporter_card_power_limit_watts{card="1",limit="default"} 400',
        'mig_exporter_card_info{card="1",cuda_version="12.8",driver_version="570.172.08",name="NVIDIA H100 80GB HBM3",'
        'pci_bus_id="00000000:2A:00.0",serial="1321723011541",uuid="GPU-00000000-0000-0000-0000-000000000001"} 1',
        'mig_exporter_card_read_success{card="1"} 0',
        'mig_exporter_card_lost{card="1"} 1',
        'mig_exporter_xid_source_readable{source="kmsg"} 0',
        'mig_exporter_card_unrepairable_memory{card="1"} 1',
        'mig_exporter_card_health_reason{card="1",reason="recovery_action_unknown",state="warning"} 1',
        'mig_exporter_card_pcie_link_width_lanes{card="1",kind="current"} 4',
        'mig_exporter_card_pcie_link_width_lanes{card="1",kind="max"} 16',
        f'mig_exporter_xid_last_timestamp_seconds{{card="1",index="1",xid="79"}} {xid_at}',
        f'mig_exporter_xid_last_timestamp_seconds{{card="0",index="1000",xid="94"}} {xid_at}',
        f'mig_exporter_xid_last_timestamp_seconds{{card="0",index="1001",xid="13"}} {xid_at}',
        "# TYPE mig_exporter_card_ecc_errors_total counter",
        f'mig_exporter_card_ecc_errors_total{{card="1",memory="dram",scope="volatile",type="uncorrectable"}} {ecc}',
        "# TYPE mig_exporter_device_ecc_errors_total counter",
        f'mig_exporter_device_ecc_errors_total{{{device.format(i=1000)},memory="sram",scope="volatile",'
        f'type="uncorrectable"}} {ecc}',
    ]
    return "\n".join(lines) + "\n"


class _Exposition(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        scrapes = self.server.scrapes  # type: ignore[attr-defined]
        scraper = self.headers.get("User-Agent", "")  # Prometheus/2.42.0, vm_promscrape
        with self.server.lock:  # type: ignore[attr-defined]
            scrapes[scraper] = scrapes.get(scraper, 0) + 1
        body = synthetic_exposition(self.server.started, scrapes[scraper]).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def synthetic_node() -> Iterator[str]:
    server = ThreadingHTTPServer((HOST, 0), _Exposition)
    server.started = time.time()  # type: ignore[attr-defined]
    server.scrapes = {}  # type: ignore[attr-defined]
    server.lock = threading.Lock()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# The alerts no node raises while every read succeeds: a failed read (phase 2 raises it), and an
# exporter outside the host's PID namespace (which would keep the engine and Slurm alerts quiet).
EVERY_ALERT_BUT = {"GPUExporterReadFailing", "GPUExporterNotInHostPIDNamespace"}


FIRING = sorted([  # (alertname, pid, namespace, pod, index)
    # tests/test_e2e.py's three alerts, their `for:` cut to 2s
    ("EngineHoldsNoGPUMemory", "52040", "", "", ""),
    ("GPUAllocatedButUnused", "", "batch", "train-7", "1002"),
    ("GPUProcessOutsideAllocation", "", "notebooks", "jupyter-alice", "1"),
    # the synthetic node's, which have no `for:`
    ("GPUApplicationXID", "", "", "", "1001"),
    ("GPUCriticalXID", "", "", "", "1"),
    ("GPUInstanceUncorrectableECCErrors", "", "", "", "1000"),
    ("GPUMemoryErrorXID", "", "", "", "1000"),
    ("GPUUncorrectableECCErrors", "", "", "", ""),
])


def test_victoriametrics_answers_as_prometheus_does_on_the_same_fleet(fake_nvidia_smi, fake_kubelet, tmp_path):
    for tool in ("prometheus", "victoria-metrics", "vmagent", "vmalert"):
        require_tool(tool)  # fail before starting anything
    free = fake_nvidia_smi(free_three_g_xml(), LISTING)
    busy = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), LISTING)
    # Node b reads the same free sample until the test makes its nvidia-smi fail.
    failing = tmp_path / "failing"
    flaky = tmp_path / "flaky-nvidia-smi"
    flaky.write_text(f"#!/bin/sh\nif [ -e '{failing}' ]; then echo 'driver gone' >&2; exit 9; fi\n"
                     f"exec '{free}' \"$@\"\n")
    flaky.chmod(0o755)
    probe_config = tmp_path / "mig-exporter.yml"
    probe_config.write_text(f"probe_targets:\n  {AGAIN}:\n    command: ['{free}']\n")
    (tmp_path / "rules").mkdir()
    rules = _rules_with_short_for(tmp_path / "rules")
    shipped = [r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    records = [r["record"] for r in shipped if "record" in r]
    alerts = {r["alert"] for r in shipped if "alert" in r}
    (tmp_path / "e2e").mkdir()
    common = ("--no-kubernetes", "--proc.root", str(make_proc(tmp_path / "proc", [])))

    with exporter(free, tmp_path, *common, "--config.file", str(probe_config)) as a, \
            exporter(flaky, tmp_path, *common) as b, exporter(busy, tmp_path, *common) as c, \
            e2e_exporter(fake_nvidia_smi, fake_kubelet, tmp_path / "e2e") as e, synthetic_node() as s:
        config = scrape_config([a.address, b.address, c.address, e.address, s],
                               {AGAIN: a.address, PROBED: e.address})
        with victoriametrics(config, rules, tmp_path) as vm, prometheus("", tmp_path, yaml.safe_dump({
                **config, "global": {**config["global"], "evaluation_interval": "1s"},
                "rule_files": [str(rules)]})) as prom:

            def both() -> tuple[dict[str, Any], dict[str, Any]]:
                return (view(prom.query, prom.get("/api/v1/alerts")["alerts"], records),
                        view(vm.query, vm.alerts(), records))

            def settle(done: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], dict[str, Any]]:
                """Both views once they agree and Prometheus' is ``done``, or the last seen at the deadline."""
                deadline = time.monotonic() + SETTLE_S
                while True:
                    seen_prom, seen_vm = both()
                    if (seen_prom == seen_vm and done(seen_prom)) or time.monotonic() > deadline:
                        return seen_prom, seen_vm
                    time.sleep(0.5)

            def differs(seen_prom: dict[str, Any], seen_vm: dict[str, Any]) -> str:
                return f"VictoriaMetrics differs from Prometheus:\n{_diff(seen_prom, seen_vm)}\n{vm.logs()}"

            # 1. Every node reads. The scenario's answer, the same from both.
            seen_prom, seen_vm = settle(lambda seen: firing(seen) == FIRING and len(active(seen)) == len(alerts) - 2)
            assert per_class(seen_prom, "class:mig_exporter_devices_free:count") == {
                THREE_G: 2, TWO_G: 0, ONE_G: 3, WHOLE: 0, SYNTHETIC_CLASS: 0}, seen_prom
            assert per_class(seen_prom, "class:mig_exporter_devices:count") == {
                THREE_G: 4, TWO_G: 4, ONE_G: 4, WHOLE: 4, SYNTHETIC_CLASS: 2}, seen_prom
            node_free = {(dict(k)["instance"], dict(k)["class"]): v
                         for k, v in seen_prom["instance_class:mig_exporter_devices_free:count"]}
            assert {node: n for (node, cls), n in node_free.items() if cls == THREE_G} == {
                a.address: 1, b.address: 1, c.address: 0, e.address: 0}
            assert firing(seen_prom) == FIRING, active(seen_prom)
            # Every alert of the file is pending or firing, its annotations rendered, but two.
            assert active(seen_prom) == alerts - EVERY_ALERT_BUT
            assert seen_vm == seen_prom, differs(seen_prom, seen_vm)

            # fleet, through each one's query API: the same answer, free devices and their UUIDs included.
            asked_prom = as_json(read_fleet(PrometheusClient(prom.url), THREE_G, devices=True))
            asked_vm = as_json(read_fleet(PrometheusClient(vm.storage.url), THREE_G, devices=True))
            assert asked_vm == asked_prom
            assert [(n["instance"], n["free"]) for n in asked_prom["nodes"]] == sorted(
                (node, 1) for node in (a.address, b.address))
            assert sorted((d["instance"], d["uuid"]) for d in asked_prom["devices"]) == sorted(
                (node, "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b") for node in (a.address, b.address))
            assert asked_prom["not_reporting"] == []

            # What vmalert sent, as an Alertmanager would take it: the firing alerts.
            sent = {_labels(n["labels"]) for n in vm.notified}
            assert {labels for labels, state, _ in seen_vm["alerts"] if state == "firing"} <= sent

            # 2. Node b's nvidia-smi fails: its devices leave its scrapes (vmagent writes staleness
            # markers, as Prometheus does) and it counts as not reporting: unknown, never free.
            failing.touch()
            seen_prom, seen_vm = settle(
                lambda seen: per_class(seen, "class:mig_exporter_devices_free:count").get(THREE_G) == 1)
            assert per_class(seen_prom, "class:mig_exporter_devices_free:count") == {
                THREE_G: 1, TWO_G: 0, ONE_G: 2, WHOLE: 0, SYNTHETIC_CLASS: 0}, seen_prom
            assert per_class(seen_prom, "class:mig_exporter_devices_unknown:count") == {
                THREE_G: 1, TWO_G: 1, ONE_G: 1, WHOLE: 1, SYNTHETIC_CLASS: 1}, seen_prom
            assert "GPUExporterReadFailing" in active(seen_prom)
            # b's device series end at once for a bare selector in both (vmagent writes staleness
            # markers, as Prometheus does), while a window still holds its last read.
            gone = f'mig_exporter_device_info{{instance="{b.address}"}}'
            assert prom.query(gone) == [] and vm.query(gone) == []
            assert len(prom.query(f"last_over_time({gone}[1m])")) == len(vm.query(f"last_over_time({gone}[1m])")) == 4
            assert seen_vm == seen_prom, differs(seen_prom, seen_vm)
            asked_prom = as_json(read_fleet(PrometheusClient(prom.url), THREE_G))
            asked_vm = as_json(read_fleet(PrometheusClient(vm.storage.url), THREE_G))
            assert asked_vm == asked_prom
            assert [n["instance"] for n in asked_prom["not_reporting"]] == [b.address]
            assert [(n["instance"], n["free"]) for n in asked_prom["nodes"]] == [(a.address, 1)]
