"""The test suite's own rules: tools are found wherever scripts/test put them, and no test
is skipped in silence (a missing tool fails; a group is left out only by deselecting it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS, require_tool

_SOME_TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.container
def test_needs_a_tool():
    pytest.skip("buildah is not installed")
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_some.py").write_text(_SOME_TESTS)
    return subprocess.run(
        # no:cloudcoil as pyproject.toml's addopts say, which this run outside the repo does not read.
        [sys.executable, "-m", "pytest", "-p", "no_silent_skips", "-p", "no:cacheprovider", "-p", "no:cloudcoil", "-q",
         "-o", "markers=container: x", str(tmp_path / "test_some.py"), *args],
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"}, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )


def test_a_skip_nobody_asked_for_fails_the_run(tmp_path):
    result = _pytest(tmp_path)
    assert result.returncode == 1, result.stdout
    assert "skipped without being asked to: the run fails" in result.stdout
    assert "test_some.py::test_needs_a_tool: Skipped: buildah is not installed" in result.stdout


def test_a_group_left_out_by_name_is_deselected_and_passes(tmp_path):
    result = _pytest(tmp_path, "-m", "not container")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 deselected" in result.stdout and "skipped" not in result.stdout


def test_tools_in_the_venv_are_found_whatever_path_the_caller_has(monkeypatch):
    """hadolint and kubernetes-validate come with the test extra, into the venv's bin,
    which a caller's PATH need not hold (CI runs under env -i)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    for tool in ("hadolint", "kubernetes-validate"):
        assert require_tool(tool) == str(Path(sys.executable).parent / tool)


def test_a_missing_tool_fails_the_test_rather_than_skipping_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match=r"no-such-tool is not installed: \./scripts/test installs it"):
        require_tool("no-such-tool")
