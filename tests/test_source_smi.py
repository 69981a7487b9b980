"""NvidiaSmiSource through a fake nvidia-smi: a real executable printing our
fixture outputs, run through the real subprocess path. Expected values are
the ones in tests/fixtures/nvidia-smi/README.md."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import MIB, FakeSmi, calls, fixture_bytes, left_behind, threads_started
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import (
    CommandFailed,
    CommandNotFound,
    CommandTimeout,
    OutputTooLarge,
    ParseError,
    ReadError,
)
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource

pytestmark = pytest.mark.timeout(30)

DRIVER_ERROR = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


# --- helpers -----------------------------------------------------------------------------------

def fake_for(fake_nvidia_smi: FakeSmi, name: str, **kwargs) -> Path:
    return fake_nvidia_smi(xml=fixture_bytes(f"{name}.xml"), listing=fixture_bytes(f"{name}.L.txt"), **kwargs)


def timed_read(source: NvidiaSmiSource, **kwargs) -> tuple[Snapshot | BaseException, float]:
    started = time.monotonic()
    try:
        result: Snapshot | BaseException = source.read(**kwargs)
    except BaseException as e:  # the test inspects what escaped
        result = e
    return result, time.monotonic() - started


# --- a MIG node --------------------------------------------------------------------------------

H100_DEVICES = {
    # index: (mig index, GI, CI, profile, MIG UUID, total MiB, used MiB, free MiB)
    1000: (0, 2, 0, "3g.40gb", "MIG-12b47fa4-2f93-5cea-b2ff-bf3e0b6e9aba", 40448, 3594, 36854),
    1001: (1, 3, 0, "2g.20gb", "MIG-7cd8995e-feba-5903-8050-d09c5892503e", 20096, 17, 20079),
    1002: (2, 9, 0, "1g.10gb", "MIG-ae36563d-8b6d-5a25-a43a-846eb31e7ea4", 9984, 7493, 2491),
    1003: (3, 10, 0, "1g.10gb", "MIG-45ee6ebc-57f4-5590-941e-1f037860cf29", 9984, 9, 9975),
}


def test_mig_node_reads_as_its_four_instances(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()

    assert snapshot.driver_version == "550.90.07"
    assert snapshot.cuda_version == "12.4"
    assert snapshot.problems == ()
    assert [d.index for d in snapshot.devices] == [1000, 1001, 1002, 1003]
    for d in snapshot.devices:
        mig_index, gi, ci, profile, uuid, total, used, free = H100_DEVICES[d.index]
        assert d.card == 0
        assert (d.mig_index, d.gpu_instance_id, d.compute_instance_id) == (mig_index, gi, ci)
        assert d.profile == profile
        assert d.uuid == uuid
        assert d.memory.total_bytes == total * MIB
        assert d.memory.used_bytes == used * MIB
        assert d.memory.free_bytes == free * MIB
        assert d.memory.reserved_bytes == 0

    (card,) = snapshot.cards
    assert card.uuid == "GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2"
    assert card.name == "NVIDIA H100 80GB HBM3"
    assert card.pci_bus_id == "00000000:19:00.0"
    assert (card.mig_current, card.mig_pending, card.mig_instances) == (True, True, 4)
    assert card.temperature_celsius == 52
    assert card.power_draw_watts == pytest.approx(432.17)
    assert card.utilization_ratio is None


def test_mig_node_places_each_process_on_its_instance(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()

    placed = {p.pid: (p.device_index, p.type, p.name, p.used_bytes) for p in snapshot.processes}
    assert placed == {
        21180: (1000, "C", "/root/tools/memhog", 2407530496),  # 2296 MiB
        21181: (1000, "C", "/root/tools/memhog", 1333788672),  # 1272 MiB
        21198: (1002, "C", "./gpu_burn", 7847542784),  # 7484 MiB
    }
    assert snapshot.processes_on(1001) == ()
    assert snapshot.processes_on(1003) == ()


def test_each_read_runs_query_and_listing_once(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    source = NvidiaSmiSource(str(fake), timeout_s=10)

    source.read()
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"]

    source.read()
    assert sorted(args for _, args in calls(fake)) == ["-L", "-L", "-q -x", "-q -x"]


def test_reads_are_fresh_each_time(fake_nvidia_smi: FakeSmi) -> None:
    # The source keeps nothing between reads: new output is seen at the next read.
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    assert len(source.read().devices) == 4

    (fake.parent / "q.xml").write_bytes(fixture_bytes("a100-mig-pending.xml"))
    (fake.parent / "L.txt").write_bytes(fixture_bytes("a100-mig-pending.L.txt"))
    assert [d.index for d in source.read().devices] == [0]


def test_non_mig_node_is_one_whole_card_device(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "a100-mig-pending")
    snapshot = NvidiaSmiSource(str(fake), timeout_s=10).read()

    assert snapshot.problems == ()
    (device,) = snapshot.devices
    assert device.index == 0
    assert device.mig_index is None
    assert device.profile is None
    assert device.uuid == "GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f"
    assert device.memory.total_bytes == 85899345920
    assert device.memory.used_bytes == 5371854848
    assert device.memory.reserved_bytes == 562 * MIB
    assert device.memory.free_bytes == 76235 * MIB
    (card,) = snapshot.cards
    assert (card.mig_current, card.mig_pending, card.mig_instances) == (False, True, None)
    assert card.utilization_ratio == pytest.approx(0.12)
    (process,) = snapshot.processes
    assert (process.pid, process.type, process.name, process.used_bytes, process.device_index) == (
        900, "C", "/usr/bin/python3", 5347737600, 0,
    )


# --- the query fails ---------------------------------------------------------------------------

def test_hanging_query_times_out_and_leaves_no_process(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="hang")
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=1.0))

    assert isinstance(result, CommandTimeout), result
    assert elapsed < 1.0 + 1.0
    assert "-q -x" in str(result)
    pgids = [pid for pid, _ in calls(fake)]
    assert len(pgids) == 2
    live, zombies = left_behind(pgids)
    assert live == [], f"left running: {live}"
    assert zombies == []


def test_hanging_query_and_listing_both_are_killed(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="hang", list_mode="hang")
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=1.0))

    assert isinstance(result, CommandTimeout), result
    assert elapsed < 1.0 + 1.0
    pgids = [pid for pid, _ in calls(fake)]
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"]
    live, zombies = left_behind(pgids)
    assert live == [], f"left running: {live}"
    assert zombies == []


def test_failing_query_raises_command_failed_with_the_driver_message(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="fail", stderr=DRIVER_ERROR, exit_code=9)
    with pytest.raises(CommandFailed) as raised:
        NvidiaSmiSource(str(fake), timeout_s=5).read()

    assert str(raised.value).endswith(f"exit status 9: {DRIVER_ERROR}")
    assert "\n" not in str(raised.value)


def test_garbage_query_raises_parse_error(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="garbage")
    source = NvidiaSmiSource(str(fake), timeout_s=5)
    # Random bytes differ at every run: whatever they are, only a ParseError may escape.
    for _ in range(5):
        result, _ = timed_read(source)
        assert isinstance(result, ParseError), repr(result)


def test_flooding_query_hits_the_output_cap(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="flood")
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=10, max_output_bytes=256 * 1024))

    assert isinstance(result, OutputTooLarge), result
    assert elapsed < 3.0, "the cap must stop the read, not the timeout"
    assert str(256 * 1024) in str(result)
    live, zombies = left_behind([pid for pid, _ in calls(fake)])
    assert live == []
    assert zombies == []


@pytest.mark.parametrize(
    "mode, error",
    [("hang", CommandTimeout), ("fail", CommandFailed), ("garbage", ParseError), ("flood", OutputTooLarge)],
)
def test_only_read_errors_escape_a_failed_read(fake_nvidia_smi: FakeSmi, mode: str, error: type) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode=mode)
    result, _ = timed_read(NvidiaSmiSource(str(fake), timeout_s=0.5, max_output_bytes=64 * 1024))
    assert isinstance(result, error), repr(result)
    assert isinstance(result, ReadError)


# --- only -L fails -----------------------------------------------------------------------------

@pytest.mark.parametrize("list_mode, reason", [
    ("fail", DRIVER_ERROR),
    ("hang", "timed out"),
    ("garbage", "not a GPU or MIG line"),
    ("flood", "bytes; process group killed"),
])
def test_failed_listing_keeps_memory_and_processes(fake_nvidia_smi: FakeSmi, list_mode: str, reason: str) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", list_mode=list_mode, stderr=DRIVER_ERROR)
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=1.0, max_output_bytes=64 * 1024))

    assert isinstance(result, Snapshot), repr(result)
    snapshot = result
    assert elapsed < 1.0 + 1.0
    assert [d.index for d in snapshot.devices] == [1000, 1001, 1002, 1003]
    for d in snapshot.devices:
        _, gi, ci, _, _, total, used, free = H100_DEVICES[d.index]
        assert d.profile is None
        assert d.uuid is None
        assert (d.gpu_instance_id, d.compute_instance_id) == (gi, ci)
        assert d.memory.total_bytes == total * MIB
        assert d.memory.used_bytes == used * MIB
        assert d.memory.free_bytes == free * MIB
    assert {p.pid: p.device_index for p in snapshot.processes} == {21180: 1000, 21181: 1000, 21198: 1002}
    (problem,) = snapshot.problems
    assert "nvidia-smi -L" in problem
    assert reason in problem
    assert "\n" not in problem
    live, zombies = left_behind([pid for pid, _ in calls(fake)])
    assert live == []
    assert zombies == []


def test_failed_listing_on_a_non_mig_node_changes_nothing_but_the_problem_line(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "a100-mig-pending", list_mode="fail")
    snapshot = NvidiaSmiSource(str(fake), timeout_s=5).read()

    (device,) = snapshot.devices
    assert device.index == 0
    assert device.uuid == "GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f"
    assert device.memory.used_bytes == 5371854848
    assert len(snapshot.problems) == 1
    assert "nvidia-smi -L" in snapshot.problems[0]


# --- finding the binary ------------------------------------------------------------------------

def test_resolve_finds_a_name_on_path(fake_nvidia_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    # The fake itself needs the system PATH (it runs cat); it comes first, so it wins over any real one.
    monkeypatch.setenv("PATH", os.pathsep.join([str(empty), str(fake.parent), os.environ["PATH"]]))
    source = NvidiaSmiSource("nvidia-smi", timeout_s=10)

    assert source.resolve() == str(fake)
    assert source.ready() == (True, f"{fake} found")
    assert len(source.read().devices) == 4
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"]


def test_resolve_looks_again_at_each_read(fake_nvidia_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    # A driver installed after start-up is picked up without a restart.
    # A name no real system has, so the first read fails even on a GPU machine.
    name = "mig-exporter-test-nvidia-smi"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.environ["PATH"]]))
    source = NvidiaSmiSource(name, timeout_s=10)
    with pytest.raises(CommandNotFound):
        source.read()

    fake = fake_for(fake_nvidia_smi, "a100-mig-pending")
    (bin_dir / name).symlink_to(fake)
    assert [d.index for d in source.read().devices] == [0]


def test_name_missing_from_path_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    source = NvidiaSmiSource("nvidia-smi")

    with pytest.raises(CommandNotFound) as raised:
        source.resolve()
    assert str(raised.value) == "nvidia-smi: not found on PATH"
    ok, reason = source.ready()
    assert (ok, reason) == (False, "nvidia-smi: not found on PATH")
    with pytest.raises(CommandNotFound):
        source.read()


def test_missing_path_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "nvidia-smi"
    source = NvidiaSmiSource(str(missing))

    with pytest.raises(CommandNotFound) as raised:
        source.resolve()
    assert str(raised.value) == f"{missing}: no such file"
    with pytest.raises(CommandNotFound):
        source.read()


def test_path_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    with pytest.raises(CommandNotFound):
        NvidiaSmiSource(str(script)).resolve()
    with pytest.raises(CommandNotFound):
        NvidiaSmiSource(str(tmp_path)).resolve()  # a directory


# --- an argv prefix: nvidia-smi through a wrapper ---------------------------------------------

def test_an_argv_prefix_runs_nvidia_smi_through_the_wrapper(fake_nvidia_smi: FakeSmi, fake_wrapper) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes")
    wrapper = fake_wrapper(fake, fixed_args=2)
    source = NvidiaSmiSource([str(wrapper), "--host", "gpu-07"], timeout_s=10)

    snapshot = source.read()

    assert [d.memory.used_bytes for d in snapshot.devices] == [
        3594 * MIB, 17 * MIB, 7493 * MIB, 9 * MIB]
    assert [d.profile for d in snapshot.devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    wrapped = sorted(line.split(" ", 1)[1] for line in (wrapper.parent / "wrapper.log").read_text().splitlines())
    assert wrapped == ["--host gpu-07 -L", "--host gpu-07 -q -x"]
    assert sorted(args for _, args in calls(fake)) == ["-L", "-q -x"]
    assert source.describe() == f"nvidia-smi ({wrapper} --host gpu-07, timeout 10s)"


def test_the_first_element_of_a_prefix_is_looked_up_on_path(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "a100-mig-pending")
    source = NvidiaSmiSource(["sh", str(fake)], timeout_s=10)

    assert source.resolve_command() == (shutil.which("sh"), str(fake))
    assert [d.index for d in source.read().devices] == [0]
    assert NvidiaSmiSource(["no-such-wrapper-here", str(fake)]).ready() == (
        False, "no-such-wrapper-here: not found on PATH")


def test_a_hung_wrapper_is_killed_with_everything_it_started(fake_nvidia_smi: FakeSmi, fake_wrapper) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="hang", list_mode="hang")
    wrapper = fake_wrapper(fake, fixed_args=1)
    result, elapsed = timed_read(NvidiaSmiSource([str(wrapper), "gpu-07"], timeout_s=1.0))

    assert isinstance(result, CommandTimeout), result
    assert elapsed < 1.0 + 1.0
    # Each wrapper leads its own process group: the fake under it and the fake's sleeps go with it.
    pgids = [int(line.split()[0]) for line in (wrapper.parent / "wrapper.log").read_text().splitlines()]
    assert len(pgids) == 2 and len(calls(fake)) == 2
    live, zombies = left_behind(pgids)
    assert live == [], f"left running: {live}"
    assert zombies == []


def test_an_empty_prefix_is_refused() -> None:
    with pytest.raises(ValueError):
        NvidiaSmiSource([])


# --- the read's budget -------------------------------------------------------------------------

def test_read_timeout_shorter_than_configured_wins(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="hang")
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=30), deadline=Deadline.after(0.5))

    assert isinstance(result, CommandTimeout), result
    assert 0.5 <= elapsed < 0.5 + 1.0


def test_configured_timeout_shorter_than_read_timeout_wins(fake_nvidia_smi: FakeSmi) -> None:
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", mode="hang")
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=0.5), deadline=Deadline.after(30))

    assert isinstance(result, CommandTimeout), result
    assert 0.5 <= elapsed < 0.5 + 1.0


def test_query_and_listing_run_in_parallel(fake_nvidia_smi: FakeSmi) -> None:
    # Each run of the fake takes 0.4 s: one after the other would take 0.8 s.
    fake = fake_for(fake_nvidia_smi, "h100-mig-processes", delay_s=0.4)
    result, elapsed = timed_read(NvidiaSmiSource(str(fake), timeout_s=10), deadline=Deadline.after(2.0))

    assert isinstance(result, Snapshot), repr(result)
    assert [d.profile for d in result.devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert 0.4 <= elapsed < 0.75


def test_a_read_starts_no_thread_once_one_is_kept(fake_nvidia_smi: FakeSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both commands are read in the calling thread, and -L is started in a kept worker: after
    the first, a read starts no thread (starting one costs about a millisecond of a 2-core
    machine). Seen from a thread that lists every thread while the second read runs."""

    from mig_exporter.core import workers

    monkeypatch.setattr(workers, "WORKERS", workers.Workers())  # as serve's: threads kept
    source = NvidiaSmiSource(str(fake_for(fake_nvidia_smi, "h100-mig-processes", delay_s=0.3)), timeout_s=10)
    source.read()
    with threads_started() as started_threads:
        result, _ = timed_read(source)
    assert isinstance(result, Snapshot), repr(result)
    assert [d.profile for d in result.devices] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert started_threads == set()


def test_describe_names_the_binary_and_timeout() -> None:
    assert (NvidiaSmiSource("/usr/bin/nvidia-smi", timeout_s=7).describe()
            == "nvidia-smi (/usr/bin/nvidia-smi, timeout 7s)")


def test_a_fast_query_failure_does_not_wait_for_a_hanging_listing(fake_nvidia_smi) -> None:
    """-q -x fails at once; the -L still running is cancelled, not waited for."""
    fake = fake_nvidia_smi(mode="fail", list_mode="hang")
    source = NvidiaSmiSource(str(fake), timeout_s=10)
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="exit status 9"):
        source.read()
    assert time.monotonic() - started < 2.0
