"""The engines' /proc read (docs/performance.md, "/proc scan"): a fabricated /proc of 5 000
processes (tests/proc_tree.py's files, on this disk) and this machine's own /proc, read cold (a
new reader: every process's stat, cmdline, exe link and threads) and warm (the same reader again:
the listing, and only new, young, re-parented and engine processes read). Process CPU time,
medians; the target is the warm read of 5 000 within ``TARGET_MS``.

    python -m benchmarks.procscan [--processes N] [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.procfs import ProcfsSource

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from proc_tree import Proc, make_proc  # noqa: E402 - needs tests/ on sys.path

TARGET_MS = 10.0


def cpu_ms(fn: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        started = time.process_time()
        fn()
        samples.append(time.process_time() - started)
    return statistics.median(samples) * 1e3


def host(root: Path, processes: int) -> Path:
    """``processes`` processes: sshd-like daemons and shells, each with a thread, one llama-server."""
    procs = [Proc(10000 + i, f"worker-{i % 50}", ["/usr/bin/worker", str(i)], ppid=1 if i % 10 == 0 else 10000,
                  exe="/usr/bin/worker", threads=[30000 + i]) for i in range(processes - 4)]
    procs.append(Proc(9000, "llama-server", ["/usr/local/bin/llama-server", "-ngl", "99"], threads=[9001, 9002]))
    return make_proc(root, procs)


def source(root: str) -> ProcfsSource:
    reader = ProcfsSource(root)
    reader.watch(DEFAULT_SETTINGS.match)
    return reader


def measure(root: str, cold_reps: int, warm_reps: int) -> tuple[int, float, float]:
    warm = source(root)
    count = len(warm.read().processes)
    return count, cpu_ms(lambda: source(root).read(), cold_reps), cpu_ms(warm.read, warm_reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5000)
    parser.add_argument("--check", action="store_true", help=f"fail unless the warm read is within {TARGET_MS} ms")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mig-bench-proc-") as tmp:
        fabricated = measure(str(host(Path(tmp) / "proc", args.processes)), 5, 21)
    real = measure("/proc", 11, 51)
    print("| /proc | processes | cold ms | warm ms |\n|---|---|---|---|")
    for name, (count, cold, warm) in (("fabricated", fabricated), ("this machine's", real)):
        print(f"| {name} | {count} | {cold:.2f} | {warm:.2f} |")
    if args.check and fabricated[2] > TARGET_MS:
        print(f"FAIL: the warm read of {fabricated[0]} processes took {fabricated[2]:.2f} ms > {TARGET_MS} ms")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
