"""A fleet scraped by one real Prometheus: what per-process series cost it, by ``--collector.processes``.

Run from the repository root::

    python -m benchmarks --fleet          # 50 nodes, 10 minutes per mode, 15 s scrape interval (~35 minutes)
    python -m benchmarks --fleet --quick  # 5 nodes, 9 s per mode, 2 s interval: a smoke run, not a measurement
    python -m benchmarks --fleet --fleet-nodes 20 --fleet-minutes 5 --json fleet.json --fleet-picture fleet.png

For each mode (``all``, ``top=3``, ``none``) it starts, afresh:

- ``--fleet-nodes`` exporters (``mig-exporter serve --source nvidia-smi --no-kubernetes``, an empty
  ``--proc.root``, ``--web.listen-address 127.0.0.1:0``), each reading a fake ``nvidia-smi`` of its own:
  a shell script that writes big-mig (benchmarks/scenarios.py: 8 H100 x 7 MIG instances x 16
  processes) with the node's own UUIDs and pids. Job turnover: every ``--fleet-turnover`` seconds
  each node's processes are replaced by new ones (new pids), each node at its own phase so the
  fleet's turnover is spread evenly over time. The pid variants are files written beforehand; the
  script picks one by ``date +%s``, so no Python runs per call;
- Debian's ``/usr/bin/prometheus`` on 127.0.0.1, scraping them all, its TSDB in a temporary directory.

Once every target has been scraped, it runs ``--fleet-minutes`` and reads Prometheus' own /metrics
every interval (head series, series created, resident memory), then its query API
(``scrape_duration_seconds`` and ``scrape_samples_scraped`` of every scrape in the run, each against the
``mig_exporter_scrape_series`` of the same scrape) and ``/api/v1/status/tsdb``. Everything it started is stopped
and its files removed, on an error or Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mig_exporter
from benchmarks import scenarios
from benchmarks.plot import pyplot, save
from benchmarks.serving import cpu_seconds, free_port, stop_server, vm_hwm_mib
from benchmarks.tables import f, machine, table

MODES = ("all", "top=3", "none")
PROMETHEUS = "/usr/bin/prometheus"
HOST = "127.0.0.1"
SHAPE = scenarios.BIG_MIG
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
_PID = re.compile(rb"<pid>(\d+)</pid>")
_UUID = re.compile(rb"\b(GPU|MIG)-[0-9a-f]{8}")


@dataclass(frozen=True)
class Settings:
    nodes: int
    minutes: float
    turnover_s: int
    interval_s: int
    quick: bool

    @classmethod
    def make(cls, quick: bool, nodes: int | None = None, minutes: float | None = None,
             turnover_s: int | None = None) -> Settings:
        if quick:
            return cls(nodes or 5, minutes or 0.15, turnover_s or 5, 2, True)
        return cls(nodes or 50, minutes or 10.0, turnover_s or 600, 15, False)

    @property
    def timeout_s(self) -> int:
        return min(10, self.interval_s)

    @property
    def start_limit_s(self) -> float:
        """How long the exporters may take to start: each is a Python process of its own."""
        return 30.0 + 3.0 * self.nodes

    @property
    def epochs(self) -> int:
        """Pid variants a node needs: one per turnover from its exporter's start to the run's end, every
        wait on the way taken at its bound (should a run outlast them, the last variant stays)."""
        span = self.start_limit_s + 30 + 4 * self.interval_s + self.minutes * 60
        return math.ceil(span / self.turnover_s) + 1


# -- the nodes -----------------------------------------------------------------------


def node_reports(node: int, epochs: int) -> tuple[list[bytes], bytes]:
    """big-mig as node ``node`` writes it, once per epoch: its own GPU and MIG UUIDs (the first eight
    hex digits are the node's), and in epoch ``e`` process ``i`` has pid 100000 + (node x epochs + e)
    x 1000 + i, so no two nodes or epochs share a pid."""
    xml, listing = scenarios.query_xml(SHAPE), scenarios.listing(SHAPE)
    own = f"{node:08x}".encode()

    def ours(data: bytes) -> bytes:
        return _UUID.sub(lambda m: m.group(1) + b"-" + own, data)

    xml = ours(xml)
    reports = []
    for epoch in range(epochs):
        pids = itertools.count(100_000 + (node * epochs + epoch) * 1000)

        def new_pid(_: re.Match[bytes], pids: Iterator[int] = pids) -> bytes:
            return b"<pid>%d</pid>" % next(pids)

        reports.append(_PID.sub(new_pid, xml))
    return reports, ours(listing)


def write_node(directory: Path, node: int, s: Settings) -> Path:
    """The node's files: its pid variants, its -L, an empty /proc and the fake nvidia-smi (written
    for each mode by ``arm``)."""
    directory.mkdir(parents=True)
    (directory / "proc").mkdir()
    reports, listing = node_reports(node, s.epochs)
    for epoch, report in enumerate(reports):
        (directory / f"q{epoch}.xml").write_bytes(report)
    (directory / "L.txt").write_bytes(listing)
    return directory / "nvidia-smi"


def arm(fake: Path, node: int, s: Settings) -> None:
    """The fake nvidia-smi for a mode starting now: ``-q -x`` writes variant 0 until the node's next
    turnover, then 1, ...; the node's phase is node/nodes of a turnover."""
    offset = round(node * s.turnover_s / s.nodes)
    base = (int(time.time()) + offset) // s.turnover_s
    q = shlex.quote(str(fake.parent / "q"))
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  -q) e=$(( ($(date +%s) + {offset}) / {s.turnover_s} - {base} ))\n"
        f"      if [ $e -gt {s.epochs - 1} ]; then e={s.epochs - 1}; fi\n"
        f"      exec cat {q}$e.xml ;;\n"
        f"  -L) exec cat {shlex.quote(str(fake.parent / 'L.txt'))} ;;\n"
        "esac\n"
        "exit 2\n"
    )
    fake.chmod(0o755)


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    log: Path
    port: int = 0


def start_exporters(fakes: list[Path], mode: str, s: Settings) -> list[Node]:
    """Every node's ``mig-exporter serve`` at once, each on a port of its own choosing (its log says
    which); once all are listening. Their logs go to files: a pipe nobody reads would stop them."""
    env = dict(os.environ)
    package_root = str(Path(mig_exporter.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    nodes = []
    try:
        for fake in fakes:
            log = fake.parent / f"serve-{mode}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "mig_exporter", "serve", "--source", "nvidia-smi", "--nvidia-smi",
                     str(fake), "--collector.processes", mode, "--no-kubernetes", "--proc.root",
                     str(fake.parent / "proc"), "--web.listen-address", f"{HOST}:0", "--log-level", "info"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out, env=env, cwd=fake.parent)
            nodes.append(Node(process, log))
        deadline = time.monotonic() + s.start_limit_s
        while any(not n.port for n in nodes):
            for n in nodes:
                if n.port:
                    continue
                text = n.log.read_text(errors="replace")
                if m := LISTENING.search(text):
                    n.port = int(m.group(1))
                elif n.process.poll() is not None:
                    raise RuntimeError(f"mig-exporter serve exited {n.process.returncode}: {text[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sum(not n.port for n in nodes)} exporters not listening "
                                   f"after {s.start_limit_s:.0f}s")
            time.sleep(0.2)
    except BaseException:
        for n in nodes:
            stop_server(n.process)
        raise
    return nodes


# -- Prometheus ------------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus on 127.0.0.1, scraping the nodes; its TSDB and log in ``directory``."""

    def __init__(self, directory: Path, targets: list[str], s: Settings) -> None:
        directory.mkdir(parents=True)
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {s.interval_s}s\n"
            f"  scrape_timeout: {s.timeout_s}s\n"
            "scrape_configs:\n"
            "  - job_name: mig-exporter\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.url = f"http://{HOST}:{free_port()}"
        self.log = directory / "prometheus.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=directory)
        try:
            deadline = time.monotonic() + 30
            while not self._ready():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus not ready (exit {self.process.poll()}): "
                                       f"{self.log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        stop_server(self.process, grace_s=30)

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result: a list of series, each with ``value`` (a vector) or ``values`` (a
        range vector's samples)."""
        return list(self.api("/api/v1/query", query=promql)["result"])

    def own(self) -> dict[str, float]:
        """Its own /metrics, the unlabelled samples: what it says of itself (it does not scrape itself)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                found[name] = float(value)
        return found

    def targets_up(self) -> tuple[int, int]:
        """Targets scraped at least once and up, of all."""
        active = self.api("/api/v1/targets", state="active")["activeTargets"]
        return sum(t["health"] == "up" for t in active), len(active)


# -- one mode ----------------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float  # since the run's start (every target scraped once)
    head_series: float
    created_total: float
    rss_bytes: float
    load1: float


@dataclass
class ModeResult:
    mode: str
    nodes: int
    minutes: float
    head_series: float
    created_per_hour: float
    peak_rss_bytes: float
    vm_hwm_bytes: float | None
    scrape_p50_s: float
    scrape_p90_s: float
    samples_per_scrape: float
    scrapes: int
    scrapes_compared: int  # scrapes whose scrape_samples_scraped was compared with mig_exporter_scrape_series
    targets_up: int
    scrape_series_mismatches: list[str]
    top_metrics: list[tuple[str, int]]
    exporter_cpu_per_scrape_ms: float
    exporter_warnings: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def series_per_node(self) -> float:
        return self.head_series / self.nodes

    @property
    def created_per_node_hour(self) -> float:
        return self.created_per_hour / self.nodes

    @property
    def rss_per_series(self) -> float:
        return self.peak_rss_bytes / self.head_series if self.head_series else float("nan")


def _cpu_s(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:
        return float("nan")


def _vm_hwm_bytes(pid: int) -> float | None:
    hwm = vm_hwm_mib(pid)
    return None if hwm is None else hwm * 1024 * 1024


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_mode(mode: str, fakes: list[Path], directory: Path, s: Settings) -> ModeResult:
    for node, fake in enumerate(fakes):
        arm(fake, node, s)
    with contextlib.ExitStack() as stack:
        nodes = start_exporters(fakes, mode, s)
        for n in nodes:
            stack.callback(stop_server, n.process)
        prometheus = Prometheus(directory / f"prometheus-{mode.replace('=', '')}", [f"{HOST}:{n.port}" for n in nodes],
                                s)
        stack.callback(prometheus.stop)
        # Every target scraped once: its series all made. The run starts here.
        deadline = time.monotonic() + 3 * s.interval_s + 30
        while (up := prometheus.targets_up())[0] < len(nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: {up[0]} of {len(nodes)} targets up after the first scrapes: "
                                   f"{prometheus.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        time.sleep(1)  # the last first scrape's samples appended
        cpu_before = [_cpu_s(n.process.pid) for n in nodes]
        start = time.monotonic()
        samples: list[Sample] = []
        end = start + s.minutes * 60
        while True:
            own = prometheus.own()
            samples.append(Sample(time.monotonic() - start, own["prometheus_tsdb_head_series"],
                                  own["prometheus_tsdb_head_series_created_total"],
                                  own["process_resident_memory_bytes"], os.getloadavg()[0]))
            for n in nodes:
                if n.process.poll() is not None:
                    raise RuntimeError(f"{mode}: an exporter exited {n.process.returncode}: "
                                       f"{n.log.read_text(errors='replace')[-2000:]}")
            if prometheus.process.poll() is not None:
                raise RuntimeError(f"{mode}: prometheus exited: {prometheus.log.read_text(errors='replace')[-2000:]}")
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(s.interval_s, left))
        window = max(1, round(samples[-1].t_s))
        cpu_s = sum(_cpu_s(n.process.pid) - b for n, b in zip(nodes, cpu_before, strict=True))
        return _read_back(mode, prometheus, samples, window, cpu_s, nodes, s)


def _read_back(mode: str, prometheus: Prometheus, samples: list[Sample], window: int, cpu_s: float,
               nodes: list[Node], s: Settings) -> ModeResult:
    """The run's figures from Prometheus' API, read before anything is stopped."""
    at = f"{time.time():.3f}"  # every range query over the same window: a scrape at its edge is in all or none
    durations, scraped, said = (_per_scrape(prometheus, f"{name}[{window}s]", at) for name in (
        "scrape_duration_seconds", "scrape_samples_scraped", "mig_exporter_scrape_series"))
    mismatches = every_scrape_mismatches(scraped, said)
    tsdb = prometheus.api("/api/v1/status/tsdb")
    top = [(m["name"], int(m["value"])) for m in tsdb["seriesCountByMetricName"]]
    up, _ = prometheus.targets_up()
    warnings = sum(len(re.findall(r"level=(WARNING|ERROR)", n.log.read_text(errors="replace"))) for n in nodes)
    first, last = samples[0], samples[-1]
    elapsed_h = (last.t_s - first.t_s) / 3600
    return ModeResult(
        mode=mode, nodes=s.nodes, minutes=window / 60, head_series=last.head_series,
        created_per_hour=(last.created_total - first.created_total) / elapsed_h if elapsed_h else float("nan"),
        peak_rss_bytes=max(x.rss_bytes for x in samples), vm_hwm_bytes=_vm_hwm_bytes(prometheus.process.pid),
        scrape_p50_s=_percentile([*durations.values()], 0.5), scrape_p90_s=_percentile([*durations.values()], 0.9),
        samples_per_scrape=statistics.mean(scraped.values()) if scraped else float("nan"),
        scrapes=len(durations), scrapes_compared=len(scraped), targets_up=up, scrape_series_mismatches=mismatches,
        top_metrics=top,
        exporter_cpu_per_scrape_ms=cpu_s * 1000 / len(durations) if durations else float("nan"),
        exporter_warnings=warnings, samples=samples)


def _per_scrape(prometheus: Prometheus, range_query: str, at: str) -> dict[tuple[str, float], float]:
    """A range query's samples, evaluated at ``at``, by target and scrape: Prometheus stamps every
    sample of a scrape, ``scrape_samples_scraped`` included, with the scrape's time."""
    result = prometheus.api("/api/v1/query", query=range_query, time=at)["result"]
    return {(series["metric"]["instance"], float(t)): float(v) for series in result for t, v in series["values"]}


def every_scrape_mismatches(scraped: dict[tuple[str, float], float],
                            said: dict[tuple[str, float], float]) -> list[str]:
    """The scrapes (target and time) where ``scrape_samples_scraped`` is not what the answer's own
    ``mig_exporter_scrape_series`` said, or where one of the two has no sample: every scrape of the
    run is compared, not one instant."""
    return [f"{instance} at {t:.3f}: scrape_samples_scraped {scraped.get((instance, t))}, "
            f"mig_exporter_scrape_series {said.get((instance, t))}"
            for instance, t in sorted(scraped.keys() | said.keys())
            if scraped.get((instance, t)) != said.get((instance, t))]


# -- the whole run --------------------------------------------------------------------


def measure(s: Settings) -> tuple[list[ModeResult], dict[str, float]]:
    if not Path(PROMETHEUS).exists():
        raise SystemExit(f"{PROMETHEUS} not found: apt-get install prometheus")
    load: dict[str, float] = {"before": os.getloadavg()[0]}
    results = []
    with tempfile.TemporaryDirectory(prefix="mig-bench-fleet-") as tmp:
        fakes = [write_node(Path(tmp) / f"node-{n:03d}", n, s) for n in range(s.nodes)]
        for mode in MODES:
            results.append(measure_mode(mode, fakes, Path(tmp), s))
            print(f"measured the fleet with --collector.processes {mode}", file=sys.stderr, flush=True)
    load["after"] = os.getloadavg()[0]
    during = [x.load1 for r in results for x in r.samples]
    load["during_mean"] = statistics.mean(during)
    load["during_max"] = max(during)
    return results, load


def report(results: list[ModeResult], s: Settings, load: dict[str, float], started: float) -> str:
    out = [f"machine: {machine()}"]
    out.append(f"load average (1 min): {load['before']:.2f} before, {load['during_mean']:.2f} mean and "
               f"{load['during_max']:.2f} max during, {load['after']:.2f} after"
               + ("; QUICK MODE: a smoke run, not a measurement" if s.quick else ""))
    out.append(f"each node: {SHAPE.describe()} (big-mig), its processes replaced every {s.turnover_s}s, the nodes' "
               f"turnovers spread evenly; Prometheus {_prometheus_version()} scraping every {s.interval_s}s "
               f"(timeout {s.timeout_s}s), fresh for each mode with fresh exporters")
    out.append("")
    out.append(f"fleet: one Prometheus, {s.nodes} nodes, {s.minutes:g} minutes per mode after every target's first "
               "scrape (created = prometheus_tsdb_head_series_created_total over the run, an hour's worth; "
               "peak RSS = the most of process_resident_memory_bytes read every interval; scrape = "
               "scrape_duration_seconds of every scrape; samples = scrape_samples_scraped)")
    out.append(table(
        ["mode", "nodes", "minutes", "head series", "series per node", "created/h (fleet)", "created/h per node",
         "peak RSS MiB", "RSS per head series B", "scrape p50 ms", "scrape p90 ms", "samples per scrape"],
        [[r.mode, str(r.nodes), f(r.minutes, 1), f(r.head_series, 0), f(r.series_per_node, 0),
          f(r.created_per_hour, 0), f(r.created_per_node_hour, 0), f(r.peak_rss_bytes / 2**20, 1),
          f(r.rss_per_series, 0), f(r.scrape_p50_s * 1000), f(r.scrape_p90_s * 1000), f(r.samples_per_scrape, 0)]
         for r in results]))
    base = results[0]
    out.append("")
    out.append(f"ratio to {base.mode}")

    def ratio(a: float, b: float) -> str:
        return f(a / b) if b else "n/a"

    out.append(table(
        ["mode", "head series", "created/h", "peak RSS", "scrape p50", "samples per scrape"],
        [[r.mode, ratio(r.head_series, base.head_series), ratio(r.created_per_hour, base.created_per_hour),
          ratio(r.peak_rss_bytes, base.peak_rss_bytes), ratio(r.scrape_p50_s, base.scrape_p50_s),
          ratio(r.samples_per_scrape, base.samples_per_scrape)] for r in results]))
    last = results[-1]
    if base.head_series != last.head_series:
        marginal = (base.peak_rss_bytes - last.peak_rss_bytes) / (base.head_series - last.head_series)
        out.append(f"  peak RSS per head series beyond {last.mode}'s: {marginal:.0f} B "
                   f"(({base.mode} - {last.mode}) / their head series' difference)")
    out.append("")
    for r in results:
        problems = [f"{r.targets_up} of {r.nodes} targets up at the end"] if r.targets_up != r.nodes else []
        if r.scrape_series_mismatches:
            problems.append(f"{len(r.scrape_series_mismatches)} scrapes where scrape_samples_scraped != "
                            f"mig_exporter_scrape_series, e.g. {r.scrape_series_mismatches[0]}")
        out.append(f"{r.mode}: {r.scrapes} scrapes; scrape_samples_scraped == mig_exporter_scrape_series at every "
                   f"scrape of every target ({r.scrapes_compared} compared): "
                   f"{'yes' if not r.scrape_series_mismatches and r.scrapes_compared else 'NO'}; "
                   f"exporters' CPU per scrape {f(r.exporter_cpu_per_scrape_ms)} ms; "
                   f"exporters' warning lines {r.exporter_warnings}; "
                   f"Prometheus VmHWM {f((r.vm_hwm_bytes or float('nan')) / 2**20, 1)} MiB"
                   + (f"; PROBLEMS: {'; '.join(problems)}" if problems else ""))
        out.append("  top metric names by series (/api/v1/status/tsdb): "
                   + ", ".join(f"{name} {count}" for name, count in r.top_metrics[:5]))
    out.append("")
    out.append(f"fleet benchmark wall time: {time.monotonic() - started:.0f}s")
    return "\n".join(out)


def _prometheus_version() -> str:
    try:
        text = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"version (\S+)", text)
    return m.group(1) if m else "?"


def figures(results: list[ModeResult], s: Settings, load: dict[str, float]) -> dict[str, Any]:
    def clean(value: object) -> object:  # NaN is not JSON
        return None if isinstance(value, float) and value != value else value

    modes = []
    for r in results:
        row = {k: clean(v) for k, v in asdict(r).items() if k != "samples"}
        row.update(series_per_node=r.series_per_node, created_per_node_hour=clean(r.created_per_node_hour),
                   rss_per_series=clean(r.rss_per_series),
                   samples=[asdict(x) for x in r.samples])
        modes.append(row)
    return {"machine": machine(), "quick": s.quick, "settings": asdict(s), "load_average": load,
            "prometheus": _prometheus_version(), "shape": SHAPE.describe(), "modes": modes}


def draw(data: dict[str, Any], output: Path) -> None:
    """Four panels: head series and Prometheus' RSS over each mode's run, series created per node and
    hour, and the scrape durations."""
    plt = pyplot()
    modes = data["modes"]
    colours = dict(zip(MODES, ("tab:red", "tab:orange", "tab:blue"), strict=True))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=100)
    for key, ax, scale, title, unit in (("head_series", axes[0][0], 1, "Prometheus head series", "series"),
                                        ("rss_bytes", axes[0][1], 2**20, "Prometheus resident memory", "MiB")):
        for m in modes:
            ax.plot([x["t_s"] / 60 for x in m["samples"]], [x[key] / scale for x in m["samples"]],
                    "-o", markersize=2.5, color=colours.get(m["mode"]), label=m["mode"])
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("minutes since every target's first scrape")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9, title="--collector.processes", title_fontsize=8.5)
    names = [m["mode"] for m in modes]
    ax = axes[1][0]
    bars = ax.bar(names, [m["created_per_node_hour"] or 0 for m in modes], color=[colours.get(n) for n in names])
    ax.bar_label(bars, fmt="%.0f", fontsize=9)
    ax.set_title(f"series created per node and hour (turnover every {data['settings']['turnover_s']}s)",
                 fontsize=11)
    ax.set_ylabel("new series per node per hour")
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1][1]
    xs = range(len(modes))
    for offset, key, label in ((-0.2, "scrape_p50_s", "p50"), (0.2, "scrape_p90_s", "p90")):
        bars = ax.bar([x + offset for x in xs], [(m[key] or 0) * 1000 for m in modes], width=0.4, label=label,
                      color=[colours.get(n) for n in names], alpha=1.0 if label == "p50" else 0.55)
        ax.bar_label(bars, fmt="%.0f", fontsize=9)
    ax.set_xticks(list(xs), names)
    ax.set_title("scrape duration, every scrape of every target", fontsize=11)
    ax.set_ylabel("ms")
    ax.legend(fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    s = data["settings"]
    load = data["load_average"]
    note = "QUICK MODE, not a measurement; " if data.get("quick") else ""
    save(plt, fig, output, f"mig-exporter: one Prometheus {data['prometheus']}, {s['nodes']} nodes of "
         f"{data['shape']}, {s['minutes']:g} min per mode, {s['interval_s']}s scrapes (python -m benchmarks --fleet)",
         11.5, f"{note}{data['machine']}; load average {load['during_mean']:.2f} mean, "
         f"{load['during_max']:.2f} max during")


def main(quick: bool, nodes: int | None, minutes: float | None, turnover_s: int | None, json_path: str | None,
         picture: str | None) -> int:
    started = time.monotonic()
    s = Settings.make(quick, nodes, minutes, turnover_s)
    results, load = measure(s)
    print(report(results, s, load, started), flush=True)
    data = figures(results, s, load)
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1) + "\n")
    if picture is None and not quick:
        picture = str(Path(__file__).resolve().parent.parent / "docs" / "images" / "fleet.png")
    if picture:
        draw(data, Path(picture))
        print(f"picture: {picture}", flush=True)
    return 0


__all__ = ["main"]
