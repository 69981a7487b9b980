"""A real Prometheus scrapes a real ``mig-exporter serve``.

The exporter runs as its own process (``python -m mig_exporter serve``) over a
fake nvidia-smi; Prometheus runs from its own binary with a one-second scrape
interval and timeout. Both listen on 127.0.0.1 only. The tests ask
Prometheus' HTTP API what it stored: the values must be the scenario's, and
Prometheus must have seen no scrape error. Prometheus negotiates OpenMetrics,
so this also covers that encoding end to end.

The ``/probe`` test runs the scrape config of docs/probe.md, with the
blackbox-style relabelling, as the document gives it except for addresses and
intervals.

Without the ``prometheus`` binary (Debian's package, which ``scripts/test``
installs) these tests fail; ``-m "not prometheus"`` leaves them out.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import MIB, REPO, fixture_bytes, require_tool

pytestmark = pytest.mark.prometheus

HOST = "127.0.0.1"
STARTUP_S = 30.0  # bound on every wait: exporter start, Prometheus start, target up
STOP_S = 10.0
JOB = "mig-exporter"
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def _prometheus_binary() -> str:
    return require_tool("prometheus")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> int:
    """Terminate, wait, and kill if it will not go; the exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(timeout=STOP_S)


class _LineReader:
    """Drains a pipe on a thread so the child never blocks on a full pipe,
    and keeps every line for the assertions and for failure messages."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._thread.start()

    def _drain(self, pipe) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:  # the process closed its stderr: it exited
                return None
            if m := pattern.search(line):
                return m
        return None

    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Exporter:
    process: subprocess.Popen
    log: _LineReader
    port: int

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


@contextmanager
def exporter(nvidia_smi: Path | None, cwd: Path, *args: str) -> Iterator[Exporter]:
    """``serve`` over the fake nvidia-smi, or over the demo when it is None. The kernel's log is
    the test's to give (``--collector.xid.kmsg``), never the test machine's /dev/kmsg."""
    source = ["--demo"] if nvidia_smi is None else ["--nvidia-smi", str(nvidia_smi)]
    if not any(a.startswith("--collector.xid.kmsg") for a in args):
        args = (*args, "--collector.xid.kmsg=")
    process = subprocess.Popen(
        [sys.executable, "-m", "mig_exporter", "serve", "--web.listen-address", f"{HOST}:0", *source, *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd,
    )
    try:
        log = _LineReader(process.stderr)
        m = log.wait_for(LISTENING, STARTUP_S)
        assert m is not None, f"the exporter did not log 'listening on' (exit {process.poll()}):\n{log.text()}"
        yield Exporter(process, log, int(m.group(1)))
    finally:
        _stop(process)
        process.stderr.close()


@dataclass
class Prometheus:
    process: subprocess.Popen
    url: str
    log_path: Path

    def get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        data = self.get("/api/v1/query", query=promql)
        assert data["resultType"] == "vector", data
        return data["result"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def prometheus(target: str, tmp_path: Path, config_text: str | None = None,
               rule_files: tuple[Path, ...] = ()) -> Iterator[Prometheus]:
    """Prometheus scraping ``target`` with a one-second interval (evaluating
    ``rule_files``), or running ``config_text``."""
    binary = _prometheus_binary()
    config = tmp_path / "prometheus.yml"
    config.write_text(config_text or (
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        + (f"rule_files: [{', '.join(repr(str(f)) for f in rule_files)}]\n" if rule_files else "")
        + "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        "    static_configs:\n"
        f"      - targets: ['{target}']\n"
    ))
    port = _free_port()
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={HOST}:{port}"],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
    try:
        server = Prometheus(process, f"http://{HOST}:{port}", log_path)
        wait_ready("prometheus", process, f"{server.url}/-/ready", server.log)
        yield server
    finally:
        _stop(process)


def wait_ready(name: str, process: subprocess.Popen, ready: str | urllib.request.Request, log: Callable[[], str],
               context: ssl.SSLContext | None = None, interval_s: float = 0.2) -> None:
    """Until ``ready`` answers 200 (bounded by STARTUP_S), failing with the server's log when
    ``process`` exits first or the time runs out."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        assert process.poll() is None, f"{name} exited {process.returncode}:\n{log()}"
        try:
            with urllib.request.urlopen(ready, timeout=2, context=context) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < deadline, f"{name} not ready after {STARTUP_S}s:\n{log()}"
        time.sleep(interval_s)


def _target_after_scrapes(server: Prometheus, address: str, scrapes: int = 2) -> dict:
    """The active target once Prometheus has scraped it ``scrapes`` times and
    stored the samples (bounded by STARTUP_S)."""
    deadline = time.monotonic() + STARTUP_S
    seen: dict | None = None
    while time.monotonic() < deadline:
        targets = server.get("/api/v1/targets", state="active")["activeTargets"]
        seen = next((t for t in targets if t["labels"].get("instance") == address), None)
        if seen is not None and seen["health"] != "unknown":
            stored = server.query(f'count_over_time(up{{instance="{address}"}}[1m])')
            if stored and float(stored[0]["value"][1]) >= scrapes:
                return seen
        time.sleep(0.2)
    raise AssertionError(f"target {address} not scraped {scrapes} times in {STARTUP_S}s: {seen}\n{server.log()}")


def _value(server: Prometheus, promql: str) -> float:
    result = server.query(promql)
    assert len(result) == 1, f"{promql}: expected one series, got {result}"
    return float(result[0]["value"][1])


def _ingestion_problems(server: Prometheus) -> dict[str, float]:
    """Prometheus' own counters of samples it dropped while ingesting scrapes:
    a series exposed twice, out of order or out of bounds, limits exceeded."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("prometheus_target_scrapes_", "prometheus_target_scrape_pool_exceeded"))
        and s.name.endswith("_total")
    }


def test_prometheus_stores_the_h100_scenario(fake_nvidia_smi, tmp_path):
    _prometheus_binary()  # fail before starting anything
    smi = fake_nvidia_smi(xml=fixture_bytes("h100-mig-processes.xml"),
                          listing=fixture_bytes("h100-mig-processes.L.txt"))
    with exporter(smi, tmp_path) as exp, prometheus(exp.address, tmp_path) as prom:
        target = _target_after_scrapes(prom, exp.address)
        assert target["health"] == "up", target
        assert target["lastError"] == "", target
        assert target["scrapeUrl"] == f"http://{exp.address}/metrics"
        assert target["labels"]["job"] == JOB

        assert _value(prom, f'up{{job="{JOB}"}}') == 1
        assert _value(prom, 'mig_exporter_read_success{source="nvidia-smi"}') == 1
        assert _value(prom, 'mig_exporter_read_errors_total{source="nvidia-smi"}') == 0
        assert _value(prom, "count(mig_exporter_device_info)") == 4
        assert _value(prom, 'mig_exporter_device_memory_used_bytes{index="1002"}') == 7493 * MIB
        assert _value(prom, 'mig_exporter_device_memory_total_bytes{index="1000"}') == 40448 * MIB

        (process,) = prom.query('mig_exporter_process_memory_used_bytes{pid="21198"}')
        assert process["metric"] == {
            "__name__": "mig_exporter_process_memory_used_bytes",
            "card": "0",
            "index": "1002",
            "mig_profile": "1g.10gb",
            "pid": "21198",
            "instance": exp.address,
            "job": JOB,
        }
        assert float(process["value"][1]) == 7484 * MIB

        # Each of 4 devices once: no series was duplicated or dropped on the way.
        assert _value(prom, "count(mig_exporter_device_memory_used_bytes)") == 4
        assert _value(prom, "count(mig_exporter_process_info)") == 3

        problems = _ingestion_problems(prom)
        assert problems, "Prometheus exposed none of its ingestion counters"
        assert {k: v for k, v in problems.items() if v} == {}
        assert "Traceback" not in exp.log.text()
    assert exp.process.returncode == 0, exp.log.text()


def test_prometheus_sees_a_failed_read_as_data(fake_nvidia_smi, tmp_path):
    """nvidia-smi fails: the scrape still succeeds (up 1) and says read_success 0."""
    _prometheus_binary()
    smi = fake_nvidia_smi(mode="fail", list_mode="fail")
    with exporter(smi, tmp_path) as exp, prometheus(exp.address, tmp_path) as prom:
        target = _target_after_scrapes(prom, exp.address)
        assert target["health"] == "up", target
        assert target["lastError"] == "", target

        assert _value(prom, f'up{{job="{JOB}"}}') == 1
        assert _value(prom, 'mig_exporter_read_success{source="nvidia-smi"}') == 0
        assert _value(prom, 'mig_exporter_read_errors_total{source="nvidia-smi"}') >= 2
        assert prom.query("mig_exporter_device_info") == []
        assert prom.query("mig_exporter_card_info") == []
        assert _value(prom, "mig_exporter_build_info") == 1

        problems = _ingestion_problems(prom)
        assert {k: v for k, v in problems.items() if v} == {}
        assert "couldn't communicate with the NVIDIA driver" in exp.log.text()
        assert "Traceback" not in exp.log.text()
    assert exp.process.returncode == 0, exp.log.text()


# --- /probe with the documented relabelling ------------------------------------------------------

BLACKBOX_RELABELLING = [
    {"source_labels": ["__address__"], "target_label": "__param_target"},
    {"source_labels": ["__param_target"], "target_label": "instance"},
    {"target_label": "__address__", "replacement": "gpu-node-1:10064"},
]


def with_probe_config(exporters: list[str], probed: str, via: str, rules: Path) -> str:
    """A 1 s Prometheus config: ``exporters`` scraped on /metrics as job mig-exporter, and the
    probe target ``probed`` read through ``via``'s /probe, as instance ``probed``, with the
    documented relabelling; ``rules`` loaded."""
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": exporters}]},
            {"job_name": "mig-exporter-probe", "metrics_path": "/probe", "static_configs": [{"targets": [probed]}],
             "relabel_configs": [*BLACKBOX_RELABELLING[:2], {"target_label": "__address__", "replacement": via}]},
        ],
    })


def documented_probe_scrape_config() -> dict:
    """The one Prometheus config in docs/probe.md."""
    text = (REPO / "docs" / "probe.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "scrape_configs:" in b]
    assert len(blocks) == 1, f"expected one scrape config in docs/probe.md, found {len(blocks)}"
    return yaml.safe_load(blocks[0])


def test_prometheus_probes_named_targets_with_the_documented_relabelling(fake_nvidia_smi, tmp_path):
    _prometheus_binary()
    config = documented_probe_scrape_config()
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/probe"
    assert job["relabel_configs"] == BLACKBOX_RELABELLING, "docs/probe.md lost the blackbox-style relabelling"
    (static,) = job["static_configs"]
    names = static["targets"]
    assert names == ["driver-root", "host", "gpu-07"]

    # The documented names, each backed by a fake: two good nodes and one whose driver is gone.
    fakes = {
        "driver-root": fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"),
                                       fixture_bytes("h100-mig-processes.L.txt")),
        "host": fake_nvidia_smi(fixture_bytes("a100-mig-pending.xml"), fixture_bytes("a100-mig-pending.L.txt")),
        "gpu-07": fake_nvidia_smi(mode="fail", list_mode="fail"),
    }
    exporter_config = tmp_path / "mig-exporter.yml"
    exporter_config.write_text("probe_targets:\n" + "".join(
        f"  {name}:\n    command: ['{fake}']\n" for name, fake in fakes.items()))
    local = fake_nvidia_smi(mode="fail", list_mode="fail")  # /metrics' own nvidia-smi, not scraped here

    with exporter(local, tmp_path, "--config.file", str(exporter_config)) as exp:
        # Only the addresses and the intervals change; the relabelling runs as documented.
        job["relabel_configs"][2]["replacement"] = exp.address
        job["scrape_interval"] = job["scrape_timeout"] = "1s"
        with prometheus("", tmp_path, yaml.safe_dump(config)) as prom:
            targets = {name: _target_after_scrapes(prom, name) for name in names}
            for name, target in targets.items():
                assert target["health"] == "up", target
                assert target["lastError"] == "", target
                assert target["labels"] == {"instance": name, "job": job["job_name"]}
                assert target["scrapeUrl"] == f"http://{exp.address}/probe?target={name}"

            assert _value(prom, 'probe_success{instance="driver-root"}') == 1
            assert _value(prom, 'probe_success{instance="host"}') == 1
            assert _value(prom, 'probe_success{instance="gpu-07"}') == 0
            assert _value(prom, 'count(up{job="mig-exporter-probe"} == 1)') == 3

            assert _value(prom, 'count(mig_exporter_device_info{instance="driver-root"})') == 4
            assert _value(prom, 'mig_exporter_device_memory_used_bytes{instance="driver-root",index="1002"}') \
                == 7493 * MIB
            assert _value(prom, 'mig_exporter_device_memory_used_bytes{instance="host",index="0"}') == 5371854848
            assert prom.query('mig_exporter_device_info{instance="gpu-07"}') == []
            (process,) = prom.query('mig_exporter_process_memory_used_bytes{pid="21198"}')
            assert process["metric"] == {
                "__name__": "mig_exporter_process_memory_used_bytes",
                "card": "0",
                "index": "1002",
                "mig_profile": "1g.10gb",
                "pid": "21198",
                "instance": "driver-root",
                "job": "mig-exporter-probe",
            }
            (process,) = prom.query('mig_exporter_process_info{instance="host"}')
            assert process["metric"]["pid"] == "900" and process["metric"]["index"] == "0"

            problems = _ingestion_problems(prom)
            assert problems, "Prometheus exposed none of its ingestion counters"
            assert {k: v for k, v in problems.items() if v} == {}

        with urllib.request.urlopen(f"http://{exp.address}/metrics", timeout=5) as r:
            own = {(s.name, s.labels.get("target")): s.value
                   for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
        assert own[("mig_exporter_probes_total", "driver-root")] >= 2
        assert own[("mig_exporter_probe_failures_total", "driver-root")] == 0
        assert own[("mig_exporter_probe_failures_total", "gpu-07")] == own[("mig_exporter_probes_total", "gpu-07")] >= 2
        assert "Traceback" not in exp.log.text()
    assert exp.process.returncode == 0, exp.log.text()
    # The one read of /metrics' own nvidia-smi is the test's fetch above: Prometheus scraped only /probe.
    runs = sorted(line.split(" ", 1)[1] for line in (local.parent / "calls.log").read_text().splitlines())
    # -L is cancelled once -q -x has failed, so it may be killed before its first line.
    assert runs in (["-L", "-q -x"], ["-q -x"])


@pytest.mark.parametrize("process_series", ["all", "top=1", "none"])
def test_prometheus_evaluates_the_rules_on_the_demo(tmp_path, process_series):
    """The demo's host runs a llama-server asked for -ngl 99 that is on no
    GPU's list, and its card 1 has a row remap pending and a link at x4 of x16:
    with deploy/prometheus/alerts.yml loaded, a real Prometheus puts
    EngineHoldsNoGPUMemory (firing takes 2 minutes), GPUCardNeedsReset
    (5 minutes) and GPUPCIeLinkWidthDegraded in pending and nothing else, and the recording rules hold the
    demo's values: under every --collector.processes, which changes only the
    per-process series. Card 1's Vulkan llama-server holds 20 GiB computing nothing (pmon):
    GPUMemoryHeldIdle (2 hours) is pending for it where it has series of its own, and not under
    none, where no process is judged and the card (an A100) has no GPM to judge it by."""
    _prometheus_binary()
    alerts_file = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yml"
    with exporter(None, tmp_path, "--collector.processes", process_series) as exp, \
            prometheus(exp.address, tmp_path, rule_files=(alerts_file,)) as prom:
        target = _target_after_scrapes(prom, exp.address)
        assert target["health"] == "up", target
        expected = [("EngineHoldsNoGPUMemory", "pending"), ("GPUCardNeedsReset", "pending"),
                    *([("GPUMemoryHeldIdle", "pending")] if process_series != "none" else []),
                    ("GPUPCIeLinkWidthDegraded", "pending")]
        deadline = time.monotonic() + STARTUP_S
        active: list[dict] = []
        while time.monotonic() < deadline:
            active = prom.get("/api/v1/alerts")["alerts"]
            recorded = prom.query("instance_engine:mig_exporter_engine_memory_used_bytes:sum")
            # The rule groups run side by side: the reset alert names the work once the work rule has
            # been evaluated (its annotation is made again at each evaluation).
            named = process_series == "none" or any(": drain " in a["annotations"].get("summary", "") for a in active)
            if len(active) >= len(expected) and recorded and named:
                break
            time.sleep(0.2)
        active.sort(key=lambda a: a["labels"]["alertname"])
        # Card 1's link runs at x4 of x16 (its power brake held in the past); the demo's XIDs came in 2024
        # (its kernel log's clock, sources/demo.py), long past the XID alerts' hour.
        assert [(a["labels"]["alertname"], a["state"]) for a in active] == expected
        for idle in (a for a in active if a["labels"]["alertname"] == "GPUMemoryHeldIdle"):
            assert {k: idle["labels"].get(k) for k in ("card", "index", "pid", "severity")} == {
                "card": "1", "index": "1", "pid": "50102", "severity": "info"}
            assert idle["annotations"]["summary"].startswith(
                f"20GiB of GPU memory held idle on card 1 on {exp.address} by process 50102"), idle["annotations"]
        reset = active[1]["labels"]
        assert {k: reset[k] for k in ("card", "reason", "severity")} == {
            "card": "1", "reason": "row_remap_pending", "severity": "warning"}
        # Whose work the reset hits: card 1's two processes, by the recording rule the alert asks.
        # With no per-process series it says so, never that no work runs there.
        assert active[1]["annotations"]["summary"].startswith(f"Card 1 on {exp.address} needs a reset: drain ") or (
            process_series == "none" and active[1]["annotations"]["summary"] ==
            f"Card 1 on {exp.address} needs a reset; its processes are not named (--collector.processes)")
        labels = active[0]["labels"]
        assert {k: labels[k] for k in ("engine", "pid", "comm", "severity", "instance")} == {
            "engine": "llama.cpp", "pid": "52040", "comm": "llama-server", "severity": "warning",
            "instance": exp.address,
        }
        assert active[0]["annotations"]["summary"] == (
            f"llama.cpp process 52040 (llama-server) on {exp.address} holds no GPU memory")

        engines = {r["metric"]["engine"]: float(r["value"][1]) for r in
                   prom.query("instance_engine:mig_exporter_engine_memory_used_bytes:sum")}
        assert engines == {"llama.cpp": (11520 + 20480) * MIB, "vllm": 9216 * MIB}
        assert _value(prom, "instance_engine:mig_exporter_engine_processes_without_gpu_memory:count") == 1
        cards = {r["metric"]["card"]: float(r["value"][1]) for r in
                 prom.query("instance_card:mig_exporter_device_memory_used_bytes:sum")}
        assert cards == {"0": (11663 + 9251 + 13) * MIB, "1": 22110 * MIB}
        rule_health = [r["health"] for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
        shipped = sum(len(g["rules"]) for g in yaml.safe_load(alerts_file.read_text())["groups"])
        assert shipped == 46 and rule_health == ["ok"] * shipped
        # The demo's classes: only the 1g.10gb instance has no process on it.
        free = {r["metric"]["class"]: float(r["value"][1]) for r in prom.query("class:mig_exporter_devices_free:count")}
        assert free == {"a100-80g-mig-3g.40gb": 0, "a100-80g-mig-2g.20gb": 0, "a100-80g-mig-1g.10gb": 1, "a100-80g": 0}
        assert "Traceback" not in exp.log.text()
