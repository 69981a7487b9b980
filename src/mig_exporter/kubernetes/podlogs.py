"""Pod and container names from the names of the kubelet's log directories.

The kubelet pod-resources API names pods but gives neither their UIDs nor
their containers' ids, and a process's cgroup gives only those. The kubelet
writes the join into the node's file system for every container runtime, for
log shippers to read:

- ``/var/log/pods/<namespace>_<pod>_<pod uid>/<container>/`` for each pod;
- ``/var/log/containers/<pod>_<namespace>_<container>-<container id>.log``, a
  link into it, for each container.

Only the names are read (a directory listing; no log is opened, no link is
followed). They parse without ambiguity: Kubernetes names cannot contain
``_``, and a container id is 64 hex digits. Parsing is pure; the reading below
lists the two directories.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

DEFAULT_LOG_DIR = "/var/log"
_CONTAINER_ID = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class PodName:
    namespace: str
    pod: str
    container: str = ""


@dataclass(frozen=True, slots=True)
class PodNames:
    """Pods by UID and containers by id, as the log directories name them."""

    by_pod_uid: dict[str, PodName] = field(default_factory=dict)
    by_container_id: dict[str, PodName] = field(default_factory=dict)


def parse_pod_dir(name: str) -> tuple[str, PodName] | None:
    """``(uid, name)`` from ``<namespace>_<pod>_<uid>``, or ``None``."""
    parts = name.split("_")
    if len(parts) != 3 or not all(parts):
        return None
    namespace, pod, uid = parts
    return uid, PodName(namespace, pod)


def parse_container_link(name: str) -> tuple[str, PodName] | None:
    """``(container id, name)`` from ``<pod>_<namespace>_<container>-<id>.log``, or ``None``."""
    if not name.endswith(".log"):
        return None
    parts = name[: -len(".log")].split("_")
    if len(parts) != 3:
        return None
    pod, namespace, rest = parts
    container, _, container_id = rest.rpartition("-")
    if not (pod and namespace and container) or not _CONTAINER_ID.match(container_id):
        return None
    return container_id, PodName(namespace, pod, container)


def pod_names(pod_dirs: list[str], container_links: list[str]) -> PodNames:
    pods = dict(filter(None, map(parse_pod_dir, pod_dirs)))
    containers = dict(filter(None, map(parse_container_link, container_links)))
    return PodNames(pods, containers)


def read_pod_names(log_dir: str) -> tuple[PodNames, str | None]:
    """The names under ``log_dir`` (``/var/log``), and why none could be read
    (both directories missing or unreadable), or ``None``."""
    listings: list[list[str]] = []
    errors: list[str] = []
    for sub in ("pods", "containers"):
        path = os.path.join(log_dir, sub)
        try:
            listings.append(os.listdir(path))
        except OSError as e:
            listings.append([])
            errors.append(f"{path}: {e.strerror or e}")
    reason = None
    if len(errors) == 2:
        reason = "cannot list " + "; ".join(errors)
    return pod_names(*listings), reason
