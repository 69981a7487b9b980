"""How many series one node costs a Prometheus, and how many new ones job turnover makes.

Counts (all but one line): each figure is the number of samples in one /metrics answer (what
Prometheus counts as ``scrape_samples_scraped``, and what ``mig_exporter_scrape_series``
says), or the number of distinct series (name and labels) over many answers, or an answer's
size in bytes. The node is read through the exporter's own Scraper and Exporter from the
benchmark's generated ``nvidia-smi -q -x`` (benchmarks/scenarios.py), not on Kubernetes, with
every engine preset watched as ``serve`` watches them, for each ``--collector.processes``
setting, on three kinds of node (``NODES``), as its /proc shows them:

- ``no host PIDs``: the exporter does not see the host's PID namespace (a container without
  ``hostPID``, or the fleet's exporters of benchmarks/fleet.py, with an empty ``--proc.root``):
  ``host_pid_namespace 0`` and no other engine series;
- ``no engine``: in the host's PID namespace, each GPU process a ``python3 train.py``;
- ``llama-server``: in the host's PID namespace, each GPU process a ``llama-server -ngl 99``
  (issue 36's inference node).

What it prints:

- ``count``: series of ``single``, ``big-whole`` and ``big-mig`` on each kind of node, and on
  the llama-server node the series with a process's pid (``pid="other"`` is not one) and the
  most engine processes with series of their own on one device;
- ``growth``: series by processes a device (8 cards x 7 MIG), and least-squares series per
  MIG instance and per whole card;
- ``churn``: a day of job turnover on a big-mig node, each instance's processes replaced
  by new ones (new pids) every 10 minutes: distinct series seen, and new series an hour;
- ``body``: the bytes of one answer, OpenMetrics (what Prometheus asks for) and text 0.0.4,
  plain and gzipped as the server sends them; and big-mig's at gzip levels 1, 6 and 9, with
  the CPU time each takes (the one figure here that is timed);
- ``dcgm``: the same node as dcgm-exporter's default counters would export it.

Run: ``python -m benchmarks.series`` (``--json PATH`` for the figures).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.scenarios import BIG_MIG, BIG_WHOLE, SINGLE, Shape, listing, query_xml
from benchmarks.serving import PROMETHEUS_ACCEPT
from benchmarks.tables import table
from mig_exporter.core.deadline import Deadline
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.procfs import HOST_PID_NAMESPACE, PidNamespace, ProcEntry, ProcTable
from mig_exporter.metrics.exporter import Answer, Exporter
from mig_exporter.metrics.process_series import OTHER_PID, ProcessSeries
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi

SETTINGS = ("all", "top=3", "none")
NO_HOST_PIDS, NO_ENGINE, LLAMA_SERVER = "no host PIDs", "no engine", "llama-server"
NODES = (NO_HOST_PIDS, NO_ENGINE, LLAMA_SERVER)
DAY_MINUTES = 24 * 60
TURNOVER_MINUTES = 10
LLAMA_SERVER_CMDLINE = ("/usr/local/bin/llama-server", "-m", "/models/qwen2.5-7b-instruct-q4_k_m.gguf", "-ngl", "99")
TRAINING_CMDLINE = ("/usr/bin/python3", "train.py", "--epochs", "3")
Series = tuple[str, frozenset[tuple[str, str]]]

# dcgm-exporter's default counters file, etc/default-counters.csv of NVIDIA/dcgm-exporter at
# 7ad58324b4447b64dc3dedf946b889b648b7f476: its 25 uncommented fields (its 26th row,
# DCGM_FI_DRIVER_VERSION, is a label on every series). With its default --devices=f each is
# one series per GPU, and on a GPU in MIG mode one per GPU instance instead (its
# device_monitoring.go watches the GPU instances of a card that has them): docs/scale.md.
DCGM_DEFAULT_FIELDS: tuple[str, ...] = tuple(f"DCGM_FI_DEV_{name}" for name in (
    "SM_CLOCK", "MEM_CLOCK", "MEMORY_TEMP", "GPU_TEMP", "POWER_USAGE", "TOTAL_ENERGY_CONSUMPTION",
    "PCIE_REPLAY_COUNTER", "GPU_UTIL", "MEM_COPY_UTIL", "ENC_UTIL", "DEC_UTIL", "XID_ERRORS", "FB_FREE", "FB_USED",
    "FB_RESERVED", "NVLINK_BANDWIDTH_TOTAL", "VGPU_LICENSE_STATUS", "UNCORRECTABLE_REMAPPED_ROWS",
    "CORRECTABLE_REMAPPED_ROWS", "ROW_REMAP_FAILURE",
)) + tuple(f"DCGM_FI_PROF_{name}" for name in (
    "GR_ENGINE_ACTIVE", "PIPE_TENSOR_ACTIVE", "DRAM_ACTIVE", "PCIE_TX_BYTES", "PCIE_RX_BYTES",
))
assert len(DCGM_DEFAULT_FIELDS) == 25


class _Fixed:
    """A source that answers one snapshot (set before each read)."""

    name = "nvidia-smi"

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def read(self, deadline: Deadline | None = None) -> Snapshot:
        return self.snapshot

    def ready(self) -> tuple[bool, str]:
        return True, "fixed"

    def describe(self) -> str:
        return "a generated node"


class NodeProcs:
    """The node's /proc as the engine reader reads it (``NODES``): outside the host's PID
    namespace nothing; inside it each GPU process of ``snapshot``, as a ``llama-server -ngl 99``
    on an engine node (else a ``python3 train.py``), and ``on_cpu`` llama-servers more, on no
    GPU's list (pids 1 to ``on_cpu``, which no scenario lists)."""

    root = "generated"

    def __init__(self, snapshot: Snapshot, node: str, on_cpu: int = 0) -> None:
        if node not in NODES:
            raise ValueError(f"{node!r}: not one of {NODES}")
        self.node = node
        self.pids = sorted({p.pid for p in snapshot.processes})
        self.on_cpu = on_cpu

    def describe(self) -> str:
        return f"a generated /proc: {self.node}"

    def read_namespace(self) -> PidNamespace:
        return PidNamespace(self.root, None if self.node == NO_HOST_PIDS else HOST_PID_NAMESPACE)

    def read(self) -> ProcTable:
        namespace = self.read_namespace()
        if self.node == NO_HOST_PIDS:
            return ProcTable(namespace, {})
        gpu = LLAMA_SERVER_CMDLINE if self.node == LLAMA_SERVER else TRAINING_CMDLINE
        entries = [_entry(pid, gpu) for pid in self.pids]
        entries += [_entry(pid, LLAMA_SERVER_CMDLINE) for pid in range(1, self.on_cpu + 1)]
        return ProcTable(namespace, {e.pid: e for e in entries})


def _entry(pid: int, cmdline: tuple[str, ...]) -> ProcEntry:
    name = cmdline[0].rsplit("/", 1)[-1]
    return ProcEntry(pid, 0, name[:15], "S", cmdline[0], cmdline, (pid,))


def snapshot_of(shape: Shape) -> Snapshot:
    return snapshot_from_smi(query_xml(shape), listing(shape))


def answer_of(snapshot: Snapshot, setting: str, node: str = NO_ENGINE, on_cpu: int = 0) -> Answer:
    """One /metrics answer for ``snapshot`` on a node of kind ``node``."""
    engines = EngineReader(DEFAULT_SETTINGS, NodeProcs(snapshot, node, on_cpu))
    exporter = Exporter(Scraper(_Fixed(snapshot), engines, process_series=ProcessSeries.parse(setting)))
    return exporter.answer(Deadline.after(30))


def series_of(snapshot: Snapshot, setting: str, node: str = NO_ENGINE, on_cpu: int = 0) -> set[Series]:
    """Every series of one /metrics answer for ``snapshot``: its name and labels."""
    answer = answer_of(snapshot, setting, node, on_cpu)
    found = {(s.name, frozenset(s.labels.items())) for family in answer.families for s in family.samples}
    written = [s.value for s in answer.families[-1].samples if s.name == "mig_exporter_scrape_series"]
    assert written == [len(found)], (written, len(found))  # every sample is a series of its own
    return found


def with_pid(found: Iterable[Series]) -> list[Series]:
    """The series that name a process by its pid (``pid="other"`` names none)."""
    return [s for s in found if dict(s[1]).get("pid", OTHER_PID) != OTHER_PID]


def engines_with_own_series(found: Iterable[Series]) -> Counter[str]:
    """Per device (``index``; ``""`` for none), the engine processes with series of their own."""
    return Counter(labels["index"] for name, ls in found if name == "mig_exporter_engine_info"
                   for labels in (dict(ls),) if labels["pid"] != OTHER_PID)


def with_new_pids(snapshot: Snapshot, epoch: int) -> Snapshot:
    """The node after ``epoch`` turnovers: each process replaced by one with a new pid."""
    processes = tuple(p._replace(pid=1_000_000 + epoch * 10_000 + i) for i, p in enumerate(snapshot.processes))
    return replace(snapshot, processes=processes)


@dataclass(frozen=True)
class Churn:
    setting: str
    per_scrape: int
    distinct_in_a_day: int

    @property
    def new_per_hour(self) -> float:
        return (self.distinct_in_a_day - self.per_scrape) / 24


def churn(shape: Shape, setting: str, node: str = NO_ENGINE) -> Churn:
    base = snapshot_of(shape)
    seen: set[Series] = set()
    first = 0
    for epoch in range(DAY_MINUTES // TURNOVER_MINUTES):
        found = series_of(with_new_pids(base, epoch), setting, node)
        first = first or len(found)
        seen |= found
    return Churn(setting, first, len(seen))


def slope(points: Iterable[tuple[float, float]]) -> float:
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys).slope


PROCESSES_A_DEVICE = (0, 1, 2, 3, 4, 8, 16)


def by_processes(setting: str, node: str) -> dict[int, int]:
    """Series of 8 cards x 7 MIG instances with 0 to 16 processes on each of the 56 devices."""
    return {p: len(series_of(snapshot_of(Shape("g", 8, 7, p)), setting, node)) for p in PROCESSES_A_DEVICE}


def growth(setting: str, node: str = NO_ENGINE) -> dict[str, float]:
    """Least-squares series per MIG instance and per whole card, with no process: exact, these counts
    are linear."""
    def points(shapes: Iterable[Shape], x: str) -> list[tuple[float, float]]:
        return [(getattr(shape, x), len(series_of(snapshot_of(shape), setting, node))) for shape in shapes]

    return {
        # MIG instances on 8 cards, 1 to 7 each, no process.
        "per_mig_instance": slope(points((Shape("g", 8, i, 0) for i in (1, 2, 4, 7)), "devices")),
        # Whole cards, no process: a card's own series and its one device's.
        "per_whole_card": slope(points((Shape("g", c, 0, 0) for c in (1, 2, 4, 8)), "cards")),
    }


def body_sizes(snapshot: Snapshot, setting: str, node: str) -> dict[str, int]:
    """The bytes of one answer: OpenMetrics (Prometheus' Accept) and text 0.0.4, plain and gzipped
    as the server sends them (level 1)."""
    answer = answer_of(snapshot, setting, node)
    sizes = {}
    for name, accept in (("openmetrics", PROMETHEUS_ACCEPT), ("text", None)):
        for compress in (False, True):
            sizes[name + ("_gzip" if compress else "")] = len(answer.encoded(accept, compress)[0])
    return sizes


def gzip_levels(body: bytes, runs: int = 30) -> dict[int, tuple[int, float]]:
    """``body``'s gzipped size and the median CPU time (ms) of compressing it, at level 1 (the
    server's), 6 (client_golang's) and 9 (client_python's ``gzip.compress``): the one timed figure."""
    found = {}
    for level in (1, 6, 9):
        times = []
        for _ in range(runs):
            start = time.process_time_ns()
            size = len(gzip.compress(body, compresslevel=level))
            times.append(time.process_time_ns() - start)
        found[level] = (size, statistics.median(times) / 1e6)
    return found


def dcgm_series(shape: Shape) -> int:
    """dcgm-exporter's default counters on the node, at most: a series per field per GPU, or per
    GPU instance in MIG mode (each of the benchmark's MIG devices is a GPU instance of its own).
    A field the card does not support (NVLink on a PCIe card, vGPU licence off vGPU) is not
    exported, so a real node may have fewer. It has no per-process series: no pid churn."""
    return len(DCGM_DEFAULT_FIELDS) * shape.devices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.series", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    # The "no host PIDs" node logs, at every read, that engine metrics are left out: as it should.
    logging.getLogger("mig_exporter").setLevel(logging.ERROR)
    figures: dict[str, object] = {}

    print("Series per node, one /metrics answer (= scrape_samples_scraped = mig_exporter_scrape_series); "
          "/proc: what the engine reader sees (every preset watched)")
    counts: dict[str, dict[str, dict[str, int]]] = {}
    pids: dict[str, dict[str, dict[str, int]]] = {}
    rows = []
    for shape in (SINGLE, BIG_WHOLE, BIG_MIG):
        snapshot = snapshot_of(shape)
        counts[shape.name], pids[shape.name] = {}, {}
        for node in NODES:
            found = {s: series_of(snapshot, s, node) for s in SETTINGS}
            counts[shape.name][node] = {s: len(found[s]) for s in SETTINGS}
            pids[shape.name][node] = {s: len(with_pid(found[s])) for s in SETTINGS}
            rows.append([shape.name, shape.describe(), node, *(str(len(found[s])) for s in SETTINGS),
                         str(dcgm_series(shape))])
        counts[shape.name]["dcgm-exporter"] = {"all": dcgm_series(shape)}  # type: ignore[dict-item]
    print(table(["scenario", "shape", "/proc", *SETTINGS, "dcgm-exporter"], rows))
    figures["series_per_node"] = counts
    figures["series_with_a_pid"] = pids

    print("\nOn the llama-server node: series with a pid (pid=\"other\" not counted), and the most engine "
          "processes with series of their own on one device")
    rows = []
    own: dict[str, dict[str, int]] = {}
    for shape in (SINGLE, BIG_WHOLE, BIG_MIG):
        snapshot = snapshot_of(shape)
        own[shape.name] = {}
        cells = []
        for s in SETTINGS:
            found = series_of(snapshot, s, LLAMA_SERVER)
            most = max(engines_with_own_series(found).values(), default=0)
            own[shape.name][s] = most
            cells.append(f"{len(with_pid(found))} ({most})")
        rows.append([shape.name, *cells])
    print(table(["scenario", *(f"{s}: with a pid (most a device)" for s in SETTINGS)], rows))
    print("  each engine on no GPU's list adds 2 series with its pid (memory 0, info index=\"\") under every setting")
    figures["engine_processes_with_own_series_most_a_device"] = own

    print("\nGrowth: series of 8 cards x 7 MIG instances by processes a device")
    grown_by_processes = {node: {s: by_processes(s, node) for s in SETTINGS} for node in (NO_ENGINE, LLAMA_SERVER)}
    print(table(["processes a device", *(f"{node}: {s}" for node in grown_by_processes for s in SETTINGS)],
                [[str(p), *(str(grown_by_processes[node][s][p]) for node in grown_by_processes for s in SETTINGS)]
                 for p in PROCESSES_A_DEVICE]))
    grown = {s: growth(s) for s in SETTINGS}
    for s in SETTINGS:
        g = grown[s]
        print(f"  {s:>6}: {g['per_mig_instance']:.2f} per MIG instance (8 cards, 1-7 instances, no process), "
              f"{g['per_whole_card']:.2f} per whole card (no process)")
    figures["growth"] = {"by_processes_a_device": grown_by_processes, "slopes": grown}

    print(f"\nChurn: a day on a big-mig node, each instance's processes replaced every {TURNOVER_MINUTES} minutes "
          f"({DAY_MINUTES // TURNOVER_MINUTES} turnovers, {BIG_MIG.processes} processes each)")
    churned: dict[str, dict[str, dict[str, float]]] = {}
    rows = []
    for node in (NO_ENGINE, LLAMA_SERVER):
        churned[node] = {}
        for s in SETTINGS:
            c = churn(BIG_MIG, s, node)
            churned[node][s] = {"per_scrape": c.per_scrape, "distinct_in_a_day": c.distinct_in_a_day,
                                "new_per_hour": c.new_per_hour}
            rows.append([node, s, str(c.per_scrape), str(c.distinct_in_a_day), f"{c.new_per_hour:.0f}"])
    print(table(["/proc", "setting", "series per scrape", "distinct series in a day", "new series an hour"], rows))
    figures["churn_big_mig"] = churned

    print("\nBody of one answer, KiB (gzip: level 1, as the server sends it)")
    sizes: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    rows = []
    for shape in (SINGLE, BIG_WHOLE, BIG_MIG):
        snapshot = snapshot_of(shape)
        sizes[shape.name] = {}
        for node in NODES:
            sizes[shape.name][node] = {}
            for s in SETTINGS:
                b = sizes[shape.name][node][s] = body_sizes(snapshot, s, node)
                rows.append([shape.name, node, s, *(f"{b[k] / 1024:.1f}" for k in
                                                    ("openmetrics", "openmetrics_gzip", "text", "text_gzip"))])
    print(table(["scenario", "/proc", "setting", "OpenMetrics", "gzipped", "text 0.0.4", "gzipped"], rows))
    figures["body_bytes"] = sizes
    levels = gzip_levels(answer_of(snapshot_of(BIG_MIG), "all", NO_HOST_PIDS).encoded(PROMETHEUS_ACCEPT, False)[0])
    print("  big-mig (no host PIDs, all), OpenMetrics, by gzip level: " + ", ".join(
        f"level {level} {size / 1024:.1f} KiB in {ms:.2f} ms" for level, (size, ms) in levels.items())
        + " (CPU time of this process, median of 30)")
    figures["gzip_levels_big_mig"] = {level: {"bytes": size, "ms": ms} for level, (size, ms) in levels.items()}

    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
