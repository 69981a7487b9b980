"""Card health on the NVML path (sources/nvml_health.py), with the real pynvml over tests/fake_nvml.py.

The fixture scenarios' health is compared with nvidia-smi's by test_source_nvml's parity tests; here
are the values nvidia-smi's fixtures cannot show (a 570 card's SRAM split and recovery action, a
pre-Turing card's ECC locations and retired pages), what a read costs in calls, and what a failing
health call does to the card.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pynvml
import pytest
from click.testing import CliRunner

from conftest import scenario, without_activity
from fake_nvml import FakeHealth, demo, fake_nvml, h100_r570_sram_split, pascal_page_retirement
from mig_exporter.cli import cli
from mig_exporter.core.errors import ReadError
from mig_exporter.model.health import CardHealth, ClockReading, EccCount, RecoveryAction, grade
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.nvml import NvmlSource

HEALTH_CALLS = ("nvmlDeviceGetFieldValues", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetMarginTemperature",
                "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetSupportedClocksEventReasons",
                "nvmlDeviceGetPerformanceState", "nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo",
                "nvmlDeviceGetFanSpeed", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit",
                "nvmlDeviceGetPowerManagementDefaultLimit", "nvmlDeviceGetPowerManagementLimitConstraints",
                "nvmlDeviceGetEccMode", "nvmlDeviceGetMemoryErrorCounter", "nvmlDeviceGetSramEccErrorStatus",
                "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetRetiredPages_v2",
                "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRepairStatus")


def _hz(mhz: int) -> float:
    return mhz * 1e6


def _with_card(base, index: int, **changes):
    cards = list(base.cards)
    cards[index] = dataclasses.replace(cards[index], **changes)
    return dataclasses.replace(base, cards=tuple(cards))


def _health_calls(fake, device: str | None = None) -> int:
    return sum(fake.called(name, device) for name in HEALTH_CALLS)


def test_a_570_card_reads_every_family_field(fake_nvml_lib):
    fake = fake_nvml_lib(h100_r570_sram_split())
    card = NvmlSource().read().cards[0]
    assert card.error is None and card.temperature_celsius == 80.0
    assert card.health == CardHealth(
        memory_temperature_celsius=71.0,
        temperature_thresholds_celsius=(("shutdown", 92.0), ("slowdown", 89.0), ("max_operating", 87.0),
                                        ("memory_max_operating", 95.0), ("target", 83.0)),
        temperature_margin_celsius=3.0,
        clock_events_active=(("gpu_idle", False), ("applications_clocks_setting", False), ("sw_power_cap", True),
                             ("hw_slowdown", False), ("hw_thermal_slowdown", False),
                             ("hw_power_brake_slowdown", False), ("sync_boost", False),
                             ("sw_thermal_slowdown", False), ("display_clocks_setting", False)),
        # ns -> s, in CLOCK_EVENT_REASONS' order
        clock_event_seconds=(("sw_power_cap", 1.5), ("hw_thermal_slowdown", 0.0), ("hw_power_brake_slowdown", 0.0),
                             ("sync_boost", 0.0), ("sw_thermal_slowdown", 0.25)),
        performance_state=0,
        clocks=(ClockReading("graphics", "current", _hz(1755)), ClockReading("sm", "current", _hz(1755)),
                ClockReading("memory", "current", _hz(2619)), ClockReading("video", "current", _hz(1605)),
                ClockReading("graphics", "max", _hz(1980)), ClockReading("sm", "max", _hz(1980)),
                ClockReading("memory", "max", _hz(2619)), ClockReading("video", "max", _hz(1545))),
        fan_speed_ratio=None,  # NOT_SUPPORTED: no fan, never 0
        power_limits_watts=(("current", 650.0), ("requested", 650.0), ("default", 700.0), ("min", 200.0),
                            ("max", 700.0)),
        energy_joules=4_200_000.123,  # mJ -> J
        ecc_mode_current=True,
        ecc_mode_pending=True,
        # SRAM uncorrectable from the 570 status: parity + SEC-DED (2 + 1, 3 + 2).
        ecc_errors=(EccCount("volatile", "sram", "correctable", 5), EccCount("volatile", "sram", "uncorrectable", 3),
                    EccCount("volatile", "dram", "correctable", 1), EccCount("volatile", "dram", "uncorrectable", 0),
                    EccCount("aggregate", "sram", "correctable", 9), EccCount("aggregate", "sram", "uncorrectable", 5),
                    EccCount("aggregate", "dram", "correctable", 4),
                    EccCount("aggregate", "dram", "uncorrectable", 0)),
        ecc_sram_threshold_exceeded=True,
        remapped_rows_correctable=2,
        remapped_rows_uncorrectable=0,
        row_remap_pending=False,
        row_remap_failure=False,
        row_remap_availability_banks=(("max", 638), ("high", 2), ("partial", 0), ("low", 0), ("none", 0)),
        repair_pending=(("channel", False), ("tpc", True)),
        recovery_action=4,  # drain and reset, over the older flags that say no
        pcie_replays=2,
    )
    assert grade(card.health).state == "reset"
    # The SRAM status gave the uncorrectable counts: those counters were not asked too.
    sram_unc = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, pynvml.NVML_MEMORY_LOCATION_SRAM)
    assert [c for c in fake.calls if c.function == "nvmlDeviceGetMemoryErrorCounter" and c.args == sram_unc] == []
    assert fake.exceptions == []


def test_a_pre_turing_card_reads_its_ecc_locations_retired_pages_and_throttle_names(fake_nvml_lib):
    fake = fake_nvml_lib(pascal_page_retirement())
    card = NvmlSource().read().cards[0]
    h = card.health
    locations = ("device_memory", "register_file", "l1_cache", "l2_cache", "texture_memory", "texture_shm")
    # nvidia-smi's older order: scope, type, location; CBU answers NOT_SUPPORTED and is left out.
    assert h.ecc_errors == tuple(
        EccCount(scope, memory, kind, counts.get(memory, 0))
        for scope, by_kind in (("volatile", {"correctable": {"device_memory": 3}, "uncorrectable": {}}),
                               ("aggregate", {"correctable": {"device_memory": 12},
                                              "uncorrectable": {"device_memory": 1}}))
        for kind, counts in by_kind.items() for memory in locations)
    assert (h.retired_pages_single_bit, h.retired_pages_double_bit, h.retired_pages_pending) == (2, 1, True)
    # A 470 driver has only the ...ThrottleReasons calls; its card does not support sync_boost or display.
    assert fake.called("nvmlDeviceGetCurrentClocksThrottleReasons") == 1
    assert [name for name, _ in h.clock_events_active] == [
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "hw_thermal_slowdown",
        "hw_power_brake_slowdown", "sw_thermal_slowdown"]
    assert h.active("sw_power_cap")
    assert h.temperature_thresholds_celsius == (("shutdown", 85.0), ("slowdown", 82.0), ("max_operating", 80.0))
    # What the card or driver does not have stays unknown, never 0.
    assert (h.memory_temperature_celsius, h.temperature_margin_celsius, h.remapped_rows_correctable,
            h.ecc_sram_threshold_exceeded, h.recovery_action, h.clock_event_seconds, h.repair_pending) == (
        None, None, None, None, None, (), ())
    assert (h.pcie_replays, h.energy_joules) == (7, 912_345.678)
    assert grade(h).state == "reset"  # the pending retirement
    assert fake.exceptions == []


def test_retired_pages_are_sized_with_four_arguments_and_read_with_five(fake_nvml_lib):
    # Without FieldValues (whose RETIRED_SBE/_DBE give the counts), the pages themselves are read.
    base = pascal_page_retirement()
    fake = fake_nvml_lib(dataclasses.replace(base, missing_functions=base.missing_functions
                                             | {"nvmlDeviceGetFieldValues"}))
    assert NvmlSource().read().cards[0].health.retired_pages_single_bit == 2
    assert fake.arities == [("nvmlDeviceGetRetiredPages_v2", 4), ("nvmlDeviceGetRetiredPages_v2", 5)] * 2
    # pynvml's own wrapper reads the addresses and the timestamps of the second call.
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    double = pynvml.nvmlDeviceGetRetiredPages_v2(handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert [p["address"] for p in double] == [0x3F00000] and double[0]["timestamp"] > 0
    # A card without page retirement answers the sizing call: no array is read.
    fake.arities.clear()
    fake.set_scenario(_with_card(fake.scenario, 0, health=FakeHealth()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRetiredPages_v2(handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert fake.arities == [("nvmlDeviceGetRetiredPages_v2", 4)]
    assert fake.exceptions == []


def test_field_values_is_called_once_per_card_per_read(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    source = NvmlSource()
    for reads in (1, 2, 3):
        source.read()
        assert [fake.called("nvmlDeviceGetFieldValues", card) for card in ("card0", "card1")] == [reads, reads]
    assert fake.called("nvmlDeviceGetFieldValues") == 6  # never on a MIG device
    assert fake.exceptions == []


def test_a_field_failing_inside_a_successful_call_leaves_only_that_value_unknown(fake_nvml_lib):
    base = demo()
    health = dataclasses.replace(base.cards[1].health,
                                 field_errors={"NVML_FI_DEV_MEMORY_TEMP": pynvml.NVML_ERROR_UNKNOWN})
    fake = fake_nvml_lib(_with_card(base, 1, health=health))
    card = NvmlSource().read().cards[1]
    assert card.error is None
    assert card.health.memory_temperature_celsius is None
    assert (card.health.pcie_replays, card.health.energy_joules, card.health.recovery_action) == (0, 18_602_915.0, 0)
    assert card.health.row_remap_pending is True
    assert fake.exceptions == []


def test_a_lost_card_inside_field_values_marks_the_card(fake_nvml_lib):
    base = demo()
    health = dataclasses.replace(base.cards[1].health,
                                 field_errors={"NVML_FI_DEV_MEMORY_TEMP": pynvml.NVML_ERROR_GPU_IS_LOST})
    fake = fake_nvml_lib(_with_card(base, 1, health=health))
    snapshot = NvmlSource().read()
    assert snapshot.cards[1].error == "NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetFieldValues"
    assert snapshot.cards[0].error is None and snapshot.cards[0].health.memory_temperature_celsius == 41.0
    assert fake.exceptions == []


def test_gpu_is_lost_in_a_health_call_marks_the_card_as_any_other_call_does(fake_nvml_lib):
    fake = fake_nvml_lib(_with_card(demo(), 1, errors={"nvmlDeviceGetPerformanceState": pynvml.NVML_ERROR_GPU_IS_LOST}))
    snapshot = NvmlSource().read()
    lost, other = snapshot.cards[1], snapshot.cards[0]
    assert lost.error == "NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetPerformanceState"
    assert lost.uuid == "GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96"  # what was read before it is kept
    assert snapshot.device(1) is None
    assert other.error is None and [d.index for d in snapshot.devices] == [1000, 1001, 1002]
    assert fake.exceptions == []


def test_a_health_call_refused_alone_leaves_only_its_values_unknown(fake_nvml_lib):
    # The remapped rows refused both as fields and by their own call; the histogram still answers.
    refused = {name: pynvml.NVML_ERROR_NO_PERMISSION for name in (
        "NVML_FI_DEV_REMAPPED_COR", "NVML_FI_DEV_REMAPPED_UNC", "NVML_FI_DEV_REMAPPED_PENDING",
        "NVML_FI_DEV_REMAPPED_FAILURE")}
    base = demo()
    health = dataclasses.replace(base.cards[1].health, field_errors=refused)
    fake = fake_nvml_lib(_with_card(base, 1, health=health,
                                    errors={"nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_NO_PERMISSION}))
    card = NvmlSource().read().cards[1]
    assert card.error is None
    assert (card.health.remapped_rows_uncorrectable, card.health.row_remap_pending) == (None, None)
    assert card.health.row_remap_availability_banks == (("max", 639), ("high", 1), ("partial", 0), ("low", 0),
                                                        ("none", 0))
    assert fake.called("nvmlDeviceGetRemappedRows", "card1") == 1  # each field refused: its own call asked
    assert fake.exceptions == []


def test_a_card_without_health_still_reads_memory_and_processes_and_is_not_asked_again(fake_nvml_lib):
    base = demo()
    fake = fake_nvml_lib(dataclasses.replace(base, cards=tuple(
        dataclasses.replace(c, health=FakeHealth(), mig_devices=tuple(
            dataclasses.replace(m, sram_uncorrectable_volatile=None) for m in c.mig_devices))
        for c in base.cards)))
    source = NvmlSource()
    snapshot = without_activity(source.read())
    expected = scenario_without_health("demo")
    assert snapshot.devices == expected.devices and snapshot.processes == expected.processes
    assert [c.health for c in snapshot.cards] == [CardHealth(), CardHealth()]
    assert [c.temperature_celsius for c in snapshot.cards] == [34.0, 51.0]
    first = _health_calls(fake)
    assert first > 40
    assert without_activity(source.read()) == snapshot
    assert _health_calls(fake) == first  # NOT_SUPPORTED is remembered per card
    assert fake.exceptions == []


def scenario_without_health(name: str):
    """The nvidia-smi path's snapshot of a scenario, without its instances' own ECC counts."""
    snapshot = DemoSource().read() if name == "demo" else scenario(name)
    devices = tuple(dataclasses.replace(d, ecc_errors=()) for d in snapshot.devices)
    return dataclasses.replace(snapshot, devices=devices)


def test_unsupported_calls_are_asked_again_after_nvml_is_initialised_again(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    source = NvmlSource()
    source.read()
    assert fake.called("nvmlDeviceGetMarginTemperature", "card0") == 1  # card 0 has none
    counts = [c.args[0] for c in fake.calls if c.function == "nvmlDeviceGetFieldValues"]
    source.read()
    assert fake.called("nvmlDeviceGetMarginTemperature", "card0") == 1  # card 0 has none
    # The second read asks only the fields that answered: the rest were NOT_SUPPORTED. The first asks
    # every field of 575's header the exporter reads: 26, less the 4 remapped-row fields in MIG mode.
    again = [c.args[0] for c in fake.calls if c.function == "nvmlDeviceGetFieldValues"][len(counts):]
    assert counts == [22, 26] and again == [18, 22]
    healthy = fake.scenario
    fake.set_scenario(dataclasses.replace(healthy, system_errors={"nvmlDeviceGetCount_v2":
                                                                  pynvml.NVML_ERROR_UNINITIALIZED}))
    with pytest.raises(ReadError):
        source.read()
    fake.set_scenario(healthy)
    source.read()  # a new initialisation may be a new driver: asked again
    assert fake.called("nvmlDeviceGetMarginTemperature", "card0") == 2
    assert fake.exceptions == []


FIXED = {"nvmlDeviceGetMaxClockInfo": 4, "nvmlDeviceGetPowerManagementLimitConstraints": 1,
         "nvmlDeviceGetPowerManagementDefaultLimit": 1, "nvmlDeviceGetSupportedClocksEventReasons": 1,
         "nvmlDeviceGetTemperatureThreshold": 4}  # per card: every threshold but the settable target


def test_what_a_card_keeps_while_the_driver_is_loaded_is_asked_once_until_nvml_is_initialised_again(
        fake_nvml_lib):
    fake = fake_nvml_lib(h100_r570_sram_split())  # one card, with a target temperature
    source = NvmlSource()
    first = source.read()
    assert dict(first.cards[0].health.temperature_thresholds_celsius)["target"] == 83.0
    once = {name: n + (name == "nvmlDeviceGetTemperatureThreshold") for name, n in FIXED.items()}
    asked = {name: fake.called(name) for name in FIXED}
    assert asked == once
    assert source.read() == first
    # Again: of the kept ones only the target temperature, and every changing value.
    assert {name: fake.called(name) - asked[name] for name in FIXED} == {
        name: int(name == "nvmlDeviceGetTemperatureThreshold") for name in FIXED}
    assert fake.called("nvmlDeviceGetClockInfo") == 2 * 4
    healthy = fake.scenario
    fake.set_scenario(dataclasses.replace(healthy, system_errors={"nvmlDeviceGetCount_v2":
                                                                  pynvml.NVML_ERROR_UNINITIALIZED}))
    with pytest.raises(ReadError):
        source.read()
    fake.set_scenario(healthy)
    before = {name: fake.called(name) for name in FIXED}
    assert source.read() == first  # a new initialisation may be a new driver: asked again
    assert {name: fake.called(name) - before[name] for name in FIXED} == once
    assert fake.exceptions == []


def test_temperature_v_is_preferred_and_the_deprecated_call_is_the_fallback(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    assert [c.temperature_celsius for c in NvmlSource().read().cards] == [34.0, 51.0]
    assert (fake.called("nvmlDeviceGetTemperatureV"), fake.called("nvmlDeviceGetTemperature")) == (2, 0)
    assert fake.exceptions == []


def test_an_older_driver_reads_the_temperature_through_the_deprecated_call(fake_nvml_lib):
    fake = fake_nvml_lib(pascal_page_retirement())
    source = NvmlSource()
    assert source.read().cards[0].temperature_celsius == 44.0
    assert source.read().cards[0].temperature_celsius == 44.0
    assert "nvmlDeviceGetTemperatureV" in fake.missing_lookups
    assert fake.called("nvmlDeviceGetTemperature") == 2
    assert fake.exceptions == []


def test_without_field_values_energy_and_replays_come_from_their_own_calls(fake_nvml_lib):
    fake = fake_nvml_lib(dataclasses.replace(demo(), missing_functions=frozenset({"nvmlDeviceGetFieldValues"})))
    health = NvmlSource().read().cards[1].health
    assert (health.energy_joules, health.pcie_replays) == (18_602_915.0, 0)
    assert (health.memory_temperature_celsius, health.recovery_action) == (None, None)  # no single call for these
    assert fake.called("nvmlDeviceGetTotalEnergyConsumption") == 2
    assert fake.exceptions == []


def test_ecc_counters_are_not_asked_while_ecc_is_off(fake_nvml_lib):
    base = demo()
    off = dataclasses.replace(base.cards[1].health, ecc_mode=(False, True))
    fake = fake_nvml_lib(_with_card(base, 1, health=off))
    health = NvmlSource().read().cards[1].health
    assert (health.ecc_mode_current, health.ecc_mode_pending, health.ecc_errors) == (False, True, ())
    assert fake.called("nvmlDeviceGetMemoryErrorCounter", "card1") == 0
    assert fake.exceptions == []


def test_a_mig_instance_reads_its_own_sram_errors_and_no_card_health(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    snapshot = NvmlSource().read()
    assert [d.ecc_errors for d in snapshot.devices] == [
        (EccCount("volatile", "sram", "uncorrectable", 1),), (EccCount("volatile", "sram", "uncorrectable", 0),),
        (EccCount("volatile", "sram", "uncorrectable", 0),), ()]
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
    for call in (lambda: pynvml.nvmlDeviceGetTemperatureThreshold(mig, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                 lambda: pynvml.nvmlDeviceGetEccMode(mig), lambda: pynvml.nvmlDeviceGetRemappedRows(mig),
                 lambda: pynvml.nvmlDeviceGetMemoryErrorCounter(mig, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                                pynvml.NVML_VOLATILE_ECC,
                                                                pynvml.NVML_MEMORY_LOCATION_SRAM)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert fake.exceptions == []


def test_the_remapper_is_not_asked_of_a_card_in_mig_mode(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    cards = NvmlSource().read().cards
    assert (cards[0].health.row_remap_pending, cards[1].health.row_remap_pending) == (None, True)
    # Card 1's come from its fields; card 0 (MIG mode) asks neither the four fields nor the call.
    assert fake.called("nvmlDeviceGetRemappedRows") == 0
    asked = {c.device: c.args[0] for c in fake.calls if c.function == "nvmlDeviceGetFieldValues"}
    assert asked["card1"] - asked["card0"] == 4
    with pytest.raises(pynvml.NVMLError_NotSupported):  # NVML: not supported in MIG mode
        pynvml.nvmlDeviceGetRemappedRows(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert fake.exceptions == []


def test_read_source_nvml_exports_the_health_families(fake_nvml_lib):
    fake = fake_nvml_lib(h100_r570_sram_split())
    result = CliRunner().invoke(cli, ["read", "--source", "nvml"])
    assert result.exit_code == 0, result.output
    lines = set(result.stdout.splitlines())
    for line in ('mig_exporter_card_energy_joules_total{card="0"} 4.200000123e+06',
                 'mig_exporter_card_ecc_errors_total{card="0",memory="sram",scope="volatile",type="uncorrectable"} 3.0',
                 'mig_exporter_card_ecc_sram_threshold_exceeded{card="0"} 1.0',
                 'mig_exporter_card_clock_event_seconds_total{card="0",reason="sw_power_cap"} 1.5',
                 'mig_exporter_card_recovery_action{card="0"} 4.0',
                 'mig_exporter_card_repair_pending{card="0",unit="tpc"} 1.0',
                 'mig_exporter_card_health{card="0",state="reset"} 1.0'):
        assert line in lines, line
    assert fake.exceptions == []


# -- the driver's own header: field ids and the recovery enum (sources/nvml_header.py) -------------

# The counters in ns, and power smoothing on, by NVML's names: each fake driver answers them at ITS
# header's ids (tests/fake_nvml.py's FAKE_FIELD_IDS), whatever ids the installed pynvml has.
COUNTER_FIELDS = {
    "NVML_FI_DEV_PERF_POLICY_POWER": 1_500_000_000, "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST": 0,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 250_000_000,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 0,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 7_000_000_000,
    "NVML_FI_PWR_SMOOTHING_ENABLED": 1,
}


def _on_driver(base, driver: str, nvml_version: str | None = None, **fields):
    """``base``'s first card alone, on ``driver``, its fields replaced by ``fields``."""
    card = base.cards[0]
    health = dataclasses.replace(card.health, fields={**fields})
    cuda = 12090 if driver.startswith("57") else 13000
    return dataclasses.replace(base, driver_version=driver, cuda_version=cuda, nvml_version=nvml_version,
                               cards=(dataclasses.replace(card, health=health),))


@pytest.mark.parametrize(("driver", "seconds", "asked"), [
    # 570's header has no thermal counters (251-268 are power smoothing): none asked, none read.
    ("570.86.15", (("sw_power_cap", 1.5), ("sync_boost", 0.0)), {74, 76}),
    ("575.57.08", (("sw_power_cap", 1.5), ("hw_thermal_slowdown", 0.0), ("hw_power_brake_slowdown", 7.0),
                   ("sync_boost", 0.0), ("sw_thermal_slowdown", 0.25)), {74, 76, 251, 252, 253}),
    ("580.65.06", (("sw_power_cap", 1.5), ("hw_thermal_slowdown", 0.0), ("hw_power_brake_slowdown", 7.0),
                   ("sync_boost", 0.0), ("sw_thermal_slowdown", 0.25)), {74, 76, 251, 252, 253}),
    # 590: at 269-271; 251 is power smoothing (on: 1), never read as 1 ns of thermal slowdown.
    ("590.44.01", (("sw_power_cap", 1.5), ("hw_thermal_slowdown", 0.0), ("hw_power_brake_slowdown", 7.0),
                   ("sync_boost", 0.0), ("sw_thermal_slowdown", 0.25)), {74, 76, 269, 270, 271}),
])
def test_clock_event_counters_are_read_at_the_ids_of_the_driver_s_header(fake_nvml_lib, monkeypatch, driver,
                                                                        seconds, asked):
    fake = fake_nvml_lib(_on_driver(h100_r570_sram_split(), driver, **COUNTER_FIELDS))
    ids: list[int] = []
    original = fake.lib._functions["nvmlDeviceGetFieldValues"]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    def recording(handle, count, values):  # the ids asked, read from the caller's array
        ids.extend(entry.fieldId for entry in (pynvml.c_nvmlFieldValue_t * count).from_address(values))
        return original(handle, count, values)

    monkeypatch.setitem(fake.lib._functions, "nvmlDeviceGetFieldValues", recording)
    health = NvmlSource().read().cards[0].health
    assert health.clock_event_seconds == seconds
    assert {fid for fid in ids if fid in {74, 76, *range(251, 272)}} == asked
    assert fake.exceptions == []


@pytest.mark.parametrize(("driver", "nvml_version", "number", "action", "unknown", "state"), [
    ("580.65.06", None, 4, 4, None, "reset"),
    # 580's header stops at 4 (its nvidia-ml-py's GPU_RESET_BUS = 5 is the binding's alone): unknown.
    ("580.65.06", None, 5, None, "5", "warning"),
    ("610.12", "13.610.12", 5, int(RecoveryAction.RECOVER_IMEX_DOMAIN), None, "warning"),
    ("615.3", "13.615.3", 6, int(RecoveryAction.BUS_RESET), None, "reset"),
    ("615.3", "13.615.3", 7, int(RecoveryAction.SYSTEM_REBOOT), None, "reset"),
    ("615.3", "13.615.3", 8, None, "8", "warning"),
])
def test_the_recovery_action_is_read_by_the_name_the_driver_s_header_gives_it(fake_nvml_lib, driver, nvml_version,
                                                                             number, action, unknown, state):
    fake = fake_nvml_lib(_on_driver(h100_r570_sram_split(), driver, nvml_version,
                                    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION=number))
    card = NvmlSource().read().cards[0]
    assert (card.health.recovery_action, card.health.recovery_action_unknown) == (action, unknown)
    verdict = grade(card.health)
    code = "recovery_action_unknown" if unknown else "recovery_action"
    assert dict(zip(verdict.codes, verdict.states, strict=True))[code] == state
    assert fake.exceptions == []


def test_unrepairable_memory_is_read_and_grades_replace(fake_nvml_lib):
    base = h100_r570_sram_split()
    health = dataclasses.replace(base.cards[0].health, unrepairable_memory=True)
    fake = fake_nvml_lib(_with_card(base, 0, health=health))
    card = NvmlSource().read().cards[0]
    assert card.health.unrepairable_memory is True
    verdict = grade(card.health)
    assert verdict.state == "replace" and verdict.codes[0] == "unrepairable_memory"
    assert fake.exceptions == []


def test_a_driver_without_the_unrepairable_memory_call_is_asked_once(fake_nvml_lib):
    base = demo()
    fake = fake_nvml_lib(dataclasses.replace(base, missing_functions=frozenset(
        {"nvmlDeviceGetUnrepairableMemoryFlag_v1"})))
    source = NvmlSource()
    for _ in range(3):
        assert [c.health.unrepairable_memory for c in source.read().cards] == [None, None]
    # Once per card: pynvml caches only a symbol it found.
    assert fake.missing_lookups.count("nvmlDeviceGetUnrepairableMemoryFlag_v1") == 2
    assert fake.exceptions == []


def test_the_pcie_link_is_read_and_its_maximum_asked_once_per_initialisation(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    source = NvmlSource()
    for _ in range(3):
        links = [(h.pcie_link_generation_current, h.pcie_link_generation_max, h.pcie_link_width_current,
                  h.pcie_link_width_max) for h in (c.health for c in source.read().cards)]
        assert links == [(4, 4, 16, 16), (4, 4, 4, 16)]  # card 1 trained at x4 of x16
    assert (fake.called("nvmlDeviceGetCurrPcieLinkWidth"), fake.called("nvmlDeviceGetMaxPcieLinkWidth"),
            fake.called("nvmlDeviceGetMaxPcieLinkGeneration")) == (6, 2, 2)
    assert fake.exceptions == []


def test_the_serial_is_read_once_per_card_and_initialisation(fake_nvml_lib):
    base = demo()
    fake = fake_nvml_lib(_with_card(base, 1, serial=None))  # a card without one (GeForce: NOT_SUPPORTED)
    source = NvmlSource()
    for _ in range(3):
        assert [c.serial for c in source.read().cards] == ["1653922034781", None]
    assert (fake.called("nvmlDeviceGetSerial", "card0"), fake.called("nvmlDeviceGetSerial", "card1")) == (1, 1)
    assert fake.exceptions == []


# The calls the FieldValues batch stands in for, where the driver's header has their fields.
BATCHED = ("nvmlDeviceGetEccMode", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages_v2",
           "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetEnforcedPowerLimit",
           "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetTotalEnergyConsumption",
           "nvmlDeviceGetPcieReplayCounter")


NOT_HEALTH = frozenset({"nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMigMode",
                        "nvmlDeviceGetTemperatureV", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates",
                        "nvmlDeviceGetMemoryInfo_v2"})


def test_field_values_batch_the_health_values_nvml_has_field_ids_for(fake_nvml_lib):
    base = demo()  # card 1 given page retirement too (an A100 retires rows): every batched call has its field
    health = dataclasses.replace(base.cards[1].health, retired_pending=False, retired_pages={})
    fake = fake_nvml_lib(_with_card(base, 1, health=health))
    source = NvmlSource()
    first = source.read().cards[1]
    before = len(fake.calls)
    again = source.read().cards[1]
    assert again == first
    calls = [c.function for c in fake.calls[before:] if c.device == "card1" and c.function not in NOT_HEALTH
             and "RunningProcesses" not in c.function and c.function != "nvmlDeviceGetProcessUtilization"]
    # A whole A100 on 575, at every later read: 15 health calls, of which 1 FieldValues (26 fields): the
    # clock reasons, P-state, margin, 4 clocks, 4 SRAM counters, the remapper histogram, the PCIe link
    # now (2). Without the batch, the 11 calls its fields stand in for made it 26.
    assert len(calls) == 15 and calls.count("nvmlDeviceGetFieldValues") == 1
    assert [name for name in BATCHED if name in calls] == []
    dram = [c for c in fake.calls if c.function == "nvmlDeviceGetMemoryErrorCounter" and c.device == "card1"
            and c.args[2] == pynvml.NVML_MEMORY_LOCATION_DRAM]
    assert dram == []  # the four DRAM counts are fields too
    h = again.health
    assert (h.ecc_mode_current, h.retired_pages_single_bit, h.retired_pages_pending, h.row_remap_pending,
            dict(h.power_limits_watts)["current"]) == (True, 0, False, True, 400.0)
    assert fake.exceptions == []


def test_without_field_values_each_value_is_asked_by_its_own_call(fake_nvml_lib):
    with fake_nvml("demo"):
        expected = NvmlSource().read()
    fake = fake_nvml_lib(dataclasses.replace(demo(), missing_functions=frozenset({"nvmlDeviceGetFieldValues"})))
    alone = NvmlSource().read()
    for ours, theirs in zip(alone.cards, expected.cards, strict=True):
        blank = dict.fromkeys(("memory_temperature_celsius", "clock_event_seconds", "recovery_action"))
        blank["clock_event_seconds"] = ()
        assert ours.health == dataclasses.replace(theirs.health, **blank)  # what only a field gives is unknown
    assert fake.called("nvmlDeviceGetRemappedRows", "card1") == 1
    assert fake.exceptions == []
