"""What GPM activity costs the NVML read (issue 39): big-mig (8 H100 in MIG mode, 56 GPU instances)
through the Python fake libnvidia-ml (tests/fake_nvml.py), ``NvmlSource.read()`` with GPM (the
H100s as they are) and without it (the same cards saying they have none: one support query per
card, then no GPM call), taking turns read by read, the fake's clock 15 s on before each, so that
every read takes a sample of each GPU instance and measures a window, as a 15 s scraper's would.

Figures (ms, medians): CPU per read (process time: the read's own thread included), and the
difference, less the fake's own part of it: the time inside the fake's GPM functions, timed call by
call (ctypes into a Python callback: a real libnvidia-ml answers in C, in microseconds). And the
samples kept at the steady state of a lone 15 s scraper.

    PYTHONPATH=src:. python -m benchmarks.activity_cost [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

from benchmarks import scenarios
from benchmarks.scenarios import BIG_MIG, REPO
from benchmarks.tables import f, machine, table
from mig_exporter.sources.nvml import NvmlSource

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from fake_nvml import FakeNvml  # tests/, on sys.path above

SCRAPE_INTERVAL_S = 15.0


class _TimedGpm(FakeNvml):
    """The fake, counting the CPU its GPM functions take, each call whole (ctypes and callback)."""

    spent_ns = 0

    def _callback(self, name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
        function = super()._callback(name, argtypes, restype)
        if not name.startswith("nvmlGpm"):
            return function

        def timed(*args: Any) -> Any:
            started = time.process_time_ns()
            try:
                return function(*args)
            finally:
                _TimedGpm.spent_ns += time.process_time_ns() - started
        return timed


def measure(quick: bool, rounds: int) -> str:
    rounds, warmup = (3, 2) if quick else (rounds, 4)
    on = scenarios.nvml_scenario(BIG_MIG)
    off = dataclasses.replace(on, cards=tuple(dataclasses.replace(c, gpm_supported=False) for c in on.cards))
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    fake_ms: list[float] = []
    gpm_calls: list[int] = []
    fake = _TimedGpm(on).install()
    try:
        fake.set_clock(1000.0)
        sources = {"on": NvmlSource(clock=fake.now), "off": NvmlSource(clock=fake.now)}
        for i in range(warmup + rounds):
            fake.advance(SCRAPE_INTERVAL_S)
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                fake.set_scenario(on if mode == "on" else off)
                before, in_fake = len(fake.calls), _TimedGpm.spent_ns
                started = time.process_time_ns()
                snapshot = sources[mode].read()
                spent = time.process_time_ns() - started
                if i < warmup:
                    continue
                cpu[mode].append(spent / 1e6)
                if mode == "on":
                    fake_ms.append((_TimedGpm.spent_ns - in_fake) / 1e6)
                    gpm_calls.append(sum(1 for c in fake.calls[before:] if c.function.startswith("nvmlGpm")))
                    measured = sum(1 for d in snapshot.devices if d.activity is not None)
                    assert measured == BIG_MIG.devices, f"{measured} of {BIG_MIG.devices} devices measured"
        held = sources["on"].activity.samples_held
        assert fake.exceptions == []
    finally:
        fake.uninstall()
    with_gpm, without = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    fake_part = statistics.median(fake_ms)
    rows = [
        ["NVML read CPU, GPM off", f(without)],
        ["NVML read CPU, GPM on", f(with_gpm)],
        ["GPM's part (on - off)", f(with_gpm - without)],
        [f"of which inside the fake's GPM functions ({statistics.median(gpm_calls):.0f} calls)", f(fake_part)],
        ["GPM's part, ours (less the fake's)", f(with_gpm - without - fake_part)],
        ["GPM samples kept (56 GPU instances, a lone 15 s scraper)", str(held)],
    ]
    return "\n".join([
        f"GPM activity on the NVML path, big-mig through the Python fake libnvidia-ml (ms per read; {rounds} "
        f"rounds taking turns, a read every {SCRAPE_INTERVAL_S:g} s of the fake's clock; medians)"
        + ("; QUICK MODE" if quick else ""),
        machine(),
        "",
        table(["figure", "value"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=40, help="reads of each mode (default 40)")
    args = parser.parse_args(argv)
    print(measure(args.quick, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
