"""Activity on the NVML path (sources/nvml_activity.py, docs/activity.md): GPM per GPU instance and
whole card, and each process's share of a whole card, with the real pynvml over the fake
libnvidia-ml (tests/fake_nvml.py), whose GPM counters count, and whose driver samples processes,
against its own clocks (monotonic and wall), which these tests drive."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import tracemalloc

import pynvml
import pytest
from click.testing import CliRunner

from fake_nvml import (
    GPU_BURN,
    SAMPLED_AT_US,
    SCENARIOS,
    gpm,
)
from mig_exporter import cli as cli_module
from mig_exporter.cli import cli
from mig_exporter.model.snapshot import (
    ACTIVITY_FIRST_SAMPLE,
    ACTIVITY_NO_GPM,
    ACTIVITY_NOT_MEASURED,
    ACTIVITY_READ_FAILED,
    Activity,
)
from mig_exporter.sources.nvml import NvmlSource
from mig_exporter.sources.nvml_activity import SPACINGS, Bounds, window_bounds

T0 = 1000.0
FIELDS = ("graphics_ratio", "sm_ratio", "sm_occupancy_ratio", "tensor_ratio", "dram_bandwidth_ratio")
GPM_CALLS = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMigSampleGet",
             "nvmlGpmMetricsGet", "nvmlGpmSampleFree")


def ratios(script: dict[int, float]) -> tuple[float, ...]:
    """The five ratios a GPM script (percent) should read."""
    ids = (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
           pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
    return tuple(script.get(i, 0.0) / 100 for i in ids)


def values(activity: Activity) -> tuple[float | None, ...]:
    return tuple(getattr(activity, f) for f in FIELDS)


def by_gpu_instance(snapshot) -> dict[int, tuple[Activity | None, str | None]]:
    return {d.gpu_instance_id: (d.activity, d.activity_unknown) for d in snapshot.devices if d.is_mig}


def with_scripts(scenario, scripts: dict[int, dict[int, float]], card: int = 0):
    """``scenario`` with card ``card``'s GPU instances at ``scripts`` (GPU instance id -> GPM percent)."""
    c = scenario.cards[card]
    migs = tuple(dataclasses.replace(m, activity=scripts.get(m.gpu_instance_id, m.activity)) for m in c.mig_devices)
    cards = list(scenario.cards)
    cards[card] = dataclasses.replace(c, mig_devices=migs)
    return dataclasses.replace(scenario, cards=tuple(cards))


def start(fake_nvml_lib, scenario, **kwargs):
    fake = fake_nvml_lib(scenario)
    fake.set_clock(T0)
    return fake, NvmlSource(clock=fake.now, wall_clock=fake.wall_time, **kwargs)


def read_at(fake, source, at: float):
    fake.set_clock(at)
    return source.read()


# -- GPM per GPU instance: the window ----------------------------------------------------------


def _varying(t: float) -> float:
    """GPU instance 3's graphics percent: 80 and 20 by turns, each for 20 s, from T0 + 3 s."""
    return 80.0 if math.floor((t - T0 - 3) / 20) % 2 == 0 else 20.0


def _script_of(percent: float) -> dict[int, float]:
    return gpm(graphics=percent, sm=percent * 0.9, occupancy=percent / 2, tensor=percent / 4, dram=percent / 3)


def _average(t_from: float, t_to: float) -> float:
    """The time average of ``_varying`` over [t_from, t_to], by its pieces."""
    edges = [t_from, *(T0 + 3 + 20 * k for k in range(-1, 100) if t_from < T0 + 3 + 20 * k < t_to), t_to]
    return sum(_varying((a + b) / 2) * (b - a) for a, b in itertools.pairwise(edges)) / (t_to - t_from)


def test_two_scrapers_at_15s_and_60s_phases_each_get_each_gpu_instances_activity(fake_nvml_lib):
    """Two Prometheus servers scrape one exporter, every 15 s from T0 and every 60 s from T0 + 7 s.
    Each read measures from the newest sample at least a window (30 s) old: both get a window of
    30 to 45 s, and each GPU instance its scripted activity within a percentage point, constant or
    changing every 20 s (there, the average over the read's own window), never the 15 s the
    other scraper left."""
    steady = {9: GPU_BURN, 10: gpm(graphics=25.0, sm=20.0, occupancy=12.0, tensor=5.0, dram=30.0)}
    scenario = with_scripts(SCENARIOS["h100-mig-processes"](), {**steady, 3: _script_of(_varying(T0))})
    fake, source = start(fake_nvml_lib, scenario)
    scrapes = [(T0 + 15 * k, "a") for k in range(40)] + [(T0 + 7 + 60 * k, "b") for k in range(10)]
    changes = [(T0 + 3 + 20 * k, "change") for k in range(31)]
    checked = {"a": 0, "b": 0}
    for at, who in sorted(scrapes + changes):
        if who == "change":
            fake.set_clock(at)
            fake.set_scenario(with_scripts(fake.scenario, {3: _script_of(_varying(at))}))
            continue
        found = by_gpu_instance(read_at(fake, source, at))
        if at < T0 + 60:
            continue  # the first reads: a window still growing
        for gi, (activity, reason) in found.items():
            assert reason is None and activity is not None, (who, at, gi, reason)
            assert 30 <= activity.window_seconds <= 45, (who, at, activity.window_seconds)
            if gi == 3:
                expected = ratios(_script_of(_average(at - activity.window_seconds, at)))
            else:
                expected = ratios(steady.get(gi, {}))
            assert values(activity) == pytest.approx(expected, abs=0.01), (who, at, gi)
        checked[who] += 1
    assert checked == {"a": 36, "b": 9}
    assert fake.exceptions == []


def test_the_first_read_gives_first_sample_and_a_read_within_a_second_shares_its_sample(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "h100-mig-processes")
    first = by_gpu_instance(source.read())
    assert first == dict.fromkeys((2, 3, 9, 10), (None, ACTIVITY_FIRST_SAMPLE))
    assert fake.gpm_samples_held == 4
    again = by_gpu_instance(read_at(fake, source, T0 + 0.5))
    assert again == first and fake.called("nvmlGpmMigSampleGet") == 4, "no sample under a second apart"
    # Short of a window, the oldest kept sample: a 10 s window, said as such.
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 10))[9]
    assert reason is None and activity.window_seconds == pytest.approx(10)
    assert values(activity) == pytest.approx(ratios(GPU_BURN))
    idle, reason = by_gpu_instance(source.read())[2]
    assert values(idle) == (0.0,) * 5 and reason is None, "a measured zero: memhogs that compute nothing"
    assert fake.exceptions == []


def test_compute_instances_of_one_gpu_instance_share_its_one_sample(fake_nvml_lib):
    scenario = with_scripts(SCENARIOS["h200-shared-gpu-instance"](), {1: gpm(graphics=50.0, dram=20.0)})
    fake, source = start(fake_nvml_lib, scenario)
    source.read()
    snapshot = read_at(fake, source, T0 + 30)
    shared = [d for d in snapshot.devices if d.gpu_instance_id == 1]
    assert len(shared) == 2 and shared[0].activity == shared[1].activity
    assert shared[0].activity.graphics_ratio == pytest.approx(0.5)
    assert shared[0].activity.dram_bandwidth_ratio == pytest.approx(0.2)
    gi_args = [c.args[0] for c in fake.calls if c.function == "nvmlGpmMigSampleGet"]
    assert sorted(gi_args) == sorted([1, 5, 11, 12] * 2), "one sample per GPU instance and read"


def test_an_a100_gives_no_activity_and_says_no_gpm(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "demo")
    for at in (T0, T0 + 30, T0 + 60):
        snapshot = read_at(fake, source, at)
        assert {(d.index, d.activity, d.activity_unknown) for d in snapshot.devices} == {
            (d.index, None, ACTIVITY_NO_GPM) for d in snapshot.devices}
    # Asked once per card, of the card; nothing sampled.
    assert [(c.function, c.device) for c in fake.calls if c.function.startswith("nvmlGpm")] == [
        ("nvmlGpmQueryDeviceSupport", "card0"), ("nvmlGpmQueryDeviceSupport", "card1")]


def test_a_card_whose_support_query_fails_has_no_gpm(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    refusing = dataclasses.replace(base.cards[0], errors={"nvmlGpmQueryDeviceSupport": pynvml.NVML_ERROR_NOT_SUPPORTED})
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(refusing,)))
    source.read()
    snapshot = read_at(fake, source, T0 + 30)
    assert {d.activity_unknown for d in snapshot.devices} == {ACTIVITY_NO_GPM}
    assert fake.called("nvmlGpmQueryDeviceSupport") == 1 and fake.called("nvmlGpmSampleAlloc") == 0


def test_gpm_support_is_asked_of_the_card_only_and_again_after_a_new_initialisation(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "h100-mig-processes")
    for at in (T0, T0 + 15, T0 + 30):
        read_at(fake, source, at)
    asked = [c.device for c in fake.calls if c.function == "nvmlGpmQueryDeviceSupport"]
    assert asked == ["card0"]
    assert all(c.device == "card0" for c in fake.calls if c.function in ("nvmlGpmMigSampleGet",))
    fake.set_scenario(dataclasses.replace(fake.scenario,
                                          system_errors={"nvmlDeviceGetCount_v2": pynvml.NVML_ERROR_UNINITIALIZED}))
    with pytest.raises(Exception, match="NVML_ERROR_UNINITIALIZED"):
        read_at(fake, source, T0 + 45)
    fake.set_scenario(SCENARIOS["h100-mig-processes"]())
    read_at(fake, source, T0 + 60)
    assert [c.device for c in fake.calls if c.function == "nvmlGpmQueryDeviceSupport"] == ["card0", "card0"]


def test_memory_and_processes_are_read_before_any_gpm_call_on_every_card(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    twin = dataclasses.replace(base.cards[0], uuid="GPU-11111111-2222-3333-4444-555555555555", mig_devices=tuple(
        dataclasses.replace(m, uuid=m.uuid[:-4] + "0000") for m in base.cards[0].mig_devices))
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(base.cards[0], twin)))
    source.read()
    before = len(fake.calls)
    read_at(fake, source, T0 + 30)
    calls = [c.function for c in fake.calls[before:]]
    first_gpm = min(i for i, name in enumerate(calls) if name.startswith("nvmlGpm"))
    last_memory = max(i for i, name in enumerate(calls)
                      if name.startswith("nvmlDeviceGetMemoryInfo") or "RunningProcesses" in name)
    assert last_memory < first_gpm
    assert {"nvmlGpmMigSampleGet", "nvmlGpmMetricsGet"} <= set(calls[first_gpm:])


# -- what is left out ---------------------------------------------------------------------------


def test_a_failing_metric_code_leaves_only_that_metric_out(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    card = dataclasses.replace(base.cards[0], gpm_metric_errors={
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: pynvml.NVML_ERROR_NOT_SUPPORTED})
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(card,)))
    source.read()
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 30))[9]
    assert reason is None
    assert values(activity) == pytest.approx((0.99, 0.97, None, 0.0, 0.10))
    assert activity.sm_occupancy_ratio is None


def test_nan_and_inf_leave_their_metric_out_and_all_failed_is_not_measured(fake_nvml_lib):
    nan, inf = float("nan"), float("inf")
    scripts = {9: {**GPU_BURN, pynvml.NVML_GPM_METRIC_SM_UTIL: nan, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: inf}}
    fake, source = start(fake_nvml_lib, with_scripts(SCENARIOS["h100-mig-processes"](), scripts))
    source.read()
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 30))[9]
    assert reason is None and values(activity) == pytest.approx((0.99, None, 0.48, 0.0, None))
    everything = dict.fromkeys(range(1, 14), pynvml.NVML_ERROR_UNKNOWN)
    fake.set_scenario(dataclasses.replace(fake.scenario, cards=(
        dataclasses.replace(fake.scenario.cards[0], gpm_metric_errors=everything),)))
    assert set(by_gpu_instance(read_at(fake, source, T0 + 60)).values()) == {(None, ACTIVITY_NOT_MEASURED)}


def test_a_failing_gpm_call_is_read_failed_with_a_problem_and_memory_stays(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, base)
    good = source.read()
    failing = dataclasses.replace(base.cards[0], errors={"nvmlGpmMigSampleGet": pynvml.NVML_ERROR_UNKNOWN})
    fake.set_scenario(dataclasses.replace(base, cards=(failing,)))
    snapshot = read_at(fake, source, T0 + 30)
    assert set(by_gpu_instance(snapshot).values()) == {(None, ACTIVITY_READ_FAILED)}
    assert [d.memory for d in snapshot.devices] == [d.memory for d in good.devices]
    assert "card 0 GPU instance 9: GPM sample not taken (nvmlGpmMigSampleGet: NVML_ERROR_UNKNOWN" in \
        "\n".join(snapshot.problems)
    assert fake.gpm_samples_held == 4, "the sample not taken is freed; the earlier ones are kept"
    fake.set_scenario(base)
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 60))[9]
    assert reason is None and activity.window_seconds == pytest.approx(60), "the window survives a failed read"


def test_a_gpu_instance_without_a_compute_instance_is_not_seen_and_not_sampled(fake_nvml_lib):
    """NVML gives no MIG device handle for a GPU instance without a compute instance: our read
    (nvmlDeviceGetMigDeviceHandleByIndex over every slot) cannot see it, so it is no device and has
    no activity series, and its id is never sampled (DCGM: "no data available")."""
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(
        dataclasses.replace(base.cards[0], empty_gpu_instances=(1,)),)))
    source.read()
    snapshot = read_at(fake, source, T0 + 30)
    assert sorted(by_gpu_instance(snapshot)) == [2, 3, 9, 10]
    assert 1 not in {c.args[0] for c in fake.calls if c.function == "nvmlGpmMigSampleGet"}


# -- samples kept, and freed ---------------------------------------------------------------------


def test_a_gpu_instance_made_again_under_its_id_starts_a_fresh_window_and_its_samples_are_freed(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, base)
    for at in (T0, T0 + 15, T0 + 30):
        read_at(fake, source, at)
    assert fake.gpm_samples_held == 12
    freed = fake.called("nvmlGpmSampleFree")
    # GPU instance 9 destroyed and made again at once (ids are reused): a new MIG UUID, idle now.
    remade = tuple(dataclasses.replace(m, uuid="MIG-99999999-9999-5999-9999-999999999999", activity={})
                   if m.gpu_instance_id == 9 else m for m in base.cards[0].mig_devices)
    fake.set_scenario(dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], mig_devices=remade),)))
    found = by_gpu_instance(read_at(fake, source, T0 + 45))
    assert found[9] == (None, ACTIVITY_FIRST_SAMPLE)
    assert fake.called("nvmlGpmSampleFree") - freed == 3, "the old instance's three samples"
    assert found[2][1] is None, "the others keep their windows"
    activity, _ = by_gpu_instance(read_at(fake, source, T0 + 60))[9]
    assert activity.window_seconds == pytest.approx(15) and values(activity) == (0.0,) * 5


def test_a_gpu_instance_that_goes_away_has_its_samples_freed(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, base)
    read_at(fake, source, T0)
    read_at(fake, source, T0 + 15)
    fake.set_scenario(dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], mig_devices=tuple(
        m for m in base.cards[0].mig_devices if m.gpu_instance_id != 10)),)))
    read_at(fake, source, T0 + 30)
    assert fake.gpm_samples_held == 3 * 3 and source.activity.samples_held == 9


def _eight_samples_kept_then_a_driver_level_error(fake_nvml_lib):
    """h100-mig-processes read twice (8 GPM samples kept), then a read failing with
    NVML_ERROR_UNINITIALIZED: NVML must be initialised again. The scenario is healthy again after it."""
    fake, source = start(fake_nvml_lib, "h100-mig-processes")
    read_at(fake, source, T0)
    read_at(fake, source, T0 + 15)
    assert fake.gpm_samples_held == 8
    healthy = fake.scenario
    fake.set_scenario(dataclasses.replace(healthy, system_errors={"nvmlDeviceGetCount_v2":
                                                                  pynvml.NVML_ERROR_UNINITIALIZED}))
    with pytest.raises(Exception, match="NVML_ERROR_UNINITIALIZED"):
        read_at(fake, source, T0 + 30)
    fake.set_scenario(healthy)
    return fake, source


def test_samples_are_freed_on_close_and_before_nvml_is_initialised_again(fake_nvml_lib):
    # A driver-level error: the next read initialises NVML again, after freeing what it held.
    fake, source = _eight_samples_kept_then_a_driver_level_error(fake_nvml_lib)
    before = len(fake.calls)
    found = by_gpu_instance(read_at(fake, source, T0 + 45))
    calls = [c.function for c in fake.calls[before:]]
    assert calls.index("nvmlInitWithFlags") > max(i for i, c in enumerate(calls) if c == "nvmlGpmSampleFree")
    assert calls.count("nvmlGpmSampleFree") == 8
    assert set(found.values()) == {(None, ACTIVITY_FIRST_SAMPLE)}, "no window across initialisations"
    assert fake.gpm_samples_held == 4
    before = len(fake.calls)
    source.close()
    assert [c.function for c in fake.calls[before:]] == ["nvmlGpmSampleFree"] * 4 + ["nvmlShutdown"]
    assert fake.gpm_samples_held == 0
    assert fake.exceptions == []


def test_the_sample_lists_are_bounded_in_count_and_age(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "h100-mig-processes", activity_window_s=10)
    most = window_bounds(10).max_samples
    assert window_bounds(10) == Bounds(12, 25.0, 1.0)
    for k in range(40):  # a read every second: the count bound holds, and still reaches a window back
        read_at(fake, source, T0 + k)
    assert source.activity.samples_held == 4 * most
    activity, _ = by_gpu_instance(source.read())[9]
    assert activity.window_seconds == pytest.approx(10)
    for k in range(1, 6):  # then every 12 s: only samples within 25 s are kept
        read_at(fake, source, T0 + 39 + 12 * k)
    assert source.activity.samples_held == 4 * 3
    assert fake.gpm_samples_held == source.activity.samples_held
    # A lone scraper slower than the age bound has no sample left to measure from.
    assert set(by_gpu_instance(read_at(fake, source, T0 + 39 + 60 + 26)).values()) == {(None, ACTIVITY_FIRST_SAMPLE)}


def test_a_steady_scrapers_read_fills_its_oldest_sample_again_rather_than_free_and_allocate(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "h100-mig-processes")
    for k in range(8):  # a lone 15 s scraper: 75 s of samples, 6 a GPU instance
        read_at(fake, source, T0 + 15 * k)
    assert source.activity.samples_held == 4 * 6 == fake.gpm_samples_held
    before = len(fake.calls)
    found = by_gpu_instance(read_at(fake, source, T0 + 15 * 8))
    calls = [c.function for c in fake.calls[before:] if c.function.startswith("nvmlGpm")]
    assert sorted(calls) == ["nvmlGpmMetricsGet"] * 4 + ["nvmlGpmMigSampleGet"] * 4
    assert values(found[9][0]) == pytest.approx(ratios(GPU_BURN)) and found[9][0].window_seconds == 30


def test_a_long_window_keeps_as_few_samples_as_a_short_one_and_each_read_still_gets_its_window(fake_nvml_lib):
    """--collector.activity.window 3600 with a 1 s scraper kept 3602 samples a GPU instance (some 200 000
    on big-mig). Past the newest, samples are kept a sixteenth of the window apart: 18 at most, and a
    baseline at least a window old is always there, at most a spacing and a read further."""
    assert [window_bounds(w) for w in (30, 3600)] == [Bounds(18, 75.0, 1.875), Bounds(18, 9000.0, 225.0)]
    window = 160.0  # a spacing of 10 s: the same bound, in fewer reads
    fake, source = start(fake_nvml_lib, "h100-mig-processes", activity_window_s=window)
    spacing = window / SPACINGS
    most = 0
    for k in range(0, 400):  # a 1 s scraper, and a 60 s one at another phase
        for at in (T0 + k, *((T0 + k + 0.5,) if k % 60 == 7 else ())):
            found = by_gpu_instance(read_at(fake, source, at))
            most = max(most, source.activity.samples_held)
            if at >= T0 + window + 1:
                activity, reason = found[9]
                assert reason is None and window <= activity.window_seconds <= window + spacing + 1, (at, activity)
                assert values(activity) == pytest.approx(ratios(GPU_BURN))
    assert most <= 4 * (SPACINGS + 2) and fake.gpm_samples_held == source.activity.samples_held
    assert fake.exceptions == []


def test_the_gpm_samples_kept_cost_a_few_hundred_bytes_each_on_our_side(fake_nvml_lib):
    """docs/activity.md's figure: what the exporter's own Python holds per kept GPM sample (its
    ctypes handle and its place in the list), measured with tracemalloc on big-mig's 56 GPU
    instances; the sample's buffer behind the handle is the driver's (nvmlGpmSampleAlloc)."""
    from benchmarks import scenarios
    fake, source = start(fake_nvml_lib, scenarios.nvml_scenario(scenarios.BIG_MIG))
    source.read()
    tracemalloc.start()
    try:
        before = _ours(tracemalloc.take_snapshot())
        held = source.activity.samples_held
        for k in range(1, 6):
            read_at(fake, source, T0 + 15 * k)
        added = source.activity.samples_held - held
        per_sample = (_ours(tracemalloc.take_snapshot()) - before) / added
    finally:
        tracemalloc.stop()
    assert added == 5 * 56
    print(f"bytes per kept GPM sample, ours: {per_sample:.0f}")
    assert 100 < per_sample < 400


def _ours(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes allocated by the exporter's activity module (where the kept samples are made)."""
    return sum(s.size for s in snapshot.filter_traces([tracemalloc.Filter(True, "*/nvml_activity.py")]).statistics(
        "filename"))


def test_a_gpm_value_out_of_range_is_left_out_and_a_rounding_overshoot_held_at_the_edge(fake_nvml_lib):
    """150 % or -20 % is no measurement (counters across a GPU instance remade unseen): left out, as
    DCGM blanks it, never clamped into a false 100 % or a false idle; half a percent past either edge is
    rounding, and held there."""
    script = gpm(graphics=150.0, sm=-20.0, occupancy=100.3, tensor=-0.3, dram=10.0)
    fake, source = start(fake_nvml_lib, with_scripts(SCENARIOS["h100-mig-processes"](), {9: script}))
    source.read()
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 30))[9]
    assert reason is None and values(activity) == (None, None, 1.0, 0.0, pytest.approx(0.10))


def test_a_passing_support_query_error_is_read_failed_and_asked_again(fake_nvml_lib):
    """Only a definite answer is kept: an UNKNOWN at start-up must not make a Hopper card "no_gpm" until
    the exporter restarts (nor a lost card); NOT_SUPPORTED is kept (see above)."""
    base = SCENARIOS["h100-mig-processes"]()
    for code in (pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_GPU_IS_LOST):
        failing = dataclasses.replace(base.cards[0], errors={"nvmlGpmQueryDeviceSupport": code})
        fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(failing,)))
        snapshot = source.read()
        assert set(by_gpu_instance(snapshot).values()) == {(None, ACTIVITY_READ_FAILED)}
        assert any(p.startswith("card 0: GPM support not known (nvmlGpmQueryDeviceSupport: ")
                   for p in snapshot.problems)
        assert snapshot.device(1000).memory.used_bytes is not None
        fake.set_scenario(base)
        assert set(by_gpu_instance(read_at(fake, source, T0 + 1)).values()) == {(None, ACTIVITY_FIRST_SAMPLE)}
        activity, reason = by_gpu_instance(read_at(fake, source, T0 + 31))[9]
        assert reason is None and values(activity) == pytest.approx(ratios(GPU_BURN))
        assert fake.called("nvmlGpmQueryDeviceSupport") == 2, "asked again after the error, then kept"


def test_a_driver_without_the_mig_sample_call_fails_no_memory_read(fake_nvml_lib):
    """A libnvidia-ml with nvmlGpmQueryDeviceSupport but not nvmlGpmMigSampleGet (CUDA 12.4's notes:
    "NVML running against older drivers will report FUNCTION_NOT_FOUND in some cases"): every memory
    and process reading stays, the GPU instances are read_failed, with the reason."""
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, missing_functions=frozenset({"nvmlGpmMigSampleGet"})))
    for at in (T0, T0 + 30):
        snapshot = read_at(fake, source, at)
        assert set(by_gpu_instance(snapshot).values()) == {(None, ACTIVITY_READ_FAILED)}
        assert [d.memory.used_bytes for d in snapshot.devices] == [m.memory.used_bytes
                                                                  for m in base.cards[0].mig_devices]
        assert [p.pid for p in snapshot.processes] == [21180, 21181, 21198]
        assert "card 0 GPU instance 9: GPM sample not taken (nvmlGpmMigSampleGet: NVML_ERROR_FUNCTION_NOT_FOUND" \
            in "\n".join(snapshot.problems)
    assert fake.gpm_samples_held == 0, "each sample allocated for a take that failed is freed"
    assert fake.exceptions == []


class _OtherMetric(ctypes.Structure):
    """A c_nvmlGpmMetric_t of another size, as a future pynvml might lay it out."""

    _fields_ = [("metricId", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint), ("value", ctypes.c_double),
                ("extra", ctypes.c_char * 64)]


class _OtherUtilSample(ctypes.Structure):
    """A c_nvmlProcessUtilizationSample_t whose utilisations shrank to 2 bytes."""

    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_ushort),
                ("memUtil", ctypes.c_ushort), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


def test_a_pynvml_of_another_layout_leaves_memory_and_the_other_activity_intact(fake_nvml_lib, monkeypatch):
    """The layout checks were AssertionErrors that failed the whole read: now the card's GPM or its
    processes' activity is read_failed (unknown), with a problem line, and nothing else changes."""
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, base)
    good = source.read()
    monkeypatch.setattr(pynvml, "c_nvmlGpmMetric_t", _OtherMetric)
    snapshot = read_at(fake, source, T0 + 30)
    assert set(by_gpu_instance(snapshot).values()) == {(None, ACTIVITY_READ_FAILED)}
    assert [d.memory for d in snapshot.devices] == [d.memory for d in good.devices]
    assert snapshot.problems == ("card 0: activity not read (ActivityUnreadable: unexpected layout of pynvml's "
                                 "c_nvmlGpmMetricsGet_t: activity not read); activity unknown",)

    whole = busy_whole_card({900: (70, 30)})
    fake, source = start(fake_nvml_lib, whole)
    monkeypatch.setattr(pynvml, "c_nvmlProcessUtilizationSample_t", _OtherUtilSample)
    snapshot = source.read()
    assert snapshot.process_activity == ()
    assert snapshot.device(0).activity_unknown == ACTIVITY_FIRST_SAMPLE, "GPM read as ever"
    assert [p for p in snapshot.problems if "process activity not read (ActivityUnreadable: " in p]


def test_samples_are_freed_before_a_readiness_check_initialises_nvml_again(fake_nvml_lib):
    """/-/ready (and --source auto's choice) runs every few seconds: after a driver-level error it is
    usually what initialises NVML again, before the next read. The samples of the old initialisation
    are freed before the new one, whoever initialises."""
    fake, source = _eight_samples_kept_then_a_driver_level_error(fake_nvml_lib)
    before = len(fake.calls)
    assert source.ready()[0]
    calls = [c.function for c in fake.calls[before:]]
    assert calls.count("nvmlGpmSampleFree") == 8 and fake.gpm_samples_held == 0
    assert calls.index("nvmlInitWithFlags") > max(i for i, c in enumerate(calls) if c == "nvmlGpmSampleFree")
    found = by_gpu_instance(read_at(fake, source, T0 + 45))
    assert set(found.values()) == {(None, ACTIVITY_FIRST_SAMPLE)} and fake.gpm_samples_held == 4
    assert fake.exceptions == []


def test_a_card_failing_before_its_uuid_keeps_its_windows_for_a_while_then_frees_them(fake_nvml_lib):
    base = SCENARIOS["h100-mig-processes"]()
    fake, source = start(fake_nvml_lib, base)
    read_at(fake, source, T0)
    read_at(fake, source, T0 + 15)
    lost = dataclasses.replace(base, cards=(dataclasses.replace(
        base.cards[0], errors={"nvmlDeviceGetUUID": pynvml.NVML_ERROR_GPU_IS_LOST}),))
    fake.set_scenario(lost)
    assert read_at(fake, source, T0 + 30).cards[0].uuid is None
    assert fake.gpm_samples_held == 8, "kept under the UUID the last good read saw"
    fake.set_scenario(base)
    activity, reason = by_gpu_instance(read_at(fake, source, T0 + 45))[9]
    assert reason is None and activity.window_seconds == pytest.approx(30), "its window survived"
    fake.set_scenario(lost)
    for at in (T0 + 60, T0 + 100, T0 + 140):  # failing for longer than the age bound (75 s)
        read_at(fake, source, at)
    assert fake.gpm_samples_held == 0 and source.activity.samples_held == 0


# -- whole cards ---------------------------------------------------------------------------------


def test_a_whole_hopper_card_gets_its_activity(fake_nvml_lib):
    base = SCENARIOS["one-lost-one-no-permission"]()
    busy = dataclasses.replace(base.cards[2], activity=gpm(graphics=87.0, sm=80.0, occupancy=40.0, tensor=33.0,
                                                            dram=52.0))
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(*base.cards[:2], busy)))
    assert source.read().device(2).activity_unknown == ACTIVITY_FIRST_SAMPLE
    device = read_at(fake, source, T0 + 30).device(2)
    assert device.activity_unknown is None
    assert values(device.activity) == pytest.approx((0.87, 0.80, 0.40, 0.33, 0.52))
    assert [c.device for c in fake.calls if c.function == "nvmlGpmSampleGet"] == ["card2", "card2"]


# -- per-process activity on whole cards ----------------------------------------------------------


def process_rows(snapshot) -> dict[int, tuple[float | None, float | None]]:
    return {a.pid: (a.sm_ratio, a.memory_ratio) for a in snapshot.process_activity}


def busy_whole_card(script: dict[int, tuple[int, int]], *, period_us: int = 166_667, merged: bool = False,
                    pids: tuple[int, ...] = (900, 901)):
    """a100-mig-pending's whole A100 as an H100, listing ``pids`` (compute), its driver sampling
    ``script`` (pid -> sm %, mem %) once a ``period_us``, one sample a process a call where ``merged``."""
    base = SCENARIOS["a100-mig-pending"]()
    card = base.cards[0]
    listed = tuple(dataclasses.replace(card.compute_processes[0], pid=pid) for pid in pids)
    card = dataclasses.replace(card, gpm_supported=True, compute_processes=listed, process_samples=(),
                               process_activity=script, process_sample_period_us=period_us,
                               process_samples_merged=merged)
    return dataclasses.replace(base, cards=(card,))


def test_process_activity_on_a_whole_card_matches_the_driver_samples_and_idle_is_zero(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "demo")
    fake.set_wall_clock((SAMPLED_AT_US + 166_667) / 1e6)  # just after the driver's last sample
    snapshot = source.read()
    # The training job's two samples averaged (each a period); llama.cpp, listed without a sample, idle.
    assert process_rows(snapshot) == {50102: (0.0, 0.0), 50318: (pytest.approx(0.63), pytest.approx(0.41))}
    assert {a.device_index for a in snapshot.process_activity} == {1}, "the whole card only"
    asked = [c for c in fake.calls if c.function == "nvmlDeviceGetProcessUtilization"]
    assert {c.device for c in asked} == {"card1"}, "never on the card in MIG mode"
    # A second reader a tenth of a second later: nothing newer (NOT_FOUND), the same window, the same
    # values (the old reader's "since the last read" made the job idle here).
    fake.advance(0.1)
    assert process_rows(source.read()) == process_rows(snapshot)
    assert [c.args[0] for c in fake.calls if c.function == "nvmlDeviceGetProcessUtilization"][-1] == \
        SAMPLED_AT_US + 166_667, "only what is newer than the newest kept is asked"
    assert fake.exceptions == []


def test_two_readers_a_moment_or_a_second_apart_both_see_a_busy_process_busy(fake_nvml_lib):
    """Two HA Prometheus servers (or a landing-page view) read within a driver period of each other:
    the second got NOT_FOUND, and every process read idle; now each read averages the window (30 s)
    ending at its own time. 901 is listed and never sampled: idle."""
    for period_us in (166_667, 1_000_000):
        fake, source = start(fake_nvml_lib, busy_whole_card({900: (70, 30)}, period_us=period_us))
        for at in (T0, T0 + 15, T0 + 15.1, T0 + 15.3, T0 + 16, T0 + 30, T0 + 30.05):
            rows = process_rows(read_at(fake, source, at))
            assert rows == {900: (pytest.approx(0.70, abs=0.005), pytest.approx(0.30, abs=0.005)), 901: (0.0, 0.0)}, \
                (period_us, at)
        assert fake.exceptions == []


def test_a_process_busy_for_half_the_window_reads_half_its_load(fake_nvml_lib):
    """The value is the time average over the window: the samples' percent over the time they stand
    for (a driver period each), and 0 where the driver sampled none of the process."""
    scenario = busy_whole_card({900: (70, 30), 901: (40, 10)})
    fake, source = start(fake_nvml_lib, scenario)
    source.read()
    fake.set_clock(T0 + 15)
    fake.set_scenario(dataclasses.replace(scenario, cards=(dataclasses.replace(
        scenario.cards[0], process_activity={901: (40, 10)}),)))  # 900 idle from now on, still listed
    rows = process_rows(read_at(fake, source, T0 + 30))
    assert rows == {900: (pytest.approx(0.35, abs=0.01), pytest.approx(0.15, abs=0.01)),
                    901: (pytest.approx(0.40, abs=0.005), pytest.approx(0.10, abs=0.005))}
    assert process_rows(read_at(fake, source, T0 + 45)) == {
        900: (pytest.approx(0.0, abs=0.005), pytest.approx(0.0, abs=0.005)), 901: rows[901]}
    assert fake.exceptions == []


def test_a_driver_answering_one_sample_a_process_a_call_reads_the_same(fake_nvml_lib):
    """Drivers in the field answer one sample a process a call (its mean since the timestamp asked,
    stamped at its newest: go-nvml #51, nvtop #110): each stands for the time since the timestamp asked."""
    scenario = busy_whole_card({900: (70, 30)}, merged=True)
    fake, source = start(fake_nvml_lib, scenario)
    for at in (T0, T0 + 15, T0 + 15.1, T0 + 16):
        assert process_rows(read_at(fake, source, at)) == {
            900: (pytest.approx(0.70, abs=0.005), pytest.approx(0.30, abs=0.005)), 901: (0.0, 0.0)}, at
    idle = dataclasses.replace(scenario.cards[0], process_activity={})
    fake.set_scenario(dataclasses.replace(scenario, cards=(idle,)))
    # Idle from T0 + 16; at T0 + 31 the window ends a (presumed) 1 s driver period back: busy 16 s of 30.
    rows = process_rows(read_at(fake, source, T0 + 31))
    assert rows == {900: (pytest.approx(0.70 * 16 / 30, abs=0.005), pytest.approx(0.30 * 16 / 30, abs=0.005)),
                    901: (0.0, 0.0)}


def test_the_wall_clock_stepping_resets_the_window_and_never_reads_idle(fake_nvml_lib):
    """The driver stamps its samples with the wall clock. Stepped back 10 s, the newest seen lay ahead of
    every new sample, and every process read idle until the clock caught up: now the step is seen, that
    read says unknown (with a problem line), and the next ones measure again. Forward likewise."""
    fake, source = start(fake_nvml_lib, busy_whole_card({900: (70, 30)}))
    busy = {900: (pytest.approx(0.70, abs=0.005), pytest.approx(0.30, abs=0.005)), 901: (0.0, 0.0)}
    read_at(fake, source, T0)
    assert process_rows(read_at(fake, source, T0 + 15)) == busy
    for step in (-10.0, 100.0):
        fake.step_wall_clock(step)
        stepped = read_at(fake, source, fake.now() + 15)
        assert process_rows(stepped) == {900: (None, None), 901: (None, None)}
        assert f"card 0: the wall clock stepped {step:+.1f}s; process activity unknown this read" in \
            "\n".join(stepped.problems)
        for later in (1, 15):
            assert process_rows(read_at(fake, source, fake.now() + later)) == busy, (step, later)
    assert fake.exceptions == []


def test_a_sample_over_100_is_no_measurement_and_the_kept_spans_are_bounded(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, busy_whole_card({900: (150, 20), 901: (40, 10)}), activity_window_s=3600)
    assert process_rows(source.read()) == {900: (None, pytest.approx(0.20)), 901: (pytest.approx(0.40),
                                                                                  pytest.approx(0.10))}
    for k in range(1, 121):  # two hours of a 60 s scraper, a sample every 1/6 s
        rows = process_rows(read_at(fake, source, T0 + 60 * k))
    assert rows == {900: (None, pytest.approx(0.20)), 901: (pytest.approx(0.40), pytest.approx(0.10))}
    # 21 600 driver samples a process in the window, kept as at most 2 x 120 spans (+ the edges).
    assert source._process_activity.spans_held <= 2 * (2 * 120 + 2)


def test_a_process_busy_on_a_media_engine_alone_is_unknown_never_idle(fake_nvml_lib):
    """A transcoder on NVENC/NVDEC: the driver samples it (encUtil, decUtil) with SM and memory at 0.
    It is not idle memory, and has no SM share to give: unknown, as a pmon row busy on enc alone.
    Once it computes too, its shares are measured again."""
    scenario = busy_whole_card({900: (0, 0, 95, 0), 901: (0, 0, 0, 40)}, pids=(900, 901, 902))
    fake, source = start(fake_nvml_lib, scenario)
    read_at(fake, source, T0)
    assert process_rows(read_at(fake, source, T0 + 15)) == {900: (None, None), 901: (None, None), 902: (0.0, 0.0)}
    fake.set_scenario(dataclasses.replace(scenario, cards=(dataclasses.replace(
        scenario.cards[0], process_activity={900: (20, 5, 95, 0), 901: (0, 0, 0, 40)}),)))
    rows = process_rows(read_at(fake, source, T0 + 60))
    assert rows[900] == (pytest.approx(0.20, abs=0.005), pytest.approx(0.05, abs=0.005))
    assert rows[901] == (None, None) and rows[902] == (0.0, 0.0)
    assert fake.exceptions == []


def test_process_activity_is_none_on_a_card_in_mig_mode_and_on_failure(fake_nvml_lib):
    fake, source = start(fake_nvml_lib, "h100-mig-processes")
    assert source.read().process_activity == ()
    assert fake.called("nvmlDeviceGetProcessUtilization") == 0
    base = SCENARIOS["a100-mig-pending"]()
    fake, source = start(fake_nvml_lib, base)
    fake.set_wall_clock(SAMPLED_AT_US / 1e6)
    assert process_rows(source.read()) == {900: (pytest.approx(0.12), pytest.approx(0.03))}
    failing = dataclasses.replace(base.cards[0], errors={"nvmlDeviceGetProcessUtilization": pynvml.NVML_ERROR_UNKNOWN})
    fake.set_scenario(dataclasses.replace(base, cards=(failing,)))
    snapshot = source.read()
    assert snapshot.process_activity == ()
    assert snapshot.device(0).memory.used_bytes is not None
    assert any(p.startswith("card 0: process utilisation not read (nvmlDeviceGetProcessUtilization: "
                            "NVML_ERROR_UNKNOWN") for p in snapshot.problems)


def test_a_card_without_process_utilisation_is_not_asked_again(fake_nvml_lib):
    base = SCENARIOS["a100-mig-pending"]()
    card = dataclasses.replace(base.cards[0],
                               errors={"nvmlDeviceGetProcessUtilization": pynvml.NVML_ERROR_NOT_SUPPORTED})
    fake, source = start(fake_nvml_lib, dataclasses.replace(base, cards=(card,)))
    for _ in range(3):
        snapshot = source.read()
        assert snapshot.process_activity == () and snapshot.problems == ()
    assert fake.called("nvmlDeviceGetProcessUtilization") == 1


# -- the flag -------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["nvml", "auto"])
def test_read_takes_a_first_gpm_sample_and_waits_a_second_so_it_gives_activity(fake_nvml_lib, source):
    """A one-shot read (node_exporter's textfile collector, from cron) keeps no samples from before:
    it takes a first one, waits a second and reads, so each GPU instance has its activity over about
    1 s, never first_sample every time."""
    fake = fake_nvml_lib("h100-mig-processes")
    result = CliRunner().invoke(cli, ["read", "--source", source])
    assert result.exit_code == 0, result.output
    assert "first_sample" not in result.output
    graphics = {line.split('index="')[1].split('"')[0]: line.rsplit(" ", 1)[1] for line in result.output.splitlines()
                if line.startswith("mig_exporter_device_graphics_activity_ratio{")}
    assert graphics == {"1000": "0.0", "1001": "0.0", "1002": "0.99", "1003": "0.0"}
    window = [float(line.rsplit(" ", 1)[1]) for line in result.output.splitlines()
              if line.startswith("mig_exporter_device_activity_window_seconds{")]
    assert window and all(1.0 <= w < 5.0 for w in window), window
    assert fake.called("nvmlDeviceGetMemoryInfo_v2", "card0/mig2") == 2  # two reads: the first only samples


def test_the_window_flag_reaches_the_nvml_source(fake_nvml_lib, monkeypatch):
    fake_nvml_lib("demo")  # no GPM: read takes no first sample
    made = []

    class Recording(NvmlSource):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("activity_window_s"))
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(cli_module, "NvmlSource", Recording)
    runner = CliRunner()
    assert runner.invoke(cli, ["read", "--source", "nvml", "--collector.activity.window", "12"]).exit_code == 0
    assert runner.invoke(cli, ["read", "--source", "nvml"],
                         env={"MIG_EXPORTER_COLLECTOR_ACTIVITY_WINDOW": "45"}).exit_code == 0
    assert runner.invoke(cli, ["read", "--source", "nvml"]).exit_code == 0
    assert made == [12.0, 45.0, 30.0]
    refused = runner.invoke(cli, ["read", "--source", "nvml", "--collector.activity.window", "0.5"])
    assert refused.exit_code == 2 and "--collector.activity.window" in refused.output
