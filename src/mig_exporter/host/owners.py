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
lists, and within what is left of the scrape's budget. Both are read once for
each process (its pid and the inode of its ``/proc/PID``, as ``procfs.py``
tells processes apart) and kept while it runs: a running process rarely
changes its cgroup or its real uid (docs/hpc.md). A pid that the /proc listing
does not show is looked up by itself: it may be a thread's id (the listing holds
thread group leaders only), kept by its own ``/proc/TID`` inode; one that is not
there at all costs one ``access`` and nothing is opened for it. A new one is looked
up at once, one found at every read; one found not there is looked for again only
one read in ``REVISIT_READS`` (by pid, round robin) while the driver goes on
listing it: such a pid (its process ended, and the driver still lists it, or it is
another namespace's) stays so, and becomes a thread's id only if the kernel gives
it out again, to a thread that then uses a GPU; that is seen within
``REVISIT_READS`` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from mig_exporter.core.deadline import Deadline
from mig_exporter.host.cgroup import NO_IDENTITY, CgroupIdentity, parse_cgroup
from mig_exporter.host.passwd import PasswdFile
from mig_exporter.host.procfs import REVISIT_READS, ProcError, ProcfsSource, parse_status_uid
from mig_exporter.model.readings import OwnerReading, ProcessOwner
from mig_exporter.model.snapshot import Snapshot, is_linux_pid

T = TypeVar("T")


class KeptReads(Generic[T]):
    """One file of each process, parsed and kept while that process runs (the same pid and
    /proc/PID inode); what is kept is what the last read asked for. ``read`` gives a pid's
    file, or ``None`` when it cannot (the process has gone); ``locate`` the inodes of those
    of some pids the listing lacks that are there all the same (threads' ids)."""

    def __init__(self, read: Callable[[int], bytes | None], parse: Callable[[bytes], T],
                 locate: Callable[[Iterable[int]], Mapping[int, int]], revisit_reads: int = REVISIT_READS) -> None:
        self._read = read
        self._parse = parse
        self._locate = locate
        self._kept: dict[int, tuple[int, T]] = {}
        self._absent: set[int] = set()  # unlisted pids not there at the last read
        self._revisit = revisit_reads
        self._reads = 0

    def read(self, pids: Iterable[int], listing: Mapping[int, int], deadline: Deadline | None = None) -> dict[int, T]:
        """Each of ``pids`` in ``listing`` (pid: inode) that can be read; once past
        ``deadline`` only what is kept."""
        kept = self._kept
        now: dict[int, tuple[int, T]] = {}
        pids = list(pids)
        unlisted = [pid for pid in pids if pid not in listing]  # no thread group leader: threads, or gone
        # Not there at the last read: not there now, but for one in revisit (see the module's docstring).
        absent, revisit = self._absent, self._revisit
        turn = self._reads % revisit
        self._reads += 1
        looked_for = [pid for pid in unlisted if pid not in absent or pid % revisit == turn]
        threads = self._locate(looked_for) if looked_for else {}
        self._absent = {pid for pid in unlisted if pid not in threads}
        for pid in pids:
            inode = listing.get(pid)
            if inode is None:
                inode = threads.get(pid)
                if inode is None:
                    continue
            known = kept.get(pid)
            if known is None or known[0] != inode:
                if deadline is not None and deadline.expired:
                    continue
                data = self._read(pid)
                if data is None:
                    continue
                known = (inode, self._parse(data))
            now[pid] = known
        self._kept = now
        return {pid: value for pid, (_, value) in now.items()}


def cgroup_reads(procs: ProcfsSource) -> KeptReads[CgroupIdentity]:
    return KeptReads(lambda pid: procs.read_cgroup(pid), parse_cgroup, lambda pids: procs.inodes(pids))


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


def read_identities(procs: ProcfsSource, pids: Iterable[int], deadline: Deadline | None = None,
                    kept: KeptReads[CgroupIdentity] | None = None,
                    listing: Mapping[int, int] | None = None) -> dict[int, CgroupIdentity] | None:
    """The cgroup identity of each pid that can still be read, until
    ``deadline``; ``None`` when the /proc root is not the
    host's PID namespace (its pids are not the driver's: engines report that).
    ``kept``: what was read before; ``listing``: the processes (pid: inode) if listed already.
    An id past Linux's range (a vGPU host's VM) is in no /proc, and is not looked for."""
    wanted = sorted({pid for pid in pids if is_linux_pid(pid)})
    if not wanted:
        return {}
    try:
        if not procs.read_namespace().is_host:
            return None
    except ProcError:
        return None
    if listing is None:
        try:
            listing = procs.listing()
        except ProcError:  # a root that cannot be listed: no process can be read in it either
            return {}
    return (kept or cgroup_reads(procs)).read(wanted, listing, deadline)


class OwnerReader:
    """Where the owners are read from: the /proc root, and the host's passwd
    file (``None``: users are uids)."""

    def __init__(self, proc_root: str, passwd_path: str | None = None) -> None:
        self.procs = ProcfsSource(proc_root)
        self.passwd = PasswdFile(passwd_path) if passwd_path else None
        self._cgroups = cgroup_reads(self.procs)
        self._uids = KeptReads(lambda pid: self.procs.read_status(pid), parse_status_uid,
                               lambda pids: self.procs.inodes(pids))

    def describe(self) -> str:
        names = f"user names from {self.passwd.path}" if self.passwd else "users as uids (no --host.passwd)"
        return f"owners: Slurm jobs and systemd units from the cgroups under {self.procs.root}, {names}"

    def identities(self, snapshot: Snapshot, deadline: Deadline | None = None,
                   listing: Mapping[int, int] | None = None) -> dict[int, CgroupIdentity] | None:
        """The cgroups of the pids on the GPU lists (see ``read_identities``)."""
        return read_identities(self.procs, (p.pid for p in snapshot.processes), deadline, self._cgroups, listing)

    def read(self, snapshot: Snapshot, deadline: Deadline | None = None,
             identities: dict[int, CgroupIdentity] | None = None,
             listing: Mapping[int, int] | None = None) -> OwnerReading:
        """Read for the processes of ``snapshot`` by ``deadline``;
        ``identities``: their cgroups, when already read for this scrape; ``listing``: the
        processes (pid: inode), when listed already."""
        if identities is None:
            identities = self.identities(snapshot, deadline, listing)
            if identities is None:
                return OwnerReading({})
        problems: list[str] = []
        if listing is None and identities:
            try:
                listing = self.procs.listing()
            except ProcError:
                listing = {}
        read = self._uids.read(sorted(identities), listing or {}, deadline)
        uids = {pid: uid for pid, uid in read.items() if uid is not None}
        if deadline is not None and deadline.expired:
            # Some may have exited instead: once out of time, which is not worth finding out.
            missing = len({p.pid for p in snapshot.processes if is_linux_pid(p.pid)} - set(uids))
            if missing:
                problems.append(f"no time left in the scrape's budget: {missing} process(es) may lack their user, "
                                "Slurm job or systemd unit")
        names: dict[int, str] = {}
        if self.passwd is not None and uids:
            names, problem = self.passwd.names()
            if problem:
                problems.append(problem)
        return owner_reading(identities, uids, names, problems)
