"""Placement rules on hand-built readings: indexes, process ownership, merging."""

from __future__ import annotations

from dataclasses import replace

from mig_exporter.model.placement import PlacementMemo, mig_placement_index, place
from mig_exporter.model.snapshot import CardReading, Memory, MigInstance, ProcessReading


def _mig_card(index: int, instances, processes) -> CardReading:
    return CardReading(index=index, uuid=f"GPU-{index}", name="NVIDIA A100-SXM4-80GB", mig_current=True,
                       mig_pending=True, memory=Memory(total_bytes=81920 * 2**20), utilization_ratio=0.5,
                       instances=tuple(instances), processes=tuple(processes))


def test_mig_placement_index():
    assert mig_placement_index(0, 0) == 1000
    assert mig_placement_index(3, 6) == 1306


def test_a_process_matching_gi_but_not_ci_is_not_placed_and_is_reported():
    card = _mig_card(0, [MigInstance(0, 1, 0, Memory())], [ProcessReading(5, "C", "x", 1, 1, 1)])
    s = place([card], driver_version=None, cuda_version=None)
    assert s.processes == ()
    assert s.problems == (
        "card 0: process 5 carries GPU instance 1 and compute instance 1, which match no MIG device; not placed",
    )


def test_processes_on_a_card_with_nothing_carved_are_reported_not_lost_silently():
    card = _mig_card(2, [], [ProcessReading(9, "C", "x", 1, 0, 0)])
    s = place([card], driver_version=None, cuda_version=None)
    assert s.devices == () and s.cards[0].mig_instances == 0
    assert len(s.problems) == 1 and "process 9" in s.problems[0]


def test_a_mig_card_read_without_the_monitor_capability_has_no_whole_process_list():
    """The driver refused the card's own memory: instances and processes the container cannot
    open are hidden, so the instances it sees are neither free nor unused, and a line says why."""
    instances = [MigInstance(0, 1, 0, Memory(total_bytes=40 * 2**30, used_bytes=2**20)),
                 MigInstance(1, 2, 0, Memory(total_bytes=20 * 2**30, used_bytes=2**20))]
    seen = _mig_card(0, instances, [])
    whole = place([seen], driver_version=None, cuda_version=None)
    assert [d.processes_known for d in whole.devices] == [True, True] and whole.problems == ()
    denied = place([replace(seen, memory=Memory(), aggregate_denied=True)], driver_version=None, cuda_version=None)
    assert [d.processes_known for d in denied.devices] == [False, False]
    assert denied.cards[0].aggregate_denied is True
    assert denied.problems == ("card 0: the driver refused the card's own memory (no MIG monitor capability): MIG "
                               "instances and processes this container cannot open are hidden, so its process lists "
                               "count as unknown (mig-exporter doctor: mig-monitor-missing)",)


def test_a_pid_listed_twice_on_one_device_is_one_process_with_its_types_joined():
    card = CardReading(index=0, name="Tesla T4", processes=(
        ProcessReading(7, "C", "/bin/app", 100), ProcessReading(7, "G", "/bin/app", 100),
        ProcessReading(8, "G", "", None), ProcessReading(8, "C", "", None),
        ProcessReading(9, "C", "mps", 64), ProcessReading(9, "M", "mps", None),
    ))
    s = place([card], driver_version=None, cuda_version=None)
    # Each entry is the process's whole usage on the device: never summed.
    assert [(p.pid, p.type, p.used_bytes) for p in s.processes] == [(7, "C+G", 100), (8, "C+G", None), (9, "M+C", 64)]


def test_the_same_pid_on_two_cards_is_two_processes():
    cards = [CardReading(index=i, name="GTX 1080", processes=(ProcessReading(450, "G", "Xorg", 10),)) for i in (0, 1)]
    s = place(cards, driver_version=None, cuda_version=None)
    assert [(p.pid, p.device_index) for p in s.processes] == [(450, 0), (450, 1)]


def test_a_card_that_failed_is_kept_with_its_error_and_others_still_report():
    failed = CardReading(index=0, uuid="GPU-0", name="NVIDIA H100 80GB HBM3", error="GPU is lost")
    ok = CardReading(index=1, uuid="GPU-1", name="NVIDIA H100 80GB HBM3", memory=Memory(used_bytes=5))
    s = place([failed, ok], driver_version="550", cuda_version="12.4")
    assert [c.error for c in s.cards] == ["GPU is lost", None]
    assert [d.index for d in s.devices] == [1]
    assert s.problems == ("card 0: GPU is lost",)


def test_duplicate_mig_index_keeps_the_first_and_reports():
    card = _mig_card(0, [MigInstance(0, 1, 0, Memory(used_bytes=1)), MigInstance(0, 2, 0, Memory(used_bytes=2))], [])
    s = place([card], driver_version=None, cuda_version=None)
    assert [(d.index, d.gpu_instance_id) for d in s.devices] == [(1000, 1)]
    assert len(s.problems) == 1


def test_a_mig_index_out_of_range_is_skipped_rather_than_taking_another_devices_index():
    """Index 100 on card 0 would be 1100, card 1's instance 0; -1000 would be whole card 0.
    Either would repeat a series, and Prometheus refuses a scrape with a repeated series."""
    cards = [
        _mig_card(0, [MigInstance(0, 1, 0, Memory()), MigInstance(100, 2, 0, Memory()),
                      MigInstance(-1000, 3, 0, Memory())], []),
        _mig_card(1, [MigInstance(0, 1, 0, Memory())], []),
    ]
    s = place(cards, driver_version=None, cuda_version=None)
    assert [d.index for d in s.devices] == [1000, 1100]
    assert s.problems == ("card 0: MIG device index -1000 is out of range (0 to 99); skipped",
                          "card 0: MIG device index 100 is out of range (0 to 99); skipped")


def test_every_device_has_the_name_people_read_beside_its_placement_index():
    mig = _mig_card(1, [MigInstance(2, 3, 0, Memory()), MigInstance(0, 1, 0, Memory())], [])
    whole = CardReading(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB", mig_current=False,
                        mig_pending=False, memory=Memory(total_bytes=81920 * 2**20), utilization_ratio=0.5,
                        instances=(), processes=())
    s = place([whole, mig], driver_version=None, cuda_version=None)
    assert {d.index: d.display_name for d in s.devices} == {0: "0", 1100: "1/mig0", 1102: "1/mig2"}


# --- the placement memo (issue 17) ----------------------------------------------------------


def _two_cards(used_on_card_1: int = 300, temperature: float = 40.0) -> list[CardReading]:
    instances = [MigInstance(0, 1, 0, Memory(100, 10, 90, 0)), MigInstance(1, 2, 0, Memory(100, 20, 80, 0))]
    cards = []
    for index, used in ((0, 200), (1, used_on_card_1)):
        card = _mig_card(index, instances, [ProcessReading(10 + index, "C", "vllm", used, 1, 0),
                                            ProcessReading(20 + index, "C", "vllm", used, 2, 0),
                                            ProcessReading(30 + index, "C", "stray", used, 9, 9)])
        cards.append(replace(card, temperature_celsius=temperature))
    return cards


def _place(cards, memo=None):
    return place(cards, driver_version="550", cuda_version="12.4", problems=["kept"], memo=memo)


def test_a_card_placed_as_at_the_last_read_reuses_that_placement_and_reads_the_same():
    memo = PlacementMemo()
    first = _place(_two_cards(), memo)
    again = _place(_two_cards(temperature=55.0), memo)  # readings change at every read; placing does not
    assert again == _place(_two_cards(temperature=55.0))
    assert [c.temperature_celsius for c in again.cards] == [55.0, 55.0]
    assert again.devices[0] is first.devices[0] and again.processes[0] is first.processes[0]
    assert again.problems == first.problems and len(again.problems) == 3  # "kept", and each card's stray


def test_a_card_whose_processes_changed_is_placed_again_and_the_other_is_kept():
    memo = PlacementMemo()
    first = _place(_two_cards(), memo)
    changed = _place(_two_cards(used_on_card_1=301), memo)
    assert changed == _place(_two_cards(used_on_card_1=301))
    assert {p.pid: p.used_bytes for p in changed.processes}[11] == 301
    assert changed.processes[0] is first.processes[0]  # card 0's
    assert changed.processes[2] is not first.processes[2]  # card 1's, placed again


def test_cards_that_change_what_they_are_are_placed_again():
    memo = PlacementMemo()
    _place(_two_cards(), memo)
    whole = [replace(card, mig_current=False) for card in _two_cards()]  # MIG switched off
    assert _place(whole, memo) == _place(whole)
    failed = [replace(_two_cards()[0], error="GPU is lost"), _two_cards()[1]]
    assert _place(failed, memo) == _place(failed)
    # A repeated card index (a driver's garbage) places each card by its own inputs.
    twice = [_two_cards()[0], replace(_two_cards()[1], index=0)]
    assert _place(twice, memo) == _place(twice)
    assert _place(twice, memo) == _place(twice)
