#!/usr/bin/env python3
"""What basic auth costs a scrape: a bcrypt check at cost 10 against a cached one, in-process and
over HTTP on 127.0.0.1 (``/-/healthy``, so the read does not count). Prints one JSON line.

    python benchmarks/auth_cost.py
"""

from __future__ import annotations

import base64
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import bcrypt

from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web.basic_auth import BasicAuth
from mig_exporter.web.server import ExporterServer
from mig_exporter.web.webconfig import WebSettings

COST = 10


def header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def main() -> None:
    hashed = bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=COST))
    auth = BasicAuth({"prometheus": hashed})
    uncached = []
    for i in range(10):  # a new password each time: never cached
        started = time.perf_counter()
        auth.check(header("prometheus", f"guess-{i}"))
        uncached.append(time.perf_counter() - started)
    auth.check(header("prometheus", "scrape-secret"))
    cached = []
    for _ in range(10_000):
        started = time.perf_counter()
        assert auth.check(header("prometheus", "scrape-secret")).ok
        cached.append(time.perf_counter() - started)

    with tempfile.TemporaryDirectory() as tmp:
        web = Path(tmp) / "web.yml"
        web.write_text(f"basic_auth_users:\n  prometheus: {hashed.decode()}\n")
        server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), timeout_s=5),
                                web=WebSettings(str(web)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)

        def get(password: str) -> float:
            started = time.perf_counter()
            conn.request("GET", "/-/healthy", headers={"Authorization": header("prometheus", password)})
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            return time.perf_counter() - started

        first = get("scrape-secret")
        later = [get("scrape-secret") for _ in range(1000)]
        conn.close()
        server.shutdown()
        server.server_close()
        with tempfile.TemporaryDirectory():
            pass
    plain_server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), timeout_s=5))
    threading.Thread(target=plain_server.serve_forever, daemon=True).start()
    conn = http.client.HTTPConnection(*plain_server.server_address[:2], timeout=10)
    plain = []
    for _ in range(1000):
        started = time.perf_counter()
        conn.request("GET", "/-/healthy")
        conn.getresponse().read()
        plain.append(time.perf_counter() - started)
    conn.close()
    plain_server.shutdown()
    plain_server.server_close()

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 3)

    print(json.dumps({
        "bcrypt_cost": COST,
        "check_uncached_median_ms": ms(uncached),
        "check_cached_median_ms": ms(cached),
        "http_first_request_ms": round(first * 1000, 3),
        "http_cached_median_ms": ms(later),
        "http_without_auth_median_ms": ms(plain),
    }))


if __name__ == "__main__":
    main()
