"""`mig-exporter doctor`: each warning against a scenario, its fix, text and JSON output, exit codes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from click.testing import CliRunner

from conftest import FIXTURES, REPO, fixture_bytes
from fake_nvml import SCENARIOS, FakeNvmlScenario, without_mig_monitor
from mig_exporter.cli import cli
from mig_exporter.doctor import (
    NO_NVML_EVENTS,
    NO_XIDS_WITHOUT_NVML,
    Comparison,
    PathReading,
    XidWatch,
    as_json,
    compare,
    compare_paths,
    diagnose,
    render_text,
    timed_read,
    xid_watch,
)
from mig_exporter.model.capacity import GPU_ONLY, HostView
from mig_exporter.model.health import CardHealth, ClockReading, EccCount, Verdict, grade
from mig_exporter.model.snapshot import Card, Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource
from proc_tree import make_proc
from smi_variants import without_mig_monitor as without_mig_monitor_xml


def _doctor(fake_nvml_lib, fake_nvidia_smi, nvml_scenario, xml: bytes, listing: bytes, host: HostView = GPU_ONLY,
            **smi_options):
    fake_nvml_lib(nvml_scenario)
    smi = fake_nvidia_smi(xml, listing, **smi_options)
    return diagnose(timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read),
                    host=host)


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
    # Outside the host's PID namespace: the hint is hostPID.
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, hidden, hidden_xml, listing, HostView(host_pids=False))
    # 3594 MiB on 1000 and 7493 MiB on 1002; 17 and 9 MiB on the idle ones are an empty device's.
    assert _codes(report) == ["memory-without-processes", "memory-without-processes"]
    assert report.findings[0].message == ("device 0/mig0 (1000) holds 3594 MiB but no process is listed, so it is "
                                          "never counted free")
    assert "hostPID: true" in report.findings[0].fix
    # In it (every host process seen): a process the driver does not name, such as a vGPU VM.
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, hidden, hidden_xml, listing)
    assert _codes(report) == ["memory-without-processes", "memory-without-processes"]
    assert "does not name" in report.findings[0].fix and "hostPID" not in report.findings[0].fix


def test_no_permission_on_mig_and_a_lost_card(fake_nvml_lib, fake_nvidia_smi):
    """A MIG card whose read NVML refused names the monitor capability; a lost card, Xids."""
    fake_nvml_lib("one-lost-one-no-permission")
    report = diagnose(timed_read("nvml", NvmlSource().read),
                      PathReading("nvidia-smi", None, "nvidia-smi: not found on PATH", 0.0))
    assert _codes(report) == ["nvidia-smi-failed", "card-unreadable", "mig-monitor-missing"]
    assert report.findings[2].message.endswith(
        "the container lacks the MIG monitor capability; NVML refused it (NVML_ERROR_NO_PERMISSION in "
        "nvmlDeviceGetMaxMigDeviceCount): none of its instances or processes is read")
    assert "Xid" in report.findings[1].fix


# --- no MIG monitor capability (issue 35) --------------------------------------------------------
# The container has the GPUs but not /dev/nvidia-caps/nvidia-cap2, nor the access capability of
# any instance: what the real driver shows there is written, with its sources, in
# fake_nvml.without_mig_monitor (NVML) and smi_variants.without_mig_monitor (nvidia-smi).

NO_MONITOR_MESSAGE = (
    "card 0 (NVIDIA H100 80GB HBM3) is in MIG mode and the driver refuses this container its aggregate "
    "readings (memory: Insufficient Permissions): the container lacks the MIG monitor capability; no instance "
    "is seen, so whether none is carved or all are hidden cannot be told; its memory is hidden")


def _assert_monitor_fix(fix: str) -> None:
    assert "migMonitor.enabled=true" in fix and "adds SYS_ADMIN" in fix
    assert "-e NVIDIA_MIG_MONITOR_DEVICES=all --cap-add SYS_ADMIN" in fix
    assert "docs/mig-monitor.md" in fix


def test_nvml_without_the_monitor_capability_names_it_not_an_empty_card(fake_nvml_lib):
    import pynvml

    fake = fake_nvml_lib(without_mig_monitor(SCENARIOS["h100-mig-processes"]()))
    report = diagnose(timed_read("nvml", NvmlSource().read),
                      PathReading("nvidia-smi", None, "nvidia-smi: not found on PATH", 0.0))
    assert fake.exceptions == []
    assert _codes(report) == ["nvidia-smi-failed", "mig-monitor-missing"], "not mig-nothing-carved"
    finding = report.findings[1]
    assert (finding.message, finding.severity) == (NO_MONITOR_MESSAGE, "error")
    _assert_monitor_fix(finding.fix)
    card = report.snapshot.cards[0]
    assert (card.error, card.aggregate_denied, card.mig_current, card.mig_instances) == (None, True, True, 0)
    assert report.snapshot.devices == () and report.snapshot.processes == ()
    assert report.exit_code == 1
    # What the fake answered, as the driver does: the card's memory refused, every slot empty.
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
    assert pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 52


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_nvidia_smi_without_the_monitor_capability_on_a_real_a100(fmt, fake_nvml_lib, fake_nvidia_smi):
    """The real A100 capture (telegraf, driver 535.54.03, 4 instances) as the container prints it."""
    import pynvml

    from conftest import require_real_corpus

    real = (require_real_corpus() / "telegraf-a100-sxm4-80gb-mig-v12-drv535.xml").read_bytes()
    fake_nvml_lib(dataclasses.replace(SCENARIOS["demo"](), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    smi = fake_nvidia_smi(*without_mig_monitor_xml(real))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi), "--format", fmt])
    assert result.exit_code == 1, result.output
    message = ("card 0 (NVIDIA A100-SXM4-80GB) is in MIG mode and the driver refuses this container its aggregate "
               "readings (memory: Insufficient Permissions): the container lacks the MIG monitor capability; no "
               "instance is seen, so whether none is carved or all are hidden cannot be told; its memory is hidden")
    if fmt == "text":
        out = result.stdout
        assert f"ERROR [mig-monitor-missing] {message}\n      fix: give the container the MIG monitor" in out
        assert "[mig-nothing-carved]" not in out
        assert "MIG current enabled, pending enabled, 0 instance(s)" in out
        assert out.rstrip().endswith("problems found: 1 error(s), 1 warning(s) (exit 1)")
        return
    doc = json.loads(result.stdout)
    assert [(w["code"], w["severity"]) for w in doc["warnings"]] == [
        ("nvml-unavailable", "warning"), ("mig-monitor-missing", "error")]
    warning = doc["warnings"][1]
    assert warning["message"] == message
    _assert_monitor_fix(warning["fix"])
    assert (doc["cards"][0]["mig_instances"], doc["cards"][0]["devices"]) == (0, [])


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_both_paths_without_the_monitor_capability_agree(fmt, fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib(without_mig_monitor(SCENARIOS["h100-mig-processes"]()))
    smi = fake_nvidia_smi(*without_mig_monitor_xml(fixture_bytes("h100-mig-processes.xml")))
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi), "--format", fmt])
    assert result.exit_code == 1, result.output
    if fmt == "text":
        assert f"ERROR [mig-monitor-missing] {NO_MONITOR_MESSAGE}\n" in result.stdout
        assert "[paths-disagree]" not in result.stdout and "[mig-nothing-carved]" not in result.stdout
        assert result.stdout.rstrip().endswith("problems found: 1 error(s), 0 warning(s) (exit 1)")
        return
    doc = json.loads(result.stdout)
    assert [r["ok"] for r in doc["reads"]] == [True, True]
    assert [(w["code"], w["severity"], w["message"]) for w in doc["warnings"]] == [
        ("mig-monitor-missing", "error", NO_MONITOR_MESSAGE)]
    assert doc["exit_code"] == 1


def test_instances_seen_without_the_monitor_capability_are_counted_and_the_rest_called_hidden(
        fake_nvml_lib, fake_nvidia_smi):
    """A container started with its instances' access capabilities (the ``all`` of
    NVIDIA_VISIBLE_DEVICES gives those existing then) sees them, the card's memory still refused."""
    xml, listing = _fixture("h100-mig-processes")
    denied, _ = without_mig_monitor_xml(xml)
    card_memory = re.compile(rb"<fb_memory_usage>\s*<total>81559 MiB.*?</fb_memory_usage>", re.S)
    only_memory = card_memory.sub(re.search(rb"<fb_memory_usage>\s*<total>Insufficient.*?</fb_memory_usage>",
                                            denied, re.S).group(0), xml)
    assert only_memory != xml
    report = diagnose(None, timed_read("nvidia-smi", NvidiaSmiSource(str(fake_nvidia_smi(only_memory, listing))).read))
    assert _codes(report) == ["mig-monitor-missing"]
    assert report.findings[0].message.endswith(
        "the container lacks the MIG monitor capability; 4 instance(s) seen, those this container was given at "
        "its start; an instance made since, and the card's memory, are hidden")
    assert len(report.snapshot.devices) == 4


def test_a_card_with_the_monitor_capability_gets_no_such_finding(fake_nvml_lib, fake_nvidia_smi):
    from conftest import require_real_corpus

    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "h100-mig-processes", *_fixture("h100-mig-processes"))
    assert report.findings == ()
    assert [c.aggregate_denied for r in report.readings for c in r.snapshot.cards] == [False, False]
    real = (require_real_corpus() / "telegraf-a100-sxm4-80gb-mig-v12-drv535.xml").read_bytes()
    as_captured = diagnose(None, PathReading("nvidia-smi", snapshot_from_smi(real, None), None, 0.1))
    assert "mig-monitor-missing" not in _codes(as_captured)
    assert as_captured.snapshot.cards[0].mig_instances == 4


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


def test_doctor_demo_shows_the_sample_and_its_card_that_needs_a_reset_without_a_gpu():
    """The sample's whole A100 (card 1) has a pending row remap: doctor --demo exits 3 for it, on
    purpose, so the report shows what a card that needs a reset looks like (with its link at x4
    of x16, a warning beside it, whose fix follows the reset's). Card 0's instance 0/mig0 has an
    uncorrectable SRAM error (a warning), and card 0, in MIG mode, cannot report its remapped
    rows. No NVML, but the demo's kernel log: its XIDs are seen, and no note says otherwise."""
    result = CliRunner().invoke(cli, ["doctor", "--demo"])
    assert result.exit_code == 3, result.output
    out = result.stdout
    assert out.startswith("demo: ok, 2 card(s), 4 device(s) in ")
    assert "[nvml" not in out and "nvml:" not in out, "the sample is nvidia-smi output; no NVML is read or blamed"
    assert ("  device 0/mig0 (1000): MIG 3g.40gb GI 2 CI 0 MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b - "
            "11663 MiB used of 40192 MiB") in out
    assert "    pid 50102 G /usr/local/bin/llama-server 20480 MiB" in out
    assert ("  health: needs reset\n    - a row remap is pending: reset the card to apply it\n"
            "    - 1 uncorrectable ECC error(s) since the driver loaded\n"
            "    - PCIe link at x4 of x16\n") in out
    assert "  health: warning\n    - 1 uncorrectable ECC error(s) since the driver loaded\n" in out
    assert ("ERROR [card-needs-reset] card 1 (NVIDIA A100-SXM4-80GB) needs a reset: a row remap is pending: "
            "reset the card to apply it; 1 uncorrectable ECC error(s) since the driver loaded; "
            "PCIe link at x4 of x16\n") in out
    fix = next(line for line in out.splitlines() if line.startswith("      fix: drain its workloads"))
    assert fix.startswith("      fix: drain its workloads and reset it when idle (nvidia-smi -r -i 1)")
    assert "reseat the card" in fix and "nvidia-smi -q -d PCI -i 1" in fix
    assert "WARNING [card-health-warning] card 0 (NVIDIA A100-SXM4-80GB): 1 uncorrectable ECC error(s)" in out
    assert "NOTE [remapped-rows-unknown] card 0 (NVIDIA A100-SXM4-80GB) is in MIG mode: it cannot report" in out
    assert "XIDs 63 and 64 (row remapping) and 94 and 95" in out and "recovery action" in out
    # The demo reads its bundled kernel log: the XIDs are seen without NVML, and no note says otherwise.
    assert "xids-not-watched" not in out and "xids-kmsg-unreadable" not in out
    assert out.rstrip().endswith("a card needs a reset or replacing: 1 error(s), 1 warning(s) (exit 3)")
    doc = json.loads(CliRunner().invoke(cli, ["doctor", "--demo", "--format", "json"]).stdout)
    assert doc["exit_code"] == 3 and [r["source"] for r in doc["reads"]] == ["demo"]
    assert doc["kmsg"] == {"readable": True, "reason": None}
    assert [(w["code"], w["severity"]) for w in doc["warnings"]] == [
        ("card-health-warning", "warning"), ("card-needs-reset", "error")]
    assert [c["health"] for c in doc["cards"]] == [
        {"state": "warning", "label": "warning", "reasons": ["1 uncorrectable ECC error(s) since the driver loaded"],
         "codes": ["ecc_uncorrectable"], "remapped_rows_reported": False},
        {"state": "reset", "label": "needs reset", "reasons": [
            "a row remap is pending: reset the card to apply it",
            "1 uncorrectable ECC error(s) since the driver loaded",
            "PCIe link at x4 of x16"],
         "codes": ["row_remap_pending", "ecc_uncorrectable", "pcie_link_width"],
         "remapped_rows_reported": True},
    ]
    assert [n["code"] for n in doc["notes"]] == ["remapped-rows-unknown"]  # the XIDs come from the kernel log
    assert doc["xids"] == {"watching": False, "cards": 0, "reason": NO_NVML_EVENTS}


# --- card health: each state, its finding and the exit code -----------------------------------

def _graded(card: Card, health: CardHealth) -> Card:
    """``card`` with ``health``, graded as the snapshot grades it when it is built (its
    instances' own counts are cleared where this is used)."""
    return dataclasses.replace(card, health=health, verdict=None if card.error else grade(health))


def _with_health(name: str, **health) -> Snapshot:
    """The scenario with its first card's health replaced (the others' cleared)."""
    from conftest import scenario

    snapshot = scenario(name)
    cards = tuple(_graded(c, CardHealth(**(health if i == 0 else {}))) for i, c in enumerate(snapshot.cards))
    devices = tuple(dataclasses.replace(d, ecc_errors=()) for d in snapshot.devices)
    return dataclasses.replace(snapshot, cards=cards, devices=devices)


def _diagnose(snapshot: Snapshot):
    return diagnose(None, PathReading("nvidia-smi", snapshot, None, 0.1))


@pytest.mark.parametrize(("health", "code", "severity", "exit_code", "reasons"), [
    ({}, None, None, 0, []),
    ({"row_remap_failure": True}, "card-needs-replacing", "error", 3,
     ["row remapping failed: the card has no spare rows left for a failing bank"]),
    ({"retired_pages_pending": True}, "card-needs-reset", "error", 3,
     ["a page retirement is pending: reset the card to apply it"]),
    ({"recovery_action": 2}, "card-needs-reset", "error", 3, ["the driver advises a node reboot"]),
    ({"clock_events_active": (("hw_thermal_slowdown", True), ("hw_power_brake_slowdown", True))},
     "card-health-warning", "warning", 0,
     ["clocks held down: hw thermal slowdown", "clocks held down: hw power brake slowdown"]),
    ({"ecc_errors": (EccCount("volatile", "dram", "uncorrectable", 2),)}, "card-health-warning", "warning", 0,
     ["2 uncorrectable ECC error(s) since the driver loaded"]),
])
def test_each_health_state_is_a_finding_with_its_reasons_and_exit_code(health, code, severity, exit_code, reasons):
    report = _diagnose(_with_health("a100-mig-pending", **health))
    found = [f for f in report.findings if f.code.startswith("card-")]
    assert [(f.code, f.severity) for f in found] == ([(code, severity)] if code else [])
    for reason in reasons:
        assert reason in found[0].message
    assert [f.code for f in report.findings if not f.code.startswith("card-")] == ["mig-reset-pending"]
    assert report.exit_code == exit_code


def test_the_fix_follows_the_reason():
    hot = _diagnose(_with_health("a100-mig-pending", clock_events_active=(("hw_thermal_slowdown", True),)))
    assert "cooling" in next(f for f in hot.findings if f.code == "card-health-warning").fix
    failed = _diagnose(_with_health("a100-mig-pending", row_remap_failure=True))
    assert "replaced (RMA)" in next(f for f in failed.findings if f.code == "card-needs-replacing").fix


def test_doctor_shows_the_grade_the_snapshot_made_and_grades_nothing_again():
    """One grade per card and snapshot (issue 37): the card's ``verdict``, which the families and
    the page show too. Here its health reads fine and its grade says replace: doctor says replace."""
    snapshot = _with_health("a100-mig-pending")
    made = Verdict("replace", ("the driver reports memory it cannot repair",), ("unrepairable_memory",), ("replace",))
    report = _diagnose(dataclasses.replace(snapshot, cards=(
        dataclasses.replace(snapshot.cards[0], verdict=made), *snapshot.cards[1:])))
    [found] = [f for f in report.findings if f.code.startswith("card-")]
    assert (found.code, found.message) == (
        "card-needs-replacing", "card 0 (NVIDIA A100-SXM4-80GB) needs replacing: the driver reports memory it "
        "cannot repair")
    assert report.exit_code == 3
    assert as_json(report)["cards"][0]["health"]["codes"] == ["unrepairable_memory"]
    assert "  health: replace\n    - the driver reports memory it cannot repair" in render_text(report)


def test_an_advice_this_exporter_does_not_know_is_a_warning_that_says_so():
    report = _diagnose(_with_health("a100-mig-pending", recovery_action_unknown="Reset Fabric"))
    [found] = [f for f in report.findings if f.code.startswith("card-")]
    assert (found.code, found.severity) == ("card-health-warning", "warning")
    assert found.message.endswith(": the driver advises an action this exporter does not know")
    assert "GPU Recovery Action" in found.fix and "treat it as a reset" in found.fix


def test_a_real_l4_at_x1_of_x16_is_a_warning_with_the_fix_for_a_link():
    """A real capture (tests/fixtures/nvidia-smi-real/SOURCES.md): card 1's link trained to one
    lane of sixteen. Not an error: the card works, slowly (exit 0)."""
    xml = (FIXTURES.parent / "nvidia-smi-real" / "datarhei-2x-l4-x1-link-v12-drv555.xml").read_bytes()
    report = _diagnose(snapshot_from_smi(xml, None))
    assert [(f.code, f.message) for f in report.findings] == [
        ("card-health-warning", "card 1 (NVIDIA L4): PCIe link at x1 of x16")]
    assert "reseat the card" in report.findings[0].fix and "nvidia-smi -q -d PCI -i 1" in report.findings[0].fix
    assert report.exit_code == 0
    assert "card 0: NVIDIA L4" in render_text(report) and "  health: ok" in render_text(report)


def test_a_card_that_needs_a_reset_comes_before_another_error_and_nothing_read_before_both():
    """3 before 1: a node with a MIG card with nothing carved (an error) and a card whose recovery
    action is a GPU reset exits 3; an unreadable card has no health at all."""
    snapshot = _with_health("a100-mig-nothing-carved")
    cards = (snapshot.cards[0], _graded(snapshot.cards[1], CardHealth(recovery_action=1)))
    report = _diagnose(dataclasses.replace(snapshot, cards=cards))
    assert [f.code for f in report.findings] == ["mig-nothing-carved", "card-needs-reset"]
    assert report.exit_code == 3
    lost = dataclasses.replace(cards[1], error="GPU is lost", verdict=None)
    report = _diagnose(dataclasses.replace(snapshot, cards=(cards[0], lost)))
    assert [f.code for f in report.findings] == ["mig-nothing-carved", "card-unreadable"]
    assert report.exit_code == 1
    assert as_json(report)["cards"][1]["health"] is None
    assert diagnose(None, PathReading("nvidia-smi", None, "no", 0.1)).exit_code == 2


def test_a_mig_card_without_remapped_rows_gets_a_note_naming_what_still_covers_it():
    mig = _diagnose(_with_health("a100-mig-nothing-carved"))
    notes = [n for n in mig.notes if n.code == "remapped-rows-unknown"]
    assert [n.message.split(" (")[0] for n in notes] == ["card 0", "card 1"]
    assert all(n.severity == "note" for n in mig.notes) and mig.exit_code == 1  # notes count for nothing
    for signal in ("XIDs 63 and 64", "94 and 95", "recovery action", "mig_exporter_device_ecc_errors_total"):
        assert signal in notes[0].fix
    assert "remapped rows: not reported in MIG mode" in render_text(mig)
    known = _diagnose(_with_health("a100-mig-nothing-carved", remapped_rows_correctable=0,
                                   remapped_rows_uncorrectable=0, row_remap_pending=False))
    assert [n.message.split(" (")[0] for n in known.notes if n.code == "remapped-rows-unknown"] == ["card 1"]
    whole = _diagnose(_with_health("a100-mig-pending"))  # MIG pending, not current
    assert [n.code for n in whole.notes] == ["xids-not-watched"]


# --- XIDs: watched through NVML, or why not -----------------------------------------------------

def test_xids_not_watched_on_nvml_say_the_watchers_reason(fake_nvml_lib, fake_nvidia_smi):
    fake_nvml_lib("h100-mig-processes")
    smi = fake_nvidia_smi(*_fixture("h100-mig-processes"))
    nvml, smi_read = timed_read("nvml", NvmlSource().read), timed_read("nvidia-smi", NvidiaSmiSource(str(smi)).read)
    report = diagnose(nvml, smi_read, xids=XidWatch(False, 0, "nvmlDeviceRegisterEvents: NOT_SUPPORTED on card 0"))
    assert [(n.code, n.message) for n in report.notes if n.code == "xids-not-watched"] == [
        ("xids-not-watched", "NVML's XID events cannot be watched: nvmlDeviceRegisterEvents: NOT_SUPPORTED on card 0")]
    watched = diagnose(nvml, smi_read, xids=XidWatch(True, 1, None))
    assert [n.code for n in watched.notes if n.code == "xids-not-watched"] == []
    assert "XIDs: watched through NVML events on 1 card(s)" in render_text(watched)
    assert as_json(watched)["xids"] == {"watching": True, "cards": 1, "reason": None}


def test_the_xid_watcher_is_asked_lazily_and_its_absence_is_a_reason(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "mig_exporter.sources.xid", None)  # as if not built
    absent = xid_watch()
    assert not absent.watching and "no XID watcher" in (absent.reason or "")
    module = types.ModuleType("mig_exporter.sources.xid")
    module.xid_watch_status = lambda: types.SimpleNamespace(watching=True, cards=2, reason=None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mig_exporter.sources.xid", module)
    assert xid_watch() == XidWatch(True, 2, None)

    def broken():
        raise RuntimeError("event set")

    module.xid_watch_status = broken  # type: ignore[attr-defined]
    assert xid_watch() == XidWatch(False, 0, "the XID watcher failed: RuntimeError: event set")


# --- the two paths' health compared ----------------------------------------------------------

def test_compare_reports_health_differences_but_not_nvml_only_or_moving_readings():
    base = _with_health("a100-mig-pending", ecc_errors=(EccCount("volatile", "dram", "uncorrectable", 1),),
                        recovery_action=0, energy_joules=10.0, clocks=(ClockReading("sm", "current", 1e9),),
                        pcie_link_generation_current=4)
    other = dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], health=CardHealth(
        ecc_errors=(EccCount("volatile", "dram", "uncorrectable", 0),), recovery_action=0,
        clocks=(ClockReading("sm", "current", 1.4e9),), pcie_link_generation_current=1)),))
    assert compare(base, other) == ["card 0 ecc volatile dram uncorrectable: 1 vs 0"]
    # energy_joules is NVML's alone by design (docs/metrics.md): not even a note.
    assert compare_paths(base, other).one_path_only == ()
    pending = dataclasses.replace(other, cards=(dataclasses.replace(other.cards[0], health=dataclasses.replace(
        base.cards[0].health, row_remap_pending=True, energy_joules=None)),))
    assert compare(base, pending) == []
    assert compare_paths(base, pending).one_path_only == ("card 0 row_remap_pending (nvidia-smi only)",)
    not_pending = dataclasses.replace(pending, cards=(dataclasses.replace(pending.cards[0], health=dataclasses.replace(
        pending.cards[0].health, row_remap_pending=False)),))
    assert compare(not_pending, pending) == ["card 0 row_remap_pending: False vs True"]


def test_an_advice_neither_path_knows_is_agreement_however_each_words_it():
    base = _with_health("a100-mig-pending", recovery_action_unknown="Reset Fabric")
    other = dataclasses.replace(base, cards=(
        dataclasses.replace(base.cards[0], health=CardHealth(recovery_action_unknown="8")), *base.cards[1:]))
    assert compare_paths(base, other) == Comparison()
    known = dataclasses.replace(base, cards=(
        dataclasses.replace(base.cards[0], health=CardHealth(recovery_action=1)), *base.cards[1:]))
    assert compare_paths(base, known).one_path_only == (
        "card 0 recovery_action (nvidia-smi only)", "card 0 recovery_action_unknown (NVML only)")


def test_a_mig_instances_own_count_differs_only_where_both_paths_give_it():
    from conftest import scenario

    mig = scenario("h100-mig-processes")

    def sram(snapshot: Snapshot, counts: tuple[EccCount, ...]) -> Snapshot:
        return dataclasses.replace(snapshot, devices=tuple(
            dataclasses.replace(d, ecc_errors=counts if d.index == 1002 else ()) for d in snapshot.devices))

    one, zero = (EccCount("volatile", "sram", "uncorrectable", 1),), (EccCount("volatile", "sram", "uncorrectable", 0),)
    assert compare(sram(mig, one), sram(mig, zero)) == ["device 0/mig2 (1002) ecc volatile sram uncorrectable: 1 vs 0"]
    absent = compare_paths(sram(mig, zero), sram(mig, ()))
    assert absent == Comparison((), ("device 0/mig2 (1002) ecc volatile sram uncorrectable (NVML only)",))


def test_a_value_one_path_gives_and_the_other_leaves_unknown_is_not_compared():
    from conftest import scenario

    serial = scenario("h100-mig-processes")
    assert serial.cards[0].serial == "1654123056789"  # the XML's <serial>
    a = dataclasses.replace(serial, cards=tuple(dataclasses.replace(c, serial=None) for c in serial.cards))
    unused = dataclasses.replace(a, devices=tuple(dataclasses.replace(d, memory=d.memory._replace(used_bytes=None))
                                                  for d in a.devices))
    assert compare_paths(serial, a) == Comparison((), ("card 0 serial (NVML only)",))
    assert compare(a, unused) == [] and compare_paths(a, unused).one_path_only[0] == (
        "device 0/mig0 (1000) memory used (NVML only)")
    other_serial = dataclasses.replace(serial, cards=tuple(dataclasses.replace(c, serial="1") for c in a.cards))
    assert compare(serial, other_serial) == ["card 0 serial: '1654123056789' vs '1'"]


def _without_thresholds_or_instance_counts() -> FakeNvmlScenario:
    """h100-mig-processes as an NVML that gives no temperature thresholds and no MIG instance's
    own SRAM count, where the XML gives the thresholds and a count of 0 for every instance."""
    base = SCENARIOS["h100-mig-processes"]()
    card = base.cards[0]
    return dataclasses.replace(base, cards=(dataclasses.replace(
        card, health=dataclasses.replace(card.health, thresholds_c={}),
        mig_devices=tuple(dataclasses.replace(m, sram_uncorrectable_volatile=None) for m in card.mig_devices)),))


def test_a_healthy_node_whose_paths_differ_only_in_what_one_reports_passes(fake_nvml_lib, fake_nvidia_smi):
    """Issue 37: doctor called such a node broken (paths-disagree, exit 1). Only values both paths
    give are compared; the rest is a note."""
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, _without_thresholds_or_instance_counts(),
                     *_fixture("h100-mig-processes"))
    assert report.findings == () and report.exit_code == 0
    [note] = [n for n in report.notes if n.code == "one-path-only"]
    assert note.severity == "note"
    assert note.message.startswith("values one path gives and the other does not, not compared: ")
    for line in ("card 0 temperature_thresholds_celsius max_operating (nvidia-smi only); ",
                 "card 0 temperature_thresholds_celsius slowdown (nvidia-smi only); ",
                 "device 0/mig0 (1000) ecc volatile sram uncorrectable (nvidia-smi only)"):
        assert line in note.message
    text = render_text(report)
    assert "NOTE [one-path-only] values one path gives" in text and "[paths-disagree]" not in text
    assert text.rstrip().endswith("ok: 0 error(s), 0 warning(s) (exit 0)")
    assert [n["code"] for n in as_json(report)["notes"]].count("one-path-only") == 1


def test_a_value_both_paths_give_and_differ_on_is_still_an_error(fake_nvml_lib, fake_nvidia_smi):
    xml, listing = _fixture("h100-mig-processes")
    hotter = xml.replace(b"<gpu_temp_slow_threshold>89 C<", b"<gpu_temp_slow_threshold>85 C<", 1)
    assert hotter != xml
    report = _doctor(fake_nvml_lib, fake_nvidia_smi, "h100-mig-processes", hotter, listing)
    assert _codes(report) == ["paths-disagree"] and report.exit_code == 1
    assert "card 0 temperature_thresholds_celsius slowdown: 89.0 vs 85.0" in report.findings[0].message


def test_a_whole_card_the_process_may_not_open_is_a_permission_finding_not_a_lost_card():
    """NO_PERMISSION on a card not in MIG mode is the device node's permission, not the card's
    fault: no Xid or reset advice; the same for a card whose memory nvidia-smi says is refused."""
    snapshot = _with_health("a100-mig-nothing-carved")
    whole = dataclasses.replace(snapshot.cards[1], mig_current=False, mig_pending=False,
                                error="NVML_ERROR_NO_PERMISSION in nvmlDeviceGetMemoryInfo")
    report = _diagnose(dataclasses.replace(snapshot, cards=(snapshot.cards[0], whole)))
    assert [f.code for f in report.findings] == ["mig-nothing-carved", "card-no-permission"]
    assert report.findings[1].fix.startswith("the exporter may not open /dev/nvidia1")
    assert "Xid" not in report.findings[1].fix
    refused = dataclasses.replace(snapshot.cards[1], mig_current=False, mig_pending=False, aggregate_denied=True)
    report = _diagnose(dataclasses.replace(snapshot, cards=(snapshot.cards[0], refused)))
    assert [f.code for f in report.findings] == ["mig-nothing-carved", "card-no-permission"]
    assert report.findings[1].message.endswith("the driver refuses this process the card's memory "
                                               "(Insufficient Permissions)")


# --- allocations: doctor reads them as status does -----------------------------------------------

H200_MIG3 = "MIG-9a4496e0-ed7a-5fce-aa86-dc3f3464849a"  # 0/mig3, a 1g.18gb with no process: free


def _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path, *args: str):
    """doctor on the H200 node (two empty 1g.18gb) through both paths, seeing the host's PIDs."""
    fake_nvml_lib("h200-shared-gpu-instance")
    smi = fake_nvidia_smi(*_fixture("h200-shared-gpu-instance"))
    proc = make_proc(tmp_path / "proc", [])
    result = CliRunner().invoke(cli, ["doctor", "--nvidia-smi", str(smi), "--proc.root", str(proc),
                                      "--kubelet.pod-resources-socket", str(tmp_path / "no.sock"), *args])
    return result


def _states(doc) -> dict[str, tuple[str, str]]:
    return {d["device"]: (d["state"], d["reason"]) for c in doc["cards"] for d in c["devices"]}


def test_doctor_counts_a_slurm_job_s_empty_device_in_use_as_status_does(fake_nvml_lib, fake_nvidia_smi, tmp_path):
    job_map = tmp_path / "job-map"
    job_map.mkdir()
    (job_map / H200_MIG3).write_text("4242\n")
    result = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path, "--slurm.job-map-dir", str(job_map),
                         "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert all(r["ok"] for r in doc["reads"])  # NVML's snapshot is the one shown, its allocations read
    states = _states(doc)
    assert states["0/mig3"] == ("in_use", "allocated to Slurm job 4242 (no process yet)")
    assert states["0/mig4"][0] == "free"
    one_g = next(c for c in doc["classes"] if c["class"] == "h200-141g-mig-1g.18gb")
    assert (one_g["devices"], one_g["free"], one_g["in_use"], one_g["unknown"]) == (2, 1, 1, 0)
    assert doc["warnings"] == []
    text = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path / "text", "--slurm.job-map-dir", str(job_map)).stdout
    assert "2 \u00d7 h200-141g-mig-1g.18gb (1 free)\n" in text
    assert "not read here" not in text


def test_doctor_says_why_allocations_read_in_part_leave_no_empty_device_free(fake_nvml_lib, fake_nvidia_smi,
                                                                              tmp_path):
    job_map = tmp_path / "job-map"
    job_map.mkdir()
    (job_map / "0").write_bytes(b"4242\n\xff\n")  # card 0's file, not UTF-8: its jobs are unknown
    result = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path, "--slurm.job-map-dir", str(job_map),
                         "--format", "json")
    assert result.exit_code == 0, result.output  # a warning: the numbers are not wrong, only unknown
    doc = json.loads(result.stdout)
    assert _states(doc)["0/mig3"] == ("unknown", "the device allocations could not be read (kubelet or Slurm job map)")
    assert next(c for c in doc["classes"] if c["class"] == "h200-141g-mig-1g.18gb")["free"] == 0
    (warning,) = doc["warnings"]
    assert (warning["code"], warning["severity"]) == ("allocations-unknown", "warning")
    assert warning["message"] == ("the device allocations could not all be read, so no empty device counts free: "
                                  "slurm job map file '0': not UTF-8 text (byte 5)")


def test_doctor_in_a_pod_without_the_kubelet_socket_counts_no_empty_device_free(fake_nvml_lib, fake_nvidia_smi,
                                                                                tmp_path, monkeypatch):
    outside = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path / "outside", "--format", "json")
    assert _states(json.loads(outside.stdout))["0/mig3"][0] == "free"  # no socket, no pod: not on Kubernetes
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    result = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path / "in-pod", "--format", "json")
    doc = json.loads(result.stdout)
    assert {state for state, _ in _states(doc).values() if state != "in_use"} == {"unknown"}
    (warning,) = doc["warnings"]
    assert warning["code"] == "allocations-unknown" and "KUBERNETES_SERVICE_HOST is set" in warning["message"]
    # --no-kubernetes: the operator's word that no kubelet is to be asked.
    off = _doctor_cli(fake_nvml_lib, fake_nvidia_smi, tmp_path / "off", "--no-kubernetes", "--format", "json")
    assert _states(json.loads(off.stdout))["0/mig3"][0] == "free"


def test_a_kernel_log_that_cannot_be_read_is_said_with_what_to_do():
    """No /dev/kmsg to read (no mount, or no right to open it): one note, with the fix; the XIDs
    then come only from NVML's events, and none come on the nvidia-smi path."""
    demo = (REPO / "src" / "mig_exporter" / "samples" / "demo.xml").read_bytes()
    report = diagnose(None, PathReading("nvidia-smi", snapshot_from_smi(demo, None), None, 0.1),
                      kmsg=(False, "cannot read /dev/kmsg: Operation not permitted"))
    notes = {f.code: f for f in report.notes}
    assert notes["xids-kmsg-unreadable"].message == (
        "the kernel's log cannot be read: cannot read /dev/kmsg: Operation not permitted")
    assert "securityContext.privileged: true" in notes["xids-kmsg-unreadable"].fix
    assert notes["xids-not-watched"].message == NO_XIDS_WITHOUT_NVML
    assert report.exit_code == 3  # a note changes no exit code: the demo's card 1 needs a reset
