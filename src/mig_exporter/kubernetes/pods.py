"""Kubernetes attribution: which pod and container each GPU process runs in,
and which pod each device is allocated to (docs/kubernetes.md).

``pod_reading`` is pure: the GPU snapshot, the processes' cgroup identities,
the names from the kubelet's log directories and the kubelet's pod-resources
answer in, a ``PodReading`` out. ``PodReader`` reads those for the scraper:
the kubelet's part (``read_kubelet``) alongside the GPUs, the rest right after
them, for the pids the driver listed:

- a process's container id and pod UID come from ``/proc/PID/cgroup``
  (``cgroup.py``), only where the /proc root is the host's PID namespace,
  whose pids the driver lists;
- its namespace, pod and container names from the kubelet's log directory
  names (``podlogs.py``), by container id, else by pod UID;
- allocations from the kubelet's pod-resources ``List`` (``podresources.py``):
  each device id is mapped to placement indexes through the snapshot's UUIDs.
  No socket is no allocations outside a pod (not on Kubernetes), and unknown
  ones in a pod (``in_a_pod``): there the node has a kubelet, whose socket is
  not mounted, not seen, or gone while the kubelet restarts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mig_exporter.core.deadline import Deadline
from mig_exporter.host.cgroup import CgroupIdentity
from mig_exporter.host.owners import cgroup_reads, read_identities
from mig_exporter.host.procfs import ProcfsSource
from mig_exporter.kubernetes.podlogs import PodName, PodNames, read_pod_names
from mig_exporter.kubernetes.podresources import PodResources, PodResourcesClient, PodResourcesError
from mig_exporter.model.placement import uuid_device_indexes
from mig_exporter.model.readings import Allocation, PodReading, ProcessPod
from mig_exporter.model.snapshot import Snapshot

# NVIDIA's device plugin with --device-id-strategy=index: "0" for card 0,
# "1:2" for MIG device 2 of card 1.
_CARD_INDEX = re.compile(r"^(\d+)$")
_MIG_INDEX = re.compile(r"^(\d+):(\d+)$")
NVIDIA_RESOURCE_PREFIX = "nvidia.com/"
MIN_CALL_S = 0.05  # less than this left of the scrape's budget: not worth a call
# Set in every container of a pod: the kubelet always adds the default namespace's kubernetes
# Service's variables, even with enableServiceLinks: false (kubelet_pods.go, getServiceEnvVarMap).
IN_POD_VARIABLE = "KUBERNETES_SERVICE_HOST"


def in_a_pod(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs in a Kubernetes pod, so on a node with a kubelet."""
    return bool(environ.get(IN_POD_VARIABLE))


def device_indexes(snapshot: Snapshot, resource: str, device_id: str) -> tuple[int, ...]:
    """The placement indexes a device plugin's device id stands for.

    - ``GPU-…`` and ``MIG-…`` UUIDs (NVIDIA's default id strategy, also the old
      ``MIG-GPU-…/gi/ci`` form) are looked up among the devices' UUIDs. A whole
      card's UUID on a card in MIG mode (the "none" MIG strategy gives pods the
      whole card) stands for all of its instances.
    - A ``::N`` suffix is a time-slicing or MPS replica of the device: the
      device is the part before it.
    - For ``nvidia.com/`` resources only, the index id strategy: ``N`` is card
      N, ``N:M`` its MIG device M.

    Ids that match nothing (another vendor's, a device that was not read) give ().
    """
    base = device_id.split("::", 1)[0]
    found = uuid_device_indexes(snapshot, base)
    if found:
        return found
    if resource.startswith(NVIDIA_RESOURCE_PREFIX):
        m = _CARD_INDEX.match(base)
        if m and any(d.index == int(m.group(1)) and not d.is_mig for d in snapshot.devices):
            return (int(m.group(1)),)
        m = _MIG_INDEX.match(base)
        if m:
            # By card and MIG index, not by the index they would make: "0:150" is no device of card 0.
            card, mig = int(m.group(1)), int(m.group(2))
            return tuple(d.index for d in snapshot.devices if d.card == card and d.mig_index == mig)[:1]
    return ()


def allocations(snapshot: Snapshot, pods: Iterable[PodResources]) -> tuple[tuple[Allocation, ...], tuple[str, ...]]:
    """Each (device, container) allocation, and a problem line for each NVIDIA
    device id that matches no device read."""
    found: set[Allocation] = set()
    unmatched: list[str] = []
    for pod in pods:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    indexes = device_indexes(snapshot, devices.resource_name, device_id)
                    if not indexes and devices.resource_name.startswith(NVIDIA_RESOURCE_PREFIX):
                        unmatched.append(f"{pod.namespace}/{pod.name} {devices.resource_name} {device_id}")
                    for index in indexes:
                        found.add(Allocation(index, pod.namespace, pod.name, container.name, devices.resource_name))
    problems: tuple[str, ...] = ()
    if unmatched:
        shown = ", ".join(sorted(unmatched)[:5]) + (", ..." if len(unmatched) > 5 else "")
        problems = (f"{len(unmatched)} device(s) the kubelet allocated are on no device read: {shown}",)
    ordered = sorted(found, key=lambda a: (a.device_index, a.namespace, a.pod, a.container, a.resource))
    return tuple(ordered), problems


def process_pods(identities: dict[int, CgroupIdentity], names: PodNames) -> dict[int, ProcessPod]:
    """The processes that run in a container, with their names where the
    kubelet's directories give them: by container id (all three names), else
    by pod UID (namespace and pod)."""
    out: dict[int, ProcessPod] = {}
    for pid, identity in sorted(identities.items()):
        if identity.container_id is None and identity.pod_uid is None:
            continue
        name = names.by_container_id.get(identity.container_id or "")
        if name is None:
            name = names.by_pod_uid.get(identity.pod_uid or "", PodName("", ""))
        out[pid] = ProcessPod(pid, identity.container_id or "", name.namespace, name.pod, name.container)
    return out


def pod_reading(
    snapshot: Snapshot,
    identities: dict[int, CgroupIdentity],
    names: PodNames,
    listed: tuple[PodResources, ...] | None,
    *,
    asked: bool,
    problems: Iterable[str] = (),
    notes: Iterable[str] = (),
) -> PodReading:
    """Join what was read. ``listed`` is ``None`` when the kubelet was not
    asked (``asked`` False) or did not answer."""
    found = list(problems)
    allocated = None
    if listed is not None:
        allocated, unmatched = allocations(snapshot, listed)
        found.extend(unmatched)
    success = (listed is not None) if asked else None
    return PodReading(process_pods(identities, names), allocated, success, tuple(found), tuple(notes))


@dataclass(frozen=True, slots=True)
class KubeletReading:
    """What the kubelet gave, apart from the GPUs: the log directory's names and why none
    (``None``: not read), and the pod-resources answer (``listed``, ``None`` when not asked
    or unanswered). ``asked``: allocations were expected of the kubelet (it was asked, or
    its socket is missing in a pod), so none listed means unknown ones."""

    names: tuple[PodNames, str | None] | None
    listed: tuple[PodResources, ...] | None
    asked: bool
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class PodReader:
    """Where the Kubernetes read looks: the /proc root, the kubelet's log
    directory and its pod-resources socket (either may be switched off with
    ``None``). ``in_pod``: this process runs in a pod (``in_a_pod``), where a
    missing socket leaves the allocations unknown rather than none."""

    def __init__(self, proc_root: str, pod_resources: PodResourcesClient | None, log_dir: str | None,
                 in_pod: bool = False) -> None:
        self.procs = ProcfsSource(proc_root)
        self._cgroups = cgroup_reads(self.procs)
        self.pod_resources = pod_resources
        self.log_dir = log_dir
        self.in_pod = in_pod

    def describe(self) -> str:
        parts = [f"cgroups under {self.procs.root}"]
        parts.append(f"names from {self.log_dir}/{{pods,containers}}" if self.log_dir else "no pod names")
        parts.append(self.pod_resources.describe() if self.pod_resources else "no allocations")
        return "pods: " + ", ".join(parts)

    def read_kubelet(self, deadline: Deadline | None = None) -> KubeletReading:
        """What needs no GPU snapshot: the log directory's names and the kubelet's
        allocations, the call getting at most what is left until ``deadline``."""
        names = read_pod_names(self.log_dir) if self.log_dir else None
        problems: list[str] = []
        notes: list[str] = []
        listed = None
        asked = False
        client = self.pod_resources
        if client is not None:
            present = client.present()
            if not present and self.in_pod:
                # A pod's node runs a kubelet, whose pods hold devices: not to be taken as none.
                asked = True
                problems.append(f"no kubelet pod-resources socket at {client.socket_path}, though this runs in a "
                                f"Kubernetes pod ({IN_POD_VARIABLE} is set): device allocations are unknown, so no "
                                "empty device counts free (mount the host's /var/lib/kubelet/pod-resources "
                                "directory and run as uid 0, see docs/kubernetes.md)")
            elif not present:
                notes.append(f"no kubelet pod-resources socket at {client.socket_path}: device allocations are left "
                             "out (not on Kubernetes, or the socket's directory is not mounted)")
            elif deadline is not None and deadline.left_s() < MIN_CALL_S:
                asked = True
                problems.append("no time left in the scrape's budget to ask the kubelet for allocations")
            else:
                asked = True
                try:
                    listed = client.list(None if deadline is None else deadline.left_s())
                except PodResourcesError as e:
                    problems.append(str(e))
        return KubeletReading(names, listed, asked, tuple(problems), tuple(notes))

    def identities(self, snapshot: Snapshot) -> dict[int, CgroupIdentity] | None:
        """The cgroups of the pids on the GPU lists, when owners did not read them (``read_identities``)."""
        return read_identities(self.procs, (p.pid for p in snapshot.processes), None, self._cgroups)

    def read(self, snapshot: Snapshot, deadline: Deadline | None = None,
             identities: dict[int, CgroupIdentity] | None = None,
             kubelet: KubeletReading | None = None) -> PodReading:
        """Read for the processes of ``snapshot``; the kubelet call gets at
        most what is left until ``deadline`` (the scrape's).
        ``identities``: their cgroups, when already read for this scrape; ``kubelet``: what
        ``read_kubelet`` gave for this scrape, when read alongside the GPUs."""
        if identities is None:
            identities = self.identities(snapshot) or {}
        if kubelet is None:
            kubelet = self.read_kubelet(deadline)
        notes: list[str] = []
        names = PodNames()
        if kubelet.names is not None and any(i.container_id or i.pod_uid for i in identities.values()):
            names, reason = kubelet.names
            if reason:
                notes.append(f"{reason}: processes in containers get no pod, namespace or container names "
                             "(mount the kubelet's /var/log/pods and /var/log/containers, see docs/kubernetes.md)")
        return pod_reading(snapshot, identities, names, kubelet.listed, asked=kubelet.asked,
                           problems=kubelet.problems, notes=(*notes, *kubelet.notes))
