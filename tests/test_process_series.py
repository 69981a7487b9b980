"""--collector.processes (all, top=N, none), mig_exporter_scrape_series, and devices whose
process list the driver does not give."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from benchmarks.scenarios import Shape, listing, query_xml
from conftest import MIB, SAMPLES, fixture_bytes, sample_value, samples, samples_of, scenario, value
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.exposition import render
from mig_exporter.metrics.families import snapshot_families
from mig_exporter.metrics.process_series import ALL_PROCESSES, ProcessSeries
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.sources.demo import DemoSource

FOUR_EACH = Shape("four-each", 2, 3, 4)  # 2 cards x 3 MIG instances x 4 processes


def _four_each() -> Snapshot:
    return snapshot_from_smi(query_xml(FOUR_EACH), listing(FOUR_EACH))


def _memory_rows(families) -> dict[tuple[str, str], float]:
    return {(s.labels["index"], s.labels["pid"]): s.value
            for s in samples_of(families, "mig_exporter_process_memory_used_bytes")}


@pytest.mark.parametrize(("text", "top", "enabled"), [
    ("all", None, True), ("ALL", None, True), ("none", None, False), ("top=3", 3, True), (" top=1 ", 1, True),
])
def test_the_setting_reads_all_none_and_top_n(text, top, enabled):
    setting = ProcessSeries.parse(text)
    assert (setting.top, setting.enabled) == (top, enabled)
    assert ProcessSeries.parse(str(setting)) == setting


@pytest.mark.parametrize("text", ["top=0", "top=-1", "top=", "top=x", "some", "", "top 3"])
def test_a_bad_setting_is_refused_with_what_is_allowed(text):
    with pytest.raises(ValueError, match="is not all, none or top=N"):
        ProcessSeries.parse(text)


def test_the_cli_refuses_a_bad_setting_with_the_option_named():
    done = subprocess.run([sys.executable, "-m", "mig_exporter", "read", "--demo", "--collector.processes", "top=0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--collector.processes" in done.stderr and "top=N" in done.stderr


def test_top_n_keeps_the_biggest_per_device_and_folds_the_rest_into_other():
    snapshot = _four_each()
    every = _memory_rows(list(snapshot_families(snapshot)))
    top = list(snapshot_families(snapshot, process_series=ProcessSeries(top=2)))
    kept = _memory_rows(top)
    for device in snapshot.devices:
        on = sorted(snapshot.processes_on(device.index), key=lambda p: (-(p.used_bytes or 0), p.pid))
        assert len(on) == 4
        index = str(device.index)
        # The two biggest by themselves, the other two as one "other" series: the sum holds.
        assert {pid for (i, pid) in kept if i == index} == {str(on[0].pid), str(on[1].pid), "other"}
        assert kept[(index, "other")] == (on[2].used_bytes or 0) + (on[3].used_bytes or 0)
        assert sum(v for (i, _), v in kept.items() if i == index) == sum(v for (i, _), v in every.items() if i == index)
        # process_info for the kept ones only; the device still counts all four.
        assert {s.labels["pid"] for s in samples_of(top, "mig_exporter_process_info")
                if s.labels["index"] == index} == {str(on[0].pid), str(on[1].pid)}
        assert sample_value(top, "mig_exporter_device_processes", {"index": index}) == 4
    assert len(kept) == len(snapshot.devices) * 3


def test_top_n_at_or_above_the_count_changes_nothing():
    snapshot = _four_each()
    every = render(list(snapshot_families(snapshot)), None)[0]
    assert render(list(snapshot_families(snapshot, process_series=ProcessSeries(top=4))), None)[0] == every


def test_a_process_of_unknown_memory_is_never_folded_into_other():
    snapshot = _four_each()
    device = snapshot.devices[0]
    smallest = min(snapshot.processes_on(device.index), key=lambda p: p.used_bytes or 0)
    unknown = smallest._replace(used_bytes=None)
    processes = tuple(unknown if p is smallest else p for p in snapshot.processes)
    snapshot = dataclasses.replace(snapshot, processes=processes)
    families = list(snapshot_families(snapshot, process_series=ProcessSeries(top=1)))
    info = {s.labels["pid"] for s in samples_of(families, "mig_exporter_process_info")
            if s.labels["index"] == str(device.index)}
    known = sorted((p for p in snapshot.processes_on(device.index) if p.used_bytes is not None),
                   key=lambda p: -(p.used_bytes or 0))
    # The biggest known one, and the unknown one, which has no memory series and is in no "other".
    assert info == {str(known[0].pid), str(unknown.pid)}
    rows = _memory_rows(families)
    assert (str(device.index), str(unknown.pid)) not in rows
    assert rows[(str(device.index), "other")] == sum(p.used_bytes or 0 for p in known[1:])


def test_none_writes_no_process_series_and_keeps_every_device_family():
    snapshot = scenario("h100-mig-processes")
    every = list(snapshot_families(snapshot))
    none = list(snapshot_families(snapshot, process_series=ProcessSeries(enabled=False)))
    assert not [f for f in none if f.name.startswith("mig_exporter_process_")]
    kept = {f.name for f in every} - {"mig_exporter_process_memory_used_bytes", "mig_exporter_process_info"}
    assert {f.name for f in none} == kept
    assert render([f for f in every if f.name in kept], None) == render(none, None)


def test_pod_owner_and_engine_families_count_every_process_whatever_the_setting(tmp_path):
    from mig_exporter.engines.attribution import EngineReader
    from mig_exporter.engines.rules import DEFAULT_SETTINGS
    from mig_exporter.sources.demo import DemoProcs

    texts = {}
    for setting in ("all", "top=1", "none"):
        scraper = Scraper(DemoSource(), EngineReader(DEFAULT_SETTINGS, DemoProcs()),
                          process_series=ProcessSeries.parse(setting))
        texts[setting] = samples(Exporter(scraper).answer(_deadline()).encoded(None, False)[0].decode())
    for setting in ("top=1", "none"):
        def kept(parsed):
            return {k: v for k, v in parsed.items()
                    if not k[0].startswith("mig_exporter_process_") and k[0] != "mig_exporter_scrape_series"
                    and k[0] != "mig_exporter_read_duration_seconds"}
        assert kept(texts[setting]) == kept(texts["all"]), setting
    # The demo's whole card 1 has 50102 (20 GiB) and 50318: top=1 folds 50318 into other.
    top = texts["top=1"]
    assert value(top, "mig_exporter_process_memory_used_bytes", index="1", pid="50102") == 20480 * MIB
    assert value(top, "mig_exporter_process_memory_used_bytes", index="1", pid="other") == value(
        texts["all"], "mig_exporter_process_memory_used_bytes", index="1", pid="50318")
    assert value(top, "mig_exporter_device_processes", index="1") == 2


def _deadline():
    from mig_exporter.core.deadline import Deadline

    return Deadline.after(30)


@pytest.mark.parametrize("accept", [None, "application/openmetrics-text; version=1.0.0"])
@pytest.mark.parametrize("setting", ["all", "top=1", "none"])
def test_scrape_series_counts_every_sample_of_the_answer_itself_included(setting, accept):
    scraper = Scraper(DemoSource(), process_series=ProcessSeries.parse(setting))
    body = Exporter(scraper).answer(_deadline()).encoded(accept, False)[0].decode()
    lines = [line for line in body.splitlines() if line and not line.startswith("#")]
    written = [line for line in lines if line.startswith("mig_exporter_scrape_series ")]
    assert len(written) == 1
    assert float(written[0].split()[1]) == len(lines)


def test_a_process_list_the_driver_gives_as_na_makes_its_devices_unknown_not_free():
    xml = fixture_bytes("h100-mig-processes.xml")
    assert xml.count(b"<processes>") == 1
    start, end = xml.index(b"<processes>"), xml.index(b"</processes>") + len(b"</processes>")
    for replacement in (b"<processes>N/A</processes>", b"<processes>Not Supported</processes>", b""):
        snapshot = snapshot_from_smi(xml[:start] + replacement + xml[end:], fixture_bytes("h100-mig-processes.L.txt"))
        assert snapshot.devices and not any(d.processes_known for d in snapshot.devices), replacement
        assert snapshot.processes == ()
        families = list(snapshot_families(snapshot))
        assert samples_of(families, "mig_exporter_device_processes") == []
        assert len(samples_of(families, "mig_exporter_device_memory_used_bytes")) == len(snapshot.devices)
    # An empty list is a list: every device is known, and free where nothing runs.
    empty = snapshot_from_smi(xml[:start] + b"<processes>\n\t\t</processes>" + xml[end:],
                              fixture_bytes("h100-mig-processes.L.txt"))
    assert all(d.processes_known for d in empty.devices)
    assert {s.value for s in samples_of(list(snapshot_families(empty)), "mig_exporter_device_processes")} == {0}


def test_the_demo_and_every_scenario_know_their_process_lists():
    assert all(d.processes_known for d in DemoSource().read().devices)
    for name in ("h100-mig-processes", "h200-shared-gpu-instance", "na-memory", "a100-mig-pending"):
        assert all(d.processes_known for d in scenario(name).devices), name
    assert (SAMPLES / "demo.xml").exists()


def test_all_is_the_default():
    assert Scraper(DemoSource()).process_series == ALL_PROCESSES
    assert str(ALL_PROCESSES) == "all"


def test_the_series_a_node_costs_follow_the_setting():
    """benchmarks/series.py's counts (docs/scale.md): per process two series (memory and info)
    under all; under top=3 three of each a device and one "other"; none under none."""
    from benchmarks.series import churn, series_of, snapshot_of

    snapshot = snapshot_of(FOUR_EACH)
    counts = {setting: len(series_of(snapshot, setting)) for setting in ("all", "top=3", "none")}
    devices, processes = len(snapshot.devices), len(snapshot.processes)
    assert (devices, processes) == (6, 24)
    assert counts["all"] == counts["none"] + 2 * processes
    assert counts["top=3"] == counts["none"] + devices * (2 * 3 + 1)
    # A day of turnover every 10 minutes: each turnover makes every per-process series anew.
    day = churn(FOUR_EACH, "all")
    assert day.per_scrape == counts["all"]
    assert day.distinct_in_a_day == counts["none"] + 144 * 2 * processes
    assert churn(FOUR_EACH, "none").new_per_hour == 0
