"""A card's health read from ``nvidia-smi -q -x`` (nvidia_smi/health_xml.py): one real report
of each layout NOTES.md lists in ../shared/fixtures/nvidia-smi/real/, with the values written
down by reading each file's XML; every other report and fixture reads without a problem line;
the demo's wear reads as the demo means it; and a MIG device's own ECC counts read the same
through the fast reading of ``<mig_devices>`` (and its memo) as through lxml."""

from __future__ import annotations

import ast
import random
import re

import pytest

from conftest import FIXTURES, REPO, SAMPLES, require_real_corpus
from mig_exporter.model.health import NO_HEALTH, CardHealth, ClockReading, EccCount, grade
from mig_exporter.nvidia_smi import query_xml
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi
from mig_exporter.nvidia_smi.query_xml import SectionMemo, parse_query_xml

NOT_PLAIN = b"<!-- read whole -->"  # after the root: the report is parsed whole by lxml


def _report(name: str) -> query_xml.QueryReport:
    report = parse_query_xml((require_real_corpus() / name).read_bytes())
    assert report.problems == ()
    return report


def _health(name: str, card: int = 0) -> CardHealth:
    return _report(name).cards[card].health


def _bent(name: str, *replacements: tuple[bytes, bytes]) -> CardHealth:
    """The first card's health in a real report with some of its values changed."""
    data = (require_real_corpus() / name).read_bytes()
    for old, new in replacements:
        assert old in data
        data = data.replace(old, new, 1)
    report = parse_query_xml(data)
    assert report.problems == ()
    return report.cards[0].health


def _mhz(*values: int) -> tuple[float, ...]:
    return tuple(v * 1_000_000.0 for v in values)


# --- clock events: clocks_throttle_reasons (<=525) and clocks_event_reasons (535+) ---


def test_clocks_throttle_reasons_of_a_525_driver_that_says_v12():
    # The DOCTYPE says v12; the names are v11's.
    h = _health("telegraf-quadro-p2000-v12-drv525.xml")
    assert h.clock_events_active == (
        ("gpu_idle", True), ("applications_clocks_setting", False), ("sw_power_cap", False),
        ("hw_slowdown", False), ("hw_thermal_slowdown", False), ("hw_power_brake_slowdown", False),
        ("sync_boost", False), ("sw_thermal_slowdown", False), ("display_clocks_setting", False))
    assert h.clock_event_seconds == ()
    assert h.performance_state == 8
    assert h.fan_speed_ratio == 0.46


def test_v7_throttle_reasons_leave_out_the_unknown_reason():
    h = _health("rai-grid-k520-v7-drv352.xml")
    assert h.clock_events_active == (
        ("gpu_idle", True), ("applications_clocks_setting", False), ("sw_power_cap", False), ("hw_slowdown", False))


def test_a_throttle_reason_the_card_does_not_have_is_left_out():
    # GTX 1080 (460): hw_power_brake_slowdown and hw_thermal_slowdown are N/A on some cards;
    # here sw_power_cap is Active on both.
    report = _report("a0s-2x-gtx1080-v11-drv460.xml")
    assert [c.health.active("sw_power_cap") for c in report.cards] == [True, True]
    assert [c.health.pcie_replays for c in report.cards] == [65535, 552]


def test_clocks_event_reasons_of_535_without_counters():
    h = _health("netdata-rtx-4090-v12-drv535.xml")
    # applications_clocks_setting's "Not Active" is broken across two lines in this file.
    assert dict(h.clock_events_active) == {
        "gpu_idle": True, "applications_clocks_setting": False, "sw_power_cap": False, "hw_slowdown": False,
        "hw_thermal_slowdown": False, "hw_power_brake_slowdown": False, "sync_boost": False,
        "sw_thermal_slowdown": False, "display_clocks_setting": False}
    assert h.clock_event_seconds == ()
    assert h.performance_state == 8
    assert h.fan_speed_ratio == 0.0
    assert h.clocks == (
        *(ClockReading(c, "current", hz) for c, hz in zip(("graphics", "sm", "memory", "video"),
                                                            _mhz(210, 210, 405, 1185), strict=True)),
        *(ClockReading(c, "max", hz) for c, hz in zip(("graphics", "sm", "memory", "video"),
                                                        _mhz(3120, 3120, 10501, 2415), strict=True)))


def test_clock_event_counters_of_575_in_seconds_under_the_reasons_names():
    h = _health("llamaland-rtx-a5000-laptop-v12-drv575.xml")
    # sw_power_cap 57824 us; sw_therm_slowdown, hw_therm_slowdown and hw_power_brake 0 us.
    assert h.clock_event_seconds == (
        ("sw_power_cap", 0.057824), ("hw_thermal_slowdown", 0.0), ("hw_power_brake_slowdown", 0.0),
        ("sync_boost", 0.0), ("sw_thermal_slowdown", 0.0))
    assert h.active("gpu_idle") and not h.active("sw_power_cap")


def test_clock_event_counters_of_590():
    h = _health("telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml")
    assert dict(h.clock_event_seconds) == {
        "sw_power_cap": 25483.012608, "hw_thermal_slowdown": 0.0, "hw_power_brake_slowdown": 0.0,
        "sync_boost": 0.0, "sw_thermal_slowdown": 0.0}


# --- power limits: power_readings (<=525), gpu_power_readings (535+), 570's average/instant ---


def test_power_readings_limits_by_their_old_names():
    # enforced_power_limit 216 (current), power_limit 216 (requested), default 200, min 100, max 216.
    h = _health("a0s-2x-gtx1080-v11-drv460.xml")
    assert h.power_limits_watts == (
        ("current", 216.0), ("requested", 216.0), ("default", 200.0), ("min", 100.0), ("max", 216.0))


def test_gpu_power_readings_limits_of_535():
    h = _health("netdata-rtx-4090-v12-drv535.xml")
    assert h.power_limits_watts == (
        ("current", 450.0), ("requested", 450.0), ("default", 450.0), ("min", 10.0), ("max", 600.0))


def test_gpu_power_readings_of_570_with_average_and_instant_draws():
    report = _report("telegraf-rtx-3060-v12-drv570.xml")
    assert report.cards[0].power_draw_watts == 11.60
    assert report.cards[0].health.power_limits_watts == (
        ("current", 170.0), ("requested", 170.0), ("default", 170.0), ("min", 100.0), ("max", 190.0))


def test_a_v100_on_power_readings_with_every_clock():
    h = _health("pai-v100-sxm3-retired-pages-v10-drv410.xml")
    assert h.power_limits_watts == (
        ("current", 350.0), ("requested", 350.0), ("default", 350.0), ("min", 100.0), ("max", 350.0))
    assert [r.hertz for r in h.clocks] == list(_mhz(135, 135, 958, 555, 1597, 1597, 958, 1432))
    assert h.fan_speed_ratio is None  # N/A: a fanless SXM card
    assert h.performance_state == 0


# --- ECC: pre-Turing locations, Turing sram/dram, 570's parity/secded split ---


def test_pre_turing_ecc_by_location_with_the_v100s_errors():
    h = _health("pai-v100-sxm3-retired-pages-v10-drv410.xml")
    assert (h.ecc_mode_current, h.ecc_mode_pending) == (True, True)
    errors = {(e.scope, e.memory, e.type): e.errors for e in h.ecc_errors}
    assert errors[("volatile", "device_memory", "correctable")] == 1
    assert errors[("volatile", "device_memory", "uncorrectable")] == 1
    assert errors[("aggregate", "device_memory", "correctable")] == 291
    assert errors[("aggregate", "device_memory", "uncorrectable")] == 7627
    assert errors[("volatile", "cbu", "uncorrectable")] == 0
    # texture_memory and texture_shm are N/A; cbu is N/A for single bit; "total" is never one.
    assert not {"texture_memory", "texture_shm", "total"} & {e.memory for e in h.ecc_errors}
    assert ("volatile", "cbu", "correctable") not in errors
    assert len(errors) == 4 * 4 + 2  # device_memory, register_file, l1, l2 by scope and type; cbu double bit
    assert sum(n for (scope, _, kind), n in errors.items() if (scope, kind) == ("aggregate", "uncorrectable")) == 7627


def test_pre_turing_ecc_of_a_k80_and_its_old_pending_flag():
    h = _health("pai-4x-tesla-k80-v10-drv430.xml")
    errors = {(e.scope, e.memory, e.type): e.errors for e in h.ecc_errors}
    assert errors[("aggregate", "device_memory", "correctable")] == 7
    assert errors[("aggregate", "device_memory", "uncorrectable")] == 7
    assert errors[("volatile", "texture_memory", "correctable")] == 0
    assert (h.retired_pages_single_bit, h.retired_pages_double_bit) == (1, 1)
    assert h.retired_pages_pending is False  # pending_blacklist: the only flag this file has


def test_turing_ecc_by_sram_and_dram():
    h = _health("telegraf-tesla-t4-v11-drv515.xml")
    assert h.ecc_errors == tuple(EccCount(scope, memory, kind, 0) for scope in ("volatile", "aggregate")
                                 for memory in ("sram", "dram") for kind in ("correctable", "uncorrectable"))
    assert h.ecc_sram_threshold_exceeded is None


def test_an_a100_in_mig_mode_gives_aggregate_counts_and_no_remapped_rows():
    report = _report("netdata-a100-sxm4-40gb-mig-v11-drv510.xml")
    h = report.cards[0].health
    assert [e.scope for e in h.ecc_errors] == ["aggregate"] * 4  # volatile: all N/A
    assert all(e.errors == 0 for e in h.ecc_errors)
    assert h.remapped_rows_correctable is None and h.row_remap_availability_banks == ()
    assert h.memory_temperature_celsius == 44.0
    assert h.temperature_thresholds_celsius == (
        ("shutdown", 92.0), ("slowdown", 89.0), ("max_operating", 85.0), ("memory_max_operating", 95.0))
    zero = (EccCount("volatile", "sram", "uncorrectable", 0),)
    assert [i.ecc_errors for i in report.cards[0].instances] == [zero, zero]


def test_570_parity_and_secded_split_all_na_reads_as_nothing():
    h = _health("telegraf-rtx-3060-v12-drv570.xml")
    assert h.ecc_errors == () and h.ecc_sram_threshold_exceeded is None
    assert (h.ecc_mode_current, h.ecc_mode_pending) == (None, None)


def test_570_parity_and_secded_add_up_to_sram_uncorrectable():
    h = _bent("telegraf-rtx-3060-v12-drv570.xml",
              (b"<sram_uncorrectable_parity>N/A", b"<sram_uncorrectable_parity>2"),
              (b"<sram_uncorrectable_secded>N/A", b"<sram_uncorrectable_secded>3"),
              (b"<sram_threshold_exceeded>N/A", b"<sram_threshold_exceeded>Yes"))
    assert h.ecc_errors == (EccCount("volatile", "sram", "uncorrectable", 5),)
    assert h.ecc_sram_threshold_exceeded is True


def test_a_plain_sram_uncorrectable_wins_over_its_parts():
    h = _bent("telegraf-rtx-3060-v12-drv570.xml",
              (b"<sram_uncorrectable_parity>N/A", b"<sram_uncorrectable>4</sram_uncorrectable>"
                                                  b"<sram_uncorrectable_parity>2"))
    assert h.ecc_errors == (EccCount("volatile", "sram", "uncorrectable", 4),)


# --- remapped rows: N/A or a structure with its histogram ---


def test_remapped_rows_na_reads_as_nothing():
    h = _health("telegraf-rtx-3060-v12-drv570.xml")
    assert (h.remapped_rows_correctable, h.remapped_rows_uncorrectable, h.row_remap_pending,
            h.row_remap_failure, h.row_remap_availability_banks) == (None, None, None, None, ())


def test_remapped_rows_with_the_histogram_in_banks():
    h = _health("netdata-rtx-4090-v12-drv535.xml")
    assert (h.remapped_rows_correctable, h.remapped_rows_uncorrectable) == (0, 0)
    assert (h.row_remap_pending, h.row_remap_failure) == (False, False)
    assert h.row_remap_availability_banks == (("max", 192), ("high", 0), ("partial", 0), ("low", 0), ("none", 0))


# --- retired pages: v9 and v10+ ---


def test_retired_pages_v10_on_the_v100_populated_and_pending():
    h = _health("pai-v100-sxm3-retired-pages-v10-drv410.xml")
    assert (h.retired_pages_single_bit, h.retired_pages_double_bit, h.retired_pages_pending) == (0, 2, True)


def test_retired_pages_v9_all_na_and_with_counts():
    name = "pai-6x-gtx1070-v9-drv384.xml"
    h = _health(name)
    assert (h.retired_pages_single_bit, h.retired_pages_double_bit, h.retired_pages_pending) == (None, None, None)
    counted = _bent(name, (b"<retired_count>N/A", b"<retired_count>3"), (b"<retired_count>N/A", b"<retired_count>1"),
                    (b"<pending_retirement>N/A", b"<pending_retirement>No"))
    assert (counted.retired_pages_single_bit, counted.retired_pages_double_bit) == (3, 1)
    assert counted.retired_pages_pending is False


def test_pending_retirement_wins_over_pending_blacklist_where_both_are_written():
    h = _bent("netdata-tesla-p100-v11-drv510.xml", (b"<pending_retirement>No", b"<pending_retirement>Yes"))
    assert h.retired_pages_pending is True


# --- temperature: T.Limit margins against absolute thresholds ---


def test_tlimit_offsets_of_an_rtx_4090_on_535_are_never_thresholds():
    h = _health("netdata-rtx-4090-v12-drv535.xml")
    # gpu_temp_max_tlimit_threshold -7 C, slow -2 C, max_gpu 0 C: offsets; the target 84 C is absolute.
    assert h.temperature_thresholds_celsius == (("target", 84.0),)
    assert h.temperature_margin_celsius == 43.0
    assert h.memory_temperature_celsius is None


def test_tlimit_margins_of_ada_and_blackwell_on_590_and_595():
    ada = _health("telegraf-rtx-4000-sff-ada-v13-drv595.xml")
    assert ada.temperature_thresholds_celsius == (("target", 88.0),)
    assert ada.temperature_margin_celsius == 49.0
    blackwell = _health("telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml")
    assert blackwell.temperature_thresholds_celsius == ()  # gpu_target_temperature N/A
    assert blackwell.temperature_margin_celsius == 68.0
    assert blackwell.row_remap_availability_banks[0] == ("max", 512)


def test_absolute_thresholds_of_a_v100():
    h = _health("pai-v100-sxm3-retired-pages-v10-drv410.xml")
    assert h.temperature_thresholds_celsius == (
        ("shutdown", 92.0), ("slowdown", 89.0), ("max_operating", 83.0), ("memory_max_operating", 85.0))
    assert h.memory_temperature_celsius == 33.0
    assert h.temperature_margin_celsius is None


# --- recovery action, repairs, and "Requested functionality has been deprecated" ---


def test_recovery_action_of_570_beside_a_deprecated_reset_status():
    h = _health("telegraf-rtx-3060-v12-drv570.xml")
    assert h.recovery_action == 0  # gpu_recovery_action "None"


def test_a_deprecated_reset_status_alone_is_no_reading_and_no_problem():
    h = _bent("telegraf-rtx-3060-v12-drv570.xml", (b"<gpu_recovery_action>None</gpu_recovery_action>", b""))
    assert h.recovery_action is None


def test_reset_status_before_570():
    assert _health("telegraf-a100-sxm4-80gb-mig-v12-drv535.xml").recovery_action == 0  # No, No
    assert _health("netdata-rtx-4090-v12-drv535.xml").recovery_action == 0  # No beside N/A
    name = "telegraf-a100-sxm4-80gb-mig-v12-drv535.xml"
    assert _bent(name, (b"<reset_required>No", b"<reset_required>Yes")).recovery_action == 1
    assert _bent(name, (b"<drain_and_reset_recommended>No",
                        b"<drain_and_reset_recommended>Yes")).recovery_action == 4


@pytest.mark.parametrize("text, action", [
    ("None", 0), ("Reset", 1), ("GPU Reset Required", 1), ("Reboot", 2), ("Node Reboot Required", 2),
    ("Drain P2P", 3), ("Drain and Reset", 4), ("Recover IMEX Domain", 5), ("Bus Reset", 6), ("System Reboot", 7),
    ("GPU_RESET", 1), ("drain_and_reset", 4), (" Reset ", 1),
    ("N/A", None), ("Not Supported", None), ("Requested functionality has been deprecated", None), ("", None),
])
def test_recovery_action_words(text, action):
    h = _bent("telegraf-rtx-3060-v12-drv570.xml",
              (b"<gpu_recovery_action>None", f"<gpu_recovery_action>{text}".encode()))
    assert (h.recovery_action, h.recovery_action_unknown) == (action, None)


@pytest.mark.parametrize("text, kept", [
    ("Reset Fabric", "Reset Fabric"),
    ("Unknown", "Unknown"),  # a word nvidia-smi has for an action it cannot name: not "no advice"
    ("Drain\n\t and  Rewire", "Drain and Rewire"),
    ("Wait " * 40, ("Wait " * 40)[:64]),
])
def test_a_recovery_action_this_exporter_does_not_know_is_kept_as_written_and_graded_a_warning(text, kept):
    # Issue 37: an unknown word read as no action at all, and graded the card ok.
    h = _bent("telegraf-rtx-3060-v12-drv570.xml",
              (b"<gpu_recovery_action>None", f"<gpu_recovery_action>{text}".encode()))  # and no problem line
    assert h.recovery_action is None and h.recovery_action_unknown == kept
    verdict = grade(h)
    assert (verdict.state, verdict.codes) == ("warning", ("recovery_action_unknown",))
    assert verdict.reasons == ("the driver advises an action this exporter does not know",)


def test_repairs_pending_of_590_and_595():
    assert _health("telegraf-dual-rtx-a5000-v13-drv590.xml", 1).repair_pending == (("channel", False), ("tpc", False))
    h = _bent("telegraf-rtx-3080-v13-drv595.xml", (b"<tpc_repair_pending>No", b"<tpc_repair_pending>Yes"))
    assert h.repair_pending == (("channel", False), ("tpc", True))


def test_unrepairable_memory_of_595_na_and_as_the_driver_writes_it():
    assert _health("telegraf-rtx-3080-v13-drv595.xml").unrepairable_memory is None  # N/A on a GeForce
    name, na = "telegraf-rtx-3080-v13-drv595.xml", b"<unrepairable_memory>N/A"
    assert _bent(name, (na, b"<unrepairable_memory>No")).unrepairable_memory is False
    broken = _bent(name, (na, b"<unrepairable_memory>Yes"))
    assert broken.unrepairable_memory is True
    assert grade(broken)[:1] + grade(broken)[2:3] == ("replace", ("unrepairable_memory",))
    assert _health("telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml").unrepairable_memory is None  # not written


def test_an_unreadable_unrepairable_memory_flag_is_none_and_a_problem_line():
    data = (require_real_corpus() / "telegraf-rtx-3080-v13-drv595.xml").read_bytes()
    report = parse_query_xml(data.replace(b"<unrepairable_memory>N/A", b"<unrepairable_memory>Maybe", 1))
    assert report.cards[0].health.unrepairable_memory is None
    assert report.problems == ("card 0: ecc_errors/unrepairable_memory: unreadable value 'Maybe'",)


def test_deprecated_values_of_590_read_as_nothing_without_a_problem():
    # power_state in gpu_power_readings and module_power_readings is deprecated; performance_state is not.
    data = (require_real_corpus() / "telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml").read_bytes()
    assert b"Requested functionality has been deprecated" in data
    h = _health("telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml")
    assert h.performance_state == 8 and h.fan_speed_ratio == 0.3 and h.recovery_action == 0


# --- the PCIe link, and the board's serial ---

OURS = FIXTURES.parent / "nvidia-smi-real"  # real captures kept beside the tests (SOURCES.md there)
L4 = "datarhei-2x-l4-x1-link-v12-drv555.xml"


def _link(h: CardHealth) -> tuple[int | None, ...]:
    return (h.pcie_link_generation_current, h.pcie_link_generation_max, h.pcie_link_width_current,
            h.pcie_link_width_max)


def test_an_l4_whose_link_trained_down_to_one_lane_grades_a_warning():
    """Issue 37: a real L4 at x1 of x16 graded ok. Its neighbour, at x16, stays ok."""
    report = parse_query_xml((OURS / L4).read_bytes())
    assert report.problems == ()
    assert [(c.index, c.pci_bus_id, c.serial) for c in report.cards] == [
        (0, "00000000:01:00.0", "1654523003308"), (1, "00000000:C1:00.0", "1654523001128")]
    assert [_link(c.health) for c in report.cards] == [(4, 4, 16, 16), (4, 4, 1, 16)]
    snapshot = snapshot_from_smi((OURS / L4).read_bytes(), None)
    ok, narrow = snapshot.cards
    assert ok.verdict is not None and (ok.verdict.state, ok.verdict.codes) == ("ok", ())
    assert narrow.verdict is not None
    assert (narrow.verdict.state, narrow.verdict.codes, narrow.verdict.reasons) == (
        "warning", ("pcie_link_width",), ("PCIe link at x1 of x16",))


def test_the_link_of_each_layout():
    assert _link(_health("telegraf-tesla-t4-v11-drv515.xml")) == (3, 3, 8, 16)
    assert _link(_health("telegraf-gt-1030-v11-drv470.xml")) == (3, 3, 4, 4)  # a x4 card at x4
    # max_link_gen is the lower of the card's (max_device_link_gen 5) and the host's (4).
    assert _link(_health("telegraf-rtx-pro-6000-blackwell-maxq-v13-drv590.xml")) == (1, 4, 16, 16)
    assert _link(_health("rai-grid-k520-v7-drv352.xml")) == (1, 3, 16, 16)  # v7
    assert _link(_health("telegraf-grid-p4-1q-vgpu-wddm-v11-drv513.xml")) == (None,) * 4  # a vGPU guest: N/A
    assert _link(_health("pai-gt730-minimal-v9-drv384.xml")) == (None,) * 4  # no <pci> at all
    assert _link(_health("telegraf-rtx-3080-wddm-v12-drv536.xml")) == (4, 4, 16, 16)  # max_host_link_gen N/A


def test_an_unreadable_link_width_is_none_and_a_problem_line():
    data = (require_real_corpus() / "telegraf-tesla-t4-v11-drv515.xml").read_bytes()
    report = parse_query_xml(data.replace(b"<current_link_width>8x<", b"<current_link_width>wide<", 1))
    assert report.cards[0].health.pcie_link_width_current is None
    assert report.problems == (
        "card 0: pci/pci_gpu_link_info/link_widths/current_link_width: unreadable count 'wide'",)


_TAG = re.compile(rb"<(serial|max_link_gen|current_link_gen|max_link_width|current_link_width)>([^<]*)<")


def _written(data: bytes) -> list[dict[str, str | None]]:
    """Each card's serial and link as the file writes them, by a pass of its own (N/A: None)."""
    cards = []
    for gpu in data.split(b"<gpu id=")[1:]:
        found = {tag.decode(): None if text.strip() in (b"N/A", b"") else text.strip().decode()
                 for tag, text in reversed(_TAG.findall(gpu))}
        cards.append(found)
    return cards


def _every_report() -> list[tuple[str, bytes]]:
    paths = [*sorted(require_real_corpus().glob("*.xml")), *sorted(OURS.glob("*.xml"))]
    return [(p.name, p.read_bytes()) for p in paths]


def test_every_real_capture_reads_its_serial_and_link_as_written():
    cards = 0
    for name, data in _every_report():
        report = parse_query_xml(data)
        assert report.problems == (), name
        for card, written in zip(report.cards, _written(data), strict=True):
            h = card.health
            assert card.serial == written.get("serial"), name
            width = {k: None if v is None else int(v.removesuffix("x"))
                     for k, v in written.items() if k.endswith("_width")}
            gen = {k: None if v is None else int(v) for k, v in written.items() if k.endswith("_gen")}
            assert _link(h) == (gen.get("current_link_gen"), gen.get("max_link_gen"),
                                width.get("current_link_width"), width.get("max_link_width")), name
            cards += 1
    assert cards == 51  # 45 cards in the shared corpus (the GT 730 writes no <pci>), 4 Tesla M10s and 2 L4s here
    # N/A, and what the corpus writes for a serial.
    serials = {card.serial for _, data in _every_report() for card in parse_query_xml(data).cards}
    assert {None, "REDACTED", "0000000000000", "0424217033069", "1654523001128"} <= serials


# --- every report, every fixture, the demo ---


def _all_corpus_reports() -> list[str]:
    return sorted(p.name for p in require_real_corpus().glob("*.xml"))


def test_every_corpus_report_reads_its_health_without_a_problem_line():
    read = 0
    for name in _all_corpus_reports():
        report = _report(name)
        read += sum(c.health != NO_HEALTH for c in report.cards)
    assert read == sum(len(_report(name).cards) for name in _all_corpus_reports()) - 1  # the GT 730 has none


def test_our_fixtures_read_their_health_without_a_problem_line():
    for path in [*sorted(FIXTURES.glob("*.xml")), SAMPLES / "demo.xml"]:
        report = parse_query_xml(path.read_bytes())
        assert not [p for p in report.problems if "unreadable" in p], path.name


def test_the_demo_has_a_pending_row_remap_on_card_1_and_an_sram_error_on_0_mig0():
    data = (SAMPLES / "demo.xml").read_bytes()
    snapshot = snapshot_from_smi(data, (SAMPLES / "demo.L.txt").read_bytes())
    card1 = snapshot.cards[1].health
    assert card1.row_remap_pending is True and card1.remapped_rows_uncorrectable == 1
    assert dict(card1.row_remap_availability_banks) == {"max": 639, "high": 1, "partial": 0, "low": 0, "none": 0}
    (mig0,) = [d for d in snapshot.devices if d.card == 0 and d.mig_index == 0]
    assert mig0.ecc_errors == (EccCount("volatile", "sram", "uncorrectable", 1),)
    others = [d.ecc_errors for d in snapshot.devices if d.card == 0 and d.mig_index != 0]
    assert others and all(e == (EccCount("volatile", "sram", "uncorrectable", 0),) for e in others)


# --- a MIG device's ECC counts: the fast reading of <mig_devices> against lxml's ---

_H100 = (FIXTURES / "h100-mig-processes.xml").read_bytes()
_ECC_BLOCK = re.compile(rb"<ecc_error_count>.*?</ecc_error_count>", re.S)
_ECC_VALUES = ["0", "1", "7", " 12 ", "18446744073709551615", "123456789012345678901", "N/A", "", "-1", "x",
               "Not Supported", "3 MiB"]
_ECC_LEAVES = ["sram_uncorrectable", "sram_correctable", "dram_correctable", "dram_uncorrectable",
               "sram_uncorrectable_parity", "sram_uncorrectable_secded", "other_count"]
_ECC_COUNTS = ["volatile_count", "aggregate_count", "unknown_count"]


def _ecc_block(rng: random.Random) -> bytes:
    sep = rng.choice(["", "\n", "\n\t\t\t\t\t"])
    blocks = []
    for _ in range(rng.randrange(4)):
        leaves = "".join(f"{sep}<{leaf}>{rng.choice(_ECC_VALUES)}</{leaf}>"
                         for leaf in rng.choices(_ECC_LEAVES, k=rng.randrange(4)))
        tag = rng.choice(_ECC_COUNTS)
        blocks.append(f"{sep}<{tag}>{leaves}{sep}</{tag}>")
    return f"<ecc_error_count>{''.join(blocks)}{sep}</ecc_error_count>".encode()


def _with_ecc(rng: random.Random) -> bytes:
    return _ECC_BLOCK.sub(lambda _: _ecc_block(rng), _H100)


@pytest.mark.parametrize("seed", range(60))
def test_instance_ecc_read_apart_reads_as_the_whole_parse_reads_it(seed):
    data = _with_ecc(random.Random(seed))
    fast = parse_query_xml(data)
    assert fast == parse_query_xml(data + NOT_PLAIN)
    memo = SectionMemo()
    assert parse_query_xml(data, memo) == fast == parse_query_xml(data, memo)


def test_the_generated_ecc_blocks_give_counts_and_problem_lines():
    # Else the comparison above would compare empty tuples, or lxml's reading with itself.
    data = [_with_ecc(random.Random(seed)) for seed in range(60)]
    fast = [query_xml._parse_fast(d) for d in data]
    assert all(f is not None and any(f[1].mig_devices) for f in fast)
    reports = [parse_query_xml(d) for d in data]
    counts = [e for r in reports for i in r.cards[0].instances for e in i.ecc_errors]
    assert sum(e.errors > 0 for e in counts) > 20
    assert {e.scope for e in counts} == {"volatile", "aggregate"}
    assert sum("unreadable count" in p for r in reports for p in r.problems) > 10


def test_a_nonzero_instance_ecc_count_is_read_and_kept_in_the_memo():
    # The first <mig_device> of the fixture is MIG device 1.
    bent = _H100.replace(b"<sram_uncorrectable>0</sram_uncorrectable>", b"<sram_uncorrectable>3</sram_uncorrectable>",
                         1)
    memo = ReadMemo()
    first = snapshot_from_smi(bent, None, None, memo)
    assert first == snapshot_from_smi(bent, None, None, memo) == snapshot_from_smi(bent + NOT_PLAIN, None)
    errors = {d.mig_index: [e.errors for e in d.ecc_errors] for d in first.devices}
    assert errors == {0: [0], 1: [3], 2: [0], 3: [0]}


def test_an_instance_ecc_count_past_64_bits_is_a_problem_line_on_both_paths():
    bent = _H100.replace(b"<sram_uncorrectable>0<", b"<sram_uncorrectable>123456789012345678901<", 1)
    report = parse_query_xml(bent)
    assert report == parse_query_xml(bent + NOT_PLAIN)
    assert report.cards[0].instances[0].ecc_errors == ()
    assert ("card 0: mig_device/ecc_error_count/volatile_count/sram_uncorrectable: unreadable count "
            "'123456789012345678901'") in report.problems


# --- the house: no function of 60 lines or more in the read path ---


@pytest.mark.parametrize("path", ["src/mig_exporter/nvidia_smi/query_xml.py",
                                  "src/mig_exporter/nvidia_smi/health_xml.py",
                                  "src/mig_exporter/sources/command.py"])
def test_no_function_is_60_lines_or_longer(path):
    tree = ast.parse((REPO / path).read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 >= 60]
    assert long == []


@pytest.mark.parametrize("value", [b"\t7", b"7\r", b"a &amp; b", b"&#55;", b"<![CDATA[7]]>", b"7<!-- x -->"])
def test_an_instance_ecc_value_outside_the_grammar_is_left_to_lxml(value):
    bent = _H100.replace(b"<sram_uncorrectable>0<", b"<sram_uncorrectable>" + value + b"<", 1)
    assert parse_query_xml(bent) == parse_query_xml(bent + NOT_PLAIN)


@pytest.mark.parametrize("count", [b"1" + b"0" * 30, b"9" * 5000, b"12abc"])
def test_an_ecc_count_that_cannot_be_read_grades_warning_never_ok(count):
    """Left out of the counts, a count too large to read would read as no errors: the card
    fails closed instead."""
    data = (require_real_corpus() / "telegraf-tesla-t4-v11-drv515.xml").read_bytes()
    old = b"<dram_uncorrectable>0</dram_uncorrectable>"
    assert old in data
    report = parse_query_xml(data.replace(old, b"<dram_uncorrectable>" + count + b"</dram_uncorrectable>", 1))
    h = report.cards[0].health
    assert h.ecc_unreadable is True
    assert ("volatile", "dram", "uncorrectable") not in {(e.scope, e.memory, e.type) for e in h.ecc_errors}
    assert len(report.problems) == 1 and "dram_uncorrectable" in report.problems[0]
    verdict = grade(h)
    assert (verdict.state, verdict.codes, verdict.reasons) == (
        "warning", ("ecc_unreadable",), ("an ECC count could not be read",))


def test_na_ecc_counts_are_not_unreadable():
    h = _health("telegraf-rtx-3060-v12-drv570.xml")
    assert h.ecc_unreadable is False and grade(h).state == "ok"
