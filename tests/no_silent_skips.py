"""A pytest plugin: no test is skipped in silence.

A skip nobody asked for hides a check that never ran (the Dockerfile lint and the manifest
validation once skipped in every local run, because their tools were not on PATH). So any
skip fails the run, listed under its own heading. Leaving a group out is done by deselecting
it (``-m "not container"``, ``./scripts/test --no-container``), which pytest reports as
"deselected", not as a skip. Registered by conftest.py.
"""

from __future__ import annotations

import pytest

_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skips and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _skips:
        terminalreporter.section("skipped without being asked to: the run fails", red=True)
        for line in _skips:
            terminalreporter.line(line)
        terminalreporter.line("a missing tool fails its test; leave a group out with -m 'not MARKER'")
