"""Which container, pod, Slurm job or systemd unit a process runs in, from ``/proc/PID/cgroup``.

Pure parsing: the file's bytes in, a ``CgroupIdentity`` out (the file is read
by ``procfs.read_cgroup``). One parser covers the layouts in use:

- cgroup v1 (one line per hierarchy, ``12:memory:/kubepods/...``) and v2 (one
  line, ``0::/kubepods.slice/...``);
- the kubelet's cgroupfs driver (``/kubepods/burstable/pod<uid>/<id>``) and
  systemd driver (``/kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope``),
  for the Guaranteed (no QoS level), Burstable and BestEffort classes;
- containerd (``cri-containerd-<id>.scope`` or a bare ``<id>``), CRI-O
  (``crio-<id>``, ``crio-<id>.scope``, with or without a nested
  ``/container``), Docker (``docker-<id>.scope``, ``/docker/<id>``) and Podman
  (``libpod-<id>.scope``), inside Kubernetes or not;
- kind's nodes (``/kubelet.slice/kubelet-kubepods.slice/...``, or ``/kubelet/kubepods/...``
  with the cgroupfs driver);
- a reader in a private cgroup namespace (containerd's default on cgroup v2),
  to which the kernel shows other containers' paths relative to its own,
  with ``..`` components (``0::/../../kubepods-besteffort.slice/...``).

Outside containers (docs/hpc.md):

- Slurm's cgroup/v2 plugin (``/system.slice/slurmstepd.scope/job_<id>/
  step_<step>/user/task_<n>``; ``<nodename>_slurmstepd.scope`` with
  multiple-slurmd) and cgroup/v1 plugin (``/slurm/uid_<uid>/job_<id>/
  step_<step>/task_<n>`` in each controller's line; ``/slurm_<nodename>/``
  with multiple-slurmd). Steps are numbers, ``batch``, ``extern`` or
  ``interactive``;
- systemd units: the innermost ``.service`` or ``.scope`` of the path
  (``ollama.service``, ``vllm@llama.service``, a user service below
  ``user@1000.service``, ``session-3.scope``, systemd-run's
  ``run-u12.service``). A process in a container, a pod or a Slurm job
  has none: there the unit is the runtime's or slurmstepd's, not the workload's.

The container id is the 64-hex-digit id the runtime gave the container (the
one ``crictl ps`` and ``docker ps`` show, shortened). The pod UID is written
with dashes whatever the driver wrote. Static pods' UIDs are 32 hex digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The innermost path component naming a container: a scope or directory with
# the runtime's prefix, or the bare id (cgroupfs driver, Docker's /docker/<id>).
_CONTAINER = re.compile(
    r"^(?:(?:cri-containerd|crio|docker|libpod|containerd|nerdctl)-)?([0-9a-f]{64})(?:\.scope)?$"
)
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# cgroupfs: pod<uid>; systemd: kubepods[-<qos>]-pod<uid_with_underscores>.slice (kind's
# nodes prefix it: kubelet-kubepods-besteffort-pod<uid>.slice)
_POD = re.compile(rf"^(?:[\w.-]*-)?pod({_UID})(?:\.slice)?$")
# The kubelet's tree (kubernetes pkg/kubelet/cm/cgroup_manager_linux.go, ConvertCgroupNameToSystemd
# and runc's ExpandSlice): the cgroupfs driver's /kubepods[/burstable|/besteffort]/pod<uid>, the
# systemd driver's kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice (each level
# repeats its parents' names), kind's cgroupRoot: /kubelet (its kubeadm config): kubelet.slice/
# kubelet-kubepods* with the systemd driver, /kubelet/kubepods/... with cgroupfs (kind before
# v0.13, and kubeadm clusters that copied its config). Another --cgroup-root gives no pod: a tree
# this list does not know is not trusted.
_KUBELET_ROOT = re.compile(r"^(?:kubepods(?:\.slice)?|kubelet(?:\.slice)?)$")
_KUBELET_NAME = re.compile(r"^(?:kubepods(?:\.slice)?|kubelet(?:\.slice)?|(?:kubelet-)?kubepods-[a-z]+\.slice|"
                           r"kubelet-kubepods\.slice|burstable|besteffort)$")
# Slurm's root: cgroup/v1's /slurm or /slurm_<nodename>, cgroup/v2's [<nodename>_]slurmstepd.scope.
_SLURM_ROOT = re.compile(r"^(?:slurm(?:_[\w.-]+)?|(?:[\w.-]+_)?slurmstepd\.scope)$")
_SLURM_JOB = re.compile(r"^job_(\d{1,64})$")  # as the job map's ids (host/jobmap.py)
_SLURM_STEP = re.compile(r"^step_(\d+|batch|extern|interactive)$")
# A unit processes can be in (slices hold none); systemd's escaping keeps names in this set.
_UNIT = re.compile(r"^[\w:.@\\-]{1,248}\.(?:service|scope)$")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """What a process's cgroup path says. ``None``: the path does not say
    (a host process; a container seen only as its pod's cgroup)."""

    container_id: str | None = None
    pod_uid: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    systemd_unit: str | None = None


NO_IDENTITY = CgroupIdentity()


def _slurms_root(parts: list[str], i: int) -> bool:
    """Whether component ``i`` is where slurmd puts jobs, not a name anyone
    could give a cgroup: cgroup/v1's root directory, or cgroup/v2's scope right
    under system.slice. Never inside a user's delegated tree, where any user
    can make cgroups with any name (and pose as a job)."""
    if not _SLURM_ROOT.match(parts[i]):
        return False
    if any(p.startswith(("user@", "user.slice")) for p in parts[:i]):
        return False
    if parts[i].endswith("slurmstepd.scope"):
        return i > 0 and parts[i - 1] == "system.slice"
    return i == 0


def parse_slurm(parts: list[str]) -> tuple[str | None, str | None]:
    """The Slurm job id and step of a path's components, when it is under
    Slurm's root. A job-level cgroup (no step below it) gives the job alone."""
    for i in range(len(parts)):
        if not _slurms_root(parts, i):
            continue
        rest = parts[i + 1:]
        if rest and rest[0].startswith("uid_"):  # cgroup/v1 puts the user above the job
            rest = rest[1:]
        job = _SLURM_JOB.match(rest[0]) if rest else None
        if job is None:
            continue
        step = _SLURM_STEP.match(rest[1]) if len(rest) > 1 else None
        return job.group(1), step.group(1) if step else None
    return None, None


def parse_unit(parts: list[str]) -> str | None:
    """The innermost systemd service or scope of a path's components. None
    under Kubernetes' slices, whose scopes are containers, and inside LXC or
    systemd-nspawn machines, whose units are another system's. A unit of a
    user's own manager is named with it, ``user@1000.service/app.service``:
    any user can name a unit ``ollama.service``, and two users' units of one
    name are two units."""
    if any(p.startswith(("kubepods", "kubelet-kubepods", "lxc.payload", "lxc.monitor")) or p == "machine.slice"
           for p in parts):
        return None
    units = [(i, p) for i, p in enumerate(parts) if _UNIT.match(p)]
    if not units:
        return None
    i, unit = units[-1]
    manager = next((p for p in parts[:i] if p.startswith("user@") and p.endswith(".service")), None)
    return f"{manager}/{unit}" if manager is not None else unit


def _kubelets(parts: list[str], start: int, end: int, relative: bool) -> bool:
    """Whether ``parts[start:end]``, the components above a pod, are the
    kubelet's own tree: every one a name the kubelet gives (``kubepods``, a QoS
    level, their systemd slices, kind's ``kubelet.slice``), starting at its root
    (``kubepods``, ``kubepods.slice``, ``kubelet.slice``) unless the path is one
    a private cgroup namespace shows relative to the reader, whose root the
    kernel hides. Anything else, a user's delegated tree (``user@1000.service/
    kubepods/...``) or a service's (``Delegate=yes``), is one where whoever owns
    it can make cgroups with any name and pose as a pod."""
    above = parts[start:end]
    if not above:
        return relative and start == 0
    if not all(_KUBELET_NAME.match(p) for p in above):
        return False
    return (relative and start == 0) or _KUBELET_ROOT.match(above[0]) is not None


def parse_path(path: str) -> CgroupIdentity:
    """The container and pod of one cgroup path.

    A pod counts only inside the kubelet's own tree (``_kubelets``), and a
    container only right under such a pod or right under a runtime's root
    (``/docker/<id>``, ``/system.slice/docker-<id>.scope``, rootful
    Podman's ``/machine.slice``), or alone in a path a private cgroup
    namespace shows. Those trees start at the hierarchy's root, or right
    inside a container that itself counts (a kind node's pods, seen from the
    host). Never in a user's delegated tree (``user@1000.service``): a user
    may name a cgroup ``kubepods``, ``pod<uid>`` or ``docker-<id>.scope`` and
    so borrow another pod's name and logs. Such a process gets its unit.
    The container is the innermost that counts; the pod is the nearest one
    above it."""
    relative = any(p == ".." for p in path.split("/"))
    parts = [p for p in path.split("/") if p and p != ".."]
    anchors = [0]  # where a tree may start: the root, and right inside each container that counts
    pods: list[int] = []
    container_at = None
    container_id = None
    for i, part in enumerate(parts):
        if any(p.startswith("user@") for p in parts[:i]):
            break
        m = _CONTAINER.match(part)
        if m and ((pods and pods[-1] == i - 1) or
                  any(parts[a:i] in ([], ["docker"], ["system.slice"], ["machine.slice"]) and
                      (relative or a > 0 or parts[a:i] != []) for a in anchors)):
            container_at, container_id = i, m.group(1)
            anchors.append(i + 1)
            continue
        if _POD.match(part) and any(_kubelets(parts, a, i, relative) for a in anchors):
            pods.append(i)
    pod_uid = None
    above = [j for j in pods if container_at is None or j < container_at]
    if above:
        m = _POD.match(parts[above[-1]])
        assert m is not None
        pod_uid = m.group(1).replace("_", "-")
    job, step = parse_slurm(parts)
    unit = None
    if container_id is None and pod_uid is None and job is None:
        unit = parse_unit(parts)
    return CgroupIdentity(container_id, pod_uid, job, step, unit)


def parse_cgroup(data: bytes) -> CgroupIdentity:
    """The identity in the contents of ``/proc/PID/cgroup``.

    Each line is ``hierarchy-id:controllers:path``. Under cgroup v1 every
    hierarchy carries a path, and for a container they agree; the first line
    that names a container wins, else the first that names a pod, else the
    first that names a Slurm job (Slurm's v1 plugin uses some controllers
    only, and its jobs sit in ``slurmd.service`` in the systemd hierarchy).
    Else the systemd unit comes from systemd's own hierarchy: the
    ``name=systemd`` line under v1, else the v2 line, else any line. A line
    that is not in that form is skipped.
    """
    best = NO_IDENTITY
    slurm = NO_IDENTITY
    units: dict[int, str] = {}  # by preference: 0 name=systemd, 1 the v2 line, 2 any other
    for line in data.decode("utf-8", errors="replace").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        found = parse_path(fields[2])
        if found.container_id is not None:
            return found
        if best.pod_uid is None and found.pod_uid is not None:
            best = found
        # Controllers may stop at the job's level: a line that also names the step is better.
        if found.slurm_job is not None and (slurm.slurm_job is None or
                                            (slurm.slurm_step is None and found.slurm_step is not None)):
            slurm = found
        if found.systemd_unit is not None:
            rank = 0 if fields[1] == "name=systemd" else 1 if fields[:2] == ["0", ""] else 2
            units.setdefault(rank, found.systemd_unit)
    if best.pod_uid is not None:
        return best
    if slurm.slurm_job is not None:
        return CgroupIdentity(slurm_job=slurm.slurm_job, slurm_step=slurm.slurm_step)
    return CgroupIdentity(systemd_unit=units[min(units)]) if units else NO_IDENTITY
