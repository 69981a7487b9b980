"""Every table and stat panel as Grafana draws it: the panel's own queries, with
the dashboard variables filled in as Grafana fills them, run against the real
Prometheus of the e2e test (the exporter's /metrics and a /probe job reading
the same node), turned into data frames (tests/grafana/frames.js) and put
through the panel's own transformations by Grafana's code (@grafana/data,
tests/grafana/driver.js). Each table must have one row per device, card,
process or engine with its columns filled in, with the values of the e2e
machine computed by hand below; each stat the number its alert counts. And a
troubled fleet (a MIG card with nothing carved, read through /metrics and
/probe; a node whose reads fail) where those alerts have something to count,
so "stat == alert count" is not 0 == 0."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import MIB, REPO, fixture_bytes, require_tool
from test_dashboards import _dashboards
from test_e2e import ALERTS, _wait, e2e_node
from test_prometheus import (
    Prometheus,
    _prometheus_binary,
    _target_after_scrapes,
    exporter,
    prometheus,
    with_probe_config,
)

pytestmark = pytest.mark.prometheus
HARNESS = REPO / "tests" / "grafana"
NODE = "NODE"  # the exporter's instance (127.0.0.1:port) in the rows below

# The e2e machine, by hand from src/mig_exporter/samples/demo.xml (fb_memory_usage
# in MiB; card 0 in MIG mode with three instances, card 1 a whole card) and from
# tests/kube_node.py (which pod runs each pid, which device the kubelet gave it).
#   card 0 MIG 0 (3g.40gb, GI 2, CI 0): total 40192, used 11663; pid 48213 llama-server 11520 (llm/llama-0)
#   card 0 MIG 1 (2g.20gb, GI 3, CI 0): total 19968, used  9251; pid 51877 python3 9216 (llm/vllm-...)
#   card 0 MIG 2 (1g.10gb, GI 9, CI 0): total  9728, used    13; no process (allocated to batch/train-7)
#   card 1 (whole A100 80GB):           total 81920, used 22110; pid 50102 llama-server (G) 20480
#                                        (graphics/vk-llama-0), pid 50318 python3 1620 (notebooks/jupyter-alice)
# Memory used, once per GPU instance: 11663 + 9251 + 13 + 22110 = 43037 MiB.
# Engines (samples/demo-proc.json): llama.cpp 52040 is on no GPU's list and holds nothing.
UUID_0, UUID_1 = "GPU-a84bba07-931d-b925-306a-0799dc6ebd71", "GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96"
MIG = {"0/mig0": "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b", "0/mig1": "MIG-bd142880-e842-57ab-bec1-2975fd55911e",
       "0/mig2": "MIG-a2cbd390-b656-5a4d-8bad-821df997d529"}


def _layout(device, card, index, profile, gi, ci, cls, uuid, used_mib, total_mib):
    return {"Node": NODE, "Device": device, "Card": card, "Index": index, "Profile": profile, "GI": gi, "CI": ci,
            "Class": cls, "UUID": uuid, "Used": used_mib * MIB, "Total": total_mib * MIB}


def _process(device, profile, pid, name, kind, namespace, pod, container, mib):
    return {"Node": NODE, "Device": device, "Profile": profile, "PID": pid, "Process": name, "Type": kind,
            "Namespace": namespace, "Pod": pod, "Container": container, "Memory": mib * MIB}


PROCESSES = [
    _process("0/mig0", "3g.40gb", "48213", "/usr/local/bin/llama-server", "C", "llm", "llama-0", "server", 11520),
    _process("0/mig1", "2g.20gb", "51877", "/usr/bin/python3", "C", "llm", "vllm-6b7f9c-x2x4q", "vllm", 9216),
    _process("1", "", "50102", "/usr/local/bin/llama-server", "G", "graphics", "vk-llama-0", "llama", 20480),
    _process("1", "", "50318", "/usr/bin/python3", "C", "notebooks", "jupyter-alice", "notebook", 1620),
]

TABLES = {
    ("overview.json", "MIG layout"): [
        _layout("0/mig0", "0", "1000", "3g.40gb", "2", "0", "a100-80g-mig-3g.40gb", MIG["0/mig0"], 11663, 40192),
        _layout("0/mig1", "0", "1001", "2g.20gb", "3", "0", "a100-80g-mig-2g.20gb", MIG["0/mig1"], 9251, 19968),
        _layout("0/mig2", "0", "1002", "1g.10gb", "9", "0", "a100-80g-mig-1g.10gb", MIG["0/mig2"], 13, 9728),
        _layout("1", "1", "1", "", "", "", "a100-80g", UUID_1, 22110, 81920),
    ],
    ("overview.json", "Top processes by GPU memory"): PROCESSES,
    # One row per class, the node counted once though a /probe job reads it too; free memory from
    # demo.xml's fb_memory_usage/free (MiB). Every device is in use: the 1g.10gb has no process,
    # but the kubelet allocated it to batch/train-7 (model/capacity.py).
    ("overview.json", "Capacity by class"): [
        {"Class": cls, "Devices": 1, "Free": 0, "In use": 1, "Unknown": 0, "Memory free": mib * MIB}
        for cls, mib in [("a100-80g-mig-3g.40gb", 28529), ("a100-80g-mig-2g.20gb", 10717),
                         ("a100-80g-mig-1g.10gb", 9715), ("a100-80g", 59248)]
    ],
    # No device free, so no node (tests/test_dashboard_capacity.py draws it with some).
    ("overview.json", "Nodes with a free device of the chosen class"): [],
    ("overview.json", "Engines holding no GPU memory"): [
        {"Node": NODE, "Engine": "llama.cpp", "PID": "52040", "Process": "llama-server"},
    ],
    ("overview.json", "GPU allocations"): [
        {"Node": NODE, "Device": device, "Profile": profile, "Namespace": ns, "Pod": pod, "Container": container,
         "Resource": resource, "Processes": processes}
        for device, profile, ns, pod, container, resource, processes in [
            ("0/mig0", "3g.40gb", "llm", "llama-0", "server", "nvidia.com/mig-3g.40gb", 1),
            ("0/mig1", "2g.20gb", "llm", "vllm-6b7f9c-x2x4q", "vllm", "nvidia.com/mig-2g.20gb", 1),
            ("0/mig2", "1g.10gb", "batch", "train-7", "trainer", "nvidia.com/mig-1g.10gb", 0),
            ("1", "", "graphics", "vk-llama-0", "llama", "nvidia.com/gpu", 2),
        ]
    ],
    ("node.json", "Processes"): [
        {"Node": p["Node"], "PID": p["PID"], "Name": p["Process"], "Type": p["Type"], "Card": p["Device"][0],
         "Device": p["Device"], "Profile": p["Profile"], "Namespace": p["Namespace"], "Pod": p["Pod"],
         "Container": p["Container"], "Memory": p["Memory"]}
        for p in PROCESSES
    ],
    ("node.json", "Cards"): [
        {"Node": NODE, "Card": "0", "Product": "NVIDIA A100-SXM4-80GB", "UUID": UUID_0, "Driver": "575.57.08",
         "MIG current": 1, "MIG pending": 1, "Instances": 3},
        # Not in MIG mode: no mig_instances series, so no Instances.
        {"Node": NODE, "Card": "1", "Product": "NVIDIA A100-SXM4-80GB", "UUID": UUID_1, "Driver": "575.57.08",
         "MIG current": 0, "MIG pending": 0, "Instances": None},
    ],
    # No XID on the e2e machine: it reads nvidia-smi and no kernel log (tests/test_dashboards.py,
    # NO_XID_LINES); test_every_health_panel_has_data_in_demo draws --demo's, and
    # test_a_one_off_xid_shows_with_its_meaning_device_and_who_ran_there one made by hand.
    ("health.json", "XID errors"): [],
}

# Tables compared as a person reads them: each number cell's text after the panel's units and
# value mappings (driver.js runs Grafana's display processor). Card health, by hand from demo.xml:
# card 0 (MIG) has 1 volatile uncorrectable SRAM error (its instance 0/mig0's) and reports no
# remapped rows, so: warning; card 1, the demo's sick card, has a pending row remap (1
# uncorrectable row), 1 volatile uncorrectable DRAM error and its PCIe link at x4 of x16: needs
# reset, with its T.Limit margin of 38 °C. Why: each reason's code, sorted. Work: the pods on each
# card's devices (tests/kube_node.py), and the one its idle 0/mig2 is allocated to. No XIDs (no
# kernel log, and nvidia-smi gives none): that column is absent, as in Grafana.
SHOWN_TABLES = {
    ("health.json", "Card health"): [
        {"Node": NODE, "Card": "0", "Product": "NVIDIA A100-SXM4-80GB", "State": "warning",
         "Why": ["ecc_uncorrectable"], "Work": ["pod batch/train-7", "pod llm/llama-0", "pod llm/vllm-6b7f9c-x2x4q"],
         "Temperature": "34 °C", "Margin": "", "Power": "87.2 W", "Power limit": "400 W", "Uncorrectable ECC": "1",
         "Remapped rows": "", "Remap pending": "", "Recovery action": "none"},
        {"Node": NODE, "Card": "1", "Product": "NVIDIA A100-SXM4-80GB", "State": "needs reset",
         "Why": ["ecc_uncorrectable", "pcie_link_width", "row_remap_pending"],
         "Work": ["pod graphics/vk-llama-0", "pod notebooks/jupyter-alice"],
         "Temperature": "51 °C", "Margin": "38 °C", "Power": "312 W", "Power limit": "400 W",
         "Uncorrectable ECC": "1", "Remapped rows": "1", "Remap pending": "pending: reset", "Recovery action": "none"},
    ],
}

# Stats: counted once per device, not once per exporter and once more per probe target.
STATS = {
    ("overview.json", "Devices"): 4,
    ("overview.json", "GPU processes"): 4,
    ("overview.json", "Memory used (no double counting)"): 43037 * MIB,
    ("overview.json", "Engines holding no GPU memory"): 1,
    ("overview.json", "Failing reads"): 0,
    ("overview.json", "MIG cards with nothing carved"): 0,
}
# A stat that counts what an alert raises shows as many as the alert has (pending or firing).
STAT_ALERTS = {
    ("overview.json", "Engines holding no GPU memory"): "EngineHoldsNoGPUMemory",
    ("overview.json", "Failing reads"): "GPUExporterReadFailing",
    ("overview.json", "MIG cards with nothing carved"): "MIGCardHasNoInstances",
}


def special_regex_escape(value: str) -> str:
    """A value of a multi-value variable in a Prometheus query, as Grafana's
    Prometheus data source escapes it: regex metacharacters get a backslash,
    itself escaped for the PromQL string (``.`` becomes ``\\\\.``)."""
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))


def all_value(variable: dict, options: list[str]) -> str:
    """What ``$name`` becomes with "All" selected: the variable's allValue when it
    has one, else every option, escaped and joined as ``(a|b)``."""
    if variable.get("allValue"):
        return variable["allValue"]
    escaped = [special_regex_escape(o) for o in options]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def interpolate(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return text


def fill_variables(prom, dashboard: dict) -> dict[str, str]:
    """Each query variable at "All", in order: its options from Prometheus
    (``label_values(selector, label)``, earlier variables filled in)."""
    values: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]["query"])
        assert m, variable["query"]
        selector, label = interpolate(m.group(1), values), m.group(2)
        options = sorted(prom.get(f"/api/v1/label/{label}/values", **{"match[]": selector}))
        assert options, f"{variable['name']}: no options for {selector}"
        values[variable["name"]] = all_value(variable, options)
    return values


def run_driver(jobs: list[dict]) -> list[dict]:
    node = require_tool("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if not re.fullmatch(r"v(\d+)\..*", version) or int(version[1:].split(".")[0]) < 20:
        pytest.fail(f"node {version or '(no version)'} is too old: tests/grafana's packages need Node.js 20 or "
                    "newer (Debian 12's nodejs is 18)", pytrace=False)
    if not (HARNESS / "node_modules" / "@grafana" / "data").is_dir():
        pytest.fail("tests/grafana/node_modules is missing: ./scripts/test runs npm ci there", pytrace=False)
    result = subprocess.run([node, str(HARNESS / "driver.js")], input=json.dumps(jobs), capture_output=True,
                            text=True, cwd=HARNESS, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# The data source a dashboard opened from dashboards/grafana/provisioning uses (its uid).
DATASOURCE_UID = "prometheus"


def url_state(dashboard: dict) -> dict:
    """The dashboard as opened, for its data links (tests/grafana/links.js): its default time
    range, the provisioned data source, every other variable at "All" (``$__all`` in a URL)."""
    return {"time": {"from": dashboard["time"]["from"], "to": dashboard["time"]["to"]},
            "variables": {v["name"]: [DATASOURCE_UID] if v["type"] == "datasource" else ["$__all"]
                          for v in dashboard["templating"]["list"]}}


def panels_through_grafana(prom, names: dict[str, str], chosen: dict[str, str] | None = None,
                           only: set[tuple[str, str]] | None = None) -> dict[tuple[str, str, str], dict]:
    """(dashboard, panel type, title) to the driver's result, for every panel of both dashboards
    (or the (dashboard, title) pairs in ``only``); each exporter address (127.0.0.1:port) in the
    answers replaced by its name in ``names``. ``chosen``: variables set to one value (as a
    link's ``var-NAME=VALUE`` sets them), not "All"."""
    at = str(time.time())
    jobs, keys = [], []
    for name, dashboard in _dashboards().items():
        # $__rate_interval as Grafana makes it for a 1 s scrape interval: its floor, 4 x 15 s.
        values = {**fill_variables(prom, dashboard), "__rate_interval": "1m",
                  **{k: special_regex_escape(v) for k, v in (chosen or {}).items()}}
        for panel in dashboard["panels"]:
            if panel["type"] == "row":  # no queries; its folded panel is a time series, no table or stat
                continue
            if only is not None and (name, panel["title"]) not in only:
                continue
            answers = []
            for target in panel["targets"]:
                query = {**target, "expr": interpolate(target["expr"], values)}
                answers.append({"query": query, "data": prom.get("/api/v1/query", query=query["expr"], time=at)})
            jobs.append({"panel": panel, "answers": answers, "context": url_state(dashboard)})
            keys.append((name, panel["type"], panel["title"]))
    text = json.dumps(jobs)
    for address in sorted(names, key=len, reverse=True):  # 127.0.0.1:4012 before 127.0.0.1:401
        text = text.replace(address, names[address])
    results = run_driver(json.loads(text))
    return dict(zip(keys, results, strict=True))


def rows(result: dict, shown: bool = False) -> list[dict] | str:
    """The table's rows, by column header; a description when it is not one table. ``shown``:
    each number cell as the table shows it (its display text), not its value."""
    frames = result["frames"]
    if not frames:  # Grafana's "No data"
        return []
    if len(frames) != 1:
        return f"{len(frames)} frames: {[[f['displayName'] for f in fr['fields']] for fr in frames]}"
    fields = frames[0]["fields"]
    out = [{f["displayName"]: (f["display"] if shown and f["display"] is not None else f["values"])[i] for f in fields}
           for i in range(frames[0]["length"])]
    # A cell listing several series (a card's reasons, its works) lists them in the answer's order.
    out = [{k: sorted(v) if isinstance(v, list) and None not in v else v for k, v in row.items()} for row in out]
    return sorted(out, key=lambda r: json.dumps(r, sort_keys=True))


def links(result: dict, column: str) -> dict[str, list[str]]:
    """Each row's data links on ``column`` (its header), by the cell's value: the URLs as Grafana
    renders them for that row (tests/grafana/links.js)."""
    (frame,) = result["frames"]
    (field,) = [f for f in frame["fields"] if f["displayName"] == column]
    by_row = field["links"] or [[] for _ in field["values"]]
    return {value: [link["href"] for link in row] for value, row in zip(field["values"], by_row, strict=True)}


def test_tables_and_stats_as_grafana_draws_them(fake_nvidia_smi, fake_kubelet, tmp_path):
    with e2e_node(fake_nvidia_smi, fake_kubelet, tmp_path) as (exp, prom):
        # The engine alert has been evaluated (it goes pending at once).
        assert _wait("alert", lambda: [a for a in prom.get("/api/v1/alerts")["alerts"]
                                       if a["labels"]["alertname"] == "EngineHoldsNoGPUMemory"])
        alerts = prom.get("/api/v1/alerts")["alerts"]
        devices = {(s["metric"]["instance"].replace(exp.address, NODE), s["metric"]["index"]): s["metric"]["device"]
                   for s in prom.query("mig_exporter_device_info")}
        results = panels_through_grafana(prom, {exp.address: NODE})

    dashboards = _dashboards()
    table_panels = {(name, p["title"]) for name, d in dashboards.items() for p in d["panels"] if p["type"] == "table"}
    stat_panels = {(name, p["title"]) for name, d in dashboards.items() for p in d["panels"] if p["type"] == "stat"}
    assert table_panels == set(TABLES) | set(SHOWN_TABLES) and stat_panels == set(STATS), \
        "every table and stat panel is checked"

    # Tables: one row per device, process, engine or card, every column filled in.
    problems: dict[str, object] = {}
    for (name, title), expected in [*TABLES.items(), *SHOWN_TABLES.items()]:
        table = rows(results[(name, "table", title)], shown=(name, title) in SHOWN_TABLES)
        if table != sorted(expected, key=lambda r: json.dumps(r, sort_keys=True)):
            problems[f"{name} / {title}"] = (table if isinstance(table, str) else
                                             {"rows": len(table), "expected rows": len(expected), "drawn": table})

    # Stats: one number each, counting every device once, and as many as their alert.
    for (name, title), expected_value in STATS.items():
        shown = [v["value"] for v in results[(name, "stat", title)]["values"]]
        alert = STAT_ALERTS.get((name, title))
        raised = len([a for a in alerts if a["labels"]["alertname"] == alert and a["state"] in ("pending", "firing")])
        if shown != [expected_value] or (alert and shown != [raised]):
            problems[f"{name} / {title}"] = {"shown": shown, "expected": expected_value,
                                             **({alert: raised} if alert else {})}

    # Legends: every series of a device is named with the device's name (card/migN).
    unnamed: dict[str, list[str]] = {}
    for (name, _, title), result in results.items():
        for frame in result["frames"]:
            for field in frame["fields"]:
                labels = field["labels"] or {}
                if field["type"] == "number" and "index" in labels:
                    device = devices[(labels["instance"], labels["index"])]
                    if not re.search(rf"(^|\s){re.escape(device)}(\s|$)", field["displayName"]):
                        unnamed.setdefault(f"{name} / {title} legend", []).append(
                            f"{field['displayName']!r} lacks {device}")
    problems.update(unnamed)

    summary = {k: ({"rows": v["rows"], "expected rows": v["expected rows"]} if isinstance(v, dict) and "rows" in v
                   else v) for k, v in problems.items()}
    assert problems == {}, json.dumps(summary, indent=1) + "\n\n" + json.dumps(problems, indent=1)


def _answers(panel: dict, values: dict[str, list[tuple[dict, float]]], now: float) -> list[dict]:
    """Prometheus' answers to the panel's queries, made by hand: ``values`` by refId, each series'
    labels (job and instance added) and value."""
    card = {"job": "mig-exporter", "instance": NODE}
    return [{"query": t, "data": {"resultType": "vector", "result": [
        {"metric": {**card, **labels}, "value": [now, str(v)]} for labels, v in values.get(t["refId"], [])]}}
        for t in panel["targets"]]


def test_the_health_table_is_one_row_a_card_with_why_whose_work_and_the_last_xid():
    """Here Prometheus' answers are made by hand: card 1 saw an XID two minutes ago and has two
    reasons and two works, card 0 none (and neither reports a margin). Grafana's code merges
    them, groups them back to one row a card with its reasons and works in one cell each, and
    writes the time as "2 minutes ago" (the query gives milliseconds, as Grafana's time units read)."""
    (panel,) = [p for p in _dashboards()["health.json"]["panels"] if p["title"] == "Card health"]
    now = time.time()
    values = {"A": [({"card": c, "name": "NVIDIA H100 80GB HBM3"}, 1) for c in "01"],
              "B": [({"card": "0"}, 0), ({"card": "1"}, 3)],
              "K": [({"card": "1"}, (now - 120) * 1000)],
              "L": [({"card": "1", "reason": "row_remap_failure"}, 1), ({"card": "1", "reason": "pcie_link_width"}, 1)],
              "M": [({"card": "1", "work": "pod llm/llama-0"}, 1), ({"card": "1", "work": "Slurm job 4242"}, 2),
                    ({"card": "0", "work": "process /usr/bin/python3"}, 1)]}
    (result,) = run_driver([{"panel": panel, "answers": _answers(panel, values, now)}])
    assert rows(result, shown=True) == [
        {"Node": NODE, "Card": "0", "Product": "NVIDIA H100 80GB HBM3", "State": "ok", "Why": None,
         "Work": ["process /usr/bin/python3"], "Last XID": ""},
        {"Node": NODE, "Card": "1", "Product": "NVIDIA H100 80GB HBM3", "State": "replace",
         "Why": ["pcie_link_width", "row_remap_failure"], "Work": ["Slurm job 4242", "pod llm/llama-0"],
         "Last XID": "2 minutes ago"},
    ]


def test_a_one_off_xid_shows_with_its_meaning_device_and_who_ran_there():
    """The issue's case: an XID seen once has a counter born at 1, so increase() over any window
    is 0 and a graph of it shows nothing. The table reads the last time instead: a one-off XID 94
    on 0/mig1 two minutes ago (its pid's pod named) and an XID 79 on card 1 an hour ago (no pid), by
    hand; each code reads as its meaning from src/mig_exporter/model/xids.py."""
    from mig_exporter.model.xids import describe

    (panel,) = [p for p in _dashboards()["health.json"]["panels"] if p["title"] == "XID errors"]
    now = time.time()
    mig = {"card": "0", "index": "1001", "xid": "94", "device": "0/mig1"}
    whole = {"card": "1", "index": "1", "xid": "79", "device": "1"}
    who = {"pid": "", "process_name": "", "namespace": "", "pod": "", "slurm_job": "", "systemd_unit": ""}
    values = {"A": [(mig, (now - 120) * 1000), (whole, (now - 3600) * 1000)],
              "B": [(mig, 1), (whole, 1)],
              "C": [({**mig, **who, "pid": "51877", "process_name": "python3", "namespace": "llm",
                      "pod": "vllm-6b7f9c-x2x4q"}, 1), ({**whole, **who}, 1)]}
    (result,) = run_driver([{"panel": panel, "answers": _answers(panel, values, now)}])
    assert rows(result, shown=True) == [
        {"Node": NODE, "Card": "0", "Device": "0/mig1", "XID": f"94: {describe(94).meaning}",
         "Last seen": "2 minutes ago", "Count": "1", "PID": "51877", "Process": "python3", "Namespace": "llm",
         "Pod": "vllm-6b7f9c-x2x4q", "Slurm job": "", "Unit": ""},
        {"Node": NODE, "Card": "1", "Device": "1", "XID": f"79: {describe(79).meaning}",
         "Last seen": "an hour ago", "Count": "1", "PID": "", "Process": "", "Namespace": "", "Pod": "",
         "Slurm job": "", "Unit": ""},
    ]


# --- --demo: the sick card fills every health panel -------------------------------------------

# What --demo cannot give a health query, each for why: an A100 retires no pages (it remaps rows).
QUIET_IN_DEMO = {"mig_exporter_card_retired_pages", "mig_exporter_card_retired_pages_pending"}


def test_every_health_panel_has_data_in_demo(tmp_path):
    """Issue 37's "done when": a real Prometheus scraping ``serve --demo`` has data for every query
    of every health panel (but page retirement, which an A100 does not do), and the XID table
    shows the XIDs of samples/demo-kmsg.txt as Grafana draws it: one row per (card, device, XID),
    with its meaning, count, last time and the process the last line named."""
    from mig_exporter.model.xids import describe

    _prometheus_binary()
    with exporter(None, tmp_path, "--no-kubernetes") as exp, prometheus(exp.address, tmp_path) as prom:
        assert _target_after_scrapes(prom, exp.address)["health"] == "up"
        d = _dashboards()["health.json"]
        values = {**fill_variables(prom, d), "__rate_interval": "1m"}
        empty = sorted((panel["title"], t["refId"]) for panel in d["panels"] if panel["type"] != "row"
                       for t in panel["targets"] if not prom.query(interpolate(t["expr"], values))
                       and not set(re.findall(r"\bmig_exporter_[a-z_]+", t["expr"])) & QUIET_IN_DEMO)
        assert empty == [], empty
        results = panels_through_grafana(prom, {exp.address: NODE}, only={("health.json", "XID errors")})
        assert "Traceback" not in exp.log.text()
    drawn = rows(results[("health.json", "table", "XID errors")], shown=True)
    assert isinstance(drawn, list) and all(row.pop("Last seen").endswith("ago") for row in drawn), drawn
    # No pod, job or unit in the demo: Prometheus keeps no empty label, so those columns are absent.
    assert drawn == sorted([
        {"Node": NODE, "Card": "0", "Device": "0/mig0", "XID": f"94: {describe(94).meaning}", "Count": "1",
         "PID": "48213", "Process": "llama-server"},
        {"Node": NODE, "Card": "1", "Device": "1", "XID": f"13: {describe(13).meaning}", "Count": "2",
         "PID": "50318", "Process": "python3"},
        {"Node": NODE, "Card": "1", "Device": "1", "XID": f"79: {describe(79).meaning}", "Count": "1",
         "PID": "", "Process": ""},
    ], key=lambda r: json.dumps(r, sort_keys=True))


# --- a troubled fleet: the stats that count what alerts raise, when there is something to count ----

CARVED, FAILING, PROBED = "carved-node", "failing-node", "carved-node-probed"
# a100-mig-nothing-carved.xml: card 0 in MIG mode with nothing carved, card 1 in MIG mode with one
# 7g.40gb instance. The failing node's nvidia-smi fails every read: no device, no card.
TROUBLED_STATS = {
    ("overview.json", "Devices"): 1,  # card 1's 7g.40gb, once: not again through /probe
    ("overview.json", "Failing reads"): 1,  # the failing node
    ("overview.json", "MIG cards with nothing carved"): 1,  # card 0, once: not again through /probe
}


@contextmanager
def troubled_fleet(fake_nvidia_smi, tmp_path: Path) -> Iterator[tuple[dict[str, str], Prometheus]]:
    """One Prometheus, the shipped rules (deploy/prometheus/alerts.yml, as they are) loaded,
    scraping on /metrics an exporter over a node with a MIG card with nothing carved and one
    whose nvidia-smi fails, and, as the probe job of docs/probe.md, the first node again
    through /probe (instance carved-node-probed). Yields (address to name, Prometheus) once
    every target has been scraped twice and MIGCardHasNoInstances and GPUExporterReadFailing
    have been evaluated (pending: their for: is minutes)."""
    _prometheus_binary()
    carved_smi = fake_nvidia_smi(fixture_bytes("a100-mig-nothing-carved.xml"),
                                 fixture_bytes("a100-mig-nothing-carved.L.txt"))
    failing_smi = fake_nvidia_smi(mode="fail")
    config = tmp_path / "mig-exporter.yml"
    config.write_text(f"probe_targets:\n  {PROBED}:\n    command: ['{carved_smi}']\n")
    (tmp_path / "carved").mkdir()
    (tmp_path / "failing").mkdir()
    with exporter(carved_smi, tmp_path / "carved", "--no-kubernetes", "--config.file", str(config)) as carved, \
            exporter(failing_smi, tmp_path / "failing", "--no-kubernetes") as failing:
        config = with_probe_config([carved.address, failing.address], PROBED, carved.address, ALERTS)
        with prometheus("", tmp_path, config) as prom:
            for address in (carved.address, failing.address, PROBED):
                assert _target_after_scrapes(prom, address)["health"] == "up"
            raised = {"MIGCardHasNoInstances", "GPUExporterReadFailing"}
            assert _wait("alerts", lambda: raised <= {a["labels"]["alertname"]
                                                      for a in prom.get("/api/v1/alerts")["alerts"]}), \
                prom.get("/api/v1/alerts")
            yield {carved.address: CARVED, failing.address: FAILING}, prom
        assert "Traceback" not in carved.log.text() + failing.log.text()


def test_stats_count_what_their_alerts_raise_in_a_troubled_fleet(fake_nvidia_smi, tmp_path):
    """The issue's example: with a probe job reading a node again, "MIG cards with nothing
    carved" showed 2 where MIGCardHasNoInstances raised 1. Here each stat that counts an
    alert's subjects has one to count, and shows exactly as many as the alert has."""
    with troubled_fleet(fake_nvidia_smi, tmp_path) as (names, prom):
        # What Prometheus holds: the nothing-carved card twice (/metrics and /probe), one
        # failed read; the alerts, gated on the exporter's own series, once each.
        stored = sorted((names.get(s["metric"]["instance"], s["metric"]["instance"]), s["metric"]["card"])
                        for s in prom.query("mig_exporter_card_mig_instances == 0"))
        assert stored == [(CARVED, "0"), (PROBED, "0")]
        assert [names[s["metric"]["instance"]] for s in prom.query("mig_exporter_read_success == 0")] == [FAILING]
        alerts = prom.get("/api/v1/alerts")["alerts"]
        results = panels_through_grafana(prom, names)

    raised = {name: sorted((names.get(a["labels"]["instance"], a["labels"]["instance"]), a["labels"].get("card"))
                           for a in alerts if a["labels"]["alertname"] == name and a["state"] in ("pending", "firing"))
              for name in ("MIGCardHasNoInstances", "GPUExporterReadFailing")}
    assert raised == {"MIGCardHasNoInstances": [(CARVED, "0")], "GPUExporterReadFailing": [(FAILING, None)]}

    shown = {key: [v["value"] for v in results[(key[0], "stat", key[1])]["values"]] for key in TROUBLED_STATS}
    assert shown == {key: [value] for key, value in TROUBLED_STATS.items()}
    for key, alert in STAT_ALERTS.items():
        if key in TROUBLED_STATS:
            assert shown[key] == [len(raised[alert])], (key, alert)
