"""Slurm jobs, systemd units and users of GPU processes (docs/hpc.md): the
status and passwd parsers, the join, the sums, and end to end through
``mig-exporter read`` on a fabricated host with a Slurm job, a systemd-run
engine and a login session."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MIB, SAMPLES, a_thread, sample_value, samples_of
from kube_node import BY_PID, LLAMA, make_kubelet_logs
from mig_exporter.core.deadline import Deadline
from mig_exporter.host.cgroup import CgroupIdentity
from mig_exporter.host.owners import KeptReads, OwnerReader, owner_reading
from mig_exporter.host.passwd import MAX_PASSWD_BYTES, PasswdFile, parse_passwd
from mig_exporter.host.procfs import ProcfsSource, parse_status_uid
from mig_exporter.kubernetes.pods import PodReader
from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.readings import ProcessOwner
from mig_exporter.sources.demo import DemoSource
from proc_tree import CONTAINER_NS, Proc, make_proc, write_proc
from test_pods import demo_proc

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cgroup"
PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    "alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash\n"
    "# a comment\n"
    "broken-line-without-fields\n"
    "mallory:x:notanumber:0::/:/bin/sh\n"
    "+nisuser::::::\n"
    "alias:x:1000:1000::/home/alice:/bin/bash\n"  # a second name for 1000: getpwuid gives the first
)
# The demo host's GPU processes (samples/demo.xml), on a Slurm and systemd host instead:
# 48213 llama-server holds 11520 MiB on 1000, 51877 python3 9216 MiB on 1001,
# 50102 llama-server 20480 MiB on card 1, 50318 python3 1620 MiB on card 1.
HPC = [
    Proc(48213, "llama-server", ["llama-server"], uid=1000,
         cgroup=(FIXTURES / "v2-slurm-step.txt").read_text()),  # job 4242, step 0
    Proc(51877, "python3", ["python3", "train.py"], uid=1000,
         cgroup=(FIXTURES / "v2-slurm-batch.txt").read_text()),  # job 4242, the batch script
    Proc(50102, "llama-server", ["llama-server"], uid=0,
         cgroup=(FIXTURES / "v2-systemd-run-service.txt").read_text()),  # systemd-run: run-u12.service
    Proc(50318, "python3", ["python3"], uid=2000,  # a uid the passwd file lacks (an LDAP user)
         cgroup=(FIXTURES / "v2-session-scope.txt").read_text()),  # ssh login: session-3.scope
]


# --- pure parsing --------------------------------------------------------------------------------

def test_the_real_uid_is_the_first_field_of_the_uid_line():
    status = b"Name:\tsudo\nUmask:\t0022\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n"
    assert parse_status_uid(status) == 1000
    assert parse_status_uid(b"Name:\tx\n") is None
    assert parse_status_uid(b"Uid:\n") is None
    assert parse_status_uid(b"Uid:\t-1\t0\t0\t0\n") is None


def test_this_process_s_own_status_gives_its_uid():
    assert parse_status_uid(Path("/proc/self/status").read_bytes()) == os.getuid()


def test_passwd_parsing_keeps_well_formed_lines_and_the_first_name_of_a_uid():
    assert parse_passwd(PASSWD.encode()) == {0: "root", 1: "daemon", 1000: "alice"}
    assert parse_passwd(b"") == {}
    assert parse_passwd(b"\xff\xfe:x:5:5::/:/bin/sh\nbob:x:1001:1001::/home/bob:/bin/sh") == {
        5: "\ufffd\ufffd", 1001: "bob"}  # undecodable bytes do not stop the read; no final newline is fine
    # Digits that are not ASCII's: a line to skip, not a read to lose or a uid to misread.
    odd = "sup:x:\u00b2:0::/:/bin/sh\narab:x:\u0661:0::/:/bin/sh\nbob:x:1001:1001::/:/bin/sh"
    assert parse_passwd(odd.encode()) == {1001: "bob"}


def test_a_passwd_file_is_read_again_only_when_it_changes(tmp_path):
    path = tmp_path / "passwd"
    path.write_text(PASSWD)
    passwd = PasswdFile(str(path))
    assert passwd.names() == ({0: "root", 1: "daemon", 1000: "alice"}, None)
    path.write_text(PASSWD + "bob:x:1001:1001::/home/bob:/bin/sh\n")
    assert passwd.names()[0][1001] == "bob"


def test_an_unreadable_passwd_file_is_a_problem_and_no_names(tmp_path):
    names, problem = PasswdFile(str(tmp_path / "none")).names()
    assert names == {} and problem is not None and "cannot read the passwd file" in problem
    names, problem = PasswdFile(str(tmp_path)).names()  # a directory where the file should be
    assert names == {} and problem is not None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # must not hang the scrape
    names, problem = PasswdFile(str(fifo)).names()
    assert names == {} and problem == f"the passwd file {fifo} is not a regular file; users are shown as uids"


def test_a_huge_passwd_file_is_read_up_to_the_bound(tmp_path):
    path = tmp_path / "passwd"
    line = b"u%07d:x:%d:100::/home/u:/bin/sh\n"
    with path.open("wb") as f:
        f.write(b"alice:x:1000:1000::/home/alice:/bin/bash\n")
        f.write(b"x" * MAX_PASSWD_BYTES)  # one endless line: never a name
        f.write(line % (1, 20001))
    names, problem = PasswdFile(str(path)).names()
    assert names == {1000: "alice"}
    assert problem == f"the passwd file {path} is larger than 16 MiB: names from its start only"


def test_the_join_names_users_and_falls_back_to_the_uid():
    reading = owner_reading(
        {1: CgroupIdentity(slurm_job="7", slurm_step="0"), 2: CgroupIdentity(systemd_unit="ollama.service"),
         3: CgroupIdentity(container_id="c" * 64)},
        {1: 1000, 2: 0, 3: 2000}, {1000: "alice", 0: "root"})
    assert reading.processes == {
        1: ProcessOwner(1, "7", "0", None, "alice"),
        2: ProcessOwner(2, None, None, "ollama.service", "root"),
        3: ProcessOwner(3, None, None, None, "2000"),
    }


# --- the watch and the metrics -------------------------------------------------------------------

def _hpc(tmp_path, namespace: str = "pid:[4026531836]") -> str:
    return str(make_proc(tmp_path / "proc", HPC, namespace=namespace))


def _owners(families) -> dict[str, tuple[str, str, str, str]]:
    return {s.labels["pid"]: (s.labels["slurm_job"], s.labels["slurm_step"], s.labels["systemd_unit"],
                              s.labels["user"]) for s in samples_of(families, "mig_exporter_process_info")}


def test_the_host_s_processes_carry_their_job_unit_and_user_and_the_sums(tmp_path):
    passwd = tmp_path / "passwd"
    passwd.write_text(PASSWD)
    families = Scraper(DemoSource(), owners=OwnerReader(_hpc(tmp_path), str(passwd))).families()
    assert _owners(families) == {
        "48213": ("4242", "0", "", "alice"),
        "51877": ("4242", "batch", "", "alice"),
        "50102": ("", "", "run-u12.service", "root"),
        "50318": ("", "", "session-3.scope", "2000"),
    }
    jobs = {s.labels["slurm_job"]: s.value for s in samples_of(families, "mig_exporter_slurm_job_memory_used_bytes")}
    assert jobs == {"4242": (11520 + 9216) * MIB}  # 48213's and 51877's, on two MIG instances
    units = {s.labels["systemd_unit"]: s.value
             for s in samples_of(families, "mig_exporter_systemd_unit_memory_used_bytes")}
    assert units == {"run-u12.service": 20480 * MIB, "session-3.scope": 1620 * MIB}
    assert sample_value(families, "mig_exporter_read_problems") == 0


def test_without_a_passwd_file_users_are_uids(tmp_path):
    families = Scraper(DemoSource(), owners=OwnerReader(_hpc(tmp_path))).families()
    assert {pid: owner[3] for pid, owner in _owners(families).items()} == {
        "48213": "1000", "51877": "1000", "50102": "0", "50318": "2000"}


def test_an_unreadable_passwd_file_is_one_problem_logged_once_and_users_are_uids(tmp_path, caplog):
    scraper = Scraper(DemoSource(), owners=OwnerReader(_hpc(tmp_path), str(tmp_path / "none")))
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        for _ in range(3):
            families = scraper.families()
    said = [r for r in caplog.records if "cannot read the passwd file" in r.getMessage()]
    assert len(said) == 1
    assert sample_value(families, "mig_exporter_read_problems") == 1
    assert _owners(families)["48213"] == ("4242", "0", "", "1000")


def test_outside_the_host_pid_namespace_no_process_is_attributed_and_the_sums_are_absent(tmp_path):
    families = Scraper(DemoSource(), owners=OwnerReader(_hpc(tmp_path, CONTAINER_NS))).families()
    assert set(_owners(families).values()) == {("", "", "", "")}
    text = render(families, None)[0].decode()
    assert "mig_exporter_slurm_job_memory_used_bytes" not in text
    assert "mig_exporter_systemd_unit_memory_used_bytes" not in text
    assert 'slurm_job="",slurm_step="",systemd_unit="",user=""' in text


def test_on_a_kubernetes_node_pods_are_no_units_and_each_cgroup_is_read_once(tmp_path, monkeypatch):
    reads: list[int] = []
    real = ProcfsSource.read_cgroup
    monkeypatch.setattr(ProcfsSource, "read_cgroup", lambda self, pid: reads.append(pid) or real(self, pid))
    proc = str(demo_proc(tmp_path / "proc"))
    pods = PodReader(proc, None, str(make_kubelet_logs(tmp_path / "log")))
    families = Scraper(DemoSource(), pods=pods, owners=OwnerReader(proc)).families()
    assert sorted(reads) == sorted(BY_PID)  # one read per GPU process, for both
    info = {s.labels["pid"]: s.labels for s in samples_of(families, "mig_exporter_process_info")}
    assert info["48213"]["pod"] == LLAMA.pod and info["48213"]["systemd_unit"] == ""
    assert {labels["user"] for labels in info.values()} == {""}  # demo_proc writes no status: unknown
    assert samples_of(families, "mig_exporter_systemd_unit_memory_used_bytes") == []


def test_a_process_the_driver_says_n_a_for_leaves_its_job_s_sum_out(tmp_path):
    from dataclasses import replace

    class NotSaid(DemoSource):
        def read(self, deadline=None):
            snapshot = super().read(deadline)
            return replace(snapshot, processes=tuple(p._replace(used_bytes=None) if p.pid == 51877 else p
                                                     for p in snapshot.processes))

    families = Scraper(NotSaid(), owners=OwnerReader(_hpc(tmp_path))).families()
    assert samples_of(families, "mig_exporter_slurm_job_memory_used_bytes") == []
    assert sample_value(families, "mig_exporter_systemd_unit_memory_used_bytes",
                        {"systemd_unit": "run-u12.service"}) == 20480 * MIB


def test_out_of_time_the_processes_left_are_a_problem_not_a_hang(tmp_path):
    snapshot = DemoSource().read()
    reading = OwnerReader(_hpc(tmp_path)).read(snapshot, Deadline.after(-1))
    assert reading.processes == {}
    assert reading.problems == ("no time left in the scrape's budget: 4 process(es) may lack their user, "
                                "Slurm job or systemd unit",)
    assert OwnerReader(_hpc(tmp_path / "again")).read(snapshot, Deadline.after(5)).problems == ()


def test_probe_answers_have_empty_owner_labels():
    from mig_exporter.metrics.families import snapshot_families

    families = list(snapshot_families(DemoSource().read()))
    assert set(_owners(families).values()) == {("", "", "", "")}


# --- end to end ----------------------------------------------------------------------------------

def _read(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mig_exporter", "read", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("kubernetes", ["true", "false"])
def test_end_to_end_read_on_a_slurm_and_systemd_host(fake_nvidia_smi, tmp_path, kubernetes):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    passwd = tmp_path / "passwd"
    passwd.write_text(PASSWD)
    # The prolog's job map: 0/mig0 by its MIG UUID to job 4242 (jobstats' "jobid uid"), card 1 by its index.
    job_map = tmp_path / "job-map"
    job_map.mkdir()
    (job_map / "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b").write_text("4242 1000\n")
    (job_map / "1").write_text("4300\n")
    result = _read(["--nvidia-smi", str(smi), "--proc.root", _hpc(tmp_path), "--kubelet.pod-resources-socket", "",
                    "--slurm.job-map-dir", str(job_map)],
                   {"MIG_EXPORTER_HOST_PASSWD": str(passwd), "MIG_EXPORTER_KUBERNETES": kubernetes})
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    assert _owners(families) == {
        "48213": ("4242", "0", "", "alice"),
        "51877": ("4242", "batch", "", "alice"),
        "50102": ("", "", "run-u12.service", "root"),
        "50318": ("", "", "session-3.scope", "2000"),
    }
    # 11520 MiB (48213, step 0) + 9216 MiB (51877, the batch step) = 20736 MiB = 21743271936 bytes
    assert sample_value(families, "mig_exporter_slurm_job_memory_used_bytes", {"slurm_job": "4242"}) == 21743271936
    # 20480 MiB = 21474836480 bytes, and 1620 MiB = 1698693120 bytes
    assert sample_value(families, "mig_exporter_systemd_unit_memory_used_bytes",
                        {"systemd_unit": "run-u12.service"}) == 21474836480
    assert sample_value(families, "mig_exporter_systemd_unit_memory_used_bytes",
                        {"systemd_unit": "session-3.scope"}) == 1698693120
    assert {s.labels["pod"] for s in samples_of(families, "mig_exporter_process_info")} == {""}
    assert sample_value(families, "mig_exporter_slurm_job_map_read_success") == 1
    assert {(s.labels["index"], s.labels["slurm_job"], s.labels["resource"])
            for s in samples_of(families, "mig_exporter_device_allocation_info")} == {
        ("1000", "4242", "slurm"), ("1", "4300", "slurm")}
    assert "Traceback" not in result.stderr


def test_the_flag_names_the_users_too(fake_nvidia_smi, tmp_path):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    passwd = tmp_path / "passwd"
    passwd.write_text(PASSWD)
    result = _read(["--nvidia-smi", str(smi), "--proc.root", _hpc(tmp_path), "--host.passwd", str(passwd)])
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    assert sample_value(families, "mig_exporter_process_info", {"pid": "50102"}) == 1
    assert _owners(families)["50102"][3] == "root"


def test_each_process_s_cgroup_and_status_are_read_once_and_again_for_a_new_process(tmp_path, monkeypatch):
    """Read once for a running process (its pid and /proc/PID inode), never for a pid that is not
    in /proc, and again when the pid is another process's."""
    opened: list[str] = []
    for name in ("read_cgroup", "read_status"):
        real = getattr(ProcfsSource, name)
        monkeypatch.setattr(ProcfsSource, name,
                            lambda self, pid, real=real, name=name: opened.append(f"{name} {pid}") or real(self, pid))
    root = Path(_hpc(tmp_path))
    shutil.rmtree(root / "50318")  # exited: on the GPU list, not in /proc
    scraper = Scraper(DemoSource(), owners=OwnerReader(str(root)))
    first = _owners(scraper.families())
    assert sorted(opened) == [f"{name} {pid}" for name in ("read_cgroup", "read_status")
                              for pid in (48213, 50102, 51877)]
    opened.clear()
    assert _owners(scraper.families()) == first
    assert opened == []
    (tmp_path / "gone").mkdir()
    os.rename(root / "48213", tmp_path / "gone" / "48213")  # kept: its inode is not handed on
    write_proc(root, Proc(48213, "python3", ["python3"], uid=2000,
                          cgroup=(FIXTURES / "v2-systemd-run-service.txt").read_text()))
    again = _owners(scraper.families())
    assert sorted(opened) == ["read_cgroup 48213", "read_status 48213"]
    assert again == {**first, "48213": ("", "", "run-u12.service", "2000")}


def test_a_gpu_pid_that_is_a_thread_id_still_gets_its_owner_from_the_real_proc(monkeypatch):
    """Review (issue 17): the driver may list a thread's id (the demo lists 50318, a thread of 50300;
    test_attribution). /proc/TID is there to open but not in /proc's listing, which holds thread
    group leaders only: its owner is read from /proc/TID's files, as 3fd01ef did, and kept like a
    process's (by its /proc/TID inode) while a pid that is not there at all opens nothing."""
    opened: list[str] = []
    for name in ("read_cgroup", "read_status"):
        real = getattr(ProcfsSource, name)
        monkeypatch.setattr(ProcfsSource, name,
                            lambda self, pid, real=real, name=name: opened.append(f"{name} {pid}") or real(self, pid))
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    with a_thread() as tid:
        snapshot = DemoSource().read()
        snapshot = dataclasses.replace(snapshot, processes=(snapshot.processes[0]._replace(pid=tid),
                                                            snapshot.processes[1]._replace(pid=gone)))
        reader = OwnerReader("/proc")
        owners = reader.read(snapshot, Deadline.after(5)).processes
        assert owners[tid].user == str(os.getuid())  # as 3fd01ef read it: /proc/TID/status
        assert gone not in owners
        assert sorted(opened) == [f"read_cgroup {tid}", f"read_status {tid}"]
        opened.clear()
        listing = reader.procs.listing()  # as the engines' /proc read hands it on
        assert reader.read(snapshot, Deadline.after(5), listing=listing).processes == owners
        assert opened == []


def test_a_listed_pid_that_is_not_there_is_looked_for_again_once_in_revisit_reads():
    """Issue 17: a pid the driver goes on listing that is no process here (it ended; the benchmark's
    896 made-up pids) cost an ``access`` at every read. It is looked for again one read in
    ``revisit`` (by pid, round robin), so one that becomes a thread's id is found within that many
    reads; a pid found is looked for at every read, and a new pid at once."""
    there: dict[int, int] = {}
    asked: list[list[int]] = []

    def locate(pids):
        asked.append(sorted(pids))
        return {pid: there[pid] for pid in pids if pid in there}

    reads = KeptReads(lambda pid: f"cgroup of {pid}".encode(), bytes.decode, locate, revisit_reads=4)
    gone = [100, 101, 102, 103]
    assert reads.read(gone, {}) == {}
    assert asked == [gone]  # a new pid is looked for at once
    for _ in range(4):
        assert reads.read(gone, {}) == {}
    # Each pid once in the four reads, by pid % 4 (reads 1, 2, 3 and 4 look for 101, 102, 103, 100).
    assert asked[1:] == [[101], [102], [103], [100]]
    there[102] = 7  # 102 is now a thread's id
    found = [reads.read(gone, {}) for _ in range(4)]
    assert found[0] == {} and found[1] == {102: "cgroup of 102"}  # read 6 is 102's turn
    assert asked[-1] == [100, 102]  # read 8: 100's turn, and 102, found, at every read
    assert reads.read([*gone, 104], {}) == {102: "cgroup of 102"}
    assert asked[-1] == [101, 102, 104]
