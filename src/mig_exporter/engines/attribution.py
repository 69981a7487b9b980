"""Attribution: which engine processes hold how much GPU memory, and where.

``engine_reading`` is pure: a /proc table and a GPU snapshot in, an
``EngineReading`` out, in two steps: ``engine_trees``, what /proc alone says
(the top-most engine processes and the ids each one's memory is summed over),
which the scraper makes in the /proc read's worker, beside the GPU read; then
``engines_on_gpus``, those trees summed over the snapshot, the only part that
waits for the GPUs (a node of 5000 processes: about 2 ms less on the scrape's
critical path). ``EngineReader`` holds the engine settings and where
processes are read from, for the scraper. The rules, all in docs/engines.md:

- An engine process is the *top-most* process an engine rule matches. A
  matched process under another matched process (a TGI shard under its
  launcher, a llama-server started by a matched wrapper) is folded into it,
  so its memory is counted once, under the top-most engine.
- Its memory is what the driver lists for its pid, the ids of its threads,
  and the pids and thread ids of all its descendants, summed over every
  device. Descendants count because the engines put the model in workers:
  vLLM's EngineCore, SGLang's schedulers, Triton's Python backend stubs and
  TGI's shards are child processes, and the parent holds nothing itself.
- 0 means none of them is on any GPU's process list: the engine runs on the
  CPU.
- Without the host's PID namespace the pids /proc shows are not the ones the
  driver lists, so no engine process is reported at all rather than every
  one as "on the CPU". The same holds for a read where the driver lists
  processes and /proc has none of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from mig_exporter.engines.rules import EngineSettings
from mig_exporter.host.procfs import ProcEntry, ProcError, ProcfsSource, ProcReader, ProcTable
from mig_exporter.model.readings import EngineProcess, EngineReading
from mig_exporter.model.snapshot import Process, Snapshot, is_linux_pid


class EngineReader:
    """The engine settings and where to read processes from (a /proc tree,
    or the demo's bundled table)."""

    def __init__(self, settings: EngineSettings, procs: ProcReader) -> None:
        self.procs = procs
        self.settings = settings

    @property
    def settings(self) -> EngineSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: EngineSettings) -> None:
        """New settings (a config reload): what was matched under the old ones is forgotten."""
        self._settings = settings
        self._matched: dict[int, tuple[ProcEntry, str | None]] = {}  # by id(): what each entry matched
        if isinstance(self.procs, ProcfsSource):  # what it reads again at every read: the engines' trees
            self.procs.watch(settings.match)

    def describe(self) -> str:
        engines = ", ".join(self.settings.engines) or "none"
        return f"engines: {engines} (/proc: {self.procs.describe()})"

    def reads_little(self) -> bool:
        """Whether the next ``read_procs`` is a short one (only what changed since the last, or
        the demo's table): one that may run alongside the GPU read. A first read of a /proc opens
        every process's files, and would hold the interpreter while the GPU read starts its
        commands."""
        return not isinstance(self.procs, ProcfsSource) or self.procs.warm

    def read_procs(self) -> tuple[ProcTable | None, str | None]:
        """Read /proc now: the table, or ``None`` and why not. With no engine
        switched on only the namespace is read, for host_pid_namespace."""
        try:
            if not self.settings.engines:
                return ProcTable(self.procs.read_namespace(), {}), None
            return self.procs.read(), None
        except ProcError as e:
            return None, str(e)

    def reading(self, table: ProcTable | None, error: str | None, snapshot: Snapshot | None) -> EngineReading:
        """The engines of ``table`` on ``snapshot``'s GPUs: ``trees``, then ``engines_on_gpus``."""
        return engines_on_gpus(self.trees(table, error), snapshot)

    def trees(self, table: ProcTable | None, error: str | None) -> EngineTrees:
        """What ``table`` alone says of the engines (``engine_trees``). A process /proc was not
        read again for is the same ``ProcEntry`` as before: what it matched is kept (a match
        costs ~10 µs a process, the whole read's budget on a node of a thousand)."""
        kept = self._matched
        now: dict[int, tuple[ProcEntry, str | None]] = {}

        def match(process: ProcEntry) -> str | None:
            hit = kept.get(id(process))  # the entry is held in the value: its id is not reused meanwhile
            engine = hit[1] if hit is not None and hit[0] is process else self.settings.match(process)
            now[id(process)] = (process, engine)
            return engine

        trees = engine_trees(self.settings, table, error, match)
        if now:  # a read that matched nothing (not the host's /proc, a failed one) keeps what was known
            self._matched = now
        return trees


class EngineTree(NamedTuple):
    """A top-most engine process, and every id its memory is summed over (sorted): its pid,
    its descendants' pids, and all their thread ids."""

    engine: str
    pid: int
    comm: str
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineTrees:
    """What /proc alone says of the engines. ``trees`` is ``None`` where engines cannot be
    told apart from processes on the CPU (then ``problems`` say why); ``known`` holds every
    pid and thread id /proc shows, and ``root`` where it is (whether the driver's pids are ours)."""

    engines: tuple[str, ...]
    host_pid_namespace: bool | None
    trees: tuple[EngineTree, ...] | None
    problems: tuple[str, ...] = ()
    known: frozenset[int] = frozenset()
    root: str = ""


def engine_reading(
    settings: EngineSettings, table: ProcTable | None, error: str | None, snapshot: Snapshot | None,
    match: Callable[[ProcEntry], str | None] | None = None,
) -> EngineReading:
    """Map processes to engines and engines to the memory their trees hold.

    ``snapshot`` is ``None`` when the GPU read failed: engines are still
    counted, but where they are is unknown. ``match``: ``settings.match``, or one
    that keeps what it found.
    """
    return engines_on_gpus(engine_trees(settings, table, error, match), snapshot)


def engine_trees(
    settings: EngineSettings, table: ProcTable | None, error: str | None,
    match: Callable[[ProcEntry], str | None] | None = None,
) -> EngineTrees:
    """The top-most engine processes of ``table`` and the ids each one's memory is summed
    over; ``error``: why there is no table."""
    match = match or settings.match
    engines = settings.engines
    if table is None:
        return EngineTrees(engines, None, None, (error or "cannot read /proc",) if engines else ())
    host = table.namespace.is_host
    if not engines:
        return EngineTrees((), host, None)
    if not host:
        return EngineTrees(engines, False, None, (table.namespace.reason(),))

    procs = table.processes
    matched = {pid: engine for pid, p in procs.items() if p.alive and (engine := match(p)) is not None}
    children: dict[int, list[int]] = defaultdict(list)
    for p in procs.values():
        if p.ppid != p.pid:
            children[p.ppid].append(p.pid)
    trees: list[EngineTree] = []
    for pid in sorted(matched):
        if _has_ancestor_in(pid, matched, lambda q: procs[q].ppid if q in procs else None):
            continue  # folded into the top-most matched ancestor
        ids: set[int] = set()
        for member in _subtree(pid, children):
            ids.add(member)
            ids.update(procs[member].thread_ids if member in procs else ())
        trees.append(EngineTree(matched[pid], pid, procs[pid].comm, tuple(sorted(ids))))
    known = frozenset(i for p in procs.values() for i in (p.pid, *p.thread_ids))
    return EngineTrees(engines, True, tuple(trees), (), known, table.namespace.root)


def engines_on_gpus(trees: EngineTrees, snapshot: Snapshot | None) -> EngineReading:
    """``trees`` summed over ``snapshot``'s processes: each engine's memory and devices."""
    placed = snapshot is not None
    if trees.trees is None:
        return EngineReading(trees.engines, trees.host_pid_namespace, None, placed, trees.problems)
    mismatch = _pids_not_ours(trees, snapshot)
    if mismatch:
        return EngineReading(trees.engines, True, None, placed, (mismatch,))
    on_gpu: dict[int, list[Process]] = defaultdict(list)
    for gp in snapshot.processes if snapshot else ():
        on_gpu[gp.pid].append(gp)
    # A device whose process list is not whole (N/A, or a MIG card read without the monitor
    # capability) may hold an engine listed nowhere: "on no GPU" is then unknown, not 0.
    hidden = snapshot is not None and (any(not d.processes_known for d in snapshot.devices)
                                       or any(c.aggregate_denied for c in snapshot.cards))
    found: list[EngineProcess] = []
    for tree in trees.trees:
        held = [gp for i in tree.ids for gp in on_gpu.get(i, ())]
        unknown = not placed or any(gp.used_bytes is None for gp in held) or (hidden and not held)
        used = None if unknown else sum(gp.used_bytes or 0 for gp in held)
        devices = tuple(sorted({gp.device_index for gp in held}))
        found.append(EngineProcess(tree.engine, tree.pid, tree.comm, used, devices))
    found.sort(key=lambda e: (e.engine, e.pid))
    return EngineReading(trees.engines, True, tuple(found), placed)


def _has_ancestor_in(pid: int, matched: dict[int, str], parent: Callable[[int], int | None]) -> bool:
    seen = {pid}
    current = parent(pid)
    while current is not None and current not in seen:
        if current in matched:
            return True
        seen.add(current)
        current = parent(current)
    return False


def _subtree(pid: int, children: dict[int, list[int]]) -> Iterator[int]:
    seen: set[int] = set()
    stack = [pid]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        yield current
        stack.extend(children.get(current, ()))


def _pids_not_ours(trees: EngineTrees, snapshot: Snapshot | None) -> str | None:
    """The driver lists processes and /proc has none of them: its pids are not
    the ones we see, whatever the namespace link says, so "on no GPU's list"
    would mean nothing. (They may also all have exited since; the next read
    tells.) Ids past Linux's range (a vGPU host's VMs) are in no /proc: they
    tell nothing either way."""
    if snapshot is None or not snapshot.processes:
        return None
    known = trees.known
    listed = sorted({p.pid for p in snapshot.processes if is_linux_pid(p.pid)})
    if not listed:
        return None
    if any(pid in known for pid in listed):
        return None
    shown = ", ".join(map(str, listed[:5])) + (", ..." if len(listed) > 5 else "")
    return (f"none of the {len(listed)} process(es) the driver lists (pid {shown}) is in {trees.root}; "
            "engine metrics are left out of this read")
