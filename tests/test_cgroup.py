"""/proc/PID/cgroup: container id and pod UID from every layout in use
(tests/fixtures/cgroup/README.md), and reading it through a /proc root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mig_exporter.host.cgroup import CgroupIdentity, parse_cgroup, parse_path
from mig_exporter.host.procfs import ProcfsSource
from proc_tree import Proc, make_proc

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cgroup"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
UID = "0d6b5a4e-8c2f-4a4b-9a53-2f6c1d7e9b10"


def test_every_fixture_has_its_expectation_and_every_layout_is_covered():
    names = {p.stem for p in FIXTURES.glob("*.txt")}
    assert names == set(EXPECTED)
    for must in ("v1-cgroupfs", "v1-systemd", "v2-cgroupfs", "v2-systemd", "containerd", "crio", "docker",
                 "besteffort", "burstable", "guaranteed", "private-cgroupns", "v1-slurm", "v2-slurm", "extern",
                 "interactive", "batch", "multiple-slurmd", "template", "user-service", "session", "systemd-run"):
        assert any(must in name for name in names), must


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture(name):
    found = parse_cgroup((FIXTURES / f"{name}.txt").read_bytes())
    assert found == CgroupIdentity(**EXPECTED[name])


def test_systemd_driver_underscores_become_dashes_and_the_scope_prefix_goes():
    found = parse_cgroup((FIXTURES / "v1-systemd-containerd-besteffort.txt").read_bytes())
    assert found.pod_uid == UID
    assert found.container_id == "84ed8db46e7bedbc6d325e89e4ad6c7476a0a0560755a5c18cf0a9627644b55e"


def test_crio_nested_container_leaf_is_the_scope_s_container():
    found = parse_cgroup((FIXTURES / "v2-systemd-crio-besteffort-nested.txt").read_bytes())
    assert found.pod_uid == UID and found.container_id is not None and len(found.container_id) == 64


def test_a_private_cgroup_namespace_shows_relative_paths_and_they_still_parse():
    text = (FIXTURES / "v2-systemd-containerd-private-cgroupns.txt").read_text()
    assert text.startswith("0::/../../../kubepods-besteffort.slice/")
    assert parse_cgroup(text.encode()).pod_uid == UID


def test_host_processes_have_no_container_or_pod_but_their_unit():
    found = parse_cgroup((FIXTURES / "v2-host-service.txt").read_bytes())
    assert found == CgroupIdentity(systemd_unit="nvidia-persistenced.service")
    found = parse_cgroup((FIXTURES / "v1-host-session.txt").read_bytes())
    assert found == CgroupIdentity(systemd_unit="session-3.scope")


@pytest.mark.parametrize(("path", "job", "step"), [
    ("/system.slice/slurmstepd.scope/job_17/step_0/user/task_0", "17", "0"),
    ("/system.slice/slurmstepd.scope/job_17/step_12/slurm", "17", "12"),  # slurmstepd itself
    ("/system.slice/slurmstepd.scope/job_17", "17", None),  # a job-level cgroup
    ("/system.slice/gpu-a07_slurmstepd.scope/job_17/step_batch/user/task_0", "17", "batch"),
    ("/slurm/uid_0/job_17/step_extern", "17", "extern"),
    ("/slurm_gpu-a07/uid_1000/job_17/step_interactive/task_0", "17", "interactive"),
    ("/system.slice/slurmstepd.scope/system", None, None),  # slurmstepd's own cgroup: no job
    ("/system.slice/other.scope/job_17/step_0", None, None),  # job_ outside Slurm's root
    ("/slurm/uid_1000/job_x17/step_0", None, None),
])
def test_slurm_paths(path, job, step):
    found = parse_path(path)
    assert (found.slurm_job, found.slurm_step) == (job, step)
    assert found.systemd_unit is None or job is None


def test_a_slurm_v1_job_is_not_slurmd_s_unit_though_systemd_s_line_says_so():
    text = (FIXTURES / "v1-slurm-step.txt").read_text()
    assert "1:name=systemd:/system.slice/slurmd.service" in text
    assert parse_cgroup(text.encode()).systemd_unit is None


@pytest.mark.parametrize(("path", "unit"), [
    ("/system.slice/ollama.service", "ollama.service"),
    ("/system.slice/system-vllm.slice/vllm@llama.service", "vllm@llama.service"),
    ("/system.slice/vllm@llama.service/payload", "vllm@llama.service"),  # a delegated subtree (Delegate=yes)
    # A user's own units carry their manager: any user may call one ollama.service.
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/comfyui.service", "user@1000.service/comfyui.service"),
    ("/user.slice/user-1001.slice/user@1001.service/app.slice/ollama.service", "user@1001.service/ollama.service"),
    ("/user.slice/user-1000.slice/user@1000.service/init.scope", "user@1000.service/init.scope"),  # the manager
    ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),  # a login session: systemd-logind's
    # Another system's units: an LXC container's, a systemd-nspawn machine's.
    ("/lxc.payload.c1/system.slice/ollama.service", None),
    ("/machine.slice/systemd-nspawn@c1.service/payload/system.slice/ollama.service", None),
    ("/system.slice/system-systemd\\x2dfsck.slice/systemd-fsck@dev-sda1.service", "systemd-fsck@dev-sda1.service"),
    ("/user.slice/user-1000.slice", None),  # slices hold no processes
    ("/", None),
    ("/system.slice/docker-" + "a" * 64 + ".scope", None),  # a container, not a unit
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
     "crio-conmon-" + "c" * 64 + ".scope", None),  # a pod's, not a service
    ("/kubepods.slice/kubepods-besteffort.slice/anything.scope", None),
])
def test_systemd_units(path, unit):
    assert parse_path(path).systemd_unit == unit


@pytest.mark.parametrize("path", [
    # Made by a user in their delegated tree, or anywhere but slurmd's own place.
    "/user.slice/user-1000.slice/user@1000.service/app.slice/slurm/job_12/step_0",
    "/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_12/step_0",
    "/system.slice/other.service/slurm/job_12/step_0",
    "/system.slice/other.service/slurmstepd.scope/job_12/step_0",
])
def test_a_job_is_only_where_slurmd_puts_jobs(path):
    assert (parse_path(path).slurm_job, parse_path(path).slurm_step) == (None, None)


def test_a_v1_line_that_names_the_step_beats_one_that_stops_at_the_job():
    data = (b"11:devices:/slurm/uid_1000/job_4242\n"
            b"4:memory:/slurm/uid_1000/job_4242/step_0/task_0\n"
            b"1:name=systemd:/system.slice/slurmd.service\n")
    found = parse_cgroup(data)
    assert (found.slurm_job, found.slurm_step, found.systemd_unit) == ("4242", "0", None)


def test_the_systemd_hierarchy_names_the_unit_under_cgroup_v1():
    text = "4:cpu,cpuacct:/system.slice\n3:memory:/system.slice/other.service\n1:name=systemd:/system.slice/a.service\n"
    assert parse_cgroup(text.encode()).systemd_unit == "a.service"
    assert parse_cgroup(b"3:memory:/system.slice/b.service\n0::/system.slice/c.service\n").systemd_unit == "c.service"


def test_a_pod_level_cgroup_gives_the_pod_alone():
    assert parse_path(f"/kubepods/burstable/pod{UID}") == CgroupIdentity(None, UID)


def test_the_innermost_container_wins_and_its_pod_is_the_one_above_it():
    outer = "a" * 64
    inner = "b" * 64
    path = f"/docker/{outer}/kubepods/besteffort/pod{UID}/{inner}"
    assert parse_path(path) == CgroupIdentity(inner, UID)


@pytest.mark.parametrize("data", [b"", b"garbage\n", b"0::relative\n", b"\xff\xfe:\x00\n", b"1:cpu\n"])
def test_malformed_input_gives_no_identity(data):
    assert parse_cgroup(data) == CgroupIdentity(None, None)


@pytest.mark.parametrize("component", [
    "c" * 63, "c" * 65, "C" * 64, "crio-conmon-" + "c" * 64 + ".scope", "session-3.scope",
])
def test_what_is_not_a_container_id(component):
    assert parse_path(f"/kubepods/pod{UID}/{component}").container_id is None


def test_reading_through_a_proc_root(tmp_path):
    cgroup = (FIXTURES / "v2-systemd-containerd-burstable.txt").read_text()
    root = make_proc(tmp_path / "proc", [Proc(48213, "llama-server", ["llama-server"], cgroup=cgroup)])
    source = ProcfsSource(str(root))
    assert parse_cgroup(source.read_cgroup(48213)) == CgroupIdentity(
        EXPECTED["v2-systemd-containerd-burstable"]["container_id"], UID)
    assert source.read_cgroup(99999) is None  # gone


def test_this_process_s_own_cgroup_file_parses():
    """The real file of the machine running the tests is in the format, whatever it says."""
    found = parse_cgroup(Path("/proc/self/cgroup").read_bytes())
    assert isinstance(found, CgroupIdentity)


def test_a_slurmd_in_a_pod_gives_the_container_the_pod_and_the_job():
    """slurmd run as a Kubernetes pod (Slinky): the job's cgroups nest under the pod's container."""
    container = "f" * 64
    path = (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{container}.scope"
            "/system.slice/slurmstepd.scope/job_99/step_0/user/task_0")
    assert parse_cgroup(f"0::{path}\n".encode()) == CgroupIdentity(container, UID, "99", "0", None)


_CID = "e" * 64
_UID_ = UID.replace("-", "_")


@pytest.mark.parametrize("path", [
    # cgroup v2, a user's delegated tree, the cgroupfs and the systemd drivers' names
    f"/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods/burstable/pod{UID}/{_CID}",
    f"/user.slice/user-1000.slice/user@1000.service/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{_UID_}.slice/cri-containerd-{_CID}.scope",
    f"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-{_CID}.scope",
    f"/user.slice/user-1000.slice/user@1000.service/docker/{_CID}",
    # a service given its own subtree (Delegate=yes), and a pod component outside any kubelet tree
    f"/system.slice/build.service/kubepods/burstable/pod{UID}/{_CID}",
    f"/system.slice/pod{UID}/{_CID}",
])
def test_a_process_in_a_user_s_delegated_cgroup_tree_gets_no_pod(path):
    """Anyone given a subtree may name its cgroups after another's pod and
    container, and would borrow its pod's name and labels."""
    found = parse_path(path)
    assert (found.container_id, found.pod_uid) == (None, None)
    # cgroup v1: every controller's line says the same
    v1 = "".join(f"{n}:{c}:{path}\n" for n, c in [(9, "memory"), (4, "cpu,cpuacct"), (1, "name=systemd")])
    found = parse_cgroup(v1.encode())
    assert (found.container_id, found.pod_uid) == (None, None)


def test_a_delegated_tree_s_process_is_its_user_s_unit_or_nothing():
    """Under names the kubelet uses, no unit either (a unit there would be a container's);
    elsewhere, the user's own unit, named with its manager."""
    path = f"/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods/burstable/pod{UID}/{_CID}"
    assert parse_cgroup(f"0::{path}\n".encode()) == CgroupIdentity()
    scope = f"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-{_CID}.scope"
    assert parse_cgroup(f"0::{scope}\n".encode()).systemd_unit == f"user@1000.service/docker-{_CID}.scope"


def test_a_kind_node_s_pods_seen_from_the_host_count():
    """A node in a container: the kubelet's tree starts right inside the node's container."""
    node = "a" * 64
    path = (f"/system.slice/docker-{node}.scope/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{_UID_}.slice/"
            f"cri-containerd-{_CID}.scope")
    assert parse_path(path) == CgroupIdentity(_CID, UID)


def test_a_pod_s_subtree_cannot_hold_another_container():
    """Only the pod's own child is its container: a cgroup made below it names none."""
    path = f"/kubepods/burstable/pod{UID}/{'b' * 64}/nested/{_CID}"
    assert parse_path(path) == CgroupIdentity("b" * 64, UID)


def test_a_kind_node_on_cgroupfs_seen_from_the_host_counts():
    """kind's cgroupRoot /kubelet with the cgroupfs driver, inside the node's /docker/<id>."""
    node = "a" * 64
    path = f"/docker/{node}/kubelet/kubepods/besteffort/pod{UID}/{_CID}"
    assert parse_path(path) == CgroupIdentity(_CID, UID)
    # The same names in a user's delegated tree are still no pod.
    forged = f"/user.slice/user-1000.slice/user@1000.service/kubelet/kubepods/besteffort/pod{UID}/{_CID}"
    assert parse_path(forged).pod_uid is None
