"""glibc keeps one heap for all threads, so a big scrape's freed memory is not kept once per
connection thread: RSS stays flat over a soak (benchmarks/load.py, docs/reliability.md). Seen
through malloc_info's list of heaps, in a fresh interpreter each time: the setting is
process-wide and must come before threads allocate."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import cli_env, serving

libc = ctypes.CDLL(None)
pytestmark = pytest.mark.skipif(not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "malloc_info"),
                                reason="glibc only")

# Four threads allocate at once, then malloc_info writes glibc's heaps to a file.
_HEAPS_AFTER_FOUR_THREADS = """
import ctypes, sys, threading
from mig_exporter.core.malloc_tuning import limit_arenas

if sys.argv[1] == "limited":
    print(limit_arenas())
start = threading.Barrier(4)

def allocate():
    start.wait()
    kept = [bytearray(2000) for _ in range(1000)]

threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
report = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, report)
libc.fclose(report)
"""


def heaps_after_four_threads(mode: str, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[list[str], int]:
    report = tmp_path / f"malloc-{mode}.xml"
    out = subprocess.run([sys.executable, "-c", _HEAPS_AFTER_FOUR_THREADS, mode, str(report)],
                         env=env or cli_env(), capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines(), len(re.findall(r'<heap nr="\d+">', report.read_text()))


def without_malloc_settings() -> dict[str, str]:
    return {k: v for k, v in cli_env().items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def test_by_default_glibc_gives_threads_heaps_of_their_own(tmp_path: Path):
    # What the limit is for: each of these heaps would keep a big scrape's freed memory.
    _, heaps = heaps_after_four_threads("default", tmp_path, without_malloc_settings())
    assert heaps > 1


def test_limited_all_threads_share_one_heap(tmp_path: Path):
    said, heaps = heaps_after_four_threads("limited", tmp_path, without_malloc_settings())
    assert said == ["malloc: at most 1 arena"]
    assert heaps == 1


def test_a_limit_the_user_set_is_left_as_it_is(tmp_path: Path):
    env = {**without_malloc_settings(), "MALLOC_ARENA_MAX": "3"}
    said, heaps = heaps_after_four_threads("limited", tmp_path, env)
    assert said == ["malloc: arenas left as MALLOC_ARENA_MAX=3 sets them"]
    assert heaps == 3


def test_a_limit_set_with_glibc_tunables_is_left_as_it_is(tmp_path: Path):
    env = {**without_malloc_settings(), "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    said, heaps = heaps_after_four_threads("limited", tmp_path, env)
    assert said == ["malloc: arenas left as GLIBC_TUNABLES sets them"]
    assert heaps == 2


def test_serve_limits_the_arenas_at_start():
    with serving("--web.listen-address", "127.0.0.1:0", "--demo", "--log.level", "debug",
                 env=without_malloc_settings()) as server:
        assert server.get("/metrics")[0] == 200
    assert any("malloc: at most 1 arena" in line for line in server.log), server.log
