"""The ``mig-exporter`` command, run for real as ``python -m mig_exporter`` in a
subprocess, against the fake nvidia-smi and the bundled demo."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import MIB, FakeSmi, fixture_bytes, samples, value
from proc_tree import Proc, make_proc

pytestmark = pytest.mark.timeout(60)

RUN_TIMEOUT_S = 30
DRIVER_ERROR = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


# --- helpers -----------------------------------------------------------------------------------

def cli_env(**overrides: str) -> dict[str, str]:
    """The test's environment without any MIG_EXPORTER_* setting, plus the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_EXPORTER_")}
    env.update(overrides)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mig_exporter", *args],
        env=env if env is not None else cli_env(),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def label_sets(parsed: dict, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls), _ in parsed.items() if n == name]


def without_duration(text: str) -> str:
    """The exposition less the read duration, which differs from one read to the next."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("mig_exporter_read_duration_seconds{"))


ERROR_LINE = re.compile(r"^(?:mig-exporter: error: |Error: )(?P<message>.+)$")


def error_message(stderr: str) -> str:
    """The one error line of a failed command, without its prefix. Anything else on stderr must be
    a log line: a usage error is one line, not a usage screen, and never a traceback."""
    other = [line for line in stderr.splitlines() if line.strip() and not line.startswith("ts=")]
    assert len(other) == 1, f"expected one error line, got: {other}"
    match = ERROR_LINE.match(other[0])
    assert match, f"not an error line: {other[0]!r}"
    return match.group("message")


def h100_fake(fake_nvidia_smi: FakeSmi, **kwargs) -> Path:
    return fake_nvidia_smi(
        xml=fixture_bytes("h100-mig-processes.xml"), listing=fixture_bytes("h100-mig-processes.L.txt"), **kwargs
    )


def h100_host_proc(root: Path) -> Path:
    """The /proc of the h100-mig-processes host: its three GPU processes, no engine."""
    return make_proc(root, [
        Proc(21180, "memhog", ["/root/tools/memhog", "2296"], exe="/root/tools/memhog"),
        Proc(21181, "memhog", ["/root/tools/memhog", "1272"], exe="/root/tools/memhog"),
        Proc(21198, "gpu_burn", ["./gpu_burn", "3600"], exe="/root/gpu-burn/gpu_burn"),
    ])


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    log: list[str] = field(default_factory=list)

    def get(self, path: str, timeout: float = 15) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None, startup_s: float = 15,
            preexec_fn: Callable[[], None] | None = None) -> Iterator[Server]:
    """Start ``serve`` on 127.0.0.1, learn its port from the log, and always kill it at the end.
    ``preexec_fn`` runs in the child before it starts (to set a resource limit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mig_exporter", "serve", *args],
        env=env if env is not None else cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def drain() -> None:  # keeps the pipe from filling while the test runs
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line.rstrip("\n"))
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + startup_s
        url = None
        while url is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"serve did not log its address within {startup_s}s: {log}")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"serve exited with {proc.wait()} before listening: {log}")
            match = re.search(r"listening on (https?://127\.0\.0\.1:(\d+))", line)
            if match:
                url = match.group(1)
        yield Server(proc, url, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=5)


# --- version and usage -------------------------------------------------------------------------

def test_a_bare_command_prints_the_usage_once_and_no_error_line() -> None:
    result = run_cli()

    assert result.returncode == 2
    assert result.stderr.startswith("Usage: mig-exporter [OPTIONS] COMMAND [ARGS]...")
    assert "Commands:" in result.stderr
    assert "mig-exporter: error" not in result.stderr and "--help'" not in result.stderr
    assert result.stderr.count("Usage:") == 1


def test_an_option_without_its_value_points_at_the_commands_own_help() -> None:
    result = run_cli("read", "--source")

    assert result.returncode == 2
    assert error_message(result.stderr) == "Option '--source' requires an argument. (see 'mig-exporter read --help')"


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == "mig-exporter 0.1.0\n"


def test_bad_flag_is_a_usage_error_with_one_error_line() -> None:
    result = run_cli("read", "--no-such-flag")

    assert result.returncode == 2
    assert result.stdout == ""
    assert error_message(result.stderr).startswith("No such option '--no-such-flag'")


def test_timeout_out_of_range_is_a_usage_error() -> None:
    result = run_cli("read", "--demo", "--timeout", "0")
    assert result.returncode == 2
    assert "--timeout" in error_message(result.stderr)


# --- read --------------------------------------------------------------------------------------

def test_read_prints_the_series_of_a_mig_node(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    fake = h100_fake(fake_nvidia_smi)
    result = run_cli("read", "--nvidia-smi", str(fake), "--proc.root", str(h100_host_proc(tmp_path / "proc")),
                     "--log.level", "info")

    assert result.returncode == 0, result.stderr
    parsed = samples(result.stdout)
    used = {d["index"]: value(parsed, "mig_exporter_device_memory_used_bytes", index=d["index"])
            for d in label_sets(parsed, "mig_exporter_device_memory_used_bytes")}
    assert used == {"1000": 3594 * MIB, "1001": 17 * MIB, "1002": 7493 * MIB, "1003": 9 * MIB}
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * 1048576
    assert value(parsed, "mig_exporter_device_memory_total_bytes", index="1000", mig_profile="3g.40gb") == 42412802048
    assert value(parsed, "mig_exporter_device_memory_free_bytes", index="1002") == 2491 * MIB
    assert value(parsed, "mig_exporter_device_info", index="1003", mig_profile="1g.10gb",
                 uuid="MIG-45ee6ebc-57f4-5590-941e-1f037860cf29", gpu_instance="10", compute_instance="0",
                 device="0/mig3") == 1

    assert label_sets(parsed, "mig_exporter_process_memory_used_bytes") == [
        {"card": "0", "index": "1000", "mig_profile": "3g.40gb", "pid": "21180"},
        {"card": "0", "index": "1000", "mig_profile": "3g.40gb", "pid": "21181"},
        {"card": "0", "index": "1002", "mig_profile": "1g.10gb", "pid": "21198"},
    ]
    assert value(parsed, "mig_exporter_process_memory_used_bytes", pid="21198", index="1002",
                 mig_profile="1g.10gb") == 7847542784
    assert value(parsed, "mig_exporter_process_info", pid="21198", process_name="./gpu_burn", process_type="C") == 1
    assert value(parsed, "mig_exporter_device_processes", index="1000") == 2
    assert value(parsed, "mig_exporter_card_mig_instances", card="0") == 4
    assert value(parsed, "mig_exporter_card_utilization_ratio", card="0") is None  # MIG: unknown, not 0
    assert value(parsed, "mig_exporter_read_success", source="nvidia-smi") == 1
    assert value(parsed, "mig_exporter_read_errors_total", source="nvidia-smi") == 0
    assert value(parsed, "mig_exporter_read_problems", source="nvidia-smi") == 0
    # No engine on this host: every preset is counted, at an explicit 0.
    assert value(parsed, "mig_exporter_host_pid_namespace") == 1
    assert {d["engine"]: value(parsed, "mig_exporter_engine_processes", **d)
            for d in label_sets(parsed, "mig_exporter_engine_processes")} == {
        "llama.cpp": 0, "ollama": 0, "vllm": 0, "sglang": 0, "tgi": 0, "triton": 0, "tensorrt-llm": 0}
    assert label_sets(parsed, "mig_exporter_engine_memory_used_bytes") == []
    assert value(parsed, "mig_exporter_build_info", version="0.1.0") == 1
    assert f"reading through nvidia-smi ({fake}, timeout 10s): {fake} found" in result.stderr


def test_read_demo_prints_the_demo_series() -> None:
    result = run_cli("read", "--demo")

    assert result.returncode == 0, result.stderr
    parsed = samples(result.stdout)
    assert sorted(
        (d["index"], d["mig_profile"]) for d in label_sets(parsed, "mig_exporter_device_memory_used_bytes")
    ) == [("1", ""), ("1000", "3g.40gb"), ("1001", "2g.20gb"), ("1002", "1g.10gb")]
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1000") == 12229541888
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1") == 23184015360
    assert value(parsed, "mig_exporter_card_mig_instances", card="0") == 3
    # The Vulkan llama-server: a graphics process on the whole card 1.
    assert value(parsed, "mig_exporter_process_info", pid="50102", index="1", card="1",
                 process_name="/usr/local/bin/llama-server", process_type="G") == 1
    assert value(parsed, "mig_exporter_process_memory_used_bytes", pid="50102") == 20480 * MIB
    assert value(parsed, "mig_exporter_read_success", source="demo") == 1
    assert value(parsed, "mig_exporter_read_success", source="nvidia-smi") is None
    assert result.stderr == "", "read logs nothing at its default level when all is well (cron mails stderr)"
    # The demo's host: two llama-servers on the GPU, one asked for -ngl 99 on none.
    assert value(parsed, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid="50102") == 20480 * MIB
    assert value(parsed, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid="52040") == 0
    assert value(parsed, "mig_exporter_engine_info", pid="52040", index="") == 1
    assert value(parsed, "mig_exporter_engine_processes", engine="llama.cpp") == 3


def test_read_output_writes_the_file_atomically(tmp_path: Path) -> None:
    out_dir = tmp_path / "textfile"
    out_dir.mkdir()
    target = out_dir / "mig.prom"
    target.write_text("old content\n")
    target.chmod(0o600)
    old_inode = target.stat().st_ino

    old_umask = os.umask(0o077)  # the mode must be set, not left to the caller's umask
    try:
        result = run_cli("read", "--demo", "--output", str(target))
    finally:
        os.umask(old_umask)
    printed = run_cli("read", "--demo")

    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    written = target.read_text()
    # Whole: the answer's last family, the count of its samples, is there.
    assert 'mig_exporter_build_info{version="0.1.0"} 1.0\n' in written
    # 215: issue 37 added 35 to the demo's 180: its kernel log's 3 XIDs (count, time, process: 9),
    # whether it reads (1) and its lines dropped by reason (2), card 1's margin (1), 10 clock-event
    # counters, 8 PCIe link values and 4 health reasons; 219: issue 38 the clamped-timeout and
    # client-timeout counters (2) and the XID series folded, by reason (2); 227: issue 39 the
    # per-process SM and memory activity of card 1's two processes (4, from the demo's pmon) and
    # each device's activity_unknown{reason="not_read"} (4: the XML gives no GPM).
    assert written.endswith("mig_exporter_scrape_series 227.0\n")
    assert without_duration(written) == without_duration(printed.stdout)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert target.stat().st_ino != old_inode, "the file was rewritten in place, not renamed over"
    assert sorted(p.name for p in out_dir.iterdir()) == ["mig.prom"], "a temporary file was left behind"


def test_read_output_of_a_failed_read_still_writes_read_success_0(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="fail")
    target = tmp_path / "mig.prom"
    result = run_cli("read", "--nvidia-smi", str(fake), "--output", str(target))

    assert result.returncode == 1
    assert value(samples(target.read_text()), "mig_exporter_read_success", source="nvidia-smi") == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_read_output_with_no_source_at_all_replaces_a_stale_file_with_read_success_0(tmp_path: Path) -> None:
    """No NVML (this machine has none) and no nvidia-smi: node_exporter must not go on
    serving the read_success 1 of an old file."""
    target = tmp_path / "mig.prom"
    stale = run_cli("read", "--demo", "--output", str(target))
    assert stale.returncode == 0 and "mig_exporter_device_memory_used_bytes" in target.read_text()

    result = run_cli("read", "--output", str(target), env=cli_env(PATH=str(tmp_path / "empty")))

    assert result.returncode == 1
    written = samples(target.read_text())
    assert value(written, "mig_exporter_read_success", source="auto") == 1 - 1
    assert value(written, "mig_exporter_read_errors_total", source="auto") == 1
    assert not any(name == "mig_exporter_device_memory_used_bytes" for name, _ in written), "no stale device left"
    assert "no source: NVML cannot be initialised" in result.stderr and "nvidia-smi: not found on PATH" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mig.prom"]


def test_read_output_with_an_explicit_missing_binary_also_writes_read_success_0(tmp_path: Path) -> None:
    target = tmp_path / "mig.prom"
    target.write_text('mig_exporter_read_success{source="nvidia-smi"} 1.0\n')
    result = run_cli("read", "--nvidia-smi", "/nonexistent/nvidia-smi", "--output", str(target))

    assert result.returncode == 1
    assert value(samples(target.read_text()), "mig_exporter_read_success", source="nvidia-smi") == 0
    assert "/nonexistent/nvidia-smi: no such file" in result.stderr


def test_read_output_into_a_missing_directory_is_a_one_line_error(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "mig.prom"
    result = run_cli("read", "--demo", "--output", str(target))

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert str(target.parent) in error_message(result.stderr)


def test_read_output_relative_to_the_working_directory(tmp_path: Path) -> None:
    result = run_cli("read", "--demo", "-o", "mig.prom", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert value(samples((tmp_path / "mig.prom").read_text()), "mig_exporter_read_success", source="demo") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mig.prom"]


def test_read_against_a_failing_nvidia_smi_exits_1_but_prints_read_success_0(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="fail", stderr=DRIVER_ERROR)
    result = run_cli("read", "--nvidia-smi", str(fake))

    assert result.returncode == 1
    assert 'mig_exporter_read_success{source="nvidia-smi"} 0.0' in result.stdout.splitlines()
    parsed = samples(result.stdout)
    assert value(parsed, "mig_exporter_read_errors_total", source="nvidia-smi") == 1
    assert label_sets(parsed, "mig_exporter_device_memory_used_bytes") == []  # not reported as 0
    assert DRIVER_ERROR in result.stderr
    assert "Traceback" not in result.stderr


def test_read_with_a_failing_listing_still_succeeds(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    fake = h100_fake(fake_nvidia_smi, list_mode="fail")
    result = run_cli("read", "--nvidia-smi", str(fake), "--proc.root", str(h100_host_proc(tmp_path / "proc")),
                     "--log.level", "info")

    assert result.returncode == 0, result.stderr
    parsed = samples(result.stdout)
    assert value(parsed, "mig_exporter_read_success", source="nvidia-smi") == 1
    assert value(parsed, "mig_exporter_read_problems", source="nvidia-smi") == 1
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002", mig_profile="") == 7493 * MIB
    assert "nvidia-smi -L failed" in result.stderr


def test_read_with_an_explicit_missing_binary_is_a_one_line_error() -> None:
    result = run_cli("read", "--nvidia-smi", "/nonexistent/nvidia-smi")

    assert result.returncode == 1
    assert result.stdout == ""
    assert error_message(result.stderr) == (
        "/nonexistent/nvidia-smi: no such file "
        "(give --nvidia-smi PATH, or --demo to try the exporter without a GPU)"
    )


@pytest.mark.parametrize("kind, why", [
    ("directory", "is a directory, not an executable file"),
    ("no run bit", "not executable (no permission to run it)"),
    ("broken link", "a broken symbolic link"),
])
def test_read_says_why_an_explicit_binary_cannot_run(tmp_path: Path, kind: str, why: str) -> None:
    path = tmp_path / "nvidia-smi"
    if kind == "directory":
        path.mkdir()
    elif kind == "no run bit":
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644)
    else:
        path.symlink_to(tmp_path / "gone")
    if kind == "no run bit" and os.access(path, os.X_OK):
        pytest.fail("root may run a file without a run bit only when one is set; the file must have none")
    result = run_cli("read", "--nvidia-smi", str(path))

    assert result.returncode == 1
    assert error_message(result.stderr) == f"{path}: {why} (give --nvidia-smi PATH, or --demo to try the exporter " \
                                           "without a GPU)"


def test_read_with_the_default_binary_absent_from_path_is_an_error(tmp_path: Path) -> None:
    result = run_cli("read", "--source", "nvidia-smi", env=cli_env(PATH=str(tmp_path)))

    assert result.returncode == 1
    assert result.stdout == ""
    assert error_message(result.stderr) == (
        "nvidia-smi: not found on PATH (give --nvidia-smi PATH, or --demo to try the exporter without a GPU)"
    )


def test_read_auto_with_neither_nvml_nor_nvidia_smi_names_both_reasons(tmp_path: Path) -> None:
    # This machine has no libnvidia-ml, so auto finds neither path.
    result = run_cli("read", env=cli_env(PATH=str(tmp_path)))

    assert result.returncode == 1
    message = error_message(result.stderr)
    assert message.startswith("no source: NVML cannot be initialised: NVML_ERROR_LIBRARY_NOT_FOUND")
    assert "; nvidia-smi: not found on PATH" in message


# --- every option from the environment ---------------------------------------------------------

# --- engines: --config.file and --proc.root -----------------------------------------------------

ENGINES_CONFIG = """\
# Only our own server and llama.cpp.
engines:
  presets:
    ollama: false
    vllm: false
    sglang: false
    tgi: false
    triton: false
    tensorrt-llm: false
  rules:
    - name: memhog
      exe: memhog
"""


def test_read_with_a_config_file_and_a_proc_root(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    config = tmp_path / "mig-exporter.yml"
    config.write_text(ENGINES_CONFIG)
    proc = h100_host_proc(tmp_path / "proc")
    result = run_cli("read", "--nvidia-smi", str(h100_fake(fake_nvidia_smi)), "--config.file", str(config),
                     "--proc.root", str(proc), "--log.level", "info")

    assert result.returncode == 0, result.stderr
    parsed = samples(result.stdout)
    assert {d["engine"]: value(parsed, "mig_exporter_engine_processes", **d)
            for d in label_sets(parsed, "mig_exporter_engine_processes")} == {"memhog": 2, "llama.cpp": 0}
    assert value(parsed, "mig_exporter_engine_memory_used_bytes", engine="memhog", pid="21180") == 2296 * MIB
    assert value(parsed, "mig_exporter_engine_memory_used_bytes", engine="memhog", pid="21181") == 1272 * MIB
    assert value(parsed, "mig_exporter_engine_info", pid="21181", comm="memhog", index="1000") == 1
    assert re.search(r"level=INFO .*reading engines: memhog, llama.cpp \(/proc: .*/proc\)", result.stderr)


def test_config_file_and_proc_root_from_the_environment(fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    config = tmp_path / "mig-exporter.yml"
    config.write_text(ENGINES_CONFIG)
    proc = h100_host_proc(tmp_path / "proc")
    result = run_cli("read", "--nvidia-smi", str(h100_fake(fake_nvidia_smi)),
                     env=cli_env(MIG_EXPORTER_CONFIG_FILE=str(config), MIG_EXPORTER_PROC_ROOT=str(proc)))

    assert result.returncode == 0, result.stderr
    assert value(samples(result.stdout), "mig_exporter_engine_processes", engine="memhog") == 2


def test_a_bad_config_file_gives_every_problem_one_line_each(tmp_path: Path) -> None:
    config = tmp_path / "bad.yml"
    config.write_text("engines:\n  presets: {vllm: maybe}\n  rules:\n    - name: x\n      cmdline: ['(']\n")
    for command in (["read", "--demo"], ["serve", "--demo", "--web.listen-address", "127.0.0.1:0"]):
        result = run_cli(*command, "--config.file", str(config))

        assert result.returncode == 1
        errors = [line for line in result.stderr.splitlines() if line.startswith("mig-exporter: error:")]
        assert errors == [
            f"mig-exporter: error: {config}: engines.presets.vllm: must be true or false, not a string",
            f"mig-exporter: error: {config}: engines.rules[0].cmdline[0]: '(' is not a valid regular expression "
            "(missing ), unterminated subpattern at position 0)",
        ]
        assert "listening" not in result.stderr


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    result = run_cli("read", "--demo", "--config.file", str(tmp_path / "none.yml"))
    assert result.returncode == 1
    assert error_message(result.stderr) == f"{tmp_path}/none.yml: cannot read: No such file or directory"


def test_nvidia_smi_from_the_environment(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi)
    result = run_cli("read", env=cli_env(MIG_EXPORTER_NVIDIA_SMI=str(fake)))

    assert result.returncode == 0, result.stderr
    parsed = samples(result.stdout)
    assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * MIB
    assert (fake.parent / "calls.log").exists()


def test_timeout_from_the_environment(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="hang")
    started = time.monotonic()
    result = run_cli("read", env=cli_env(MIG_EXPORTER_NVIDIA_SMI=str(fake), MIG_EXPORTER_TIMEOUT="0.5"))
    elapsed = time.monotonic() - started

    assert result.returncode == 1
    assert elapsed < 5, "the default timeout (10 s) was used instead of MIG_EXPORTER_TIMEOUT"
    assert 'mig_exporter_read_success{source="nvidia-smi"} 0.0' in result.stdout.splitlines()
    assert "timed out after 0.5s" in result.stderr


@pytest.mark.parametrize("args, env", [
    (["--source", "demo"], {}),
    (["--demo"], {}),
    ([], {"MIG_EXPORTER_SOURCE": "demo"}),
    ([], {"MIG_EXPORTER_DEMO": "1"}),
])
def test_source_demo_is_the_demo_processes_and_all(args: list[str], env: dict[str, str]) -> None:
    """--source demo was once the demo GPU over this host's /proc: every engine metric gone,
    read_problems 1 and an empty pod family. Every spelling now gives the same exposition."""
    result = run_cli("read", *args, env=cli_env(**env))
    reference = run_cli("read", "--demo")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert without_duration(result.stdout) == without_duration(reference.stdout)
    parsed = samples(result.stdout)
    assert value(parsed, "mig_exporter_read_problems", source="demo") == 0
    assert value(parsed, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid="52040") == 0
    assert "# HELP mig_exporter_pod_memory_used_bytes" not in result.stdout, "a family without samples is left out"


def test_demo_from_the_environment() -> None:
    result = run_cli("read", env=cli_env(MIG_EXPORTER_DEMO="1", MIG_EXPORTER_NVIDIA_SMI="/nonexistent/nvidia-smi"))

    assert result.returncode == 0, result.stderr
    assert value(samples(result.stdout), "mig_exporter_read_success", source="demo") == 1


def test_output_from_the_environment(tmp_path: Path) -> None:
    target = tmp_path / "mig.prom"
    result = run_cli("read", "--demo", env=cli_env(MIG_EXPORTER_OUTPUT=str(target)))

    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert value(samples(target.read_text()), "mig_exporter_read_success", source="demo") == 1


def test_log_level_from_the_environment() -> None:
    quiet = run_cli("read", "--demo", env=cli_env(MIG_EXPORTER_LOG_LEVEL="error"))
    chatty = run_cli("read", "--demo", env=cli_env(MIG_EXPORTER_LOG_LEVEL="debug"))

    assert quiet.returncode == 0 and chatty.returncode == 0
    assert quiet.stderr == ""
    assert "level=INFO" in chatty.stderr


@pytest.mark.parametrize("variable, option, args", [
    ("MIG_EXPORTER_TIMEOUT", "--timeout", ["read", "--demo"]),
    ("MIG_EXPORTER_LOG_LEVEL", "--log-level", ["read", "--demo"]),
    ("MIG_EXPORTER_LOG_FORMAT", "--log.format", ["read", "--demo"]),
    ("MIG_EXPORTER_WEB_TIMEOUT_OFFSET", "--web.timeout-offset",
     ["serve", "--demo", "--web.listen-address", "127.0.0.1:0"]),
    ("MIG_EXPORTER_WEB_LISTEN_ADDRESS", "--web.listen-address", ["serve", "--demo"]),
    ("MIG_EXPORTER_PROBE_MAX_CONCURRENT", "--probe.max-concurrent",
     ["serve", "--demo", "--web.listen-address", "127.0.0.1:0"]),
])
def test_a_bad_value_in_the_environment_is_a_usage_error(variable: str, option: str, args: list[str]) -> None:
    # Refusing the value proves the variable is read.
    result = run_cli(*args, env=cli_env(**{variable: "nonsense"}), timeout=15)

    assert result.returncode == 2
    message = error_message(result.stderr)
    assert option in message
    assert "nonsense" in message


# --- serve -------------------------------------------------------------------------------------

def test_serve_demo_answers_metrics_and_stops_on_sigterm() -> None:
    with serving("--web.listen-address", "127.0.0.1:0", "--demo") as server:
        status, body = server.get("/metrics")
        assert status == 200
        parsed = samples(body)
        assert value(parsed, "mig_exporter_read_success", source="demo") == 1
        assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1001", mig_profile="2g.20gb") == 9700376576
        assert value(parsed, "mig_exporter_process_info", pid="50102", process_type="G") == 1

        server.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert server.proc.wait(timeout=5) == 0
        assert time.monotonic() - started < 5
    assert any("received SIGTERM" in line for line in server.log)
    assert not any("Traceback" in line for line in server.log)


def _without_duration_lines(body: bytes) -> bytes:
    """The exposition less its ``mig_exporter_read_duration_seconds`` sample, which differs from
    one read to the next; every other byte kept as it is."""
    return b"".join(line for line in body.splitlines(keepends=True)
                    if not line.startswith(b"mig_exporter_read_duration_seconds{"))


@pytest.mark.parametrize("kind", ["demo", "fake nvidia-smi"])
def test_read_and_a_scrape_of_serve_give_the_same_bytes(kind: str, fake_nvidia_smi: FakeSmi, tmp_path: Path) -> None:
    """One exporter and one encoder for both: of the same snapshot, ``read`` prints what a scrape
    without a header gets, byte for byte but the read's duration (the only sample that is not the
    snapshot's or a count; the build info is the same version in both)."""
    if kind == "demo":
        args = ["--demo"]
    else:
        args = ["--nvidia-smi", str(h100_fake(fake_nvidia_smi)), "--proc.root", str(h100_host_proc(tmp_path / "proc")),
                "--no-kubernetes"]
    result = subprocess.run([sys.executable, "-m", "mig_exporter", "read", *args], env=cli_env(),
                            stdin=subprocess.DEVNULL, capture_output=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    with serving("--web.listen-address", "127.0.0.1:0", *args) as server, \
            urllib.request.urlopen(server.url + "/metrics", timeout=15) as response:
        scraped = response.read()
    assert b"mig_exporter_device_memory_used_bytes{" in scraped
    assert scraped.count(b"mig_exporter_read_duration_seconds{") == 1
    assert _without_duration_lines(result.stdout) == _without_duration_lines(scraped)


def test_build_server_assembles_what_serve_runs(tmp_path: Path, fake_nvidia_smi: FakeSmi) -> None:
    """serve's options to a listening server, without the process around it (signals, the
    subreaper): the scrape, the probe targets, and the counters about probes on /metrics."""
    from mig_exporter.cli import build_server

    fake = h100_fake(fake_nvidia_smi)
    config = probe_config(tmp_path / "mig.yml", gpu_a=h100_fake(fake_nvidia_smi))
    server = build_server(
        source="nvidia-smi", nvidia_smi=str(fake), timeout=5.0, config_file=str(config),
        proc_root=str(h100_host_proc(tmp_path / "proc")), host_passwd=None, kubernetes=False,
        pod_resources_socket="", kubelet_log_dir="", slurm_job_map_dir=None, listen_address="127.0.0.1:0",
        timeout_offset=0.5, max_concurrent=2, max_connections=64, web_config_file=None,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.exporter.timeout_s == 5.0
        client = Server(None, server.url)  # type: ignore[arg-type]
        status, body = client.get("/probe?target=gpu_a")
        assert status == 200 and value(samples(body), "probe_success") == 1
        status, body = client.get("/metrics")
        parsed = samples(body)
        assert value(parsed, "mig_exporter_read_success", source="nvidia-smi") == 1
        assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * MIB
        assert value(parsed, "mig_exporter_probes_total", target="gpu_a") == 1
        assert value(parsed, "mig_exporter_config_last_reload_successful") == 1
        request = urllib.request.Request(server.url + "/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=15) as response:
            assert response.status == 200
    finally:
        server.shutdown()
        server.server_close()


def test_serve_listen_address_from_the_environment() -> None:
    with socket.socket() as probe:  # a free port, so the address seen can only come from the variable
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = cli_env(MIG_EXPORTER_WEB_LISTEN_ADDRESS=f"127.0.0.1:{port}", MIG_EXPORTER_DEMO="1")
    with serving(env=env) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        status, body = server.get("/metrics")
        assert status == 200
        assert value(samples(body), "mig_exporter_read_success", source="demo") == 1


def test_serve_reads_the_fake_at_every_scrape(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi)
    with serving("--web.listen-address", "127.0.0.1:0", "--nvidia-smi", str(fake)) as server:
        for _ in range(2):
            status, body = server.get("/metrics")
            assert status == 200
            assert value(samples(body), "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * MIB
    runs = [line.split(" ", 1)[1] for line in (fake.parent / "calls.log").read_text().splitlines()]
    assert sorted(runs) == ["-L", "-L", "-q -x", "-q -x"]


def test_serve_without_nvidia_smi_on_path_still_serves_read_success_0(tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    with serving("--web.listen-address", "127.0.0.1:0", env=cli_env(PATH=str(empty))) as server:
        status, body = server.get("/metrics")
        assert status == 200
        parsed = samples(body)
        # Neither NVML (absent on this machine) nor nvidia-smi: source "auto" until one appears.
        assert value(parsed, "mig_exporter_read_success", source="auto") == 0
        assert value(parsed, "mig_exporter_read_errors_total", source="auto") == 1
        assert label_sets(parsed, "mig_exporter_device_memory_used_bytes") == []
    assert any("nvidia-smi: not found on PATH" in line and "level=WARNING" in line for line in server.log)


def test_serve_with_an_explicit_missing_binary_is_a_one_line_error() -> None:
    result = run_cli("serve", "--web.listen-address", "127.0.0.1:0", "--nvidia-smi", "/nonexistent/nvidia-smi")

    assert result.returncode == 1
    assert error_message(result.stderr) == (
        "/nonexistent/nvidia-smi: no such file "
        "(give --nvidia-smi PATH, or --demo to try the exporter without a GPU)"
    )
    assert "listening" not in result.stderr


def test_serve_with_a_nonsense_listen_address_is_a_usage_error() -> None:
    result = run_cli("serve", "--demo", "--web.listen-address", "nonsense")

    assert result.returncode == 2
    message = error_message(result.stderr)
    assert "--web.listen-address" in message
    assert "nonsense" in message
    assert "listening" not in result.stderr


def test_serve_with_a_port_out_of_range_says_so() -> None:
    result = run_cli("serve", "--demo", "--web.listen-address", ":99999")

    assert result.returncode == 2
    assert error_message(result.stderr) == ("Invalid value for --web.listen-address: listen address ':99999': port "
                                            "99999 is out of range (0 to 65535) (see 'mig-exporter serve --help')")


# The default address ":PORT" listens on every address. Tested inside a network namespace
# of our own, whose only interface is loopback: nothing outside this test can reach it.
_DUAL_STACK_CHECK = r"""
import json, re, subprocess, sys, urllib.request
proc = subprocess.Popen([sys.executable, "-m", "mig_exporter", "serve", "--demo", "--web.listen-address", ":0",
                         "--log.level", "info"], stderr=subprocess.PIPE, text=True)
try:
    for line in proc.stderr:
        m = re.search(r"listening on (\S+ \(.*?\))", line)
        if m:
            break
    port = re.search(r":(\d+) ", m.group(1)).group(1)
    answers = {}
    for host in ("127.0.0.1", "[::1]"):
        with urllib.request.urlopen(f"http://{host}:{port}/-/healthy", timeout=10) as r:
            answers[host] = r.status
    print(json.dumps({"logged": m.group(1).replace(port, "PORT"), "answers": answers}))
finally:
    proc.kill()
    proc.wait()
"""


def test_the_default_listen_address_is_dual_stack_and_logged_as_bound(tmp_path: Path) -> None:
    unshare, ip = shutil.which("unshare"), shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    assert unshare and ip, "unshare (util-linux) and ip (iproute2) run the server in a namespace of its own"
    script = tmp_path / "check.py"
    script.write_text(_DUAL_STACK_CHECK)
    result = subprocess.run(
        [unshare, "--map-root-user", "--net", "sh", "-c", f'"{ip}" link set lo up && exec "$0" "$1"',
         sys.executable, str(script)],
        env=cli_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome == {"logged": "http://[::]:PORT (every IPv4 and IPv6 address)",
                       "answers": {"127.0.0.1": 200, "[::1]": 200}}


def test_serve_on_a_port_in_use_is_a_one_line_error() -> None:
    with serving("--web.listen-address", "127.0.0.1:0", "--demo") as first:
        port = first.url.rsplit(":", 1)[1]
        result = run_cli("serve", "--demo", "--web.listen-address", f"127.0.0.1:{port}")

    assert result.returncode == 1
    assert error_message(result.stderr).startswith(f"cannot listen on 127.0.0.1:{port}: ")


def test_sigterm_during_a_hung_read_leaves_no_nvidia_smi_behind(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="hang", list_mode="hang")
    calls_log = fake.parent / "calls.log"
    pgids: list[int] = []
    try:
        with serving("--web.listen-address", "127.0.0.1:0", "--nvidia-smi", str(fake), "--timeout", "60") as server:
            scrape = threading.Thread(target=lambda: _ignore_errors(server.get, "/metrics", 70), daemon=True)
            scrape.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(_lines(calls_log)) < 2:
                time.sleep(0.02)
            pgids = [int(line.split(" ", 1)[0]) for line in _lines(calls_log)]
            assert len(pgids) == 2, "the scrape never started nvidia-smi"

            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=5) == 0
        assert _running_in_groups(pgids, within_s=1.0) == []
    finally:
        for pgid in pgids:  # the fake's groups were started by this test: never leave them running
            with suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _ignore_errors(func, *args) -> None:
    with suppress(Exception):  # the server is being stopped under the request
        func(*args)


def _running_in_groups(pgids: list[int], within_s: float) -> list[tuple[int, int]]:
    """(pid, pgrp) of processes of the groups still running (zombies excepted), after a short grace."""
    deadline = time.monotonic() + within_s
    while True:
        running = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat_line = f.read()
            except OSError:
                continue
            fields = stat_line[stat_line.rindex(")") + 2:].split()
            if int(fields[2]) in pgids and fields[0] not in "ZX":
                running.append((int(entry), int(fields[2])))
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


# --- the config file: serve --config.file, SIGHUP, check-config --------------------------------

BAD_CONFIG = """\
probe_targets:
  gpu-a:
    command: nvidia-smi
  '../etc':
    command: [nvidia-smi]
  gpu-b:
    command: [nvidia-smi]
    timeout: forever
"""
BAD_CONFIG_ERRORS = [
    "probe_targets.gpu-a.command: must be a list of arguments (no shell is used), e.g. ['nvidia-smi']",
    "probe_targets.'../etc': not a valid target name "
    "(a letter or digit, then letters, digits, '_', '.' or '-'; at most 64 characters)",
    "probe_targets.gpu-b.timeout: 'forever' is not a duration (write it like 500ms, 5s or 1m30s)",
]


def probe_config(path: Path, **targets: Path) -> Path:
    path.write_text("probe_targets:\n" + "".join(
        f"  {name}:\n    command: ['{fake}']\n    timeout: 5s\n" for name, fake in targets.items()))
    return path


def error_lines(stderr: str) -> list[str]:
    """The error lines of a failed command, without their prefix; nothing else but log lines."""
    other = [line for line in stderr.splitlines() if line.strip() and not line.startswith("ts=")]
    assert all(line.startswith("mig-exporter: error: ") for line in other), other
    return [line.removeprefix("mig-exporter: error: ") for line in other]


def wait_for_log(server: Server, text: str, after: int = 0, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in server.log[after:]:
            if text in line:
                return line
        time.sleep(0.02)
    raise AssertionError(f"no log line with {text!r}: {server.log}")


def test_serve_with_a_bad_config_prints_every_error_and_exits_1(tmp_path: Path, fake_nvidia_smi: FakeSmi) -> None:
    config = tmp_path / "mig.yml"
    config.write_text(BAD_CONFIG)
    fake = h100_fake(fake_nvidia_smi)
    result = run_cli("serve", "--web.listen-address", "127.0.0.1:0", "--nvidia-smi", str(fake),
                     "--config.file", str(config))

    assert result.returncode == 1
    assert error_lines(result.stderr) == [f"{config}: {error}" for error in BAD_CONFIG_ERRORS]
    assert "listening" not in result.stderr
    assert "Traceback" not in result.stderr
    assert not (fake.parent / "calls.log").exists()


def test_serve_with_a_missing_config_file_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yml"
    result = run_cli("serve", "--demo", "--web.listen-address", "127.0.0.1:0",
                     env=cli_env(MIG_EXPORTER_CONFIG_FILE=str(missing)))

    assert result.returncode == 1
    assert error_message(result.stderr) == f"{missing}: cannot read: No such file or directory"


def test_serve_probes_the_targets_of_the_config_file_from_the_environment(
    tmp_path: Path, fake_nvidia_smi: FakeSmi
) -> None:
    config = probe_config(tmp_path / "mig.yml", gpu_a=h100_fake(fake_nvidia_smi))
    env = cli_env(MIG_EXPORTER_CONFIG_FILE=str(config), MIG_EXPORTER_PROBE_MAX_CONCURRENT="2")
    with serving("--web.listen-address", "127.0.0.1:0", "--demo", env=env) as server:
        status, body = server.get("/probe?target=gpu_a")
        assert status == 200
        parsed = samples(body)
        assert value(parsed, "probe_success") == 1
        assert value(parsed, "mig_exporter_device_memory_used_bytes", index="1002") == 7493 * MIB
        status, body = server.get("/metrics")
        assert value(samples(body), "mig_exporter_probes_total", target="gpu_a") == 1
        assert server.get("/probe?target=/bin/sh")[0] == 400
    assert any(f"loaded {config}: 1 probe target (gpu_a); engines: llama.cpp, ollama, vllm, sglang, tgi, triton, "
               "tensorrt-llm; at most 2 probes at once" in line for line in server.log)


def test_sighup_reloads_the_config_and_a_bad_one_is_refused(tmp_path: Path, fake_nvidia_smi: FakeSmi) -> None:
    fake_a, fake_b = h100_fake(fake_nvidia_smi), h100_fake(fake_nvidia_smi)
    config = probe_config(tmp_path / "mig.yml", gpu_a=fake_a)
    with serving("--web.listen-address", "127.0.0.1:0", "--demo", "--config.file", str(config)) as server:
        assert server.get("/probe?target=gpu_b")[0] == 400

        probe_config(config, gpu_a=fake_a, gpu_b=fake_b)
        mark = len(server.log)
        server.proc.send_signal(signal.SIGHUP)
        wait_for_log(server, f"reloaded {config}: 2 probe targets (gpu_a, gpu_b); "
                             "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm", mark)
        status, body = server.get("/probe?target=gpu_b")
        assert status == 200 and value(samples(body), "probe_success") == 1

        config.write_text(BAD_CONFIG)
        mark = len(server.log)
        server.proc.send_signal(signal.SIGHUP)
        line = wait_for_log(server, "kept the previous config", mark)
        assert "level=ERROR" in line and all(error in line for error in BAD_CONFIG_ERRORS)
        assert server.get("/probe?target=gpu_b")[0] == 200
        assert value(samples(server.get("/metrics")[1]), "mig_exporter_config_last_reload_successful") == 0
        assert server.proc.poll() is None
    assert not any("Traceback" in line for line in server.log)


def test_sighup_without_a_config_file_keeps_serving() -> None:
    with serving("--web.listen-address", "127.0.0.1:0", "--demo") as server:
        server.proc.send_signal(signal.SIGHUP)
        wait_for_log(server, "no --config.file, nothing to reload")
        assert server.get("/metrics")[0] == 200


def test_check_config_of_a_good_file(tmp_path: Path, fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi)
    config = tmp_path / "mig.yml"
    config.write_text(f"probe_targets:\n  gpu-a: {{command: ['{fake}']}}\n"
                      "  remote: {command: [no-such-ssh-here, gpu-07, nvidia-smi], timeout: 3s}\n")
    result = run_cli("check-config", str(config))

    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{config}: ok: 2 probe targets (gpu-a, remote); "
                             "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm\n")
    # Checked on this host, a command that is missing here is worth a warning, not a failure.
    assert result.stderr == (f"mig-exporter: warning: {config}: probe_targets.remote: "
                             "no-such-ssh-here: not found on PATH (on this host)\n")
    assert not (fake.parent / "calls.log").exists(), "check-config must not run the targets"


def test_check_config_of_a_bad_file_prints_every_error_and_exits_1(tmp_path: Path) -> None:
    config = tmp_path / "mig.yml"
    config.write_text(BAD_CONFIG)
    result = run_cli("check-config", str(config))

    assert result.returncode == 1
    assert result.stdout == ""
    assert error_lines(result.stderr) == [f"{config}: {error}" for error in BAD_CONFIG_ERRORS]


@pytest.mark.parametrize("content, error", [
    (None, "cannot read: No such file or directory"),
    ("probe_targets: [\n", "line 2, column 1: not valid YAML: expected the node content, but found '<stream end>'"),
])
def test_check_config_of_an_unreadable_file(tmp_path: Path, content: str | None, error: str) -> None:
    config = tmp_path / "mig.yml"
    if content is not None:
        config.write_text(content)
    result = run_cli("check-config", str(config))

    assert result.returncode == 1
    assert error_message(result.stderr) == f"{config}: {error}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_read_leaves_no_nvidia_smi_behind(fake_nvidia_smi: FakeSmi, sig) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="hang", list_mode="hang")
    calls_log = fake.parent / "calls.log"
    pgids: list[int] = []
    proc = subprocess.Popen([sys.executable, "-m", "mig_exporter", "read", "--nvidia-smi", str(fake),
                             "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_lines(calls_log)) < 2:
            time.sleep(0.02)
        pgids = [int(line.split(" ", 1)[0]) for line in _lines(calls_log)]
        assert len(pgids) == 2, "the read never started nvidia-smi"
        proc.send_signal(sig)
        assert proc.wait(timeout=5) != 0
        assert _running_in_groups(pgids, within_s=1.0) == []
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        for pgid in pgids:
            with suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


# --- logs: logfmt and JSON -----------------------------------------------------------------------

def test_log_lines_are_logfmt_with_quoted_messages(fake_nvidia_smi: FakeSmi) -> None:
    fake = h100_fake(fake_nvidia_smi, mode="fail")
    result = run_cli("read", "--nvidia-smi", str(fake))

    assert result.returncode == 1
    [line] = [line for line in result.stderr.splitlines() if "level=WARNING" in line]
    assert re.fullmatch(
        r'ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=WARNING logger=mig_exporter '
        r'msg="read from nvidia-smi failed: .*exit status 9: NVIDIA-SMI has failed because it couldn\'t '
        r'communicate with the NVIDIA driver\."', line)


def test_json_logs_are_one_object_per_line(fake_nvidia_smi: FakeSmi) -> None:
    import json

    fake = h100_fake(fake_nvidia_smi, mode="fail")
    result = run_cli("read", "--nvidia-smi", str(fake), "--log.format", "json", "--log.level", "debug")

    assert result.returncode == 1
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert records, "no log line"
    assert all(set(r) == {"ts", "level", "logger", "msg"} for r in records)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]) for r in records)
    [failure] = [r for r in records if r["level"] == "WARNING"]
    assert failure["logger"] == "mig_exporter"
    assert failure["msg"].startswith("read from nvidia-smi failed: ")
    assert failure["msg"].endswith("exit status 9: " + DRIVER_ERROR)


def test_json_logs_from_the_environment_for_serve() -> None:
    import json

    with serving("--web.listen-address", "127.0.0.1:0", "--demo",
                 env=cli_env(MIG_EXPORTER_LOG_FORMAT="json")) as server:
        assert server.get("/nope")[0] == 404
        wait_for_log(server, "answered 404")
    records = [json.loads(line) for line in server.log]
    assert any(r["msg"].startswith("mig-exporter 0.1.0 listening on http://127.0.0.1:") for r in records)
    [refusal] = [r for r in records if "answered 404" in r["msg"]]
    assert refusal["level"] == "INFO" and refusal["logger"] == "mig_exporter.http"


def test_a_traceback_stays_inside_its_one_log_line() -> None:
    import json
    import logging

    from mig_exporter.core.logs import JsonFormatter, LogfmtFormatter

    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord("mig_exporter", logging.ERROR, __file__, 1, "read failed: %s", ("x",),
                                   sys.exc_info())
    line = LogfmtFormatter().format(record)
    assert "\n" not in line and line.startswith("ts=") and 'msg="read failed: x" exc="Traceback' in line
    parsed = json.loads(JsonFormatter().format(record))
    assert parsed["msg"] == "read failed: x" and "ValueError: boom" in parsed["exc"]


# --- the web config: --web.config.file and check-web-config ------------------------------------

def test_serve_with_a_web_config_serves_https_with_basic_auth_from_the_environment(tmp_path: Path) -> None:
    import base64
    import http.client
    import ssl

    import bcrypt

    from certs import make_pki

    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
                   f"basic_auth_users:\n  prometheus: {hashed}\n")
    env = cli_env(MIG_EXPORTER_WEB_CONFIG_FILE=str(web))
    with serving("--web.listen-address", "127.0.0.1:0", "--demo", env=env) as server:
        assert server.url.startswith("https://127.0.0.1:")
        port = int(server.url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=str(pki.ca.cert))
        answers = []
        for headers in ({}, {"Authorization": "Basic " + base64.b64encode(b"prometheus:pw").decode()}):
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            conn.request("GET", "/metrics", headers=headers)
            response = conn.getresponse()
            answers.append((response.status, response.read()))
            conn.close()
        assert answers[0] == (401, b"Unauthorized\n")
        assert answers[1][0] == 200
        assert value(samples(answers[1][1].decode()), "mig_exporter_read_success", source="demo") == 1
        wait_for_log(server, "answered 401: no credentials")
    assert any(f"loaded {web}: TLS (TLS12+, client certificates: NoClientCert); basic auth: 1 user" in line
               for line in server.log)


WEB_CONFIG_ERRORS = [
    "tls_server_config: missing one of key or key_file",
    "basic_auth_users.prometheus: not a bcrypt hash ($2y$, $2b$ or $2a$ and 56 more characters; "
    "make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n')",
]


def test_serve_with_a_bad_web_config_says_every_error_and_exits_1(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.crt\nbasic_auth_users:\n  prometheus: hunter2\n")
    result = run_cli("serve", "--demo", "--web.listen-address", "127.0.0.1:0", "--web.config.file", str(web))

    assert result.returncode == 1
    assert error_lines(result.stderr) == [f"{web}: {error}" for error in WEB_CONFIG_ERRORS]
    assert "listening" not in result.stderr


def test_serve_with_a_missing_web_config_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_cli("serve", "--demo", "--web.listen-address", "127.0.0.1:0",
                     "--web.config.file", str(tmp_path / "web.yml"))
    assert result.returncode == 1
    assert error_message(result.stderr) == f"{tmp_path / 'web.yml'}: cannot read: No such file or directory"


def test_check_web_config(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: server.crt\nbasic_auth_users:\n  prometheus: hunter2\n")
    bad = run_cli("check-web-config", str(web))
    assert bad.returncode == 1 and bad.stdout == ""
    assert error_lines(bad.stderr) == [f"{web}: {error}" for error in WEB_CONFIG_ERRORS]

    web.write_text("basic_auth_users:\n  prometheus: $2y$10$" + "a" * 53 + "\n")
    good = run_cli("check-web-config", str(web))
    assert (good.returncode, good.stdout) == (0, f"{web}: ok: no TLS; basic auth: 1 user\n")
