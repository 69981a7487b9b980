"""The NVML read path, with the real pynvml running over a fake libnvidia-ml.

The parity tests are the heart: for every scenario, NVML and nvidia-smi give
the same snapshot — devices, indexes, profiles, UUIDs, classes, processes and
bytes — so a dashboard cannot tell which path fed it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
import time

import pynvml
import pytest
from click.testing import CliRunner

import fake_nvml
from conftest import MIB, fixture_bytes, sample_value, samples_of, scenario
from fake_nvml import OLD_DRIVER_MISSING, SCENARIOS
from mig_exporter.cli import cli
from mig_exporter.core import flight
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.doctor import timed_read
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.snapshot import ACTIVITY_NOT_READ, Snapshot
from mig_exporter.sources.demo import DemoProcs, DemoSource
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.sources.nvml_gateway import NvmlUnavailable

FIXTURE_SCENARIOS = ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved",
                     "a100-mig-pending", "na-memory"]


# What only NVML gives, and the nvidia-smi path cannot: ``nvidia-smi -q -x`` has no element for the
# energy a card used (NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION), so parity is asked of everything else.
NVML_ONLY_HEALTH = ("energy_joules",)
NVML_ONLY_FAMILIES = ("mig_exporter_card_energy_joules",)
# Their samples and, as a family without samples is not written at all, their HELP and TYPE lines.
NVML_ONLY_LINES = tuple(f"{start}{family}" for family in NVML_ONLY_FAMILIES
                        for start in ("", "# HELP ", "# TYPE "))
# Activity differs by path and by read: GPM is NVML's alone (nvidia-smi's XML has none: its devices
# say not_read, NVML's first read first_sample or no_gpm), and per-process activity comes from
# nvidia-smi pmon on the other path (tests/test_activity_nvml.py holds NVML's to its values).
ACTIVITY_FAMILIES = tuple(f"mig_exporter_{name}" for name in (
    "device_graphics_activity_ratio", "device_sm_activity_ratio", "device_sm_occupancy_ratio",
    "device_tensor_activity_ratio", "device_dram_bandwidth_ratio", "device_activity_window_seconds",
    "device_activity_unknown", "process_sm_activity_ratio", "process_memory_activity_ratio"))
ACTIVITY_LINES = tuple(f"{start}{family}" for family in ACTIVITY_FAMILIES for start in ("", "# HELP ", "# TYPE "))


# Scenarios whose driver's nvml.h has no field for the driver's recovery advice: 535's header has
# neither NVML_FI_DEV_RESET_STATUS nor _DRAIN_AND_RESET_STATUS (550.89's adds them, 570's
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; sources/nvml_header.py), so NVML reads recovery_action as
# unknown, while nvidia-smi 535 shows gpu_reset_status by means of its own, not a public field id.
NO_RECOVERY_FIELD = ("na-memory",)
RECOVERY_LINES = tuple(f"{start}mig_exporter_card_recovery_action" for start in ("", "# HELP ", "# TYPE "))


def as_nvml_reads(name: str) -> Snapshot:
    """The nvidia-smi snapshot of scenario ``name`` as NVML can read it: without a recovery
    action where the driver's header has no field for one (NO_RECOVERY_FIELD)."""
    smi = scenario(name)
    if name not in NO_RECOVERY_FIELD:
        return smi
    assert all(card.health.recovery_action is not None for card in smi.cards), "blank only what is known"
    return dataclasses.replace(smi, cards=tuple(
        dataclasses.replace(card, health=dataclasses.replace(card.health, recovery_action=None))
        for card in smi.cards))


def nvml_only_blanked(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` with NVML_ONLY_HEALTH left unknown on every card, and each device's activity and
    the processes' as the nvidia-smi path's XML reads them (not read), as the nvidia-smi path reads it.
    Every blanked value must be known first: a reading that vanished would pass unseen otherwise."""
    cards = []
    for card in snapshot.cards:
        if card.error is None:
            assert all(getattr(card.health, name) is not None for name in NVML_ONLY_HEALTH), card
        blank = dict.fromkeys(NVML_ONLY_HEALTH)
        cards.append(dataclasses.replace(card, health=dataclasses.replace(card.health, **blank)))
    devices = []
    for device in snapshot.devices:
        assert device.activity_unknown != ACTIVITY_NOT_READ, device
        devices.append(dataclasses.replace(device, activity=None, activity_unknown=ACTIVITY_NOT_READ))
    whole = {d.index for d in snapshot.devices if not d.is_mig}
    assert {a.device_index for a in snapshot.process_activity} <= whole
    return dataclasses.replace(snapshot, cards=tuple(cards), devices=tuple(devices), process_activity=())


@pytest.mark.parametrize("name", FIXTURE_SCENARIOS)
def test_nvml_snapshot_equals_the_nvidia_smi_snapshot(fake_nvml_lib, name):
    fake = fake_nvml_lib(name)
    assert nvml_only_blanked(NvmlSource().read()) == as_nvml_reads(name)
    assert fake.exceptions == []


def test_nvml_demo_equals_the_bundled_demo(fake_nvml_lib):
    fake_nvml_lib("demo")
    # The processes' activity is compared apart (below): the demo's is pmon's.
    assert nvml_only_blanked(NvmlSource().read()) == dataclasses.replace(DemoSource().read(), process_activity=())


def test_nvml_process_activity_on_the_demo_equals_the_bundled_pmon(fake_nvml_lib):
    """The same whole card's processes, measured on both paths: NVML's samples (the training job's
    two averaged, llama.cpp's none: idle), read just after the driver took the second, and the demo's
    pmon capture."""
    fake = fake_nvml_lib("demo")
    fake.set_wall_clock(fake_nvml.SAMPLED_AT_US / 1e6 + 1 / 6)
    def rows(snapshot):
        return sorted((a.pid, a.device_index, round(a.sm_ratio, 9), round(a.memory_ratio, 9))
                      for a in snapshot.process_activity)
    via_nvml = rows(NvmlSource(wall_clock=fake.wall_time).read())
    assert via_nvml == rows(DemoSource().read())
    assert via_nvml == [(50102, 1, 0.0, 0.0), (50318, 1, 0.63, 0.41)]


def test_mig_instances_are_enumerated_over_every_slot_and_empty_ones_skipped(fake_nvml_lib):
    fake = fake_nvml_lib("h100-mig-processes")
    snapshot = NvmlSource().read()
    assert [d.index for d in snapshot.devices] == [1000, 1001, 1002, 1003]
    # Seven slots asked for, four answered, three NOT_FOUND and skipped.
    assert fake.called("nvmlDeviceGetMigDeviceHandleByIndex") == 7
    assert [(p.pid, p.device_index, p.used_bytes) for p in snapshot.processes] == [
        (21180, 1000, 2296 * MIB), (21181, 1000, 1272 * MIB), (21198, 1002, 7484 * MIB)]


def test_a_lost_card_and_a_card_without_mig_permission_are_marked_and_the_third_reports(fake_nvml_lib, caplog):
    fake_nvml_lib("one-lost-one-no-permission")
    scraper = Scraper(NvmlSource())
    families = scraper.families()
    lost, denied, healthy = NvmlSource().read().cards
    assert lost.error == "NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetUUID"
    assert denied.error == "NVML_ERROR_NO_PERMISSION in nvmlDeviceGetMaxMigDeviceCount"
    assert denied.uuid is not None and denied.name is not None, "what was read before the failure is kept"
    assert healthy.error is None
    assert sample_value(families, "mig_exporter_card_read_success", {"card": "0"}) == 0
    assert sample_value(families, "mig_exporter_card_read_success", {"card": "1"}) == 0
    assert sample_value(families, "mig_exporter_card_read_success", {"card": "2"}) == 1
    # Only the card the driver says is lost is (GPUCardLost pages for it, not for a refusal).
    assert (lost.lost, denied.lost, healthy.lost) == (True, False, False)
    assert [s.labels for f in families if f.name == "mig_exporter_card_lost" for s in f.samples] == [{"card": "0"}]
    assert sample_value(families, "mig_exporter_card_lost", {"card": "0"}) == 1
    assert sample_value(families, "mig_exporter_read_success", {"source": "nvml"}) == 1
    assert sample_value(families, "mig_exporter_read_problems", {"source": "nvml"}) == 2
    assert sample_value(families, "mig_exporter_device_processes", {"index": "2"}) == 1
    assert "card 0: NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetUUID" in caplog.text
    assert "card 1: NVML_ERROR_NO_PERMISSION" in caplog.text


def test_r535_struct_mismatch_is_detected_and_the_older_call_gives_the_truth(fake_nvml_lib):
    bad = dataclasses.replace(SCENARIOS["h100-mig-processes"](), r535_struct_mismatch=True)
    fake = fake_nvml_lib(bad)
    snapshot = NvmlSource().read()
    assert nvml_only_blanked(snapshot) == scenario("h100-mig-processes")
    assert fake.called("nvmlDeviceGetComputeRunningProcesses_v2") > 0


def test_impossible_pids_are_never_exported_even_without_an_older_call(fake_nvml_lib):
    bad = dataclasses.replace(
        SCENARIOS["h100-mig-processes"](),
        r535_struct_mismatch=True,
        missing_functions=frozenset({"nvmlDeviceGetComputeRunningProcesses_v2"}),
    )
    fake_nvml_lib(bad)
    snapshot = NvmlSource().read()
    assert [(p.pid, p.used_bytes) for p in snapshot.processes] == [(21180, None), (21181, None), (21198, None)]
    assert snapshot.problems == tuple(
        f"card 0 MIG device {mig}: {dropped} process entries with impossible pids (0, or 4294967295: NVML's 'none') "
        f"dropped and the memory of {kept} unknown (NVML process struct version mismatch)"
        for mig, dropped, kept in ((0, 6, 2), (2, 3, 1)))


def test_an_older_driver_without_v3_process_calls_or_memory_v2_still_reads(fake_nvml_lib):
    old = dataclasses.replace(SCENARIOS["h100-mig-processes"](), missing_functions=OLD_DRIVER_MISSING)
    fake = fake_nvml_lib(old)
    snapshot = NvmlSource().read()
    assert [(p.pid, p.device_index) for p in snapshot.processes] == [(21180, 1000), (21181, 1000), (21198, 1002)]
    # v1 memory has no reserved field: unknown, not zero.
    assert all(d.memory.reserved_bytes is None for d in snapshot.devices)
    assert snapshot.device(1002).memory.total_bytes == 9984 * MIB
    assert fake.exceptions == []


def test_a_driver_with_no_process_list_pynvml_can_call_makes_every_device_unknown_not_free(fake_nvml_lib):
    lists = {f"nvmlDeviceGet{kind}RunningProcesses{suffix}"
             for kind in ("Compute", "Graphics", "MPSCompute") for suffix in ("_v2", "_v3")}
    fake_nvml_lib(dataclasses.replace(SCENARIOS["h100-mig-processes"](), missing_functions=frozenset(lists)))
    snapshot = NvmlSource().read()
    assert snapshot.devices and not any(d.processes_known for d in snapshot.devices)
    assert snapshot.processes == ()
    assert any("processes unknown" in problem for problem in snapshot.problems)
    assert samples_of(list(snapshot_families(snapshot)), "mig_exporter_device_processes") == []


def test_unknown_process_memory_is_none(fake_nvml_lib):
    fake_nvml_lib("na-memory")
    snapshot = NvmlSource().read()
    assert [(p.pid, p.type, p.used_bytes) for p in snapshot.processes_on(0)] == [(4242, "C", None), (4243, "G", None)]


def test_without_the_library_the_source_says_why(fake_nvml_lib):
    fake_nvml_lib(dataclasses.replace(SCENARIOS["demo"](), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    source = NvmlSource()
    ok, reason = source.ready()
    assert not ok and "NVML_ERROR_DRIVER_NOT_LOADED" in reason
    with pytest.raises(NvmlUnavailable, match="NVML cannot be initialised: NVML_ERROR_DRIVER_NOT_LOADED"):
        source.read()


def test_nvml_is_initialised_once_and_again_after_a_driver_error(fake_nvml_lib):
    fake = fake_nvml_lib("a100-mig-pending")
    source = NvmlSource()
    source.read()
    source.read()
    assert fake.called("nvmlInitWithFlags") == 1
    healthy = fake.scenario
    fake.set_scenario(dataclasses.replace(
        healthy, system_errors={"nvmlDeviceGetCount_v2": pynvml.NVML_ERROR_UNINITIALIZED}))
    with pytest.raises(ReadError, match="NVML_ERROR_UNINITIALIZED"):
        source.read()
    fake.set_scenario(healthy)
    assert nvml_only_blanked(source.read()) == scenario("a100-mig-pending")
    assert fake.called("nvmlInitWithFlags") == 2


def _hang(fake, symbol: str, release: threading.Event, argtypes) -> None:
    """Make one C function block until ``release`` is set (a wedged driver call)."""
    def blocked(*args):
        release.wait(30)
        return pynvml.NVML_ERROR_UNKNOWN
    hung = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(blocked)
    fake._functions[symbol] = hung
    pynvml._nvmlGetFunctionPointer_cache.pop(symbol, None)
    return hung


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_a_hung_call_fails_the_read_at_its_deadline_and_later_reads_do_not_pile_up(fake_nvml_lib, monkeypatch):
    """NVML calls run in a flight of their own, which waits no grace: a read still hung at its
    deadline fails then, so the scrape around it answers then too, with its own /proc reading;
    the next read joins the hung call rather than starting another."""
    monkeypatch.setattr(flight, "JOIN_GRACE_S", 5.0)  # a grace waited anywhere would show
    fake = fake_nvml_lib("a100-mig-pending")
    source = NvmlSource(timeout_s=10)
    source.read()  # initialised
    # The server's own limit is the caller's 0.3 s (issue 38: a caller due sooner than --timeout
    # answers alone, uncounted; this test is about the read that overruns its own deadline).
    exporter = Exporter(Scraper(source, EngineReader(DEFAULT_SETTINGS, DemoProcs())), timeout_s=0.3)
    before = len(_threads("nvml-read"))
    release = threading.Event()
    keep = _hang(fake, "nvmlDeviceGetCount_v2", release, (ctypes.c_void_p,))
    try:
        for _ in range(3):
            started = time.monotonic()
            answer = exporter.answer(Deadline.after(0.3))
            waited = time.monotonic() - started
            assert answer.outcome is not None and answer.outcome.error == "nvml read did not finish within 0.3s"
            assert waited < 2.5, f"answered after {waited:.2f}s: a grace was waited"
            # A failed read of its own: the engine families of its /proc read stay.
            names = {family.name for family in answer.families}
            assert {"mig_exporter_engine_processes", "mig_exporter_host_pid_namespace"} <= names
        assert len(_threads("nvml-read")) - before == 1, "the later reads joined the hung one instead of starting more"
        assert exporter.scraper.errors_total == 3
    finally:
        release.set()
    del keep


def test_doctor_reads_a_hung_call_as_a_failed_path_at_its_deadline(fake_nvml_lib):
    fake = fake_nvml_lib("a100-mig-pending")
    source = NvmlSource(timeout_s=10)
    source.read()  # initialised
    release = threading.Event()
    keep = _hang(fake, "nvmlDeviceGetCount_v2", release, (ctypes.c_void_p,))
    try:
        started = time.monotonic()
        reading = timed_read("nvml", lambda: source.read(Deadline.after(0.3)))
        assert time.monotonic() - started < 2
        assert reading.snapshot is None and reading.error == "nvml read did not finish within 0.3s"
    finally:
        release.set()
    del keep


def test_concurrent_reads_share_one_read(fake_nvml_lib):
    fake = fake_nvml_lib("h100-mig-processes")
    source = NvmlSource()
    source.read()
    exporter = Exporter(Scraper(source))
    before = fake.called("nvmlDeviceGetCount_v2")
    release = threading.Event()
    original = fake._functions["nvmlDeviceGetCount_v2"]

    def slow(out):
        release.wait(5)
        return original(out)
    fake._functions["nvmlDeviceGetCount_v2"] = keep = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(slow)
    pynvml._nvmlGetFunctionPointer_cache.pop("nvmlDeviceGetCount_v2", None)
    results = []
    readers = [threading.Thread(target=lambda: results.append(exporter.answer(Deadline.after(10)).outcome))
               for _ in range(5)]
    for r in readers:
        r.start()
    time.sleep(0.2)
    release.set()
    for r in readers:
        r.join(10)
    assert len(results) == 5 and all(nvml_only_blanked(r.snapshot) == scenario("h100-mig-processes") for r in results)
    assert fake.called("nvmlDeviceGetCount_v2") - before == 1
    del keep


def without_volatile(text: str, also: tuple[str, ...] = ()) -> str:
    """Exposition minus the per-read duration, NVML_ONLY_LINES and the lines starting with ``also``,
    with the source label made neutral and the answer's own sample count (mig_exporter_scrape_series)
    less the samples left out."""
    skipped = ("mig_exporter_read_duration_seconds{", *NVML_ONLY_LINES, *ACTIVITY_LINES, *also)
    lines = [line for line in text.splitlines() if not line.startswith(skipped)]
    counted = (*NVML_ONLY_FAMILIES, *ACTIVITY_FAMILIES, *(start for start in also if not start.startswith("#")))
    left_out = sum(1 for line in text.splitlines() if line.startswith(counted))
    lines = [f"mig_exporter_scrape_series {float(line.split()[1]) - left_out}"
             if line.startswith("mig_exporter_scrape_series ") else line for line in lines]
    return re.sub(r'source="[^"]+"', 'source="*"', "\n".join(lines))



@pytest.mark.parametrize("name", FIXTURE_SCENARIOS)
def test_read_source_nvml_prints_the_same_series_as_the_nvidia_smi_path(fake_nvml_lib, fake_nvidia_smi, name):
    fake_nvml_lib(name)
    smi = fake_nvidia_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"))
    runner = CliRunner()
    via_nvml = runner.invoke(cli, ["read", "--source", "nvml"])
    via_smi = runner.invoke(cli, ["read", "--source", "nvidia-smi", "--nvidia-smi", str(smi)])
    assert via_nvml.exit_code == 0 and via_smi.exit_code == 0
    assert 'mig_exporter_read_success{source="nvml"} 1.0' in via_nvml.stdout
    assert 'mig_exporter_read_success{source="nvidia-smi"} 1.0' in via_smi.stdout
    assert any(line.startswith(NVML_ONLY_FAMILIES) for line in via_nvml.stdout.splitlines())
    # Where NVML cannot read the recovery action (NO_RECOVERY_FIELD), its family is left out of
    # both: NVML writes no sample of it, nvidia-smi one per card.
    unread = RECOVERY_LINES if name in NO_RECOVERY_FIELD else ()
    if unread:
        assert not any(line.startswith(RECOVERY_LINES[0]) for line in via_nvml.stdout.splitlines())
    assert without_volatile(via_nvml.stdout, unread) == without_volatile(via_smi.stdout, unread)


def test_source_auto_takes_nvml_where_the_library_loads(fake_nvml_lib):
    fake_nvml_lib("h100-mig-processes")
    result = CliRunner().invoke(cli, ["read"])
    assert result.exit_code == 0
    assert 'mig_exporter_read_success{source="nvml"} 1.0' in result.stdout
    assert ('mig_exporter_device_memory_used_bytes{card="0",index="1002",mig_profile="1g.10gb"} 7.856979968e+09'
            in result.stdout)


def test_a_process_name_that_is_not_utf8_does_not_fail_the_read(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    odd = dataclasses.replace(base, process_names={**base.process_names, 21198: "/opt/\udcff\udcfe/llama-server"})
    fake = fake_nvml_lib(odd)
    snapshot = NvmlSource().read()
    names = {p.pid: p.name for p in snapshot.processes}
    assert names[21198] == "/opt/\ufffd\ufffd/llama-server"
    assert names[21180] == "/root/tools/memhog"
    assert fake.exceptions == []


def test_garbled_process_lists_never_export_garbage_memory(fake_nvml_lib):
    bad = dataclasses.replace(
        SCENARIOS["h100-mig-processes"](),
        r535_struct_mismatch=True,
        missing_functions=frozenset({"nvmlDeviceGetComputeRunningProcesses_v2"}),
    )
    fake_nvml_lib(bad)
    snapshot = NvmlSource().read()
    assert all(p.used_bytes is None for p in snapshot.processes)


def test_a_hung_readiness_check_answers_at_its_deadline(fake_nvml_lib):
    fake = fake_nvml_lib("a100-mig-pending")
    source = NvmlSource(timeout_s=0.5)
    release = threading.Event()
    keep = _hang(fake, "nvmlInitWithFlags", release, (ctypes.c_uint,))
    try:
        started = time.monotonic()
        ok, reason = source.ready()
        assert not ok and "did not finish within 0.5s" in reason
        assert time.monotonic() - started < 2.0
    finally:
        release.set()
    del keep


# -- what a read keeps from the last one ------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_SCENARIOS)
def test_every_later_read_equals_the_nvidia_smi_snapshot_too(fake_nvml_lib, name):
    fake = fake_nvml_lib(name)
    source = NvmlSource()
    assert [nvml_only_blanked(source.read()) for _ in range(3)] == [as_nvml_reads(name)] * 3
    assert fake.exceptions == []


def test_a_later_read_shows_what_changed_in_a_process_list(fake_nvml_lib):
    fake = fake_nvml_lib("h100-mig-processes")
    source = NvmlSource()
    first = source.read()
    card = fake.scenario.cards[0]
    mig = card.mig_devices[0]
    moved = dataclasses.replace(mig, compute_processes=(
        dataclasses.replace(mig.compute_processes[0], used_bytes=4096 * MIB), *mig.compute_processes[1:]),
        graphics_processes=(mig.compute_processes[1],))
    fake.set_scenario(dataclasses.replace(fake.scenario, cards=(
        dataclasses.replace(card, mig_devices=(moved, *card.mig_devices[1:])), *fake.scenario.cards[1:])))
    later = source.read()
    assert [(p.pid, p.type, p.used_bytes) for p in first.processes] == [
        (21180, "C", 2296 * MIB), (21181, "C", 1272 * MIB), (21198, "C", 7484 * MIB)]
    assert [(p.pid, p.type, p.used_bytes) for p in later.processes] == [
        (21180, "C", 4096 * MIB), (21181, "C+G", 1272 * MIB), (21198, "C", 7484 * MIB)]


def test_a_process_that_renames_itself_shows_its_new_name(fake_nvml_lib):
    # The pid is not handed out again, yet the process's name changes under it, as setproctitle
    # (Ray's "ray::IDLE" -> "ray::_MapWorker", gunicorn, celery) or an exec does: nvidia-smi shows
    # the new name at the next read, and so does a later NVML read.
    base = SCENARIOS["h100-mig-processes"]()
    fake = fake_nvml_lib(dataclasses.replace(base, process_names={**base.process_names, 21198: "ray::IDLE"}))
    source = NvmlSource()
    assert [(p.pid, p.name) for p in source.read().processes][-1] == (21198, "ray::IDLE")
    renamed = {**base.process_names, 21198: "ray::_MapWorker"}
    fake.set_scenario(dataclasses.replace(fake.scenario, process_names=renamed))
    assert [(p.pid, p.name) for p in source.read().processes] == [
        (21180, "/root/tools/memhog"), (21181, "/root/tools/memhog"), (21198, "ray::_MapWorker")]
    assert [c.args[0] for c in fake.calls if c.function == "nvmlSystemGetProcessName"] == [21180, 21181, 21198] * 2


def test_a_process_whose_memory_changed_between_reads_shows_its_new_memory(fake_nvml_lib):
    """Issue 17: a read keeps each card's placement and reuses it while the card's instances and
    processes are equal (model/placement.py): one that changed is placed again."""
    fake = fake_nvml_lib("h100-mig-processes")
    source = NvmlSource()
    first = source.read()
    assert nvml_only_blanked(first) == scenario("h100-mig-processes")
    base = fake.scenario
    card = base.cards[0]
    mig = card.mig_devices[0]
    grown = dataclasses.replace(mig, compute_processes=tuple(
        dataclasses.replace(p, used_bytes=p.used_bytes + MIB) for p in mig.compute_processes))
    fake.set_scenario(dataclasses.replace(base, cards=(
        dataclasses.replace(card, mig_devices=(grown, *card.mig_devices[1:])), *base.cards[1:])))
    again = source.read()
    pids = {p.pid for p in mig.compute_processes}
    assert pids
    for before, after in zip(first.processes, again.processes, strict=True):
        assert after.used_bytes == before.used_bytes + (MIB if after.pid in pids else 0)
    fake.set_scenario(base)
    # Equal but for activity, whose window grows with the time the reads took.
    assert nvml_only_blanked(source.read()) == nvml_only_blanked(first)
