"""Issue 39: the activity families, from hand-built snapshots (model/snapshot.py's Activity).

Device activity (GPM) per device, each compute instance of a GPU instance with what the GPU
instance reports; left out where not measured, with ``mig_exporter_device_activity_unknown``
saying why; never a 0 for what was not measured. Per-process activity on whole cards for the
processes that have series of their own under ``--collector.processes``, never for
``pid="other"``."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import sample_value, samples_of, scenario
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.process_series import ProcessSeries
from mig_exporter.model.snapshot import (
    ACTIVITY_FIRST_SAMPLE,
    ACTIVITY_NO_COMPUTE_INSTANCE,
    ACTIVITY_NO_GPM,
    ACTIVITY_NOT_MEASURED,
    ACTIVITY_NOT_READ,
    ACTIVITY_READ_FAILED,
    Activity,
    PlacedProcessActivity,
    Snapshot,
)

RATIOS = ["mig_exporter_device_graphics_activity_ratio", "mig_exporter_device_sm_activity_ratio",
          "mig_exporter_device_sm_occupancy_ratio", "mig_exporter_device_tensor_activity_ratio",
          "mig_exporter_device_dram_bandwidth_ratio"]
WINDOW = "mig_exporter_device_activity_window_seconds"
UNKNOWN = "mig_exporter_device_activity_unknown"
PROCESS_RATIOS = ["mig_exporter_process_sm_activity_ratio", "mig_exporter_process_memory_activity_ratio"]
BUSY = Activity(30.5, graphics_ratio=0.62, sm_ratio=0.41, sm_occupancy_ratio=0.2, tensor_ratio=0.1,
                dram_bandwidth_ratio=0.33)


def _with_activity(snapshot: Snapshot, by_index: dict[int, Activity | str]) -> Snapshot:
    """Each device of ``by_index`` given its Activity, or the reason it has none (others keep theirs)."""
    devices = []
    for d in snapshot.devices:
        given = by_index.get(d.index)
        if isinstance(given, Activity):
            d = dataclasses.replace(d, activity=given, activity_unknown=None)
        elif given is not None:
            d = dataclasses.replace(d, activity=None, activity_unknown=given)
        devices.append(d)
    return dataclasses.replace(snapshot, devices=tuple(devices))


def _shared_gi() -> Snapshot:
    """h200-shared-gpu-instance: 1000 and 1001 are compute instances of GPU instance 1, so the
    read gives both GPU instance 1's activity; 1002 busy on its own; 1003 has no compute
    instance's data, 1004 a read that failed."""
    gi1 = Activity(30.0, graphics_ratio=0.004, sm_ratio=0.002, sm_occupancy_ratio=0.001, tensor_ratio=0.0,
                   dram_bandwidth_ratio=0.003)
    return _with_activity(scenario("h200-shared-gpu-instance"), {
        1000: gi1, 1001: gi1, 1002: BUSY, 1003: ACTIVITY_NO_COMPUTE_INSTANCE, 1004: ACTIVITY_READ_FAILED})


def _by_index(families, name: str) -> dict[str, float]:
    return {s.labels["index"]: s.value for s in samples_of(families, name)}


def test_each_device_has_its_ratios_and_window_and_compute_instances_share_their_gpu_instances():
    families = list(snapshot_families(_shared_gi()))
    assert _by_index(families, "mig_exporter_device_graphics_activity_ratio") == {
        "1000": 0.004, "1001": 0.004, "1002": 0.62}
    assert _by_index(families, "mig_exporter_device_sm_activity_ratio") == {"1000": 0.002, "1001": 0.002, "1002": 0.41}
    assert _by_index(families, "mig_exporter_device_sm_occupancy_ratio") == {
        "1000": 0.001, "1001": 0.001, "1002": 0.2}
    # A measured 0 is a 0: written.
    assert _by_index(families, "mig_exporter_device_tensor_activity_ratio") == {"1000": 0.0, "1001": 0.0, "1002": 0.1}
    assert _by_index(families, "mig_exporter_device_dram_bandwidth_ratio") == {
        "1000": 0.003, "1001": 0.003, "1002": 0.33}
    assert _by_index(families, WINDOW) == {"1000": 30.0, "1001": 30.0, "1002": 30.5}
    assert sample_value(families, "mig_exporter_device_sm_activity_ratio", {"index": "1001"}) == 0.002
    (labels,) = [s.labels for s in samples_of(families, "mig_exporter_device_sm_activity_ratio")
                 if s.labels["index"] == "1002"]
    assert labels == {"index": "1002", "card": "0", "mig_profile": "2g.35gb"}


def test_a_device_without_activity_has_no_ratio_and_says_why():
    families = list(snapshot_families(_shared_gi()))
    unknown = {s.labels["index"]: (s.labels["reason"], s.value) for s in samples_of(families, UNKNOWN)}
    assert unknown == {"1003": (ACTIVITY_NO_COMPUTE_INSTANCE, 1.0), "1004": (ACTIVITY_READ_FAILED, 1.0)}
    for name in [*RATIOS, WINDOW]:
        assert not {"1003", "1004"} & set(_by_index(families, name)), name
    (labels,) = [s.labels for s in samples_of(families, UNKNOWN) if s.labels["index"] == "1003"]
    assert labels == {"index": "1003", "card": "0", "mig_profile": "1g.18gb", "reason": "no_compute_instance"}


@pytest.mark.parametrize("reason", [ACTIVITY_NO_GPM, ACTIVITY_FIRST_SAMPLE, ACTIVITY_NO_COMPUTE_INSTANCE,
                                    ACTIVITY_NOT_MEASURED, ACTIVITY_READ_FAILED, ACTIVITY_NOT_READ])
def test_a_read_that_measures_nothing_writes_no_activity_family_at_all_only_why(reason):
    """An A100 (no_gpm), the first scrape, the nvidia-smi path: no ratio family, not even its
    HELP line, and never a 0; one unknown series per device with the reason."""
    snapshot = scenario("h100-mig-processes")
    snapshot = _with_activity(snapshot, dict.fromkeys((d.index for d in snapshot.devices), reason))
    families = list(snapshot_families(snapshot))
    names = {f.name for f in families}
    assert not names & {*RATIOS, WINDOW, *PROCESS_RATIOS}
    assert {(s.labels["index"], s.labels["reason"]) for s in samples_of(families, UNKNOWN)} == {
        (str(d.index), reason) for d in snapshot.devices}
    text = _text(families)
    assert "activity_ratio" not in text and "dram_bandwidth" not in text and "window_seconds" not in text


def test_the_nvidia_smi_path_reads_no_activity_and_says_so():
    """The model's default: a path that does not read activity leaves it as not_read."""
    families = list(snapshot_families(scenario("h100-mig-processes")))
    assert {s.labels["reason"] for s in samples_of(families, UNKNOWN)} == {ACTIVITY_NOT_READ}
    assert len(samples_of(families, UNKNOWN)) == 4


def test_a_metric_the_driver_did_not_measure_is_left_out_of_its_family_alone():
    """One metric's own return code not success (or NaN): that ratio is None, the others written."""
    partial = Activity(30.0, graphics_ratio=0.5, sm_ratio=None, sm_occupancy_ratio=0.3, tensor_ratio=None,
                       dram_bandwidth_ratio=None)
    snapshot = _with_activity(scenario("h100-mig-processes"), {1000: partial, 1002: BUSY})
    families = list(snapshot_families(snapshot))
    assert _by_index(families, "mig_exporter_device_graphics_activity_ratio") == {"1000": 0.5, "1002": 0.62}
    assert _by_index(families, "mig_exporter_device_sm_activity_ratio") == {"1002": 0.41}
    assert _by_index(families, "mig_exporter_device_tensor_activity_ratio") == {"1002": 0.1}
    assert _by_index(families, WINDOW) == {"1000": 30.0, "1002": 30.5}
    # 1001 and 1003 keep the nvidia-smi path's not_read; 1000 is measured, so not unknown.
    assert set(_by_index(families, UNKNOWN)) == {"1001", "1003"}


def test_only_one_measured_metric_writes_only_its_family():
    only_dram = Activity(30.0, dram_bandwidth_ratio=0.25)
    families = list(snapshot_families(_with_activity(scenario("h100-mig-processes"), {1000: only_dram})))
    names = {f.name for f in families}
    assert names & set(RATIOS) == {"mig_exporter_device_dram_bandwidth_ratio"}
    assert _by_index(families, WINDOW) == {"1000": 30.0}


def test_a_window_of_no_time_is_left_out_not_zero():
    families = list(snapshot_families(_with_activity(scenario("h100-mig-processes"), {
        1000: Activity(0.0, graphics_ratio=0.1)})))
    assert _by_index(families, "mig_exporter_device_graphics_activity_ratio") == {"1000": 0.1}
    assert _by_index(families, WINDOW) == {}


# --- per-process activity on whole cards ---------------------------------------------------------

def _whole_cards() -> Snapshot:
    """na-memory's whole card 0 (pids 4242 and 4243, memory N/A) with per-process samples: one
    busy, one idle (0: listed, and the driver sampled nothing of it)."""
    snapshot = scenario("na-memory")
    pids = [(p.pid, p.device_index) for p in snapshot.processes]
    activity = []
    for n, (pid, index) in enumerate(pids):
        activity.append(PlacedProcessActivity(pid, index, 0.0 if n == 1 else 0.5 + n / 10, 0.0 if n == 1 else 0.2))
    return dataclasses.replace(snapshot, process_activity=tuple(activity))


def test_each_process_on_a_whole_card_has_its_sm_and_memory_activity():
    snapshot = _whole_cards()
    families = list(snapshot_families(snapshot))
    expected_sm = {(str(a.device_index), str(a.pid)): a.sm_ratio for a in snapshot.process_activity}
    sm = {(s.labels["index"], s.labels["pid"]): s.value
          for s in samples_of(families, "mig_exporter_process_sm_activity_ratio")}
    assert sm == expected_sm and len(sm) == len(snapshot.processes) >= 2
    assert 0.0 in sm.values(), "an idle process is a measured 0"
    memory = {(s.labels["index"], s.labels["pid"]): s.value
              for s in samples_of(families, "mig_exporter_process_memory_activity_ratio")}
    assert set(memory) == set(sm)
    first = samples_of(families, "mig_exporter_process_sm_activity_ratio")[0].labels
    assert set(first) == {"index", "card", "mig_profile", "pid"}


def test_process_activity_follows_collector_processes():
    """top=N: the processes kept have it, pid="other" none; none: no process series at all."""
    snapshot = _two_on_one_card()
    kept = list(snapshot_families(snapshot, process_series=ProcessSeries(top=1)))
    memory = {s.labels["pid"] for s in samples_of(kept, "mig_exporter_process_memory_used_bytes")}
    assert memory == {"900", "other"}
    for name in PROCESS_RATIOS:
        assert {s.labels["pid"] for s in samples_of(kept, name)} == {"900"}, name
    none = list(snapshot_families(snapshot, process_series=ProcessSeries(enabled=False)))
    assert not {f.name for f in none} & set(PROCESS_RATIOS)
    every = list(snapshot_families(snapshot))
    assert {s.labels["pid"] for s in samples_of(every, "mig_exporter_process_sm_activity_ratio")} == {"900", "901"}


def _two_on_one_card() -> Snapshot:
    """a100-mig-pending's whole card 0 with pid 900 (5100 MiB) and a second, smaller process."""
    snapshot = scenario("a100-mig-pending")
    (p,) = snapshot.processes
    second = p._replace(pid=901, used_bytes=100 * 1024 * 1024, name="python3")
    return dataclasses.replace(snapshot, processes=(p, second), process_activity=(
        PlacedProcessActivity(900, 0, 0.0, 0.0), PlacedProcessActivity(901, 0, 0.7, 0.1)))


def test_a_process_without_a_sample_row_or_a_card_in_mig_mode_has_no_process_activity():
    """process_activity () (a card in MIG mode, a failed read, a path that does not read it):
    no process activity family; a process with no row of its own is left out, not 0."""
    assert not {f.name for f in snapshot_families(scenario("h100-mig-processes"))} & set(PROCESS_RATIOS)
    snapshot = _two_on_one_card()
    snapshot = dataclasses.replace(snapshot, process_activity=snapshot.process_activity[1:])
    families = list(snapshot_families(snapshot))
    assert {s.labels["pid"] for s in samples_of(families, "mig_exporter_process_sm_activity_ratio")} == {"901"}


def test_a_metric_the_driver_did_not_give_for_a_process_is_left_out():
    snapshot = _two_on_one_card()
    snapshot = dataclasses.replace(snapshot, process_activity=(
        PlacedProcessActivity(900, 0, 0.3, None), PlacedProcessActivity(901, 0, 0.7, None)))
    names = {f.name for f in snapshot_families(snapshot)}
    assert "mig_exporter_process_sm_activity_ratio" in names
    assert "mig_exporter_process_memory_activity_ratio" not in names


def test_the_exposition_of_activity_is_what_promtool_reads():
    """Text and values as written: one HELP and TYPE each, base units, the labels of the
    device memory families."""
    text = _text(list(snapshot_families(_shared_gi())))
    assert 'mig_exporter_device_sm_activity_ratio{card="0",index="1002",mig_profile="2g.35gb"} 0.41' in text
    assert ('mig_exporter_device_activity_unknown{card="0",index="1004",mig_profile="1g.18gb",'
            'reason="read_failed"} 1.0') in text
    for name in [*RATIOS, WINDOW, UNKNOWN]:
        assert text.count(f"# TYPE {name} gauge\n") == 1, name


def _text(families) -> str:
    class _Collector:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()
