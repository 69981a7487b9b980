"""The Prometheus rules: promtool accepts them, their unit tests pass, every
alert has a case that fires and a case that stays quiet, and the Kubernetes
PrometheusRule carries exactly the same groups.

promtool comes from Debian's ``prometheus`` package. When it is missing these
tests fail: ``scripts/test`` installs it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO, require_tool

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "prometheusrule.yaml"
RULE_TESTS = REPO / "tests" / "rules" / "alerts_test.yml"
SYNC = REPO / "scripts" / "sync-prometheusrule"


def _promtool() -> str:
    return require_tool("promtool")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, check=False)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _alert_names() -> list[str]:
    return [r["alert"] for r in _rules() if "alert" in r]


def test_promtool_checks_the_rules():
    result = _run("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_the_rules_are_the_ones_the_issue_asks_for():
    assert sorted(_alert_names()) == sorted([
        "EngineHoldsNoGPUMemory", "GPUExporterReadFailing", "GPUProcessesInvisible", "GPUDeviceMemoryNearlyFull",
        "MIGCardHasNoInstances", "MIGModeChangePending", "GPUExporterNotInHostPIDNamespace",
        "GPUProcessOutsideAllocation", "GPUAllocatedButUnused",
        "GPUProcessOutsideSlurmAllocation", "GPUSlurmAllocationUnused",
        *CARD_HEALTH_ALERTS, "GPUCardLost", "GPUCardRecoveryActionUnknown", "GPUPCIeLinkWidthDegraded",
        "GPUXidsNotSeen", "GPUMemoryHeldIdle",
    ])
    by_name = {r["alert"]: r for r in _rules() if "alert" in r}
    assert by_name["EngineHoldsNoGPUMemory"]["for"] == "2m"
    assert by_name["GPUExporterReadFailing"]["for"] == "5m"
    # No keep_firing_for: vmalert 1.79 refuses the whole file for it; the expression holds instead.
    assert [name for name, rule in by_name.items() if "keep_firing_for" in rule] == []
    assert by_name["GPUDeviceMemoryNearlyFull"]["for"] == "10m"
    assert by_name["GPUAllocatedButUnused"]["for"] == "30m"
    assert by_name["GPUProcessOutsideSlurmAllocation"]["for"] == "5m"
    assert by_name["GPUSlurmAllocationUnused"]["for"] == "30m"
    # Issue 26: a reset or a replacement within 15 minutes, ECC within 20, an XID within 10 (the
    # first event too: no for), heat and the power brake within 30, power capping within 3 hours.
    for name in ("GPUCardNeedsReset", "GPUCardNeedsRecovery", "GPUCardNeedsReplacement", "GPUPowerBrakeSlowdown",
                 "GPUCardLost", "GPUCardRecoveryActionUnknown"):
        assert by_name[name]["for"] == "5m", name
    # Issue 37: a narrow PCIe link for 15 minutes.
    assert by_name["GPUPCIeLinkWidthDegraded"]["for"] == "15m"
    # A node where no XID source is read: named after 30 minutes, as info.
    assert by_name["GPUXidsNotSeen"]["for"] == "30m" and by_name["GPUXidsNotSeen"]["labels"]["severity"] == "info"
    for name in ("GPUThermalSlowdown", "GPUTemperatureMarginLow"):
        assert by_name[name]["for"] == "10m", name
    assert by_name["GPUPowerCapped"]["for"] == "1h"
    # Issue 39: memory held by work idle for 2 hours (the chart's prometheusRule.memoryHeldIdleFor).
    assert by_name["GPUMemoryHeldIdle"]["for"] == "2h" and by_name["GPUMemoryHeldIdle"]["labels"]["severity"] == "info"
    for name in ("GPUUncorrectableECCErrors", "GPUInstanceUncorrectableECCErrors", *XID_ALERTS):
        assert "for" not in by_name[name], name
    records = [r["record"] for r in _rules() if "record" in r]
    assert records == [
        "instance_engine:mig_exporter_engine_memory_used_bytes:sum",
        "instance_engine:mig_exporter_engine_processes_without_gpu_memory:count",
        "instance_card:mig_exporter_device_memory_used_bytes:sum",
        "instance_card:mig_exporter_device_memory_total_bytes:sum",
        "instance_card_work:mig_exporter_process_info:count",
        "instance_card_work:mig_exporter_device_allocation_info:count",
        "node:mig_exporter_cards:count",
        IDLE_RECORD,
        *CAPACITY_RECORDS,
    ]
    # Issues 27 and 36: these ten names are what other tools may rely on.
    groups = {group["name"]: group for group in yaml.safe_load(ALERTS.read_text())["groups"]}
    assert [r["record"] for r in groups["mig-exporter.capacity"]["rules"]] == CAPACITY_RECORDS


IDLE_RECORD = "instance_device:mig_exporter_memory_held_idle_bytes:sum"
CAPACITY_RECORDS = [
    "instance_class:mig_exporter_devices:count",
    "instance_class:mig_exporter_devices_free:count",
    "instance_class:mig_exporter_devices_in_use:count",
    "instance_class:mig_exporter_devices_unknown:count",
    "instance_class:mig_exporter_device_memory_free_bytes:sum",
    "class:mig_exporter_devices:count",
    "class:mig_exporter_devices_free:count",
    "class:mig_exporter_devices_in_use:count",
    "class:mig_exporter_devices_unknown:count",
    "class:mig_exporter_device_memory_free_bytes:sum",
]


def test_promtool_unit_tests_pass():
    result = _run("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case_and_every_record_a_value_check():
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    checked: set[str] = set()
    for case in cases:
        for test in case.get("alert_rule_test", []):
            (fires if test.get("exp_alerts") else quiet).add(test["alertname"])
        for test in case.get("promql_expr_test", []):
            checked.add(test["expr"])
    alerts = set(_alert_names())
    assert alerts - fires == set(), "alerts without a case where they fire"
    assert alerts - quiet == set(), "alerts without a case where they stay quiet"
    records = {r["record"] for r in _rules() if "record" in r}
    assert records - checked == set(), "recording rules without a value check"


# Recorded series (`node:mig_exporter_cards:count`) are not inputs here: their rules hold
# their own inputs through failed reads.
SELECTOR = re.compile(r"(?<![:\w])(mig_exporter_[a-z_]+)(\{[^}]*\})?(\[\d+[mhd]\])?")
# Counters and clock-event gauges are read over a window of their own: range functions
# skip staleness markers, so a failed read is only a few missing samples. GPUCardLost
# looks back further (last_over_time over a day) for the cards a node listed.
WINDOWED = r"(rate|increase|avg_over_time|last_over_time)\({name}(\{{[^}}]*\}})?\[\d+[mhd]\]\)"
HOLD = "[3m]"
PROBE_GUARD = "and on (job, instance) last_over_time(mig_exporter_build_info[3m])"
HELD_GATE = "unless on (job, instance) (mig_exporter_read_success == 1)"


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_alert_input_rides_through_failed_reads():
    """No alert reads a bare instant selector, which a failed read or scrape empties
    and so resets `for:`. Each input is a 3-minute range (last_over_time or
    max_over_time), or the newest read's series with the held ones beside it
    when that read did not succeed:
    `x or (last_over_time(x[3m]) unless on (job, instance) (mig_exporter_read_success == 1))`.
    The gate asks the read, not the family: a node's last engine or process
    leaves no series of its family to say the read was good."""
    for rule in _rules():
        if "alert" not in rule:
            continue
        expr = _words(rule["expr"])
        # The held series' gate is the one bare selector allowed.
        gated = expr.replace(HELD_GATE, "")
        found = list(SELECTOR.finditer(gated))
        assert found, rule["alert"]
        for m in found:
            name, matchers, held = m.groups()
            if held and held != HOLD:
                assert re.search(WINDOWED.format(name=name), expr), (rule["alert"], m.group(0))
                continue
            if held:
                assert re.search(rf"(last|max|count)_over_time\({name}(\{{[^}}]*\}})?\[3m\]\)", expr), (
                    rule["alert"], name)
                continue
            selector = f"{name}{matchers or ''}"
            assert f"last_over_time({selector}{HOLD})" in expr or (
                f"{selector} or (last_over_time({selector}{HOLD}) {HELD_GATE})" in expr
            ), f"{rule['alert']}: {m.group(0)} is not held through a failed read"


def test_rules_over_device_card_and_process_series_count_the_exporters_own_series_only():
    """Probe targets export these families too, never build_info (docs/probe.md)."""
    families = re.compile(r"(?<!:)mig_exporter_(device|card|process)_")
    guarded = [r.get("alert") or r["record"] for r in _rules() if families.search(r["expr"])]
    assert len(guarded) == 32
    for rule in _rules():
        if families.search(rule["expr"]):
            name = rule.get("alert") or rule["record"]
            if rule.get("record") in CAPACITY_RECORDS:
                # The capacity rules match with ignoring, not on (job, instance): a ruler over
                # many clusters keeps each cluster's nodes apart (docs/capacity.md). Every device
                # series they count is a reporting node's, or a silent exporter's.
                words = _words(rule["expr"])
                assert words.count("mig_exporter_device_info[") == (
                    words.count(CAPACITY_REPORTING) + words.count(CAPACITY_SEEN)), name
                assert CAPACITY_REPORTING in words, name
            elif name == "node:mig_exporter_cards:count":
                # Counted per node, without instance: the guard comes before the count.
                assert f"{PROBE_GUARD}, " in _words(rule["expr"]), name
            elif name == "GPUCardLost":
                # A lost card's series carry the instance of an exporter pod that may be gone.
                assert _words(rule["expr"]).endswith(PROBE_GUARD.replace("[3m]", "[1d]")), name
            else:
                assert _words(rule["expr"]).endswith(PROBE_GUARD), name


# A node that reports now, an exporter's own /metrics (capacity_rules), and a silent one's devices.
CAPACITY_REPORTING = ("last_over_time(mig_exporter_device_info[1m]) and mig_exporter_device_info and ignoring "
                      "(index, card, mig_profile, uuid, gpu_instance, compute_instance, name, device, class, state, "
                      "source, version) ( min without (source) (last_over_time(mig_exporter_read_success[1m])) == 1 "
                      "and ignoring (version) last_over_time(mig_exporter_build_info[1m]) and ignoring (source) "
                      "mig_exporter_read_success )")
CAPACITY_SEEN = ("last_over_time(mig_exporter_device_info[1h]) and ignoring (index, card, mig_profile, uuid, "
                 "gpu_instance, compute_instance, name, device, class, state, source, version) "
                 "last_over_time(mig_exporter_build_info[1h])")


def test_the_capacity_rules_keep_every_target_and_external_label():
    """No `by (` or `on (` in the node rules: what they aggregate away is named (`without`,
    `ignoring`), so job, instance, node, cluster and replica stay; the fleet rules sum them."""
    by_name = {r.get("record"): r for r in _rules()}
    nodes = len(CAPACITY_RECORDS) // 2
    for name in CAPACITY_RECORDS[:nodes]:
        expr = _words(by_name[name]["expr"])
        assert " by (" not in expr and " on (" not in expr, name
    for name in CAPACITY_RECORDS[nodes:]:
        assert _words(by_name[name]["expr"]) == f"sum by (class) (instance_{name})"


CARD_HEALTH_ALERTS = [
    "GPUCardNeedsReset", "GPUCardNeedsRecovery", "GPUCardNeedsReplacement", "GPUUncorrectableECCErrors",
    "GPUInstanceUncorrectableECCErrors", "GPUCriticalXID", "GPUMemoryErrorXID", "GPUApplicationXID",
    "GPUThermalSlowdown", "GPUTemperatureMarginLow", "GPUPowerBrakeSlowdown", "GPUPowerCapped",
]
XID_ALERTS = ["GPUCriticalXID", "GPUMemoryErrorXID", "GPUApplicationXID"]
WORK = "instance_card_work:mig_exporter_process_info:count"
ALLOCATED = "instance_card_work:mig_exporter_device_allocation_info:count"


def test_card_health_alerts_say_whose_work_is_hit():
    """Each names the work on the card (or on the instance an XID or ECC count names) in its
    summary, from the recording rule; XID alerts read when the XID was last seen, so the
    first event of a series fires (increase() would miss it), and are probe-guarded too."""
    by_name = {r["alert"]: r for r in _rules() if "alert" in r}
    for name in CARD_HEALTH_ALERTS:
        # Issue 37: the processes, else the allocations (the processes are often gone after a fault).
        assert WORK in by_name[name]["annotations"]["summary"], name
        assert ALLOCATED in by_name[name]["annotations"]["summary"], name
        assert _words(by_name[name]["expr"]).endswith(PROBE_GUARD), name
    for name in XID_ALERTS:
        expr = _words(by_name[name]["expr"])
        assert "last_over_time(mig_exporter_xid_last_timestamp_seconds{" in expr and "> time() - 3600" in expr, name
        # The last XID line's own process first.
        assert "mig_exporter_xid_last_process_info{" in by_name[name]["annotations"]["summary"], name
        assert "mig_exporter_xid_errors_total" not in expr, name
    codes = [set(re.search(r'xid=~"([0-9|]+)"', by_name[n]["expr"]).group(1).split("|")) for n in XID_ALERTS]
    assert not set.intersection(*codes) and not codes[0] & codes[1] and not codes[1] & codes[2], "an XID in two tiers"
    # ECC: one scope, so an error is counted once.
    for name in ("GPUUncorrectableECCErrors", "GPUInstanceUncorrectableECCErrors"):
        assert 'scope="aggregate"' not in by_name[name]["expr"]
        assert by_name[name]["expr"].count('scope="volatile",type="uncorrectable"') >= 1


def test_kubernetes_and_slurm_allocation_alerts_read_only_their_own_rows():
    """Slurm rows of mig_exporter_device_allocation_info have pod="" and slurm_job set,
    Kubernetes rows slurm_job="": each allocation alert reads its own kind only."""
    by_name = {r["alert"]: _words(r["expr"]) for r in _rules() if "alert" in r}
    allocations = re.compile(r"mig_exporter_device_allocation_info(\{[^}]*\})?")
    own = {
        "GPUProcessOutsideAllocation": '{pod!=""}', "GPUAllocatedButUnused": '{pod!=""}',
        "GPUProcessOutsideSlurmAllocation": '{slurm_job!=""}', "GPUSlurmAllocationUnused": '{slurm_job!=""}',
    }
    for name, expr in by_name.items():
        found = [m.group(1) for m in allocations.finditer(expr)]
        assert bool(found) == (name in own), name
        assert all(matchers == own[name] for matchers in found), (name, found)
    assert 'mig_exporter_process_info{slurm_job!=""}' in by_name["GPUProcessOutsideSlurmAllocation"]
    assert "(max_over_time(mig_exporter_slurm_job_map_read_success[3m]) == 1)" in (
        by_name["GPUProcessOutsideSlurmAllocation"])


def test_the_engine_count_counts_what_the_engine_alert_counts():
    """One definition of "an engine holding no GPU memory": the recording rule is
    the alert's expr, word for word, counted per engine; dashboards reuse it."""
    by_name = {r.get("alert") or r["record"]: r for r in _rules()}
    alert = _words(by_name["EngineHoldsNoGPUMemory"]["expr"])
    record = _words(by_name["instance_engine:mig_exporter_engine_processes_without_gpu_memory:count"]["expr"])
    assert record == f"count by (job, instance, engine) ( {alert} )"
    # Self-contained: every join names job and instance.
    assert re.findall(r"on \(([^)]*)\)", alert) == ["job, instance", "job, instance, engine, pid", "job, instance"]


def test_memory_held_idle_is_one_definition_judged_only_where_activity_is_measured():
    """Issue 39: the recording rule is GPUMemoryHeldIdle's expr summed per whole card or GPU
    instance, word for word (the alert's `for:` aside); the alert reads activity only as measured
    ratios (an absent series is never idle), judges a MIG GPU instance once (its compute instances
    each report its memory and GPM), leaves out a device that reported its activity unknown within
    3 minutes and a process listed within 3 minutes without its shares, and judges a whole card's
    processes rather than the card where they have activity of their own."""
    by_name = {r.get("alert") or r["record"]: r for r in _rules()}
    alert = _words(by_name["GPUMemoryHeldIdle"]["expr"])
    record = _words(by_name[IDLE_RECORD]["expr"])
    assert alert.endswith(PROBE_GUARD)
    core = alert[: -len(PROBE_GUARD)].strip()
    assert record == f"sum by (job, instance, node, card, gpu_instance) ( {core} ) {PROBE_GUARD}"
    # Each device series joined to its GPU instance as GPUProcessesInvisible and
    # GPUDeviceMemoryNearlyFull do: memory, activity and the unknown each once per GPU instance.
    join = ("* on (job, instance, index, mig_profile) group_left (gpu_instance) topk by (job, instance, index, "
            "mig_profile) (1, mig_exporter_device_info or (last_over_time(mig_exporter_device_info[3m]) "
            f"{HELD_GATE}) )")
    assert alert.count(join) == 3
    assert "max by (job, instance, node, card, gpu_instance, mig_profile) ( last_over_time(" \
           "mig_exporter_device_memory_used_bytes[3m]) " + join in alert
    assert ("unless on (job, instance, card, gpu_instance) ( (max_over_time(mig_exporter_device_activity_unknown[3m])"
            " == 1) " + join) in alert
    assert ("unless on (job, instance, card) ( max_over_time(mig_exporter_process_sm_activity_ratio[3m]) "
            "or max_over_time(mig_exporter_process_memory_activity_ratio[3m]) )") in alert
    # A process's unknown: a scrape that listed it (its memory) without a share of it.
    assert ("unless on (job, instance, index, pid) ( count_over_time(mig_exporter_process_memory_used_bytes[3m]) "
            "> on (job, instance, index, pid) min by (job, instance, index, pid) ( "
            "count_over_time(mig_exporter_process_sm_activity_ratio[3m]) or label_replace(count_over_time("
            'mig_exporter_process_memory_activity_ratio[3m]), "activity", "memory", "", "") ) )') in alert
    # Under 1% of the highest measured ratio, above 1 GiB (the chart replaces these two numbers).
    assert alert.count(") < 0.01") == 2 and alert.count("> 1073741824") == 2
    assert "or vector(" not in alert and "absent(" not in alert, "nothing stands in for an unmeasured ratio"
    # Its labels name the GPU instance (or the whole card), and the process where a process is
    # judged; the target's pod labels (an Operator scrape's: the exporter's own pod) are
    # aggregated away, not routed on.
    assert "max by (job, instance, node, card, gpu_instance, mig_profile) (" in alert
    assert "max by (job, instance, node, card, index, mig_profile, pid) (" in alert


def test_every_alert_has_a_case_where_it_fires_through_a_failed_read():
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    through: set[str] = set()
    for case in cases:
        if not any("stale" in s["values"].split() for s in case["input_series"]):
            continue
        for test in case.get("alert_rule_test", []):
            if test.get("exp_alerts"):
                through.add(test["alertname"])
    assert set(_alert_names()) - through == set()


def test_a_wrong_expectation_fails(tmp_path: Path):
    """The unit tests are not vacuous: promtool fails when an expectation is wrong."""
    text = RULE_TESTS.read_text().replace("../../deploy/prometheus/alerts.yml", str(ALERTS))
    assert text.count('pid: "52040"') == 1
    # Only the case that holds the expectation: promtool evaluates each case's whole span, and the
    # file's other cases (about 15 s of it) prove nothing here.
    tests = yaml.safe_load(text.replace('pid: "52040"', 'pid: "52041"'))
    tests["tests"] = [case for case in tests["tests"] if re.search(r"pid: ['\"]52041['\"]", yaml.safe_dump(case))]
    assert len(tests["tests"]) == 1
    wrong = tmp_path / "wrong_test.yml"
    wrong.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = _run("test", "rules", str(wrong))
    assert result.returncode == 1
    assert "alertname: EngineHoldsNoGPUMemory" in result.stdout + result.stderr


def test_the_prometheus_rule_carries_the_same_groups():
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["name"] == "mig-exporter"
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    # Comments too: the file is exactly what the sync script writes.
    result = subprocess.run([sys.executable, str(SYNC), "--check"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr


def test_the_prometheus_rule_groups_pass_promtool(tmp_path: Path):
    groups = tmp_path / "groups.yml"
    groups.write_text(yaml.safe_dump({"groups": yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"]}))
    result = _run("check", "rules", str(groups))
    assert result.returncode == 0, result.stdout + result.stderr


RUNBOOK = "https://github.com/mig-exporter/mig-exporter/blob/main/docs/alerts.md#"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to '-'."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_has_a_runbook_section():
    """Issue 37: each alert links to its own section of docs/alerts.md, which exists."""
    anchors = _anchors((REPO / "docs" / "alerts.md").read_text())
    for rule in _rules():
        if "alert" in rule:
            url = rule["annotations"].get("runbook_url", "")
            assert url == RUNBOOK + rule["alert"].lower(), rule["alert"]
            assert rule["alert"].lower() in anchors, f"docs/alerts.md has no section for {rule['alert']}"
