#!/usr/bin/env python3
"""Generate the Grafana dashboards (overview.json, node.json) from this file.

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
deploy/prometheus/alerts.yml when this runs. tests/test_grafana.py draws every
table and stat with Grafana's own code (docs/dashboards.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

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


def with_device(expr: str, sel: str, labels: str = "device") -> str:
    """``expr`` (a per-device series) with the device's name (and ``labels``) joined in."""
    return f"{expr} * on (job, instance, index) group_left ({labels}) mig_exporter_device_info{{{sel}}}"


def engines_without_memory(sel: str) -> str:
    """The engines EngineHoldsNoGPUMemory raises, on the chosen nodes."""
    return f"({alert_expr('EngineHoldsNoGPUMemory')}) and on (job, instance) mig_exporter_build_info{{{sel}}}"


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


def variables(with_card: bool) -> list[dict]:
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
    return out


def dashboard(uid: str, title: str, description: str, panels: list[dict], with_card: bool) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpu", "nvidia", "mig", "mig-exporter"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": variables(with_card)},
        "annotations": {"list": []},
        "links": [{"title": "mig-exporter dashboards", "type": "dashboards", "tags": ["mig-exporter"],
                   "asDropdown": True}],
        "panels": panels,
    }


def overview() -> dict:
    lay = Layout()
    lay.add(stat("Devices", f"count(mig_exporter_device_info{{{SEL}}}) or vector(0)",
                 description="Whole cards and MIG instances: what workloads run on."), 4, 4)
    lay.add(stat("GPU processes", f"count(mig_exporter_process_info{{{SEL}}}) or vector(0)"), 4, 4)
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
    lay.add(timeseries("Memory used by card and GPU instance", [target(
        per_gpu_instance("mig_exporter_device_memory_used_bytes", SEL),
        "{{instance}} card {{card}} GI {{gpu_instance}}")], "bytes",
        description="A whole card shows GI empty. Compute instances of one GPU instance share its memory and "
                    "appear once."), 12, 9)
    lay.add(timeseries("Memory used by device", [target(
        with_device(f"mig_exporter_device_memory_used_bytes{{{SEL}}}", SEL, "device, class"),
        "{{instance}} {{device}} {{class}}")], "bytes",
        description="One line per device (card/migN). Devices on one GPU instance show the same line."), 12, 9)
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
                     "Fleet-wide GPU memory by card, MIG instance and process (mig-exporter).", lay.panels, False)


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


DASHBOARDS = {"overview.json": overview, "node.json": node}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
