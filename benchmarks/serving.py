"""The exporter under test, served: a fake ``nvidia-smi`` that only writes its files,
``mig-exporter serve`` on a free port of 127.0.0.1, scraped as Prometheus scrapes it, and the
serving process's CPU time and peak RSS. Every benchmark that serves the exporter starts it here.

Imports nothing of benchmarks/: run.py, procscan.py, nvml_lib.py and fleet.py import this.
"""

from __future__ import annotations

import gzip
import http.client
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mig_exporter

# What Prometheus 2.42 (Debian's, which the tests run) sends with every scrape.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_HEADERS = {
    "Accept": PROMETHEUS_ACCEPT,
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.42.0",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
}


def write_fake_nvidia_smi(directory: Path, xml: bytes | list[bytes], listing: bytes, query_s: float = 0.0,
                          pmon: bytes | None = None) -> Path:
    """A fake nvidia-smi that only writes the files (tests/conftest.py's, without logging);
    with ``query_s``, ``-q -x`` first takes that long, as the driver's own query does. Given several
    reports, ``-q -x`` writes them in turn, one a run (a counter file says which is next). ``pmon``:
    what ``pmon`` writes (``scenarios.pmon``; the exporter runs it where a whole card has processes),
    else it fails, as a driver without it would."""
    reports = [xml] if isinstance(xml, bytes) else xml
    for n, report in enumerate(reports):
        (directory / f"q{n}.xml").write_bytes(report)
    (directory / "L.txt").write_bytes(listing)
    if pmon is not None:
        (directory / "pmon.txt").write_bytes(pmon)
    q = shlex.quote(str(directory / "q"))
    if len(reports) == 1:
        query = f"exec cat {q}0.xml"
    else:
        counter = shlex.quote(str(directory / "next"))
        (directory / "next").write_text("0\n")
        query = f"n=$(cat {counter}); echo $(( (n + 1) % {len(reports)} )) > {counter}; exec cat {q}$n.xml"
    script = directory / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  -q) {f'sleep {query_s}; ' if query_s else ''}{query} ;;\n"
        f"  -L) exec cat {shlex.quote(str(directory / 'L.txt'))} ;;\n"
        + (f"  pmon) exec cat {shlex.quote(str(directory / 'pmon.txt'))} ;;\n" if pmon is not None else "")
        + "esac\n"
        "exit 2\n"
    )
    script.chmod(0o755)
    return script


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(fake: Path, proc_root: Path | None = None) -> tuple[subprocess.Popen, int]:
    """``mig-exporter serve`` on the fake, as it runs with no options but these: every engine preset
    on, Kubernetes on (the kubelet's default socket and log directory), owners read from the cgroups
    of ``proc_root`` (this machine's /proc when None)."""
    extra = [] if proc_root is None else ["--proc.root", str(proc_root)]
    return start_serve(["--source", "nvidia-smi", "--nvidia-smi", str(fake), "--log-level", "warning", *extra])


def start_serve(options: list[str], env: dict[str, str] | None = None,
                within_s: float = 20.0) -> tuple[subprocess.Popen, int]:
    """``mig-exporter serve`` with ``options`` on a free port of 127.0.0.1, in ``env`` (this
    process's by default), running the same mig_exporter as this process; once /-/healthy answers."""
    port = free_port()
    env = dict(os.environ if env is None else env)
    package_root = str(Path(mig_exporter.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mig_exporter", "serve", *options, "--web.listen-address", f"127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mig-exporter serve exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/-/healthy")
            if conn.getresponse().status == 200:
                conn.close()
                return proc, port
        except OSError:
            time.sleep(0.05)
    stop_server(proc)
    raise RuntimeError(f"mig-exporter serve did not answer /-/healthy within {within_s:.0f}s")


def stop_server(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, ``grace_s`` seconds to exit (a Prometheus writes its head out), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stderr:
        proc.stderr.close()


class Scrape:
    """GET /metrics with Prometheus' headers over one kept-alive connection; the body, gunzipped."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def __call__(self) -> bytes:
        body, gzipped = self.raw()
        return gzip.decompress(body) if gzipped else body

    def raw(self) -> tuple[bytes, bool]:
        """The body as sent, and whether it is gzipped: what a timed loop measures (the client's
        gunzip is not the server's cost)."""
        self.conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
        response = self.conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}")
        return body, response.getheader("Content-Encoding") == "gzip"

    def close(self) -> None:
        self.conn.close()


def cpu_seconds(pid: int) -> float:
    """User and system time of the process itself (its reaped children not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
