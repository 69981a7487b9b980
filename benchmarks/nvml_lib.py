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
``measure(quick, figures)`` also fills ``figures``. Run alone::

    PYTHONPATH=src:. python -m benchmarks.nvml_lib [--quick]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    args = parser.parse_args(argv)
    figures: dict[str, float] = {}
    print(measure(args.quick, figures))
    if args.json:
        print(json.dumps(figures, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
