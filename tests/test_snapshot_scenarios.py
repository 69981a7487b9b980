"""Our own nvidia-smi fixtures, read into snapshots: the MIG rules, value by value.

The expected values are those in tests/fixtures/nvidia-smi/README.md.
"""

from __future__ import annotations

from conftest import MIB, scenario


def test_mig_card_is_reported_as_its_instances_sorted_by_mig_index():
    s = scenario("h100-mig-processes")
    assert [d.index for d in s.devices] == [1000, 1001, 1002, 1003]
    assert [d.profile for d in s.devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert [(d.gpu_instance_id, d.compute_instance_id) for d in s.devices] == [(2, 0), (3, 0), (9, 0), (10, 0)]
    first = s.devices[0]
    assert first.uuid == "MIG-12b47fa4-2f93-5cea-b2ff-bf3e0b6e9aba"
    assert first.card == 0 and first.mig_index == 0
    assert first.memory.total_bytes == 40448 * MIB
    assert first.memory.used_bytes == 3594 * MIB
    assert first.memory.free_bytes == 36854 * MIB
    assert first.memory.reserved_bytes == 0
    assert first.device_class == "h100-80g-mig-3g.40gb"
    assert first.name == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert s.device(0) is None, "a card in MIG mode is never reported as the whole card"


def test_processes_go_only_to_the_instance_whose_gi_and_ci_they_carry():
    s = scenario("h100-mig-processes")
    assert sorted(p.pid for p in s.processes_on(1000)) == [21180, 21181]
    assert [p.pid for p in s.processes_on(1002)] == [21198]
    assert s.processes_on(1001) == () and s.processes_on(1003) == ()
    burn = s.processes_on(1002)[0]
    assert (burn.name, burn.type, burn.used_bytes) == ("./gpu_burn", "C", 7484 * MIB)
    assert s.problems == ()


def test_two_compute_instances_on_one_gpu_instance_each_keep_only_their_process():
    s = scenario("h200-shared-gpu-instance")
    d0, d1 = s.device(1000), s.device(1001)
    assert (d0.gpu_instance_id, d0.compute_instance_id, d0.profile) == (1, 0, "1c.3g.71gb")
    assert (d1.gpu_instance_id, d1.compute_instance_id, d1.profile) == (1, 1, "2c.3g.71gb")
    # They share GPU instance 1's memory, so both report the same framebuffer.
    assert d0.memory == d1.memory
    assert d0.memory.used_bytes == 30210 * MIB
    assert [p.pid for p in s.processes_on(1000)] == [7001]
    assert [p.pid for p in s.processes_on(1001)] == [7002]
    triton = s.processes_on(1002)[0]
    assert (triton.pid, triton.type) == (7003, "M+C")
    assert s.cards[0].card_class == "h200-141g"
    assert d0.device_class == "h200-141g-mig-1c.3g.71gb"


def test_mig_card_with_nothing_carved_yields_no_device_and_says_so():
    s = scenario("a100-mig-nothing-carved")
    assert [d.index for d in s.devices] == [1100]
    empty, carved = s.cards
    assert empty.mig_current is True and empty.mig_instances == 0
    assert carved.mig_instances == 1
    only = s.devices[0]
    assert (only.card, only.mig_index, only.gpu_instance_id, only.profile) == (1, 0, 0, "7g.40gb")
    assert [p.pid for p in s.processes_on(1100)] == [3301]


def test_pending_mig_mode_is_still_a_whole_card():
    s = scenario("a100-mig-pending")
    card = s.cards[0]
    assert (card.mig_current, card.mig_pending) == (False, True)
    assert card.utilization_ratio == 0.12
    assert [d.index for d in s.devices] == [0]
    whole = s.devices[0]
    assert whole.profile is None and whole.uuid == "GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f"
    assert whole.memory.used_bytes == 5123 * MIB and whole.memory.reserved_bytes == 562 * MIB
    assert whole.device_class == "a100-80g"
    assert [(p.pid, p.used_bytes) for p in s.processes_on(0)] == [(900, 5100 * MIB)]


def test_na_values_are_unknown_never_zero():
    s = scenario("na-memory")
    a10g, t4 = s.cards
    assert a10g.temperature_celsius is None and a10g.power_draw_watts is None and a10g.utilization_ratio is None
    assert a10g.mig_current is None and a10g.mig_pending is None
    d0 = s.device(0)
    assert (d0.memory.total_bytes, d0.memory.used_bytes, d0.memory.free_bytes, d0.memory.reserved_bytes) == (None,) * 4
    assert [(p.pid, p.type, p.used_bytes) for p in s.processes_on(0)] == [(4242, "C", None), (4243, "G", None)]
    # A real zero stays zero.
    assert t4.utilization_ratio == 0.0
    assert s.device(1).memory.used_bytes == 2 * MIB
    assert s.cuda_version == "12.2" and s.driver_version == "535.154.05"
    assert s.problems == ()


def test_mig_card_utilisation_is_none_and_card_readings_are_kept():
    s = scenario("h100-mig-processes")
    card = s.cards[0]
    assert card.utilization_ratio is None
    assert card.temperature_celsius == 52.0 and card.power_draw_watts == 432.17
    assert card.pci_bus_id == "00000000:19:00.0"
    assert card.mig_instances == 4
