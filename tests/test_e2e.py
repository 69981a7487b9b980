"""End to end: a real Prometheus (Debian's) scrapes the exporter's /metrics,
fed by the fake nvidia-smi, a fabricated /proc and the Kubernetes node of
kube_node.py (cgroups, the kubelet's log directories, a fake kubelet), and
its /probe with the blackbox-style relabelling, with the shipped alert rules
loaded. Every dashboard panel's query must return data, EngineHoldsNoGPUMemory
must fire for the engine left off every GPU's list, and the allocation alerts
for the notebook on a card it was not given and the MIG device nobody uses."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from conftest import MIB, REPO, SAMPLES, fixture_bytes
from kube_node import PODS, make_kubelet_logs
from test_dashboards import FOLDED, QUIET_ON_THE_DEMO, concrete, dashboard_queries, quiet_key
from test_pods import demo_proc
from test_prometheus import (
    STARTUP_S,
    Exporter,
    Prometheus,
    _prometheus_binary,
    _target_after_scrapes,
    _value,
    exporter,
    prometheus,
    with_probe_config,
)

pytestmark = pytest.mark.prometheus
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"


SHORTENED = {"EngineHoldsNoGPUMemory", "GPUProcessOutsideAllocation", "GPUAllocatedButUnused"}


def _rules_with_short_for(tmp_path: Path) -> Path:
    """The shipped rules with the `for:` of the alerts this node should raise
    cut to 2s, so they can go pending and fire within the test."""
    rules = yaml.safe_load(ALERTS.read_text())
    found = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") in SHORTENED:
                rule["for"] = "2s"
                found.add(rule["alert"])
    assert found == SHORTENED
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def _wait(what, check, timeout_s: float = STARTUP_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def _firing(prom, name: str) -> list[dict]:
    return [a for a in prom.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


PROBED = "gpu-node-2"  # the e2e exporter's one /probe target, reading the same fake nvidia-smi


@contextmanager
def e2e_exporter(fake_nvidia_smi, fake_kubelet, tmp_path: Path) -> Iterator[Exporter]:
    """The e2e machine's exporter, unscraped: the demo sample (2 cards, 4 devices)
    through the fake nvidia-smi, no kernel log (never the test machine's /dev/kmsg; XID
    lines are timed by the machine's boot, so an XID alert would hang on its uptime: --demo's
    fixed clock is checked instead), the fabricated /proc (engines), the kubelet's log
    directories and the fake kubelet (pods) of kube_node.py, and the /probe target
    PROBED over the same nvidia-smi. Checks its log for a traceback when it stops."""
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes(),
                          pmon=(SAMPLES / "demo-pmon.txt").read_bytes())  # as --demo: one busy, one idle
    proc = demo_proc(tmp_path / "proc")
    logs = make_kubelet_logs(tmp_path / "log")
    kubelet = fake_kubelet(PODS)
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  {PROBED}:\n    command: ['{smi}']\n")
    with exporter(smi, tmp_path, "--proc.root", str(proc), "--config.file", str(config),
                  "--kubelet.pod-resources-socket", kubelet.socket_path, "--kubelet.log-dir", str(logs),
                  "--collector.xid.kmsg=") as exp:
        yield exp
        assert "Traceback" not in exp.log.text()


@contextmanager
def e2e_node(fake_nvidia_smi, fake_kubelet, tmp_path: Path) -> Iterator[tuple[Exporter, Prometheus]]:
    """The e2e machine: the exporter of e2e_exporter scraped by a real Prometheus
    on /metrics and, as instance gpu-node-2, on /probe, with the shipped rules
    loaded. Yields once both targets have been scraped twice;
    tests/test_grafana.py uses it too."""
    _prometheus_binary()
    rules = _rules_with_short_for(tmp_path)
    with e2e_exporter(fake_nvidia_smi, fake_kubelet, tmp_path) as exp:
        config = with_probe_config([exp.address], PROBED, exp.address, rules)
        with prometheus("", tmp_path, config) as prom:
            assert _target_after_scrapes(prom, exp.address)["health"] == "up"
            assert _target_after_scrapes(prom, PROBED)["health"] == "up"
            yield exp, prom


def test_prometheus_scrapes_metrics_and_probe_and_every_panel_has_data(fake_nvidia_smi, fake_kubelet, tmp_path):
    with e2e_node(fake_nvidia_smi, fake_kubelet, tmp_path) as (exp, prom):
        # Devices and processes, from /metrics and through /probe.
        for instance in (exp.address, "gpu-node-2"):
            sel = f'instance="{instance}"'
            assert _value(prom, f'mig_exporter_device_memory_used_bytes{{{sel},index="1000"}}') == 11663 * MIB
            assert _value(prom, f'mig_exporter_device_memory_total_bytes{{{sel},index="1002"}}') == 9728 * MIB
            assert _value(prom, f'mig_exporter_device_memory_used_bytes{{{sel},index="1"}}') == 22110 * MIB
            assert _value(prom, f'mig_exporter_process_memory_used_bytes{{{sel},pid="50102"}}') == 20480 * MIB
            assert _value(prom, f'count(mig_exporter_device_info{{{sel}}})') == 4
        assert _value(prom, 'probe_success{instance="gpu-node-2"}') == 1

        # The engines, from the fabricated /proc.
        sel = f'instance="{exp.address}"'
        assert _value(prom, f'mig_exporter_engine_memory_used_bytes{{{sel},pid="52040"}}') == 0
        assert _value(prom, f'mig_exporter_engine_memory_used_bytes{{{sel},pid="51860"}}') == 9216 * MIB
        assert _value(prom, f'mig_exporter_host_pid_namespace{{{sel}}}') == 1

        # The pods: processes carry their pod labels, devices their allocations.
        assert _value(prom, f'mig_exporter_process_info{{{sel},pid="48213",namespace="llm",pod="llama-0",'
                            f'container="server"}}') == 1
        assert _value(prom, f'mig_exporter_pod_memory_used_bytes{{{sel},namespace="notebooks",'
                            f'pod="jupyter-alice"}}') == 1620 * MIB
        assert _value(prom, f'count(mig_exporter_device_allocation_info{{{sel}}})') == 4
        # /probe reads another nvidia-smi, maybe another host: no pod labels there.
        assert _value(prom, 'count(mig_exporter_process_info{instance="gpu-node-2",pod=""})') == 4

        # Every query of every dashboard panel returns data, but for the panels folded away for
        # fleets without them (no Slurm job, no systemd unit here), and the health queries that
        # this machine has nothing for (each with its reason in QUIET_ON_THE_DEMO).
        empty = [(dash, title, expr) for dash, title, expr in dashboard_queries() if not prom.query(concrete(expr))]
        assert {(dash, title) for dash, title, expr in empty if quiet_key(dash, title, expr) is None} == FOLDED
        assert {quiet_key(*query) for query in empty} - {None} == set(QUIET_ON_THE_DEMO)

        # The rules load, and the engine on no GPU's list goes pending, then fires.
        health = {r["name"]: r["health"] for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]}
        assert health and set(health.values()) == {"ok"}, health
        alerts = _wait("alert", lambda: [a for a in prom.get("/api/v1/alerts")["alerts"]
                                         if a["labels"]["alertname"] == "EngineHoldsNoGPUMemory"
                                         and a["state"] == "firing"])
        assert [(a["labels"]["pid"], a["labels"]["engine"]) for a in alerts] == [("52040", "llama.cpp")]
        outside = _wait("alert", lambda: _firing(prom, "GPUProcessOutsideAllocation"))
        assert [(a["labels"]["namespace"], a["labels"]["pod"], a["labels"]["index"]) for a in outside] == [
            ("notebooks", "jupyter-alice", "1")]
        unused = _wait("alert", lambda: _firing(prom, "GPUAllocatedButUnused"))
        assert [(a["labels"]["namespace"], a["labels"]["pod"], a["labels"]["index"]) for a in unused] == [
            ("batch", "train-7", "1002")]


def test_dashboard_queries_are_the_ones_checked():
    """The e2e test reads the panels from the committed dashboards."""
    queries = dashboard_queries()
    assert len(queries) >= 20
    assert any(re.search(r"engine_memory_used_bytes", expr) for _, _, expr in queries)


def test_a_firing_alert_holds_through_failed_reads_of_a_real_exporter(fake_nvidia_smi, tmp_path):
    """Defect 4 of issue 15 with the real parts: Prometheus scrapes a real exporter every
    second, MIGCardHasNoInstances fires, then two or three reads in a row fail (nvidia-smi
    exits 9; the device and card series leave the scrape). The alert must stay firing at
    every look, where a bare `mig_exporter_card_mig_instances == 0` would resolve and go
    back to pending."""
    _prometheus_binary()
    real = fake_nvidia_smi(fixture_bytes("a100-mig-nothing-carved.xml"), fixture_bytes("a100-mig-nothing-carved.L.txt"))
    failing = tmp_path / "failing"
    smi = tmp_path / "flaky-nvidia-smi"
    smi.write_text(f"#!/bin/sh\nif [ -e '{failing}' ]; then echo 'driver gone' >&2; exit 9; fi\nexec '{real}' \"$@\"\n")
    smi.chmod(0o755)
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "MIGCardHasNoInstances":
                rule["for"] = "3s"
    rules_path = tmp_path / "alerts.yml"
    rules_path.write_text(yaml.safe_dump(rules))

    with exporter(smi, tmp_path) as exp, prometheus(exp.address, tmp_path, rule_files=(rules_path,)) as prom:
        firing = _wait("firing", lambda: _firing(prom, "MIGCardHasNoInstances"))
        assert [(a["labels"]["card"], a["labels"]["instance"]) for a in firing] == [("0", exp.address)]
        failing.touch()
        looks = []
        deadline = time.monotonic() + 3.0  # two or three failed reads at one scrape a second
        while time.monotonic() < deadline:
            looks.append(len(_firing(prom, "MIGCardHasNoInstances")))
            time.sleep(0.2)
        failing.unlink()
        # The reads did fail, and the card's series did leave those scrapes...
        assert _value(prom, f'min_over_time(mig_exporter_read_success{{instance="{exp.address}"}}[10s])') == 0
        # Counted against the scrapes of the same window, whatever its edges catch: every scrape has
        # read_success, only the good reads have the card.
        card = f'mig_exporter_card_mig_instances{{instance="{exp.address}",card="0"}}'
        scrapes = _value(prom, f'count_over_time(mig_exporter_read_success{{instance="{exp.address}"}}[10s])')
        seen = _value(prom, f"count_over_time({card}[10s])")
        assert seen < scrapes, f"the card's series was in every scrape ({seen} of {scrapes}): no read failed"
        # ...and the alert held at every look.
        assert looks and set(looks) == {1}, looks
        assert _wait("firing again", lambda: _firing(prom, "MIGCardHasNoInstances"))
    assert "Traceback" not in exp.log.text()
