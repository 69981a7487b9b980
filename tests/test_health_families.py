"""Card health as families: once per card (never per MIG instance), the instance's own ECC on
the device, unknown values left out, and the card's grade (made once, with the snapshot) as one
series per state and one per reason."""

from __future__ import annotations

import dataclasses

from prometheus_client.core import Metric

from conftest import require_real_corpus
from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.health_families import health_families
from mig_exporter.metrics.xid_families import xid_families
from mig_exporter.model.health import CardHealth, ClockReading, EccCount, Verdict, XidSeen, grade
from mig_exporter.model.placement import place
from mig_exporter.model.snapshot import MIB, CardReading, Memory, MigInstance
from mig_exporter.nvidia_smi.build import snapshot_from_smi

SICK = CardHealth(
    memory_temperature_celsius=58.0,
    temperature_thresholds_celsius=(("shutdown", 92.0), ("slowdown", 89.0)),
    clock_events_active=(("gpu_idle", False), ("hw_thermal_slowdown", True)),
    clock_event_seconds=(("hw_thermal_slowdown", 12.5),),
    clocks=(ClockReading("sm", "current", 1.41e9), ClockReading("sm", "max", 1.98e9)),
    power_limits_watts=(("current", 400.0),),
    ecc_errors=(EccCount("volatile", "dram", "uncorrectable", 1), EccCount("aggregate", "dram", "uncorrectable", 3)),
    remapped_rows_correctable=0,
    remapped_rows_uncorrectable=1,
    row_remap_pending=True,
    row_remap_failure=False,
    row_remap_availability_banks=(("max", 639), ("high", 1)),
)


def _memory(total_mib: int) -> Memory:
    return Memory(total_mib * MIB, 0, total_mib * MIB, 0)


def _mig_card(index: int, health: CardHealth, instance_ecc: tuple[EccCount, ...] = ()) -> CardReading:
    return CardReading(
        index=index, uuid=f"GPU-{index}", name="NVIDIA H100 80GB HBM3", mig_current=True, mig_pending=True,
        memory=_memory(81559), health=health,
        instances=tuple(MigInstance(i, 7 + i, 0, _memory(9984), "1g.10gb", f"MIG-{index}-{i}",
                                    instance_ecc if i == 2 else ()) for i in range(7)),
    )


def _samples(families: list[Metric], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in families for s in f.samples if s.name == name}


def test_a_card_in_mig_mode_reports_its_health_once_on_the_card_never_on_its_instances():
    snapshot = place([_mig_card(3, SICK)], driver_version="590.44.01", cuda_version="13.1")
    families = list(health_families(snapshot))
    assert len(snapshot.devices) == 7
    assert _samples(families, "mig_exporter_card_row_remap_pending") == {(("card", "3"),): 1}
    assert _samples(families, "mig_exporter_card_memory_temperature_celsius") == {(("card", "3"),): 58.0}
    assert _samples(families, "mig_exporter_card_ecc_errors_total") == {
        (("card", "3"), ("memory", "dram"), ("scope", "volatile"), ("type", "uncorrectable")): 1,
        (("card", "3"), ("memory", "dram"), ("scope", "aggregate"), ("type", "uncorrectable")): 3,
    }
    for family in families:
        if family.name.startswith("mig_exporter_card_"):
            assert all("index" not in s.labels for s in family.samples), family.name


def test_an_instance_reports_its_own_ecc_on_its_device_and_the_card_grades_on_it():
    errors = (EccCount("volatile", "sram", "uncorrectable", 2),)
    snapshot = place([_mig_card(1, CardHealth(), errors)], driver_version=None, cuda_version=None)
    families = list(health_families(snapshot))
    assert _samples(families, "mig_exporter_device_ecc_errors_total") == {
        (("card", "1"), ("index", "1102"), ("memory", "sram"), ("mig_profile", "1g.10gb"), ("scope", "volatile"),
         ("type", "uncorrectable")): 2,
    }
    assert _samples(families, "mig_exporter_card_health") == {
        (("card", "1"), ("state", "ok")): 0, (("card", "1"), ("state", "warning")): 1,
        (("card", "1"), ("state", "reset")): 0, (("card", "1"), ("state", "replace")): 0,
    }


def test_unknown_values_are_left_out_never_zero():
    snapshot = place([CardReading(index=0, name="Tesla T4", memory=_memory(15360))], driver_version=None,
                     cuda_version=None)
    families = {f.name: f for f in health_families(snapshot)}
    for name, family in families.items():
        if name != "mig_exporter_card_health":
            assert family.samples == [], name
    assert _samples(list(families.values()), "mig_exporter_card_health")[(("card", "0"), ("state", "ok"))] == 1


def test_an_unreadable_card_has_no_grade():
    snapshot = place([CardReading(index=0, error="GPU_IS_LOST in nvmlDeviceGetMigMode", health=SICK)],
                     driver_version=None, cuda_version=None)
    assert _samples(list(health_families(snapshot)), "mig_exporter_card_health") == {}


def test_clocks_thresholds_and_counters_carry_their_names():
    snapshot = place([_mig_card(0, SICK)], driver_version=None, cuda_version=None)
    families = list(health_families(snapshot))
    assert _samples(families, "mig_exporter_card_clock_hertz") == {
        (("card", "0"), ("clock", "sm"), ("kind", "current")): 1.41e9,
        (("card", "0"), ("clock", "sm"), ("kind", "max")): 1.98e9,
    }
    assert _samples(families, "mig_exporter_card_clock_event_seconds_total") == {
        (("card", "0"), ("reason", "hw_thermal_slowdown")): 12.5}
    assert _samples(families, "mig_exporter_card_clock_event_active") == {
        (("card", "0"), ("reason", "gpu_idle")): 0, (("card", "0"), ("reason", "hw_thermal_slowdown")): 1}
    assert _samples(families, "mig_exporter_card_temperature_threshold_celsius") == {
        (("card", "0"), ("threshold", "shutdown")): 92.0, (("card", "0"), ("threshold", "slowdown")): 89.0}


def test_the_grade_is_the_worst_state_with_every_reason():
    verdict = grade(SICK)
    assert verdict.state == "reset" and verdict.label == "needs reset"
    assert verdict.reasons == (
        "a row remap is pending: reset the card to apply it",
        "1 uncorrectable ECC error(s) since the driver loaded",
        "clocks held down: hw thermal slowdown",
    )
    assert grade(CardHealth(row_remap_failure=True, row_remap_pending=True)).state == "replace"
    assert grade(CardHealth(recovery_action=4)).state == "reset"
    assert grade(CardHealth(recovery_action=3)).state == "warning"
    assert grade(CardHealth(temperature_margin_celsius=4.0)).state == "warning"
    assert grade(CardHealth(temperature_margin_celsius=5.0)) == Verdict("ok", ())
    assert grade(CardHealth(clock_events_active=(("sw_power_cap", True), ("gpu_idle", True)))).state == "ok"


def test_the_card_count_holds_its_instances_errors_and_is_not_added_to_them():
    card = CardHealth(ecc_errors=(EccCount("volatile", "sram", "uncorrectable", 1),))
    assert grade(card, instance_uncorrectable=1).reasons == ("1 uncorrectable ECC error(s) since the driver loaded",)
    assert grade(CardHealth(), instance_uncorrectable=2).reasons == (
        "2 uncorrectable ECC error(s) since the driver loaded",)


def test_xids_by_card_instance_and_code():
    families = list(xid_families([XidSeen(1, 1102, 43, 2, 1_700_000_000.0), XidSeen(1, 1, 79, 1, 1_700_000_100.0)]))
    assert _samples(families, "mig_exporter_xid_errors_total") == {
        (("card", "1"), ("index", "1102"), ("xid", "43")): 2, (("card", "1"), ("index", "1"), ("xid", "79")): 1}
    last = _samples(families, "mig_exporter_xid_last_timestamp_seconds")
    assert last[(("card", "1"), ("index", "1"), ("xid", "79"))] == 1_700_000_100.0


def test_a_family_whose_rows_are_unchanged_is_the_one_made_last_time_and_its_lines_are_written_once():
    # A card's wear and limits seldom change between two scrapes; its temperatures do.
    first = {f.name: f for f in health_families(place([_mig_card(5, SICK)], driver_version=None, cuda_version=None))}
    body = render(list(first.values()), "")[0].decode()
    assert first["mig_exporter_card_ecc_errors"].lines is not None
    hotter = dataclasses.replace(SICK, memory_temperature_celsius=61.0)
    second = {f.name: f for f in health_families(place([_mig_card(5, hotter)], driver_version=None,
                                                        cuda_version=None))}
    assert second["mig_exporter_card_ecc_errors"] is first["mig_exporter_card_ecc_errors"]
    assert second["mig_exporter_card_memory_temperature_celsius"] is not first[
        "mig_exporter_card_memory_temperature_celsius"]
    again = render(list(second.values()), "")[0].decode()
    assert again == body.replace('mig_exporter_card_memory_temperature_celsius{card="5"} 58.0',
                                 'mig_exporter_card_memory_temperature_celsius{card="5"} 61.0')
    # Once a reader has its samples (another registry, a test), a family is made anew.
    assert second["mig_exporter_card_ecc_errors"].samples
    third = {f.name: f for f in health_families(place([_mig_card(5, hotter)], driver_version=None,
                                                       cuda_version=None))}
    assert third["mig_exporter_card_ecc_errors"] is not second["mig_exporter_card_ecc_errors"]
    assert third["mig_exporter_card_ecc_errors"] == second["mig_exporter_card_ecc_errors"]


def test_a_negative_zero_is_never_written_as_the_zero_kept_before_it():
    lines = []
    for margin in (0.0, -0.0, -0.0, 0.0):
        card = CardReading(index=7, memory=_memory(15360), health=CardHealth(temperature_margin_celsius=margin))
        body = render(list(health_families(place([card], driver_version=None, cuda_version=None))), "")[0]
        lines += [line for line in body.decode().splitlines() if line.startswith("mig_exporter_card_temperature_m")]
    assert lines == [f'mig_exporter_card_temperature_margin_celsius{{card="7"}} {t}' for t in
                     ("0.0", "-0.0", "-0.0", "0.0")]


def _real(name: str) -> list[Metric]:
    return list(health_families(snapshot_from_smi((require_real_corpus() / name).read_bytes(), None)))


def test_a_sick_card_has_a_reason_series_for_each_reason_of_its_grade_with_that_reasons_own_state():
    families = list(health_families(place([_mig_card(2, SICK)], driver_version=None, cuda_version=None)))
    assert _samples(families, "mig_exporter_card_health_reason") == {
        (("card", "2"), ("reason", "row_remap_pending"), ("state", "reset")): 1,
        (("card", "2"), ("reason", "ecc_uncorrectable"), ("state", "warning")): 1,
        (("card", "2"), ("reason", "hw_thermal_slowdown"), ("state", "warning")): 1,
    }
    assert _samples(families, "mig_exporter_card_health")[(("card", "2"), ("state", "reset"))] == 1


def test_an_ok_card_and_an_unreadable_card_have_no_reason_series():
    ok = CardReading(index=0, name="Tesla T4", memory=_memory(15360))
    lost = CardReading(index=1, error="GPU_IS_LOST in nvmlDeviceGetMigMode", health=SICK)
    families = {f.name: f for f in health_families(place([ok, lost], driver_version=None, cuda_version=None))}
    assert "mig_exporter_card_health_reason" not in families
    assert {s.labels["card"] for s in families["mig_exporter_card_health"].samples} == {"0"}


def test_the_grade_is_the_cards_verdict_made_with_the_snapshot_never_graded_again():
    snapshot = place([_mig_card(4, CardHealth())], driver_version=None, cuda_version=None)
    verdict = Verdict("replace", ("the driver reports memory it cannot repair",), ("unrepairable_memory",),
                      ("replace",))
    card = dataclasses.replace(snapshot.cards[0], verdict=verdict)
    families = list(health_families(dataclasses.replace(snapshot, cards=(card,))))
    assert _samples(families, "mig_exporter_card_health")[(("card", "4"), ("state", "replace"))] == 1
    assert _samples(families, "mig_exporter_card_health_reason") == {
        (("card", "4"), ("reason", "unrepairable_memory"), ("state", "replace")): 1}


def test_unrepairable_memory_is_1_or_0_and_left_out_where_the_driver_does_not_say():
    cards = [CardReading(index=i, memory=_memory(81559), health=CardHealth(unrepairable_memory=flag))
             for i, flag in enumerate((True, False, None))]
    families = list(health_families(place(cards, driver_version=None, cuda_version=None)))
    assert _samples(families, "mig_exporter_card_unrepairable_memory") == {(("card", "0"),): 1, (("card", "1"),): 0}
    assert _samples(families, "mig_exporter_card_health_reason") == {
        (("card", "0"), ("reason", "unrepairable_memory"), ("state", "replace")): 1}
    # Every real 590+ capture writes ecc_errors/unrepairable_memory N/A: no series, never 0.
    assert _samples(_real("telegraf-dual-rtx-a5000-v13-drv590.xml"), "mig_exporter_card_unrepairable_memory") == {}


def test_a_pcie_link_at_half_its_lanes_gives_its_generation_and_width_and_no_warning():
    # A laptop RTX A5000 on 575 whose gen 4 link runs x8 of x16 (pci/pci_gpu_link_info): how the
    # card is wired (model/health.py PCIE_DEGRADED_SHARE), not a fault.
    families = _real("llamaland-rtx-a5000-laptop-v12-drv575.xml")
    assert _samples(families, "mig_exporter_card_pcie_link_generation") == {
        (("card", "0"), ("kind", "current")): 4, (("card", "0"), ("kind", "max")): 4}
    assert _samples(families, "mig_exporter_card_pcie_link_width_lanes") == {
        (("card", "0"), ("kind", "current")): 8, (("card", "0"), ("kind", "max")): 16}
    assert _samples(families, "mig_exporter_card_health_reason") == {}


def test_a_pcie_link_at_a_quarter_of_its_lanes_or_fewer_warns():
    for width, reasons in ((4, {(("card", "0"), ("reason", "pcie_link_width"), ("state", "warning")): 1}),
                           (8, {}), (1, {(("card", "0"), ("reason", "pcie_link_width"), ("state", "warning")): 1})):
        health = CardHealth(pcie_link_width_current=width, pcie_link_width_max=16)
        families = list(health_families(place([CardReading(index=0, memory=_memory(15360), health=health)],
                                              driver_version=None, cuda_version=None)))
        assert _samples(families, "mig_exporter_card_health_reason") == reasons, width


def test_each_pcie_link_value_the_driver_does_not_give_is_left_out():
    health = CardHealth(pcie_link_generation_current=1, pcie_link_width_max=16)
    families = list(health_families(place([CardReading(index=0, memory=_memory(15360), health=health)],
                                          driver_version=None, cuda_version=None)))
    assert _samples(families, "mig_exporter_card_pcie_link_generation") == {(("card", "0"), ("kind", "current")): 1}
    assert _samples(families, "mig_exporter_card_pcie_link_width_lanes") == {(("card", "0"), ("kind", "max")): 16}


def test_a_real_card_with_a_pending_page_retirement_needs_a_reset_and_says_why():
    # A V100 on 410 with a double-bit error and pending_retirement Yes.
    families = _real("pai-v100-sxm3-retired-pages-v10-drv410.xml")
    assert _samples(families, "mig_exporter_card_health") == {
        (("card", "0"), ("state", "ok")): 0, (("card", "0"), ("state", "warning")): 0,
        (("card", "0"), ("state", "reset")): 1, (("card", "0"), ("state", "replace")): 0}
    assert _samples(families, "mig_exporter_card_health_reason") == {
        (("card", "0"), ("reason", "retired_pages_pending"), ("state", "reset")): 1,
        (("card", "0"), ("reason", "ecc_uncorrectable"), ("state", "warning")): 1}


def test_a_card_past_its_shutdown_threshold_grades_warning_without_a_margin():
    """120 °C over a 92 °C shutdown threshold, and no T.Limit margin read: never ok."""
    health = CardHealth(temperature_thresholds_celsius=(("shutdown", 92.0), ("slowdown", 89.0)))
    verdict = grade(health, temperature_celsius=120.0)
    assert (verdict.state, verdict.codes, verdict.reasons) == (
        "warning", ("temperature_over_threshold",), ("120 °C, at or past its 92 °C shutdown threshold",))
    assert grade(health, temperature_celsius=90.0).reasons == ("90 °C, at or past its 89 °C slowdown threshold",)
    assert grade(health, temperature_celsius=88.0) == Verdict("ok", ())
    # No thresholds or no temperature: nothing to hold it against.
    assert grade(CardHealth(), temperature_celsius=120.0) == Verdict("ok", ())
    assert grade(health) == Verdict("ok", ())
