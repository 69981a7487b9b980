"""The benchmark: what the exporter costs beyond the driver's own time.

Run from the repository root::

    ./scripts/bench              # installs the bench extra into .venv, then runs this
    python -m benchmarks         # the same, in an environment you set up
    python -m benchmarks --quick # a few iterations: checks that it runs, measures nothing
    python -m benchmarks --profile smi   # cProfile of a big-mig path in process (smi, nvml, nvitop)
    python -m benchmarks --profile serve # py-spy of a serving process, by stage
    python -m benchmarks --check         # exit 1 when a target is missed
    python -m benchmarks --podresources  # only the pod-resources decoding table
    python -m benchmarks --fleet         # only the fleet: a real Prometheus scraping 50 exporters (fleet.py)

For each scenario (benchmarks/scenarios.py) it measures, as medians over
repeated runs:

- parse: ``nvidia-smi -q -x`` and ``-L`` bytes to the snapshot (parse, join, placement);
- collect+render: the snapshot to the exposition Prometheus asks for;
- the scrape through HTTP: ``mig-exporter serve`` in a process of its own,
  reading a fake ``nvidia-smi`` that only writes the files, scraped with
  Prometheus' own headers; the fake alone is run in the same loop, and the
  difference is the exporter's overhead; then the serving process's peak RSS;
- the NVML path on the same machine through tests/fake_nvml.py, next to
  nvitop-exporter's update of the same devices on the same fake library;
- how the cost grows with processes and instances;
- the kubelet's pod-resources answer decoded by our decoder, before and
  after its rework, and by protobuf's generated stubs (benchmarks/podresources.py).

- the /proc scan of 5000 processes, and whether a scrape waits for it (benchmarks/procscan.py);
- the NVML path through a fake libnvidia-ml.so.1 in C, where benchmarks/nvml_lib.py is present.

Then it checks the targets of issue 17 and prints PASS, MISS or "not measured" for each;
``--runs N`` measures N times and puts the runs side by side, ``--json PATH`` writes the
figures that ``python -m benchmarks.plot`` draws.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import http.client
import importlib.util
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks import fleet, podresources, procscan, scenarios, series
from benchmarks.scenarios import BIG_MIG, BIG_WHOLE, MAIN_SHAPES, SINGLE, Shape
from benchmarks.serving import (
    PROMETHEUS_ACCEPT,
    PROMETHEUS_HEADERS,
    Scrape,
    cpu_seconds,
    start_server,
    stop_server,
    vm_hwm_mib,
    write_fake_nvidia_smi,
)
from benchmarks.tables import f, machine, table
from mig_exporter.kubernetes.podresources import DEFAULT_SOCKET
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi

# The targets of issue 17, on this 2-core machine at a quiet moment (docs/performance.md#targets).
TARGET_OVERHEAD_BIG_MIG_MS = 8.0
# Issue 26 let card health cost at most 15% more server CPU than the 8.5 ms median before it, and
# peak RSS up to 45 MiB (docs/performance.md#issue-26-card-health).
TARGET_SERVER_CPU_BIG_MIG_MS = 9.8
TARGET_OVERHEAD_BIG_WHOLE_MS = 7.0
TARGET_OVERHEAD_SINGLE_MS = 1.5
TARGET_PEAK_RSS_MIB = 45.0
TARGET_SLOPE_PER_PROCESS_US = 8.0
TARGET_SLOPE_PER_INSTANCE_US = 25.0
TARGET_PROC_SCAN_MS = 10.0
# "Off the critical path": a 5000-process /proc may add at most this to a single-card scrape's p50
# over a 50-process one, behind a fake nvidia-smi whose -q -x takes 100 ms (procscan.QUERY_S).
TARGET_PROC_SCAN_ADDED_MS = 1.0
TARGET_NVML_LIB_OVERHEAD_MS = 3.0
TARGET_NVML_LIB_RATIO = 0.2
# benchmarks/nvml_lib.py (the NVML path through a fake libnvidia-ml.so.1 in C), where present:
# measure(quick, figures) -> str, its table, filling ``figures`` with "<scenario>.<figure>" keys. The library
# answers in nanoseconds, so the serving process's CPU per scrape is all the exporter's own.
NVML_LIB_OVERHEAD_KEY = "big-mig.cpu_per_scrape_ms"
NVML_LIB_RATIO_KEY = "big-mig.ratio_cpu"
CHANGING = "big-mig, every value new"

PROCESS_SCALING = (
    Shape("1x7x16", 1, 7, 16),
    Shape("2x7x16", 2, 7, 16),
    Shape("4x7x16", 4, 7, 16),
    Shape("8x7x16", 8, 7, 16),
    Shape("8x7x32", 8, 7, 32),
)
INSTANCE_SCALING = (
    Shape("1x7x0", 1, 7, 0),
    Shape("2x7x0", 2, 7, 0),
    Shape("4x7x0", 4, 7, 0),
    Shape("8x7x0", 8, 7, 0),
)


@dataclass(frozen=True)
class Settings:
    quick: bool
    reps_in_process: int
    reps_http: int
    reps_nvml: int
    reps_scaling: int
    reps_podresources: int
    warmup: int

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if quick:
            return cls(True, 3, 3, 2, 2, 3, 1)
        return cls(False, 50, 100, 25, 25, 100, 3)

    def http_reps(self, shape: Shape) -> int:
        # A small scrape is quick and its overhead a small difference of two
        # noisy times: more of them.
        return self.reps_http * (3 if shape.processes < 100 and not self.quick else 1)


# -- small helpers ---------------------------------------------------------------


def median_ms(samples_ns: Iterable[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def p90_ms(samples_ns: list[int]) -> float:
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] / 1e6


def timed(fn: Callable[[], object], reps: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return out


class _Families:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> list:
        return self._families


def render(families: list, accept: str) -> bytes:
    """Render as the server does for this Accept header."""
    try:
        from mig_exporter.metrics.exposition import render as fast_render
    except ImportError:  # before the exporter had its own encoder
        from prometheus_client.exposition import choose_encoder

        encoder, _ = choose_encoder(accept)
        return encoder(_Families(families))
    return fast_render(families, accept)[0]


class _SnapshotSource:
    name = "nvidia-smi"


def families_of(snapshot) -> list:
    return list(Scraper(_SnapshotSource()).families_for(ReadOutcome(snapshot, 0.001)))


def count_lines(body: bytes, prefix: bytes) -> int:
    return sum(1 for line in body.splitlines() if line.startswith(prefix))


# -- results ---------------------------------------------------------------------


@dataclass
class SmiResult:
    shape: Shape
    xml_kib: float
    parse_ms: float
    render_ms: float
    body_kib: float
    scrape_ms: float = float("nan")
    scrape_p90_ms: float = float("nan")
    fake_ms: float = float("nan")
    overhead_ms: float = float("nan")
    server_cpu_ms: float = float("nan")
    peak_rss_mib: float | None = None
    parse_kept_ms: float = float("nan")  # the same bytes again, through the source's memo
    label: str = ""  # the row's name, where not the shape's


@dataclass
class NvmlResult:
    shape: Shape
    read_ms: float
    scrape_ms: float
    nvitop_update_ms: float | None = None
    nvitop_render_ms: float | None = None
    nvitop_series: int | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.nvitop_update_ms is None else self.scrape_ms / self.nvitop_update_ms


@dataclass
class ScalingRow:
    shape: Shape
    xml_kib: float
    parse_ms: float
    render_ms: float
    nvml_ms: float


@dataclass
class Results:
    smi: dict[str, SmiResult] = field(default_factory=dict)
    nvml: dict[str, NvmlResult] = field(default_factory=dict)
    process_scaling: list[ScalingRow] = field(default_factory=list)
    instance_scaling: list[ScalingRow] = field(default_factory=list)
    podresources: podresources.DecodeResults | None = None
    procscan: procscan.Results | None = None
    nvml_lib_text: str | None = None  # benchmarks/nvml_lib.py's report, where that module is present
    nvml_lib_figures: dict | None = None
    load_before: float = float("nan")
    load_after: float = float("nan")


# -- nvidia-smi path: in process ---------------------------------------------------


def measure_in_process(shape: Shape, xml: bytes, listing: bytes, s: Settings) -> SmiResult:
    snapshot = snapshot_from_smi(xml, listing)
    assert len(snapshot.processes) == shape.processes, (shape, len(snapshot.processes))
    parse = timed(lambda: snapshot_from_smi(xml, listing), s.reps_in_process, s.warmup)
    # The same bytes again through one memo, as a source reads them: nothing has changed since its last read.
    memo = ReadMemo()
    assert snapshot_from_smi(xml, listing, None, memo) == snapshot
    kept = timed(lambda: snapshot_from_smi(xml, listing, None, memo), s.reps_in_process, s.warmup)
    body = render(families_of(snapshot), PROMETHEUS_ACCEPT)
    assert count_lines(body, b"mig_exporter_process_memory_used_bytes{") == shape.processes
    rendering = timed(lambda: render(families_of(snapshot), PROMETHEUS_ACCEPT), s.reps_in_process, s.warmup)
    return SmiResult(shape, len(xml) / 1024, median_ms(parse), median_ms(rendering), len(body) / 1024,
                     parse_kept_ms=median_ms(kept))


# Consecutive reads of the "every value new" row share no process list, MIG device or memory figure.
CHANGING_VARIANTS = 3
_USED = re.compile(rb"<(used_memory|used)>(\d+) MiB<")


def changing(xml: bytes, variants: int = CHANGING_VARIANTS) -> list[bytes]:
    """``xml`` ``variants`` times over, the k-th with every used memory figure (each process's, each MIG
    device's and card's) k MiB higher: read in turn, no section is the one the last read had, so the
    source's memo never serves one (nvidia_smi/build.py) and the parse is the whole parse."""
    return [_USED.sub(lambda m, k=k: b"<%s>%d MiB<" % (m.group(1), int(m.group(2)) + k), xml)
            for k in range(variants)]


# -- nvidia-smi path: through HTTP -------------------------------------------------


def run_fake_alone(fake: Path) -> None:
    """Both runs the exporter makes, in parallel as it makes them, and nothing else."""
    listing = subprocess.Popen([str(fake), "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    query = subprocess.Popen([str(fake), "-q", "-x"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    query.stdout.read()
    query.wait()
    listing.stdout.read()
    listing.wait()
    query.stdout.close()
    listing.stdout.close()


def measure_http(result: SmiResult, xml: bytes | list[bytes], listing: bytes, s: Settings) -> None:
    shape = result.shape
    with tempfile.TemporaryDirectory(prefix=f"mig-bench-{shape.name}-") as tmp:
        fake = write_fake_nvidia_smi(Path(tmp), xml, listing, pmon=scenarios.pmon(shape))
        proc, port = start_server(fake)
        try:
            scrape = Scrape(port)
            for _ in range(s.warmup):
                run_fake_alone(fake)
                scrape()
            fake_ns, scrape_ns = [], []
            last = b""
            cpu_before = cpu_seconds(proc.pid)
            for _ in range(s.http_reps(shape)):
                t = time.perf_counter_ns()
                run_fake_alone(fake)
                fake_ns.append(time.perf_counter_ns() - t)
                t = time.perf_counter_ns()
                last, _ = scrape.raw()
                scrape_ns.append(time.perf_counter_ns() - t)
            server_cpu_s = cpu_seconds(proc.pid) - cpu_before
            scrape.close()
            body = gzip.decompress(last)
            if b'mig_exporter_read_success{source="nvidia-smi"} 1.0' not in body:
                raise RuntimeError(f"{shape.name}: the scrape did not read the fake nvidia-smi")
            if count_lines(body, b"mig_exporter_process_memory_used_bytes{") != shape.processes:
                raise RuntimeError(f"{shape.name}: the scrape lacks processes")
            result.peak_rss_mib = vm_hwm_mib(proc.pid)
        finally:
            stop_server(proc)
    result.scrape_ms = median_ms(scrape_ns)
    result.scrape_p90_ms = p90_ms(scrape_ns)
    result.fake_ms = median_ms(fake_ns)
    result.overhead_ms = result.scrape_ms - result.fake_ms
    result.server_cpu_ms = server_cpu_s * 1000 / s.http_reps(shape)


# -- NVML path -----------------------------------------------------------------------


class NvmlBench:
    """One fake libnvidia-ml for the whole run (nvitop initialises NVML once
    per process), given each scenario in turn."""

    def __init__(self) -> None:
        from fake_nvml import FakeNvml

        self.fake = FakeNvml(scenarios.nvml_scenario(SINGLE)).install()
        try:
            import nvitop_exporter  # noqa: F401 - only whether it imports

            self.nvitop_error: str | None = None
        except ImportError as e:
            self.nvitop_error = f"nvitop-exporter not installed ({e.name}); pip install '.[bench]'"

    def ours(self, shape: Shape) -> tuple[Callable[[], bytes], Callable[[], object]]:
        from mig_exporter.sources.nvml import NvmlSource

        source = NvmlSource()
        scraper = Scraper(source)

        def scrape() -> bytes:
            self.fake.calls.clear()  # the fake records every call; keep it from growing
            return render(scraper.families(), PROMETHEUS_ACCEPT)

        def read() -> object:
            self.fake.calls.clear()
            return source.read()

        return scrape, read

    def theirs(self, shape: Shape) -> tuple[Callable[[], None], Callable[[], bytes], int]:
        from nvitop import Device
        from nvitop_exporter.exporter import PrometheusExporter
        from prometheus_client import CollectorRegistry, generate_latest

        # As nvitop-exporter's main() builds its list: the cards and their MIG devices.
        physical = Device.from_indices(range(Device.count()))
        migs = [m for d in physical for m in d.mig_devices()]
        devices = sorted(physical + migs, key=lambda d: (d.index,) if isinstance(d.index, int) else d.index)
        registry = CollectorRegistry(auto_describe=False)
        exporter = PrometheusExporter(devices, hostname="bench", registry=registry)

        def update() -> None:
            self.fake.calls.clear()
            for device in devices:  # PrometheusExporter.collect()'s loop body, less update_host()
                exporter.update_device(device)

        return update, lambda: generate_latest(registry), len(devices)

    def measure(self, shape: Shape, s: Settings) -> NvmlResult:
        self.fake.set_scenario(scenarios.nvml_scenario(shape))
        scrape, read = self.ours(shape)
        body = scrape()
        if count_lines(body, b"mig_exporter_process_memory_used_bytes{") != shape.processes:
            raise RuntimeError(f"{shape.name}: the NVML scrape lacks processes")
        if self.nvitop_error:
            scrape_ns = timed(scrape, s.reps_nvml, s.warmup)
            read_ns = timed(read, s.reps_nvml, s.warmup)
            return NvmlResult(shape, median_ms(read_ns), median_ms(scrape_ns), note=self.nvitop_error)
        update, their_render, n_devices = self.theirs(shape)
        for _ in range(s.warmup):
            scrape()
            update()
        # Interleaved, so a busy moment of the machine falls on both alike.
        ours_ns, theirs_ns, read_ns, their_render_ns = [], [], [], []
        for _ in range(s.reps_nvml):
            t = time.perf_counter_ns()
            scrape()
            ours_ns.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            update()
            theirs_ns.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            read()
            read_ns.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            text = their_render()
            their_render_ns.append(time.perf_counter_ns() - t)
        if self.fake.exceptions:
            raise RuntimeError(f"the fake NVML raised: {self.fake.exceptions[:3]}")
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        return NvmlResult(shape, median_ms(read_ns), median_ms(ours_ns), median_ms(theirs_ns),
                          median_ms(their_render_ns), series, note=f"{n_devices} nvitop devices")


# -- scaling ---------------------------------------------------------------------------


def measure_scaling(shapes: Iterable[Shape], nvml: NvmlBench, s: Settings) -> list[ScalingRow]:
    """Round robin over the shapes, so a busy moment of the machine falls on all of them alike; this
    process's CPU time (every thread of it, NVML's read included), which other work on the machine
    stretches far less than wall time, so the slopes hold on a busy machine."""
    shapes = list(shapes)
    inputs = []
    for shape in shapes:
        xml, listing = scenarios.query_xml(shape), scenarios.listing(shape)
        snapshot = snapshot_from_smi(xml, listing)
        if len(snapshot.processes) != shape.processes:
            raise RuntimeError(f"{shape.name}: the snapshot lacks processes")
        inputs.append((xml, listing, snapshot, scenarios.nvml_scenario(shape)))
    parse: list[list[int]] = [[] for _ in shapes]
    rendering: list[list[int]] = [[] for _ in shapes]
    nvml_ns: list[list[int]] = [[] for _ in shapes]
    for rep in range(s.reps_scaling + 1):  # the first round warms up
        for i, (shape, (xml, listing, snapshot, fake_scenario)) in enumerate(zip(shapes, inputs, strict=True)):
            t = time.process_time_ns()
            snapshot_from_smi(xml, listing)
            t1 = time.process_time_ns()
            render(families_of(snapshot), PROMETHEUS_ACCEPT)
            t2 = time.process_time_ns()
            nvml.fake.set_scenario(fake_scenario)
            scrape, _ = nvml.ours(shape)
            t3 = time.process_time_ns()
            scrape()
            t4 = time.process_time_ns()
            if rep:
                parse[i].append(t1 - t)
                rendering[i].append(t2 - t1)
                nvml_ns[i].append(t4 - t3)
    return [ScalingRow(shape, len(xml) / 1024, median_ms(p), median_ms(r), median_ms(n))
            for shape, (xml, *_), p, r, n in zip(shapes, inputs, parse, rendering, nvml_ns, strict=True)]


# -- output ----------------------------------------------------------------------------


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Slope, intercept and R^2 of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot else 1.0


SCALING = (("process", "processes"), ("instance", "devices"))


def scaling_rows(results: Results, unit: str) -> list[ScalingRow]:
    return results.process_scaling if unit == "process" else results.instance_scaling


def fit(rows: list[ScalingRow], per: str, label: str) -> tuple[float, float, float] | None:
    """The least-squares line of ``label`` (smi total or NVML scrape, ms) against ``per``."""
    if len(rows) < 2:
        return None
    values = [r.parse_ms + r.render_ms if label == "smi total" else r.nvml_ms for r in rows]
    return linear_fit([getattr(r.shape, per) for r in rows], values)


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None  # None: not measured in this run
    limit: float
    unit: str

    @property
    def verdict(self) -> str:
        if self.value is None or self.value != self.value:
            return "not measured"
        return "PASS" if self.value <= self.limit else "MISS"


def targets(results: Results) -> list[Target]:
    """Issue 17's targets and this run's figure for each."""
    def smi(name: str, attribute: str) -> float | None:
        result = results.smi.get(name)
        return None if result is None else getattr(result, attribute)

    def slope_us(unit: str) -> float | None:
        per = dict(SCALING)[unit]
        line = fit(scaling_rows(results, unit), per, "smi total")
        return None if line is None else line[0] * 1000

    # The three scenarios' servers, as the target is set (the every-value-new row is shown, not judged).
    rss = [r.peak_rss_mib for name, r in results.smi.items() if name != CHANGING and r.peak_rss_mib is not None]
    scan = results.procscan
    lib = results.nvml_lib_figures or {}
    return [
        Target("overhead p50, big-mig", smi(BIG_MIG.name, "overhead_ms"), TARGET_OVERHEAD_BIG_MIG_MS, "ms"),
        Target("server CPU per scrape, big-mig", smi(BIG_MIG.name, "server_cpu_ms"), TARGET_SERVER_CPU_BIG_MIG_MS,
               "ms"),
        Target("overhead p50, big-whole", smi(BIG_WHOLE.name, "overhead_ms"), TARGET_OVERHEAD_BIG_WHOLE_MS, "ms"),
        Target("overhead p50, single", smi(SINGLE.name, "overhead_ms"), TARGET_OVERHEAD_SINGLE_MS, "ms"),
        Target("peak RSS of the serving process", max(rss) if rss else None, TARGET_PEAK_RSS_MIB, "MiB"),
        Target("smi total slope per process", slope_us("process"), TARGET_SLOPE_PER_PROCESS_US, "us"),
        Target("smi total slope per MIG instance", slope_us("instance"), TARGET_SLOPE_PER_INSTANCE_US, "us"),
        Target("/proc scan of 5000, warm p50", scan and scan.read.warm_ms, TARGET_PROC_SCAN_MS, "ms"),
        Target("/proc 5000 vs 50: scrape p50 added", scan and scan.scrape and scan.scrape.added_ms,
               TARGET_PROC_SCAN_ADDED_MS, "ms"),
        Target("NVML via C library: CPU per scrape, big-mig", lib.get(NVML_LIB_OVERHEAD_KEY),
               TARGET_NVML_LIB_OVERHEAD_MS, "ms"),
        Target("NVML via C library: / nvitop update CPU", lib.get(NVML_LIB_RATIO_KEY), TARGET_NVML_LIB_RATIO, "x"),
    ]


def targets_table(rows: list[Target]) -> str:
    return table(["target", "measured", "limit", "verdict"],
                 [[t.name, f(t.value), f"<= {t.limit:g} {t.unit}", t.verdict] for t in rows])


def report(results: Results, s: Settings, started: float) -> str:
    out = []
    out.append(f"machine: {machine()}")
    out.append(f"load average before/after: {results.load_before:.2f} / {results.load_after:.2f}; "
               f"medians of {s.reps_in_process} (in process), {s.reps_http} (HTTP; 3x for single), "
               f"{s.reps_nvml} (NVML), {s.reps_scaling} (scaling) runs"
               + ("; QUICK MODE: a smoke run, not a measurement" if s.quick else ""))
    out.append("serve runs as start_server starts it: --source nvidia-smi on the fake, every engine preset on "
               f"(no --config.file; /proc here: {host_processes()} processes), Kubernetes on (the default socket "
               f"{DEFAULT_SOCKET}, {'present' if os.path.exists(DEFAULT_SOCKET) else 'absent here'}; kubelet log "
               "names read only for containerised processes, none here), owners from each GPU pid's cgroup "
               "(the scenarios' pids are not live: each open fails), no Slurm job map")
    out.append("")
    out.append("nvidia-smi path (ms, p50; overhead = HTTP scrape - fake nvidia-smi alone; "
               "server CPU = the serving process's CPU time per scrape, mean)")
    out.append(table(
        ["scenario", "shape", "xml KiB", "parse", "parse, unchanged", "collect+render", "HTTP scrape", "p90",
         "fake alone", "overhead", "server CPU", "peak RSS MiB"],
        [[r.label or r.shape.name, r.shape.describe(), f(r.xml_kib, 0), f(r.parse_ms), f(r.parse_kept_ms),
          f(r.render_ms), f(r.scrape_ms), f(r.scrape_p90_ms), f(r.fake_ms), f(r.overhead_ms), f(r.server_cpu_ms),
          f(r.peak_rss_mib, 1)]
         for r in results.smi.values()],
    ))
    out.append("  parse = every section read (nothing kept); parse, unchanged = the same report again through the "
               "source's memo (sections, -L and placement kept: what the HTTP rows serve, the fake writing the same "
               f"report each time); {CHANGING}: the fake writes {CHANGING_VARIANTS} reports in turn, each with "
               "every used memory figure changed, so the memo serves nothing")
    out.append("")
    out.append("NVML path through the fake libnvidia-ml (ms, p50; ratio = our scrape / nvitop-exporter's update)")
    out.append(table(
        ["scenario", "our read", "our scrape", "nvitop update", "nvitop render", "nvitop series", "ratio"],
        [[r.shape.name, f(r.read_ms), f(r.scrape_ms), f(r.nvitop_update_ms), f(r.nvitop_render_ms),
          str(r.nvitop_series) if r.nvitop_series is not None else "n/a",
          f(r.ratio) if r.ratio is not None else r.note] for r in results.nvml.values()],
    ))
    for unit, per in SCALING:
        rows = scaling_rows(results, unit)
        title = ("scaling with processes (MIG, 16 or 32 per instance)" if unit == "process"
                 else "scaling with instances (no processes)")
        shown = "device" if unit == "instance" else unit
        out.append("")
        out.append(f"{title} (ms of this process's CPU, p50; per {shown} = smi total / {per}, us)")
        body = []
        for row in rows:
            total = row.parse_ms + row.render_ms
            count = getattr(row.shape, per)
            body.append([row.shape.name, str(row.shape.devices), str(row.shape.processes), f(row.xml_kib, 0),
                         f(row.parse_ms), f(row.render_ms), f(total), f(total * 1000 / count, 1), f(row.nvml_ms)])
        out.append(table(["shape", "devices", "processes", "xml KiB", "parse", "collect+render", "smi total",
                          f"per {shown}", "NVML scrape"], body))
        for label in ("smi total", "NVML scrape"):
            line = fit(rows, per, label)
            if line is not None:
                slope, intercept, r2 = line
                out.append(f"  {label}: least-squares line {slope * 1000:.1f} us per {shown} {intercept:+.2f} ms, "
                           f"R^2 = {r2:.3f}")

    if results.procscan is not None:
        out.append("")
        out.extend(procscan.report(results.procscan))
    out.append("")
    out.append("NVML through a fake libnvidia-ml.so.1 in C (benchmarks/nvml_lib.py)")
    out.append(results.nvml_lib_text if results.nvml_lib_text is not None
               else "not measured: benchmarks/nvml_lib.py is absent in this tree")
    if results.podresources is not None:
        out.append("")
        out.extend(podresources.report(results.podresources))
    out.append("")
    out.append(f"benchmark wall time: {time.monotonic() - started:.0f}s")
    return "\n".join(out)


def host_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def figures(results: Results, s: Settings) -> dict:
    """The run as JSON (--json): what benchmarks/plot.py draws, and the targets."""
    def scaling(unit: str) -> dict:
        per = dict(SCALING)[unit]
        rows = scaling_rows(results, unit)
        fits = {}
        for label in ("smi total", "NVML scrape"):
            line = fit(rows, per, label)
            if line is not None:
                fits[label] = {"slope_us": line[0] * 1000, "intercept_ms": line[1], "r2": line[2]}
        return {"per": per, "points": [
            {"shape": r.shape.name, "devices": r.shape.devices, "processes": r.shape.processes,
             "xml_kib": r.xml_kib, "parse_ms": r.parse_ms, "render_ms": r.render_ms,
             "total_ms": r.parse_ms + r.render_ms, "nvml_ms": r.nvml_ms} for r in rows], "fits": fits}

    def clean(value: object) -> object:  # NaN is not JSON
        return None if isinstance(value, float) and value != value else value

    return {
        "machine": machine(),
        "quick": s.quick,
        "load_average": {"before": results.load_before, "after": results.load_after},
        "smi": {name: {k: clean(v) for k, v in vars(r).items() if k != "shape"} for name, r in results.smi.items()},
        "nvml": {name: {"read_ms": r.read_ms, "scrape_ms": r.scrape_ms, "nvitop_update_ms": r.nvitop_update_ms,
                        "ratio": r.ratio} for name, r in results.nvml.items()},
        "process_scaling": scaling("process"),
        "instance_scaling": scaling("instance"),
        "procscan": procscan.figures(results.procscan) if results.procscan else None,
        "nvml_lib": results.nvml_lib_figures,
        "targets": [{"name": t.name, "value": clean(t.value), "limit": t.limit, "unit": t.unit,
                     "verdict": t.verdict} for t in targets(results)],
    }


def runs_table(runs: list[Results]) -> tuple[str, list[Target]]:
    """Each run's figure per target, side by side with the run's load average, and the targets
    judged on the median of the runs."""
    per_run = [targets(r) for r in runs]
    medians = []
    for i, first in enumerate(per_run[0]):
        values = [t[i].value for t in per_run if t[i].value is not None and t[i].value == t[i].value]
        medians.append(Target(first.name, statistics.median(values) if values else None, first.limit, first.unit))
    headers = ["figure", *(f"run {n}" for n in range(1, len(runs) + 1)), "median", "limit", "verdict"]
    rows = [["load average (1 min) before/after", *(f"{r.load_before:.2f}/{r.load_after:.2f}" for r in runs),
             "", "", ""]]
    for i, m in enumerate(medians):
        rows.append([m.name, *(f(t[i].value) for t in per_run), f(m.value), f"<= {m.limit:g} {m.unit}", m.verdict])
    return table(headers, rows), medians


# -- profile ---------------------------------------------------------------------------


def profile(path: str, reps: int) -> str:
    shape = BIG_MIG
    profiler = cProfile.Profile()
    if path == "smi":
        xml, listing = scenarios.query_xml(shape), scenarios.listing(shape)
        work = lambda: render(families_of(snapshot_from_smi(xml, listing)), PROMETHEUS_ACCEPT)  # noqa: E731
    else:
        nvml = NvmlBench()
        if path == "nvitop" and nvml.nvitop_error:
            return nvml.nvitop_error
        nvml.fake.set_scenario(scenarios.nvml_scenario(shape))
        if path == "nvml":
            from mig_exporter.sources.nvml import NvmlSource

            source = NvmlSource()  # read: in this thread, where cProfile sees it

            def work() -> bytes:
                nvml.fake.calls.clear()
                return render(families_of(source.read()), PROMETHEUS_ACCEPT)
        else:
            work = nvml.theirs(shape)[0]
    work()
    profiler.enable()
    for _ in range(reps):
        work()
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(25)
    return f"cProfile of {reps} {path} scrapes of {shape.name}, by own time:\n{stream.getvalue()}"


# Where a scrape's time goes in the serving process, by the function each stage runs.
SERVE_STAGES = (
    ("whole /metrics answer", "_Handler._metrics"),
    ("  read: nvidia-smi runs, parse, placement", "NvidiaSmiSource.read"),
    ("    run the two commands (spawn, pipes, wait)", "run_command"),
    ("    parse -q -x (lxml and our reading)", "parse_query_xml"),
    ("      lxml's own parse", "parse_query_xml (mig_exporter/nvidia_smi/query_xml.py:{fromstring})"),
    ("    -L and its join", "apply_listing"),
    ("    placement", "place"),
    ("  collect: snapshot to families", "Scraper.families_for"),
    ("    prometheus_client's add_metric", "GaugeMetricFamily.add_metric"),
    ("  render: families to OpenMetrics", "render|generate_latest"),  # ours; prometheus_client's before it
    ("  gzip", "compress"),
)


def profile_serve(seconds: float) -> str:
    """py-spy on a ``mig-exporter serve`` process while it is scraped (big-mig)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return "py-spy not installed; pip install '.[bench]'"
    import mig_exporter.nvidia_smi.query_xml as smi_xml

    fromstring_line = next(i for i, line in enumerate(Path(smi_xml.__file__).read_text().splitlines(), 1)
                           if "etree.fromstring(" in line)
    shape = BIG_MIG
    xml, listing = scenarios.query_xml(shape), scenarios.listing(shape)
    with tempfile.TemporaryDirectory(prefix="mig-bench-spy-") as tmp:
        fake = write_fake_nvidia_smi(Path(tmp), xml, listing)
        raw = Path(tmp) / "stacks.txt"
        proc, port = start_server(fake)
        try:
            recorder = subprocess.Popen(
                [str(spy), "record", "--pid", str(proc.pid), "--duration", str(int(seconds)), "--rate", "500",
                 "--format", "raw", "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(1)  # py-spy attaches
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            scrapes = 0
            end = time.monotonic() + seconds - 1.5
            while time.monotonic() < end:
                conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
                conn.getresponse().read()
                scrapes += 1
            conn.close()
            _, err = recorder.communicate(timeout=seconds + 30)
            if not raw.exists():
                return f"py-spy recorded nothing: {err.strip()[-500:]}"
            counts = {name: 0 for _, name in SERVE_STAGES}
            total = 0
            for line in raw.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                frames = set(stack.split(";"))
                total += int(n)
                names = {frame.split(" (")[0] for frame in frames}
                for _, name in SERVE_STAGES:
                    if "{fromstring}" in name:
                        hit = any(frame.startswith("parse_query_xml (") and frame.endswith(f":{fromstring_line})")
                                  for frame in frames)
                    else:
                        hit = any(alternative in names for alternative in name.split("|"))
                    counts[name] += int(n) if hit else 0
        finally:
            stop_server(proc)
    whole = counts[SERVE_STAGES[0][1]] or 1
    rows = [[label, f"{100 * counts[name] / whole:.1f}"] for label, name in SERVE_STAGES]
    return (f"py-spy of mig-exporter serve, {scrapes} scrapes of {shape.name} with Prometheus' headers, "
            f"{total} samples at 500 Hz; share of the /metrics answer:\n" + table(["stage", "% of answer"], rows))


# -- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few iterations: check that it runs")
    parser.add_argument("--profile", choices=["smi", "nvml", "nvitop", "serve"],
                        help="profile one path on big-mig and exit: cProfile of the nvidia-smi path, our NVML "
                             "path or nvitop-exporter's update in process; py-spy of a serving process (serve)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target is missed or not measured (judged on the median of --runs)")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="measure N times and print each run's key figures with its load average in one table")
    parser.add_argument("--json", metavar="PATH", help="write the (last) run's figures as JSON, for benchmarks/plot.py")
    parser.add_argument("--podresources", action="store_true",
                        help="only the pod-resources decoding: ours before and after, and protobuf's")
    parser.add_argument("--series", action="store_true",
                        help="only count the series a node exports and their churn (benchmarks/series.py; no timing)")
    parser.add_argument("--fleet", action="store_true",
                        help="only the fleet (benchmarks/fleet.py): N exporters of big-mig with job turnover, one real "
                             "Prometheus scraping them, for each --collector.processes mode (~35 minutes; --quick: ~1)")
    parser.add_argument("--fleet-nodes", type=int, metavar="N", help="exporters in the fleet (default 50; quick 5)")
    parser.add_argument("--fleet-minutes", type=float, metavar="M",
                        help="minutes each mode runs after every target's first scrape (default 10; quick 0.15)")
    parser.add_argument("--fleet-turnover", type=int, metavar="S",
                        help="seconds between a node's job turnovers, its processes all replaced (default 600; "
                             "quick 5)")
    parser.add_argument("--fleet-picture", metavar="PATH",
                        help="where the fleet's picture goes (default docs/images/fleet.png; none with --quick)")
    args = parser.parse_args(argv)
    if args.series:
        return series.main(["--json", args.json] if args.json else [])
    if args.fleet:
        return fleet.main(args.quick, args.fleet_nodes, args.fleet_minutes, args.fleet_turnover, args.json,
                          args.fleet_picture)
    settings = Settings.make(args.quick)
    if args.podresources:
        load_before = os.getloadavg()
        decoded = podresources.measure(settings.reps_podresources, settings.warmup)
        print(f"machine: {machine()}")
        print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}"
              + ("; QUICK MODE: a smoke run, not a measurement" if settings.quick else ""))
        print("\n".join(["", *podresources.report(decoded)]))
        return 0
    if args.profile == "serve":
        print(profile_serve(4 if args.quick else 10))
        return 0
    if args.profile:
        print(profile(args.profile, 3 if args.quick else 20))
        return 0

    runs = []
    nvml = NvmlBench()  # once: the fake library stays installed for the process (nvitop initialises once)
    for n in range(args.runs):
        started = time.monotonic()
        results = measure_all(settings, nvml)
        runs.append(results)
        if args.runs > 1:
            print(f"== run {n + 1} of {args.runs}", flush=True)
        print(report(results, settings, started), flush=True)
    if args.runs > 1:
        text, judged = runs_table(runs)
        print(f"\n{args.runs} runs: each run's figure per target, and the targets judged on their median "
              "(issue 17)", flush=True)
        print(text, flush=True)
    else:
        judged = targets(runs[0])
        print("\ntargets (issue 17)")
        print(targets_table(judged), flush=True)
    if args.json:
        data = figures(runs[-1], settings)
        if args.runs > 1:
            data["runs"] = [figures(r, settings)["targets"] for r in runs]
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    missed = [t for t in judged if t.verdict != "PASS"]
    return 1 if args.check and missed and not settings.quick else 0


def measure_all(settings: Settings, nvml: NvmlBench) -> Results:
    results = Results(load_before=os.getloadavg()[0])
    for shape in MAIN_SHAPES:
        xml, listing = scenarios.query_xml(shape), scenarios.listing(shape)
        result = measure_in_process(shape, xml, listing, settings)
        measure_http(result, xml, listing, settings)
        results.smi[shape.name] = result
        print(f"measured {shape.name} (nvidia-smi path)", file=sys.stderr, flush=True)
    # The worst case of the memo: every process's and MIG device's memory changes at every read.
    xml, listing = scenarios.query_xml(BIG_MIG), scenarios.listing(BIG_MIG)
    result = replace(results.smi[BIG_MIG.name], label=CHANGING, scrape_ms=float("nan"), overhead_ms=float("nan"),
                     parse_kept_ms=float("nan"), server_cpu_ms=float("nan"), peak_rss_mib=None)
    measure_http(result, changing(xml), listing, settings)
    results.smi[CHANGING] = result
    print(f"measured {CHANGING} (nvidia-smi path)", file=sys.stderr, flush=True)
    for shape in MAIN_SHAPES:
        results.nvml[shape.name] = nvml.measure(shape, settings)
        print(f"measured {shape.name} (NVML path)", file=sys.stderr, flush=True)
    results.process_scaling = measure_scaling(PROCESS_SCALING, nvml, settings)
    results.instance_scaling = measure_scaling(INSTANCE_SCALING, nvml, settings)
    results.procscan = procscan.measure(settings.quick)
    print("measured the /proc scan", file=sys.stderr, flush=True)
    # benchmarks/nvml_lib.py: absent in a tree without that stage (then "not measured"); where present, an
    # error in it is the benchmark's error.
    if importlib.util.find_spec("benchmarks.nvml_lib") is not None:
        from benchmarks import nvml_lib

        results.nvml_lib_figures = {}
        results.nvml_lib_text = nvml_lib.measure(settings.quick, results.nvml_lib_figures)
        print("measured NVML through the C library", file=sys.stderr, flush=True)
    results.podresources = podresources.measure(settings.reps_podresources, settings.warmup)
    print("measured pod-resources decoding", file=sys.stderr, flush=True)
    results.load_after = os.getloadavg()[0]
    return results


__all__ = ["main"]
