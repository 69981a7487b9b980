"""Kubernetes attribution: processes to containers and pods, devices to the pods
they are allocated to, the metrics, and an end-to-end read on the node of
tests/kube_node.py (fake nvidia-smi, fabricated /proc with cgroups, the
kubelet's log directories, a fake kubelet on a unix socket)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kube_node
from conftest import MIB, SAMPLES, a_thread, sample_value, samples_of
from fake_kubelet import Container, Pod
from kube_node import BY_PID, LLAMA, NOTEBOOK, PODS, TRAINER, VK_LLAMA, VLLM, make_kubelet_logs
from mig_exporter.core.deadline import Deadline
from mig_exporter.host.cgroup import CgroupIdentity, parse_cgroup
from mig_exporter.kubernetes.podlogs import (
    PodName,
    parse_container_link,
    parse_pod_dir,
    pod_names,
    read_pod_names,
)
from mig_exporter.kubernetes.podresources import (
    ContainerDevices,
    ContainerResources,
    PodResources,
    PodResourcesClient,
)
from mig_exporter.kubernetes.pods import PodReader, device_indexes, in_a_pod, pod_reading
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.readings import Allocation, ProcessPod
from mig_exporter.sources.demo import DemoSource
from proc_tree import CONTAINER_NS, HOST_CGROUP

DEMO = DemoSource().read()


def demo_proc(root: Path, cgroups: dict[int, str] | None = None, namespace: str | None = None) -> Path:
    """The demo host's processes (samples/demo-proc.json) as a /proc tree, with
    the node's cgroups (kube_node.BY_PID) and host cgroups for the rest."""
    demo = json.loads((SAMPLES / "demo-proc.json").read_text())
    cgroups = {pid: w.cgroup() for pid, w in BY_PID.items()} if cgroups is None else cgroups
    for p in demo["processes"]:
        pid = int(p["stat"].split(" ", 1)[0])
        d = root / str(pid)
        (d / "task").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "stat").write_text(p["stat"] + "\n")
        (d / "cmdline").write_text(p["cmdline"])
        (d / "cgroup").write_text(cgroups.get(pid, HOST_CGROUP))
        if p["exe"] is not None:
            os.symlink(p["exe"], d / "exe")
        os.symlink(namespace or demo["self_pid_namespace"], d / "ns" / "pid")
        for tid in p["tasks"]:
            (d / "task" / str(tid)).mkdir()
    os.symlink(str(demo["self"]), root / "self")
    return root


def _listed(pods: list[Pod]) -> tuple[PodResources, ...]:
    return tuple(PodResources(p.namespace, p.name, tuple(
        ContainerResources(c.name, tuple(ContainerDevices(r, tuple(ids)) for r, ids in c.devices.items()))
        for c in p.containers)) for p in pods)


# --- device ids to placement indexes -------------------------------------------------------------

@pytest.mark.parametrize(("resource", "device_id", "indexes"), [
    ("nvidia.com/mig-3g.40gb", kube_node.MIG_3G, (1000,)),
    ("nvidia.com/gpu", kube_node.MIG_1G, (1002,)),  # MIG strategy "single": MIG UUIDs under nvidia.com/gpu
    ("nvidia.com/gpu", kube_node.CARD_1, (1,)),
    ("nvidia.com/gpu", kube_node.CARD_1 + "::3", (1,)),  # time-slicing replica
    ("nvidia.com/mig-1g.10gb", kube_node.MIG_1G + "::0", (1002,)),
    # MIG strategy "none": the whole card in MIG mode stands for all its instances.
    ("nvidia.com/gpu", "GPU-a84bba07-931d-b925-306a-0799dc6ebd71", (1000, 1001, 1002)),
    ("nvidia.com/gpu", "1", (1,)),  # --device-id-strategy=index
    ("nvidia.com/mig-2g.20gb", "0:1", (1001,)),
    ("nvidia.com/mig-2g.20gb", "1:0", ()),  # card 1 is whole: it has no MIG device 0
    ("nvidia.com/mig-2g.20gb", "0:100", ()),  # not card 1's MIG device 0 (index 1100) by another name
    ("nvidia.com/gpu", "0", ()),  # card 0 is in MIG mode: not a device of its own
    ("nvidia.com/gpu", "GPU-00000000-0000-0000-0000-000000000000", ()),
    ("example.com/fpga", "1", ()),  # another vendor's numbers are not our cards
])
def test_device_ids_map_to_placement_indexes(resource, device_id, indexes):
    assert device_indexes(DEMO, resource, device_id) == indexes


# --- names from the kubelet's log directories ----------------------------------------------------

def test_pod_and_container_log_names_parse():
    assert parse_pod_dir(f"llm_llama-0_{LLAMA.pod_uid}") == (LLAMA.pod_uid, PodName("llm", "llama-0"))
    link = f"llama-0_llm_server-{LLAMA.container_id}.log"
    assert parse_container_link(link) == (LLAMA.container_id, PodName("llm", "llama-0", "server"))
    # Container names may hold dashes: the id is what follows the last one.
    link = f"vllm-6b7f9c-x2x4q_llm_vllm-engine-core-{VLLM.container_id}.log"
    assert parse_container_link(link) == (VLLM.container_id, PodName("llm", "vllm-6b7f9c-x2x4q", "vllm-engine-core"))


@pytest.mark.parametrize("name", ["", "a_b", "a_b_c_d", "_b_c", "llama-0_llm_server-123.log", "x_y_z-" + "a" * 64,
                                  "x_y_-" + "a" * 64 + ".log"])
def test_other_names_in_the_log_directories_are_ignored(name):
    assert parse_container_link(name) is None
    if name.count("_") != 2 or name.startswith("_"):
        assert parse_pod_dir(name) is None


def test_reading_the_log_directories(tmp_path):
    names, reason = read_pod_names(str(make_kubelet_logs(tmp_path / "log")))
    assert reason is None
    assert names.by_container_id[NOTEBOOK.container_id] == PodName("notebooks", "jupyter-alice", "notebook")
    assert names.by_pod_uid[TRAINER.pod_uid] == PodName("batch", "train-7")
    names, reason = read_pod_names(str(tmp_path / "nowhere"))
    assert names.by_pod_uid == {} and "cannot list" in reason and "nowhere/pods" in reason


# --- the join ------------------------------------------------------------------------------------

def test_processes_are_named_by_container_id_else_by_pod_uid():
    names = pod_names([f"llm_llama-0_{LLAMA.pod_uid}"], [f"vllm-6b7f9c-x2x4q_llm_vllm-{VLLM.container_id}.log"])
    identities = {
        48213: CgroupIdentity(LLAMA.container_id, LLAMA.pod_uid),  # no link for it: the pod by UID
        51877: CgroupIdentity(VLLM.container_id, None),  # a private cgroupns sibling: by id alone
        50102: CgroupIdentity("e" * 64, None),  # a container nobody names (plain Docker)
        50318: CgroupIdentity(None, None),  # a host process
    }
    reading = pod_reading(DEMO, identities, names, None, asked=False)
    assert reading.processes == {
        48213: ProcessPod(48213, LLAMA.container_id, "llm", "llama-0", ""),
        51877: ProcessPod(51877, VLLM.container_id, "llm", "vllm-6b7f9c-x2x4q", "vllm"),
        50102: ProcessPod(50102, "e" * 64, "", "", ""),
    }
    assert reading.allocations is None and reading.pod_resources_success is None


def test_allocations_of_the_node():
    reading = pod_reading(DEMO, {}, pod_names([], []), _listed(PODS), asked=True)
    assert reading.pod_resources_success is True
    assert reading.allocations == (
        Allocation(1, "graphics", "vk-llama-0", "llama", "nvidia.com/gpu"),
        Allocation(1000, "llm", "llama-0", "server", "nvidia.com/mig-3g.40gb"),
        Allocation(1001, "llm", "vllm-6b7f9c-x2x4q", "vllm", "nvidia.com/mig-2g.20gb"),
        Allocation(1002, "batch", "train-7", "trainer", "nvidia.com/mig-1g.10gb"),
    )
    assert reading.problems == ()


def test_replicas_of_one_card_to_one_container_are_one_allocation_and_unknown_devices_a_problem():
    pods = [Pod("a", "p", [Container("c", {"nvidia.com/gpu": [kube_node.CARD_1 + "::0", kube_node.CARD_1 + "::1",
                                                               "GPU-gone"], "example.com/fpga": ["fpga-0"]})])]
    reading = pod_reading(DEMO, {}, pod_names([], []), _listed(pods), asked=True)
    assert reading.allocations == (Allocation(1, "a", "p", "c", "nvidia.com/gpu"),)
    assert reading.problems == ("1 device(s) the kubelet allocated are on no device read: a/p nvidia.com/gpu GPU-gone",)


def test_a_kubelet_that_failed_gives_no_allocations_and_success_0():
    reading = pod_reading(DEMO, {}, pod_names([], []), None, asked=True, problems=["List failed"])
    assert (reading.allocations, reading.pod_resources_success, reading.problems) == (None, False, ("List failed",))


# --- PodReader and the metrics --------------------------------------------------------------------

def _watch(tmp_path, socket_path, **kw) -> PodReader:
    proc = demo_proc(tmp_path / "proc", **kw)
    logs = make_kubelet_logs(tmp_path / "log")
    return PodReader(str(proc), PodResourcesClient(socket_path) if socket_path else None, str(logs))


def test_the_node_s_processes_carry_their_pods_and_the_devices_their_allocations(tmp_path, fake_kubelet):
    kubelet = fake_kubelet(PODS)
    families = Scraper(DemoSource(), pods=_watch(tmp_path, kubelet.socket_path)).families()
    info = {s.labels["pid"]: s.labels for s in samples_of(families, "mig_exporter_process_info")}
    for pid, w in BY_PID.items():
        labels = info[str(pid)]
        assert (labels["namespace"], labels["pod"], labels["container"], labels["container_id"]) == (
            w.namespace, w.pod, w.container, w.container_id)
    allocated = {(s.labels["index"], s.labels["namespace"], s.labels["pod"], s.labels["container"],
                  s.labels["resource"]) for s in samples_of(families, "mig_exporter_device_allocation_info")}
    assert allocated == {
        ("1000", "llm", "llama-0", "server", "nvidia.com/mig-3g.40gb"),
        ("1001", "llm", "vllm-6b7f9c-x2x4q", "vllm", "nvidia.com/mig-2g.20gb"),
        ("1", "graphics", "vk-llama-0", "llama", "nvidia.com/gpu"),
        ("1002", "batch", "train-7", "trainer", "nvidia.com/mig-1g.10gb"),
    }
    pod_memory = {(s.labels["namespace"], s.labels["pod"], s.labels["container"]): s.value
                  for s in samples_of(families, "mig_exporter_pod_memory_used_bytes")}
    assert pod_memory == {
        ("llm", "llama-0", "server"): 11520 * MIB,
        ("llm", "vllm-6b7f9c-x2x4q", "vllm"): 9216 * MIB,
        ("graphics", "vk-llama-0", "llama"): 20480 * MIB,
        ("notebooks", "jupyter-alice", "notebook"): 1620 * MIB,
    }
    assert sample_value(families, "mig_exporter_pod_resources_read_success") == 1
    assert sample_value(families, "mig_exporter_read_problems") == 0


def test_the_kubelet_is_asked_while_the_gpus_are_read(tmp_path, fake_kubelet):
    """The kubelet's answer and log directories need no GPU snapshot: each read waits (a while)
    for the other to have begun, and both see the other only if they run at the same time."""
    gpu_began, kubelet_began = threading.Event(), threading.Event()
    met: list[str] = []

    class Gpu(DemoSource):
        def read(self, deadline=None):
            gpu_began.set()
            if kubelet_began.wait(5):
                met.append("gpu saw kubelet")
            return super().read(deadline)

    pods = _watch(tmp_path, fake_kubelet(PODS).socket_path)
    ask = pods.read_kubelet

    def read_kubelet(deadline=None):
        kubelet_began.set()
        if gpu_began.wait(5):
            met.append("kubelet saw gpu")
        return ask(deadline)

    pods.read_kubelet = read_kubelet
    started = time.monotonic()
    families = Scraper(Gpu(), pods=pods).families(Deadline.after(20))
    assert sorted(met) == ["gpu saw kubelet", "kubelet saw gpu"]
    assert time.monotonic() - started < 4  # neither waited its 5 s out
    assert sample_value(families, "mig_exporter_pod_resources_read_success") == 1
    assert sample_value(families, "mig_exporter_process_info", {"pid": "48213", "pod": "llama-0"}) == 1
    assert len(samples_of(families, "mig_exporter_device_allocation_info")) == 4


def test_without_a_socket_the_labels_stay_and_allocations_go_and_it_is_said_once(tmp_path, caplog):
    scraper = Scraper(DemoSource(), pods=_watch(tmp_path, str(tmp_path / "no.sock")))
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        for _ in range(3):
            families = scraper.families()
    said = [r for r in caplog.records if "no kubelet pod-resources socket" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert sample_value(families, "mig_exporter_process_info", {"pid": "48213", "pod": "llama-0"}) == 1
    assert samples_of(families, "mig_exporter_device_allocation_info") == []
    assert sample_value(families, "mig_exporter_pod_resources_read_success") is None
    assert sample_value(families, "mig_exporter_pod_memory_used_bytes", {"pod": "llama-0"}) == 11520 * MIB
    assert sample_value(families, "mig_exporter_read_problems") == 0  # not on Kubernetes is not a problem


def test_a_kubelet_that_hangs_is_a_problem_within_the_scrape_s_budget(tmp_path, fake_kubelet):
    kubelet = fake_kubelet(PODS)
    kubelet.delay_s = 5
    scraper = Scraper(DemoSource(), pods=_watch(tmp_path, kubelet.socket_path))
    outcome = scraper.read(Deadline.after(0.5))
    assert outcome.duration_s < 2.5
    families = list(scraper.families_for(outcome))
    assert sample_value(families, "mig_exporter_pod_resources_read_success") == 0
    assert sample_value(families, "mig_exporter_read_problems") == 1
    assert sample_value(families, "mig_exporter_read_success") == 1  # the GPU read stands
    assert sample_value(families, "mig_exporter_process_info", {"pid": "50318", "pod": "jupyter-alice"}) == 1


def test_outside_the_host_pid_namespace_no_process_is_attributed(tmp_path, fake_kubelet):
    kubelet = fake_kubelet(PODS)
    scraper = Scraper(DemoSource(), pods=_watch(tmp_path, kubelet.socket_path, namespace=CONTAINER_NS))
    families = scraper.families()
    assert {s.labels["pod"] for s in samples_of(families, "mig_exporter_process_info")} == {""}
    assert samples_of(families, "mig_exporter_pod_memory_used_bytes") == []
    assert len(samples_of(families, "mig_exporter_device_allocation_info")) == 4  # allocations need no pids


def test_a_gpu_pid_that_is_a_thread_id_has_its_cgroup_read_from_the_real_proc():
    """As for owners (test_owners): a thread's id is not in /proc's listing, yet /proc/TID/cgroup is
    the thread's to read, and pods read it when no owners read it for them; a pid that is not
    there at all has none."""
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    with a_thread() as tid:
        snapshot = DemoSource().read()
        snapshot = dataclasses.replace(snapshot, processes=(snapshot.processes[0]._replace(pid=tid),
                                                            snapshot.processes[1]._replace(pid=gone)))
        identities = PodReader("/proc", None, None).identities(snapshot)
        assert identities == {tid: parse_cgroup(Path(f"/proc/{tid}/cgroup").read_bytes())}


def test_a_failed_gpu_read_reads_no_pods(tmp_path, fake_kubelet):
    from mig_exporter.core.errors import CommandFailed

    class Failing(DemoSource):
        def read(self, deadline=None):
            raise CommandFailed("nvidia-smi: exit status 9")

    kubelet = fake_kubelet(PODS)
    families = Scraper(Failing(), pods=_watch(tmp_path, kubelet.socket_path)).families()
    assert kubelet.calls <= 1  # asked alongside the GPU read, once at most; its answer goes unused
    assert sample_value(families, "mig_exporter_pod_resources_read_success") is None
    assert samples_of(families, "mig_exporter_process_info") == []
    assert samples_of(families, "mig_exporter_device_allocation_info") == []


def test_an_unknown_container_id_has_its_id_and_no_names(tmp_path, fake_kubelet):
    docker = "0::/system.slice/docker-" + "d" * 64 + ".scope\n"
    kubelet = fake_kubelet(PODS)
    families = Scraper(DemoSource(), pods=_watch(tmp_path, kubelet.socket_path, cgroups={50102: docker})).families()
    labels = next(s.labels for s in samples_of(families, "mig_exporter_process_info") if s.labels["pid"] == "50102")
    assert (labels["container_id"], labels["namespace"], labels["pod"], labels["container"]) == ("d" * 64, "", "", "")
    assert samples_of(families, "mig_exporter_pod_memory_used_bytes") == []


# --- end to end ----------------------------------------------------------------------------------

def _read(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mig_exporter", "read", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_end_to_end_read_carries_the_pod_labels(fake_nvidia_smi, fake_kubelet, tmp_path):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    proc = demo_proc(tmp_path / "proc")
    logs = make_kubelet_logs(tmp_path / "log")
    kubelet = fake_kubelet(PODS)
    result = _read(["--nvidia-smi", str(smi), "--proc.root", str(proc), "--kubelet.log-dir", str(logs)],
                   {"MIG_EXPORTER_KUBELET_POD_RESOURCES_SOCKET": kubelet.socket_path})
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    info = {s.labels["pid"]: s.labels for s in samples_of(families, "mig_exporter_process_info")}
    assert {pid: (labels["namespace"], labels["pod"], labels["container"], labels["container_id"])
            for pid, labels in info.items()} == {
        "48213": ("llm", "llama-0", "server", LLAMA.container_id),
        "51877": ("llm", "vllm-6b7f9c-x2x4q", "vllm", VLLM.container_id),
        "50102": ("graphics", "vk-llama-0", "llama", VK_LLAMA.container_id),
        "50318": ("notebooks", "jupyter-alice", "notebook", NOTEBOOK.container_id),
    }
    assert sample_value(families, "mig_exporter_device_allocation_info",
                        {"index": "1002", "namespace": "batch", "pod": "train-7", "container": "trainer"}) == 1
    assert sample_value(families, "mig_exporter_pod_memory_used_bytes",
                        {"namespace": "graphics", "pod": "vk-llama-0", "container": "llama"}) == 20480 * MIB
    assert kubelet.calls == 1
    assert "Traceback" not in result.stderr


def test_no_kubernetes_gives_no_pod_labels_and_asks_no_kubelet(fake_nvidia_smi, fake_kubelet, tmp_path):
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    kubelet = fake_kubelet(PODS)
    result = _read(["--nvidia-smi", str(smi), "--proc.root", str(demo_proc(tmp_path / "proc")),
                    "--kubelet.pod-resources-socket", kubelet.socket_path],
                   {"MIG_EXPORTER_KUBERNETES": "false"})
    assert result.returncode == 0, result.stderr
    families = list(text_string_to_metric_families(result.stdout))
    assert {s.labels["pod"] for s in samples_of(families, "mig_exporter_process_info")} == {""}
    assert samples_of(families, "mig_exporter_device_allocation_info") == []
    assert kubelet.calls == 0


def test_grpc_is_not_loaded_where_there_is_no_kubelet(fake_nvidia_smi, tmp_path):
    """The exporter on a host without a kubelet never imports grpcio."""
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    code = ("import sys; from mig_exporter.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "sys.stderr.write('GRPC LOADED' if 'grpc' in sys.modules else 'GRPC NOT LOADED')\n")
    result = subprocess.run([sys.executable, "-c", code, "read", "--nvidia-smi", str(smi),
                             "--kubelet.pod-resources-socket", str(tmp_path / "none.sock"), "--log.level", "info"],
                            capture_output=True, text=True, timeout=60)
    assert result.stderr.endswith("GRPC NOT LOADED"), result.stderr
    assert "no kubelet pod-resources socket at" in result.stderr


# --- in a pod, no socket is unknown allocations, not none ------------------------------------------

def test_in_a_pod_is_told_by_the_variable_the_kubelet_sets_in_every_container():
    # The kubelet adds the default namespace's kubernetes Service's variables to every container,
    # enableServiceLinks: false or not (pkg/kubelet/kubelet_pods.go, getServiceEnvVarMap).
    assert in_a_pod({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert not in_a_pod({}) and not in_a_pod({"KUBERNETES_SERVICE_HOST": ""})


def test_in_a_pod_a_missing_socket_is_a_problem_and_the_allocations_unknown(tmp_path):
    """A pod's node runs a kubelet whose pods hold devices: a socket not mounted, or gone while
    the kubelet starts (it unlinks the old one first: pkg/kubelet/util/util_unix.go,
    CreateListener), is allocations that cannot be read, never no allocations."""
    pods = _watch(tmp_path, str(tmp_path / "no.sock"))
    pods.in_pod = True
    outcome = Scraper(DemoSource(), pods=pods).read()
    assert outcome.pods is not None
    assert (outcome.pods.allocations, outcome.pods.pod_resources_success) == (None, False)
    (problem,) = outcome.pods.problems
    assert problem.startswith(f"no kubelet pod-resources socket at {tmp_path / 'no.sock'}, though this runs in a "
                              "Kubernetes pod (KUBERNETES_SERVICE_HOST is set): device allocations are unknown")
    assert outcome.pods.notes == ()
    assert not outcome.host.allocations_known
    families = list(Scraper(DemoSource(), pods=pods).families_for(outcome))
    assert sample_value(families, "mig_exporter_pod_resources_read_success") == 0
    assert sample_value(families, "mig_exporter_read_problems") == 1
    # The process labels still come from the cgroups and the log directories.
    assert sample_value(families, "mig_exporter_process_info", {"pid": "48213", "pod": "llama-0"}) == 1


def test_in_a_pod_with_the_socket_mounted_nothing_changes(tmp_path, fake_kubelet):
    pods = _watch(tmp_path, fake_kubelet(PODS).socket_path)
    pods.in_pod = True
    outcome = Scraper(DemoSource(), pods=pods).read()
    assert outcome.pods is not None and outcome.pods.pod_resources_success is True
    assert outcome.host.allocations_known and len(outcome.host.allocated) == 4


def test_end_to_end_in_a_pod_without_the_socket_no_empty_device_is_free(fake_nvidia_smi, tmp_path):
    """The demo's 1g.10gb (0/mig2) is empty: free outside a pod, unknown in one whose kubelet
    socket is missing, free again where the socket is switched off (--kubelet.pod-resources-socket=,
    the non-root component) or --no-kubernetes: the operator's word that nothing is asked."""
    smi = fake_nvidia_smi((SAMPLES / "demo.xml").read_bytes(), (SAMPLES / "demo.L.txt").read_bytes())
    proc = str(demo_proc(tmp_path / "proc"))
    missing = str(tmp_path / "pod-resources" / "kubelet.sock")
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}

    def state_of_1002(args: list[str], env: dict[str, str]) -> tuple[str, float | None]:
        result = _read(["--nvidia-smi", str(smi), "--proc.root", proc, *args], env)
        assert result.returncode == 0, result.stderr
        families = list(text_string_to_metric_families(result.stdout))
        (state,) = [s.labels["state"] for s in samples_of(families, "mig_exporter_device_state")
                    if s.labels["index"] == "1002" and s.value == 1]
        return state, sample_value(families, "mig_exporter_pod_resources_read_success")

    outside = {"KUBERNETES_SERVICE_HOST": ""}  # whatever the tests run in
    assert state_of_1002(["--kubelet.pod-resources-socket", missing], outside) == ("free", None)
    assert state_of_1002(["--kubelet.pod-resources-socket", missing], in_pod) == ("unknown", 0)
    assert state_of_1002(["--kubelet.pod-resources-socket="], in_pod) == ("free", None)
    assert state_of_1002(["--kubelet.pod-resources-socket", missing, "--no-kubernetes"], in_pod) == ("free", None)
