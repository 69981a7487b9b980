"""deploy/systemd/mig-exporter.service: systemd accepts it without a warning, and every
flag of its ExecStart is a real ``serve`` option.

systemd-analyze comes from Debian's ``systemd`` package. When it is missing these tests
fail: ``scripts/test`` installs it.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from conftest import REPO, require_tool

UNIT = REPO / "deploy" / "systemd" / "mig-exporter.service"
BINARY = "/usr/local/bin/mig-exporter"

def _exec_start() -> list[str]:
    (line,) = [line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def _verify(unit_dir: Path, text: str) -> subprocess.CompletedProcess[str]:
    unit = unit_dir / UNIT.name
    unit.write_text(text)
    return subprocess.run([require_tool("systemd-analyze"), "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_systemd_analyze_verify_finds_nothing(tmp_path: Path):
    """verify also checks that ExecStart's binary exists and is executable, and the tests
    do not install mig-exporter in /usr/local/bin: the copy verified runs `true` instead,
    with every other line as shipped."""
    text = UNIT.read_text()
    assert text.count(f"ExecStart={BINARY} ") == 1
    true = shutil.which("true")
    assert true
    result = _verify(tmp_path, text.replace(f"ExecStart={BINARY} ", f"ExecStart={true} "))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_verify_is_not_vacuous(tmp_path: Path):
    """The same check fails on a misspelt setting and on a missing binary."""
    true = shutil.which("true")
    assert true
    text = UNIT.read_text().replace(f"ExecStart={BINARY} ", f"ExecStart={true} ")
    result = _verify(tmp_path, text.replace("ProtectSystem=strict", "ProtectSystem=strict\nProtectSystm=strict"))
    assert "Unknown key 'ProtectSystm' in section [Service]" in result.stdout + result.stderr
    result = _verify(tmp_path, UNIT.read_text().replace(f"ExecStart={BINARY} ", "ExecStart=/nonexistent/mig-exporter "))
    assert result.returncode != 0
    assert "/nonexistent/mig-exporter is not executable" in result.stdout + result.stderr


def test_the_unit_is_hardened():
    settings = dict(line.split("=", 1) for line in UNIT.read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    assert {key: settings[key] for key in (
        "DynamicUser", "ProtectSystem", "ProtectHome", "NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectControlGroups", "RestrictAddressFamilies", "RestrictNamespaces",
        "LockPersonality", "MemoryDenyWriteExecute", "SystemCallFilter", "CapabilityBoundingSet", "Restart",
        "PrivateDevices")} == {
        "DynamicUser": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "NoNewPrivileges": "yes",
        "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes", "LockPersonality": "yes", "MemoryDenyWriteExecute": "yes",
        "SystemCallFilter": "@system-service", "CapabilityBoundingSet": "", "Restart": "on-failure",
        "PrivateDevices": "no",
    }
    # These would hide other users' processes, or show their uids as nobody.
    assert "ProtectProc" not in settings and "PrivateUsers" not in settings


def test_exec_start_flags_are_serve_options():
    from mig_exporter.cli import cli

    argv = _exec_start()
    assert argv[:2] == [BINARY, "serve"]
    flags = [arg for arg in argv[2:] if arg.startswith("--")]
    assert flags == ["--no-kubernetes", "--host.passwd", "--web.listen-address"]
    options = {opt for param in cli.commands["serve"].params for opt in (*param.opts, *param.secondary_opts)}
    assert "--no-kubernetes" in options and "--web.listen-address" in options
    assert "--host.passwd" in flags
    assert [flag for flag in flags if flag not in options] == []
