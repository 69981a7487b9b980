"""benchmarks/load.py in quick mode: the load script itself works (wrk on 127.0.0.1, a large fake
node, /metrics and /probe) and every request it makes is answered. Its figures are in
docs/reliability.md; nothing here times anything."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(120)


def test_the_load_script_runs_in_quick_mode_without_a_failed_request():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "load.py"), "--quick"],
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["cards"] == 8 and figures["scrapes"] == 300 and figures["scrape_failures"] == 0
    assert 0 < figures["reads"] <= 300, "concurrent scrapes share reads: never more runs than scrapes"
    for name in ("metrics", "probe"):
        run = figures[f"wrk_{name}"]
        assert run["requests"] > 0 and run["non_2xx"] == 0 and run["socket_errors"] == 0
        assert run["rss_after_kib"] > 0
    assert "| metrics |" in result.stdout and "| probe |" in result.stdout
