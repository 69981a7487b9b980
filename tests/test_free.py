"""The one definition of free (model/capacity.py), case by case on captured outputs: a
device is free only when a scheduler may place work on it. Each case that issue 36 names
counts 0 free here; tests/test_capacity.py and tests/test_freshness.py check the other views
(the rules in a real Prometheus, the dashboard, status, doctor, the landing page, fleet)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from conftest import FIXTURES, MIB, REAL_CORPUS, SAMPLES, fixture_bytes
from mig_exporter.core.errors import ReadError
from mig_exporter.metrics.families import device_state_families
from mig_exporter.model.capacity import (
    EMPTY_DEVICE_MARGIN_BYTES,
    FREE,
    IN_USE,
    UNKNOWN,
    HostView,
    count_by_class,
    device_states,
    host_view,
)
from mig_exporter.model.readings import Allocation, EngineReading, PodReading, SlurmAllocation, SlurmJobMapReading
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from test_capacity import LISTING, THREE_G, free_three_g_xml, held_three_g_xml

GIB = 1024**3


def _free_demo():
    return snapshot_from_smi(free_three_g_xml(), LISTING)


def test_an_empty_device_whose_host_pids_are_seen_is_free():
    states = device_states(_free_demo())
    assert states[1000] == (FREE, "no process, no allocation, memory as an empty device's")
    assert states[1002].state == FREE  # the demo's idle 1g.10gb: 13 MiB in use
    assert states[1001] == (IN_USE, "1 process listed") and states[1] == (IN_USE, "2 processes listed")


@pytest.mark.parametrize(("host", "reason"), [
    (HostView(allocated={1000: ("Slurm job 4242",)}), "allocated to Slurm job 4242 (no process yet)"),
    (HostView(allocated={1000: ("pod llm/llama-0",)}), "allocated to pod llm/llama-0 (no process yet)"),
])
def test_an_allocated_device_with_no_process_yet_is_in_use(host, reason):
    assert device_states(_free_demo(), host)[1000] == (IN_USE, reason)
    assert {c.device_class: c.free for c in count_by_class(_free_demo(), host)}[THREE_G] == 0


@pytest.mark.parametrize(("host", "says"), [
    (HostView(host_pids=False), "does not see the host's PIDs"),
    (HostView(host_pids=None), "(/proc not read)"),
    (HostView(allocations_known=False), "allocations could not be read"),
])
def test_what_cannot_be_told_makes_an_empty_device_unknown(host, says):
    states = device_states(_free_demo(), host)
    assert states[1000].state == UNKNOWN and says in states[1000].reason
    assert states[1001].state == IN_USE  # a listed process is work whatever else is unknown
    assert sum(c.free for c in count_by_class(_free_demo(), host)) == 0


def test_memory_held_with_no_process_listed_is_unknown():
    snapshot = snapshot_from_smi(held_three_g_xml(), LISTING)
    assert device_states(snapshot)[1000] == (UNKNOWN, "11.4 GiB in use with no process listed")


def test_two_whole_cards_with_50_gib_used_and_no_process_are_unknown_not_free():
    """The issue's node: `doctor` said `(2 free)` beside `ERROR [memory-without-processes]`."""
    xml = (SAMPLES / "demo.xml").read_text()
    xml = re.sub(r"<processes>.*?</processes>", "<processes>\n\t\t</processes>", xml, flags=re.S)
    snapshot = snapshot_from_smi(xml.encode(), LISTING)
    card = snapshot.device(1)
    assert card is not None and card.memory.used_bytes is not None and card.memory.used_bytes > 20 * GIB
    assert device_states(snapshot)[1] == (UNKNOWN, f"{card.memory.used_bytes / GIB:.1f} GiB in use with no "
                                                   "process listed")


@pytest.mark.parametrize("processes", ["<processes>N/A</processes>", "<processes>Not Supported</processes>", ""])
def test_a_process_list_the_driver_does_not_give_is_unknown(processes):
    xml = re.sub(r"<processes>.*?</processes>", processes, free_three_g_xml().decode(), flags=re.S)
    snapshot = snapshot_from_smi(xml.encode(), LISTING)
    assert {i: s for i, s in device_states(snapshot).items()} == {
        d.index: (UNKNOWN, "the driver gives no process list for it") for d in snapshot.devices}


def test_an_unreadable_card_s_devices_are_unknown():
    snapshot = _free_demo()
    broken = replace(snapshot, cards=tuple(replace(c, error="GPU_IS_LOST") if c.index == 0 else c
                                           for c in snapshot.cards))
    assert {i: s.state for i, s in device_states(broken).items() if i >= 1000} == {
        1000: UNKNOWN, 1001: IN_USE, 1002: UNKNOWN}
    assert device_states(broken)[1000].reason == "its card could not be read"


def test_a_compute_instance_whose_gpu_instance_holds_a_siblings_memory_is_in_use():
    """H200 GPU instance 1 split into two compute instances (0/mig0, 0/mig1), each with a
    process; with 0/mig1's process gone, its GPU instance still has 30210 MiB held by 0/mig0:
    less than the profile's whole memory is left, so 0/mig1 is not free, and says why."""
    xml = fixture_bytes("h200-shared-gpu-instance.xml").decode()
    (block,) = [b for b in re.findall(r"[ \t]*<process_info>.*?</process_info>\n", xml, re.S)
                if "<pid>7002</pid>" in b]
    snapshot = snapshot_from_smi(xml.replace(block, "").encode(),
                                 (FIXTURES / "h200-shared-gpu-instance.L.txt").read_bytes())
    states = device_states(snapshot)
    assert states[1001] == (IN_USE, "its GPU instance's memory is shared with 0/mig0, which holds 29.5 GiB of it")
    assert states[1003].state == FREE and states[1004].state == FREE  # 13 MiB each, GPU instances of their own


def test_host_view_reads_the_kubelet_the_job_map_and_the_namespace():
    engines = EngineReading((), True, None, True)
    pods = PodReading({}, (Allocation(1000, "llm", "llama-0", "server", "nvidia.com/mig-3g.40gb"),), True)
    jobs = SlurmJobMapReading((SlurmAllocation(1002, "4242"), SlurmAllocation(1002, "4243")), True)
    host = host_view(engines, pods, jobs)
    assert host == HostView(True, {1000: ("pod llm/llama-0",), 1002: ("Slurm job 4242", "Slurm job 4243")}, True)
    # Asked and not answering: allocations unknown. Not asked (no socket): none.
    assert not host_view(engines, PodReading({}, None, False), None).allocations_known
    assert host_view(engines, PodReading({}, None, None), None).allocations_known
    assert not host_view(engines, None, SlurmJobMapReading((), False)).allocations_known
    assert host_view(None, None, None).host_pids is None


def test_allocations_read_in_part_make_an_empty_device_unknown_not_free():
    """A job map read in part (a device's file unread, the budget spent, too many files) may miss
    the job on the empty 3g.40gb; so may a pod whose kubelet socket is missing. Neither is free,
    and what was read still counts: the job map's allocated device stays in use."""
    snapshot = snapshot_from_smi(free_three_g_xml(), LISTING)
    engines = EngineReading((), True, None, True)
    assert device_states(snapshot, host_view(engines, None, SlurmJobMapReading((), True)))[1000].state == FREE
    partial = SlurmJobMapReading((SlurmAllocation(1002, "4242"),), True, ("slurm job map file '0': cannot read",),
                                 complete=False)
    host = host_view(engines, None, partial)
    assert host.allocated == {1002: ("Slurm job 4242",)} and not host.allocations_known
    states = device_states(snapshot, host)
    assert states[1000] == (UNKNOWN, "the device allocations could not be read (kubelet or Slurm job map)")
    assert states[1002].state == IN_USE
    # No socket in a pod: the kubelet was due to be asked (pods.py), so success is False, not None.
    in_pod = PodReading({}, None, False, ("no kubelet pod-resources socket at …, though this runs in a pod",))
    assert device_states(snapshot, host_view(engines, in_pod, None))[1000].state == UNKNOWN


def test_the_state_family_has_one_series_per_state_and_exactly_one_is_1():
    (family,) = device_state_families(_free_demo(), HostView(allocated={1002: ("Slurm job 7",)}))
    by_device: dict[str, dict[str, float]] = {}
    for s in family.samples:
        by_device.setdefault(s.labels["index"], {})[s.labels["state"]] = s.value
    assert by_device == {
        "1000": {"free": 1, "in_use": 0, "unknown": 0},
        "1001": {"free": 0, "in_use": 1, "unknown": 0},
        "1002": {"free": 0, "in_use": 1, "unknown": 0},
        "1": {"free": 0, "in_use": 1, "unknown": 0},
    }


def test_the_margin_lies_between_every_empty_device_and_every_compute_process_in_the_real_captures():
    """Where EMPTY_DEVICE_MARGIN_BYTES comes from (docs/capacity.md): every device the real
    corpus lists no process on holds at most 116 MiB, but one (a container's view of a card in
    use, 9184 MiB: the case the margin is for); the smallest compute process holds 160 MiB."""
    empty, compute = [], []
    for path in sorted(REAL_CORPUS.glob("*.xml")) + sorted(FIXTURES.glob("*.xml")):
        try:
            snapshot = snapshot_from_smi(path.read_bytes(), None)
        except ReadError:  # a fixture made to fail parsing has no devices to count
            continue
        listed = {p.device_index for p in snapshot.processes}
        empty += [(d.memory.used_bytes, path.name, d.display_name) for d in snapshot.devices
                  if d.processes_known and d.index not in listed and d.memory.used_bytes is not None]
        compute += [p.used_bytes for p in snapshot.processes if "C" in p.type and p.used_bytes]
    held = [e for e in empty if e[0] > EMPTY_DEVICE_MARGIN_BYTES]
    assert [(name, device, used // MIB) for used, name, device in held] == [
        ("telegraf-rtx-3080-v13-drv595.xml", "0", 9184)]
    assert max(e[0] for e in empty if e not in held) == 116 * MIB
    assert min(compute) == 160 * MIB
    assert 116 * MIB < EMPTY_DEVICE_MARGIN_BYTES < 160 * MIB
