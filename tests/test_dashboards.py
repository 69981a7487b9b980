"""The Grafana dashboards: generated JSON up to date, well formed, every query
valid PromQL (promtool), naming only documented metrics, never double counting."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

import pytest
import yaml

from conftest import REPO, require_tool

GRAFANA = REPO / "dashboards" / "grafana"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_dashboards", GRAFANA / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dashboards() -> dict[str, dict]:
    return {name: json.loads((GRAFANA / name).read_text()) for name in _generator().DASHBOARDS}


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel but rows, those inside collapsed rows too (a collapsed row keeps its
    panels in its own ``panels``), in dashboard order."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


# Panels folded in a collapsed row: empty on most fleets (docs/hpc.md), so the e2e
# fleet, which runs no Slurm job and no systemd unit, leaves them without data.
FOLDED = {("overview.json", "GPU memory by Slurm job / systemd unit")}
# Queries that the e2e machine (the demo: two A100s on 575, read through nvidia-smi, a kubelet
# allocating every device) leaves empty, each for what it shows: (dashboard, panel, family queried) → why.
# The demo's sick card (card 1) fills every other health query: margin, clock events, PCIe link.
NO_XID_LINES = ("the e2e machine reads nvidia-smi (no NVML events) and no kernel log (its lines are timed by the "
                "machine's boot); serve --demo's are checked in test_grafana.py")
NO_GPM = ("the e2e machine reads nvidia-smi, which has no GPM (and its A100s have none): its devices' activity is "
          "unknown (not_read), never 0; its whole card's processes have theirs (pmon)")
QUIET_ON_THE_DEMO = {
    ("health.json", "Card health", "mig_exporter_xid_last_timestamp_seconds"): NO_XID_LINES,
    ("health.json", "XID errors", "mig_exporter_xid_last_timestamp_seconds"): NO_XID_LINES,
    ("health.json", "XID errors", "mig_exporter_xid_errors_total"): NO_XID_LINES,
    ("health.json", "XID errors", "mig_exporter_xid_last_process_info"): NO_XID_LINES,
    ("health.json", "Retired pages and recovery action", "mig_exporter_card_retired_pages"):
        "page retirement is pre-Ampere's: an A100 writes N/A (it remaps rows instead; the panel has the recovery "
        "action)",
    ("health.json", "Retired pages and recovery action", "mig_exporter_card_retired_pages_pending"):
        "page retirement is pre-Ampere's: an A100 writes N/A (it remaps rows instead; the panel has the recovery "
        "action)",
    ("overview.json", "Nodes with a free device of the chosen class", "mig_exporter_device_state"):
        "no device is free: the 1g.10gb has no process, but the kubelet allocated it to batch/train-7",
    ("overview.json", "Activity by device", "mig_exporter_device_graphics_activity_ratio"): NO_GPM,
    ("overview.json", "Activity by device", "mig_exporter_device_sm_activity_ratio"): NO_GPM,
}


def quiet_key(dash: str, title: str, expr: str) -> tuple[str, str, str] | None:
    """The QUIET_ON_THE_DEMO entry a query is, if any: the family it reads is named in it."""
    families = set(re.findall(r"\b(mig_exporter_[a-z_]+)\b", expr))
    keys = [k for k in QUIET_ON_THE_DEMO if k[:2] == (dash, title) and k[2] in families]
    return keys[0] if len(keys) == 1 else None

def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every query of every panel, in collapsed rows too."""
    return [(name, panel["title"], t["expr"])
            for name, d in _dashboards().items() for panel in all_panels(d) for t in panel.get("targets", [])]


def concrete(expr: str) -> str:
    """The query as Grafana sends it with every variable at "All"."""
    return (expr.replace("$node", ".*").replace("$card", ".*").replace("$class", ".*")
            .replace("$__rate_interval", "1m"))


def test_committed_json_is_what_the_generator_makes():
    gen = _generator()
    for name, build in gen.DASHBOARDS.items():
        assert (GRAFANA / name).read_text() == gen.render(build), f"run dashboards/grafana/generate.py ({name})"


@pytest.mark.parametrize("name", ["overview.json", "node.json", "health.json"])
def test_dashboard_structure(name):
    d = _dashboards()[name]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = [v["name"] for v in d["templating"]["list"]]
    assert variables[:2] == ["datasource", "node"]
    if name in ("node.json", "health.json"):
        assert "card" in variables
    ids += [p["id"] for row in d["panels"] if row["type"] == "row" for p in row["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in d["panels"] + [p for row in d["panels"] if row["type"] == "row" for p in row["panels"]]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        if panel["type"] == "row":
            assert panel["collapsed"] and panel["panels"] and "targets" not in panel, panel["title"]
            continue
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_overview_has_the_panels_users_asked_for():
    titles = {p["title"] for p in _dashboards()["overview.json"]["panels"]}
    assert {"Memory used by card and GPU instance", "MIG layout", "Top processes by GPU memory",
            "Engines holding no GPU memory", "Read failures"} <= titles
    node_titles = {p["title"] for p in _dashboards()["node.json"]["panels"]}
    assert {"Memory used by device", "Processes", "Cards"} <= node_titles


def test_every_query_is_valid_promql(tmp_path):
    promtool = require_tool("promtool")
    rules = {"groups": [{"name": "dashboard-queries", "rules": [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, _, expr) in enumerate(dashboard_queries())
    ]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_queries_name_only_documented_metrics():
    documented = set(re.findall(r"^\| `(mig_exporter_[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text(), re.M))
    for dash, title, expr in dashboard_queries():
        for metric in re.findall(r"\bmig_exporter_[a-z_]+", expr):
            assert metric in documented, f"{dash} / {title}: {metric} is not in docs/metrics.md"


def test_the_hpc_panel_is_folded_in_a_collapsed_row_at_the_bottom():
    """Grafana cannot hide a panel without data: the Slurm / systemd panel sits in a
    collapsed row, last, so Kubernetes fleets see one folded line."""
    d = _dashboards()["overview.json"]
    row = d["panels"][-1]
    assert (row["type"], row["title"], row["collapsed"]) == ("row", "HPC: Slurm jobs and systemd units", True)
    assert [p["type"] for p in d["panels"]].count("row") == 1
    (panel,) = row["panels"]
    assert (panel["type"], panel["title"]) == ("timeseries", "GPU memory by Slurm job / systemd unit")
    assert [(t["refId"], t["expr"], t["legendFormat"]) for t in panel["targets"]] == [
        ("A", 'topk(20, mig_exporter_slurm_job_memory_used_bytes{instance=~"$node"})',
         "job {{slurm_job}} {{instance}}"),
        ("B", 'topk(20, mig_exporter_systemd_unit_memory_used_bytes{instance=~"$node"})',
         "{{systemd_unit}} {{instance}}"),
    ]
    above = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in d["panels"][:-1])
    assert row["gridPos"] == {"x": 0, "y": above, "w": 24, "h": 1}
    assert panel["gridPos"]["y"] == above + 1
    assert {(n, title) for n, title, _ in dashboard_queries()} >= FOLDED


def test_process_tables_show_slurm_job_unit_and_user():
    for name, title in [("overview.json", "Top processes by GPU memory"), ("node.json", "Processes")]:
        (panel,) = [p for p in all_panels(_dashboards()[name]) if p["title"] == title]
        (target,) = panel["targets"]
        assert "container, slurm_job, systemd_unit, user) mig_exporter_process_info" in target["expr"]
        organize = next(x for x in panel["transformations"] if x["id"] == "organize")["options"]
        assert {k: organize["renameByName"][k] for k in ("slurm_job", "systemd_unit", "user")} == {
            "slurm_job": "Slurm job", "systemd_unit": "Unit", "user": "User"}


def test_no_query_adds_up_memory_shared_by_compute_instances():
    for dash, title, expr in dashboard_queries():
        if "device_memory" in expr and re.search(r"\bsum\b", expr):
            # One value per GPU instance: by name, or (the capacity rules) every label but the device's.
            assert ("max by (job, instance, card, gpu_instance)" in expr
                    or "max without (index, mig_profile) ( last_over_time(mig_exporter_device_memory_free_bytes"
                    in expr), \
                f"{dash} / {title} double counts: {expr}"


def test_every_join_and_aggregation_keeps_job_and_instance():
    """Joins match on (job, instance, ...) as the rules do, and aggregations by
    instance keep job: two jobs scraping one instance must not make group_left
    fail (many-to-many) nor a max mix two jobs' series."""
    joins = aggregations = 0
    for dash, title, expr in dashboard_queries():
        for kind, clause in re.findall(r"\b(on|by)\s*\(([^)]*)\)", expr):
            labels = [label.strip() for label in clause.split(",")]
            if kind == "on":
                joins += 1
                assert labels[:2] == ["job", "instance"], f"{dash} / {title}: on ({clause})"
            elif "instance" in labels:
                aggregations += 1
                assert labels[:2] == ["job", "instance"], f"{dash} / {title}: by ({clause})"
    assert joins >= 20 and aggregations >= 6, (joins, aggregations)


def test_the_idle_memory_panel_is_the_alert():
    """One definition of memory held idle: GPUMemoryHeldIdle's expression, read from alerts.yml when
    the dashboards are generated, verbatim in the overview's panel, per whole card or GPU instance
    (named by one of its devices) or process, and never where
    activity is not measured (the device activity panel reads only measured ratios)."""
    (rule,) = [r for g in yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
               for r in g["rules"] if r.get("alert") == "GPUMemoryHeldIdle"]
    expr = rule["expr"].strip()
    (panel,) = [p for p in _dashboards()["overview.json"]["panels"] if p["title"] == "GPU memory held idle"]
    (target,) = panel["targets"]
    assert target["expr"] == (
        f'(({expr}) and on (job, instance) mig_exporter_build_info{{instance=~"$node"}}) '
        f'* on (job, instance, card, gpu_instance) group_left (device) '
        f'topk by (job, instance, card, gpu_instance) (1, mig_exporter_device_info{{instance=~"$node"}})')
    assert panel["fieldConfig"]["defaults"]["unit"] == "bytes"
    (activity,) = [p for p in _dashboards()["overview.json"]["panels"] if p["title"] == "Activity by device"]
    assert [t["expr"].split("{")[0] for t in activity["targets"]] == [
        "mig_exporter_device_graphics_activity_ratio", "mig_exporter_device_sm_activity_ratio",
        "mig_exporter_process_sm_activity_ratio"]
    assert all("or vector(" not in t["expr"] for t in activity["targets"])


def test_provisioning_files_are_grafana_provisioning():
    dashboards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards.yaml").read_text())
    assert dashboards["apiVersion"] == 1 and dashboards["providers"][0]["type"] == "file"
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"


def test_the_engines_stat_and_table_are_the_alert():
    """One definition of an engine holding no GPU memory: EngineHoldsNoGPUMemory's
    expression, read from alerts.yml when the dashboards are generated, verbatim
    in the stat and the table (the stat once counted engines the alert skips)."""
    (rule,) = [r for g in yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
               for r in g["rules"] if r.get("alert") == "EngineHoldsNoGPUMemory"]
    expr = rule["expr"].strip()
    panels = [p for p in _dashboards()["overview.json"]["panels"] if p["title"] == "Engines holding no GPU memory"]
    assert sorted(p["type"] for p in panels) == ["stat", "table"]
    for panel in panels:
        (target,) = panel["targets"]
        assert target["expr"].startswith(("count((", "(")) and f"({expr}) and on (job, instance)" in target["expr"]
    (stat,) = [p for p in panels if p["type"] == "stat"]
    assert stat["targets"][0]["expr"] == (
        f'count(({expr}) and on (job, instance) mig_exporter_build_info{{instance=~"$node"}}) or vector(0)')


@pytest.mark.parametrize("name", ["overview.json", "node.json", "health.json"])
def test_all_nodes_are_the_exporters_not_their_probe_targets(name):
    """"All" in $node is the instances that export mig_exporter_build_info (Grafana
    joins them as a regex), not ".*", which also matches /probe targets: a node read
    through /metrics and /probe would count twice."""
    (node,) = [v for v in _dashboards()[name]["templating"]["list"] if v["name"] == "node"]
    assert node["query"]["query"] == "label_values(mig_exporter_build_info, instance)"
    assert node["includeAll"] and "allValue" not in node


def _per_device_metrics() -> set[str]:
    """The metrics docs/metrics.md documents with an ``index`` label: one series per device.
    Not mig_exporter_engine_info, which the dashboards read as ``index=""`` (an engine on no
    device: the engines panels)."""
    rows = re.findall(r"^\| `(mig_exporter_[a-z_]+)` \| \w+ \| ([^|]*) \|", (REPO / "docs" / "metrics.md").read_text(),
                      re.M)
    return {name for name, labels in rows if "`index`" in labels} - {"mig_exporter_engine_info"}


def _is_per_device(expr: str, per_device: set[str]) -> bool:
    """A query whose series are devices: it reads a per-device metric and does not
    aggregate it by something other than the device (``topk`` keeps the labels)."""
    if not set(re.findall(r"\bmig_exporter_[a-z_]+", expr)) & per_device:
        return False
    outer = re.match(r"[\s(]*(sum|max|min|avg|count)\b\s*(?:(by|without)\s*\(([^)]*)\))?", expr)
    if outer is not None and outer.group(2) == "without":  # the capacity rules: the device's labels go
        return "index" not in outer.group(3)
    return outer is None or "index" in (outer.group(3) or "")


def test_every_per_device_view_names_the_device():
    """Legends and table columns show the device ("0/mig1"), not the placement index:
    every per-device series' legend has ``{{device}}``, every per-device table a Device column."""
    per_device = _per_device_metrics()
    assert {"mig_exporter_device_memory_used_bytes", "mig_exporter_process_info",
            "mig_exporter_device_allocation_info"} <= per_device, per_device
    checked = []
    for name, d in _dashboards().items():
        for panel in all_panels(d):
            where = f"{name} / {panel['title']}"
            for t in panel["targets"]:
                assert "{{index}}" not in t.get("legendFormat", ""), f"{where}: legend shows the index"
                if panel["type"] == "timeseries" and _is_per_device(t["expr"], per_device):
                    legend = t["legendFormat"]
                    assert "{{device}}" in legend, f"{where}: legend {legend!r} lacks {{{{device}}}}"
                    checked.append(where)
            if panel["type"] == "table":
                organize = next(x for x in panel["transformations"] if x["id"] == "organize")["options"]
                assert organize["renameByName"].get("index") in (None, "Index"), panel["title"]
                if any(_is_per_device(t["expr"], per_device) for t in panel["targets"]):
                    assert organize["renameByName"].get("device") == "Device", f"{where}: no Device column"
                    checked.append(where)
    # The per-device views: both "Memory used by device", "Memory free by device", the
    # MIG layout, processes and allocations tables, the MIG instances' own ECC errors, and
    # the activity (three queries) and memory held idle.
    assert sorted(checked) == sorted([
        "overview.json / Memory used by device", "overview.json / MIG layout",
        *["overview.json / Activity by device"] * 3, "overview.json / GPU memory held idle",
        "overview.json / Top processes by GPU memory", "overview.json / GPU allocations",
        "node.json / Memory used by device", "node.json / Memory free by device", "node.json / Processes",
        "health.json / ECC errors since the driver loaded", "health.json / XID errors",
    ]), checked


# --- the card-health dashboard ------------------------------------------------------------------

HEALTH_FAMILIES = {
    "mig_exporter_card_temperature_celsius", "mig_exporter_card_memory_temperature_celsius",
    "mig_exporter_card_temperature_threshold_celsius", "mig_exporter_card_temperature_margin_celsius",
    "mig_exporter_card_power_draw_watts", "mig_exporter_card_power_limit_watts",
    "mig_exporter_card_clock_event_active", "mig_exporter_card_clock_event_seconds_total",
    "mig_exporter_card_clock_hertz", "mig_exporter_card_ecc_errors_total", "mig_exporter_device_ecc_errors_total",
    "mig_exporter_card_remapped_rows", "mig_exporter_card_row_remap_pending", "mig_exporter_card_row_remap_failure",
    "mig_exporter_card_row_remap_availability_banks", "mig_exporter_card_retired_pages",
    "mig_exporter_card_retired_pages_pending", "mig_exporter_xid_errors_total",
    "mig_exporter_xid_last_timestamp_seconds", "mig_exporter_xid_last_process_info",
    "mig_exporter_card_recovery_action", "mig_exporter_card_health", "mig_exporter_card_health_reason",
    "mig_exporter_card_pcie_link_width_lanes", "mig_exporter_card_pcie_link_generation",
}
# Families without a card label, selected by node alone: the card comes from a join on device_info.
WITHOUT_CARD = {"mig_exporter_device_allocation_info"}


def test_the_health_dashboard_reads_every_health_family_per_card():
    """Heat, power and wear are the card's: every query selects by node and card, and
    none of them adds cards up."""
    read = set()
    for dash, title, expr in dashboard_queries():
        if dash != "health.json":
            continue
        read |= set(re.findall(r"\bmig_exporter_[a-z_]+", expr))
        for family, selector in re.findall(r"(mig_exporter_[a-z_]+)\{([^}]*)\}", expr):
            chosen = 'instance=~"$node"' if family in WITHOUT_CARD else 'instance=~"$node", card=~"$card"'
            assert selector.startswith(chosen), f"{title}: {family}{{{selector}}}"
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            assert "card" in clause, f"{title}: by ({clause}) mixes cards"
    assert read >= HEALTH_FAMILIES, sorted(HEALTH_FAMILIES - read)


def test_the_health_states_read_as_the_landing_page_and_doctor_write_them():
    """The table's State and the timeline map mig_exporter_card_health's states, worst first
    as numbers, to the words of model/health.py's Verdict.label."""
    from mig_exporter.model.health import HEALTH_STATES, Verdict

    gen = _generator()
    labels = [Verdict(state, ()).label for state in HEALTH_STATES]
    assert [text for text, _ in gen.HEALTH_STATE_TEXT.values()] == labels == ["ok", "warning", "needs reset", "replace"]
    assert list(gen.HEALTH_STATE_TEXT) == list(range(len(HEALTH_STATES)))
    panels = {p["title"]: p for p in all_panels(_dashboards()["health.json"])}
    (override,) = [o for o in panels["Card health"]["fieldConfig"]["overrides"]
                   if o["matcher"]["options"] == "Value #B" and any(p["id"] == "mappings" for p in o["properties"])]
    (mapping,) = next(p["value"] for p in override["properties"] if p["id"] == "mappings")
    assert {int(k): v["text"] for k, v in mapping["options"].items()} == dict(enumerate(labels))
    (timeline_mapping,) = panels["Health over time"]["fieldConfig"]["defaults"]["mappings"]
    assert timeline_mapping == mapping
    # Each state's number: state="warning" as 1, "reset" as 2, "replace" as 3 ("ok" is what is left: 0).
    (target,) = panels["Health over time"]["targets"]
    assert target["expr"] == panels["Card health"]["targets"][1]["expr"]
    for number, state in enumerate(HEALTH_STATES[1:], 1):
        assert f'state="{state}"}}' + (f" * {number}" if number > 1 else "") in target["expr"]
