"""Clients that never read, TLS connections dropped mid-answer, a reload flood: against a real
``mig-exporter serve --demo``, does the node's monitoring stay up, and does the log stay sane?
(docs/reliability.md, "The port")

Attacks, each against a fresh server on 127.0.0.1 (soft open-file limit 1024, ``--log.level
info``, its stderr kept in a file), each lasting ``--hold`` s unless said otherwise:

- ``none``, ``none-tls-auth``: no attack, the monitor alone (the harness's baseline: 100%);
- ``nonread-healthy``: 2 connections (SO_RCVBUF 4096) pipelining ``GET /-/healthy`` as fast as
  the socket takes them, never reading; ``nonread-healthy-tls-auth``: the same over TLS to a
  server with basic auth, without credentials;
- ``nonread-metrics``: 70 such connections pipelining ``GET /metrics``;
  ``nonread-metrics-tls-auth``: the same over TLS with basic auth, with valid credentials;
- ``tls-close``: 1000 TLS connections (20 at a time) that each send ``GET /metrics`` after the
  handshake and close at once, unread;
- ``tls-pipeline-reset``: 5 TLS connections that each send 1000 pipelined ``GET /metrics``, then
  reset (SO_LINGER 0), unread;
- ``reload-flood``: 10 clients ``POST /-/reload`` for 10 s at most (``--config.file`` given).

Throughout, and for 10 s after, a monitor asks ``/-/healthy`` and ``/metrics`` (fresh connection
each, over TLS and with credentials where the server wants them) every 0.25 s with a 1 s
deadline, and samples the server's RSS. One row per attack: the share of each answered 200
within 1 s with p50/p99, peak RSS, the server's CPU seconds over the attack and after, and its
stderr: lines, lines with ERROR, lines with Traceback, bytes. Then the first traceback each
attack's server logged. ``--src DIR`` runs another checkout's code (the "before").

    python benchmarks/port_attacks.py                              # this checkout, every attack
    python benchmarks/port_attacks.py --src /path/to/old/src --attacks none,tls-close --hold 20

Bounded: every loop has a count and a deadline, and everything runs on loopback.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import http.client
import os
import re
import resource
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: benchmarks/ is on the path, its parent is not
    sys.path.insert(0, str(REPO))
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from benchmarks.slow_clients import _close_all, _cpu_s, _listening_port, _raise_own_limit, _rss_mib  # noqa: E402
from certs import Pki, make_pki  # noqa: E402 - needs tests/ on sys.path

EVERY_S = 0.25
DEADLINE_S = 1.0
AFTER_S = 10.0
USER, PASSWORD = "prometheus", "correct horse"
MAX_HOLD_S = 120.0


@dataclass(frozen=True)
class Setup:
    """How the attacked server is started."""

    tls: bool = False
    auth: bool = False
    config: bool = False


@dataclass
class Target:
    """The server as a client sees it: where, over TLS or not, with which credentials."""

    port: int
    context: ssl.SSLContext | None
    auth_header: str  # "Authorization: Basic ...\r\n", or "" when the server has no basic auth

    def connect(self, timeout: float, rcvbuf: int | None = None) -> socket.socket:
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
            raw.settimeout(timeout)
            raw.connect(("127.0.0.1", self.port))
            if self.context is None:
                return raw
            return self.context.wrap_socket(raw, server_hostname="127.0.0.1")
        except BaseException:
            raw.close()
            raise

    def request(self, method: str, path: str, credentials: bool, close: bool = False) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
        if credentials:
            head += self.auth_header
        if close:
            head += "Connection: close\r\n"
        return (head + "\r\n").encode()


# -- the monitor ----------------------------------------------------------------------------------

@dataclass
class Checks:
    ok: list[bool] = field(default_factory=list)
    took: list[float] = field(default_factory=list)
    at: list[float] = field(default_factory=list)  # seconds since the attack began

    def failed_between(self) -> str:
        """When the first and the last failed check began, or "" when none failed."""
        failed = [at for ok, at in zip(self.ok, self.at, strict=True) if not ok]
        return f"+{failed[0]:.0f}..+{failed[-1]:.0f} s" if failed else ""

    def summary(self) -> str:
        if not self.ok:
            return f"{'-':>5} {'-':>7} {'-':>7}"
        ordered = sorted(self.took)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        share = 100 * sum(self.ok) / len(self.ok)
        return f"{share:5.1f} {statistics.median(ordered) * 1000:7.1f} {p99 * 1000:7.1f}"


class Monitor(threading.Thread):
    """Asks /-/healthy and /metrics every EVERY_S, each with a DEADLINE_S deadline; samples RSS."""

    PATHS = ("/-/healthy", "/metrics")

    def __init__(self, target: Target, pid: int) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.pid = pid
        self.checks = {path: Checks() for path in self.PATHS}
        self.peak_rss = 0.0
        self.done = threading.Event()
        self.began = time.monotonic()

    def _answered_in_time(self, path: str) -> tuple[bool, float]:
        started = time.monotonic()
        received = bytearray()
        closed = False
        try:
            with self.target.connect(DEADLINE_S) as s:
                s.sendall(self.target.request("GET", path, credentials=True, close=True))
                for _ in range(100_000):
                    left = DEADLINE_S - (time.monotonic() - started)
                    if left <= 0:
                        break
                    s.settimeout(left)
                    chunk = s.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    received += chunk
        except OSError:  # refused, reset, timed out, a failed handshake
            pass
        took = time.monotonic() - started
        return closed and received.startswith(b"HTTP/1.1 200") and took <= DEADLINE_S, took

    def run(self) -> None:
        for _ in range(int(4 * MAX_HOLD_S / EVERY_S)):  # far more rounds than any attack lasts
            for path in self.PATHS:
                at = time.monotonic() - self.began
                ok, took = self._answered_in_time(path)
                self.checks[path].at.append(at)
                self.checks[path].ok.append(ok)
                self.checks[path].took.append(took)
            with contextlib.suppress(OSError):
                self.peak_rss = max(self.peak_rss, _rss_mib(self.pid))
            if self.done.wait(EVERY_S):
                return


# -- the attacks ----------------------------------------------------------------------------------

Extra = dict[str, object]

WOULD_BLOCK = (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError)


def _open(target: Target, count: int, rcvbuf: int | None = None) -> tuple[list[socket.socket], int]:
    """count connections (TLS ones handshaken), non-blocking; and how many failed to open."""
    socks: list[socket.socket] = []
    until = time.monotonic() + 30
    for _ in range(count):
        if time.monotonic() > until:
            break
        try:
            s = target.connect(5.0, rcvbuf)
        except OSError:
            continue
        s.setblocking(False)
        socks.append(s)
    return socks, count - len(socks)


def _nonread(target: Target, count: int, path: str, credentials: bool, hold_s: float) -> Extra:
    """Pipeline requests as fast as each socket takes them, never read; close after hold_s."""
    request = target.request("GET", path, credentials)
    batch = request * 16
    socks, failed = _open(target, count, rcvbuf=4096)
    # A TLS write that would block must be retried with the same bytes: each socket keeps its own.
    unsent = {s: b"" for s in socks}
    sent = broken = 0
    until = time.monotonic() + hold_s
    for _ in range(10_000_000):
        if not unsent or time.monotonic() >= until:
            break
        took_any = False
        for s in list(unsent):
            data = unsent[s] or batch
            try:
                n = s.send(data)
            except WOULD_BLOCK:
                unsent[s] = data
                continue
            except OSError:  # the server closed or reset it
                del unsent[s]
                broken += 1
                continue
            unsent[s] = data[n:]
            sent += n
            took_any = True
        if not took_any:
            time.sleep(0.02)
    _close_all(socks)
    return {"opened": len(socks), "failed": failed, "requests sent": sent // len(request),
            "broken by the server": broken}


def _then_idle(until: float) -> None:
    time.sleep(max(0.0, until - time.monotonic()))


def _tls_close(target: Target, hold_s: float) -> Extra:
    """1000 connections, 20 at a time: handshake, GET /metrics, close at once without reading."""
    request = target.request("GET", "/metrics", credentials=True)
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    started = time.monotonic()
    until = started + hold_s

    def worker(share: int) -> None:
        for _ in range(share):
            if time.monotonic() > until:
                return
            try:
                with target.connect(5.0) as s:
                    s.sendall(request)
                outcome = "sent and closed"
            except OSError:
                outcome = "failed"
            with lock:
                counts[outcome] += 1

    threads = [threading.Thread(target=worker, args=(50,), daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, until - time.monotonic() + 10))
    extra: Extra = dict(counts)
    extra["burst s"] = round(time.monotonic() - started, 1)
    _then_idle(until)
    return extra


def _tls_pipeline_reset(target: Target, hold_s: float) -> Extra:
    """5 connections each send 1000 pipelined GET /metrics (10 s at most), then reset, unread."""
    data = target.request("GET", "/metrics", credentials=True) * 1000
    until = time.monotonic() + hold_s
    socks, failed = _open(target, 5)
    done = 0
    for s in socks:
        send_until = time.monotonic() + 10
        for _ in range(100_000):
            if time.monotonic() > send_until:
                break
            try:
                s.send(data)  # TLS: all of it or nothing (no partial writes); retried with the same bytes
            except WOULD_BLOCK:
                time.sleep(0.01)
                continue
            except OSError:
                break
            done += 1
            break
    for s in socks:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    _close_all(socks)  # SO_LINGER (1, 0): the close is an RST
    _then_idle(until)
    return {"opened": len(socks), "failed": failed, "all 1000 sent": done}


def _reload_flood(target: Target, hold_s: float) -> Extra:
    """10 clients POST /-/reload on kept-alive connections (a new one after an error), reading."""
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    until = time.monotonic() + min(hold_s, 10.0)

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=5)
        mine: collections.Counter[str] = collections.Counter()
        for _ in range(100_000):
            if time.monotonic() > until:
                break
            try:
                conn.request("POST", "/-/reload", body=b"")
                answer = conn.getresponse()
                answer.read()
                mine[str(answer.status)] += 1
            except (OSError, http.client.HTTPException):
                mine["error"] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=5)
        conn.close()
        with lock:
            counts.update(mine)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return {f"reloads {key}": value for key, value in sorted(counts.items())}


def _idle(target: Target, hold_s: float) -> Extra:
    time.sleep(hold_s)
    return {}


PLAIN, TLS, TLS_AUTH = Setup(), Setup(tls=True), Setup(tls=True, auth=True)
ATTACKS: dict[str, tuple[Setup, Callable[[Target, float], Extra]]] = {
    "none": (PLAIN, _idle),
    "none-tls-auth": (TLS_AUTH, _idle),
    "nonread-healthy": (PLAIN, lambda t, hold: _nonread(t, 2, "/-/healthy", False, hold)),
    "nonread-healthy-tls-auth": (TLS_AUTH, lambda t, hold: _nonread(t, 2, "/-/healthy", False, hold)),
    "nonread-metrics": (PLAIN, lambda t, hold: _nonread(t, 70, "/metrics", False, hold)),
    "nonread-metrics-tls-auth": (TLS_AUTH, lambda t, hold: _nonread(t, 70, "/metrics", True, hold)),
    "tls-close": (TLS, _tls_close),
    "tls-pipeline-reset": (TLS, _tls_pipeline_reset),
    "reload-flood": (Setup(config=True), _reload_flood),
}


# -- the server -----------------------------------------------------------------------------------

def _web_config(setup: Setup, pki: Pki, directory: Path) -> list[str]:
    import bcrypt

    text = ""
    if setup.tls:
        text += f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
    if setup.auth:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
        text += f"basic_auth_users:\n  {USER}: {hashed}\n"
    if not text:
        return []
    path = directory / "web.yml"
    path.write_text(text)
    return ["--web.config.file", str(path)]


@contextlib.contextmanager
def serving(src: Path, setup: Setup, pki: Pki, directory: Path, log: Path) -> Iterator[tuple[int, Target]]:
    """A server for setup, its stderr in log; killed on the way out, whatever happened."""
    args = _web_config(setup, pki, directory)
    if setup.config:
        config = directory / "mig-exporter.yml"
        config.write_text("probe_targets:\n  gpu-a:\n    command: [/bin/true]\n")
        args += ["--config.file", str(config)]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    env = {**os.environ, "PYTHONPATH": str(src)}
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mig_exporter", "serve", "--demo", "--web.listen-address", "127.0.0.1:0",
             "--log.level", "info", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    try:
        port = None
        for _ in range(200):  # 20 s
            port = _listening_port(proc.pid)
            if port or proc.poll() is not None:
                break
            time.sleep(0.1)
        if not port:
            raise SystemExit(f"the server did not start listening; its log: {log}")
        context = None
        if setup.tls:
            context = ssl.create_default_context(cafile=str(pki.ca.cert))
        auth = ""
        if setup.auth:
            auth = "Authorization: Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode() + "\r\n"
        yield proc.pid, Target(port, context, auth)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _unescaped(line: str) -> str:
    """A logfmt line with its traceback's escapes (core/logs.py) undone."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m[1], m[1]), line)


def _log_facts(log: Path) -> tuple[dict[str, int], list[str]]:
    """Lines, lines with ERROR or Traceback, bytes; and the first traceback (40 lines at most).

    A record's traceback is escaped into its one line (core/logs.py); one that escaped logging
    (a thread's uncaught exception) spans lines, its last the one not indented."""
    facts = {"lines": 0, "ERROR": 0, "Traceback": 0, "bytes": log.stat().st_size}
    first: list[str] = []
    spanning = False
    with log.open("rb") as f:
        for raw in f:
            line = raw.decode(errors="replace").rstrip("\n")
            facts["lines"] += 1
            facts["ERROR"] += "ERROR" in line
            facts["Traceback"] += "Traceback" in line
            if spanning and len(first) < 40:
                first.append(line)
                spanning = line.startswith((" ", "\t"))
            elif "Traceback" in line and not first:
                first = _unescaped(line).splitlines()[:40]
                spanning = line.startswith("Traceback")
    return facts, first


# -- the run --------------------------------------------------------------------------------------

HEADER = (f"{'attack':26s} {'hlth%':>5} {'p50ms':>7} {'p99ms':>7}  {'metr%':>5} {'p50ms':>7} {'p99ms':>7}  "
          f"{'RSS':>6} {'CPU s':>6}  {'lines':>7} {'ERROR':>6} {'Trace':>6} {'bytes':>10}  alive  notes")


def run(src: Path, name: str, hold_s: float, pki: Pki, logs: Path) -> list[str]:
    setup, attack = ATTACKS[name]
    log = logs / f"{name}.stderr"
    with tempfile.TemporaryDirectory(prefix=f"port-attacks-{name}-") as tmp, \
            serving(src, setup, pki, Path(tmp), log) as (pid, target):
        monitor = Monitor(target, pid)
        cpu_before = _cpu_s(pid)
        monitor.start()
        try:
            extra = attack(target, hold_s)
            time.sleep(AFTER_S)
        finally:
            monitor.done.set()
            monitor.join(timeout=10)
        cpu = _cpu_s(pid) - cpu_before
        alive = _listening_port(pid) is not None
    facts, first = _log_facts(log)
    for path, checks in monitor.checks.items():
        if checks.failed_between():
            extra[f"{path} failed"] = checks.failed_between()
    notes = ", ".join(f"{key} {value}" for key, value in extra.items())
    print(f"{name:26s} {monitor.checks['/-/healthy'].summary()}  {monitor.checks['/metrics'].summary()}  "
          f"{monitor.peak_rss:6.1f} {cpu:6.1f}  {facts['lines']:7d} {facts['ERROR']:6d} {facts['Traceback']:6d} "
          f"{facts['bytes']:10d}  {'yes' if alive else 'NO':5s}  {notes}", flush=True)
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the src/ directory whose code to run")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma list of: {', '.join(ATTACKS)}")
    parser.add_argument("--hold", type=float, default=40.0, help=f"seconds each attack lasts (at most {MAX_HOLD_S:g})")
    parser.add_argument("--logs", type=Path, help="keep each server's stderr here as ATTACK.stderr (default: removed)")
    args = parser.parse_args()
    names = [n for n in args.attacks.split(",") if n]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks: {', '.join(unknown)}")
    _raise_own_limit()
    hold = min(max(args.hold, 1.0), MAX_HOLD_S)
    work = Path(tempfile.mkdtemp(prefix="port-attacks-"))
    try:
        pki = make_pki(work / "pki")
        logs = args.logs or work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        print(f"src {args.src}; hold {hold:g} s (+{AFTER_S:g} s after); monitor every {EVERY_S:g} s, "
              f"deadline {DEADLINE_S:g} s; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(HEADER, flush=True)
        tracebacks = {name: run(args.src, name, hold, pki, logs) for name in names}
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        for name, lines in tracebacks.items():
            if lines:
                print(f"\n-- {name}: the first traceback in the server's log\n" + "\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
