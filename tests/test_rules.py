"""The Prometheus rules: promtool accepts them, their unit tests pass, every
alert has a case that fires and a case that stays quiet, and the Kubernetes
PrometheusRule carries exactly the same groups.

promtool comes from Debian's ``prometheus`` package. When it is missing these
tests fail: ``scripts/test`` installs it.
"""

from __future__ import annotations

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
    ])
    by_name = {r["alert"]: r for r in _rules() if "alert" in r}
    assert by_name["EngineHoldsNoGPUMemory"]["for"] == "2m"
    assert by_name["GPUExporterReadFailing"]["for"] == "5m"
    assert by_name["GPUDeviceMemoryNearlyFull"]["for"] == "10m"
    assert by_name["GPUAllocatedButUnused"]["for"] == "30m"
    records = [r["record"] for r in _rules() if "record" in r]
    assert records == [
        "instance_engine:mig_exporter_engine_memory_used_bytes:sum",
        "instance_engine:mig_exporter_engine_processes_without_gpu_memory:count",
        "instance_card:mig_exporter_device_memory_used_bytes:sum",
        "instance_card:mig_exporter_device_memory_total_bytes:sum",
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


def test_a_wrong_expectation_fails(tmp_path: Path):
    """The unit tests are not vacuous: promtool fails when an expectation is wrong."""
    text = RULE_TESTS.read_text().replace("../../deploy/prometheus/alerts.yml", str(ALERTS))
    assert text.count('pid: "52040"') == 1
    wrong = tmp_path / "wrong_test.yml"
    wrong.write_text(text.replace('pid: "52040"', 'pid: "52041"'))
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
