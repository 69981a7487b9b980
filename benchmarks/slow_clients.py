"""Slow and flooding clients against a real ``mig-exporter serve --demo``: does the node's
monitoring stay up? (docs/reliability.md, "The port")

Scenarios, each against a fresh server on 127.0.0.1 whose soft open-file limit is 1024 (the
usual container default; ``--hard-1024`` makes the hard limit 1024 too):

- ``slow``: 1100 connections, each sending one header byte every 10 s, held for ``--hold`` s;
- ``held``: 3000 connections that send half a head, held, then all closed at once;
- ``big``: 25 connections, each sending headers of 5.9 MB (90 of 65 000 bytes) slowly.

Throughout, and for 10 s after, a checker asks ``/-/healthy`` and ``/metrics`` every 0.5 s
with a 1 s deadline. Printed per scenario: the share answered within 1 s (target >= 95%),
their p50/p99, the server's peak RSS (target < 100 MiB) and its CPU share while idle-held
(a spin on accept() is ~100%). ``--src DIR`` runs another checkout's code (the "before").

    python benchmarks/slow_clients.py                 # this checkout
    python benchmarks/slow_clients.py --src /path/to/old/src --scenarios slow,held

Bounded: every loop has a count and a deadline, and everything runs on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK_EVERY_S = 0.5
CHECK_DEADLINE_S = 1.0
AFTER_S = 10.0


def _raise_own_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


def start_server(src: Path, hard_1024: bool) -> tuple[subprocess.Popen[bytes], int]:
    hard = 1024 if hard_1024 else resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen([sys.executable, "-m", "mig_exporter", "serve", "--demo", "--web.listen-address",
                             "127.0.0.1:0", "--log.level", "warning"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=limits)
    # The port: from /proc, since warning-level logs do not say it.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        port = _listening_port(proc.pid)
        if port:
            return proc, port
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start listening")


def _listening_port(pid: int) -> int | None:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            m = re.match(r"socket:\[(\d+)\]", target)
            if m:
                inodes.add(m.group(1))
    except OSError:
        return None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            return int(fields[1].split(":")[1], 16)
    return None


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Checker(threading.Thread):
    """Asks /-/healthy and /metrics every CHECK_EVERY_S with a CHECK_DEADLINE_S deadline."""

    def __init__(self, port: int, pid: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.pid = pid
        self.results: list[tuple[str, bool, float]] = []
        self.peak_rss = 0.0
        self.stop = threading.Event()

    def _ask(self, path: str) -> tuple[bool, float]:
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=CHECK_DEADLINE_S) as s:
                s.settimeout(CHECK_DEADLINE_S)
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                data = b""
                while time.monotonic() - started < CHECK_DEADLINE_S:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError:
            return False, time.monotonic() - started
        elapsed = time.monotonic() - started
        return data.startswith(b"HTTP/1.1 200") and elapsed <= CHECK_DEADLINE_S, elapsed

    def run(self) -> None:
        while not self.stop.is_set():
            for path in ("/-/healthy", "/metrics"):
                ok, elapsed = self._ask(path)
                self.results.append((path, ok, elapsed))
            try:
                self.peak_rss = max(self.peak_rss, _rss_mib(self.pid))
            except OSError:
                return
            self.stop.wait(CHECK_EVERY_S)


def _connect_many(port: int, count: int, first: bytes, deadline_s: float = 60) -> list[socket.socket]:
    out = []
    until = time.monotonic() + deadline_s
    for _ in range(count):
        if time.monotonic() > until:
            break
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.setblocking(False)
            if first:
                s.send(first)
            out.append(s)
        except OSError:
            pass
    return out


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def scenario_slow(port: int, hold_s: float) -> dict[str, float]:
    socks = _connect_many(port, 1100, b"G")
    payload = b"ET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 1000
    sent = 1
    until = time.monotonic() + hold_s
    while time.monotonic() < until:
        time.sleep(min(10.0, max(0.0, until - time.monotonic())))
        for s in socks:
            with contextlib.suppress(OSError):
                s.send(payload[sent - 1:sent])
        sent += 1
    answered = sum(not _silent(s) for s in socks)
    _close_all(socks)
    return {"connections": len(socks), "answered_or_closed_by_the_server": answered}


def _silent(s: socket.socket) -> bool:
    """Open, with nothing from the server (no 408, no close)."""
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def scenario_held(port: int, hold_s: float) -> dict[str, float]:
    socks = _connect_many(port, 3000, b"GET /metrics HTTP/1.1\r\nX-Held: ")
    time.sleep(hold_s)
    _close_all(socks)  # all at once
    return {"connections": len(socks)}


def scenario_big(port: int, hold_s: float) -> dict[str, float]:
    socks = _connect_many(port, 25, b"GET /metrics HTTP/1.1\r\n")
    header = b"X-Big: " + b"a" * 65000 + b"\r\n"
    until = time.monotonic() + hold_s
    refused = 0
    for _ in range(90):
        if time.monotonic() > until:
            break
        for s in list(socks):
            try:
                s.send(header)
            except BlockingIOError:
                pass
            except OSError:
                socks.remove(s)
                refused += 1
        time.sleep(hold_s / 90)
    _close_all(socks)
    return {"connections_closed_by_the_server": refused}


SCENARIOS = {"slow": scenario_slow, "held": scenario_held, "big": scenario_big}


def run(src: Path, name: str, hold_s: float, hard_1024: bool) -> None:
    proc, port = start_server(src, hard_1024)
    try:
        checker = Checker(port, proc.pid)
        checker.start()
        time.sleep(1.0)
        cpu_before = _cpu_s(proc.pid)
        started = time.monotonic()
        extra = SCENARIOS[name](port, hold_s)
        attack_s = time.monotonic() - started
        cpu_share = (_cpu_s(proc.pid) - cpu_before) / attack_s
        time.sleep(AFTER_S)
        checker.stop.set()
        checker.join(timeout=10)
        alive = proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
    limit = " hard limit 1024" if hard_1024 else ""
    print(f"\n== {name} ({src}){limit}: {attack_s:.0f}s attack + {AFTER_S:.0f}s after")
    for path in ("/-/healthy", "/metrics"):
        rows = [(ok, t) for p, ok, t in checker.results if p == path]
        answered = sum(ok for ok, _ in rows)
        times = sorted(t for _, t in rows)
        p50 = statistics.median(times) * 1000 if times else float("nan")
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))] * 1000 if times else float("nan")
        share = answered / len(rows) if rows else 0.0
        print(f"  {path:11s} answered within {CHECK_DEADLINE_S:g}s: {answered}/{len(rows)} = {share:.0%} "
              f"(target >= 95%); p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"  peak RSS {checker.peak_rss:.1f} MiB (target < 100); server CPU during the attack "
          f"{cpu_share:.0%} of a core; server alive after: {alive}")
    for key, value in extra.items():
        print(f"  {key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the src/ directory whose code to run")
    parser.add_argument("--scenarios", default="slow,held,big")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds each attack lasts (at most 120)")
    parser.add_argument("--hard-1024", action="store_true", help="the server's hard open-file limit is 1024 too")
    args = parser.parse_args()
    _raise_own_limit()
    for name in args.scenarios.split(","):
        run(args.src, name, min(args.hold, 120.0), args.hard_1024)


if __name__ == "__main__":
    main()
