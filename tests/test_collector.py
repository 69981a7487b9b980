"""Snapshot to metric families: names, labels and values, through a real registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import MIB, sample_value, scenario
from mig_exporter.core.errors import CommandTimeout
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource


class _Fixed:
    """A source that returns one scenario, or fails the way it is told."""

    name = "nvidia-smi"

    def __init__(self, snapshot=None, error: Exception | None = None) -> None:
        self.snapshot, self.error, self.reads = snapshot, error, 0

    def read(self, deadline=None):
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.snapshot

    def ready(self):
        return True, "fixed"

    def describe(self):
        return "fixed"


def _registry(source) -> tuple[CollectorRegistry, Scraper]:
    scraper = Scraper(source)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Exporter(scraper))
    return registry, scraper


def test_registering_the_collector_does_not_read():
    source = _Fixed(scenario("h100-mig-processes"))
    registry = CollectorRegistry()  # auto_describe=True, like the default registry
    registry.register(Exporter(Scraper(source)))
    assert source.reads == 0


def test_mig_node_series():
    registry, _ = _registry(_Fixed(scenario("h100-mig-processes")))
    get = registry.get_sample_value
    dev = {"index": "1002", "card": "0", "mig_profile": "1g.10gb"}
    assert get("mig_exporter_device_memory_used_bytes", dev) == 7493 * MIB
    assert get("mig_exporter_device_memory_total_bytes", dev) == 9984 * MIB
    assert get("mig_exporter_device_memory_reserved_bytes", dev) == 0
    assert get("mig_exporter_device_processes", dev) == 1
    assert get("mig_exporter_device_processes", {"index": "1001", "card": "0", "mig_profile": "2g.20gb"}) == 0
    assert get("mig_exporter_process_memory_used_bytes", {**dev, "pid": "21198"}) == 7484 * MIB
    outside_kubernetes = {"namespace": "", "pod": "", "container": "", "container_id": "",
                          "slurm_job": "", "slurm_step": "", "systemd_unit": "", "user": ""}
    assert get("mig_exporter_process_info", {**dev, "pid": "21198", "process_name": "./gpu_burn", "process_type": "C",
                                             **outside_kubernetes}) == 1
    assert get("mig_exporter_device_info", {
        **dev, "uuid": "MIG-ae36563d-8b6d-5a25-a43a-846eb31e7ea4", "gpu_instance": "9", "compute_instance": "0",
        "class": "h100-80g-mig-1g.10gb", "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "device": "0/mig2"}) == 1
    assert get("mig_exporter_device_info", {"index": "0"}) is None
    assert get("mig_exporter_card_mig_mode", {"card": "0", "state": "current"}) == 1
    assert get("mig_exporter_card_mig_mode", {"card": "0", "state": "pending"}) == 1
    assert get("mig_exporter_card_mig_instances", {"card": "0"}) == 4
    assert get("mig_exporter_card_utilization_ratio", {"card": "0"}) is None
    assert get("mig_exporter_card_temperature_celsius", {"card": "0"}) == 52
    assert get("mig_exporter_card_power_draw_watts", {"card": "0"}) == 432.17
    assert get("mig_exporter_card_info", {
        "card": "0", "uuid": "GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2", "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:19:00.0", "serial": "1654123056789", "driver_version": "550.90.07",
        "cuda_version": "12.4"}) == 1
    assert get("mig_exporter_card_read_success", {"card": "0"}) == 1
    assert get("mig_exporter_read_success", {"source": "nvidia-smi"}) == 1
    assert get("mig_exporter_read_errors_total", {"source": "nvidia-smi"}) == 0
    assert get("mig_exporter_read_problems", {"source": "nvidia-smi"}) == 0
    assert get("mig_exporter_build_info", {"version": "0.1.0"}) == 1


def _one_scrape(source):
    """Sample lookup over one collect(), matching the labels given (a subset)."""
    families = list(_registry(source)[0].collect())
    return lambda name, labels: sample_value(families, name, labels)


def test_whole_card_has_empty_profile_and_instance_labels():
    get = _one_scrape(_Fixed(scenario("a100-mig-pending")))
    whole = {"index": "0", "card": "0", "mig_profile": ""}
    assert get("mig_exporter_device_memory_used_bytes", whole) == 5123 * MIB
    assert get("mig_exporter_device_info",
               {**whole, "gpu_instance": "", "compute_instance": "", "class": "a100-80g", "device": "0"}) == 1
    assert get("mig_exporter_card_mig_mode", {"card": "0", "state": "current"}) == 0
    assert get("mig_exporter_card_mig_mode", {"card": "0", "state": "pending"}) == 1
    assert get("mig_exporter_card_mig_instances", {"card": "0"}) is None
    assert get("mig_exporter_card_utilization_ratio", {"card": "0"}) == 0.12


def test_unknown_values_are_left_out_never_zero():
    get = _one_scrape(_Fixed(scenario("na-memory")))
    a10g = {"index": "0", "card": "0", "mig_profile": ""}
    for field in ("total", "used", "free", "reserved"):
        assert get(f"mig_exporter_device_memory_{field}_bytes", a10g) is None
    assert get("mig_exporter_device_processes", a10g) == 2
    assert get("mig_exporter_process_memory_used_bytes", {"pid": "4242"}) is None
    assert get("mig_exporter_process_info", {"pid": "4242", "process_type": "C"}) == 1
    assert get("mig_exporter_card_temperature_celsius", {"card": "0"}) is None
    assert get("mig_exporter_card_mig_mode", {"card": "0", "state": "current"}) is None
    assert get("mig_exporter_card_utilization_ratio", {"card": "1"}) == 0.0


def test_nothing_carved_card_says_zero_instances_and_has_no_device():
    registry, _ = _registry(_Fixed(scenario("a100-mig-nothing-carved")))
    get = registry.get_sample_value
    assert get("mig_exporter_card_mig_instances", {"card": "0"}) == 0
    assert get("mig_exporter_card_mig_instances", {"card": "1"}) == 1
    text = generate_latest(registry).decode()
    assert 'index="0"' not in text and 'index="1100"' in text


def test_a_failed_read_answers_with_read_success_zero_and_counts_the_error():
    scraper = Scraper(_Fixed(error=CommandTimeout("nvidia-smi -q -x: timed out after 10.0s")))
    first = scraper.families()
    assert sample_value(first, "mig_exporter_read_success", {"source": "nvidia-smi"}) == 0
    assert sample_value(first, "mig_exporter_read_errors_total", {"source": "nvidia-smi"}) == 1
    assert sample_value(first, "mig_exporter_device_info", {}) is None
    assert sample_value(first, "mig_exporter_build_info", {"version": "0.1.0"}) == 1
    second = scraper.families()
    assert sample_value(second, "mig_exporter_read_errors_total", {"source": "nvidia-smi"}) == 2


def test_an_unexpected_exception_in_a_source_is_a_failed_read_not_a_crash(caplog):
    registry, _ = _registry(_Fixed(error=ZeroDivisionError("boom")))
    assert registry.get_sample_value("mig_exporter_read_success", {"source": "nvidia-smi"}) == 0
    assert "read from nvidia-smi failed unexpectedly" in caplog.text


def test_problems_are_counted_and_logged_once_until_they_clear(caplog):
    from conftest import fixture_bytes
    from mig_exporter.nvidia_smi.build import snapshot_from_smi

    broken = snapshot_from_smi(fixture_bytes("h100-mig-processes.xml"), b"garbage")
    fine = scenario("h100-mig-processes")
    source = _Fixed(broken)
    registry, _ = _registry(source)
    caplog.set_level("INFO")
    for _ in range(3):
        assert registry.get_sample_value("mig_exporter_read_problems", {"source": "nvidia-smi"}) == 1
    assert caplog.text.count("nvidia-smi -L line 1") == 1
    source.snapshot = fine
    assert registry.get_sample_value("mig_exporter_read_problems", {"source": "nvidia-smi"}) == 0
    assert "cleared: nvidia-smi -L line 1" in caplog.text


def test_every_family_appears_once_per_exposition():
    registry, _ = _registry(DemoSource())
    text = generate_latest(registry).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    assert "mig_exporter_process_info" in types


@pytest.mark.parametrize("name", ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved",
                                  "a100-mig-pending", "na-memory"])
def test_no_two_samples_share_a_name_and_labels(name):
    registry, _ = _registry(_Fixed(scenario(name)))
    seen = set()
    for family in registry.collect():
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen
            seen.add(key)


def test_a_repeating_bug_logs_its_traceback_once(caplog):
    scraper = Scraper(_Fixed(error=ZeroDivisionError("boom")))
    for _ in range(3):
        scraper.families()
    assert caplog.text.count("Traceback") == 1
    assert caplog.text.count("read from nvidia-smi failed: unexpected ZeroDivisionError: boom") == 3
