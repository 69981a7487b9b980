"""The /proc scan: what reading a busy node's process table costs, and whether a
scrape waits for it.

- read: ``ProcfsSource(root).read()`` of a fabricated tree of 5000 processes
  (tests/proc_tree.py writes it, in the kernel's own file formats): cold (the
  first read of a new source) and warm (its second and later reads, which a
  per-process cache may serve), and under churn (a tenth of the processes
  replaced by new ones between reads, outside the timing);
- off the critical path: ``mig-exporter serve --proc.root`` on that tree and on
  one of about 50 processes, both up at once, scraped in turn on the single
  scenario; the difference of the scrape p50s is what the bigger table adds to
  a scrape's wall time.

Only the package's public API: a source is made and read, nothing inside it is
looked at, so whatever cache it keeps is measured as a scrape would meet it.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import scenarios, serving
from benchmarks.scenarios import REPO
from benchmarks.tables import f, table
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.procfs import ProcfsSource

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from proc_tree import Proc, make_proc  # tests/, on sys.path above

BIG_TREE = 5000
SMALL_TREE = 50
CHURN = 0.10  # the share of processes replaced between two reads
FIRST_PID = 10_000
PID_STEP = 3

# What a GPU node runs besides its GPU jobs: daemons, shells, runtimes, workers.
_KINDS = (
    ("bash", ["/bin/bash", "-l"], "/usr/bin/bash"),
    ("sshd", ["sshd: alice [priv]"], "/usr/sbin/sshd"),
    ("python3", ["/usr/bin/python3", "-m", "worker", "--queue", "default"], "/usr/bin/python3.12"),
    ("containerd-shim", ["/usr/bin/containerd-shim-runc-v2", "-namespace", "k8s.io", "-id",
                         "4f1c0ffee0ddba11"], "/usr/bin/containerd-shim-runc-v2"),
    ("node", ["node", "/srv/app/server.js"], "/usr/bin/node"),
    ("java", ["/usr/lib/jvm/java-17-openjdk-amd64/bin/java", "-Xmx4g", "-jar", "app.jar"],
     "/usr/lib/jvm/java-17-openjdk-amd64/bin/java"),
    ("kworker/3:1", [], None),  # a kernel thread: no exe, no command line
)
# And its inference engines: one process in ENGINE_EVERY, 57 of the 5000, about one per MIG
# instance of big-mig (each engine's tree is read afresh at every read, as it must be).
_ENGINE = ("vllm", ["/opt/conda/envs/vllm/bin/python3.11", "-m", "vllm.entrypoints.openai.api_server", "--model",
                    "meta-llama/Llama-3.1-8B-Instruct"], "/opt/conda/envs/vllm/bin/python3.11")
ENGINE_EVERY = 89
# "Off the critical path" is measured behind a fake nvidia-smi whose -q -x takes this long: the
# scan runs while it does (a real query takes 0.4-6 s).
QUERY_S = 0.1


def processes(count: int, first_pid: int) -> list[Proc]:
    """``count`` processes from ``first_pid`` on; every fifth has two more threads."""
    out = []
    for i in range(count):
        pid = first_pid + PID_STEP * i
        comm, cmdline, exe = _ENGINE if i % ENGINE_EVERY == 0 else _KINDS[pid % len(_KINDS)]
        threads = [pid + 1, pid + 2] if i % 5 == 0 else []
        out.append(Proc(pid, comm, cmdline, ppid=1, exe=exe, threads=threads))
    return out


def make_tree(root: Path, count: int) -> Path:
    """A /proc of ``count`` processes besides init, kthreadd and the exporter."""
    return make_proc(root, processes(count, FIRST_PID))


def churn(root: Path, alive: list[int], next_pid: int, share: float = CHURN) -> tuple[list[int], int]:
    """Replace ``share`` of the processes: the oldest exit, as many new ones start
    with pids not seen before. Returns the pids now alive and the next free pid."""
    n = max(1, int(len(alive) * share))
    for pid in alive[:n]:
        shutil.rmtree(root / str(pid))
    born = processes(n, next_pid)
    # make_proc writes a whole tree; here only the new processes' directories.
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        staged = make_proc(Path(tmp) / "proc", born)
        for p in born:
            (staged / str(p.pid)).rename(root / str(p.pid))
    return [*alive[n:], *(p.pid for p in born)], next_pid + PID_STEP * n


@dataclass
class ReadFigures:
    """Medians in ms of one tree's reads: wall and this process's CPU."""

    processes: int
    cold_ms: float
    cold_cpu_ms: float
    warm_ms: float
    warm_cpu_ms: float
    churn_ms: float
    churn_cpu_ms: float
    reps: int


@dataclass
class ScrapeFigures:
    """Single-card HTTP scrapes of two servers, one per /proc tree, interleaved."""

    small_processes: int
    big_processes: int
    small_p50_ms: float
    big_p50_ms: float
    small_cpu_ms: float
    big_cpu_ms: float
    reps: int

    @property
    def added_ms(self) -> float:
        return self.big_p50_ms - self.small_p50_ms


@dataclass
class Results:
    read: ReadFigures
    scrape: ScrapeFigures | None
    note: str = ""


def _timed(fn: Callable[[], object]) -> tuple[int, int]:
    w, c = time.perf_counter_ns(), time.process_time_ns()
    fn()
    return time.perf_counter_ns() - w, time.process_time_ns() - c


def _ms(samples: list[int]) -> float:
    return statistics.median(samples) / 1e6


def _source(root: Path) -> ProcfsSource:
    """A source as serve's engines read it: every preset's processes and their trees watched
    (read afresh at every read)."""
    source = ProcfsSource(str(root))
    source.watch(DEFAULT_SETTINGS.match)
    return source


def measure_reads(root: Path, count: int, reps: int) -> ReadFigures:
    """Cold: a new source's first read, ``reps`` times. Warm: one source read
    ``reps`` times after its first. Churn: one source, a tenth of the tree
    replaced before each read (last, as it changes the tree)."""
    cold_w, cold_c, warm_w, warm_c, churn_w, churn_c = [], [], [], [], [], []
    for _ in range(reps):
        w, c = _timed(_source(root).read)
        cold_w.append(w)
        cold_c.append(c)
    source = _source(root)
    table = source.read()
    if len(table.processes) < count:
        raise RuntimeError(f"read {len(table.processes)} of {count} fabricated processes")
    for _ in range(reps):
        w, c = _timed(source.read)
        warm_w.append(w)
        warm_c.append(c)
    alive = sorted(pid for pid in table.processes if pid >= FIRST_PID)
    next_pid = max(alive) + PID_STEP * 10
    for _ in range(reps):
        alive, next_pid = churn(root, alive, next_pid)
        w, c = _timed(source.read)
        churn_w.append(w)
        churn_c.append(c)
    after = source.read()
    if sorted(pid for pid in after.processes if pid >= FIRST_PID) != alive:
        raise RuntimeError("the read after churn does not list the processes alive")
    return ReadFigures(count, _ms(cold_w), _ms(cold_c), _ms(warm_w), _ms(warm_c), _ms(churn_w), _ms(churn_c), reps)


def measure_scrapes(big: Path, small: Path, reps: int, warmup: int) -> ScrapeFigures:
    """``serve --proc.root`` on each tree, the single scenario, scrapes in turn."""
    shape = scenarios.SINGLE
    xml, listing = scenarios.query_xml(shape), scenarios.listing(shape)
    with tempfile.TemporaryDirectory(prefix="mig-bench-procscan-") as tmp:
        fake = serving.write_fake_nvidia_smi(Path(tmp), xml, listing, QUERY_S)
        servers = []
        try:
            for root in (small, big):
                servers.append(serving.start_server(fake, proc_root=root))
            scrapers = [serving.Scrape(port) for _, port in servers]
            for _ in range(warmup):
                for scrape in scrapers:
                    scrape()
            times: list[list[int]] = [[], []]
            cpu_before = [serving.cpu_seconds(proc.pid) for proc, _ in servers]
            for rep in range(reps):
                # Alternate which goes first, so neither always follows the other.
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for i in order:
                    t = time.perf_counter_ns()
                    body = scrapers[i]()
                    times[i].append(time.perf_counter_ns() - t)
            cpu = [(serving.cpu_seconds(proc.pid) - before) * 1000 / reps
                   for (proc, _), before in zip(servers, cpu_before, strict=True)]
            for scrape in scrapers:
                scrape.close()
            if b'mig_exporter_read_success{source="nvidia-smi"} 1.0' not in body:
                raise RuntimeError("the scrape did not read the fake nvidia-smi")
        finally:
            for proc, _ in servers:
                serving.stop_server(proc)
    return ScrapeFigures(SMALL_TREE, BIG_TREE, _ms(times[0]), _ms(times[1]), cpu[0], cpu[1], reps)


def measure(quick: bool) -> Results:
    reps = 3 if quick else 20
    with tempfile.TemporaryDirectory(prefix="mig-bench-proc-") as tmp:
        big = make_tree(Path(tmp) / "big" / "proc", BIG_TREE)
        small = make_tree(Path(tmp) / "small" / "proc", SMALL_TREE)
        # The scrapes first: the reads' churn changes the big tree (its size stays).
        scrape = measure_scrapes(big, small, 3 if quick else 40, 1 if quick else 3)
        read = measure_reads(big, BIG_TREE, reps)
    return Results(read, scrape)


def report(results: Results) -> list[str]:
    r = results.read
    out = [f"/proc scan of a fabricated tree (tests/proc_tree.py) of {r.processes} processes "
           f"(ms, p50 of {r.reps}; wall and this process's CPU; churn = {CHURN:.0%} replaced before each read)"]
    out.append(table(["read", "wall", "CPU"], [
        ["cold (a new source's first read)", f(r.cold_ms), f(r.cold_cpu_ms)],
        ["warm (the same source again)", f(r.warm_ms), f(r.warm_cpu_ms)],
        ["churn (warm, 10% new processes)", f(r.churn_ms), f(r.churn_cpu_ms)],
    ]))
    s = results.scrape
    if s is not None:
        out.append("")
        out.append(f"/proc scan on the scrape's path: serve --proc.root <tree>, single scenario behind a fake -q -x "
                   f"of {QUERY_S * 1000:.0f} ms, HTTP scrape p50 (ms) of {s.reps} scrapes each, interleaved; server "
                   "CPU per scrape (ms, mean)")
        out.append(table(["proc root", "processes", "scrape p50", "server CPU"], [
            ["small tree", str(s.small_processes), f(s.small_p50_ms), f(s.small_cpu_ms)],
            ["big tree", str(s.big_processes), f(s.big_p50_ms), f(s.big_cpu_ms)],
            ["difference", str(s.big_processes - s.small_processes), f(s.added_ms), f(s.big_cpu_ms - s.small_cpu_ms)],
        ]))
    return out


def figures(results: Results) -> dict[str, object]:
    """For --json."""
    from dataclasses import asdict

    out: dict[str, object] = {"read": asdict(results.read)}
    if results.scrape is not None:
        out["scrape"] = {**asdict(results.scrape), "added_ms": results.scrape.added_ms}
    return out
