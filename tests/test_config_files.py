"""A hostile config file, for ``--config.file`` and ``--web.config.file`` alike: a YAML alias bomb
(a few hundred bytes that expand to gigabytes) is refused while the YAML is composed, before any
object is built, in ``check-config``, ``check-web-config`` and a live ``POST /-/reload``. Every
command runs in a subprocess under a 1 GiB address-space limit, so code without the refusal fails
the test instead of eating the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import FakeSmi, samples, value
from test_cli import cli_env, error_message, h100_fake, serving

pytestmark = pytest.mark.timeout(90)

MEMORY_LIMIT = 1 << 30
BOMB_TIMEOUT_S = 20  # code that expands the bomb runs past this (or dies of MemoryError)
QUICKLY_S = 10  # python's start and the check, on a busy machine; the refusal itself takes milliseconds
ANCHOR_ERROR = "line 2, column 6: YAML anchor &a: anchors and aliases are not allowed in this file; " \
               "write the value out in full"


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def alias_bomb(use: str) -> str:
    """The billion laughs: nine levels of nine aliases each, 9**9 strings once expanded, in ~1 KB.
    The anchors sit under an unknown top-level key; ``use`` is the rest of the file, where ``*i``
    (the whole bomb) goes somewhere a checker looks at, or shows, the value."""
    lines = ["bomb:", "  a: &a [" + ", ".join([f'"{"lol" * 20}"'] * 9) + "]"]
    for level, below in zip("bcdefghi", "abcdefgh", strict=True):
        lines.append(f"  {level}: &{level} [" + ", ".join([f"*{below}"] * 9) + "]")
    return "\n".join(lines) + "\n" + use


CONFIG_BOMB = alias_bomb("probe_targets:\n  gpu_a:\n    command: *i\n")
WEB_CONFIG_BOMB = alias_bomb("tls_server_config:\n  min_version: *i\n")


def run_limited(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mig_exporter", *args], env=cli_env(), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=BOMB_TIMEOUT_S, preexec_fn=limit_memory,
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize("command, bomb", [("check-config", CONFIG_BOMB), ("check-web-config", WEB_CONFIG_BOMB)])
def test_checking_an_alias_bomb_refuses_it_at_once(tmp_path: Path, command: str, bomb: str) -> None:
    path = tmp_path / "file.yml"
    path.write_text(bomb)

    result, took = run_limited(command, str(path))

    assert result.returncode == 1 and result.stdout == ""
    assert error_message(result.stderr) == f"{path}: {ANCHOR_ERROR}"
    assert took < QUICKLY_S


def test_serve_refuses_a_web_config_bomb_at_start(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(WEB_CONFIG_BOMB)

    result, took = run_limited("serve", "--demo", "--web.listen-address", "127.0.0.1:0", "--web.config.file",
                               str(web))

    assert result.returncode == 1
    assert error_message(result.stderr) == f"{web}: {ANCHOR_ERROR}"
    assert took < QUICKLY_S


def post(url: str, timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(url, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_reload_into_an_alias_bomb_fails_at_once_and_the_exporter_keeps_serving(
    tmp_path: Path, fake_nvidia_smi: FakeSmi
) -> None:
    fake = h100_fake(fake_nvidia_smi)
    config = tmp_path / "mig.yml"
    config.write_text(f"probe_targets:\n  gpu_a:\n    command: ['{fake}']\n")
    with serving("--web.listen-address", "127.0.0.1:0", "--demo", "--config.file", str(config),
                 preexec_fn=limit_memory) as server:
        assert value(samples(server.get("/metrics")[1]), "mig_exporter_config_last_reload_successful") == 1
        config.write_text(CONFIG_BOMB)

        answer: list[tuple[tuple[int, str], float]] = []

        def reload() -> None:
            started = time.monotonic()
            answer.append((post(server.url + "/-/reload", timeout=BOMB_TIMEOUT_S), time.monotonic() - started))

        reloading = threading.Thread(target=reload)
        reloading.start()
        healthy: list[tuple[int, float]] = []
        while True:  # /-/healthy answers while the reload runs (at least once, however short the reload)
            started = time.monotonic()
            try:
                status = server.get("/-/healthy", timeout=2)[0]
            except OSError:  # a timeout
                status = 0
            healthy.append((status, time.monotonic() - started))
            if not reloading.is_alive():
                break
        reloading.join()

        ((status, body), took), = answer
        assert status == 400, body
        assert body.splitlines() == [
            f"reloading {config} failed; kept the previous config, 1 probe target (gpu_a); "
            "engines: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm:",
            f"  {ANCHOR_ERROR}",
        ]
        assert took < 2
        assert all(status == 200 and seconds < 2 for status, seconds in healthy), healthy
        assert value(samples(server.get("/metrics")[1]), "mig_exporter_config_last_reload_successful") == 0
        status, body = server.get("/probe?target=gpu_a")  # the old config stays in force
        assert status == 200 and value(samples(body), "probe_success") == 1
        assert server.proc.poll() is None
    assert not any("Traceback" in line for line in server.log)
    errors = [line for line in server.log if "level=ERROR" in line]
    assert len(errors) == 1 and ANCHOR_ERROR in errors[0], errors
