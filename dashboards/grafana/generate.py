#!/usr/bin/env python3
"""Generate the Grafana dashboards (overview.json, node.json, health.json) from this file.

The dashboards are code so their queries live in one place, where the tests
can read them: every query is checked by promtool, and run against a real
Prometheus scraping the exporter. Run ``python dashboards/grafana/generate.py``
after editing; a test fails when the committed JSON is out of date.

No query adds up device memory without first taking one value per
(card, GPU instance): compute instances of one GPU instance each report the
GPU instance's whole framebuffer.

Every join matches on ``job`` and ``instance`` (``on (job, instance, index)``),
as the rules in deploy/prometheus/alerts.yml do, and every aggregation by
``instance`` keeps ``job`` too: two jobs scraping one instance (a /probe job
naming its target like a node, a second scrape config) would otherwise make
``group_left`` fail with "many-to-many matching" and the panel show nothing,
or a ``max by`` mix two jobs' series into one.

Every device is named by its ``device`` label ("0/mig1", or "1" for a whole
card), joined in from ``mig_exporter_device_info``. A table's queries give the
same label set for each of its rows, so Grafana's ``merge`` makes one row of
them. ``$node`` lists the instances that export ``mig_exporter_build_info``,
and "All" is those instances (no ``allValue``): a /probe target (docs/probe.md)
exports no build info, so a node read both ways is counted once. The engines
panels use the EngineHoldsNoGPUMemory alert's own expression, read from
deploy/prometheus/alerts.yml when this runs, and so does the panel of memory held idle
(GPUMemoryHeldIdle's). tests/test_grafana.py draws every table and stat with Grafana's own
code (docs/dashboards.md).

The health dashboard's card table lists, in one cell each, a card's reasons
(mig_exporter_card_health_reason) and the work on it: a group-by on that one
query's frame (a transformation's ``filter``), before the merge. Its XID table
reads each XID's last time, not increase() of its counter: a counter born at 1
never increases, so a one-off XID would show as 0. The XID codes read as their
meanings from src/mig_exporter/model/xids.py (NVIDIA's catalogue).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

try:
    from mig_exporter.model.xids import XIDS
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from mig_exporter.model.xids import XIDS

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent.parent / "deploy" / "prometheus" / "alerts.yml"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$node"'
CARD_SEL = 'instance=~"$node", card=~"$card"'


def per_gpu_instance(metric: str, sel: str) -> str:
    """One value per (job, node, card, GPU instance): compute instances of one GPU
    instance share its memory, so summing devices would count it twice."""
    return (
        f"max by (job, instance, card, gpu_instance) ({metric}{{{sel}}} "
        f"* on (job, instance, index) group_left (gpu_instance) mig_exporter_device_info{{{sel}}})"
    )


def alert_expr(name: str) -> str:
    """The expression of one of the shipped alerts (deploy/prometheus/alerts.yml)."""
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if r.get("alert") == name]
    assert len(rules) == 1, f"alert {name}: {len(rules)} rules"
    return str(rules[0]["expr"]).strip()


def record_expr(name: str) -> str:
    """The expression of one of the shipped recording rules (deploy/prometheus/alerts.yml)."""
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if r.get("record") == name]
    assert len(rules) == 1, f"record {name}: {len(rules)} rules"
    return " ".join(str(rules[0]["expr"]).split())


def selected(expr: str, sel: str, extra: dict[str, str] | None = None) -> str:
    """``expr`` with ``sel`` on each of its selectors, before any matchers of their own, and
    ``extra[metric]`` after ``sel`` on that metric's."""
    def one(m: re.Match[str]) -> str:
        matchers = ", ".join(x for x in (sel, (extra or {}).get(m.group(1))) if x)
        return f"{m.group(1)}{{{matchers}" + (", " if m.group(2) else "}")
    return re.sub(r"\b(mig_exporter_[a-z_]+)\b(?![\w:])(\{)?", one, expr)


# The capacity group's node rules (docs/capacity.md), each a column: devices of each class on
# each node, how many free, in use and unknown, and their memory free.
CAPACITY = {
    "instance_class:mig_exporter_devices:count": "Devices",
    "instance_class:mig_exporter_devices_free:count": "Free",
    "instance_class:mig_exporter_devices_in_use:count": "In use",
    "instance_class:mig_exporter_devices_unknown:count": "Unknown",
    "instance_class:mig_exporter_device_memory_free_bytes:sum": "Memory free",
}
CHOSEN_CLASS = {"mig_exporter_device_info": 'class=~"$class"'}  # the class is device_info's label


def per_class(record: str, sel: str) -> str:
    """A node rule of the capacity group summed over the chosen nodes, by class (and by cluster
    where the series carry that external label: two clusters' capacities stay two): the rule's
    own expression, so the table counts what the rules count."""
    return f"sum by (cluster, class) ({selected(record_expr(record), sel)})"


def per_node_with_free(record: str, sel: str) -> str:
    """A node rule of the capacity group on the chosen nodes and classes, for each node with one or
    more free devices of the class. Not aggregated: the rule keeps every label but the device's
    (job, instance, what relabelling adds, the external cluster), so nodes of one address in two
    clusters, or scraped by two jobs, stay apart."""
    free = f"({selected(record_expr('instance_class:mig_exporter_devices_free:count'), sel, CHOSEN_CLASS)}) > 0"
    if record == "instance_class:mig_exporter_devices_free:count":
        return free
    return f"({selected(record_expr(record), sel, CHOSEN_CLASS)}) and ({free})"


# "Capacity by class" links each class to the nodes with one free: this dashboard again, with that
# class in $class, the time range, data source and nodes kept (Grafana's data link variables:
# ${__url_time_range}, ${name:queryparam}; ${__data.fields.class} is the row's class, URI-encoded).
CLASS_LINK = {
    "title": "Nodes with a free ${__data.fields.class}",
    "url": "/d/mig-exporter-overview?${__url_time_range}&${datasource:queryparam}&${node:queryparam}"
           "&var-class=${__data.fields.class}",
}


def with_device(expr: str, sel: str, labels: str = "device") -> str:
    """``expr`` (a per-device series) with the device's name (and ``labels``) joined in."""
    return f"{expr} * on (job, instance, index) group_left ({labels}) mig_exporter_device_info{{{sel}}}"


def engines_without_memory(sel: str) -> str:
    """The engines EngineHoldsNoGPUMemory raises, on the chosen nodes."""
    return f"({alert_expr('EngineHoldsNoGPUMemory')}) and on (job, instance) mig_exporter_build_info{{{sel}}}"


def memory_held_idle(sel: str) -> str:
    """What GPUMemoryHeldIdle judges idle now, on the chosen nodes, with a device's name: its own
    expression (the alert's `for:` aside), one series per whole card or MIG GPU instance (its
    compute instances counted once), or per process where a whole card's processes are judged;
    they never overlap, so they stack to a node's total. A GPU instance's series is keyed by card
    and gpu_instance, so the name joined is one of its devices' (topk of equal values keeps one):
    the alert's own annotation names them all."""
    return (f"(({alert_expr('GPUMemoryHeldIdle')}) and on (job, instance) mig_exporter_build_info{{{sel}}}) "
            f"* on (job, instance, card, gpu_instance) group_left (device) "
            f"topk by (job, instance, card, gpu_instance) (1, mig_exporter_device_info{{{sel}}})")


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False, fmt: str = "time_series") -> dict:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "refId": ref, "legendFormat": legend or "__auto",
                         "format": fmt}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


class Layout:
    """Panels placed left to right, rows of 24 units."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = self.row_h = 0

    def _next_id(self) -> int:
        return len(self.panels) + sum(len(p.get("panels", [])) for p in self.panels) + 1

    def add(self, panel: dict, w: int, h: int, into: list[dict] | None = None) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["id"] = self._next_id()
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        panel.setdefault("datasource", DS)
        (self.panels if into is None else into).append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def collapsed_row(self, title: str, panels: list[tuple[dict, int, int]]) -> None:
        """A collapsed row on a line of its own, holding ``panels`` (panel, width, height):
        Grafana cannot hide a panel that has no data, but a view most fleets leave empty
        stays out of the way folded in a row, and is one click away where it has data.
        A collapsed row keeps its panels in its own ``panels``; they sit below it."""
        self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        row: dict[str, Any] = {"type": "row", "title": title, "collapsed": True, "id": self._next_id(),
                               "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []}
        self.panels.append(row)
        self.y += 1
        for panel, w, h in panels:
            self.add(panel, w, h, into=row["panels"])
        self.x, self.y, self.row_h = 0, self.y + self.row_h, 0


def stat(title: str, expr: str, unit: str = "none", description: str = "", thresholds: list | None = None) -> dict:
    return {
        "type": "stat", "title": title, "description": description,
        "targets": [target(expr, instant=True)],
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": thresholds or [
            {"color": "green", "value": None}]}}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "none", "textMode": "auto"},
    }


def timeseries(title: str, targets: list[dict], unit: str, description: str = "", stack: bool = False) -> dict:
    return {
        "type": "timeseries", "title": title, "description": description, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 40,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def table(title: str, targets: list[dict], columns: dict[str, str], units: dict[str, str], description: str = "",
          sort_by: str | None = None) -> dict:
    """An instant-query table; ``columns`` maps the frame's field names to headers, in order."""
    overrides = [
        {"matcher": {"id": "byName", "options": field},
         "properties": [{"id": "unit", "value": unit}]}
        for field, unit in units.items()
    ]
    return {
        "type": "table", "title": title, "description": description, "targets": targets,
        "fieldConfig": {"defaults": {}, "overrides": overrides},
        "options": {"showHeader": True, "sortBy": [{"displayName": columns.get(sort_by, sort_by), "desc": True}]
                    if sort_by else []},
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True},
                "indexByName": {name: i for i, name in enumerate(columns)},
                "renameByName": columns,
            }},
            {"id": "filterFieldsByName", "options": {"include": {"names": list(columns)}}},
        ],
    }


def variables(with_card: bool, with_class: bool = False) -> list[dict]:
    out = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "node", "type": "query", "label": "Node", "datasource": DS,
         "query": {"query": "label_values(mig_exporter_build_info, instance)", "refId": "node"},
         "definition": "label_values(mig_exporter_build_info, instance)",
         "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"},
         "refresh": 2, "sort": 1},
    ]
    if with_card:
        out.append({
            "name": "card", "type": "query", "label": "Card", "datasource": DS,
            "query": {"query": 'label_values(mig_exporter_card_info{instance=~"$node"}, card)', "refId": "card"},
            "definition": 'label_values(mig_exporter_card_info{instance=~"$node"}, card)',
            "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
            "refresh": 2, "sort": 3,
        })
    if with_class:
        query = 'label_values(mig_exporter_device_info{instance=~"$node"}, class)'
        out.append({
            "name": "class", "type": "query", "label": "Device class", "datasource": DS,
            "query": {"query": query, "refId": "class"}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
            "refresh": 2, "sort": 1,
        })
    return out


def dashboard(uid: str, title: str, description: str, panels: list[dict], with_card: bool,
              with_class: bool = False) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpu", "nvidia", "mig", "mig-exporter"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables(with_card, with_class)},
        "annotations": {"list": []},
        "links": [{"title": "mig-exporter dashboards", "type": "dashboards", "tags": ["mig-exporter"],
                   "asDropdown": True}],
        "panels": panels,
    }


def overview() -> dict:
    lay = Layout()
    lay.add(stat("Devices", f"count(mig_exporter_device_info{{{SEL}}}) or vector(0)",
                 description="Whole cards and MIG instances: what workloads run on."), 4, 4)
    # Every process, whatever --collector.processes keeps of the per-process series.
    lay.add(stat("GPU processes", f"sum(mig_exporter_device_processes{{{SEL}}}) or vector(0)"), 4, 4)
    lay.add(stat("Memory used (no double counting)",
                 f"sum({per_gpu_instance('mig_exporter_device_memory_used_bytes', SEL)})", unit="bytes",
                 description="One value per GPU instance: compute instances sharing one are counted once."), 4, 4)
    lay.add(stat("Engines holding no GPU memory",
                 f"count({engines_without_memory(SEL)}) or vector(0)",
                 thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
                 description="Inference engines (llama.cpp, vLLM, Ollama, ...) on no GPU's process list: "
                             "running on the CPU. The EngineHoldsNoGPUMemory alert's own expression."), 4, 4)
    lay.add(stat("Failing reads", f"count(mig_exporter_read_success{{{SEL}}} == 0) or vector(0)",
                 thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]), 4, 4)
    lay.add(stat("MIG cards with nothing carved", f"count(mig_exporter_card_mig_instances{{{SEL}}} == 0) or vector(0)",
                 thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]), 4, 4)
    capacity = table("Capacity by class", [
        target(per_class(record, SEL), ref=ref, instant=True, fmt="table")
        for ref, record in zip("ABCDE", CAPACITY, strict=True)
    ], {"cluster": "Cluster", "class": "Class",
        **{f"Value #{ref}": header for ref, header in zip("ABCDE", CAPACITY.values(), strict=True)}},
        {"Value #E": "bytes"}, sort_by="Value #B",
        description="One row per device class on the chosen nodes (per cluster where the series carry one). Free: "
                    "no process, no allocation, memory as an empty device's; in use: work on it; unknown: what it "
                    "holds cannot be told, or its node stopped reporting (never free). Memory free counts each GPU "
                    "instance once. The recording rules' own expressions (docs/capacity.md); a probe target is "
                    "never counted. Click a class for the nodes with one free.")
    capacity["fieldConfig"]["overrides"].append({
        "matcher": {"id": "byName", "options": "class"},
        "properties": [{"id": "links", "value": [CLASS_LINK]}],
    })
    lay.add(capacity, 12, 8)
    per_node = {k: v for k, v in CAPACITY.items() if v in ("Free", "In use", "Unknown")}
    lay.add(table("Nodes with a free device of the chosen class", [
        target(per_node_with_free(record, SEL), ref=ref, instant=True, fmt="table")
        for ref, record in zip("ABC", per_node, strict=True)
    ], {"cluster": "Cluster", "instance": "Node", "class": "Class",
        **{f"Value #{ref}": header for ref, header in zip("ABC", per_node.values(), strict=True)}}, {},
        sort_by="Value #A",
        description="Each node with at least one free device of the classes chosen above (Device class): "
                    "where a job asking for one can start now; and how many of the class there are in use, or unknown. "
                    "Nodes of one name in two clusters, or scraped by two jobs, are two rows."), 12, 8)
    lay.add(timeseries("Memory used by card and GPU instance", [target(
        per_gpu_instance("mig_exporter_device_memory_used_bytes", SEL),
        "{{instance}} card {{card}} GI {{gpu_instance}}")], "bytes",
        description="A whole card shows GI empty. Compute instances of one GPU instance share its memory and "
                    "appear once."), 12, 9)
    lay.add(timeseries("Memory used by device", [target(
        with_device(f"mig_exporter_device_memory_used_bytes{{{SEL}}}", SEL, "device, class"),
        "{{instance}} {{device}} {{class}}")], "bytes",
        description="One line per device (card/migN). Devices on one GPU instance show the same line."), 12, 9)
    lay.add(timeseries("Activity by device", [
        target(with_device(f"mig_exporter_device_graphics_activity_ratio{{{SEL}}}", SEL),
               "{{instance}} {{device}} graphics", "A"),
        target(with_device(f"mig_exporter_device_sm_activity_ratio{{{SEL}}}", SEL), "{{instance}} {{device}} SM", "B"),
        target(with_device(f"mig_exporter_process_sm_activity_ratio{{{SEL}}}", SEL),
               "{{instance}} {{device}} pid {{pid}} SM", "C"),
    ], "percentunit", description="What the engines did, where the hardware measures it (docs/metrics.md, "
                                  "\"Activity\"): each MIG instance's and whole card's graphics activity (any kernel "
                                  "ran) and SM activity, through GPM (Hopper and later, NVML path; the compute "
                                  "instances of one GPU instance show its line), and each process's share of a whole "
                                  "card's SMs (both paths). A device that is not measured (an A100, nvidia-smi) has no "
                                  "line, never a 0: mig_exporter_device_activity_unknown says why."), 12, 8)
    lay.add(timeseries("GPU memory held idle", [target(memory_held_idle(SEL), "{{instance}} {{device}} {{pid}}")],
                       "bytes", stack=True,
                       description="Memory held by work measured idle now: a whole card or MIG GPU instance (its "
                                   "compute instances counted once, named by one of them), or a process on a whole "
                                   "card, holding more than 1 GiB under 1% activity. The GPUMemoryHeldIdle alert's own "
                                   "expression; the alert fires when it has lasted 2 hours, naming the pod, Slurm job, "
                                   "unit or engine. Where activity is not measured nothing is counted idle."), 12, 8)
    # Used and Total: the same labels on both queries (the device's identity joined
    # in, no metric name), so merge makes one row per device.
    identity = "device, gpu_instance, compute_instance, class, uuid"
    lay.add(table("MIG layout", [
        target(with_device(f"mig_exporter_device_memory_used_bytes{{{SEL}}}", SEL, identity),
               ref="B", instant=True, fmt="table"),
        target(with_device(f"mig_exporter_device_memory_total_bytes{{{SEL}}}", SEL, identity),
               ref="C", instant=True, fmt="table"),
    ], {"instance": "Node", "device": "Device", "card": "Card", "index": "Index", "mig_profile": "Profile",
        "gpu_instance": "GI", "compute_instance": "CI", "class": "Class", "uuid": "UUID", "Value #B": "Used",
        "Value #C": "Total"},
        {"Value #B": "bytes", "Value #C": "bytes"},
        description="Each node's devices: which MIG profiles, and how full."), 24, 9)
    lay.add(table("Top processes by GPU memory", [
        target("topk(25, " + with_device(
            f"mig_exporter_process_memory_used_bytes{{{SEL}}} "
            f"* on (job, instance, index, pid) group_left (process_name, process_type, namespace, pod, container, "
            f"slurm_job, systemd_unit, user) "
            f"mig_exporter_process_info{{{SEL}}}", SEL) + ")", instant=True, fmt="table"),
    ], {"instance": "Node", "device": "Device", "mig_profile": "Profile", "pid": "PID", "process_name": "Process",
        "process_type": "Type", "namespace": "Namespace", "pod": "Pod", "container": "Container",
        "slurm_job": "Slurm job", "systemd_unit": "Unit", "user": "User",
        "Value": "Memory"}, {"Value": "bytes"}, sort_by="Value",
        description="Namespace, pod and container are empty for processes outside Kubernetes; Slurm job and "
                    "systemd unit outside those (docs/hpc.md). A column no process fills is left out."), 12, 9)
    lay.add(table("Engines holding no GPU memory", [
        target(engines_without_memory(SEL), instant=True, fmt="table"),
    ], {"instance": "Node", "engine": "Engine", "pid": "PID", "comm": "Process"}, {},
        description="An engine told to use a GPU whose GPU backend never loaded runs on the CPU without a word: "
                    "its pid is on no GPU's process list (so it has no device). The EngineHoldsNoGPUMemory "
                    "alert's own expression."), 12, 9)
    lay.add(timeseries("GPU memory by pod", [target(
        f"topk(20, mig_exporter_pod_memory_used_bytes{{{SEL}}})", "{{namespace}}/{{pod}} {{container}}")], "bytes",
        description="What each pod's container holds on all its devices (Kubernetes nodes only)."), 12, 8)
    lay.add(table("GPU allocations", [
        target(with_device(f"mig_exporter_device_allocation_info{{{SEL}}} "
                           f"* on (job, instance, index) group_left (mig_profile) "
                           f"mig_exporter_device_processes{{{SEL}}}", SEL), instant=True, fmt="table"),
    ], {"instance": "Node", "device": "Device", "mig_profile": "Profile", "namespace": "Namespace", "pod": "Pod",
        "container": "Container", "slurm_job": "Slurm job", "resource": "Resource", "Value": "Processes"}, {},
        sort_by="Value",
        description="Which pod the kubelet allocated each device to, or which Slurm job the job map gives it to, and "
                    "how many processes are on it; 0 for long is GPUAllocatedButUnused (GPUSlurmAllocationUnused). "
                    "A time-sliced card has a row per pod."), 12, 8)
    lay.add(timeseries("Read failures", [
        target(f"1 - mig_exporter_read_success{{{SEL}}}", "{{instance}} read failed ({{source}})", "A"),
        target(f"1 - mig_exporter_card_read_success{{{SEL}}}", "{{instance}} card {{card}} unreadable", "B"),
        target(f"mig_exporter_read_problems{{{SEL}}}", "{{instance}} problems ({{source}})", "C"),
    ], "none", description="1 while a read or a card fails; problems are partial failures (see the log)."), 12, 8)
    lay.add(timeseries("Read duration", [target(f"mig_exporter_read_duration_seconds{{{SEL}}}",
                                                "{{instance}} {{source}}")], "s"), 12, 8)
    lay.collapsed_row("HPC: Slurm jobs and systemd units", [(timeseries("GPU memory by Slurm job / systemd unit", [
        target(f"topk(20, mig_exporter_slurm_job_memory_used_bytes{{{SEL}}})", "job {{slurm_job}} {{instance}}", "A"),
        target(f"topk(20, mig_exporter_systemd_unit_memory_used_bytes{{{SEL}}})", "{{systemd_unit}} {{instance}}",
               "B"),
    ], "bytes", description="What each Slurm job's processes, and each systemd unit's, hold on all the node's "
                            "devices (bare-metal and HPC nodes; docs/hpc.md). Empty on Kubernetes nodes."), 24, 8)])
    return dashboard("mig-exporter-overview", "GPU memory / overview",
                     "Fleet-wide GPU memory by card, MIG instance and process (mig-exporter).", lay.panels, False,
                     with_class=True)


def node() -> dict:
    lay = Layout()
    lay.add(timeseries("Memory used by device", [target(
        with_device(f"mig_exporter_device_memory_used_bytes{{{CARD_SEL}}}", CARD_SEL),
        "{{instance}} {{device}} {{mig_profile}}")], "bytes",
        description="Each card and MIG instance. Devices on one GPU instance share its memory and show the same "
                    "line; they are not stacked."), 16, 9)
    lay.add(timeseries("Memory free by device", [target(
        with_device(f"mig_exporter_device_memory_free_bytes{{{CARD_SEL}}}", CARD_SEL),
        "{{instance}} {{device}} {{mig_profile}}")], "bytes"),
        8, 9)
    # One query: each process's memory with its identity and its device's name joined in.
    lay.add(table("Processes", [
        target(with_device(
            f"mig_exporter_process_memory_used_bytes{{{CARD_SEL}}} "
            f"* on (job, instance, index, pid) group_left (process_name, process_type, namespace, pod, container, "
            f"slurm_job, systemd_unit, user) "
            f"mig_exporter_process_info{{{CARD_SEL}}}", CARD_SEL), instant=True, fmt="table"),
    ], {"instance": "Node", "pid": "PID", "process_name": "Name", "process_type": "Type", "card": "Card",
        "device": "Device", "mig_profile": "Profile", "namespace": "Namespace", "pod": "Pod",
        "container": "Container", "slurm_job": "Slurm job", "systemd_unit": "Unit", "user": "User",
        "Value": "Memory"}, {"Value": "bytes"}, sort_by="Value"), 24, 9)
    # Every query by (job, instance, card): no metric name, no state, so merge makes one row per card.
    lay.add(table("Cards", [
        target(f"max by (job, instance, card, name, uuid, driver_version) (mig_exporter_card_info{{{CARD_SEL}}})",
               ref="A", instant=True, fmt="table"),
        target(f'max by (job, instance, card) (mig_exporter_card_mig_mode{{{CARD_SEL}, state="current"}})', ref="B",
               instant=True, fmt="table"),
        target(f'max by (job, instance, card) (mig_exporter_card_mig_mode{{{CARD_SEL}, state="pending"}})', ref="C",
               instant=True, fmt="table"),
        target(f"max by (job, instance, card) (mig_exporter_card_mig_instances{{{CARD_SEL}}})", ref="D", instant=True,
               fmt="table"),
    ], {"instance": "Node", "card": "Card", "name": "Product", "uuid": "UUID", "driver_version": "Driver",
        "Value #B": "MIG current", "Value #C": "MIG pending", "Value #D": "Instances"}, {},
        description="MIG mode: 1 enabled, 0 disabled; current and pending differ until the card is reset."), 24, 7)
    lay.add(timeseries("Temperature", [target(f"mig_exporter_card_temperature_celsius{{{CARD_SEL}}}",
                                              "{{instance}} card {{card}}")], "celsius"), 8, 8)
    lay.add(timeseries("Power draw", [target(f"mig_exporter_card_power_draw_watts{{{CARD_SEL}}}",
                                             "{{instance}} card {{card}}")], "watt"), 8, 8)
    lay.add(timeseries("Utilisation (whole cards)", [target(f"mig_exporter_card_utilization_ratio{{{CARD_SEL}}}",
                                                            "{{instance}} card {{card}}")], "percentunit",
                       description="Not measured by the driver on cards in MIG mode, so absent there."), 8, 8)
    return dashboard("mig-exporter-node", "GPU memory / node", "One node's cards, MIG instances and processes.",
                     lay.panels, True)


# --- card health: heat, power and wear, one card a row (docs/metrics.md, "Card health") ----------------

# mig_exporter_card_health's states as one number a card (its worst), and as a person reads them:
# the landing page's and doctor's words (model/health.py Verdict.label).
HEALTH_STATE_TEXT = {0: ("ok", "green"), 1: ("warning", "orange"), 2: ("needs reset", "red"),
                     3: ("replace", "dark-red")}
RECOVERY_ACTION_TEXT = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset",
                        5: "recover IMEX domain", 6: "bus reset", 7: "system reboot"}


def health_state(sel: str) -> str:
    """Each card's worst state as a number (0 ok, 1 warning, 2 reset, 3 replace): its
    mig_exporter_card_health series are 1 for that state and 0 for the others."""
    return (f'max by (job, instance, card) (mig_exporter_card_health{{{sel}, state="warning"}} '
            f'or mig_exporter_card_health{{{sel}, state="reset"}} * 2 '
            f'or mig_exporter_card_health{{{sel}, state="replace"}} * 3)')


def mappings(texts: dict[int, tuple[str, str | None]]) -> list[dict]:
    """A value mapping: each number shown as its text (in its colour, where it has one)."""
    options: dict[str, dict[str, Any]] = {}
    for i, (value, (text, colour)) in enumerate(texts.items()):
        options[str(value)] = {"text": text, "index": i, **({"color": colour} if colour else {})}
    return [{"type": "value", "options": options}]


def per_card(expr: str) -> str:
    """One value a card: the same labels for every query of the health table, so merge makes one row."""
    return f"max by (job, instance, card) ({expr})"


def work_on_cards(sel: str) -> str:
    """The work on each card as a person names it, one series per (card, work), its value the
    number of processes: ``pod NAMESPACE/POD``, else ``Slurm job ID``, else the systemd unit, else
    ``process NAME``, as the instance_card_work:mig_exporter_process_info:count rule of
    deploy/prometheus/alerts.yml names it (written out here, so the dashboard needs no rule
    loaded); and a device with no process on it, by the pod or job it is allocated to
    (mig_exporter_device_allocation_info, which has no card label: the card is device_info's)."""
    processes = (
        'label_replace(label_replace(label_replace(label_replace(label_join('
        f'mig_exporter_process_info{{{sel}}}, "pod_path", "/", "namespace", "pod"), '
        '"work", "process $1", "process_name", "(.*)"), "work", "$1", "systemd_unit", "(.+)"), '
        '"work", "Slurm job $1", "slurm_job", "(.+)"), "work", "pod $1", "pod_path", "(.+/.+)")')
    allocated = (
        'label_replace(label_replace(label_join('
        f'(mig_exporter_device_allocation_info{{{SEL}}} unless on (job, instance, index) '
        f'mig_exporter_process_info{{{sel}}}) * on (job, instance, index) group_left (card) '
        f'mig_exporter_device_info{{{sel}}}, "pod_path", "/", "namespace", "pod"), '
        '"work", "Slurm job $1", "slurm_job", "(.+)"), "work", "pod $1", "pod_path", "(.+/.+)")')
    return f"count by (job, instance, card, work) ({processes} or {allocated})"


def listed(ref: str, label: str) -> dict[str, Any]:
    """A transformation making the answer to query ``ref`` one row a card, its ``label``s (each
    a series of its own) listed in one cell: merge would give each a row of its own."""
    return {"id": "groupBy", "filter": {"id": "byRefId", "options": ref}, "options": {"fields": {
        "job": {"operation": "groupby"}, "instance": {"operation": "groupby"}, "card": {"operation": "groupby"},
        label: {"operation": "aggregate", "aggregations": ["uniqueValues"]}}}}


def card_health_table() -> dict:
    sel = CARD_SEL
    volatile = 'scope="volatile", type="uncorrectable"'
    # A card's own volatile uncorrectable count holds its instances'; theirs stand in where it gives none
    # (model/health.py grade's rule).
    uncorrectable = (f"sum by (job, instance, card) (mig_exporter_card_ecc_errors_total{{{sel}, {volatile}}}) "
                     f"or sum by (job, instance, card) (mig_exporter_device_ecc_errors_total{{{sel}, {volatile}}})")
    queries = [
        ("A", f"max by (job, instance, card, name) (mig_exporter_card_info{{{sel}}})"),
        ("B", health_state(sel)),
        ("C", per_card(f"mig_exporter_card_temperature_celsius{{{sel}}}")),
        ("D", per_card(f"mig_exporter_card_temperature_margin_celsius{{{sel}}}")),
        ("E", per_card(f"mig_exporter_card_power_draw_watts{{{sel}}}")),
        ("F", per_card(f'mig_exporter_card_power_limit_watts{{{sel}, limit="current"}}')),
        ("G", uncorrectable),
        ("H", f"sum by (job, instance, card) (mig_exporter_card_remapped_rows{{{sel}}})"),
        ("I", per_card(f"mig_exporter_card_row_remap_pending{{{sel}}}")),
        ("J", per_card(f"mig_exporter_card_recovery_action{{{sel}}}")),
        # Milliseconds: what Grafana's time units read.
        ("K", per_card(f"mig_exporter_xid_last_timestamp_seconds{{{sel}}}") + " * 1000"),
        # Why (each reason's code, docs/metrics.md) and whose work: one series per reason and per work.
        ("L", f"max by (job, instance, card, reason) (mig_exporter_card_health_reason{{{sel}}})"),
        ("M", work_on_cards(sel)),
    ]
    panel = table("Card health", [target(expr, ref=ref, instant=True, fmt="table") for ref, expr in queries], {
        "instance": "Node", "card": "Card", "name": "Product", "Value #B": "State",
        "reason (uniqueValues)": "Why", "work (uniqueValues)": "Work", "Value #C": "Temperature",
        "Value #D": "Margin", "Value #E": "Power", "Value #F": "Power limit", "Value #G": "Uncorrectable ECC",
        "Value #H": "Remapped rows", "Value #I": "Remap pending", "Value #J": "Recovery action",
        "Value #K": "Last XID"},
        {"Value #C": "celsius", "Value #D": "celsius", "Value #E": "watt", "Value #F": "watt",
         "Value #G": "none", "Value #H": "none", "Value #K": "dateTimeFromNow"},
        description="Each card's worst state by the rules of docs/metrics.md (\"Card health states\"), as the landing "
                    "page and doctor grade it, and why: each reason's code (mig_exporter_card_health_reason). Work: "
                    "the pods, Slurm jobs, systemd units (else processes) on the card, and the pods or jobs its "
                    "idle devices are allocated to: whose work a reset stops. Uncorrectable ECC: errors since the "
                    "driver loaded. A card in MIG mode reports no remapped rows (blank): its XIDs 63, 64, 94 and "
                    "95, its recovery action and its instances' SRAM errors still cover it. Last XID: from the "
                    "kernel's log or NVML's events (docs/xids.md).")
    panel["transformations"][:0] = [listed("L", "reason"), listed("M", "work")]
    overrides = panel["fieldConfig"]["overrides"]
    overrides.append({"matcher": {"id": "byName", "options": "Value #B"}, "properties": [
        {"id": "mappings", "value": mappings(HEALTH_STATE_TEXT)},
        {"id": "custom.cellOptions", "value": {"type": "color-background"}}]})
    overrides.append({"matcher": {"id": "byName", "options": "Value #I"}, "properties": [
        {"id": "mappings", "value": mappings({0: ("no", None), 1: ("pending: reset", "red")})}]})
    overrides.append({"matcher": {"id": "byName", "options": "Value #J"}, "properties": [
        {"id": "mappings", "value": mappings({k: (v, None if k == 0 else "red")
                                              for k, v in RECOVERY_ACTION_TEXT.items()})}]})
    return panel


def per_xid(expr: str, sel: str) -> str:
    """``expr`` (one series per card, device index and XID) with the device's name joined in; an
    XID on a card in MIG mode that names no instance has no device_info of its index: there the
    device is the card."""
    return (f"({with_device(expr, sel)}) or label_replace(({expr}) unless on (job, instance, index) "
            f'mig_exporter_device_info{{{sel}}}, "device", "$1", "card", "(.*)")')


# The XID column: each code as "code: meaning" (src/mig_exporter/model/xids.py, NVIDIA's catalogue).
XID_TEXT = {code: (f"{code}: {entry.meaning}", {"critical": "red", "warning": "orange"}.get(entry.severity))
            for code, entry in XIDS.items()}


def xid_table() -> dict[str, Any]:
    """One row per (card, device, XID) seen: when it was last seen (from its timestamp, so a
    one-off XID, whose counter is born at 1 and never increases, shows), how many, and who ran
    on the device then (the last XID line's pid, its process, pod or job)."""
    sel = CARD_SEL
    keys = "job, instance, card, index, xid"
    who = f"{keys}, pid, process_name, namespace, pod, slurm_job, systemd_unit"
    queries = [
        # Milliseconds: what Grafana's time units read.
        ("A", per_xid(f"max by ({keys}) (mig_exporter_xid_last_timestamp_seconds{{{sel}}}) * 1000", sel)),
        ("B", per_xid(f"max by ({keys}) (mig_exporter_xid_errors_total{{{sel}}})", sel)),
        ("C", per_xid(f"max by ({who}) (mig_exporter_xid_last_process_info{{{sel}}})", sel)),
    ]
    panel = table("XID errors", [target(expr, ref=ref, instant=True, fmt="table") for ref, expr in queries], {
        "instance": "Node", "card": "Card", "device": "Device", "xid": "XID", "Value #A": "Last seen",
        "Value #B": "Count", "pid": "PID", "process_name": "Process", "namespace": "Namespace", "pod": "Pod",
        "slurm_job": "Slurm job", "systemd_unit": "Unit"},
        {"Value #A": "dateTimeFromNow", "Value #B": "none"}, sort_by="Value #A",
        description="Each XID the driver reported, by card, device and code, with its meaning (NVIDIA's XID "
                    "catalogue, docs/alerts.md), when it was last seen, how many since the exporter started, and "
                    "the process the last one named (pid, pod, Slurm job or unit; blank where the line named "
                    "none). 63 and 64: row remapping; 94 and 95: contained and uncontained memory errors, which "
                    "cover a card in MIG mode that cannot report its remapped rows. From the kernel's log "
                    "(/dev/kmsg) or NVML's events (docs/xids.md).")
    # The code as a number, so that its value mapping gives its meaning.
    panel["transformations"].insert(1, {"id": "convertFieldType", "options": {"conversions": [
        {"targetField": "xid", "destinationType": "number"}], "fields": {}}})
    panel["fieldConfig"]["overrides"].append({"matcher": {"id": "byName", "options": "xid"}, "properties": [
        {"id": "mappings", "value": mappings(XID_TEXT)}, {"id": "custom.align", "value": "left"}]})
    return panel


def state_timeline(title: str, targets: list[dict], texts: dict[int, tuple[str, str | None]],
                   description: str = "") -> dict:
    return {
        "type": "state-timeline", "title": title, "description": description, "targets": targets,
        "fieldConfig": {"defaults": {"mappings": mappings(texts), "color": {"mode": "thresholds"},
                                     "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]}},
                        "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                    "legend": {"showLegend": False}},
    }


def dashed(panel: dict, ref: str) -> dict:
    """The target ``ref``'s lines dashed: thresholds and limits beside the readings."""
    panel["fieldConfig"]["overrides"].append({"matcher": {"id": "byFrameRefID", "options": ref}, "properties": [
        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
        {"id": "custom.fillOpacity", "value": 0}]})
    return panel


def heat_and_power(lay: Layout) -> None:
    sel = CARD_SEL
    lay.add(dashed(timeseries("Temperature and thresholds", [
        target(f"mig_exporter_card_temperature_celsius{{{sel}}}", "{{instance}} card {{card}} core", "A"),
        target(f"mig_exporter_card_memory_temperature_celsius{{{sel}}}", "{{instance}} card {{card}} memory", "B"),
        target(f'mig_exporter_card_temperature_threshold_celsius{{{sel}, threshold=~"slowdown|max_operating|'
               f'memory_max_operating"}}', "{{instance}} card {{card}} {{threshold}}", "C"),
    ], "celsius", description="Core and memory temperature, and the driver's thresholds (dashed): the card slows "
                              "down at slowdown, and should stay under max_operating (memory: "
                              "memory_max_operating)."), "C"), 12, 8)
    lay.add(timeseries("Margin to the thermal limit", [
        target(f"mig_exporter_card_temperature_margin_celsius{{{sel}}}", "{{instance}} card {{card}}")],
        "celsius", description="How far the core is below T.Limit; the card slows down at 0, and its health "
                               "is a warning under 5 °C. Not every card reports it."), 12, 8)
    lay.add(dashed(timeseries("Power and limits", [
        target(f"mig_exporter_card_power_draw_watts{{{sel}}}", "{{instance}} card {{card}} draw", "A"),
        target(f'mig_exporter_card_power_limit_watts{{{sel}, limit=~"current|max"}}',
               "{{instance}} card {{card}} {{limit}} limit", "B"),
    ], "watt", description="Power drawn, and the enforced (current) and maximum limits (dashed): a card at its "
                           "current limit is capped (sw_power_cap below)."), "B"), 12, 8)
    lay.add(dashed(timeseries("Clocks", [
        target(f'mig_exporter_card_clock_hertz{{{sel}, kind="current", clock=~"graphics|memory"}}',
               "{{instance}} card {{card}} {{clock}}", "A"),
        target(f'mig_exporter_card_clock_hertz{{{sel}, kind="max", clock=~"graphics|memory"}}',
               "{{instance}} card {{card}} {{clock}} max", "B"),
    ], "hertz", description="Current clocks and the most the card may run (dashed): a throttle shows as the drop "
                            "it causes."), "B"), 12, 8)
    lay.add(timeseries("Clock event reasons active", [
        target(f"mig_exporter_card_clock_event_active{{{sel}}} == 1", "{{instance}} card {{card}} {{reason}}")],
        "none", description="1 while the driver holds the clocks down for the reason (sampled at each scrape). "
                            "hw_slowdown, hw_thermal_slowdown, sw_thermal_slowdown and hw_power_brake_slowdown make "
                            "the card's health a warning; gpu_idle and sw_power_cap are normal."), 12, 8)
    # Each reason that ever held the clocks down since the driver loaded (its counter above 0), at
    # its share of the time now: a reason at 0 % is one that did, and does no longer.
    lay.add(timeseries("Time held down by clock event reason", [
        target(f"rate(mig_exporter_card_clock_event_seconds_total{{{sel}}}[$__rate_interval]) "
               f"and mig_exporter_card_clock_event_seconds_total{{{sel}}} > 0",
               "{{instance}} card {{card}} {{reason}}")],
        "percentunit", description="The share of time the clocks were held down for the reason, from the driver's "
                                   "own counters (575+): a 3 s throttle between two scrapes shows here. Only the "
                                   "reasons that held them down since the driver loaded."), 12, 8)


def wear(lay: Layout) -> None:
    sel = CARD_SEL
    lay.add(timeseries("ECC errors since the driver loaded", [
        target(f'mig_exporter_card_ecc_errors_total{{{sel}, scope="volatile"}} > 0',
               "{{instance}} card {{card}} {{memory}} {{type}}", "A"),
        target(with_device(f'(mig_exporter_device_ecc_errors_total{{{sel}, scope="volatile"}} > 0)', sel),
               "{{instance}} {{device}} {{memory}} {{type}}", "B"),
    ], "none", description="Volatile ECC counts above 0: the card's (which hold its MIG instances'), and each MIG "
                           "instance's own SRAM errors. An uncorrectable one makes the card's health a warning."),
        12, 8)
    lay.add(xid_table(), 12, 8)
    lay.add(timeseries("Remapped rows", [
        target(f"mig_exporter_card_remapped_rows{{{sel}}}", "{{instance}} card {{card}} {{type}}", "A"),
        target(f"mig_exporter_card_row_remap_pending{{{sel}}}", "{{instance}} card {{card}} pending", "B"),
        target(f"mig_exporter_card_row_remap_failure{{{sel}}}", "{{instance}} card {{card}} failure", "C"),
    ], "none", description="Rows remapped by the error that caused it; pending 1: the card needs a reset; "
                           "failure 1: it needs replacing. Absent for a card in MIG mode (docs/metrics.md)."), 6, 8)
    lay.add(timeseries("Row remap availability (banks)", [
        target(f"mig_exporter_card_row_remap_availability_banks{{{sel}}}",
               "{{instance}} card {{card}} {{availability}}")],
        "none", description="Memory banks by the spare rows they have left; a bank at none makes the card's health a "
                            "warning."), 6, 8)
    lay.add(timeseries("Retired pages and recovery action", [
        target(f"mig_exporter_card_retired_pages{{{sel}}}", "{{instance}} card {{card}} retired {{cause}}", "A"),
        target(f"mig_exporter_card_retired_pages_pending{{{sel}}}", "{{instance}} card {{card}} retirement pending",
               "B"),
        target(f"mig_exporter_card_recovery_action{{{sel}}}", "{{instance}} card {{card}} recovery action", "C"),
    ], "none", description="Pages retired (pre-Ampere cards) and a retirement waiting for a reset; the driver's "
                           "recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset, 5 "
                           "recover the IMEX domain, 6 bus reset, 7 system reboot."), 6, 8)
    lay.add(dashed(timeseries("PCIe link", [
        target(f'mig_exporter_card_pcie_link_width_lanes{{{sel}, kind="current"}}',
               "{{instance}} card {{card}} lanes", "A"),
        target(f'mig_exporter_card_pcie_link_width_lanes{{{sel}, kind="max"}}',
               "{{instance}} card {{card}} lanes max", "B"),
        target(f'mig_exporter_card_pcie_link_generation{{{sel}, kind="current"}}',
               "{{instance}} card {{card}} generation", "C"),
    ], "none", description="The link's width in lanes against the most the card and host allow (dashed), and its "
                           "generation. Fewer lanes than max is a link that trained narrow (a riser, a badly seated "
                           "card) and makes the card's health a warning; a lower generation is an idle link saving "
                           "power."), "B"), 6, 8)


def health() -> dict:
    lay = Layout()
    lay.add(card_health_table(), 24, 7)
    lay.add(state_timeline("Health over time", [target(health_state(CARD_SEL), "{{instance}} card {{card}}")],
                           HEALTH_STATE_TEXT, description="Each card's worst state over time."), 24, 5)
    heat_and_power(lay)
    wear(lay)
    return dashboard("mig-exporter-health", "GPU health / cards",
                     "Heat, power and wear of one node's cards: the card health states, temperatures against their "
                     "thresholds, power against its limits, clock events, ECC, remapped rows, XIDs.",
                     lay.panels, True)


DASHBOARDS = {"overview.json": overview, "node.json": node, "health.json": health}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
