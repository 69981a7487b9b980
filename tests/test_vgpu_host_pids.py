"""Processes the driver lists are never dropped for their pid (issue 36).

A vGPU host lists its VMs as processes, by ids past Linux's pid range: the real capture of a
Tesla M10 host on driver 390.94 (tests/fixtures/nvidia-smi-real/SOURCES.md) lists two VMs of
4064 MiB on each of its four cards, as ``C+G``, with ids from 42818686 to 44717029. Each card
is in use: its VMs are counted on it with their memory and type, on the nvidia-smi path and
through NVML. Only what no process id can be is skipped, with a problem line that says why.
The VMs' ids are in no /proc: nothing looks them up there, none gets a pod, a Slurm job, a
unit or a user, and they neither match an engine nor make the engines' "/proc is not the
driver's" guess.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import MIB, TESTS, sample_value, samples_of
from fake_nvml import FakeCard, FakeMemory, FakeNvmlScenario, FakeProcess
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.owners import OwnerReader
from mig_exporter.host.procfs import ProcfsSource
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.readings import EngineProcess
from mig_exporter.model.snapshot import PID_MAX_LIMIT, is_linux_pid, is_process_id
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.sources.nvml import NvmlSource
from proc_tree import Proc, make_proc

M10 = (TESTS / "fixtures" / "nvidia-smi-real" / "itnovum-4x-tesla-m10-vgpu-host-v9-drv390.xml").read_bytes()
VM_MIB = 4064
# (card, pid, VM name) as the capture lists them, each C+G with 4064 MiB; a card's in pid order.
VMS = [
    (0, 42818686, "TS-526"), (0, 43962378, "TS-530"),
    (1, 44450601, "TS-527"), (1, 44714933, "TS-532"),
    (2, 44713050, "TS-525"), (2, 44717029, "TS-529"),
    (3, 44324356, "TS-531"), (3, 44458026, "TS-528"),
]
EXPECTED = [(pid, "C+G", name, VM_MIB * MIB, card) for card, pid, name in VMS]
WHOLE = b"<!-- read whole -->"  # after the root: lxml parses the report whole (test_parse_expectations)
LLAMA = ["/usr/local/bin/llama-server", "-m", "/models/q.gguf", "-ngl", "99"]


def _processes(snapshot) -> list[tuple]:
    return [(p.pid, p.type, p.name, p.used_bytes, p.device_index) for p in snapshot.processes]


def test_the_capture_lists_vms_past_linuxs_pid_range():
    assert all(pid >= PID_MAX_LIMIT for _, pid, _ in VMS)
    assert M10.count(b"<pid>") == len(VMS) and b"<virtualization_mode>Host VGPU</virtualization_mode>" in M10


@pytest.mark.parametrize("way", ["sections", "memo", "whole"])
def test_every_vm_is_counted_on_its_card_with_its_memory_and_type(way):
    if way == "memo":
        memo = ReadMemo()
        snapshot_from_smi(M10, b"", None, memo)
        snapshot = snapshot_from_smi(M10, b"", None, memo)
    else:
        snapshot = snapshot_from_smi(M10 + WHOLE if way == "whole" else M10, b"")
    assert [(d.index, d.name, d.processes_known) for d in snapshot.devices] == [
        (i, "Tesla M10", True) for i in range(4)]
    assert _processes(snapshot) == EXPECTED
    assert snapshot.problems == ()
    assert [d.memory.used_bytes for d in snapshot.devices] == [8141 * MIB] * 4  # 8.5 GB, all VMs'


@pytest.mark.parametrize(("pid", "why"), [
    ("0", "no process has id 0"),
    ("4294967295", "2^32-1, NVML's 'none' and the garbage of a process struct mismatch"),
    ("4294967296", "larger than a driver's 32-bit process id"),
    ("99999999999", "longer than the 10 digits of a 32-bit process id"),
    ("9" * 5000, "longer than the 10 digits of a 32-bit process id"),  # past int()'s digit limit
    ("-1", "negative"),
    ("", "empty"),
    ("N/A", "not a whole number"),
    ("0x28d5b7e", "not a whole number"),
    ("4281 8686", "not a whole number"),
    ("\u0663\u0663", "not a whole number"),  # Arabic-Indic digits: str.isdigit() says yes
])
@pytest.mark.parametrize("way", ["sections", "whole"])
def test_a_pid_no_process_can_have_is_skipped_with_why_and_the_others_stay(pid, why, way):
    bent = M10.replace(b"<pid>43962378</pid>", f"<pid>{pid}</pid>".encode())
    snapshot = snapshot_from_smi(bent + WHOLE if way == "whole" else bent, b"")
    assert _processes(snapshot) == [p for p in EXPECTED if p[0] != 43962378]
    assert snapshot.problems == (f"card 0: a process with pid {pid[:60]!r}: {why}; skipped",)


@pytest.mark.parametrize("pid", [1, 4_194_303, 4_194_304, 2**31 - 1, 2**31, 4_294_967_294])
def test_any_whole_pid_a_driver_can_give_is_kept(pid):
    bent = M10.replace(b"<pid>43962378</pid>", f"<pid>{pid}</pid>".encode())
    snapshot = snapshot_from_smi(bent, b"")
    assert (pid, "C+G", "TS-530", VM_MIB * MIB, 0) in _processes(snapshot)
    assert snapshot.problems == ()
    assert is_process_id(pid) and is_linux_pid(pid) == (pid < PID_MAX_LIMIT)


def test_the_type_is_kept_as_the_driver_gives_it():
    bent = M10.replace(b"<type>C+G</type>", b"<type>G</type>", 1)
    assert _processes(snapshot_from_smi(bent, b""))[0] == (42818686, "G", "TS-526", VM_MIB * MIB, 0)


# --- the whole scrape: metrics, owners, engines ---------------------------------------------------


def _scrape(tmp_path: Path, fake_nvidia_smi, monkeypatch) -> tuple[list, list[int]]:
    """One scrape of the M10 host through a fake nvidia-smi, with owners and engines read from a
    /proc holding a llama-server on the CPU; and every pid that /proc was asked about."""
    asked: list[int] = []
    for name in ("read_cgroup", "read_status"):
        real = getattr(ProcfsSource, name)
        monkeypatch.setattr(ProcfsSource, name, lambda self, pid, real=real: asked.append(pid) or real(self, pid))
    real_inodes = ProcfsSource.inodes

    def inodes(self, pids):
        pids = list(pids)
        asked.extend(pids)
        return real_inodes(self, pids)

    monkeypatch.setattr(ProcfsSource, "inodes", inodes)
    root = str(make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA, uid=1000)]))
    smi = NvidiaSmiSource(str(fake_nvidia_smi(M10, b"")))
    scraper = Scraper(smi, engines=EngineReader(DEFAULT_SETTINGS, ProcfsSource(root)), owners=OwnerReader(root))
    return list(scraper.families()), asked


def test_each_card_reads_in_use_with_its_vms_series(tmp_path, fake_nvidia_smi, monkeypatch):
    families, _ = _scrape(tmp_path, fake_nvidia_smi, monkeypatch)
    assert sample_value(families, "mig_exporter_read_success") == 1
    assert sample_value(families, "mig_exporter_read_problems") == 0
    for card in range(4):
        assert sample_value(families, "mig_exporter_device_processes", {"index": str(card)}) == 2
    used = {s.labels["pid"]: (s.labels["index"], s.value)
            for s in samples_of(families, "mig_exporter_process_memory_used_bytes")}
    assert used == {str(pid): (str(card), VM_MIB * MIB) for card, pid, _ in VMS}
    info = {s.labels["pid"]: s.labels for s in samples_of(families, "mig_exporter_process_info")}
    assert {pid: (labels["process_type"], labels["process_name"]) for pid, labels in info.items()} == {
        str(pid): ("C+G", name) for _, pid, name in VMS}
    # In no /proc: no pod, job, unit or user.
    owners = ("namespace", "pod", "container", "container_id", "slurm_job", "slurm_step", "systemd_unit", "user")
    assert {labels[k] for labels in info.values() for k in owners} == {""}


def test_no_vm_id_is_looked_up_in_proc_and_the_engines_still_report(tmp_path, fake_nvidia_smi, monkeypatch):
    families, asked = _scrape(tmp_path, fake_nvidia_smi, monkeypatch)
    assert not [pid for pid in asked if not is_linux_pid(pid)]
    # The driver's list holds none of /proc's pids, and that says nothing here: the VMs are in no
    # /proc. The llama-server is on the CPU, as it is.
    assert sample_value(families, "mig_exporter_host_pid_namespace") == 1
    assert sample_value(families, "mig_exporter_engine_processes", {"engine": "llama.cpp"}) == 1
    assert sample_value(families, "mig_exporter_engine_memory_used_bytes", {"pid": "52040"}) == 0


def test_an_engine_reading_beside_vms_alone_is_not_a_namespace_mismatch(tmp_path):
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)])
    watch = EngineReader(DEFAULT_SETTINGS, ProcfsSource(str(root)))
    reading = watch.reading(*watch.read_procs(), snapshot_from_smi(M10, b""))
    assert reading.problems == ()
    assert reading.processes == (EngineProcess("llama.cpp", 52040, "llama-server", 0, ()),)


def test_a_proc_entry_named_like_a_vm_is_never_read(tmp_path):
    """No Linux /proc holds such an id; one that did (a fabricated tree) is still not asked."""
    root = make_proc(tmp_path / "proc", [Proc(42818686, "qemu", ["qemu"], uid=1000,
                                              cgroup="0::/system.slice/vm.service\n")])
    reading = OwnerReader(str(root)).read(snapshot_from_smi(M10, b""))
    assert reading.processes == {} and reading.problems == ()


# --- NVML -------------------------------------------------------------------------------------------

BIG = 3_000_000_001  # past 2^31: passed to nvmlSystemGetProcessName as a C int's 32 bits


def m10_host(**more) -> FakeNvmlScenario:
    """The captured host as NVML lists it: each VM on its card's compute and graphics lists."""
    uuids = ["GPU-74f1301f-aa41-e5c6-f5c7-e15484997833", "GPU-5e9b8082-77de-41fe-5c44-176ebbfb1c78",
             "GPU-9a90d633-6239-77db-9db6-fb4acf3bd980", "GPU-feca4508-bf49-839b-0135-49c73ab3f73b"]
    cards = []
    for card, uuid in enumerate(uuids):
        vms = tuple(FakeProcess(pid, VM_MIB * MIB) for c, pid, _ in VMS if c == card)
        cards.append(FakeCard(
            name="Tesla M10", uuid=uuid, pci_bus_id=f"00000000:1{'ABCD'[card]}:00.0",
            memory=FakeMemory(8191 * MIB, 0, 8141 * MIB, 50 * MIB), mig_mode=None, temperature_c=37,
            power_mw=10430, gpu_util_percent=0, memory_util_percent=0,
            compute_processes=vms, graphics_processes=vms))
    return FakeNvmlScenario(driver_version="390.94", cuda_version=9010, cards=tuple(cards),
                            process_names={pid: name for _, pid, name in VMS}, **more)


def _with_compute(scenario: FakeNvmlScenario, card: int, *extra: FakeProcess) -> FakeNvmlScenario:
    cards = list(scenario.cards)
    cards[card] = dataclasses.replace(cards[card], compute_processes=(*cards[card].compute_processes, *extra))
    return dataclasses.replace(scenario, cards=tuple(cards))


def test_nvml_counts_the_vms_as_the_nvidia_smi_path_does(fake_nvml_lib):
    fake = fake_nvml_lib(m10_host())
    snapshot = NvmlSource().read()
    assert _processes(snapshot) == EXPECTED == _processes(snapshot_from_smi(M10, b""))
    assert snapshot.problems == ()
    assert fake.exceptions == []


def test_nvml_keeps_the_vms_when_the_r535_mismatch_garbles_v3(fake_nvml_lib):
    """v3 garbled: read again with v2, whose VM ids past Linux's range are no sign of garbling."""
    fake = fake_nvml_lib(m10_host(r535_struct_mismatch=True))
    snapshot = NvmlSource().read()
    assert _processes(snapshot) == EXPECTED
    assert snapshot.problems == ()
    assert fake.called("nvmlDeviceGetComputeRunningProcesses_v2") > 0


def test_nvml_keeps_a_pid_past_2_31_and_names_it(fake_nvml_lib):
    base = m10_host()
    scenario = dataclasses.replace(_with_compute(base, 1, FakeProcess(BIG, 12 * MIB)),
                                   process_names={**base.process_names, BIG: "TS-600"})
    fake = fake_nvml_lib(scenario)
    snapshot = NvmlSource().read()
    assert (BIG, "C", "TS-600", 12 * MIB, 1) in _processes(snapshot)
    assert snapshot.problems == ()
    assert fake.exceptions == []


@pytest.mark.parametrize("bad", [0, 0xFFFFFFFF])
def test_nvml_drops_a_pid_no_process_has_and_says_so(fake_nvml_lib, bad):
    """0 or 2^32-1 on a list in every call the driver has: the R535 garbling's mark, so the list's
    sizes are unknown too; the VMs on it are kept, their memory from the graphics list."""
    fake = fake_nvml_lib(_with_compute(m10_host(), 2, FakeProcess(bad, 1 * MIB)))
    snapshot = NvmlSource().read()
    assert bad not in {p.pid for p in snapshot.processes}
    assert _processes(snapshot) == EXPECTED
    assert snapshot.problems == (
        "card 2: 1 process entries with impossible pids (0, or 4294967295: NVML's 'none') dropped and the "
        "memory of 2 unknown (NVML process struct version mismatch)",)
    assert fake.exceptions == []


def test_through_the_c_library_a_pid_past_2_31_keeps_its_bits(fake_libnvml_env):
    from test_fake_libnvml import _read, _sample

    base = m10_host()
    scenario = dataclasses.replace(_with_compute(base, 1, FakeProcess(BIG, 12 * MIB)),
                                   process_names={**base.process_names, BIG: "TS-600"})
    result = _read(fake_libnvml_env(scenario), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_device_processes{card="1",index="1",mig_profile=""}') == "3.0"
    used = _sample(result.stdout, f'mig_exporter_process_memory_used_bytes{{card="1",index="1",mig_profile="",'
                                  f'pid="{BIG}"}}')
    assert used is not None and float(used) == 12 * MIB
    assert f'pid="{BIG}",pod="",process_name="TS-600",process_type="C"' in result.stdout
    assert _sample(result.stdout, 'mig_exporter_read_problems{source="nvml"}') == "0.0"
