"""Shared test fixtures: our own nvidia-smi outputs, the real corpus, and a fake nvidia-smi."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mig_exporter.collector import snapshot_families
from mig_exporter.snapshot import Snapshot
from mig_exporter.source_smi import snapshot_from_smi

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures" / "nvidia-smi"
SAMPLES = REPO / "src" / "mig_exporter" / "samples"
# The real corpus lives beside the checkout (../shared), as in CI.
REAL_CORPUS = Path(os.environ.get("MIG_EXPORTER_REAL_CORPUS", REPO.parent / "shared" / "fixtures" / "nvidia-smi" / "real"))
MIB = 1024 * 1024


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def scenario(name: str) -> Snapshot:
    """The snapshot of one of our fixture scenarios, -q -x and -L together."""
    return snapshot_from_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"))


def sample_value(families, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample among metric families, like registry.get_sample_value."""
    labels = labels or {}
    for family in families:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def samples_of(families, name: str) -> list:
    return [s for f in families for s in f.samples if s.name == name]


def families_of(snapshot: Snapshot) -> list:
    return list(snapshot_families(snapshot))


FakeSmi = Callable[..., Path]


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path) -> FakeSmi:
    """Make a fake ``nvidia-smi``: a real executable that prints captured output.

    ``xml``/``listing``: bytes printed for ``-q -x`` and ``-L``.
    ``mode``: ``ok``; ``hang`` (sleeps, with a child of its own, after printing
    part of the output); ``fail`` (prints ``stderr`` and exits ``exit_code``);
    ``garbage`` (prints random bytes); ``flood`` (prints without end).
    ``list_mode`` does the same for ``-L`` alone. Each call is logged to
    ``calls.log`` beside the script, one line per run.
    """
    counter = iter(range(1000))

    def make(
        xml: bytes = b"",
        listing: bytes = b"",
        mode: str = "ok",
        list_mode: str = "ok",
        stderr: str = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
        exit_code: int = 9,
        delay_s: float = 0.0,
    ) -> Path:
        d = tmp_path / f"fake-smi-{next(counter)}"
        d.mkdir()
        (d / "q.xml").write_bytes(xml)
        (d / "L.txt").write_bytes(listing)
        script = d / "nvidia-smi"

        def action(which: str, what: str) -> str:
            out = shlex.quote(str(d / which))
            return {
                "ok": f"cat {out}",
                "hang": f"head -c 100 {out}; sleep 600 & sleep 600",
                "fail": f"echo {shlex.quote(stderr)} >&2; exit {exit_code}",
                "garbage": "head -c 4096 /dev/urandom",
                "flood": "yes '<gpu>'",
            }[what]

        script.write_text(
            "#!/bin/sh\n"
            f"echo \"$$ $*\" >> {shlex.quote(str(d / 'calls.log'))}\n"
            + (f"sleep {delay_s}\n" if delay_s else "")
            + 'case "$1" in\n'
            f"  -q) {action('q.xml', mode)} ;;\n"
            f"  -L) {action('L.txt', list_mode)} ;;\n"
            '  *) echo "fake nvidia-smi: unknown arguments: $*" >&2; exit 2 ;;\n'
            "esac\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return script

    return make


@pytest.fixture
def python() -> str:
    return sys.executable


# A fake libnvidia-ml beneath pynvml's real ctypes layer (tests/fake_nvml.py).
from fake_nvml import fake_nvml_lib  # noqa: E402,F401  (registers the fixture)
