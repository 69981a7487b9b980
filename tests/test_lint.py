"""ruff over the repository and mypy over the package, with their settings in
pyproject.toml: any finding fails the test, and so does a missing tool (both
are in the test extra)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _run(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # sys.executable -m: this interpreter's ruff and mypy, whatever PATH holds.
    # "No module named ruff" is a failure like any finding.
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".", timeout_s=60)
    assert result.returncode == 0, f"ruff check:\n{result.stdout}{result.stderr}"


def test_mypy_finds_nothing() -> None:
    # The files, strictness and overrides come from [tool.mypy]; the cache is
    # .mypy_cache (gitignored), which makes a second run take a few seconds.
    result = _run("mypy", timeout_s=110)
    assert result.returncode == 0, f"mypy:\n{result.stdout}{result.stderr}"
