"""Which container and pod a process runs in, from ``/proc/PID/cgroup``.

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
- kind's nodes (``/kubelet.slice/kubelet-kubepods.slice/...``);
- a reader in a private cgroup namespace (containerd's default on cgroup v2),
  to which the kernel shows other containers' paths relative to its own,
  with ``..`` components (``0::/../../kubepods-besteffort.slice/...``).

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


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """What a process's cgroup path says. ``None``: the path does not say
    (a host process; a container seen only as its pod's cgroup)."""

    container_id: str | None = None
    pod_uid: str | None = None


NO_IDENTITY = CgroupIdentity()


def parse_path(path: str) -> CgroupIdentity:
    """The container and pod of one cgroup path. The container is the
    innermost component that names one (a kind node's containers run inside
    the node's own container); the pod is the nearest one above it."""
    parts = [p for p in path.split("/") if p and p != ".."]
    container_at = None
    container_id = None
    for i in range(len(parts) - 1, -1, -1):
        m = _CONTAINER.match(parts[i])
        if m:
            container_at, container_id = i, m.group(1)
            break
    pod_uid = None
    for part in reversed(parts[: container_at if container_at is not None else len(parts)]):
        m = _POD.match(part)
        if m:
            pod_uid = m.group(1).replace("_", "-")
            break
    return CgroupIdentity(container_id, pod_uid)


def parse_cgroup(data: bytes) -> CgroupIdentity:
    """The identity in the contents of ``/proc/PID/cgroup``.

    Each line is ``hierarchy-id:controllers:path``. Under cgroup v1 every
    hierarchy carries a path, and for a container they agree; the first line
    that names a container wins, else the first that names a pod. A line that
    is not in that form is skipped.
    """
    best = NO_IDENTITY
    for line in data.decode("utf-8", errors="replace").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        found = parse_path(fields[2])
        if found.container_id is not None:
            return found
        if best.pod_uid is None and found.pod_uid is not None:
            best = found
    return best
