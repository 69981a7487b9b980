#!/usr/bin/env python3
"""Basic auth under a flood of password guesses, and what timing tells about which users exist.

1. Timing: uncached checks (a new password each time) in-process, with two users of different
   bcrypt costs (``prometheus`` at 10, ``admin`` at 12): the median for an unknown user, and for a
   wrong password of each real user.
2. Flood: ``mig-exporter serve --demo --web.config.file`` on 127.0.0.1 with basic auth (cost 10).
   Scrapers on 127.0.0.1, each with its own user and password, verified (so cached) at the start,
   scrape ``/metrics`` every 10 s on kept-alive connections, staggered (so about one scrape a
   second): p50/p95/max for one interval alone, then while N attacker connections from 127.0.0.2
   send wrong passwords, each a new one, for a bounded time. 10 s is longer than 100 guesses take,
   so a cache that let guesses push verified pairs out would have lost every scraper's. During the
   flood, a few users never seen before make their first request (an uncached check from a peer
   that has not failed): their latency too.

Prints a table, then one JSON line. Traffic goes to 127.0.0.1 only (the attackers' source address
is 127.0.0.2, on loopback too); every loop is bounded in count and time.

    python benchmarks/auth_flood.py                        # 50 and 200 attackers, 30 s each
    python benchmarks/auth_flood.py --attackers 50 --seconds 10
    python benchmarks/auth_flood.py --src /tmp/old/src     # another checkout's code (before/after)
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: benchmarks/ is on the path, its parent is not
    sys.path.insert(0, str(REPO))

from benchmarks.load import Server  # noqa: E402  (after the path is set)

COST = 10
HIGH_COST = 12
PASSWORD = "scrape-secret"
FRESH_USERS = 5
SCRAPE_TIMEOUT_S = 10.0
MAX_GUESSES = 1_000_000
ATTACKER_SOURCE = "127.0.0.2"


def header(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(value: float) -> float:
    return round(value * 1000, 1)


def timing(rounds: int) -> dict[str, float]:
    """Median uncached check for an unknown user and for each real user's wrong password."""
    import bcrypt

    from mig_exporter.web.basic_auth import BasicAuth

    users = {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=COST)),
             "admin": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=HIGH_COST))}
    auth = BasicAuth(users)
    names = {"unknown_user": "mallory", f"cost{COST}_user": "prometheus", f"cost{HIGH_COST}_user": "admin"}
    taken: dict[str, list[float]] = {label: [] for label in names}
    for i in range(rounds):  # interleaved, so a slow moment of the machine hits every kind alike
        for label, user in names.items():
            started = time.perf_counter()
            assert not auth.check(header(user, f"guess-{i}")["Authorization"]).ok
            taken[label].append(time.perf_counter() - started)
    return {f"{label}_median_ms": ms(statistics.median(values)) for label, values in taken.items()}


class Client:
    """One kept-alive connection, reopened after an error, as a scraper keeps one."""

    def __init__(self, port: int, source: str | None = None) -> None:
        self.port = port
        self.source = (source, 0) if source else None
        self.conn: http.client.HTTPConnection | None = None

    def get(self, path: str, headers: dict[str, str]) -> int:
        """The status; 0 for a timeout or a broken connection."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=SCRAPE_TIMEOUT_S,
                                                   source_address=self.source)
        try:
            self.conn.request("GET", path, headers=headers)
            response = self.conn.getresponse()
            response.read()
            if response.will_close:
                self.close()
            return response.status
        except (OSError, http.client.HTTPException):
            self.close()
            return 0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def scrapes(port: int, scrapers: dict[str, str], interval_s: float, start: float, until: float) -> tuple[
        list[float], int]:
    """Each scraper (user: password) scrapes /metrics every ``interval_s`` on its own kept-alive
    connection, as a Prometheus server does, the scrapers staggered evenly across the interval,
    from ``start`` to ``until``: (latencies, failures)."""
    lock = threading.Lock()
    taken: list[float] = []
    failed = [0]

    def scraper(i: int, user: str, password: str) -> None:
        client = Client(port)
        for n in range(100_000):
            at = start + (i / len(scrapers) + n) * interval_s
            if at >= until:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            t0 = time.perf_counter()
            status = client.get("/metrics", header(user, password))
            with lock:
                taken.append(time.perf_counter() - t0)
                failed[0] += status != 200
        client.close()

    threads = [threading.Thread(target=scraper, args=(i, user, password), daemon=True)
               for i, (user, password) in enumerate(scrapers.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(until - time.monotonic() + SCRAPE_TIMEOUT_S + 5)
    return taken, failed[0]


def flood(src: Path, attackers: int, seconds: float, scrapers: int, interval_s: float, tmp: Path) -> dict[str, Any]:
    import bcrypt

    legit = {f"prometheus{i}": f"{PASSWORD}-{i}" for i in range(scrapers)}
    fresh = {f"fresh{i}": f"fresh-secret-{i}" for i in range(FRESH_USERS)}
    users = {u: bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=COST)).decode() for u, p in {**legit, **fresh}.items()}
    web = tmp / f"web-{attackers}.yml"
    web.write_text("basic_auth_users:\n" + "".join(f"  {u}: {h}\n" for u, h in users.items()))
    server = Server(["--demo", "--web.config.file", str(web)], src)
    assert server.port is not None
    try:
        for user, password in legit.items():  # verified, so cached, before the flood
            assert Client(server.port).get("/metrics", header(user, password)) == 200
        now = time.monotonic()
        baseline, baseline_failed = scrapes(server.port, legit, interval_s, now, now + interval_s)

        stop = threading.Event()
        lock = threading.Lock()
        guesses = {"sent": 0, "refused": 0, "other": 0}

        def attack(n: int) -> None:
            client = Client(server.port or 0, ATTACKER_SOURCE)
            for i in range(MAX_GUESSES // attackers):
                if stop.is_set():
                    break
                status = client.get("/metrics", header("prometheus0", f"guess-{n}-{i}"))
                with lock:
                    guesses["sent"] += 1
                    guesses["refused" if status == 401 else "other"] += 1
            client.close()

        threads = [threading.Thread(target=attack, args=(n,), daemon=True) for n in range(attackers)]
        attack_started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(min(2.0, seconds / 5))  # the flood under way (and, before, the cache churned)
        started = time.monotonic()
        until = started + seconds
        firsts: list[float] = []
        first_failed = [0]

        def first_requests() -> None:
            client = Client(server.port or 0)
            for i, (user, password) in enumerate(fresh.items()):
                at = started + (i + 0.5) * seconds / FRESH_USERS
                time.sleep(max(0.0, at - time.monotonic()))
                t0 = time.perf_counter()
                first_failed[0] += client.get("/-/healthy", header(user, password)) != 200
                firsts.append(time.perf_counter() - t0)
            client.close()

        first_thread = threading.Thread(target=first_requests, daemon=True)
        first_thread.start()
        during, during_failed = scrapes(server.port, legit, interval_s, started, until)
        first_thread.join(SCRAPE_TIMEOUT_S * FRESH_USERS)
        stop.set()
        elapsed = time.monotonic() - attack_started
        with lock:
            answered, unanswered = guesses["refused"], guesses["other"]
        for t in threads:
            t.join(SCRAPE_TIMEOUT_S + 5)
    finally:
        server.stop()
    return {
        "attackers": attackers,
        "flood_s": seconds,
        "scrapers": scrapers,
        "scrape_interval_s": interval_s,
        "guesses_refused_per_s": round(answered / elapsed, 1),
        "guesses_unanswered": unanswered,  # timed out (10 s) in the attackers' own queue
        "baseline_scrapes": len(baseline),
        "baseline_p50_ms": ms(percentile(baseline, 0.5)),
        "baseline_p95_ms": ms(percentile(baseline, 0.95)),
        "baseline_failed": baseline_failed,
        "scrapes": len(during),
        "scrape_p50_ms": ms(percentile(during, 0.5)),
        "scrape_p95_ms": ms(percentile(during, 0.95)),
        "scrape_max_ms": ms(max(during)),
        "scrapes_failed": during_failed,
        "first_check_ms": [ms(v) for v in firsts],
        "first_checks_failed": first_failed[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attackers", default="50,200", help="attacker connections, one flood each (default 50,200)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each flood is measured (default 30)")
    parser.add_argument("--scrapers", type=int, default=10,
                        help="scrapers, each with its own user and password (default 10)")
    parser.add_argument("--scrape-interval", type=float, default=10.0,
                        help="each scraper's interval, staggered (default 10 s: longer than 100 guesses take)")
    parser.add_argument("--timing-rounds", type=int, default=5, help="uncached checks of each kind (default 5)")
    parser.add_argument("--src", type=Path, default=REPO / "src",
                        help="the mig_exporter source to run (default: this checkout's)")
    args = parser.parse_args()
    if not 0 < args.seconds <= 120:
        parser.error("--seconds: between 0 and 120")
    if not 0 < args.scrapers <= 50 or not 0 < args.scrape_interval <= 60:
        parser.error("--scrapers: 1 to 50; --scrape-interval: up to 60 s")
    counts = [int(n) for n in args.attackers.split(",") if n]
    if not counts or not all(0 < n <= 500 for n in counts):
        parser.error("--attackers: 1 to 500 each")
    src = args.src.resolve()
    sys.path.insert(0, str(src))

    import mig_exporter

    loaded = str(Path(mig_exporter.__file__).resolve().parent.parent)
    if loaded != str(src):
        raise SystemExit(f"imported mig_exporter from {loaded}, not {src}: set PYTHONPATH={src}")
    result: dict[str, Any] = {"src": str(src), "bcrypt_cost": COST, "cpus": os.cpu_count()}
    result["timing"] = timing(args.timing_rounds)
    print(f"uncached check, users of cost {COST} and {HIGH_COST} (median of {args.timing_rounds}):")
    for label, value in result["timing"].items():
        print(f"  {label:<28} {value:8.1f} ms")
    result["floods"] = []
    with tempfile.TemporaryDirectory(prefix="auth-flood-") as tmp:
        for attackers in counts:
            row = flood(src, attackers, args.seconds, args.scrapers, args.scrape_interval, Path(tmp))
            result["floods"].append(row)
            print(f"{attackers} attackers from {ATTACKER_SOURCE} for {args.seconds:g} s: "
                  f"{row['guesses_refused_per_s']} guesses refused a second ({row['guesses_unanswered']} timed out); "
                  f"{args.scrapers} scrapers every {args.scrape_interval:g} s")
            print(f"  scrape alone:       p50 {row['baseline_p50_ms']:8.1f} ms  p95 {row['baseline_p95_ms']:8.1f} ms"
                  f"  ({row['baseline_scrapes']} scrapes, {row['baseline_failed']} failed)")
            print(f"  scrape under flood: p50 {row['scrape_p50_ms']:8.1f} ms  p95 {row['scrape_p95_ms']:8.1f} ms"
                  f"  max {row['scrape_max_ms']:.1f} ms  ({row['scrapes']} scrapes, {row['scrapes_failed']} failed)")
            print(f"  first request of a new user: {row['first_check_ms']} ms "
                  f"({row['first_checks_failed']} failed)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
