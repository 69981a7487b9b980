"""How many series one node costs a Prometheus, and how many new ones job turnover makes.

Counts, does not time: each figure is the number of samples in one /metrics answer (what
Prometheus counts as ``scrape_samples_scraped``, and what ``mig_exporter_scrape_series``
says), or the number of distinct series (name and labels) over many answers. The node is
read through the exporter's own Scraper and Exporter from the benchmark's generated
``nvidia-smi -q -x`` (benchmarks/scenarios.py), not on Kubernetes and with no engines
watched, for each ``--collector.processes`` setting.

- ``count``: series of ``single``, ``big-whole`` and ``big-mig``;
- ``growth``: least-squares series per extra process, per MIG instance and per whole card;
- ``churn``: a day of job turnover on a big-mig node, each instance's processes replaced
  by new ones (new pids) every 10 minutes: distinct series seen, and new series an hour;
- ``dcgm``: the same node as dcgm-exporter's default counters would export it.

Run: ``python -m benchmarks.series`` (``--json PATH`` for the figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.scenarios import BIG_MIG, BIG_WHOLE, SINGLE, Shape, listing, query_xml
from mig_exporter.core.deadline import Deadline
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.process_series import ProcessSeries
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi

SETTINGS = ("all", "top=3", "none")
DAY_MINUTES = 24 * 60
TURNOVER_MINUTES = 10

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


def snapshot_of(shape: Shape) -> Snapshot:
    return snapshot_from_smi(query_xml(shape), listing(shape))


def series_of(snapshot: Snapshot, setting: str) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """Every series of one /metrics answer for ``snapshot``: its name and labels."""
    exporter = Exporter(Scraper(_Fixed(snapshot), process_series=ProcessSeries.parse(setting)))
    answer = exporter.answer(Deadline.after(30))
    found = {(s.name, frozenset(s.labels.items())) for family in answer.families for s in family.samples}
    written = [s.value for s in answer.families[-1].samples if s.name == "mig_exporter_scrape_series"]
    assert written == [len(found)], (written, len(found))  # every sample is a series of its own
    return found


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


def churn(shape: Shape, setting: str) -> Churn:
    base = snapshot_of(shape)
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    first = 0
    for epoch in range(DAY_MINUTES // TURNOVER_MINUTES):
        found = series_of(with_new_pids(base, epoch), setting)
        first = first or len(found)
        seen |= found
    return Churn(setting, first, len(seen))


def slope(points: Iterable[tuple[float, float]]) -> float:
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys).slope


def growth(setting: str) -> dict[str, float]:
    def points(shapes: Iterable[Shape], x: str) -> list[tuple[float, float]]:
        return [(getattr(shape, x), len(series_of(snapshot_of(shape), setting))) for shape in shapes]

    return {
        # Processes on 8 cards x 7 MIG instances: 0 to 16 on each of the 56 devices.
        "per_process_in_mig": slope(points((Shape("g", 8, 7, p) for p in (0, 2, 4, 8, 16)), "processes")),
        # MIG instances on 8 cards, 1 to 7 each, no process.
        "per_mig_instance": slope(points((Shape("g", 8, i, 0) for i in (1, 2, 4, 7)), "devices")),
        # Whole cards, no process: a card's own series and its one device's.
        "per_whole_card": slope(points((Shape("g", c, 0, 0) for c in (1, 2, 4, 8)), "cards")),
    }


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
    figures: dict[str, object] = {}

    print("Series per node, one /metrics answer (= scrape_samples_scraped = mig_exporter_scrape_series)")
    print(f"| scenario  | shape                        | {' | '.join(f'{s:>6}' for s in SETTINGS)} | dcgm-exporter |")
    print(f"|-----------|------------------------------|{'|'.join('-------:' for _ in SETTINGS)}|--------------:|")
    counts: dict[str, dict[str, int]] = {}
    for shape in (SINGLE, BIG_WHOLE, BIG_MIG):
        snapshot = snapshot_of(shape)
        counts[shape.name] = {s: len(series_of(snapshot, s)) for s in SETTINGS}
        dcgm = dcgm_series(shape)
        counts[shape.name]["dcgm-exporter"] = dcgm
        print(f"| {shape.name:<9} | {shape.describe():<28} | "
              f"{' | '.join(f'{counts[shape.name][s]:>6}' for s in SETTINGS)} | {dcgm:>13} |")
    figures["series_per_node"] = counts

    print("\nGrowth: least-squares series per process (8 cards x 7 MIG, 0-16 a device), per MIG instance "
          "(8 cards, 1-7 instances, no process) and per whole card (no process)")
    grown = {s: growth(s) for s in SETTINGS}
    for s in SETTINGS:
        g = grown[s]
        print(f"  {s:>6}: {g['per_process_in_mig']:.2f} per process, {g['per_mig_instance']:.2f} per MIG instance, "
              f"{g['per_whole_card']:.2f} per whole card")
    figures["growth"] = grown

    print(f"\nChurn: a day on a big-mig node, each instance's processes replaced every {TURNOVER_MINUTES} minutes "
          f"({DAY_MINUTES // TURNOVER_MINUTES} turnovers, {BIG_MIG.processes} processes each)")
    print("| setting | series per scrape | distinct series in a day | new series an hour |")
    print("|---------|------------------:|-------------------------:|-------------------:|")
    churned = {}
    for s in SETTINGS:
        c = churn(BIG_MIG, s)
        churned[s] = {"per_scrape": c.per_scrape, "distinct_in_a_day": c.distinct_in_a_day,
                      "new_per_hour": c.new_per_hour}
        print(f"| {s:>7} | {c.per_scrape:>17} | {c.distinct_in_a_day:>24} | {c.new_per_hour:>18.0f} |")
    figures["churn_big_mig"] = churned

    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
