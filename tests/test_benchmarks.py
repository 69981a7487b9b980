"""The benchmark (benchmarks/, ``./scripts/bench``) runs, prints its tables,
and measures the machines the issue names. No timing is asserted here: the
figures are checked by the benchmark itself, on a quiet machine."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
from benchmarks import podresources, scenarios
from benchmarks.run import INSTANCE_SCALING, PROCESS_SCALING
from mig_exporter.kubernetes.podresources import parse_list_response
from mig_exporter.nvidia_smi.build import snapshot_from_smi
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
    assert NvmlSource().read() == snapshot_from_smi(scenarios.query_xml(shape), scenarios.listing(shape))
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


def test_the_benchmark_runs_in_quick_mode_and_prints_every_table():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "QUICK MODE" in out

    smi = _rows(out, "nvidia-smi path")
    assert [r[0] for r in smi] == ["big-mig", "big-whole", "single"]
    for row in smi:
        assert all(re.fullmatch(r"-?\d+(\.\d+)?", cell) for cell in row[2:]), row  # every figure measured
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

    targets = _rows(out, "targets (issue 8)")
    assert [r[0] for r in targets] == [
        "overhead p50, big-mig", "overhead p50, single", "peak RSS of the serving process",
        "NVML scrape / nvitop update, big-mig",
    ]
    assert all(r[3] in ("PASS", "MISS", "n/a") for r in targets)
    assert targets[2][3] in ("PASS", "MISS")  # peak RSS is read in every run
