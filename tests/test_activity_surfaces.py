"""Issue 39 where a person reads it: the landing page marks memory held idle and shows each
device's activity where it is measured (nothing where it is not: unknown is not idle), and
``doctor`` says for each device which case the metrics leave out, in plain words. Hand-built
snapshots (model/snapshot.py's Activity, the ACTIVITY_* reasons)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import MIB, scenario
from mig_exporter.doctor import ACTIVITY_UNKNOWN_WORDS, PathReading, activity_words, as_json, diagnose, render_text
from mig_exporter.metrics.scrape import ReadOutcome
from mig_exporter.model.capacity import GPU_ONLY
from mig_exporter.model.snapshot import (
    ACTIVITY_FIRST_SAMPLE,
    ACTIVITY_NO_COMPUTE_INSTANCE,
    ACTIVITY_NO_GPM,
    ACTIVITY_NOT_MEASURED,
    ACTIVITY_NOT_READ,
    ACTIVITY_READ_FAILED,
    Activity,
    PlacedProcessActivity,
    Snapshot,
)
from mig_exporter.web import landing
from test_landing import bars, dom

REASONS = [ACTIVITY_NO_GPM, ACTIVITY_FIRST_SAMPLE, ACTIVITY_NO_COMPUTE_INSTANCE, ACTIVITY_NOT_MEASURED,
           ACTIVITY_READ_FAILED, ACTIVITY_NOT_READ]
IDLE = Activity(30.0, graphics_ratio=0.004, sm_ratio=0.002)
BUSY = Activity(30.0, graphics_ratio=0.62, sm_ratio=0.41, sm_occupancy_ratio=0.2, tensor_ratio=0.1,
                dram_bandwidth_ratio=0.33)


def _h100() -> Snapshot:
    """h100-mig-processes: 0/mig0 (1000) holds 3594 MiB and idles; 0/mig2 (1002) holds 7493 MiB and
    is busy; 0/mig1 (17 MiB) idles holding nothing to speak of; 0/mig3's activity failed to read."""
    snapshot = scenario("h100-mig-processes")
    given = {1000: IDLE, 1001: IDLE, 1002: BUSY}
    devices = tuple(dataclasses.replace(d, activity=given[d.index], activity_unknown=None) if d.index in given
                    else dataclasses.replace(d, activity=None, activity_unknown=ACTIVITY_READ_FAILED)
                    for d in snapshot.devices)
    return dataclasses.replace(snapshot, devices=devices)


def _whole_card() -> Snapshot:
    """a100-mig-pending's whole card 0 (an A100: no GPM) with pid 900 (5100 MiB) idle and a small
    busy neighbour, from the driver's per-process samples."""
    snapshot = scenario("a100-mig-pending")
    (p,) = snapshot.processes
    devices = tuple(dataclasses.replace(d, activity=None, activity_unknown=ACTIVITY_NO_GPM) for d in snapshot.devices)
    return dataclasses.replace(snapshot, devices=devices, processes=(p, p._replace(pid=901, used_bytes=300 * MIB)),
                               process_activity=(PlacedProcessActivity(900, 0, 0.0, 0.0),
                                                 PlacedProcessActivity(901, 0, 0.37, 0.05)))


def _page(snapshot: Snapshot) -> str:
    return landing.page(ReadOutcome(snapshot, 0.1), version="0", source="x", node="gpu-node-5")


# --- the landing page ----------------------------------------------------------------------------

def test_the_page_marks_a_device_holding_memory_idle_and_shows_the_others_activity():
    root = dom(_page(_h100()))
    rows = {tr.attrs["data-devices"]: tr for tr in root.find_all("tr", "device")}
    idle = {name for name, tr in rows.items() if "idle" in tr.classes}
    assert idle == {"0/mig0"}, "0/mig1 idles too, but holds no memory to speak of"
    mark = rows["0/mig0"].find("div", "activity")
    assert mark.text == "idle: 3594 MiB held, under 1% activity over the last 30 s"
    assert mark.attrs["data-idle-mib"] == "3594"
    assert rows["0/mig2"].find("div", "activity").text == "graphics 62% · SM 41%"
    assert rows["0/mig1"].find("div", "activity").text == "graphics 0% · SM 0%"


def test_the_page_says_nothing_of_activity_where_it_is_not_measured():
    """0/mig3's read failed, and the nvidia-smi path reads none: no line, no 0, no idle mark."""
    root = dom(_page(_h100()))
    (row,) = [tr for tr in root.find_all("tr", "device") if tr.attrs["data-devices"] == "0/mig3"]
    assert row.find_all("div", "activity") == [] and "idle" not in row.classes
    plain = _page(scenario("h100-mig-processes"))
    assert 'class="activity' not in plain and "idle" not in plain.split("<body>", 1)[1]


def test_the_page_marks_an_idle_process_on_a_whole_card_and_gives_the_others_their_share():
    ((row,),) = bars(dom(_page(_whole_card()))).values()
    assert row.processes == ["900 /usr/bin/python3 5100 MiB idle", "901 /usr/bin/python3 300 MiB SM 37%"]
    page = _page(_whole_card())
    assert page.count('<span class="share idle"') == 1
    # The card has no GPM: no device line, never a 0.
    assert 'class="activity' not in page


def test_a_small_idle_process_is_not_marked_idle():
    snapshot = _whole_card()
    snapshot = dataclasses.replace(snapshot, process_activity=(PlacedProcessActivity(900, 0, 0.0, 0.0),
                                                               PlacedProcessActivity(901, 0, 0.0, 0.0)))
    ((row,),) = bars(dom(_page(snapshot))).values()
    assert row.processes == ["900 /usr/bin/python3 5100 MiB idle", "901 /usr/bin/python3 300 MiB SM 0%"]


# --- doctor ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reason", REASONS)
def test_doctor_says_which_left_out_case_applies_to_each_device(reason):
    snapshot = scenario("h100-mig-processes")
    snapshot = dataclasses.replace(snapshot, devices=tuple(
        dataclasses.replace(d, activity=None, activity_unknown=reason) for d in snapshot.devices))
    report = diagnose(None, PathReading("nvidia-smi", snapshot, None, 0.1), xids=None, host=GPU_ONLY)
    text = render_text(report)
    words = ACTIVITY_UNKNOWN_WORDS[reason]
    assert text.count(f"    activity: {words}\n") == len(snapshot.devices)
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("  device 0/mig0 (1000): ")]
    assert lines[at + 1] == f"    activity: {words}", "each device's line is followed by its activity"
    doc = as_json(report)
    device = doc["cards"][0]["devices"][0]
    assert device["activity"] is None
    assert device["activity_unknown"] == {"reason": reason, "why": words}
    # Nothing else changes: the activity is no finding, and no note.
    assert [f.code for f in report.findings] == [] and "activity" not in " ".join(f.code for f in report.notes)


def test_doctor_words_each_case_plainly():
    """Every reason the model has a sentence: what the case is, without the code."""
    assert set(ACTIVITY_UNKNOWN_WORDS) == set(REASONS)
    for reason, words in ACTIVITY_UNKNOWN_WORDS.items():
        assert words.startswith(("not measured", "not read")) and reason not in words, reason
    assert "Hopper" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NO_GPM] and "A100" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NO_GPM]
    assert "compute instance" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NO_COMPUTE_INSTANCE]
    assert "two" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_FIRST_SAMPLE]
    assert "NaN" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NOT_MEASURED]
    assert "nvidia-smi" in ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NOT_READ]


def test_doctor_shows_measured_activity_and_each_process_share():
    report = diagnose(None, PathReading("nvml", _h100(), None, 0.1), xids=None, host=GPU_ONLY)
    text = render_text(report)
    assert "    activity: graphics 62%, SM 41%, SM occupancy 20%, tensor 10%, DRAM bandwidth 33% over the last 30 s\n" \
        in text
    assert "    activity: graphics 0%, SM 0% over the last 30 s\n" in text
    assert f"    activity: {ACTIVITY_UNKNOWN_WORDS[ACTIVITY_READ_FAILED]}\n" in text
    doc = as_json(report)
    busy = next(d for c in doc["cards"] for d in c["devices"] if d["index"] == 1002)
    assert busy["activity"] == {"window_seconds": 30.0, "graphics_ratio": 0.62, "sm_ratio": 0.41,
                                "sm_occupancy_ratio": 0.2, "tensor_ratio": 0.1, "dram_bandwidth_ratio": 0.33}
    assert busy["activity_unknown"] is None
    whole = render_text(diagnose(None, PathReading("nvml", _whole_card(), None, 0.1), xids=None, host=GPU_ONLY))
    assert "    pid 900 C /usr/bin/python3 5100 MiB, SM 0%, memory 0%\n" in whole
    assert "    pid 901 C /usr/bin/python3 300 MiB, SM 37%, memory 5%\n" in whole
    (device,) = as_json(diagnose(None, PathReading("nvml", _whole_card(), None, 0.1), xids=None,
                                 host=GPU_ONLY))["cards"][0]["devices"]
    assert device["process_activity"] == [{"pid": 900, "sm_ratio": 0.0, "memory_ratio": 0.0},
                                          {"pid": 901, "sm_ratio": 0.37, "memory_ratio": 0.05}]
    assert activity_words(_whole_card().devices[0]) == ACTIVITY_UNKNOWN_WORDS[ACTIVITY_NO_GPM]
