#!/usr/bin/env python3
"""Load and soak: ``mig-exporter serve`` on 127.0.0.1 under wrk, over a fake nvidia-smi that
serves a large node (8 H100 in MIG mode: 32 instances, 96 processes).

Runs, in this order, and prints what it saw (a table, then one JSON line):

1. 10 000 scrapes of /metrics, 8 clients at once (as from a few Prometheus servers): RSS after the
   first 100 scrapes and after all 10 000;
3. wrk against /metrics, then against /probe?target=node (30 s and 50 connections each): requests
   per second, latency, errors, and RSS before and after.

Exits 1 when a request failed (a socket error, an answer other than 200, or a read that failed:
``mig_exporter_read_errors_total`` above 0) or RSS after 10 000
scrapes is more than 10% above RSS after 100. Traffic goes to 127.0.0.1 only; every loop is
bounded in count and time. Needs wrk (Debian: ``apt-get install wrk``).

    python benchmarks/load.py               # the figures in docs/reliability.md
    python benchmarks/load.py --quick       # 15 s: a smoke test of the script (no RSS verdict)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
CARDS = 8
PROCESSES_PER_CARD = 12


def large_node(directory: Path) -> Path:
    """A fake nvidia-smi printing 8 copies of the H100 MIG fixture's card, each with its own UUIDs,
    bus id and 12 processes; each run is logged to runs.log."""
    xml = (FIXTURES / "h100-mig-processes.xml").read_text()
    listing = (FIXTURES / "h100-mig-processes.L.txt").read_text()
    head, rest = xml.split("\t<gpu ", 1)
    card, tail = rest.split("</gpu>", 1)
    card = "\t<gpu " + card + "</gpu>\n"
    processes = re.findall(r"\t\t\t<process_info>.*?</process_info>\n", card, re.S)
    cards, lines = [], []
    for i in range(CARDS):
        def renamed(text: str, i: int = i) -> str:
            text = re.sub(r"(GPU|MIG)-([0-9a-f]{6})", lambda m: f"{m.group(1)}-{i:02x}{m.group(2)[2:]}", text)
            return text.replace("00000000:19:00.0", f"00000000:{0x19 + i:02X}:00.0")
        # Pids no process here will have (the fake's own runs would otherwise come and go among them).
        extra = "".join(re.sub(r"<pid>(\d+)</pid>", f"<pid>{4_100_000 + i * 100 + n}</pid>",
                               processes[n % len(processes)]) for n in range(PROCESSES_PER_CARD))
        body = renamed(card).replace("<minor_number>0</minor_number>", f"<minor_number>{i}</minor_number>")
        body = re.sub(r"\t\t<processes>.*?</processes>",
                      lambda _, extra=extra: f"\t\t<processes>\n{extra}\t\t</processes>", body, flags=re.S)
        cards.append(body)
        lines.append(renamed(listing).replace("GPU 0:", f"GPU {i}:"))
    head = head.replace("<attached_gpus>1</attached_gpus>", f"<attached_gpus>{CARDS}</attached_gpus>")
    (directory / "q.xml").write_text(head + "".join(cards) + tail.lstrip("\n"))
    (directory / "L.txt").write_text("".join(lines))
    fake = directory / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >> {directory / "runs.log"}\n'
        f'case "$1" in -q) cat {directory / "q.xml"} ;; -L) cat {directory / "L.txt"} ;; esac\n')
    fake.chmod(0o755)
    return fake


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Server:
    """``mig-exporter serve ARGS`` on 127.0.0.1 and a free port, the code of ``src``; its
    WARNING and ERROR lines are kept. auth_flood.py runs its servers through this too."""

    def __init__(self, args: list[str], src: Path = REPO / "src") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_EXPORTER_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mig_exporter", "serve", *args, "--web.listen-address", "127.0.0.1:0"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.warnings: list[str] = []
        self.port: int | None = None
        ready = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
                if "level=WARNING" in line or "level=ERROR" in line:
                    self.warnings.append(line.rstrip())
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(30) or self.port is None:
            self.stop()
            raise SystemExit("serve did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def scrapes(port: int, count: int, clients: int, path: str = "/metrics", limit_s: float = 900,
            at: tuple[int, Callable[[], None]] | None = None) -> tuple[int, int]:
    """``count`` GETs over keep-alive connections, ``clients`` at once; (answered 200, failed).
    ``at``: (n, f) calls f once n requests have been answered."""
    deadline = time.monotonic() + limit_s
    lock = threading.Lock()
    left = [count]
    done = [0, 0]

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < deadline:
            with lock:
                if left[0] == 0:
                    break
                left[0] -= 1
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            with lock:
                done[0 if ok else 1] += 1
                if at is not None and done[0] + done[1] == at[0]:
                    at[1]()
        conn.close()

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    return done[0], done[1]


def read_errors(port: int) -> float:
    """mig_exporter_read_errors_total: reads that failed (a 200 with read_success 0 is no HTTP error)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("mig_exporter_read_errors_total{"))


def wrk(port: int, path: str, duration_s: int, connections: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t", "2", "-c", str(connections), "-d", f"{duration_s}s", "--timeout", "15s", "--latency",
         f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout

    def number(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else 0.0

    def ms(text: str) -> float:
        value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    latency = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", out, re.M))
    return {
        "requests": number(r"(\d+) requests in"),
        "requests_per_s": number(r"Requests/sec:\s+([\d.]+)"),
        "non_2xx": number(r"Non-2xx or 3xx responses: (\d+)"),
        "socket_errors": sum(int(n) for n in socket_errors.groups()) if socket_errors else 0,
        "p50_ms": ms(latency["50"]) if "50" in latency else 0.0,
        "p99_ms": ms(latency["99"]) if "99" in latency else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=30, help="seconds of each wrk run (default 30)")
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (default 50)")
    parser.add_argument("--scrapes", type=int, default=10_000, help="scrapes before the second RSS (default 10000)")
    parser.add_argument("--quick", action="store_true", help="2 s wrk runs, 10 connections, 300 scrapes")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.connections, args.scrapes = 2, 10, 300
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="mig-exporter-load-") as tmp:
        directory = Path(tmp)
        fake = large_node(directory)
        config = directory / "mig.yml"
        config.write_text(f"probe_targets:\n  node:\n    command: ['{fake}']\n    timeout: 10s\n")
        server = Server(["--nvidia-smi", str(fake), "--config.file", str(config), "--probe.max-concurrent", "4",
                         "--timeout", "10"])
        port = server.port
        assert port is not None
        figures: dict[str, object] = {"cards": CARDS, "xml_bytes": (directory / "q.xml").stat().st_size}
        try:
            figures["rss_start_kib"] = rss_kib(server.proc.pid)
            started = time.monotonic()
            # RSS is read between the runs, with no request in flight.
            ok, failed = scrapes(port, 100, 8)
            figures["rss_after_100_kib"] = rss_kib(server.proc.pid)
            more_ok, more_failed = scrapes(port, args.scrapes - 100, 8)
            figures["soak_s"] = round(time.monotonic() - started, 1)
            figures["rss_after_scrapes_kib"] = rss_kib(server.proc.pid)
            figures["scrapes"] = ok + failed + more_ok + more_failed
            figures["scrape_failures"] = failed + more_failed
            figures["reads"] = sum(1 for line in (directory / "runs.log").read_text().splitlines() if line == "-q")
            for name, path in (("metrics", "/metrics"), ("probe", "/probe?target=node")):
                before = rss_kib(server.proc.pid)
                result = wrk(port, path, args.duration, args.connections)
                figures[f"wrk_{name}"] = {**result, "rss_before_kib": before, "rss_after_kib": rss_kib(server.proc.pid)}
            figures["read_errors_total"] = read_errors(port)
        finally:
            server.stop()
        figures["server_warnings"] = server.warnings[:5]

    growth = figures["rss_after_scrapes_kib"] / figures["rss_after_100_kib"] - 1  # type: ignore[operator]
    figures["rss_growth_ratio"] = round(growth, 4)
    errors = figures["scrape_failures"] + figures["read_errors_total"] + sum(  # type: ignore[operator]
        figures[f"wrk_{n}"]["non_2xx"] + figures[f"wrk_{n}"]["socket_errors"] for n in ("metrics", "probe"))  # type: ignore[index]
    print(f"large node: {CARDS} cards, {figures['xml_bytes']} bytes of -q -x")
    print(f"RSS after 100 scrapes: {figures['rss_after_100_kib']} KiB; after {figures['scrapes']} scrapes "
          f"({figures['reads']} nvidia-smi runs, {figures['soak_s']} s): {figures['rss_after_scrapes_kib']} KiB "
          f"({growth:+.1%}); failed reads: {figures['read_errors_total']:.0f}")
    print("| path | requests | requests/s | p50 | p99 | errors | RSS before | RSS after |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("metrics", "probe"):
        r = figures[f"wrk_{name}"]
        print(f"| {name} | {r['requests']:.0f} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} ms "  # type: ignore[index]
              f"| {r['p99_ms']:.1f} ms "  # type: ignore[index]
              f"| {r['non_2xx'] + r['socket_errors']:.0f} | {r['rss_before_kib']} KiB | {r['rss_after_kib']} KiB |")  # type: ignore[index]
    print(json.dumps(figures))
    if errors:
        print(f"FAILED: {errors} requests failed", file=sys.stderr)
        return 1
    if growth > 0.10 and not args.quick:  # 300 scrapes say nothing about a leak
        print(f"FAILED: RSS grew {growth:.1%} from 100 to {figures['scrapes']} scrapes (limit 10%)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
