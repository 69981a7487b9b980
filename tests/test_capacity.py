"""A free 3g.40gb instance is counted the same in every view: the recording rules, the
overview dashboard's "Capacity by class" table (drawn by Grafana's own code), the landing
page, doctor, status and fleet.

One scenario: the demo node with its 3g.40gb instance's process gone (so 0/mig0 is free),
served by two exporters, and one more exporter serving the demo as it is (its 3g.40gb in
use). A /probe job reads the first node again, so a view that counted a probe's read would
count 3g.40gb instances twice. One real Prometheus scrapes them all with the shipped rules.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import MIB, REPO, SAMPLES
from mig_exporter.capacity_rules import FRESH_WITHIN, NODE_RULES
from mig_exporter.model.capacity import TIMES, ClassCount, count_by_class, summary
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from proc_tree import CONTAINER_NS, make_proc
from test_grafana import links, panels_through_grafana, rows
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
    """demo.xml without pid 48213, the one process on 0/mig0 (3g.40gb), and without the memory
    it held (13 MiB in use, as an empty instance shows): that instance is free."""
    xml = (SAMPLES / "demo.xml").read_text()
    blocks = re.findall(r"[ \t]*<process_info>.*?</process_info>\n", xml, re.S)
    (mine,) = [b for b in blocks if "<pid>48213</pid>" in b]
    held = "<used>11663 MiB</used>\n\t\t\t\t\t<free>28529 MiB</free>"
    assert xml.count(held) == 1
    return xml.replace(mine, "").replace(held, "<used>13 MiB</used>\n\t\t\t\t\t<free>40179 MiB</free>").encode()


def held_three_g_xml() -> bytes:
    """demo.xml without pid 48213 but with the 11.4 GiB it held: memory in use with no process
    listed (the exporter outside the host's PID namespace sees this): unknown, never free."""
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
    proc = str(make_proc(tmp_path / "proc", []))  # the host's PID namespace, as a real /proc shows it
    status = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", proc,
                  "--no-kubernetes", "--output", "json")
    assert status.returncode == 0, status.stderr
    answer = json.loads(status.stdout)
    assert {"class": THREE_G, "devices": 1, "free": 1, "unknown": 0}.items() <= next(
        c for c in answer["classes"] if c["class"] == THREE_G).items()
    (mig0,) = [d for d in answer["devices"] if d["device"] == "0/mig0"]
    assert mig0 == {"device": "0/mig0", "index": 1000, "class": THREE_G,
                    "uuid": "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b", "gpu_instance": 2, "compute_instance": 0,
                    "state": "free", "reason": "no process, no allocation, memory as an empty device's",
                    "memory_used_bytes": 13 * MIB, "memory_free_bytes": 40179 * MIB,
                    "memory_total_bytes": 40192 * MIB, "processes": 0}
    text = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", proc,
                "--no-kubernetes")
    assert text.returncode == 0, text.stderr
    assert f"1 {TIMES} {THREE_G} (1 free)" in text.stdout
    assert re.search(r"^0/mig0\s+a100-80g-mig-3g\.40gb\s+free\s+0\.0 / 39\.2 GiB\s+0$", text.stdout, re.M), text.stdout
    # The biggest process on the node: 50102, 20 GiB on whole card 1.
    assert "Top process: 50102 /usr/local/bin/llama-server, 20.0 GiB on 1" in text.stdout

    doctor = _cli("doctor", "--nvidia-smi", smi, "--proc.root", proc, "--format", "json")
    report = json.loads(doctor.stdout)
    assert {c["class"]: (c["devices"], c["free"]) for c in report["classes"]}[THREE_G] == (1, 1)
    assert f"devices by class: 1 {TIMES} {THREE_G} (1 free)" in _cli("doctor", "--nvidia-smi", smi,
                                                                     "--proc.root", proc).stdout

    with exporter(Path(smi), tmp_path, "--no-kubernetes", "--proc.root", proc) as exp, \
            urllib.request.urlopen(f"http://{exp.address}/", timeout=10) as response:
        page = response.read().decode()
    assert (f'<li data-class="{THREE_G}" data-devices="1" data-free="1" data-unknown="0">'
            f'<bdi>1 {TIMES} {THREE_G} (1 free)</bdi></li>') in page


def test_memory_held_with_no_process_is_unknown_in_status_doctor_and_the_landing_page(fake_nvidia_smi, tmp_path):
    """The 3g.40gb's process gone from the list, its 11.4 GiB still held: what an exporter
    outside the host's PID namespace sees. Never free; doctor's error and its count agree."""
    smi = str(fake_nvidia_smi(held_three_g_xml(), LISTING))
    proc = str(make_proc(tmp_path / "proc", []))
    answer = json.loads(_cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", proc,
                             "--no-kubernetes", "--output", "json").stdout)
    (mig0,) = [d for d in answer["devices"] if d["device"] == "0/mig0"]
    assert (mig0["state"], mig0["reason"]) == ("unknown", "11.4 GiB in use with no process listed")
    assert {"free": 0, "unknown": 1}.items() <= next(c for c in answer["classes"] if c["class"] == THREE_G).items()
    text = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", proc, "--no-kubernetes")
    assert f"1 {TIMES} {THREE_G} (unknown)" in text.stdout
    assert "  0/mig0: unknown: 11.4 GiB in use with no process listed" in text.stdout
    report = json.loads(_cli("doctor", "--nvidia-smi", smi, "--proc.root", proc, "--format", "json").stdout)
    assert {c["class"]: (c["free"], c["unknown"]) for c in report["classes"]}[THREE_G] == (0, 1)
    assert "memory-without-processes" in {f["code"] for f in report["warnings"]}
    (device,) = [d for c in report["cards"] for d in c["devices"] if d["device"] == "0/mig0"]
    assert device["state"] == "unknown"
    with exporter(Path(smi), tmp_path, "--no-kubernetes", "--proc.root", proc) as exp, \
            urllib.request.urlopen(f"http://{exp.address}/", timeout=10) as response:
        page = response.read().decode()
    assert f'data-free="0" data-unknown="1"><bdi>1 {TIMES} {THREE_G} (unknown)</bdi></li>' in page


def test_without_the_hosts_pids_no_device_is_free_in_status_or_doctor(fake_nvidia_smi, tmp_path):
    """A /proc of another PID namespace (a container without hostPID): the driver's list may
    miss processes, so an empty-looking device is unknown."""
    smi = str(fake_nvidia_smi(free_three_g_xml(), LISTING))
    proc = str(make_proc(tmp_path / "proc", [], namespace=CONTAINER_NS))
    answer = json.loads(_cli("status", "--source", "nvidia-smi", "--nvidia-smi", smi, "--proc.root", proc,
                             "--no-kubernetes", "--output", "json").stdout)
    assert sum(c["free"] for c in answer["classes"]) == 0
    (mig0,) = [d for d in answer["devices"] if d["device"] == "0/mig0"]
    assert mig0["state"] == "unknown" and "host's PIDs" in mig0["reason"]
    report = json.loads(_cli("doctor", "--nvidia-smi", smi, "--proc.root", proc, "--format", "json").stdout)
    assert sum(c["free"] for c in report["classes"]) == 0


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
    common = ("--no-kubernetes", "--proc.root", str(make_proc(tmp_path / "proc", [])))
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
            by_class = {c["class"]: c for c in answer["classes"]}
            assert {"class": THREE_G, "devices": 3, "free": 2, "in_use": 1, "unknown": 0}.items() <= \
                by_class[THREE_G].items()
            assert {"class": ONE_G, "devices": 3, "free": 3, "in_use": 0, "unknown": 0}.items() <= \
                by_class[ONE_G].items()
            assert [(n["instance"], n["free"], n["labels"]) for n in answer["nodes"]] == sorted(
                (address, 1, {"job": "mig-exporter"}) for address in (a.address, b.address))
            text = _cli("fleet", "--prometheus", prom.url, "--class", THREE_G)
            assert re.search(rf"^{re.escape(THREE_G)}\s+3\s+2\s+1\s+0\s+[\d.]+ GiB$", text.stdout, re.M), \
                text.stdout
            assert f"Nodes with a free {THREE_G} now:" in text.stdout and f"  {a.address}  1 free" in text.stdout
            # A class the fleet has no device of is a usage error, naming the classes it has.
            nowhere = _cli("fleet", "--prometheus", prom.url, "--class", "h200-141g", "--output", "json")
            assert nowhere.returncode == 2 and THREE_G in nowhere.stderr, nowhere.stderr

            # The dashboard, as Grafana draws it: one row per class, the probe not counted.
            names = {a.address: "A", b.address: "B", c.address: "C"}
            drawn = panels_through_grafana(prom, names)
        capacity = rows(drawn[("overview.json", "table", "Capacity by class")])
        assert {r["Class"]: (r["Devices"], r["Free"], r["In use"], r["Unknown"]) for r in capacity} == {
            THREE_G: (3, 2, 1, 0), "a100-80g-mig-2g.20gb": (3, 0, 3, 0), ONE_G: (3, 3, 0, 0),
            "a100-80g": (3, 0, 3, 0)}
        assert {r["Class"]: r["Memory free"] for r in capacity}[THREE_G] == memory[THREE_G]
        # A class's row links to this dashboard with that class chosen, time range and variables kept.
        assert links(drawn[("overview.json", "table", "Capacity by class")], "Class")[THREE_G] == [
            f"/d/mig-exporter-overview?from=now-6h&to=now&var-datasource=prometheus&var-node=$__all&var-class={THREE_G}"]
        nodes = rows(drawn[("overview.json", "table", "Nodes with a free device of the chosen class")])
        assert [(r["Node"], r["Free"], r["In use"], r["Unknown"]) for r in nodes if r["Class"] == THREE_G] == [
            ("A", 1, 0, 0), ("B", 1, 0, 0)]


def test_the_rules_file_holds_the_capacity_expressions_fleet_asks():
    """One definition of free: the rules file's capacity group is written from capacity_rules.py
    (scripts/sync-capacity-rules), whose expressions fleet and the dashboard ask, so a Prometheus
    without the rules loaded answers what one with them records."""
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "sync-capacity-rules"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    group = next(g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "mig-exporter.capacity")
    node_rules = {r["record"]: r["expr"].rstrip("\n") for r in group["rules"]
                  if r["record"].startswith("instance_class:")}
    assert node_rules == NODE_RULES
    assert [r["record"] for r in group["rules"]][len(NODE_RULES):] == [
        name.replace("instance_class:", "class:") for name in NODE_RULES]
    # Every ruler in use accepts the file: vmalert 1.79 refuses keep_firing_for outright.
    assert not [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "keep_firing_for" in r]
    assert FRESH_WITHIN == "1m"


def test_each_case_the_issue_names_counts_0_free_in_the_rules_status_and_the_landing_page(fake_nvidia_smi, tmp_path):
    """Four nodes whose 3g.40gb instance shows no process, each for a reason a scheduler must not
    place work there, and one that is truly free, scraped by a real Prometheus with the shipped
    rules: a Slurm job holds it (no process yet); 11.4 GiB held with no process listed; the
    exporter outside the host's PID namespace; a failing nvidia-smi. Each counts 0 free, in the
    rules (and the expressions fleet asks), status, doctor (with status's options, its counts and
    states are status's) and the landing page."""
    _prometheus_binary()
    host_proc = str(make_proc(tmp_path / "proc", []))
    container_proc = str(make_proc(tmp_path / "container-proc", [], namespace=CONTAINER_NS))
    job_map = tmp_path / "job-map"
    job_map.mkdir()
    (job_map / "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b").write_text("4242\n")
    free, held = fake_nvidia_smi(free_three_g_xml(), LISTING), fake_nvidia_smi(held_three_g_xml(), LISTING)
    failing = fake_nvidia_smi(mode="fail")
    nodes = {  # name: (nvidia-smi, options, the 3g.40gb's state and why, as status gives it)
        "free": (free, ("--proc.root", host_proc), "free"),
        "slurm": (free, ("--proc.root", host_proc, "--slurm.job-map-dir", str(job_map)), "in_use"),
        "held": (held, ("--proc.root", host_proc), "unknown"),
        "no-host-pids": (free, ("--proc.root", container_proc), "unknown"),
        "failing": (failing, ("--proc.root", host_proc), None),
    }
    for name, (smi, options, state) in nodes.items():
        done = _cli("status", "--source", "nvidia-smi", "--nvidia-smi", str(smi), "--no-kubernetes", *options,
                    "--output", "json")
        answer = json.loads(done.stdout)
        # doctor, given status's options, reads the same allocations and counts as status does.
        checked = _cli("doctor", "--nvidia-smi", str(smi), "--no-kubernetes", *options, "--format", "json")
        report = json.loads(checked.stdout)
        if state is None:
            assert done.returncode == 1 and answer["classes"] == [], name
            assert checked.returncode == 2 and report["classes"] == [], name
            continue
        (mig0,) = [d for d in answer["devices"] if d["device"] == "0/mig0"]
        assert mig0["state"] == state, (name, mig0)
        assert next(c for c in answer["classes"] if c["class"] == THREE_G)["free"] == (state == "free"), name
        assert report["classes"] == answer["classes"], name
        assert {d["device"]: d["state"] for c in report["cards"] for d in c["devices"]} == {
            d["device"]: d["state"] for d in answer["devices"]}, name
    with contextlib.ExitStack() as stack:
        exporters = {name: stack.enter_context(exporter(smi, tmp_path, "--no-kubernetes", *options))
                     for name, (smi, options, _) in nodes.items()}
        address = {name: e.address for name, e in exporters.items()}
        for name in ("free", "held"):
            with urllib.request.urlopen(f"http://{address[name]}/", timeout=10) as response:
                page = response.read().decode()
            shown = "1 free" if name == "free" else "unknown"
            assert f'data-free="{int(name == "free")}"' in page and f"1 {TIMES} {THREE_G} ({shown})" in page
        rules = tmp_path / "rules.yml"
        rules.write_text(ALERTS.read_text())
        config = yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "mig-exporter",
                                "static_configs": [{"targets": list(address.values())}]}],
        })
        with prometheus("", tmp_path, config) as prom:
            for a in address.values():
                assert _target_after_scrapes(prom, a)["health"] == "up"

            def per_node(name: str) -> dict[tuple[str, str], float]:
                return {(r["metric"]["instance"], r["metric"]["class"]): float(r["value"][1])
                        for r in prom.query(name)}

            expected_free = {address["free"]: 1, address["slurm"]: 0, address["held"]: 0,
                             address["no-host-pids"]: 0}
            deadline = time.monotonic() + STARTUP_S
            while time.monotonic() < deadline and {
                    node: n for (node, c), n in per_node("instance_class:mig_exporter_devices_free:count").items()
                    if c == THREE_G} != expected_free:
                time.sleep(0.25)
            recorded = per_node("instance_class:mig_exporter_devices_free:count")
            assert {node: n for (node, c), n in recorded.items() if c == THREE_G} == expected_free
            # The failing node never read: it has no devices to count, and so none free.
            assert not [k for k in recorded if k[0] == address["failing"]]
            unknown = per_node("instance_class:mig_exporter_devices_unknown:count")
            in_use = per_node("instance_class:mig_exporter_devices_in_use:count")
            assert unknown[(address["held"], THREE_G)] == 1 and unknown[(address["no-host-pids"], THREE_G)] == 1
            assert in_use[(address["slurm"], THREE_G)] == 1
            # Without host PIDs nothing on that node is free, the idle 1g.10gb included.
            assert sum(n for (node, _), n in recorded.items() if node == address["no-host-pids"]) == 0
            # What fleet asks (the rules' own expressions, no rules needed) agrees.
            asked = {(r["metric"]["instance"], r["metric"]["class"]): float(r["value"][1])
                     for r in prom.query(NODE_RULES["instance_class:mig_exporter_devices_free:count"])}
            assert asked == recorded
            assert prom.query("class:mig_exporter_devices_free:count")  # the fleet rule too
            assert {r["metric"]["class"]: float(r["value"][1]) for r in
                    prom.query("class:mig_exporter_devices_free:count")}[THREE_G] == 1
