"""--collector.processes (all, top=N, none), mig_exporter_scrape_series, and devices whose
process list the driver does not give."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from benchmarks.scenarios import Shape, listing, query_xml
from conftest import MIB, REPO, SAMPLES, fixture_bytes, sample_value, samples, samples_of, scenario, value
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

    per_process = ("mig_exporter_engine_memory", "mig_exporter_engine_info")

    def kept(parsed):
        return {k: v for k, v in parsed.items()
                if not k[0].startswith(("mig_exporter_process_", *per_process))
                and k[0] not in ("mig_exporter_scrape_series", "mig_exporter_read_duration_seconds")}

    def engines(parsed):
        return {k: v for k, v in parsed.items() if k[0].startswith(per_process)}

    def memory_by_engine(parsed):
        sums = {}
        for (name, labels), v in engines(parsed).items():
            if name == "mig_exporter_engine_memory_used_bytes":
                sums[dict(labels)["engine"]] = sums.get(dict(labels)["engine"], 0) + v
        return sums

    for setting in ("top=1", "none"):
        assert kept(texts[setting]) == kept(texts["all"]), setting
        assert memory_by_engine(texts[setting]) == memory_by_engine(texts["all"]) == {
            "llama.cpp": (11520 + 20480) * MIB, "vllm": 9216 * MIB}, setting
    # The demo has one engine process a device: top=1 keeps each by itself.
    assert engines(texts["top=1"]) == engines(texts["all"])
    # none: the llama-server on no GPU (52040) keeps its own series, which the alert reads; the rest
    # are one pid="other" memory series per engine and one info series per engine and device.
    assert {(name, tuple(sorted(labels))): v for (name, labels), v in engines(texts["none"]).items()} == {
        ("mig_exporter_engine_memory_used_bytes", (("engine", "llama.cpp"), ("pid", "52040"))): 0,
        ("mig_exporter_engine_memory_used_bytes", (("engine", "llama.cpp"), ("pid", "other"))): 32000 * MIB,
        ("mig_exporter_engine_memory_used_bytes", (("engine", "vllm"), ("pid", "other"))): 9216 * MIB,
        ("mig_exporter_engine_info", (("comm", "llama-server"), ("engine", "llama.cpp"), ("index", ""),
                                      ("pid", "52040"))): 1,
        ("mig_exporter_engine_info", (("comm", ""), ("engine", "llama.cpp"), ("index", "1"), ("pid", "other"))): 1,
        ("mig_exporter_engine_info", (("comm", ""), ("engine", "llama.cpp"), ("index", "1000"),
                                      ("pid", "other"))): 1,
        ("mig_exporter_engine_info", (("comm", ""), ("engine", "vllm"), ("index", "1001"), ("pid", "other"))): 1,
    }
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


# --- the engine families under top=N and none (issue 36) ------------------------------------------

def _engine(pid: int, used_mib: int | None, *devices: int, engine: str = "llama.cpp"):
    from mig_exporter.model.readings import EngineProcess

    return EngineProcess(engine, pid, "llama-server", None if used_mib is None else used_mib * MIB, devices)


def test_engines_on_no_gpu_keep_their_own_series_and_the_rest_are_taken_by_memory():
    on_cpu = _engine(5, 0)
    engines = [_engine(10, 100, 1000), _engine(11, 300, 1000), _engine(12, 200, 1000), on_cpu,
               _engine(13, 900, 1000, 1001),  # tensor-parallel over two devices: one of each device's N
               _engine(14, 50, 1001), _engine(15, 60, 1001)]
    assert ProcessSeries().select_engines(engines) == (engines, [])
    own, folded = ProcessSeries(top=2).select_engines(engines)
    # By memory, most first: 13 (both devices), 11 (1000 is then full), 15 (1001 is then full).
    assert [e.pid for e in own] == [11, 5, 13, 15]
    assert [e.pid for e in folded] == [10, 12, 14]
    own, folded = ProcessSeries(enabled=False).select_engines(engines)
    assert own == [on_cpu] and [e.pid for e in folded] == [10, 11, 12, 13, 14, 15]


def test_an_engine_of_unknown_memory_is_kept_under_top_n_and_summed_under_none():
    unknown = _engine(20, None, 1000)
    engines = [_engine(10, 100, 1000), unknown, _engine(11, 300, 1000)]
    own, folded = ProcessSeries(top=1).select_engines(engines)
    assert own == [unknown, engines[2]] and folded == [engines[0]]  # not counted towards N
    own, folded = ProcessSeries(enabled=False).select_engines(engines)
    assert own == [] and folded == engines
    # Hidden devices (a process list N/A): an engine listed nowhere has unknown memory and no device.
    hidden = _engine(21, None)
    assert ProcessSeries(enabled=False).select_engines([hidden]) == ([hidden], [])


def test_the_engine_families_sum_the_rest_per_engine_and_device_and_keep_each_sum():
    from mig_exporter.metrics.families import engine_families
    from mig_exporter.model.readings import EngineReading

    processes = (_engine(10, 100, 1000), _engine(11, 300, 1000), _engine(12, None, 1001), _engine(13, 0),
                 _engine(30, 4000, 1, engine="vllm"), _engine(31, 500, 1, 1000, engine="vllm"))
    reading = EngineReading(("llama.cpp", "vllm"), True, processes, True)

    def rows(setting):
        families = list(engine_families(reading, ProcessSeries.parse(setting)))
        memory = {(s.labels["engine"], s.labels["pid"]): s.value
                  for s in samples_of(families, "mig_exporter_engine_memory_used_bytes")}
        info = sorted((s.labels["engine"], s.labels["pid"], s.labels["comm"], s.labels["index"])
                      for s in samples_of(families, "mig_exporter_engine_info"))
        return memory, info

    every, _ = rows("all")
    for setting in ("all", "top=1", "none"):
        memory, _ = rows(setting)
        for engine in ("llama.cpp", "vllm"):  # what the recording rule sums: the same under every setting
            assert sum(v for (e, _), v in memory.items() if e == engine) == sum(
                v for (e, _), v in every.items() if e == engine), (setting, engine)
    assert rows("none") == (
        {("llama.cpp", "13"): 0, ("llama.cpp", "other"): 400 * MIB, ("vllm", "other"): 4500 * MIB},
        [("llama.cpp", "13", "llama-server", ""), ("llama.cpp", "other", "", "1000"),
         ("llama.cpp", "other", "", "1001"), ("vllm", "other", "", "1"), ("vllm", "other", "", "1000")])
    # top=1: 11 is the biggest on 1000; 12's memory is unknown, so it keeps its info (no memory series);
    # vllm's 30 takes device 1, so 31 (on 1 and 1000) is summed.
    assert rows("top=1") == (
        {("llama.cpp", "11"): 300 * MIB, ("llama.cpp", "13"): 0, ("llama.cpp", "other"): 100 * MIB,
         ("vllm", "30"): 4000 * MIB, ("vllm", "other"): 500 * MIB},
        [("llama.cpp", "11", "llama-server", "1000"), ("llama.cpp", "12", "llama-server", "1001"),
         ("llama.cpp", "13", "llama-server", ""), ("llama.cpp", "other", "", "1000"),
         ("vllm", "30", "llama-server", "1"), ("vllm", "other", "", "1"), ("vllm", "other", "", "1000")])


def test_on_an_all_llama_server_big_mig_node_none_leaves_no_pid_and_top_3_three_a_device():
    """Issue 36's node: big-mig (8 H100 x 7 MIG x 16 processes), every process a llama-server
    asked for -ngl 99, and two more llama-servers on no GPU's list (pids 1 and 2). Exact counts:
    what each setting adds to the same node with no engine running."""
    from benchmarks.scenarios import BIG_MIG
    from benchmarks.series import LLAMA_SERVER, NO_ENGINE, engines_with_own_series, series_of, snapshot_of, with_pid

    snapshot = snapshot_of(BIG_MIG)
    devices, processes = len(snapshot.devices), len(snapshot.processes)
    assert (devices, processes) == (56, 896)
    total = sum(p.used_bytes or 0 for p in snapshot.processes)

    def engine_series(found):
        return {(name, frozenset(labels)): labels for name, labels in found
                if name in ("mig_exporter_engine_memory_used_bytes", "mig_exporter_engine_info")}

    for setting, per_pid, other in (("all", 896, 0), ("top=3", 3 * 56, 1 + 56), ("none", 0, 1 + 56)):
        plain = series_of(snapshot, setting, NO_ENGINE)
        found = series_of(snapshot, setting, LLAMA_SERVER, on_cpu=2)
        engines = engine_series(found)
        # Each engine process with series of its own has two (memory, info); the two on the CPU too.
        assert len(engines) == 2 * per_pid + 2 * 2 + other, setting
        assert len(found) == len(plain) + len(engines), setting
        with_a_pid = with_pid(found)
        own = engines_with_own_series(found)
        on_cpu = {dict(labels)["pid"] for name, labels in with_a_pid
                  if name == "mig_exporter_engine_info" and dict(labels)["index"] == ""}
        assert on_cpu == {"1", "2"}, setting
        assert own.pop("") == 2
        if setting == "none":
            # No series with a pid but the two engines on the CPU, which EngineHoldsNoGPUMemory names.
            assert {dict(labels)["pid"] for _, labels in with_a_pid} == {"1", "2"}
            assert len(with_a_pid) == 4 and own == {}
        elif setting == "top=3":
            assert set(own.values()) == {3} and len(own) == devices  # at most 3 a device: here 3 on each
            assert len(with_a_pid) == 3 * devices * 2 + 3 * devices * 2 + 4  # processes' and engines'
        else:
            assert set(own.values()) == {16} and len(with_a_pid) == 4 * processes + 4
        # The memory of every engine series, summed: what the node's llama-servers hold, whatever the setting.
        memory = sum(v for (name, labels), v in _values(snapshot, setting).items()
                     if name == "mig_exporter_engine_memory_used_bytes")
        assert memory == total, setting


def _values(snapshot, setting):
    from benchmarks.series import LLAMA_SERVER, answer_of

    answer = answer_of(snapshot, setting, LLAMA_SERVER, on_cpu=2)
    return {(s.name, frozenset(s.labels.items())): s.value for f in answer.families for s in f.samples}


def test_top_3_keeps_each_device_s_three_biggest_llama_servers_and_sums_the_rest():
    from benchmarks.scenarios import BIG_MIG
    from benchmarks.series import snapshot_of

    snapshot = snapshot_of(BIG_MIG)
    values = _values(snapshot, "top=3")
    memory = {dict(labels)["pid"]: v for (name, labels), v in values.items()
              if name == "mig_exporter_engine_memory_used_bytes"}
    biggest = {str(p.pid) for d in snapshot.devices for p in sorted(
        snapshot.processes_on(d.index), key=lambda p: (-(p.used_bytes or 0), p.pid))[:3]}
    assert set(memory) == biggest | {"1", "2", "other"}
    assert memory["1"] == memory["2"] == 0
    assert memory["other"] == sum(p.used_bytes or 0 for p in snapshot.processes if str(p.pid) not in biggest)
    info = {(dict(labels)["pid"], dict(labels)["index"]) for (name, labels) in values
            if name == "mig_exporter_engine_info"}
    assert {index for pid, index in info if pid == "other"} == {str(d.index) for d in snapshot.devices}


def test_scale_md_gives_the_big_mig_series_the_benchmark_counts():
    """docs/scale.md's big-mig rows are benchmarks/series.py's counts of today's exporter: a family
    added or dropped shows here first (re-run ``python -m benchmarks.series`` and copy its table)."""
    from benchmarks.scenarios import BIG_MIG
    from benchmarks.series import NODES, SETTINGS, series_of, snapshot_of, with_pid

    text = (REPO / "docs" / "scale.md").read_text()
    snapshot = snapshot_of(BIG_MIG)
    for node in NODES:
        (row,) = [line for line in text.splitlines()
                  if line.startswith("| big-mig |") and f"| {node} |" in line]
        written = [int(cell) for cell in row.strip("|").split("|")[3:6]]
        counted = [len(series_of(snapshot, setting, node)) for setting in SETTINGS]
        assert written == counted, (node, row)
    (row,) = [line for line in text.splitlines() if line.startswith("| big-mig | 3584 (16) |")]
    assert [len(with_pid(series_of(snapshot, s, "llama-server"))) for s in SETTINGS] == [
        int(cell.split("(")[0]) for cell in row.strip("|").split("|")[1:4]]
