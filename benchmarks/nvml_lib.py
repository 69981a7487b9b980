"""The NVML path through a real shared library: the C fake libnvidia-ml.so.1 (tests/fake_libnvml/).

Per scenario (big-mig, big-whole, single), each in processes of its own that load our library
where they ask for ``libnvidia-ml.so.1`` (``LD_LIBRARY_PATH``):

- ours: ``mig-exporter serve --source nvml`` (engines and pods on, as by default), scraped over
  HTTP with Prometheus' headers: the scrape's p50 wall time and the serving process's CPU per
  scrape (its utime + stime over the loop, divided by the scrapes). The library answers in
  nanoseconds, so the whole scrape is the exporter's overhead;
- our NVML read alone (``NvmlSource._read_now``: pynvml's calls and placement, no collect,
  render or /proc), CPU p50 in a process of its own: what of the scrape is NVML's;
- theirs: nvitop-exporter 1.7.2's ``update_device`` over the cards and their MIG devices (its
  ``collect()`` loop less ``update_host()``, as benchmarks/run.py runs it), in a process of its
  own on the same library: CPU per update (``time.process_time``), p50, and its wall time.

``ratio`` is our CPU per scrape over nvitop's CPU per update (issue 17's target: at most 0.2 on
big-mig, and at most 3 ms a big-mig scrape). ``measure(quick)`` returns the markdown table;
``measure(quick, figures)`` also fills ``figures``.

``--health-cost`` measures what card health costs the NVML path (issue 37: at most 15% of the CPU
per scrape before health): on big-mig, ``serve --source nvml`` as it is and with the health read
stubbed out (a ``sitecustomize`` on the server's ``PYTHONPATH`` makes ``HealthReader.card`` answer an
empty ``CardHealth`` and ``instance_ecc`` nothing: no health calls, no health rows, the tree before
card health as far as NVML goes), taking turns for ``--rounds`` rounds so that both see the same load;
the same for the read alone. Run alone::

    PYTHONPATH=src:. python -m benchmarks.nvml_lib [--quick] [--health-cost [--rounds N]]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mig_exporter
from benchmarks import scenarios, serving
from benchmarks.scenarios import BIG_MIG, BIG_WHOLE, SINGLE, Shape

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from fake_nvml_c import SONAME, build, environment, write_scenario  # noqa: E402 - needs tests/ on sys.path

TARGET_BIG_MIG_SCRAPE_MS = 3.0
TARGET_RATIO = 0.2
SHAPES = (BIG_MIG, BIG_WHOLE, SINGLE)
# nvitop-exporter's update, in a process of its own: prints its figures as JSON.
_NVITOP_CHILD = """
import json, statistics, sys, time
from nvitop import Device
from nvitop_exporter.exporter import PrometheusExporter
from prometheus_client import CollectorRegistry
reps, warmup = int(sys.argv[1]), int(sys.argv[2])
physical = Device.from_indices(range(Device.count()))
migs = [m for d in physical for m in d.mig_devices()]
devices = sorted(physical + migs, key=lambda d: (d.index,) if isinstance(d.index, int) else d.index)
exporter = PrometheusExporter(devices, hostname="bench", registry=CollectorRegistry(auto_describe=False))
def update():
    for device in devices:
        exporter.update_device(device)
for _ in range(warmup):
    update()
cpu, wall = [], []
for _ in range(reps):
    c, w = time.process_time_ns(), time.perf_counter_ns()
    update()
    cpu.append(time.process_time_ns() - c)
    wall.append(time.perf_counter_ns() - w)
maps = open("/proc/self/maps").read()
print(json.dumps({"cpu_ms": statistics.median(cpu) / 1e6, "wall_ms": statistics.median(wall) / 1e6,
                  "devices": len(devices), "maps": [l.split()[-1] for l in maps.splitlines() if "libnvidia-ml" in l]}))
"""


# Our NVML read alone (no collect, no render, no /proc), in a process of its own.
_READ_CHILD = """
import json, statistics, sys, time
from mig_exporter.sources.nvml import NvmlSource
reps, warmup = int(sys.argv[1]), int(sys.argv[2])
source = NvmlSource()
for _ in range(warmup):
    source.read()
cpu = []
for _ in range(reps):
    c = time.process_time_ns()
    source._read_now()
    cpu.append(time.process_time_ns() - c)
print(json.dumps({"read_cpu_ms": statistics.median(cpu) / 1e6}))
"""


# The health read stubbed out: imported by Python at start-up from the server's PYTHONPATH.
_NO_HEALTH_SITE = """
from mig_exporter.model.health import NO_HEALTH
from mig_exporter.sources import nvml_health
nvml_health.HealthReader.card = lambda self, card, handle, mig_current: NO_HEALTH
nvml_health.HealthReader.instance_ecc = lambda self, card, handle: ()
"""


def _without_health(env: dict[str, str], directory: Path) -> dict[str, str]:
    """``env`` for a process whose NVML path reads no card health (``_NO_HEALTH_SITE``)."""
    (directory / "sitecustomize.py").write_text(_NO_HEALTH_SITE)
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH")) if p)
    return env


# Our scrape in process, no HTTP: read, families and rendering, CPU per scrape; the least of batches,
# the figure least moved by what else the machine runs.
_SCRAPE_CHILD = """
import json, sys, time
from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.nvml import NvmlSource
reps, batches = int(sys.argv[1]), int(sys.argv[2])
scraper = Scraper(NvmlSource())
for _ in range(3):
    render(scraper.families(), None)
best = []
for _ in range(batches):
    c = time.process_time_ns()
    for _ in range(reps):
        render(scraper.families(), None)
    best.append((time.process_time_ns() - c) / reps / 1e6)
print(json.dumps({"scrape_cpu_ms": min(best)}))
"""


def _python_env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    roots = (str(Path(mig_exporter.__file__).resolve().parent.parent), str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH")) if p)
    return env


def measure_ours(shape: Shape, env: dict[str, str], library: Path, reps: int, warmup: int) -> dict[str, float]:
    proc, port = serving.start_serve(["--source", "nvml", "--log-level", "error"], env, within_s=30)
    try:
        scrape = serving.Scrape(port)
        for _ in range(warmup):
            scrape()
        walls = []
        cpu_before = serving.cpu_seconds(proc.pid)
        for _ in range(reps):
            t = time.perf_counter_ns()
            last, _ = scrape.raw()
            walls.append(time.perf_counter_ns() - t)
        cpu_s = serving.cpu_seconds(proc.pid) - cpu_before
        scrape.close()
        body = gzip.decompress(last)
        if b'mig_exporter_read_success{source="nvml"} 1' not in body:
            raise RuntimeError(f"{shape.name}: the NVML read failed")
        lines = sum(1 for line in body.splitlines() if line.startswith(b"mig_exporter_process_memory_used_bytes{"))
        if lines != shape.processes:
            raise RuntimeError(f"{shape.name}: {lines} process series, {shape.processes} expected")
        if str(library / SONAME) not in Path(f"/proc/{proc.pid}/maps").read_text():
            raise RuntimeError("the serving process did not map our libnvidia-ml")
    finally:
        serving.stop_server(proc)
    return {"scrape_p50_ms": statistics.median(walls) / 1e6, "cpu_per_scrape_ms": cpu_s * 1000 / reps}


def measure_nvitop(shape: Shape, env: dict[str, str], library: Path, reps: int, warmup: int) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", _NVITOP_CHILD, str(reps), str(warmup)], env=_python_env(env),
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"nvitop-exporter's update failed: {result.stderr[-2000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if figures["maps"] != [str(library / SONAME)] * len(figures["maps"]) or not figures["maps"]:
        raise RuntimeError(f"nvitop loaded another libnvidia-ml: {figures['maps']}")
    if figures["devices"] != shape.devices + (shape.cards if shape.instances else 0):
        raise RuntimeError(f"{shape.name}: nvitop saw {figures['devices']} devices")
    return {"update_cpu_ms": figures["cpu_ms"], "update_wall_ms": figures["wall_ms"], "devices": figures["devices"]}


def measure_read(env: dict[str, str], reps: int, warmup: int) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", _READ_CHILD, str(reps), str(warmup)], env=_python_env(env),
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the NVML read failed: {result.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def _nvitop_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("nvitop_exporter") is None:
        return "nvitop-exporter not installed; pip install '.[bench]'"
    return None


def measure(quick: bool, figures: dict[str, float] | None = None) -> str:
    """The table; ``figures`` (when given) gets ``<scenario>.<figure>`` for each value in it."""
    figures = {} if figures is None else figures
    library = build()
    reps = {BIG_MIG.name: 3, BIG_WHOLE.name: 3, SINGLE.name: 3} if quick else \
        {BIG_MIG.name: 100, BIG_WHOLE.name: 100, SINGLE.name: 300}
    # nvitop's update of big-mig takes about a second of CPU here.
    nvitop_reps = {BIG_MIG.name: 2, BIG_WHOLE.name: 2, SINGLE.name: 3} if quick else \
        {BIG_MIG.name: 10, BIG_WHOLE.name: 20, SINGLE.name: 75}
    warmup = 1 if quick else 3
    missing = _nvitop_missing()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mig-bench-nvml-lib-") as tmp:
        for shape in SHAPES:
            path = write_scenario(Path(tmp) / f"{shape.name}.txt", scenarios.nvml_scenario(shape))
            env = environment(library, path)
            ours = measure_ours(shape, env, library, reps[shape.name], warmup)
            read = measure_read(env, reps[shape.name], warmup)
            theirs = {} if missing else measure_nvitop(shape, env, library, nvitop_reps[shape.name], warmup)
            values = {**ours, **read, **theirs}
            if theirs:
                values["ratio_cpu"] = ours["cpu_per_scrape_ms"] / theirs["update_cpu_ms"]
            figures.update({f"{shape.name}.{k}": float(v) for k, v in values.items()})

            def cell(key: str, values: dict[str, float] = values) -> str:
                return f"{values[key]:.2f}" if key in values else "n/a"

            rows.append(f"| {shape.name} | {cell('scrape_p50_ms')} | {cell('cpu_per_scrape_ms')} | "
                        f"{cell('read_cpu_ms')} | "
                        f"{cell('update_cpu_ms')} | {cell('update_wall_ms')} | {cell('ratio_cpu')} |")
    load = os.getloadavg()
    lines = [
        f"NVML through the C fake libnvidia-ml.so.1 (ms; ours: `serve --source nvml` over HTTP, {reps[BIG_MIG.name]}"
        f"/{reps[SINGLE.name]} scrapes; nvitop-exporter's update_device loop in its own process; ratio = our CPU "
        f"per scrape / nvitop's CPU per update; our NVML read: `NvmlSource` alone, in its own process; "
        f"load {load[0]:.2f})"
        + ("; QUICK MODE: a smoke run, not a measurement" if quick else ""),
        "",
        "| scenario | our scrape p50 | our CPU/scrape | our NVML read CPU | nvitop CPU/update | nvitop update wall "
        "| ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    if missing:
        lines.append(f"\nnvitop: {missing}")
    big_cpu = figures.get(f"{BIG_MIG.name}.cpu_per_scrape_ms")
    big_ratio = figures.get(f"{BIG_MIG.name}.ratio_cpu")
    lines.append("")
    lines.append(f"targets (big-mig): CPU per scrape <= {TARGET_BIG_MIG_SCRAPE_MS} ms: "
                 f"{'PASS' if big_cpu is not None and big_cpu <= TARGET_BIG_MIG_SCRAPE_MS else 'MISS'}; "
                 f"ratio <= {TARGET_RATIO}: "
                 f"{'PASS' if big_ratio is not None and big_ratio <= TARGET_RATIO else 'MISS'}")
    return "\n".join(lines)


TARGET_HEALTH_SHARE = 0.15  # issue 37: health may add at most 15% to the NVML path's CPU per scrape


def measure_health_cost(quick: bool, rounds: int, figures: dict[str, float] | None = None) -> str:
    """big-mig's CPU per scrape and per read with card health and without it, taking turns."""
    figures = {} if figures is None else figures
    library = build()
    reps, warmup = (3, 1) if quick else (100, 3)
    runs: dict[str, dict[str, list[float]]] = {mode: {"cpu": [], "read": [], "in_process": []}
                                               for mode in ("with", "without")}
    with tempfile.TemporaryDirectory(prefix="mig-bench-nvml-health-") as tmp:
        path = write_scenario(Path(tmp) / "big-mig.txt", scenarios.nvml_scenario(BIG_MIG))
        site = Path(tmp) / "site"
        site.mkdir()
        envs = {"with": environment(library, path), "without": _without_health(environment(library, path), site)}
        for i in range(rounds):
            for mode in (("with", "without") if i % 2 == 0 else ("without", "with")):
                runs[mode]["cpu"].append(measure_ours(BIG_MIG, envs[mode], library, reps, warmup)["cpu_per_scrape_ms"])
                runs[mode]["read"].append(measure_read(envs[mode], reps, warmup)["read_cpu_ms"])
                result = subprocess.run([sys.executable, "-c", _SCRAPE_CHILD, str(reps), "5"],
                                        env=_python_env(envs[mode]), capture_output=True, text=True, timeout=600)
                if result.returncode != 0:
                    raise RuntimeError(f"the in-process scrape failed: {result.stderr[-2000:]}")
                runs[mode]["in_process"].append(json.loads(result.stdout.strip().splitlines()[-1])["scrape_cpu_ms"])
    medians = {f"{mode}.{k}": statistics.median(v) for mode, by in runs.items() for k, v in by.items()}
    share = medians["with.cpu"] / medians["without.cpu"] - 1
    least = {mode: min(runs[mode]["in_process"]) for mode in runs}
    in_process = least["with"] / least["without"] - 1
    figures["big-mig.health.in_process_share"] = in_process
    figures.update({f"big-mig.health.{k}": v for k, v in medians.items()}, **{"big-mig.health.share": share})
    load = os.getloadavg()
    cells = {mode: " ".join(f"{v:.2f}" for v in runs[mode]["cpu"]) for mode in runs}
    return "\n".join([
        f"Card health on the NVML path, big-mig through the C fake libnvidia-ml (ms; {rounds} rounds taking turns, "
        f"{reps} scrapes each; medians; load {load[0]:.2f})" + ("; QUICK MODE" if quick else ""),
        "",
        "| figure | without health | with health | change |",
        "|---|---:|---:|---:|",
        f"| server CPU per scrape | {medians['without.cpu']:.2f} | {medians['with.cpu']:.2f} | {share:+.1%} |",
        f"| NVML read CPU (`_read_now`) | {medians['without.read']:.2f} | {medians['with.read']:.2f} | "
        f"{medians['with.read'] - medians['without.read']:+.2f} ms |",
        f"| scrape CPU in process, least of all batches (read, families, render) | {least['without']:.2f} | "
        f"{least['with']:.2f} | {in_process:+.1%} |",
        "",
        f"rounds, server CPU per scrape: without {cells['without']}; with {cells['with']}",
        f"target: health adds <= {TARGET_HEALTH_SHARE:.0%}: {'PASS' if share <= TARGET_HEALTH_SHARE else 'MISS'}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    parser.add_argument("--health-cost", action="store_true",
                        help="big-mig with and without card health, taking turns (issue 37's 15%%)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --health-cost (default 6)")
    args = parser.parse_args(argv)
    figures: dict[str, float] = {}
    if args.health_cost:
        print(measure_health_cost(args.quick, args.rounds, figures))
    else:
        print(measure(args.quick, figures))
    if args.json:
        print(json.dumps(figures, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
