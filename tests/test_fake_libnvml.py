"""The NVML path through a real shared library: the C fake libnvidia-ml.so.1 (tests/fake_libnvml/).

The exporter runs unmodified in a process of its own, loading our library where it asks for
``libnvidia-ml.so.1`` (``LD_LIBRARY_PATH``), so pynvml's real ctypes calls cross a real C ABI:
struct layouts, handle pointers, the size-query protocol, a call that never returns.
"""

from __future__ import annotations

import ctypes
import dataclasses
import http.client
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner

import fake_nvml
import mig_exporter
from benchmarks import scenarios as bench
from conftest import fixture_bytes
from fake_nvml import (
    _SIGNATURES,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    RETIRED_AT,
    SCENARIOS,
    FakeHealth,
    FakeNvmlScenario,
    fake_field_ids,
    field_answers,
)
from fake_nvml_c import SONAME, scenario_text
from mig_exporter.cli import cli
from test_source_nvml import NO_RECOVERY_FIELD, RECOVERY_LINES, without_volatile

PACKAGE_ROOT = str(Path(mig_exporter.__file__).resolve().parent.parent)
FIXTURE_SCENARIOS = ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved",
                     "a100-mig-pending", "na-memory"]
BENCH_SHAPES = {s.name: s for s in bench.MAIN_SHAPES}

# pynvml's ctypes classes and the C struct of nvml.h each stands for.
LAYOUTS = {
    "nvmlMemory_t": pynvml.c_nvmlMemory_t,
    "nvmlMemory_v2_t": pynvml.c_nvmlMemory_v2_t,
    "nvmlProcessInfo_t": pynvml.c_nvmlProcessInfo_v3_t,
    "nvmlPciInfo_t": pynvml.nvmlPciInfo_t,
    "nvmlUtilization_t": pynvml.c_nvmlUtilization_t,
    "nvmlTemperature_v1_t": pynvml.c_nvmlTemperature_v1_t,
    "nvmlFieldValue_t": pynvml.c_nvmlFieldValue_t,
    "nvmlProcessUtilizationSample_t": pynvml.c_nvmlProcessUtilizationSample_t,
    "nvmlMarginTemperature_v1_t": pynvml.c_nvmlMarginTemperature_v1_t,
    "nvmlEccSramErrorStatus_v1_t": pynvml.c_nvmlEccSramErrorStatus_v1_t,
    "nvmlRowRemapperHistogramValues_t": pynvml.c_nvmlRowRemapperHistogramValues,
    "nvmlRepairStatus_v1_t": pynvml.c_nvmlRepairStatus_t,
    "nvmlGpmSupport_t": pynvml.c_nvmlGpmSupport_t,
    "nvmlGpmMetric_t": pynvml.c_nvmlGpmMetric_t,
    "nvmlGpmMetricInfo_t": pynvml.c_metricInfo_t,
}
# Structs compared field by field but not in size: nvmlGpmMetricsGet_t's metrics array is as long as
# each binding's NVML_GPM_METRIC_MAX (210 in nvidia-ml-py 13.580.65, 477 in 13.615.71).
FIELDS_ONLY = {"nvmlGpmMetricsGet_t": pynvml.c_nvmlGpmMetricsGet_t}
# The version words, enum bounds and field ids the library checks or answers from, as pynvml has them
# (and RETIRED_AT, the Python fake's timestamp of the first retired page).
CONSTANTS = {
    **{name: getattr(pynvml, name) for name in (
        "nvmlMemory_v2", "nvmlTemperature_v1", "nvmlMarginTemperature_v1", "nvmlEccSramErrorStatus_v1",
        "nvmlRepairStatus_v1", "NVML_CLOCK_COUNT", "NVML_TEMPERATURE_THRESHOLD_COUNT", "NVML_MEMORY_LOCATION_COUNT",
        "NVML_MEMORY_LOCATION_SRAM", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC",
        "NVML_PAGE_RETIREMENT_CAUSE_COUNT", "NVML_VALUE_TYPE_UNSIGNED_INT", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER", "NVML_GPM_SUPPORT_VERSION", "NVML_GPM_METRICS_GET_VERSION")},
    "RETIRED_AT": RETIRED_AT,
}


class ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t, which pynvml no longer defines (tests/fake_nvml.py's)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _read(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mig_exporter", "read", *args], env=_env(env),
                          capture_output=True, text=True, timeout=120)


def _sample(text: str, prefix: str) -> str | None:
    return next((line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(prefix + " ")), None)


# -- the library itself ----------------------------------------------------------


def _layouts(library: Path, names: list[str]) -> dict[str, int]:
    """``fakeNvmlLayout`` of each name, asked in a process of its own: a library loaded here would
    answer every later ``CDLL("libnvidia-ml.so.1")`` of this test process by its soname."""
    code = ("import ctypes, json, sys\n"
            "lib = ctypes.CDLL(sys.argv[1])\n"
            "lib.fakeNvmlLayout.restype = ctypes.c_long\n"
            "lib.fakeNvmlLayout.argtypes = [ctypes.c_char_p]\n"
            "print(json.dumps({n: lib.fakeNvmlLayout(n.encode()) for n in sys.argv[2:]}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(library), *names], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return {k: int(v) for k, v in json.loads(out).items()}


def test_every_struct_has_nvml_h_layout_as_pynvml_declares_it(fake_libnvml_dir):
    classes = {**LAYOUTS, "nvmlProcessInfo_v1_t": ProcessInfoV1}
    expected = dict(CONSTANTS)
    for c_name, cls in {**classes, **FIELDS_ONLY}.items():
        if c_name not in FIELDS_ONLY:
            expected[c_name] = ctypes.sizeof(cls)
        for field_name, *_ in cls._fields_:
            expected[f"{c_name}.{field_name}"] = getattr(cls, field_name).offset
    assert len(expected) == 18 + 16 + 76  # the constants, sixteen structs sized, every field
    assert _layouts(fake_libnvml_dir / SONAME, list(expected)) == expected
    assert expected["nvmlMemory_v2"] == 0x02000028
    assert expected["nvmlEccSramErrorStatus_v1_t"] == 104  # version, eleven 64-bit counters, the flag


def test_it_exports_every_function_the_python_fake_serves(fake_libnvml_dir):
    """The Python fake's list is what our exporter and nvitop-exporter's update call."""
    exported = subprocess.run(["nm", "-D", "--defined-only", str(fake_libnvml_dir / SONAME)],
                              capture_output=True, text=True, check=True).stdout
    symbols = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert set(_SIGNATURES) <= symbols
    assert {s for s in symbols if s.startswith("nvml")} == set(_SIGNATURES)


def test_the_scenario_file_keeps_odd_strings_and_refuses_what_a_library_cannot_do():
    base = SCENARIOS["h100-mig-processes"]()
    odd = dataclasses.replace(base, process_names={21180: "my job 100%", 21198: "caf\udce9"})
    text = scenario_text(odd)
    assert "process_name 21180 my%20job%20100%25\n" in text
    assert "process_name 21198 caf%E9\n" in text  # the raw byte of a name that is not UTF-8
    with pytest.raises(ValueError, match="missing_functions"):
        scenario_text(dataclasses.replace(base, missing_functions=frozenset({"nvmlDeviceGetMemoryInfo_v2"})))
    with pytest.raises(ValueError, match=r"\(0, 9\)"):
        scenario_text(base, grow={(0, 9): 5})


# -- card health: the same answers as the Python fake ------------------------------------


def _health_scenario() -> FakeNvmlScenario:
    """Every FakeHealth field set on some card: a whole H100 on 570 (SRAM split, repair, histogram,
    field errors, 40 retired pages over two lines), an A100 in MIG mode whose instances count their
    own SRAM errors (one cannot), a P100 with the older ECC locations, and an A100 with ECC off
    and limits NVML half knows."""
    h100 = fake_nvml.h100_r570_sram_split()
    demo = SCENARIOS["demo"]()
    pascal = fake_nvml.pascal_page_retirement().cards[0]
    double_bit = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    whole = dataclasses.replace(h100.cards[0], health=dataclasses.replace(
        h100.cards[0].health, fan_percent=40, retired_pending=False, unrepairable_memory=True,
        pcie_link=(5, 5, 16, 16),
        retired_pages={double_bit: tuple(0x7F000000 + 0x1000 * i for i in range(40)),
                       pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: ()},
        field_errors={"NVML_FI_DEV_MEMORY_TEMP": pynvml.NVML_ERROR_NO_PERMISSION,
                      "NVML_FI_DEV_ECC_CURRENT": pynvml.NVML_ERROR_UNKNOWN}))
    mig_card = dataclasses.replace(demo.cards[0], mig_devices=(
        dataclasses.replace(demo.cards[0].mig_devices[0], sram_uncorrectable_volatile=4),
        *demo.cards[0].mig_devices[1:2],
        dataclasses.replace(demo.cards[0].mig_devices[2], sram_uncorrectable_volatile=None)))
    ecc_off = dataclasses.replace(demo.cards[1], health=dataclasses.replace(
        demo.cards[1].health, ecc_mode=(False, True), clocks_event_reasons=None,
        power_limits_mw=(None, 250_000, None, 100_000, None)))
    return FakeNvmlScenario(driver_version="570.86.15", cuda_version=12080,
                            cards=(whole, mig_card, pascal, ecc_off))


# Run over pynvml, loaded on the C library in a child or on the Python fake here: every health call
# on every card and MIG handle, each answer a value or "E<code>", as JSON-ready values.
_HEALTH_PROBE = r"""
import ctypes, json


class UnrepairableMemory(ctypes.Structure):  # nvml.h's nvmlUnrepairableMemory_v1_t (590+), for any pynvml
    _fields_ = [("version", ctypes.c_uint), ("unrepairableMemory", ctypes.c_uint)]


def answers(pynvml, field_ids):
    def plain(value):
        if isinstance(value, ctypes.Structure):
            return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    def ask(function, *args):
        try:
            return plain(function(*args))
        except pynvml.NVMLError as e:
            return f"E{e.value}"

    def version_zero(name, struct, handle):  # the call's code for a struct of an unknown version
        value = struct()
        value.version = 0
        return pynvml._nvmlGetFunctionPointer(name)(handle, ctypes.byref(value))

    def device(h):
        out = {}
        fields = pynvml.nvmlDeviceGetFieldValues(h, field_ids)
        out["fields"] = [[f.fieldId, f.nvmlReturn, f.valueType,
                          f.value.uiVal if f.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT else f.value.ullVal]
                         for f in fields]
        out["temperature"] = ask(pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU)
        out["thresholds"] = [ask(pynvml.nvmlDeviceGetTemperatureThreshold, h, t)
                             for t in range(pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT + 1)]
        out["margin"] = ask(pynvml.nvmlDeviceGetMarginTemperature, h)
        for name in ("CurrentClocksEventReasons", "SupportedClocksEventReasons", "CurrentClocksThrottleReasons",
                     "SupportedClocksThrottleReasons", "PerformanceState", "FanSpeed", "EnforcedPowerLimit",
                     "PowerManagementLimit", "PowerManagementDefaultLimit", "PowerManagementLimitConstraints",
                     "TotalEnergyConsumption", "PcieReplayCounter", "EccMode", "RemappedRows",
                     "RowRemapperHistogram", "RetiredPagesPendingStatus", "RepairStatus"):
            out[name] = ask(getattr(pynvml, "nvmlDeviceGet" + name), h)
        for name in ("CurrPcieLinkGeneration", "MaxPcieLinkGeneration", "CurrPcieLinkWidth", "MaxPcieLinkWidth"):
            out[name] = ask(getattr(pynvml, "nvmlDeviceGet" + name), h)
        out["serial"] = ask(pynvml.nvmlDeviceGetSerial, h)
        unrepairable = UnrepairableMemory(version=ctypes.sizeof(UnrepairableMemory) | 1 << 24)
        code = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetUnrepairableMemoryFlag_v1")(h, ctypes.byref(unrepairable))
        out["unrepairable"] = [code, unrepairable.unrepairableMemory]
        for name in ("ClockInfo", "MaxClockInfo"):
            out[name] = [ask(getattr(pynvml, "nvmlDeviceGet" + name), h, c) for c in range(pynvml.NVML_CLOCK_COUNT + 1)]
        out["ecc"] = {f"{e} {c} {loc}": ask(pynvml.nvmlDeviceGetMemoryErrorCounter, h, e, c, loc)
                      for e in range(3) for c in range(2) for loc in range(pynvml.NVML_MEMORY_LOCATION_COUNT + 1)}
        status = pynvml.c_nvmlEccSramErrorStatus_v1_t()
        out["sram"] = [ask(pynvml.nvmlDeviceGetSramEccErrorStatus, h, ctypes.byref(status)), plain(status)]
        out["retired"] = [ask(pynvml.nvmlDeviceGetRetiredPages_v2, h, cause)
                          for cause in range(pynvml.NVML_PAGE_RETIREMENT_CAUSE_COUNT + 1)]
        out["version_zero"] = {name: version_zero(name, struct, h) for name, struct in (
            ("nvmlDeviceGetTemperatureV", pynvml.c_nvmlTemperature_v1_t),
            ("nvmlDeviceGetMarginTemperature", pynvml.c_nvmlMarginTemperature_v1_t),
            ("nvmlDeviceGetSramEccErrorStatus", pynvml.c_nvmlEccSramErrorStatus_v1_t),
            ("nvmlDeviceGetRepairStatus", pynvml.c_nvmlRepairStatus_t),
            ("nvmlDeviceGetUnrepairableMemoryFlag_v1", UnrepairableMemory))}
        return out

    result = {}
    pynvml.nvmlInit()
    for i in range(pynvml.nvmlDeviceGetCount()):
        card = pynvml.nvmlDeviceGetHandleByIndex(i)
        result[f"card{i}"] = device(card)
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(card)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(card, slot)
            except pynvml.NVMLError:
                continue
            result[f"card{i}/mig{slot}"] = device(mig)
    pynvml.nvmlShutdown()
    return json.loads(json.dumps(result))
"""


# A field id every header has and no card of any scenario gives a value: NVML_FI_DEV_PERF_POLICY_THERMAL,
# between the power (74) and sync-boost (76) counters the exporter reads.
UNLISTED_FIELD_ID = 75


def _field_ids(scenario: FakeNvmlScenario) -> list[int]:
    """Every field id a card of the scenario answers or fails, at the ids of its driver's header,
    and one that none lists."""
    ids = {fid for card in scenario.cards for fid in field_answers(card, scenario.driver_version)}
    assert UNLISTED_FIELD_ID not in ids
    return [*sorted(ids), UNLISTED_FIELD_ID]


def _health_over_the_library(env: dict[str, str], field_ids: list[int]) -> dict:
    code = _HEALTH_PROBE + "\nimport pynvml, sys\nprint(json.dumps(answers(pynvml, json.loads(sys.argv[1]))))\n"
    out = subprocess.run([sys.executable, "-c", code, json.dumps(field_ids)], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out)


def test_the_health_scenario_sets_every_health_field():
    scenario = _health_scenario()
    for f in dataclasses.fields(FakeHealth):
        assert any(getattr(card.health, f.name) != getattr(FakeHealth(), f.name) for card in scenario.cards), f.name
    migs = [m.sram_uncorrectable_volatile for card in scenario.cards for m in card.mig_devices]
    assert 4 in migs and None in migs


def test_health_through_the_library_answers_as_the_python_fake(fake_libnvml_env, fake_nvml_lib):
    """The same pynvml calls on the same scenario: the C library in a child, the Python fake here."""
    scenario = _health_scenario()
    ids = _field_ids(scenario)
    over_c = _health_over_the_library(fake_libnvml_env(scenario), ids)
    probe: dict = {}
    exec(_HEALTH_PROBE, probe)
    fake = fake_nvml_lib(scenario)
    over_python = probe["answers"](pynvml, ids)
    assert fake.exceptions == []
    assert list(over_c) == ["card0", "card1", "card1/mig0", "card1/mig1", "card1/mig2", "card2", "card3"]
    for device in over_c:
        assert over_c[device] == over_python[device], device
    # and what they agree on is the scenario's, not an error everywhere
    not_supported = f"E{NVML_ERROR_NOT_SUPPORTED}"
    h100, mig0, pascal, ecc_off = over_c["card0"], over_c["card1/mig0"], over_c["card2"], over_c["card3"]
    assert h100["sram"] == [0, {**h100["sram"][1], "version": pynvml.nvmlEccSramErrorStatus_v1,
                                "volatileUncParity": 2, "volatileUncSecDed": 1, "volatileCor": 5,
                                "aggregateUncParity": 3, "aggregateUncSecDed": 2, "aggregateCor": 9,
                                "bThresholdExceeded": 1}]
    assert h100["margin"] == 3 and h100["FanSpeed"] == 40 and h100["RepairStatus"] == [0, 1]
    assert h100["unrepairable"] == [0, 1] and h100["serial"] == not_supported
    assert [h100[n] for n in ("CurrPcieLinkGeneration", "MaxPcieLinkGeneration", "CurrPcieLinkWidth",
                              "MaxPcieLinkWidth")] == [5, 5, 16, 16]
    assert over_c["card1"]["serial"] == over_c["card1/mig0"]["serial"] == "1653922034781"  # a MIG handle: its card's
    assert h100["RowRemapperHistogram"] == {"max": 638, "high": 2, "partial": 0, "low": 0, "none": 0}
    assert h100["TotalEnergyConsumption"] == 4_200_000_123 and h100["PcieReplayCounter"] == 2
    assert h100["thresholds"][pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_CURR] == 83
    assert h100["thresholds"][-1] == h100["ClockInfo"][-1] == f"E{pynvml.NVML_ERROR_INVALID_ARGUMENT}"
    assert h100["retired"][0] == [] and len(h100["retired"][1]) == 40
    assert h100["retired"][1][39] == {"address": 0x7F000000 + 0x1000 * 39, "timestamp": RETIRED_AT + 39}
    assert h100["version_zero"] == dict.fromkeys(h100["version_zero"], pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    sram_unc = " ".join(map(str, (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC,
                                  pynvml.NVML_MEMORY_LOCATION_SRAM)))
    assert mig0["ecc"][sram_unc] == 4 and over_c["card1/mig2"]["ecc"][sram_unc] == not_supported
    invalid = f"E{pynvml.NVML_ERROR_INVALID_ARGUMENT}"
    for key, answer in mig0["ecc"].items():  # a bad error type or location is refused before the handle's kind
        bad = key.startswith("2 ") or key.endswith(f" {pynvml.NVML_MEMORY_LOCATION_COUNT}")
        assert answer == (invalid if bad else 4 if key == sram_unc else not_supported), key
    assert mig0["margin"] == mig0["RemappedRows"] == mig0["EccMode"] == not_supported
    assert over_c["card1"]["RemappedRows"] == not_supported  # in MIG mode
    device_memory = pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY
    assert pascal["ecc"][f"0 {pynvml.NVML_AGGREGATE_ECC} {device_memory}"] == 12
    assert pascal["ecc"][f"0 0 {pynvml.NVML_MEMORY_LOCATION_SRAM}"] == not_supported
    assert pascal["retired"][:2] == [[{"address": 0x1A2B000, "timestamp": RETIRED_AT},
                                      {"address": 0x1A2C000, "timestamp": RETIRED_AT + 1}],
                                     [{"address": 0x3F00000, "timestamp": RETIRED_AT}]]
    assert pascal["RetiredPagesPendingStatus"] == 1 and pascal["sram"][0] == not_supported
    assert ecc_off["ecc"]["0 0 2"] == not_supported and ecc_off["EccMode"] == [0, 1]
    assert ecc_off["CurrentClocksEventReasons"] == not_supported and ecc_off["SupportedClocksEventReasons"] == 511
    assert ecc_off["PowerManagementLimit"] == 250_000 and ecc_off["EnforcedPowerLimit"] == not_supported
    assert ecc_off["PowerManagementLimitConstraints"] == not_supported


def test_field_values_answer_each_entry_its_own_code_in_a_call_that_succeeds(fake_libnvml_env):
    scenario = _health_scenario()
    ids = _field_ids(scenario)
    answers = _health_over_the_library(fake_libnvml_env(scenario), ids)
    by_id = {fid: rest for fid, *rest in answers["card0"]["fields"]}
    by_name = {name: by_id[fid] for name, fid in fake_field_ids(scenario.driver_version).items() if fid in by_id}
    assert by_name["NVML_FI_DEV_MEMORY_TEMP"][0] == pynvml.NVML_ERROR_NO_PERMISSION  # its field_errors
    assert by_name["NVML_FI_DEV_ECC_CURRENT"][0] == pynvml.NVML_ERROR_UNKNOWN  # an error, no value
    # Not in the card's fields, yet answered from its ECC mode (current on, pending on), as NVML does.
    assert by_name["NVML_FI_DEV_ECC_PENDING"] == [0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 1]
    assert by_id[UNLISTED_FIELD_ID] == [NVML_ERROR_NOT_SUPPORTED, 0, 0]  # listed nowhere
    assert by_name["NVML_FI_DEV_PCIE_REPLAY_COUNTER"] == [0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 2]
    assert by_name["NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == [0, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                                                               4_200_000_123]
    assert {rest[0] for _, *rest in answers["card1/mig0"]["fields"]} == {NVML_ERROR_NOT_SUPPORTED}


def test_the_exporter_reads_the_same_health_over_the_library_as_over_the_python_fake(fake_libnvml_env, fake_nvml_lib):
    """sources/nvml_health.py end to end: ``read --source nvml`` in a child over the C library, and
    in this process over the Python fake, print the same series, energy included."""
    scenario = _health_scenario()
    via_c = _read(fake_libnvml_env(scenario), "--source", "nvml")
    fake_nvml_lib(scenario)
    via_python = CliRunner().invoke(cli, ["read", "--source", "nvml"])
    assert via_c.returncode == 0 and via_python.exit_code == 0, via_c.stderr

    def series(text: str) -> list[str]:
        # read's GPM window is the time between its two samples on the real clock: its length differs
        return [line for line in text.splitlines() if not line.startswith(
            ("mig_exporter_read_duration_seconds{", "mig_exporter_device_activity_window_seconds{"))]

    assert series(via_c.stdout) == series(via_python.stdout)
    health = [line for line in series(via_c.stdout) if line.startswith("mig_exporter_card_")
              and not line.startswith(("mig_exporter_card_read_", "mig_exporter_card_info", "mig_exporter_card_mig_"))]
    assert len(health) > 50, health
    assert any(line.startswith("mig_exporter_card_energy_joules_total{") for line in health)


@pytest.mark.parametrize("line", ["threshold 8 80", "retired 2 0x1000", "ecc 0 0 2 many", "sram_unc 3",
                                  "power_limits 1 2 3", "activity x 1 40.0 -", "activity - 1 busy -",
                                  "activity - 1 40.0 soon", "gpm_error 5", "putil 1 2 3 4 5 six"])
def test_a_bad_health_line_fails_init_and_names_its_line(tmp_path, fake_libnvml_dir, line):
    """An out-of-range kind, a bad number, a MIG line on a card, a short line, a bad activity line
    (GPU instance, percent, start, a missing code or number): UNKNOWN at nvmlInit."""
    from fake_nvml_c import environment

    scenario = tmp_path / "bad.txt"
    scenario.write_text(f"# {'many words ' * 30}\ndriver 570.86.15\ncard\nname x\n{line}\n")
    code = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).nvmlInitWithFlags(0))"
    done = subprocess.run([sys.executable, "-c", code, str(fake_libnvml_dir / SONAME)],
                          env=environment(fake_libnvml_dir, scenario), capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == str(pynvml.NVML_ERROR_UNKNOWN)
    assert f"{scenario}:5: " in done.stderr


_RETIRED_CHILD = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {"init": lib.nvmlInitWithFlags(0)}
card, mig, parent = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
lib.nvmlDeviceGetHandleByIndex_v2(2, ctypes.byref(card))
lib.nvmlDeviceGetHandleByIndex_v2(1, ctypes.byref(parent))
lib.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0, ctypes.byref(mig))
pages = lib.nvmlDeviceGetRetiredPages_v2
addresses, times = (ctypes.c_ulonglong * 8)(), (ctypes.c_ulonglong * 8)()
count = ctypes.c_uint(0)
out["sizing"] = [pages(card, 0, ctypes.byref(count), None), count.value]  # four arguments, as pynvml sizes
short = ctypes.c_uint(1)
out["short"] = [pages(card, 0, ctypes.byref(short), addresses, times), short.value, addresses[0]]
exact = ctypes.c_uint(2)
out["read"] = [pages(card, 0, ctypes.byref(exact), addresses, times), exact.value, list(addresses[:2]), list(times[:2])]
room = ctypes.c_uint(8)
out["no_timestamps"] = [pages(card, 1, ctypes.byref(room), addresses, None), room.value, addresses[0]]
out["bad_cause"] = pages(card, 2, ctypes.byref(count), None)
out["no_count"] = pages(card, 0, None, None)
out["mig"] = pages(mig, 0, ctypes.byref(count), None)
values = (ctypes.c_byte * 40)()
out["fields_none"] = lib.nvmlDeviceGetFieldValues(card, 0, values)
out["fields_null"] = lib.nvmlDeviceGetFieldValues(card, 1, None)
import pynvml  # loads this same library, by its soname
pynvml.nvmlInit()
out["pynvml"] = pynvml.nvmlDeviceGetRetiredPages_v2(pynvml.nvmlDeviceGetHandleByIndex(2), 0)
print(json.dumps(out))
"""


def test_retired_pages_answer_the_two_call_protocol_pynvml_makes(fake_libnvml_env, fake_libnvml_dir):
    """nvmlDeviceGetRetiredPages_v2 as pynvml calls it: sized with a NULL array and no timestamps
    (four arguments), then read with both; a short array answers INSUFFICIENT_SIZE and the count."""
    env = fake_libnvml_env(_health_scenario())
    out = subprocess.run([sys.executable, "-c", _RETIRED_CHILD, str(fake_libnvml_dir / SONAME)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    insufficient, invalid = pynvml.NVML_ERROR_INSUFFICIENT_SIZE, pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert json.loads(out) == {
        "init": 0,
        "sizing": [insufficient, 2],  # the P100's two pages retired for single-bit errors
        "short": [insufficient, 2, 0],  # nothing written
        "read": [0, 2, [0x1A2B000, 0x1A2C000], [RETIRED_AT, RETIRED_AT + 1]],
        "no_timestamps": [0, 1, 0x3F00000],
        "bad_cause": invalid, "no_count": invalid,
        "mig": NVML_ERROR_NOT_SUPPORTED,
        "fields_none": invalid, "fields_null": invalid,
        "pynvml": [{"address": 0x1A2B000, "timestamp": RETIRED_AT},
                   {"address": 0x1A2C000, "timestamp": RETIRED_AT + 1}],
    }


# -- activity: GPM and per-process utilisation, the same answers as the Python fake -------------------

GRAPHICS, SM, OCCUPANCY, TENSOR, DRAM = (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL,
                                         pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
                                         pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
EMPTY_GPU_INSTANCE, UNKNOWN_GPU_INSTANCE = 13, 99
SAMPLED_AT_US = 1_717_171_717_000_000  # the driver's CPU timestamps of the samples below
PROCESS_SAMPLES = (fake_nvml.FakeUtilSample(50102, SAMPLED_AT_US, 61, 40),
                   fake_nvml.FakeUtilSample(50318, SAMPLED_AT_US + 1, 5, 1, 2, 3),
                   fake_nvml.FakeUtilSample(50102, SAMPLED_AT_US + 166_667, 65, 42))


def _activity_scenario() -> FakeNvmlScenario:
    """An H100 in MIG mode: gpu_burn's GPU instance (9) busy, the memhogs' (2) idle, GPU instance 10
    scripted NaN and Inf, 13 without a compute instance, tensor activity failing with its own code;
    a whole H100 at 40% graphics with three driver samples of two processes; the demo's A100 in MIG
    mode (no GPM)."""
    h100 = SCENARIOS["h100-mig-processes"]().cards[0]
    demo = SCENARIOS["demo"]()
    odd = {GRAPHICS: float("nan"), SM: float("inf")}
    mig_card = dataclasses.replace(
        h100, mig_devices=(*h100.mig_devices[:3], dataclasses.replace(h100.mig_devices[3], activity=odd)),
        empty_gpu_instances=(EMPTY_GPU_INSTANCE,), gpm_metric_errors={TENSOR: pynvml.NVML_ERROR_UNKNOWN})
    whole = dataclasses.replace(demo.cards[1], **fake_nvml.H100, process_samples=PROCESS_SAMPLES,
                                activity=fake_nvml.gpm(graphics=40.0, sm=35.0, occupancy=20.0, tensor=12.5, dram=7.0))
    return dataclasses.replace(demo, cards=(mig_card, whole, demo.cards[0]))


# Run over pynvml, loaded on the C library in a child or on the Python fake here, with the fake clock
# held by ``set_clock`` and the samples held counted by ``held``: every GPM and process utilisation call
# on every card and MIG handle, each answer a value or "E<code>", as JSON-ready values.
_ACTIVITY_PROBE = r"""
import ctypes

ASKED = [1, 2, 3, 5, 10, 20, 0]  # the five the exporter reads, PCIe TX (MiB/s) and no metric


def answers(pynvml, set_clock, held):
    out = {}

    def ask(function, *args):
        try:
            return function(*args)
        except pynvml.NVMLError as e:
            return f"E{e.value}"

    def metrics(first, second, ids=ASKED, version=1, count=None):
        get = pynvml.c_nvmlGpmMetricsGet_t()
        get.version, get.sample1, get.sample2 = version, first, second
        get.numMetrics = len(ids) if count is None else count
        for i, metric in enumerate(ids):
            get.metrics[i].metricId, get.metrics[i].value = metric, -1.0  # kept where the metric fails
        beyond = get.metrics[len(ids)]
        beyond.metricId, beyond.nvmlReturn, beyond.value = 1, 4242, -7.0  # past numMetrics: untouched
        try:
            pynvml.nvmlGpmMetricsGet(get)
        except pynvml.NVMLError as e:
            return f"E{e.value}"
        rows = [get.metrics[i] for i in range(len(ids))] + [beyond]
        return [[m.metricId, m.nvmlReturn, repr(round(m.value, 9))] for m in rows]

    def utilisation(handle, since):
        found = ask(pynvml.nvmlDeviceGetProcessUtilization, handle, since)
        if isinstance(found, str):
            return found
        return [[s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil] for s in found]

    pynvml.nvmlInit()
    cards, migs = {}, {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        cards[f"card{i}"] = card = pynvml.nvmlDeviceGetHandleByIndex(i)
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(card)):
            try:
                migs[f"card{i}/mig{slot}"] = (card, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(card, slot))
            except pynvml.NVMLError:
                pass
    handles = {**cards, **{name: mig for name, (_, mig) in migs.items()}}
    out["support"] = {name: ask(lambda h: pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice, h)
                      for name, h in handles.items()}
    stale = pynvml.c_nvmlGpmSupport_t()
    stale.version = 2
    out["support_version_2"] = pynvml._nvmlGetFunctionPointer("nvmlGpmQueryDeviceSupport")(
        cards["card0"], ctypes.byref(stale))

    # What each sampling call takes: SampleGet on every handle, MigSampleGet on each card for each
    # GPU instance of its MIG devices, one without a compute instance and one it lacks, and on a MIG handle.
    takes = {f"get {name}": (pynvml.nvmlGpmSampleGet, h) for name, h in handles.items()}
    for name, card in cards.items():
        ids = {pynvml.nvmlDeviceGetGpuInstanceId(m) for n, (c, m) in migs.items() if n.startswith(name + "/")}
        for gi in sorted(ids) + [13, 99]:
            takes[f"mig {name} {gi}"] = (lambda h, s, gi=gi: pynvml.nvmlGpmMigSampleGet(h, gi, s), card)
    takes["mig card0/mig0 2"] = (lambda h, s: pynvml.nvmlGpmMigSampleGet(h, 2, s), handles["card0/mig0"])

    allocated = []

    def take_all(at):
        set_clock(at)
        taken = {}
        for name, (take, handle) in takes.items():
            allocated.append(pynvml.nvmlGpmSampleAlloc())
            code = ask(take, handle, allocated[-1])
            taken[name] = allocated[-1] if not isinstance(code, str) else code
        return taken

    first, second, close = take_all(1000.0), take_all(1030.0), take_all(1030.05)
    out["held"] = held()
    out["sampled"] = {name: s if isinstance(s, str) else 0 for name, s in first.items()}
    out["windows"] = {name: metrics(first[name], second[name]) for name, s in first.items() if not isinstance(s, str)}
    out["under_100ms"] = metrics(second["get card1"], close["get card1"])
    out["backwards"] = metrics(second["get card1"], first["get card1"])
    out["mig_handle_and_card"] = metrics(first["mig card0 9"], second["get card0/mig2"])  # both GPU instance 9
    out["two_gpu_instances"] = metrics(first["mig card0 9"], second["mig card0 2"])
    out["version_2"] = metrics(first["get card1"], second["get card1"], version=2)
    out["no_metric"] = metrics(first["get card1"], second["get card1"], ids=[1], count=0)
    out["99_metrics"] = metrics(first["get card1"], second["get card1"], ids=[1], count=99)
    blank = pynvml.nvmlGpmSampleAlloc()
    out["never_filled"] = metrics(blank, second["get card1"])
    for sample in allocated + [blank]:  # those whose sampling failed too
        pynvml.nvmlGpmSampleFree(sample)
    out["after_free"] = held()
    out["freed_twice"] = ask(pynvml.nvmlGpmSampleFree, blank)
    out["freed_sample"] = metrics(first["get card1"], second["get card1"])

    # nvmlDeviceGetProcessUtilization since 0, since the first sample (us), since the last.
    out["utilisation"] = {name: [utilisation(h, since) for since in (0, 1717171717000000, 1717171717166667)]
                          for name, h in handles.items() if name in ("card0", "card0/mig0", "card1", "card2")}
    pynvml.nvmlShutdown()
    return out
"""


def _activity_over_the_library(env: dict[str, str]) -> dict:
    code = _ACTIVITY_PROBE + (
        "\nimport json, pynvml\n"
        "def set_clock(seconds):\n"
        "    pynvml.nvmlLib.fakeNvmlSetClock(ctypes.c_double(seconds))\n"
        "print(json.dumps(answers(pynvml, set_clock, lambda: pynvml.nvmlLib.fakeNvmlLiveGpmSamples())))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return json.loads(out)


def test_activity_through_the_library_answers_as_the_python_fake(fake_libnvml_env, fake_nvml_lib):
    """The same pynvml calls on the same scenario at the same fake times: the C library in a child,
    the Python fake here."""
    scenario = _activity_scenario()
    over_c = _activity_over_the_library(fake_libnvml_env(scenario))
    probe: dict = {}
    exec(_ACTIVITY_PROBE, probe)
    fake = fake_nvml_lib(scenario)
    over_python = json.loads(json.dumps(probe["answers"](pynvml, fake.set_clock, lambda: fake.gpm_samples_held)))
    assert fake.exceptions == []
    assert list(over_c) == list(over_python)
    for key in over_c:
        assert over_c[key] == over_python[key], key
    # and what they agree on is the scenario's
    assert over_c["windows"]["get card1"][0] == [GRAPHICS, 0, "40.0"]


# -- process utilisation made as the clock runs: the same samples from both fakes --------------------

WALL_LESS_FAKE_S = 1_717_170_000.0  # the wall clock less the fake clock, until it steps back 10 s at 1020
_MADE_PROBE = r"""
def answers(pynvml, set_clock):
    pynvml.nvmlInit()
    card = pynvml.nvmlDeviceGetHandleByIndex(1)

    def ask(since):
        try:
            return [[s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil]
                    for s in pynvml.nvmlDeviceGetProcessUtilization(card, since)]
        except pynvml.NVMLError as e:
            return f"E{e.value}"

    out, newest = [], 0
    for at in (1000.0, 1000.1, 1010.0, 1015.0, 1020.0, 1030.0, 1200.0):
        set_clock(at)
        since_newest, everything = ask(newest), ask(0)
        out.append([at, newest, since_newest, everything])
        if isinstance(since_newest, list) and since_newest:
            newest = max(newest, max(s[1] for s in since_newest))
    pynvml.nvmlShutdown()
    return out
"""


def _made_scenarios(period_us: int, merged: bool) -> tuple[FakeNvmlScenario, FakeNvmlScenario]:
    """The demo's whole card (index 1) as an H100 whose driver samples a training job (900), a
    transcoder busy on NVENC alone (901) and nothing of 902; from 1015 on, 900 idle and 901 computing."""
    demo = SCENARIOS["demo"]()
    whole = dataclasses.replace(demo.cards[1], **fake_nvml.H100, process_samples=(), process_sample_period_us=period_us,
                                process_samples_merged=merged,
                                process_activity={900: (70, 30), 901: (0, 0, 95, 0), 902: (0, 0)})
    later = dataclasses.replace(whole, process_activity={901: (40, 10, 95, 3)})
    return (dataclasses.replace(demo, cards=(demo.cards[0], whole)),
            dataclasses.replace(demo, cards=(demo.cards[0], later)))


@pytest.mark.parametrize(("period_us", "merged"), [(166_667, False), (1_000_000, True)])
def test_process_samples_made_as_the_clock_runs_are_the_python_fakes(fake_libnvml_env, fake_nvml_lib, period_us,
                                                                     merged):
    """nvmlDeviceGetProcessUtilization over the C library and over the Python fake, at the same fake
    times: a sample a period of each scripted process while any share is above 0, stamped by the wall
    clock (which steps back 10 s at 1020), the script changed at 1015, 120 s kept; one sample a process
    a call where merged. Asked since 0 and since the newest stamp seen, as the exporter asks."""
    first, later = _made_scenarios(period_us, merged)
    env = fake_libnvml_env(first, later=((1015.0, later),),
                           wall_clock=((None, WALL_LESS_FAKE_S), (1020.0, WALL_LESS_FAKE_S - 10)))
    code = _MADE_PROBE + (
        "\nimport ctypes, json, pynvml\n"
        "def set_clock(seconds):\n"
        "    pynvml.nvmlLib.fakeNvmlSetClock(ctypes.c_double(seconds))\n"
        "print(json.dumps(answers(pynvml, set_clock)))\n")
    over_c = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                       check=True, timeout=60).stdout)
    fake = fake_nvml_lib(first)

    def set_clock(seconds: float) -> None:
        fake.set_clock(seconds)
        if seconds == 1000.0:
            fake.set_wall_clock(1000.0 + WALL_LESS_FAKE_S)
        elif seconds == 1015.0:
            fake.set_scenario(later)
        elif seconds == 1020.0:
            fake.step_wall_clock(-10.0)

    probe: dict = {}
    exec(_MADE_PROBE, probe)
    over_python = json.loads(json.dumps(probe["answers"](pynvml, set_clock)))
    assert fake.exceptions == []
    assert [row[:2] for row in over_c] == [row[:2] for row in over_python]
    for c_row, python_row in zip(over_c, over_python, strict=True):
        assert c_row == python_row, c_row[0]
    # and what they agree on is the script: at 1000, 120 s of samples of 900 and 901, none of 902
    everything = over_c[0][3]
    per_process = 1 if merged else 120_000_000 // period_us
    assert sorted({s[0] for s in everything}) == [900, 901]
    assert len(everything) in (2 * per_process, 2 * per_process + 2)
    assert {tuple(s[2:]) for s in everything} == {(70, 30, 0, 0), (0, 0, 95, 0)}
    assert max(s[1] for s in everything) <= int((1000.0 + WALL_LESS_FAKE_S) * 1e6)
    # After the step back at 1020, the 10 s of samples to 1030 are stamped no later than the newest seen
    # at 1020 (but for the last, a few us past it): asked since it, they are all but hidden.
    at_1020, at_1030 = over_c[4], over_c[5]
    assert isinstance(at_1020[2], list) and at_1020[2], "1015-1020 still on the old clock"
    assert isinstance(at_1030[2], str) or len(at_1030[2]) <= 1, at_1030[2]
    assert {tuple(s[2:]) for s in over_c[6][3] if s[0] == 901} >= {(40, 10, 95, 3)}


@pytest.fixture(scope="module")
def activity(fake_libnvml_dir, tmp_path_factory) -> dict:
    """The activity probe's answers over the library, for the tests below that read them."""
    from fake_nvml_c import environment, write_scenario

    path = write_scenario(tmp_path_factory.mktemp("activity") / "scenario.txt", _activity_scenario())
    return _activity_over_the_library(environment(fake_libnvml_dir, path))


def test_gpm_support_is_the_cards_hopper_yes_a100_no_and_a_mig_handle_answers_as_its_card(activity):
    assert activity["support"] == {"card0": 1, "card1": 1, "card2": 0, **{f"card0/mig{i}": 1 for i in range(4)},
                                   **{f"card2/mig{i}": 0 for i in range(3)}}
    assert activity["support_version_2"] == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_a_30s_window_at_a_scripted_activity_answers_that_activity(activity):
    windows = activity["windows"]
    graphics, sm, occupancy, tensor, dram, pcie, none = windows["get card1"][:7]
    assert abs(float(graphics[2]) / 100 - 0.40) <= 0.01
    assert [sm[2], occupancy[2], tensor[2], dram[2]] == ["35.0", "20.0", "12.5", "7.0"]
    not_supported = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert pcie[:2] == [20, not_supported] and none[:2] == [0, not_supported]  # not percents: no value
    assert pcie[2] == none[2] == "-1.0"  # a metric that fails keeps what the caller left
    assert windows["get card1"][7] == [1, 4242, "-7.0"]  # past numMetrics: untouched
    # gpu_burn's GPU instance, by its id on the card or through its MIG handle; the memhogs' is idle
    burn = [[GRAPHICS, 0, "99.0"], [SM, 0, "97.0"], [OCCUPANCY, 0, "48.0"]]
    assert windows["mig card0 9"][:3] == windows["get card0/mig2"][:3] == activity["mig_handle_and_card"][:3] == burn
    assert [row[2] for row in windows["mig card0 2"][:5]] == ["0.0", "0.0", "0.0", "-1.0", "0.0"]
    # a GPU instance without a compute instance samples, but has no data: no measured 0 (DCGM answers blank)
    assert [row[1:] for row in windows[f"mig card0 {EMPTY_GPU_INSTANCE}"][:5]] == [
        [pynvml.NVML_ERROR_NO_DATA, "-1.0"]] * 5
    assert [row[2] for row in windows["mig card0 10"][:2]] == ["nan", "inf"]  # as scripted: the exporter's to drop
    assert [row[2] for row in activity["under_100ms"][:5]] == ["0.0"] * 5
    assert activity["backwards"] == windows["get card1"]


def test_a_metrics_own_return_code_surfaces_in_its_nvml_return(activity):
    for name in ("mig card0 9", "get card0/mig2", "mig card0 2"):
        assert activity["windows"][name][3][:2] == [TENSOR, pynvml.NVML_ERROR_UNKNOWN], name
    assert activity["windows"]["get card1"][3][:2] == [TENSOR, pynvml.NVML_SUCCESS]  # another card's metric


def test_sampling_calls_refuse_what_the_driver_refuses(activity):
    codes = activity["sampled"]
    not_supported, invalid = f"E{pynvml.NVML_ERROR_NOT_SUPPORTED}", f"E{pynvml.NVML_ERROR_INVALID_ARGUMENT}"
    assert codes[f"mig card0 {UNKNOWN_GPU_INSTANCE}"] == f"E{pynvml.NVML_ERROR_NOT_FOUND}"
    assert codes[f"mig card0 {EMPTY_GPU_INSTANCE}"] == 0 and codes["mig card0 9"] == 0
    assert codes["mig card0/mig0 2"] == invalid  # a MIG handle: it takes the parent card
    assert codes["get card0"] == not_supported  # a card in MIG mode has no whole-card sample
    assert codes["mig card1 13"] == not_supported  # a card not in MIG mode
    assert {n: c for n, c in codes.items() if "card2" in n} == dict.fromkeys(
        [n for n in codes if "card2" in n], not_supported)  # an A100: no GPM
    assert activity["version_2"] == f"E{pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH}"
    for name in ("two_gpu_instances", "no_metric", "99_metrics", "never_filled", "freed_sample"):
        assert activity[name] == invalid, name


def test_samples_are_counted_until_freed(activity):
    sampled = sum(1 for code in activity["sampled"].values() if code == 0)
    failed = len(activity["sampled"]) - sampled
    assert activity["held"] == 3 * len(activity["sampled"])  # three rounds, failed samples too
    assert failed > 0 and activity["after_free"] == 0
    assert activity["freed_twice"] == f"E{pynvml.NVML_ERROR_INVALID_ARGUMENT}"


def test_process_utilisation_answers_samples_after_last_seen_and_not_found_when_idle(activity):
    first, other, last = ([u.pid, u.timestamp_us, u.sm_percent, u.memory_percent, u.encoder_percent,
                           u.decoder_percent] for u in PROCESS_SAMPLES)
    not_found = f"E{pynvml.NVML_ERROR_NOT_FOUND}"
    assert activity["utilisation"]["card1"] == [[first, other, last], [other, last], not_found]
    # MIG mode: the size query answers, the read is refused (card NOT_SUPPORTED, MIG handle INVALID_ARGUMENT)
    not_supported = f"E{pynvml.NVML_ERROR_NOT_SUPPORTED}"
    assert activity["utilisation"]["card0"] == activity["utilisation"]["card2"] == [not_supported] * 3
    assert activity["utilisation"]["card0/mig0"] == [f"E{pynvml.NVML_ERROR_INVALID_ARGUMENT}"] * 3


def test_a_whole_card_with_no_sampled_process_answers_not_found(fake_libnvml_env):
    idle = dataclasses.replace(SCENARIOS["demo"](), cards=(dataclasses.replace(SCENARIOS["demo"]().cards[1],
                                                                              process_samples=()),))
    code = ("import pynvml\npynvml.nvmlInit()\n"
            "try:\n    pynvml.nvmlDeviceGetProcessUtilization(pynvml.nvmlDeviceGetHandleByIndex(0), 0)\n"
            "except pynvml.NVMLError_NotFound:\n    print('not found')\n")
    out = subprocess.run([sys.executable, "-c", code], env=fake_libnvml_env(idle), capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out == "not found\n"


_CLOCK_CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import pynvml
from fake_nvml_c import set_clock

clock = Path(sys.argv[1])
pynvml.nvmlInit()
card = pynvml.nvmlDeviceGetHandleByIndex(0)
samples = {}
for at in (1000, 1015, 1030, 1045, 1060):
    set_clock(clock, at)
    samples[at] = pynvml.nvmlGpmSampleGet(card, pynvml.nvmlGpmSampleAlloc())


def graphics(first, second):
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version, get.numMetrics, get.sample1, get.sample2 = 1, 1, samples[first], samples[second]
    get.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    return pynvml.nvmlGpmMetricsGet(get).metrics[0].value


print(json.dumps({f"{a}-{b}": graphics(a, b) for a, b in ((1000, 1030), (1030, 1060), (1000, 1060), (1015, 1045))}))
"""


def test_the_clock_file_drives_the_samples_and_a_script_changed_mid_window_averages_over_time(
        fake_libnvml_env, tmp_path):
    """40% until fake time 1030, 80% from then (``later``, the Python fake's set_scenario at 1030)."""
    base = dataclasses.replace(SCENARIOS["demo"]().cards[1], **fake_nvml.H100)
    at_40, at_80 = (dataclasses.replace(SCENARIOS["demo"](), cards=(dataclasses.replace(base, activity={GRAPHICS: p}),))
                    for p in (40.0, 80.0))
    clock = tmp_path / "clock"
    env = fake_libnvml_env(at_40, clock_file=clock, later=((1030.0, at_80),))
    out = subprocess.run([sys.executable, "-c", _CLOCK_CHILD, str(clock), str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    windows = json.loads(out)
    assert windows == {"1000-1030": pytest.approx(40.0), "1030-1060": pytest.approx(80.0),
                       "1000-1060": pytest.approx(60.0), "1015-1045": pytest.approx(60.0)}


def test_the_scenario_file_carries_the_activity_lines():
    scenario = _activity_scenario()
    text = scenario_text(scenario, clock_file=Path("/tmp/a clock"), later=((30.0, scenario),))
    lines = text.splitlines()
    assert "clock_file /tmp/a%20clock" in lines
    assert lines.count("gpm 1") == 2 and "gpu_instance 13" in lines
    assert f"activity 9 {GRAPHICS} 99.0 -" in lines and f"activity 10 {GRAPHICS} nan -" in lines
    assert f"activity 10 {SM} inf -" in lines and f"activity - {GRAPHICS} 40.0 -" in lines
    assert f"gpm_error {TENSOR} {pynvml.NVML_ERROR_UNKNOWN}" in lines
    assert "putil 50318 1717171717000001 5 1 2 3" in lines
    assert f"activity 2 {DRAM} 0.0 30.0" in lines  # later: every percent metric, idle where unscripted
    with pytest.raises(ValueError, match="same cards"):
        scenario_text(scenario, later=((30.0, SCENARIOS["demo"]()),))
    # process scripts, and what a later line cannot change (the period, merging) refused
    first, later = _made_scenarios(166_667, False)
    lines = scenario_text(first, later=((1015.0, later),)).splitlines()
    assert {"pactivity 900 70 30 0 0 -", "pactivity 901 0 0 95 0 -", "putil_period 166667",
            "pactivity 900 0 0 0 0 1015.0", "pactivity 901 40 10 95 3 1015.0"} <= set(lines)
    merged = dataclasses.replace(later, cards=(later.cards[0], dataclasses.replace(
        later.cards[1], process_samples_merged=True)))
    with pytest.raises(ValueError, match="activity scripts only"):
        scenario_text(first, later=((1015.0, merged),))


# -- the exporter in a process of its own, over the library ---------------------------


@pytest.mark.parametrize("name", FIXTURE_SCENARIOS)
def test_read_source_nvml_over_the_library_equals_nvidia_smi(fake_libnvml_env, fake_nvidia_smi, name):
    smi = fake_nvidia_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"))
    via_nvml = _read(fake_libnvml_env(name), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0, via_nvml.stderr
    assert via_smi.returncode == 0, via_smi.stderr
    assert _sample(via_nvml.stdout, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    assert "mig_exporter_card_energy_joules_total{" in via_nvml.stdout  # what parity skips is there
    unread = RECOVERY_LINES if name in NO_RECOVERY_FIELD else ()  # no field for it in the driver's header
    assert without_volatile(via_nvml.stdout, unread) == without_volatile(via_smi.stdout, unread)


@pytest.mark.parametrize("name", sorted(BENCH_SHAPES))
def test_the_benchmark_machines_read_the_same_through_the_library(fake_libnvml_env, fake_nvidia_smi, name):
    shape = BENCH_SHAPES[name]
    smi = fake_nvidia_smi(bench.query_xml(shape), bench.listing(shape))
    via_nvml = _read(fake_libnvml_env(bench.nvml_scenario(shape)), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0 and via_smi.returncode == 0, via_nvml.stderr + via_smi.stderr
    processes = [line for line in via_nvml.stdout.splitlines()
                 if line.startswith("mig_exporter_process_memory_used_bytes{")]
    assert len(processes) == shape.processes
    assert without_volatile(via_nvml.stdout) == without_volatile(via_smi.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``mig-exporter serve --source nvml`` in its own process."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mig_exporter", "serve", "--source", "nvml",
             "--web.listen-address", f"127.0.0.1:{self.port}", "--log-level", "warning", *args],
            env=_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            try:
                self.get("/-/healthy")
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("serve did not answer /-/healthy")

    def get(self, path: str, timeout: float = 30) -> tuple[int, str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            started = time.monotonic()
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read().decode(), time.monotonic() - started
        finally:
            conn.close()

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""


@pytest.fixture
def serve():
    started: list[Served] = []

    def start(env: dict[str, str], *args: str) -> Served:
        started.append(Served(env, *args))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_serve_source_nvml_maps_our_library_and_answers_as_read_does(fake_libnvml_env, fake_libnvml_dir, serve):
    env = fake_libnvml_env("h100-mig-processes")
    served = serve(env)
    status, body, _ = served.get("/metrics")
    assert status == 200
    maps = Path(f"/proc/{served.proc.pid}/maps").read_text()
    assert str(fake_libnvml_dir / SONAME) in maps
    assert "/libnvidia-ml.so" not in maps.replace(str(fake_libnvml_dir / SONAME), "")
    read = _read(env, "--source", "nvml")
    # serve listens for XID events over NVML and says whether it does; a one-shot read has no
    # listener, so that series is serve's alone (its value depends on whether the listener has
    # registered yet).
    listener = 'mig_exporter_xid_source_readable{source="nvml_events"} '
    assert any(line.startswith(listener) for line in body.splitlines())
    # GPM activity needs two samples: serve's first scrape says first_sample, read waits a second for
    # its second (the next test reads activity through the library).
    ours = [line for line in body.splitlines() if line.startswith("mig_exporter_") and "_read_" not in line
            and "activity" not in line
            and not line.startswith(("mig_exporter_build_info", "mig_exporter_scrape", "mig_exporter_exporter",
                                     listener))]
    assert len(ours) > 20
    assert set(ours) <= set(read.stdout.splitlines())
    assert served.get("/-/ready")[0] == 200


def test_serve_reads_gpm_and_process_activity_through_the_library_on_the_real_clocks(fake_libnvml_env, serve):
    """The exporter's own activity calls over the C library, not only pynvml's: nvmlGpmMigSampleGet's
    unsigned GPU instance id, nvmlGpmMetricsGet's struct unpacked at nvml.h's offsets, and
    nvmlDeviceGetProcessUtilization's 64-bit timestamp, its samples stamped by the real wall clock.
    Two scrapes 1.2 s apart on the real monotonic clock: gpu_burn's GPU instance busy, the whole
    H100 at its scripted 40%, the training job at its share and the idle llama.cpp at 0."""
    mig_card = SCENARIOS["h100-mig-processes"]().cards[0]
    demo = SCENARIOS["demo"]()
    whole = dataclasses.replace(demo.cards[1], **fake_nvml.H100, process_samples=(),
                                activity=fake_nvml.gpm(graphics=40.0, sm=35.0, occupancy=20.0, tensor=12.5, dram=7.0),
                                process_activity={50318: (63, 41)})
    served = serve(fake_libnvml_env(dataclasses.replace(demo, cards=(mig_card, whole))))
    first = served.get("/metrics")[1]
    assert 'reason="first_sample"} 1' in first
    time.sleep(1.2)
    status, body, _ = served.get("/metrics")
    assert status == 200 and "first_sample" not in body
    graphics = {dict(re.findall(r'(\w+)="([^"]*)"', line))["index"]: float(line.rsplit(" ", 1)[1])
                for line in body.splitlines() if line.startswith("mig_exporter_device_graphics_activity_ratio{")}
    assert graphics == {"1000": 0.0, "1001": 0.0, "1002": 0.99, "1003": 0.0, "1": pytest.approx(0.40)}
    window = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith("mig_exporter_device_activity_window_seconds{") and 'index="1"' in line]
    assert len(window) == 1 and 1.0 <= window[0] < 10, window
    assert float(_sample(body, 'mig_exporter_device_dram_bandwidth_ratio{card="1",index="1",mig_profile=""}')
                 or "nan") == pytest.approx(0.07)
    shares = {(dict(re.findall(r'(\w+)="([^"]*)"', line))["pid"], line.split("{")[0]): float(line.rsplit(" ", 1)[1])
              for line in body.splitlines() if line.startswith("mig_exporter_process_") and "_activity_ratio{" in line}
    assert shares == {("50318", "mig_exporter_process_sm_activity_ratio"): pytest.approx(0.63, abs=0.01),
                      ("50318", "mig_exporter_process_memory_activity_ratio"): pytest.approx(0.41, abs=0.01),
                      ("50102", "mig_exporter_process_sm_activity_ratio"): 0.0,
                      ("50102", "mig_exporter_process_memory_activity_ratio"): 0.0}


def test_every_later_scrape_through_the_library_lists_the_processes_as_one_read_does(fake_libnvml_env, serve):
    # Later reads keep process readings from earlier ones: they must never differ.
    env = fake_libnvml_env(bench.nvml_scenario(BENCH_SHAPES["big-mig"]))

    def processes(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("mig_exporter_process_"))

    expected = processes(_read(env, "--source", "nvml").stdout)
    assert len(expected) >= BENCH_SHAPES["big-mig"].processes
    served = serve(env)
    for _ in range(3):
        status, body, _ = served.get("/metrics")
        assert status == 200
        assert processes(body) == expected


# -- error modes -------------------------------------------------------------------


def test_a_lost_card_and_refused_mig_queries_mark_their_cards_and_the_third_reports(fake_libnvml_env):
    result = _read(fake_libnvml_env("one-lost-one-no-permission"), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _sample(out, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(out, 'mig_exporter_card_read_success{card="1"}') == "0.0"
    assert _sample(out, 'mig_exporter_card_read_success{card="2"}') == "1.0"
    assert "NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetUUID" in result.stderr
    assert "NVML_ERROR_NO_PERMISSION in nvmlDeviceGetMaxMigDeviceCount" in result.stderr
    assert _sample(out, 'mig_exporter_process_memory_used_bytes{card="2",gpu_instance_id="",index="2",'
                        'pid="61001",type="C"}') is not None or 'pid="61001"' in out


def _not_supported(name: str, *functions: str) -> FakeNvmlScenario:
    base = SCENARIOS[name]()
    cards = tuple(dataclasses.replace(c, errors={f: NVML_ERROR_NOT_SUPPORTED for f in functions}) for c in base.cards)
    return dataclasses.replace(base, cards=cards)


def test_not_supported_mig_mode_reads_the_card_whole(fake_libnvml_env):
    """A driver that answers NOT_SUPPORTED to nvmlDeviceGetMigMode: the card has no MIG, as a T4."""
    result = _read(fake_libnvml_env(_not_supported("a100-mig-pending", "nvmlDeviceGetMigMode")),
                   "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "1.0"
    assert "mig_exporter_card_mig_mode{" not in result.stdout
    assert 'pid="900"' in result.stdout


def test_not_supported_mig_device_queries_fail_only_that_card(fake_libnvml_env):
    result = _read(fake_libnvml_env(_not_supported("h100-mig-processes", "nvmlDeviceGetMaxMigDeviceCount")),
                   "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(result.stdout, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    assert "NVML_ERROR_NOT_SUPPORTED in nvmlDeviceGetMaxMigDeviceCount" in result.stderr


def test_a_process_list_that_grew_after_its_sizing_call_is_read_again(fake_libnvml_env):
    """pynvml sizes the list, allocates twice that plus five, reads: a list that grew past that
    answers INSUFFICIENT_SIZE to the read. The exporter asks again rather than drop the card."""
    result = _read(fake_libnvml_env("h100-mig-processes", grow={(0, 0): 50}), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _sample(out, 'mig_exporter_card_read_success{card="0"}') == "1.0"
    assert "INSUFFICIENT_SIZE" not in result.stderr
    grown = [line for line in out.splitlines() if line.startswith("mig_exporter_process_memory_used_bytes{")
             and re.search(r'pid="30001\d\d"', line)]
    assert len(grown) == 50
    assert 'pid="21180"' in out and 'pid="21198"' in out


def test_an_insufficient_size_on_every_read_fails_the_card_after_bounded_retries(fake_libnvml_env):
    """A list that outgrows every read (a fork bomb on the GPU) ends in a marked card, not a loop."""
    base = SCENARIOS["h100-mig-processes"]()
    lost = dataclasses.replace(base, cards=(dataclasses.replace(
        base.cards[0], errors={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_INSUFFICIENT_SIZE,
                               "nvmlDeviceGetComputeRunningProcesses_v2": pynvml.NVML_ERROR_INSUFFICIENT_SIZE}),))
    result = _read(fake_libnvml_env(lost), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert "NVML_ERROR_INSUFFICIENT_SIZE" in result.stderr


def test_a_lost_card_keeps_its_handle_and_fails_only_itself(fake_libnvml_env):
    base = SCENARIOS["demo"]()
    cards = (dataclasses.replace(base.cards[0], errors={"*": NVML_ERROR_GPU_IS_LOST}), base.cards[1])
    result = _read(fake_libnvml_env(dataclasses.replace(base, cards=cards)), "--source", "nvml")
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="1"}') == "1.0"
    assert 'pid="50318"' in result.stdout and 'pid="48213"' not in result.stdout


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_device_call_hung_for_good_fails_every_later_read_at_its_deadline_while_ready_stays_200(
        fake_libnvml_env, serve):
    """What docs/reliability.md describes: after nvmlDeviceGetPowerUsage never returns, each
    scrape answers at its deadline with the read failed and no device series, one thread stays
    hung, and /-/ready, whose check calls nvmlDeviceGetCount only, still answers 200."""
    served = serve(fake_libnvml_env("demo", hang=("nvmlDeviceGetPowerUsage", 2)), "--timeout", "1")
    status, first, _ = served.get("/metrics")  # the two cards' power: the calls the hang allows
    assert status == 200 and _sample(first, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    threads = []
    for n in range(1, 7):
        status, body, took = served.get("/metrics")
        assert status == 200
        assert 0.9 < took < 3.0, took
        assert _sample(body, 'mig_exporter_read_success{source="nvml"}') == "0.0"
        assert _sample(body, 'mig_exporter_read_errors_total{source="nvml"}') == f"{n}.0"
        assert "mig_exporter_device_memory_used_bytes{" not in body
        ready, text, ready_took = served.get("/-/ready")
        assert ready == 200 and "2 device(s)" in text and ready_took < 0.5
        threads.append(_threads(served.proc.pid))
    # Later reads join the hung one: no thread per scrape (6 scrapes would add 5). The kept
    # workers may grow by one where a scrape's call comes while every kept one is still busy.
    assert threads[-1] - threads[0] <= 1, threads
    assert "nvml read did not finish within 1.0s" in served.stop()


def test_a_hung_device_count_fails_reads_and_readiness_alike(fake_libnvml_env, serve):
    """Hung in nvmlDeviceGetCount, the call /-/ready's check makes too: both answer at their
    deadlines, reads failed and /-/ready 503, /-/healthy at once."""
    # One call at startup's readiness check, one in the first read; the third never returns. No XID
    # listener: it calls nvmlDeviceGetCount too, at a moment of its own.
    served = serve(fake_libnvml_env("demo", hang=("nvmlDeviceGetCount_v2", 2)), "--timeout", "1",
                   "--no-collector.xid")
    assert _sample(served.get("/metrics")[1], 'mig_exporter_read_success{source="nvml"}') == "1.0"
    for _ in range(2):
        status, body, took = served.get("/metrics")
        assert status == 200 and 0.9 < took < 3.0
        assert _sample(body, 'mig_exporter_read_success{source="nvml"}') == "0.0"
        ready, text, ready_took = served.get("/-/ready")
        assert ready == 503 and "did not finish within 1.0s" in text and 0.9 < ready_took < 3.0
        healthy, _, healthy_took = served.get("/-/healthy")
        assert healthy == 200 and healthy_took < 0.5


def test_the_library_benchmark_runs_in_quick_mode_and_measures_every_figure(fake_libnvml_dir):
    """benchmarks/nvml_lib.py: no timing asserted, only that every figure is measured."""
    from benchmarks import nvml_lib

    figures: dict[str, float] = {}
    table = nvml_lib.measure(True, figures)
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "scenario" not in line]
    assert [r[0].strip() for r in rows] == ["big-mig", "big-whole", "single"]
    nvitop = importlib.util.find_spec("nvitop_exporter") is not None
    for row in rows:
        cells = [c.strip() for c in row[1:]]
        assert all(re.fullmatch(r"\d+\.\d\d", c) for c in (cells if nvitop else cells[:3])), row
    assert figures["big-mig.scrape_p50_ms"] > 0 and figures["single.read_cpu_ms"] > 0
    assert ("big-mig.ratio_cpu" in figures) == nvitop
    if nvitop:
        assert figures["big-mig.devices"] == 8 + 56
    assert "QUICK MODE" in table and "targets (big-mig)" in table


_PROTOCOL_CHILD = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {"init": lib.nvmlInitWithFlags(0)}
card, mig = ctypes.c_void_p(), ctypes.c_void_p()
out["handle"] = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(card))
out["mig"] = lib.nvmlDeviceGetMigDeviceHandleByIndex(card, 0, ctypes.byref(mig))
out["bogus"] = lib.nvmlDeviceGetUUID(ctypes.c_void_p(card.value + 1), ctypes.create_string_buffer(96), 96)
lists = lib.nvmlDeviceGetComputeRunningProcesses_v3
count = ctypes.c_uint(0)
out["sizing"] = [lists(mig, ctypes.byref(count), None), count.value]
short = ctypes.c_uint(1)
buf = (ctypes.c_char * (24 * 200))()
out["short"] = [lists(mig, ctypes.byref(short), buf), short.value]
exact = ctypes.c_uint(count.value)
out["grown"] = [lists(mig, ctypes.byref(exact), buf), exact.value]
room = ctypes.c_uint(200)
out["read"] = [lists(mig, ctypes.byref(room), buf), room.value]
out["pids"] = [int.from_bytes(buf[24 * i:24 * i + 4], "little") for i in range(room.value)][:3]
print(json.dumps(out))
"""


def test_the_size_query_protocol_as_nvml_h_describes_it(fake_libnvml_env, fake_libnvml_dir):
    """In C terms, without pynvml: a NULL array sizes the list (INSUFFICIENT_SIZE and the count),
    a short array answers INSUFFICIENT_SIZE with the count needed, a long one is filled; a list set
    to grow is longer after its sizing call; a pointer not given out is INVALID_ARGUMENT."""
    env = fake_libnvml_env("h100-mig-processes", grow={(0, 0): 50})
    out = subprocess.run([sys.executable, "-c", _PROTOCOL_CHILD, str(fake_libnvml_dir / SONAME)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    answers = json.loads(out)
    insufficient = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert answers == {
        "init": 0, "handle": 0, "mig": 0, "bogus": pynvml.NVML_ERROR_INVALID_ARGUMENT,
        "sizing": [insufficient, 2],  # MIG device 0's two processes
        "short": [insufficient, 52],  # grown since: 50 more
        "grown": [insufficient, 52],
        "read": [0, 52],
        "pids": [21180, 21181, 3000102],  # 3000000 + 1000·card + 100·(slot+1) + place in the list
    }


def test_a_process_name_that_is_not_utf8_crosses_the_library_and_is_kept(fake_libnvml_env):
    base = SCENARIOS["h100-mig-processes"]()
    odd = dataclasses.replace(base, process_names={**base.process_names, 21198: "gpu_burn-caf\udce9"})
    result = _read(fake_libnvml_env(odd), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert 'process_name="gpu_burn-caf\ufffd"' in result.stdout
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "1.0"


def test_r535_garbled_v3_lists_are_read_again_with_v2_through_the_library(fake_libnvml_env, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    garbled = dataclasses.replace(SCENARIOS["h100-mig-processes"](), r535_struct_mismatch=True)
    via_nvml = _read(fake_libnvml_env(garbled), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0, via_nvml.stderr
    assert without_volatile(via_nvml.stdout) == without_volatile(via_smi.stdout)
