"""The benchmark (benchmarks/, ``./scripts/bench``) runs, prints its tables,
and measures the machines the issue names. No timing is asserted here: the
figures are checked by the benchmark itself, on a quiet machine."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from conftest import MIB, REPO, without_activity

sys.path.insert(0, str(REPO))
from benchmarks import fleet, plot, podresources, procscan, scenarios
from benchmarks.run import (
    CHANGING,
    INSTANCE_SCALING,
    PROCESS_SCALING,
    Results,
    SmiResult,
    changing,
    runs_table,
    targets,
)
from benchmarks.serving import write_fake_nvidia_smi
from mig_exporter.host.procfs import ProcfsSource
from mig_exporter.kubernetes.podresources import parse_list_response
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi
from mig_exporter.nvidia_smi.query_xml import parse_query_xml
from mig_exporter.sources.nvml import NvmlSource


def test_big_mig_is_eight_cards_of_seven_instances_with_sixteen_processes_each():
    xml, listing = scenarios.query_xml(scenarios.BIG_MIG), scenarios.listing(scenarios.BIG_MIG)
    report = parse_query_xml(xml)
    assert report.problems == ()
    assert len(report.cards) == 8 and all(c.mig_current for c in report.cards)
    snapshot = snapshot_from_smi(xml, listing)
    assert snapshot.problems == ()
    assert len(snapshot.devices) == 56
    assert len(snapshot.processes) == 896
    assert {d.profile for d in snapshot.devices} == {"1g.10gb"}
    assert all(len(snapshot.processes_on(d.index)) == 16 for d in snapshot.devices)
    assert len({p.pid for p in snapshot.processes}) == 896
    # The whole report, as nvidia-smi writes it: every card keeps its other blocks.
    assert xml.count(b"<supported_graphics_clock>") == 8 * 110
    assert xml.count(b"<ecc_errors>") == 8 and xml.count(b"<bar1_memory_usage>") == 8 + 56


def test_big_whole_and_single():
    whole = snapshot_from_smi(scenarios.query_xml(scenarios.BIG_WHOLE), scenarios.listing(scenarios.BIG_WHOLE))
    assert [d.index for d in whole.devices] == list(range(8))
    assert len(whole.processes) == 512
    assert {p.type for p in whole.processes} == {"C", "G"}
    single = snapshot_from_smi(scenarios.query_xml(scenarios.SINGLE), scenarios.listing(scenarios.SINGLE))
    assert [d.index for d in single.devices] == [1000 + i for i in range(7)]
    assert len(single.processes) == 7


@pytest.mark.parametrize("shape", [scenarios.BIG_MIG, scenarios.BIG_WHOLE, scenarios.SINGLE, INSTANCE_SCALING[0]],
                         ids=lambda s: s.name)
def test_each_scenario_is_one_machine_through_nvml_and_nvidia_smi(fake_nvml_lib, shape):
    fake = fake_nvml_lib(scenarios.nvml_scenario(shape))
    # Less what only NVML reads (GPM activity; the scenarios give no pmon to compare with).
    assert without_activity(NvmlSource().read()) == snapshot_from_smi(scenarios.query_xml(shape),
                                                                              scenarios.listing(shape))
    assert fake.exceptions == []


def test_the_pod_resources_answers_are_a_gpu_node_s_and_every_decoder_reads_the_same_pods(podresources_pb):
    answers = podresources.answers(podresources_pb)
    assert [a.pods for a in answers] == [110, 500]
    before, _ = podresources.decoder_before()  # None outside a git checkout with that commit
    for answer in answers:
        pods = parse_list_response(answer.data)
        assert len(pods) == answer.pods
        resources = [d.resource_name for p in pods for c in p.containers for d in c.devices]
        assert {r.split("-", 1)[0] for r in resources} == {
            "nvidia.com/gpu", "nvidia.com/mig", "example.com/fpga", "intel.com/sriov_netdevice"}
        assert sum(r == "nvidia.com/gpu" for r in resources) >= answer.pods // 3
        assert sum(r.startswith("nvidia.com/mig-") for r in resources) >= answer.pods // 3
        assert any("::" in i for p in pods for c in p.containers for d in c.devices for i in d.device_ids)
        assert len({len(p.containers) for p in pods}) == 3  # 1 to 3 containers
        podresources.check_same(answer, podresources_pb, before)  # raises where two decoders disagree


def _rows(text: str, title: str) -> list[list[str]]:
    """The rows of the table printed under ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 3:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


# About 30 s alone; several times that while other suites share the 2 cores.
@pytest.mark.timeout(320)
def test_the_benchmark_runs_in_quick_mode_and_prints_every_table(tmp_path):
    figures_path = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(figures_path)],
        cwd=REPO, capture_output=True, text=True, timeout=310, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "QUICK MODE" in out

    smi = _rows(out, "nvidia-smi path")
    assert [r[0] for r in smi] == ["big-mig", "big-whole", "single", "big-mig, every value new"]
    for row in smi[:3]:
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", cell) for cell in row[2:]), row  # every figure measured
    # The worst case: nothing kept between reads (its in-process figures are big-mig's).
    assert smi[3][4] == "n/a" and all(re.fullmatch(r"-?\d+(\.\d+)?", c) for i, c in enumerate(smi[3][2:], 2) if i != 4)
    assert float(smi[0][2]) > 300  # KiB of XML: the whole report, not a skeleton

    nvml = _rows(out, "NVML path")
    assert [r[0] for r in nvml] == ["big-mig", "big-whole", "single"]
    nvitop_installed = importlib.util.find_spec("nvitop_exporter") is not None
    for row in nvml:
        assert re.fullmatch(r"\d+\.\d+", row[1]) and re.fullmatch(r"\d+\.\d+", row[2]), row
        if nvitop_installed:
            assert re.fullmatch(r"\d+\.\d+", row[6]) and int(row[5]) > 0, row
        else:
            assert "nvitop-exporter not installed" in row[6], row

    processes = _rows(out, "scaling with processes")
    assert [r[0] for r in processes] == [s.name for s in PROCESS_SCALING]
    assert [int(r[2]) for r in processes] == [112, 224, 448, 896, 1792]
    instances = _rows(out, "scaling with instances")
    assert [r[0] for r in instances] == [s.name for s in INSTANCE_SCALING]
    assert [int(r[1]) for r in instances] == [7, 14, 28, 56]
    assert out.count("least-squares line") == 4

    decoding = _rows(out, "pod-resources List decoding")
    assert [r[0] for r in decoding] == ["110", "500"]
    has_before = podresources.decoder_before()[0] is not None
    for row in decoding:
        before_cells = {4, 12}  # before, before / after
        assert all(re.fullmatch(r"\d+(\.\d+)?", cell) for i, cell in enumerate(row) if i not in before_cells), row
        assert all(bool(re.fullmatch(r"\d+\.\d+", row[i])) == has_before for i in before_cells), row
    assert re.search(r"protobuf = protobuf [\d.]+, backend (upb|cpp|python)", out)

    reads = _rows(out, "/proc scan of a fabricated tree")
    assert [r[0].split(" (")[0] for r in reads] == ["cold", "warm", "churn"]
    assert all(re.fullmatch(r"\d+\.\d+", cell) for r in reads for cell in r[1:]), reads
    scrapes = _rows(out, "/proc scan on the scrape's path")
    assert [(r[0], r[1]) for r in scrapes] == [("small tree", "50"), ("big tree", "5000"), ("difference", "4950")]
    assert all(re.fullmatch(r"-?\d+\.\d+", cell) for r in scrapes for cell in r[2:]), scrapes
    has_nvml_lib = (REPO / "benchmarks" / "nvml_lib.py").exists()
    assert ("benchmarks/nvml_lib.py is absent" in out) != has_nvml_lib

    rows = _rows(out, "targets (issue 17)")
    assert [r[0] for r in rows] == [t.name for t in targets(Results())] == [
        "overhead p50, big-mig", "server CPU per scrape, big-mig", "overhead p50, big-whole", "overhead p50, single",
        "peak RSS of the serving process", "smi total slope per process", "smi total slope per MIG instance",
        "/proc scan of 5000, warm p50", "/proc 5000 vs 50: scrape p50 added",
        "NVML via C library: CPU per scrape, big-mig", "NVML via C library: / nvitop update CPU",
    ]
    assert [r[2] for r in rows] == ["<= 8 ms", "<= 9.8 ms", "<= 7 ms", "<= 1.5 ms", "<= 45 MiB", "<= 8 us", "<= 25 us",
                                    "<= 10 ms", "<= 1 ms", "<= 3 ms", "<= 0.2 x"]
    for row in rows[:9]:  # measured in every run
        assert re.fullmatch(r"-?\d+\.\d+", row[1]) and row[3] in ("PASS", "MISS"), row
    if has_nvml_lib:
        cpu, ratio = rows[9:]
        assert re.fullmatch(r"\d+\.\d+", cpu[1]) and cpu[3] in ("PASS", "MISS"), cpu
        if nvitop_installed:  # the ratio needs nvitop-exporter on the same library (the bench extra)
            assert re.fullmatch(r"\d+\.\d+", ratio[1]) and ratio[3] in ("PASS", "MISS"), ratio
        else:
            assert ratio[1:] == ["n/a", "<= 0.2 x", "not measured"], ratio
    else:
        assert [r[1:] for r in rows[9:]] == [["n/a", "<= 3 ms", "not measured"], ["n/a", "<= 0.2 x", "not measured"]]

    # --json: the same figures, for benchmarks/plot.py
    figures = json.loads(figures_path.read_text())
    assert figures["quick"] is True
    assert [t["verdict"] for t in figures["targets"]] == [r[3] for r in rows]
    assert [p["processes"] for p in figures["process_scaling"]["points"]] == [112, 224, 448, 896, 1792]
    assert [p["devices"] for p in figures["instance_scaling"]["points"]] == [7, 14, 28, 56]
    slope = figures["process_scaling"]["fits"]["smi total"]["slope_us"]
    assert f"{slope:.2f}" == rows[5][1]
    assert figures["procscan"]["read"]["processes"] == 5000
    assert figures["procscan"]["scrape"]["big_processes"] == 5000
    lines = plot.series(figures, "process_scaling")
    assert [s.label for s in lines][:4] == [m[1] for m in plot.MEASURES]
    total = lines[2]
    assert total.xs == (112, 224, 448, 896, 1792)
    assert abs(total.slope * 1000 - slope) < 1e-6  # the plot's line is the benchmark's line
    assert len(plot.series(figures, "instance_scaling")[0].xs) == 4


def test_the_least_squares_line_goes_through_points_on_a_line():
    assert plot.least_squares([1, 2, 4], [3, 5, 9]) == (2.0, 1.0)


def test_a_fabricated_proc_tree_is_read_whole_and_churn_replaces_a_tenth(tmp_path):
    root = procscan.make_tree(tmp_path / "proc", 40)
    source = ProcfsSource(str(root))
    first = source.read()
    assert first.namespace.is_host
    pids = sorted(p for p in first.processes if p >= procscan.FIRST_PID)
    assert len(pids) == 40 and len(first.processes) == 43  # and init, kthreadd, the exporter
    assert first.processes[pids[0]].thread_ids == (pids[0], pids[0] + 1, pids[0] + 2)
    assert {first.processes[p].comm for p in pids} == {k[0] for k in (*procscan._KINDS, procscan._ENGINE)}
    alive, next_pid = procscan.churn(root, pids, pids[-1] + 30)
    assert len(alive) == 40 and alive[:36] == pids[4:] and min(alive[36:]) == pids[-1] + 30
    again = source.read()  # the same source: whatever it keeps, it sees the new processes and not the gone
    assert sorted(p for p in again.processes if p >= procscan.FIRST_PID) == alive
    assert next_pid == pids[-1] + 30 + 4 * procscan.PID_STEP


def _smi(name: str, overhead: float, cpu: float, rss: float) -> SmiResult:
    shape = next(s for s in scenarios.MAIN_SHAPES if s.name == name)
    return SmiResult(shape, 1.0, 1.0, 1.0, 1.0, overhead_ms=overhead, server_cpu_ms=cpu, peak_rss_mib=rss)


def test_runs_are_judged_on_their_median_and_an_unmeasured_target_is_no_pass():
    runs = []
    for n, (overhead, load) in enumerate([(9.0, 3.5), (7.0, 0.4), (7.5, 1.0)]):
        r = Results(load_before=load, load_after=load + 0.25)
        r.smi = {"big-mig": _smi("big-mig", overhead, 8.0 + n, 39.0), "single": _smi("single", 1.0, 2.0, 35.0)}
        runs.append(r)
    text, judged = runs_table(runs)
    by_name = {t.name: t for t in judged}
    assert (by_name["overhead p50, big-mig"].value, by_name["overhead p50, big-mig"].verdict) == (7.5, "PASS")
    assert by_name["server CPU per scrape, big-mig"].value == 9.0
    assert by_name["overhead p50, big-whole"].verdict == "not measured"
    assert by_name["/proc scan of 5000, warm p50"].verdict == "not measured"
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")[2:6]] == ["run 1", "run 2", "run 3", "median"]
    assert [c.strip() for c in lines[2].split("|")[2:5]] == ["3.50/3.75", "0.40/0.65", "1.00/1.25"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == [
        "overhead p50, big-mig", "9.00", "7.00", "7.50", "7.50", "<= 8 ms", "PASS"]


def test_the_rss_target_is_judged_on_the_three_scenarios_and_the_worst_case_row_is_shown():
    r = Results()
    r.smi = {"big-mig": _smi("big-mig", 7.0, 8.0, 39.0), "single": _smi("single", 1.0, 2.0, 35.0),
             CHANGING: replace(_smi("big-mig", 9.0, 11.0, 41.0), label=CHANGING)}
    assert {t.name: t.value for t in targets(r)}["peak RSS of the serving process"] == 39.0
    assert {t.name: t.value for t in targets(r)}["overhead p50, big-mig"] == 7.0


def test_the_every_value_new_reports_share_no_section_with_the_one_before(tmp_path):
    """The worst case of the source's memo (nvidia_smi/build.py): the fake writes the reports in
    turn, and no read finds a process list or MIG device section of the read before it."""
    xml, listing = scenarios.query_xml(scenarios.BIG_MIG), scenarios.listing(scenarios.BIG_MIG)
    reports = changing(xml)
    fake = write_fake_nvidia_smi(tmp_path, reports, listing)
    written = [subprocess.run([str(fake), "-q", "-x"], capture_output=True, check=True).stdout for _ in range(4)]
    assert written == [reports[0], reports[1], reports[2], reports[0]]
    memo = ReadMemo()
    for before, now in itertools.pairwise(written):
        snapshot_from_smi(before, listing, None, memo)
        kept = set(memo.sections.processes) | set(memo.sections.mig_devices)
        snapshot = snapshot_from_smi(now, listing, None, memo)
        assert not kept & (set(memo.sections.processes) | set(memo.sections.mig_devices))
        assert snapshot == snapshot_from_smi(now, listing)
    used = {p.pid: p.used_bytes for p in snapshot_from_smi(reports[1], listing).processes}
    assert all(used[p.pid] == p.used_bytes + MIB for p in snapshot_from_smi(reports[0], listing).processes)


def _benchmark_imports() -> dict[str, set[str]]:
    """For each module of benchmarks/, the modules of benchmarks/ it imports: at the top or inside a
    function (an import put off until a call is an arrow all the same)."""
    modules = {path.stem: path for path in (REPO / "benchmarks").glob("*.py")}
    arrows: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks."))
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 0 and module.startswith("benchmarks."):
                    found.add(module.split(".")[1])
                elif (node.level, module) in ((0, "benchmarks"), (1, "")):
                    found.update(a.name for a in node.names)
                elif node.level == 1:
                    found.add(module.split(".")[0])
        arrows[name] = (found & modules.keys()) - {name}
    return arrows


def _a_cycle(arrows: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules around it (the first again at the end), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name):], name]
        if name in done:
            return None
        for other in sorted(arrows.get(name, ())):
            if (cycle := visit(other, [*path, name])) is not None:
                return cycle
        done.add(name)
        return None

    return next((c for name in sorted(arrows) if (c := visit(name, [])) is not None), None)


def test_the_benchmarks_import_each_other_one_way():
    """No module of benchmarks/ imports one that imports it back, directly or around a circle:
    run.py imports the measurements, they import the shared serving and table helpers."""
    arrows = _benchmark_imports()
    assert {"procscan", "podresources", "nvml_lib"} <= arrows["run"]
    assert arrows["serving"] == arrows["tables"] == set()
    assert _a_cycle(arrows) is None, f"import cycle: {' -> '.join(_a_cycle(arrows) or [])}"
    # The check sees a cycle where there is one, including one through a function's late import.
    cycle = _a_cycle({**arrows, "tables": {"run"}})
    assert cycle is not None and cycle[0] == cycle[-1] == "run" and "tables" in cycle, cycle


def test_each_fleet_node_writes_its_own_pids_and_uuids_and_new_pids_at_each_turnover(tmp_path, monkeypatch):
    s = fleet.Settings.make(quick=False, nodes=2)
    fakes = [fleet.write_node(tmp_path / f"node-{n}", n, s) for n in range(2)]
    for node, fake in enumerate(fakes):
        fleet.arm(fake, node, s)

    def read(fake):
        xml = subprocess.run([str(fake), "-q", "-x"], capture_output=True, check=True).stdout
        listing = subprocess.run([str(fake), "-L"], capture_output=True, check=True).stdout
        return snapshot_from_smi(xml, listing)

    first, other = read(fakes[0]), read(fakes[1])
    assert first.problems == () and len(first.processes) == len(other.processes) == 896
    assert not {p.pid for p in first.processes} & {p.pid for p in other.processes}
    assert not {d.uuid for d in first.devices} & {d.uuid for d in other.devices}
    # One turnover later (armed as if a turnover ago): every process of the node is a new one.
    now = time.time()
    monkeypatch.setattr(fleet.time, "time", lambda: now - s.turnover_s)
    fleet.arm(fakes[0], 0, s)
    later = read(fakes[0])
    assert not {p.pid for p in first.processes} & {p.pid for p in later.processes}
    assert [d.uuid for d in later.devices] == [d.uuid for d in first.devices]
    assert [p.used_bytes for p in later.processes] == [p.used_bytes for p in first.processes]


def test_the_fleet_compares_every_scrape_not_one_instant():
    """A target whose count was right at the last scrape but wrong at an earlier one is a
    mismatch; so is a scrape that has one of the two samples and not the other."""
    said = {("a:1", 15.0): 2607.0, ("a:1", 30.0): 2607.0, ("b:2", 15.0): 2607.0, ("b:2", 30.0): 2607.0}
    assert fleet.every_scrape_mismatches(dict(said), said) == []
    scraped = {**said, ("a:1", 15.0): 2600.0}
    assert fleet.every_scrape_mismatches(scraped, said) == [
        "a:1 at 15.000: scrape_samples_scraped 2600.0, mig_exporter_scrape_series 2607.0"]
    scraped = {**said, ("b:2", 45.0): 0.0}  # a failed scrape: no mig_exporter_scrape_series at all
    assert fleet.every_scrape_mismatches(scraped, said) == [
        "b:2 at 45.000: scrape_samples_scraped 0.0, mig_exporter_scrape_series None"]


# About 45 s alone: three modes of 5 exporters and a fresh Prometheus, 9 s each after the first scrapes.
@pytest.mark.prometheus
@pytest.mark.timeout(400)
def test_the_fleet_runs_in_quick_mode_and_none_keeps_fewer_series_than_all(tmp_path):
    figures_path = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--fleet", "--quick", "--json", str(figures_path)],
        cwd=REPO, capture_output=True, text=True, timeout=390, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert "QUICK MODE" in out
    rows = _rows(out, "fleet: one Prometheus")
    assert [r[0] for r in rows] == ["all", "top=3", "none"]
    for row in rows:
        assert all(re.fullmatch(r"\d+(\.\d+)?", cell) for cell in row[1:]), row  # every figure measured
    head = {r[0]: float(r[3]) for r in rows}
    assert head["none"] < head["top=3"] < head["all"]
    samples = {r[0]: float(r[11]) for r in rows}
    assert samples["none"] < samples["top=3"] < samples["all"]
    # Every scrape of every target compared, not one instant: about 9 s / 2 s scrapes of 5 targets a mode.
    checked = re.findall(r"scrape_samples_scraped == mig_exporter_scrape_series at every scrape of every target "
                         r"\((\d+) compared\): yes", out)
    assert len(checked) == 3 and all(int(n) >= 5 * 3 for n in checked), checked
    assert "PROBLEMS" not in out
    figures = json.loads(figures_path.read_text())
    assert figures["quick"] is True
    assert [(m["mode"], m["head_series"]) for m in figures["modes"]] == [(mode, head[mode]) for mode in head]
