"""`mig-exporter doctor`: each warning against a scenario, its fix, text and JSON output, exit codes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from click.testing import CliRunner

from conftest import fixture_bytes
from fake_nvml import SCENARIOS
from mig_exporter.cli import cli
from mig_exporter.doctor import PathReading, compare, diagnose, timed_read
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource


def _doctor(fake_nvml_lib, fake_nvidia_smi, nvml_scenario, xml: bytes, listing: bytes, **smi_options):
    fake_nvml_lib(nvml_scenario)
    smi = fake_nvidia_smi(xml, listing, **smi_options)
    return diagnose(timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read))


def _fixture(name: str) -> tuple[bytes, bytes]:
    return fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt")


def _codes(report) -> list[str]:
    return [f.code for f in report.findings]


def test_a_healthy_mig_node_has_no_warnings(fake_nvml_lib, fake_nvidia_smi):
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "h100-mig-processes", *_fixture("h100-mig-processes"))
    assert report.findings == ()
    assert report.snapshot is not None and len(report.snapshot.devices) == 4


def test_mig_enabled_with_nothing_carved(fake_nvml_lib, fake_nvidia_smi):
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "a100-mig-nothing-carved", *_fixture("a100-mig-nothing-carved"))
    assert _codes(report) == ["mig-nothing-carved"]
    finding = report.findings[0]
    assert finding.message == ("card 0 (NVIDIA A100-SXM4-40GB) is in MIG mode with no instance carved: "
                               "nothing can run on it")
    assert "nvidia-smi mig -cgi" in finding.fix


def test_pending_mode_differs_from_current(fake_nvml_lib, fake_nvidia_smi):
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "a100-mig-pending", *_fixture("a100-mig-pending"))
    assert _codes(report) == ["mig-reset-pending"]
    assert "MIG mode is disabled but enabled is pending: a GPU reset is needed" in report.findings[0].message
    assert "nvidia-smi -r -i 0" in report.findings[0].fix


def test_nvml_and_nvidia_smi_disagree(fake_nvml_lib, fake_nvidia_smi):
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "h100-mig-processes", *_fixture("h200-shared-gpu-instance"))
    assert _codes(report) == ["paths-disagree"]
    assert "card 0 uuid: 'GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2' vs 'GPU-68c6414c-e9da-201e-0c0d-1a0dc00f0e71'" in (
        report.findings[0].message)


def test_compare_tolerates_mib_rounding_but_not_a_moved_process():
    from conftest import scenario

    a = scenario("h100-mig-processes")
    b = dataclasses.replace(a, devices=tuple(
        dataclasses.replace(d, memory=d.memory._replace(total_bytes=d.memory.total_bytes + 512 * 1024))
        for d in a.devices))
    assert compare(a, b) == []
    moved = dataclasses.replace(a, processes=tuple(
        p._replace(device_index=1003) if p.pid == 21198 else p for p in a.processes))
    assert compare(a, moved) == ["process 21198 on device 0/mig2 (1002) seen by one path only",
                                 "process 21198 on device 0/mig3 (1003) seen by one path only"]


def test_memory_in_use_with_no_process_listed_points_at_host_pid(fake_nvml_lib, fake_nvidia_smi):
    xml, listing = _fixture("h100-mig-processes")
    hidden_xml = re.sub(rb"<process_info>.*?</process_info>\s*", b"", xml, flags=re.S)
    base = SCENARIOS["h100-mig-processes"]()
    hidden = dataclasses.replace(base, cards=tuple(
        dataclasses.replace(card, mig_devices=tuple(
            dataclasses.replace(m, compute_processes=(), graphics_processes=(), mps_processes=())
            for m in card.mig_devices))
        for card in base.cards))
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, hidden, hidden_xml, listing)
    # 3594 MiB on 1000 and 7493 MiB on 1002; 17 and 9 MiB on the idle ones are below the threshold.
    assert _codes(report) == ["memory-without-processes", "memory-without-processes"]
    assert report.findings[0].message == "device 0/mig0 (1000) holds 3594 MiB but no process is listed"
    assert "hostPID: true" in report.findings[0].fix


def test_no_permission_on_mig_and_a_lost_card(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("one-lost-one-no-permission")
    report = diagnose(timed_read("nvml", NvmlSource().read),
                      PathReading("nvidia-smi", None, "nvidia-smi: not found on PATH", 0.0))
    assert _codes(report) == ["nvidia-smi-failed", "card-unreadable", "mig-no-permission"]
    assert "NVIDIA_MIG_MONITOR_DEVICES=all" in report.findings[2].fix
    assert "Xid" in report.findings[1].fix


def test_slow_nvidia_smi(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("h100-mig-processes")
    smi = fake_nvidia_smi(*_fixture("h100-mig-processes"), delay_s=0.3)
    report = diagnose(timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read),
                      slow_threshold_s=0.1)
    assert _codes(report) == ["nvidia-smi-slow"]
    assert "persistence mode" in report.findings[0].fix


def test_library_loads_but_no_device_is_visible(fake_nvml_lib, fake_nvidia_smi):
    empty = dataclasses.replace(SCENARIOS["demo"](), cards=())
    xml = (b'<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>550.90.07</driver_version>'
           b'<attached_gpus>0</attached_gpus></nvidia_smi_log>\n')
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, empty, xml, b"No devices were found\n")
    assert _codes(report) == ["no-devices", "no-devices"]
    assert "NVIDIA_VISIBLE_DEVICES" in report.findings[0].fix


def test_neither_path_available(fake_nvml_lib):
    import pynvml

    fake_nvml_lib(dataclasses.replace(SCENARIOS["demo"](), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    report = diagnose(timed_read("nvml", NvmlSource().read),
                      timed_read("nvidia-smi", NvidiaSmiSource("/nonexistent/nvidia-smi").read))
    assert _codes(report) == ["nvml-unavailable", "nvidia-smi-failed"]
    assert report.snapshot is None


def test_cli_text_output_shows_each_card_and_exits_0_without_warnings(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("h200-shared-gpu-instance")
    smi = fake_nvidia_smi(*_fixture("h200-shared-gpu-instance"))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "nvml: ok, 1 card(s), 5 device(s)" in out
    assert "nvidia-smi: ok, 1 card(s), 5 device(s)" in out
    assert "card 0: NVIDIA H200 GPU-68c6414c-e9da-201e-0c0d-1a0dc00f0e71 00000000:4C:00.0 - MIG current enabled, " \
           "pending enabled, 5 instance(s)" in out
    assert ("  device 0/mig1 (1001): MIG 2c.3g.71gb GI 1 CI 1 MIG-3134b65a-b3ad-5f32-a1cc-8fa650bdf659 - "
            "30210 MiB used of 71424 MiB") in out
    assert "    pid 7003 M+C /opt/tritonserver/bin/tritonserver 4096 MiB" in out
    assert out.rstrip().endswith("ok: 0 error(s), 0 warning(s) (exit 0)")


def test_cli_json_output_and_exit_1_on_warnings(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("a100-mig-nothing-carved")
    smi = fake_nvidia_smi(*_fixture("a100-mig-nothing-carved"))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi), "--format", "json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [r["source"] for r in doc["reads"]] == ["nvml", "nvidia-smi"] and all(r["ok"] for r in doc["reads"])
    assert [(w["code"], w["severity"]) for w in doc["warnings"]] == [("mig-nothing-carved", "error")]
    assert doc["exit_code"] == 1
    assert doc["cards"][0]["mig_instances"] == 0 and doc["cards"][0]["devices"] == []
    device = doc["cards"][1]["devices"][0]
    assert (device["index"], device["device"], device["mig_profile"], device["gpu_instance"]) == (
        1100, "1/mig0", "7g.40gb", 0)
    assert device["processes"] == [{"pid": 3301, "type": "C", "name": "/usr/bin/python3", "used_bytes": 4092 * 1048576}]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_cli_doctor_reports_a_missing_library_and_binary(fmt, fake_nvml_lib):
    import pynvml

    fake_nvml_lib(dataclasses.replace(SCENARIOS["demo"](), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", "/nonexistent/nvidia-smi", "--format", fmt])
    assert result.exit_code == 2, "nothing can be read"
    assert "nvml-unavailable" in result.stdout and "nvidia-smi-failed" in result.stdout


# --- exit codes: 0 one path reads and nothing is wrong, 1 an error, 2 nothing reads ----------

def test_a_node_that_reads_through_nvidia_smi_alone_passes_with_a_warning(fake_nvml_lib, fake_nvidia_smi):
    """docs/sources.md gates a node's readiness on doctor: a node without NVML still reads."""
    import pynvml

    scenario = SCENARIOS["h100-mig-processes"]()
    fake_nvml_lib(dataclasses.replace(scenario, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    smi = fake_nvidia_smi(*_fixture("h100-mig-processes"))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi)])
    assert result.exit_code == 0, result.output
    assert "WARNING [nvml-unavailable] NVML could not be read" in result.stdout
    assert result.stdout.rstrip().endswith("ok: 0 error(s), 1 warning(s) (exit 0)")


def test_a_node_that_reads_through_nvml_alone_passes_with_a_warning(fake_nvml_lib):
    fake_nvml_lib("h100-mig-processes")
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", "/nonexistent/nvidia-smi", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(w["code"], w["severity"]) for w in doc["warnings"]] == [("nvidia-smi-failed", "warning")]
    assert "/nonexistent/nvidia-smi: no such file" in doc["warnings"][0]["message"]


def test_a_slow_nvidia_smi_and_a_pending_reset_are_warnings_not_errors(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("a100-mig-pending")
    smi = fake_nvidia_smi(*_fixture("a100-mig-pending"), delay_s=0.3)
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi), "--slow-threshold", "0.1"])
    assert result.exit_code == 0, result.output
    assert "WARNING [nvidia-smi-slow]" in result.stdout and "WARNING [mig-reset-pending]" in result.stdout


def test_an_unreadable_card_is_an_error_even_when_both_paths_read(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("a100-mig-nothing-carved")
    smi = fake_nvidia_smi(*_fixture("a100-mig-nothing-carved"))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi)])
    assert result.exit_code == 1
    assert "ERROR [mig-nothing-carved]" in result.stdout
    assert result.stdout.rstrip().endswith("problems found: 1 error(s), 0 warning(s) (exit 1)")


def test_doctor_demo_shows_a_healthy_report_without_a_gpu():
    result = CliRunner().invoke(cli, ["doctor", "--demo"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("demo: ok, 2 card(s), 4 device(s) in ")
    assert "nvml" not in out, "the sample is nvidia-smi output; no NVML is read or blamed"
    assert ("  device 0/mig0 (1000): MIG 3g.40gb GI 2 CI 0 MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b - "
            "11663 MiB used of 40192 MiB") in out
    assert "    pid 50102 G /usr/local/bin/llama-server 20480 MiB" in out
    assert out.rstrip().endswith("ok: 0 error(s), 0 warning(s) (exit 0)")
    doc = json.loads(CliRunner().invoke(cli, ["doctor", "--demo", "--format", "json"]).stdout)
    assert doc["exit_code"] == 0 and doc["warnings"] == [] and [r["source"] for r in doc["reads"]] == ["demo"]
