"""The exposition passes ``promtool check metrics`` with zero findings.

Every read the exporter can make is rendered through the real path, a
``Scraper`` over a real source and an ``Exporter`` in a fresh
``CollectorRegistry``. The sources are the bundled demo, a fake nvidia-smi for
each scenario of ``tests/fixtures/nvidia-smi`` and reads that fail. The text
format is piped into Prometheus' own linter; both the text format and
OpenMetrics are parsed back and their values are checked against the scenario
README.

promtool comes from Debian's ``prometheus`` package. When it is missing, these
tests fail: ``scripts/test`` installs it.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_latest_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from conftest import MIB, fixture_bytes, require_tool
from mig_exporter.core.errors import ReadError
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.base import Source
from mig_exporter.sources.demo import DemoProcs, DemoSource
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource

SCENARIOS = [
    "h100-mig-processes",
    "h200-shared-gpu-instance",
    "a100-mig-nothing-carved",
    "a100-mig-pending",
    "na-memory",
]
READ_TIMEOUT_S = 10.0

# Read through Prometheus' own families: duration and the error counter change
# from one render to the next, so they are compared apart.
PER_RENDER = {"mig_exporter_read_duration_seconds", "mig_exporter_read_errors_total"}


def _promtool() -> str:
    return require_tool("promtool")


class RaisingSource:
    """A source whose read raises, as a real one does when nvidia-smi fails."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.name = "raising"

    def read(self, deadline=None):
        raise self.error

    def ready(self) -> tuple[bool, str]:
        return False, "always fails"

    def describe(self) -> str:
        return "a source that raises"


@dataclass(frozen=True)
class Case:
    """One read, and what its exposition must say."""

    source: Callable[..., Source]  # called with the fake_nvidia_smi factory
    source_name: str
    success: bool
    devices: int
    # (sample name, labels that must match, value); None means the sample is absent.
    expect: list[tuple[str, dict[str, str], float | None]] = field(default_factory=list)
    engines: Callable[[], EngineReader] | None = None  # watch engines beside the read


def _smi(scenario: str) -> Callable[..., Source]:
    def make(fake) -> Source:
        script = fake(xml=fixture_bytes(f"{scenario}.xml"), listing=fixture_bytes(f"{scenario}.L.txt"))
        return NvidiaSmiSource(str(script), READ_TIMEOUT_S)

    return make


def _failing_smi(fake) -> Source:
    return NvidiaSmiSource(str(fake(mode="fail", list_mode="fail")), READ_TIMEOUT_S)


CASES: dict[str, Case] = {
    "demo": Case(
        lambda fake: DemoSource(),
        "demo",
        True,
        4,
        [
            ("mig_exporter_device_memory_used_bytes", {"index": "1000", "card": "0", "mig_profile": "3g.40gb"},
             11663 * MIB),
            ("mig_exporter_device_memory_used_bytes", {"index": "1", "card": "1", "mig_profile": ""}, 22110 * MIB),
            ("mig_exporter_process_memory_used_bytes", {"pid": "50102", "index": "1", "mig_profile": ""}, 20480 * MIB),
            ("mig_exporter_process_info", {"pid": "50102", "process_type": "G"}, 1),
            ("mig_exporter_card_utilization_ratio", {"card": "1"}, 0.63),
            ("mig_exporter_card_utilization_ratio", {"card": "0"}, None),
            ("mig_exporter_card_mig_instances", {"card": "0"}, 3),
        ],
    ),
    "demo-engines": Case(
        lambda fake: DemoSource(),
        "demo",
        True,
        4,
        [
            ("mig_exporter_host_pid_namespace", {}, 1),
            ("mig_exporter_engine_processes", {"engine": "llama.cpp"}, 3),
            ("mig_exporter_engine_processes", {"engine": "ollama"}, 0),
            ("mig_exporter_engine_memory_used_bytes", {"engine": "llama.cpp", "pid": "52040"}, 0),
            ("mig_exporter_engine_memory_used_bytes", {"engine": "llama.cpp", "pid": "50102"}, 20480 * MIB),
            ("mig_exporter_engine_memory_used_bytes", {"engine": "vllm", "pid": "51860"}, 9216 * MIB),
            ("mig_exporter_engine_memory_used_bytes", {"pid": "52311"}, None),  # -ngl 0: no engine
            ("mig_exporter_engine_info", {"pid": "52040", "index": "", "comm": "llama-server"}, 1),
            ("mig_exporter_engine_info", {"pid": "51860", "index": "1001", "comm": "vllm"}, 1),
        ],
        engines=lambda: EngineReader(DEFAULT_SETTINGS, DemoProcs()),
    ),
    "h100-mig-processes": Case(
        _smi("h100-mig-processes"),
        "nvidia-smi",
        True,
        4,
        [
            ("mig_exporter_device_memory_used_bytes", {"index": "1002", "mig_profile": "1g.10gb"}, 7493 * MIB),
            ("mig_exporter_device_memory_total_bytes", {"index": "1000", "mig_profile": "3g.40gb"}, 40448 * MIB),
            ("mig_exporter_device_memory_free_bytes", {"index": "1001", "mig_profile": "2g.20gb"}, 20079 * MIB),
            ("mig_exporter_device_memory_reserved_bytes", {"index": "1003"}, 0),
            ("mig_exporter_device_processes", {"index": "1000"}, 2),
            ("mig_exporter_device_processes", {"index": "1001"}, 0),
            ("mig_exporter_process_memory_used_bytes", {"pid": "21198", "index": "1002", "mig_profile": "1g.10gb"},
             7484 * MIB),
            ("mig_exporter_process_memory_used_bytes", {"pid": "21181", "index": "1000"}, 1272 * MIB),
            ("mig_exporter_card_power_draw_watts", {"card": "0"}, 432.17),
            ("mig_exporter_card_utilization_ratio", {"card": "0"}, None),
            ("mig_exporter_card_mig_instances", {"card": "0"}, 4),
        ],
    ),
    "h200-shared-gpu-instance": Case(
        _smi("h200-shared-gpu-instance"),
        "nvidia-smi",
        True,
        5,
        [
            ("mig_exporter_device_memory_used_bytes", {"index": "1000", "mig_profile": "1c.3g.71gb"}, 30210 * MIB),
            ("mig_exporter_device_memory_used_bytes", {"index": "1001", "mig_profile": "2c.3g.71gb"}, 30210 * MIB),
            ("mig_exporter_device_info", {"index": "1001", "gpu_instance": "1", "compute_instance": "1"}, 1),
            ("mig_exporter_process_memory_used_bytes", {"pid": "7001", "index": "1000"}, 20480 * MIB),
            ("mig_exporter_process_memory_used_bytes", {"pid": "7001", "index": "1001"}, None),
            ("mig_exporter_process_memory_used_bytes", {"pid": "7002", "index": "1001"}, 9600 * MIB),
            ("mig_exporter_process_info", {"pid": "7003", "index": "1002", "process_type": "M+C"}, 1),
        ],
    ),
    "a100-mig-nothing-carved": Case(
        _smi("a100-mig-nothing-carved"),
        "nvidia-smi",
        True,
        1,
        [
            ("mig_exporter_card_mig_instances", {"card": "0"}, 0),
            ("mig_exporter_card_mig_instances", {"card": "1"}, 1),
            ("mig_exporter_device_info", {"card": "0"}, None),
            ("mig_exporter_device_info", {"index": "1100", "gpu_instance": "0", "mig_profile": "7g.40gb"}, 1),
            ("mig_exporter_device_memory_used_bytes", {"index": "1100"}, 4105 * MIB),
            ("mig_exporter_process_memory_used_bytes", {"pid": "3301", "index": "1100"}, 4092 * MIB),
        ],
    ),
    "a100-mig-pending": Case(
        _smi("a100-mig-pending"),
        "nvidia-smi",
        True,
        1,
        [
            ("mig_exporter_card_mig_mode", {"card": "0", "state": "current"}, 0),
            ("mig_exporter_card_mig_mode", {"card": "0", "state": "pending"}, 1),
            ("mig_exporter_device_memory_used_bytes", {"index": "0", "mig_profile": ""}, 5123 * MIB),
            ("mig_exporter_process_memory_used_bytes", {"pid": "900", "index": "0"}, 5100 * MIB),
            ("mig_exporter_card_utilization_ratio", {"card": "0"}, 0.12),
        ],
    ),
    "na-memory": Case(
        _smi("na-memory"),
        "nvidia-smi",
        True,
        2,
        [
            # N/A is left out, never written as 0.
            ("mig_exporter_device_memory_total_bytes", {"index": "0"}, None),
            ("mig_exporter_device_memory_used_bytes", {"index": "0"}, None),
            ("mig_exporter_process_memory_used_bytes", {"pid": "4242"}, None),
            ("mig_exporter_process_info", {"pid": "4243", "index": "0", "process_type": "G"}, 1),
            ("mig_exporter_card_temperature_celsius", {"card": "0"}, None),
            ("mig_exporter_card_utilization_ratio", {"card": "0"}, None),
            ("mig_exporter_card_utilization_ratio", {"card": "1"}, 0.0),
            ("mig_exporter_device_memory_used_bytes", {"index": "1"}, 2 * MIB),
            ("mig_exporter_card_info", {"card": "1", "driver_version": "535.154.05", "cuda_version": "12.2"}, 1),
        ],
    ),
    "read-error": Case(
        lambda fake: RaisingSource(ReadError("nvidia-smi: exit status 9")), "raising", False, 0,
        [("mig_exporter_card_info", {}, None), ("mig_exporter_process_info", {}, None)],
    ),
    "unexpected-error": Case(
        lambda fake: RaisingSource(RuntimeError("a bug")), "raising", False, 0,
        [("mig_exporter_card_info", {}, None)],
    ),
    "nvidia-smi-fails": Case(
        _failing_smi, "nvidia-smi", False, 0,
        [("mig_exporter_card_info", {}, None)],
    ),
}


@pytest.fixture(params=list(CASES))
def case(request, fake_nvidia_smi) -> tuple[Case, CollectorRegistry]:
    """A case and a fresh registry that reads its source at every render."""
    c = CASES[request.param]
    registry = CollectorRegistry(auto_describe=False)
    engines = c.engines() if c.engines else None
    registry.register(Exporter(Scraper(c.source(fake_nvidia_smi), engines), timeout_s=READ_TIMEOUT_S))
    return c, registry


def _samples(families) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(name, sorted labels): value}; a repeated series is an error."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in families:
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"series {key} exposed twice"
            out[key] = s.value
    return out


def _matching(samples, name: str, labels: dict[str, str]) -> list[float]:
    return [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]


def test_promtool_finds_nothing(case):
    c, registry = case
    text = generate_latest(registry)
    result = subprocess.run(
        [_promtool(), "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    findings = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, f"promtool exit {result.returncode}:\n{findings}"
    assert result.stdout == b""
    assert result.stderr == b""
    # The text promtool approved is the one the read produced, not an empty page.
    assert f'mig_exporter_read_success{{source="{c.source_name}"}} {1.0 if c.success else 0.0}'.encode() in text


def test_promtool_reports_findings_in_a_bad_exposition():
    """The check above is not vacuous: promtool does flag a bad exposition."""
    bad = b"# HELP x_milliseconds x\n# TYPE x_milliseconds gauge\nx_milliseconds 1\n"
    result = subprocess.run([_promtool(), "check", "metrics"], input=bad, capture_output=True, timeout=60, check=False)
    assert result.returncode == 3
    assert result.stderr.decode().strip() == 'x_milliseconds use base unit "seconds" instead of "milliseconds"'


def test_text_exposition_values(case):
    c, registry = case
    samples = _samples(parse_text(generate_latest(registry).decode()))
    assert _matching(samples, "mig_exporter_read_success", {"source": c.source_name}) == [1.0 if c.success else 0.0]
    errors = _matching(samples, "mig_exporter_read_errors_total", {"source": c.source_name})
    assert errors == [0.0 if c.success else 1.0]
    assert len(_matching(samples, "mig_exporter_device_info", {})) == c.devices
    assert _matching(samples, "mig_exporter_build_info", {}) == [1.0]
    (duration,) = _matching(samples, "mig_exporter_read_duration_seconds", {"source": c.source_name})
    assert 0 <= duration < READ_TIMEOUT_S
    for name, labels, value in c.expect:
        found = _matching(samples, name, labels)
        if value is None:
            assert found == [], f"{name}{labels} should be absent, got {found}"
        else:
            assert len(found) == 1, f"{name}{labels}: expected one series, got {found}"
            assert math.isclose(found[0], value, rel_tol=0, abs_tol=1e-9), f"{name}{labels}: {found[0]} != {value}"


def test_openmetrics_agrees_with_text(case):
    """Prometheus negotiates OpenMetrics when it scrapes; it must carry the same series."""
    c, registry = case
    text = _samples(parse_text(generate_latest(registry).decode()))
    openmetrics_bytes = generate_latest_openmetrics(registry)
    assert openmetrics_bytes.endswith(b"# EOF\n")
    openmetrics = _samples(parse_openmetrics(openmetrics_bytes.decode()))

    def stable(samples):
        return {k: v for k, v in samples.items() if k[0] not in PER_RENDER}

    assert stable(openmetrics) == stable(text)
    # The second render read again: a failed read counted once more.
    errors = _matching(openmetrics, "mig_exporter_read_errors_total", {"source": c.source_name})
    assert errors == [0.0 if c.success else 2.0]
    (duration,) = _matching(openmetrics, "mig_exporter_read_duration_seconds", {"source": c.source_name})
    assert 0 <= duration < READ_TIMEOUT_S
