"""NVML's field ids and enum values per driver header (sources/nvml_header.py).

The numbers are nvml.h's, per driver branch; these tests hold the moves issue 37 names (the clock-event
counters absent in 570, at 251-253 in 575 and 580.65, at 269-271 from 580.82 and 590 with 251 back
to power smoothing; the recovery-action enum growing in 610 and 615) and check each table against the pynvml
that is installed, whose constants are its own release's header: scripts/test runs this file with the
newest nvidia-ml-py and with the lowest pyproject.toml allows.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import version

import pynvml
import pytest

import fake_nvml
from mig_exporter.model.health import RecoveryAction
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.sources.nvml_header import HEADERS, driver_branch, header_for

COUNTERS = ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN")


@pytest.mark.parametrize(("answer", "branch"), [
    ("12.570.86", 570), ("13.580.65.06", 580), (b"13.590.44", 590), ("570.86.15", 570), ("", None), (None, None),
    ("unknown", None),
])
def test_the_driver_branch_is_read_from_nvml_s_version(answer, branch):
    assert driver_branch(answer) == branch


@pytest.mark.parametrize(("nvml_version", "counters", "at_251"), [
    ("12.570.86", (None, None, None), "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("12.575.51", (251, 252, 253), "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    ("13.580.65", (251, 252, 253), "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    ("13.580.65.06", (251, 252, 253), "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    # 580.82 (CUDA 13.0 Update 1, "v580 TRD2") renumbered them within the branch: NVML's known issues,
    # and nvidia-ml-py 13.580.82's pynvml.py (269) against 13.580.65's (251).
    ("13.580.82.07", (269, 270, 271), "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("580.126.09", (269, 270, 271), "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("13.590.44", (269, 270, 271), "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("13.595.45", (269, 270, 271), "NVML_FI_PWR_SMOOTHING_ENABLED"),
    ("13.615.71", (269, 270, 271), "NVML_FI_PWR_SMOOTHING_ENABLED"),
])
def test_the_clock_event_counters_are_where_the_driver_s_header_puts_them(nvml_version, counters, at_251):
    header = header_for(nvml_version)
    assert tuple(header.field_id(name) for name in COUNTERS) == counters
    assert [name for name, fid in header.fields.items() if fid == 251] == [at_251]


def test_the_fields_that_never_moved_are_in_every_header():
    for header in HEADERS:
        assert (header.field_id("NVML_FI_DEV_MEMORY_TEMP"), header.field_id("NVML_FI_DEV_PERF_POLICY_POWER"),
                header.field_id("NVML_FI_DEV_ECC_DBE_VOL_DEV"), header.field_id("NVML_FI_DEV_REMAPPED_PENDING")) == (
            82, 74, 12, 144), header.branch


def test_the_recovery_action_enum_grows_with_the_header():
    names = {branch: dict(header_for(f"13.{branch}.1").recovery_actions) for branch in (550, 570, 580, 590, 610, 615)}
    assert names[550] == {}  # no recovery action before 570: the reset flags stand in
    assert names[570] == names[580] == names[590] == {
        0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P", 4: "DRAIN_AND_RESET"}
    assert names[610] == {**names[590], 5: "RECOVER_IMEX_DOMAIN"}
    assert names[615] == {**names[610], 6: "BUS_RESET", 7: "SYSTEM_REBOOT"}
    # Every name a header gives is one of ours, and ours number them as NVML does.
    for header in HEADERS:
        for number, name in header.recovery_actions.items():
            assert RecoveryAction[name] == number


@pytest.mark.parametrize(("nvml_version", "branch"), [
    ("13.999.1", 615),  # newer than every table: the newest
    ("12.560.35", 560), ("12.565.57", 560),  # between two: the older one's
    ("11.470.256", 535), (None, 535), ("garbled", 535),  # older, or unknown: the oldest, without the moved fields
])
def test_a_driver_without_a_table_of_its_own_gets_the_nearest_older_one(nvml_version, branch):
    header = header_for(nvml_version)
    assert header.branch == branch
    if branch == 535:
        assert all(header.field_id(name) is None for name in COUNTERS)
        assert header.field_id("NVML_FI_PWR_SMOOTHING_ENABLED") is None


def test_the_header_of_the_installed_binding_s_branch_agrees_with_its_constants():
    # nvidia-ml-py's release names the header it was made from ("13.615.71": 615's, "12.535.161": 535's).
    header = header_for(version("nvidia-ml-py"))
    compared = 0
    for name, fid in header.fields.items():
        if hasattr(pynvml, name):
            assert getattr(pynvml, name) == fid, name
            compared += 1
    for number, name in header.recovery_actions.items():
        if hasattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name}"):
            assert getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{name}") == number, name
    assert compared >= 20


@pytest.mark.parametrize(("driver", "seconds"), [("580.65.06", 0.25), ("580.82.07", 0.25)])
def test_a_580_driver_reads_its_own_release_s_counters(fake_nvml_lib, driver, seconds):
    """The same branch, two numberings: each fake driver answers at its own release's ids, and the
    exporter reads sw_thermal_slowdown's 0.25 s from either, whatever pynvml is installed."""
    h100 = fake_nvml.h100_r570_sram_split()
    fake_nvml_lib(dataclasses.replace(h100, driver_version=driver))
    (card,) = NvmlSource().read().cards
    assert dict(card.health.clock_event_seconds)["sw_thermal_slowdown"] == seconds
