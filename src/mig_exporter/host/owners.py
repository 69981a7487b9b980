"""Who each GPU process belongs to outside Kubernetes: its Slurm job and step,
its systemd unit and its user (docs/hpc.md).

``owner_reading`` is pure: the processes' cgroup identities, their uids and
the passwd names in, an ``OwnerReading`` out. ``OwnerReader`` reads those for
the scraper, right after the GPUs, for the pids the driver listed:

- the Slurm job and step and the systemd unit from ``/proc/PID/cgroup``
  (``cgroup.py``), the same read that gives the Kubernetes pod: the scraper
  reads it once and hands it to both;
- the user from the real uid of ``/proc/PID/status``, named through the
  passwd file of ``--host.passwd`` (``passwd.py``), else the bare uid;

only where the /proc root is the host's PID namespace, whose pids the driver
lists, and within what is left of the scrape's budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mig_exporter.core.deadline import Deadline
from mig_exporter.host.cgroup import NO_IDENTITY, CgroupIdentity, parse_cgroup
from mig_exporter.host.passwd import PasswdFile
from mig_exporter.host.procfs import ProcError, ProcfsSource, parse_status_uid
from mig_exporter.model.readings import OwnerReading, ProcessOwner
from mig_exporter.model.snapshot import Snapshot


def owner_reading(
    identities: Mapping[int, CgroupIdentity],
    uids: Mapping[int, int],
    names: Mapping[int, str],
    problems: Iterable[str] = (),
) -> OwnerReading:
    """Join what was read: every pid with a cgroup or a uid gets an owner."""
    out: dict[int, ProcessOwner] = {}
    for pid in sorted(set(identities) | set(uids)):
        identity = identities.get(pid, NO_IDENTITY)
        uid = uids.get(pid)
        user = None if uid is None else names.get(uid, str(uid))
        out[pid] = ProcessOwner(pid, identity.slurm_job, identity.slurm_step, identity.systemd_unit, user)
    return OwnerReading(out, tuple(problems))


def read_identities(procs: ProcfsSource, pids: Iterable[int],
                    deadline: Deadline | None = None) -> dict[int, CgroupIdentity] | None:
    """The cgroup identity of each pid that can still be read, until
    ``deadline``; ``None`` when the /proc root is not the
    host's PID namespace (its pids are not the driver's: engines report that)."""
    wanted = sorted(set(pids))
    if not wanted:
        return {}
    try:
        if not procs.read_namespace().is_host:
            return None
    except ProcError:
        return None
    out = {}
    for pid in wanted:
        if deadline is not None and deadline.expired:
            break
        data = procs.read_cgroup(pid)
        if data is not None:
            out[pid] = parse_cgroup(data)
    return out


class OwnerReader:
    """Where the owners are read from: the /proc root, and the host's passwd
    file (``None``: users are uids)."""

    def __init__(self, proc_root: str, passwd_path: str | None = None) -> None:
        self.procs = ProcfsSource(proc_root)
        self.passwd = PasswdFile(passwd_path) if passwd_path else None

    def describe(self) -> str:
        names = f"user names from {self.passwd.path}" if self.passwd else "users as uids (no --host.passwd)"
        return f"owners: Slurm jobs and systemd units from the cgroups under {self.procs.root}, {names}"

    def identities(self, snapshot: Snapshot, deadline: Deadline | None = None) -> dict[int, CgroupIdentity] | None:
        """The cgroups of the pids on the GPU lists (see ``read_identities``)."""
        return read_identities(self.procs, (p.pid for p in snapshot.processes), deadline)

    def read(self, snapshot: Snapshot, deadline: Deadline | None = None,
             identities: dict[int, CgroupIdentity] | None = None) -> OwnerReading:
        """Read for the processes of ``snapshot`` by ``deadline``;
        ``identities``: their cgroups, when already read for this scrape."""
        if identities is None:
            identities = self.identities(snapshot, deadline)
            if identities is None:
                return OwnerReading({})
        problems: list[str] = []
        uids: dict[int, int] = {}
        for pid in sorted(identities):
            if deadline is not None and deadline.expired:
                break
            data = self.procs.read_status(pid)
            uid = None if data is None else parse_status_uid(data)
            if uid is not None:
                uids[pid] = uid
        if deadline is not None and deadline.expired:
            # Some may have exited instead: once out of time, which is not worth finding out.
            missing = len({p.pid for p in snapshot.processes} - set(uids))
            if missing:
                problems.append(f"no time left in the scrape's budget: {missing} process(es) may lack their user, "
                                "Slurm job or systemd unit")
        names: dict[int, str] = {}
        if self.passwd is not None and uids:
            names, problem = self.passwd.names()
            if problem:
                problems.append(problem)
        return owner_reading(identities, uids, names, problems)
