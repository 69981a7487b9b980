"""The fake libnvidia-ml behaves like the library, seen through pynvml's public functions.

Every read here goes through the real pynvml wrappers (their ctypes structs,
size queries, version fields and error classes) into tests/fake_nvml.py's C
callbacks. The scenarios are checked against the nvidia-smi fixtures they
mirror, parsed by our own nvidia-smi parser.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pynvml
import pytest
from lxml import etree

from conftest import FIXTURES, MIB, SAMPLES
from fake_nvml import (
    GPU_BURN,
    NO_INSTANCE_ID,
    OLD_DRIVER_MISSING,
    R535_GARBAGE_BYTES,
    SAMPLED_AT_US,
    SCENARIOS,
    FakeCard,
    FakeNvmlScenario,
    FakeUtilSample,
    a100_mig_pending,
    demo,
    fake_nvml,
    gpm,
    h100_mig_processes,
    h100_r570_sram_split,
    h200_shared_gpu_instance,
    one_lost_one_no_permission,
)
from mig_exporter.model.health import NO_HEALTH
from mig_exporter.model.snapshot import CardReading, Memory, MigInstance, ProcessReading
from mig_exporter.nvidia_smi.listing import apply_listing, parse_list
from mig_exporter.nvidia_smi.query_xml import parse_query_xml

FIXTURE_FILES = {
    "demo": (SAMPLES / "demo.xml", SAMPLES / "demo.L.txt"),
    **{name: (FIXTURES / f"{name}.xml", FIXTURES / f"{name}.L.txt") for name in (
        "h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved", "a100-mig-pending", "na-memory",
    )},
}


@pytest.fixture
def nvml(fake_nvml_lib):
    """Install a scenario by name and initialise NVML through pynvml."""
    def start(scenario):
        fake = fake_nvml_lib(scenario)
        pynvml.nvmlInit()
        return fake
    return start


def handles(card: int):
    return pynvml.nvmlDeviceGetHandleByIndex(card)


def mig_handles(card_handle) -> dict[int, object]:
    """MIG slot -> handle, skipping empty slots the way NVML callers must."""
    found = {}
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(card_handle)):
        try:
            found[slot] = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(card_handle, slot)
        except pynvml.NVMLError_NotFound:
            continue
    return found


def pids(processes) -> list[tuple[int, int | None, int, int]]:
    return sorted((p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in processes)


def optional(function, *args):
    try:
        return function(*args)
    except pynvml.NVMLError_NotSupported:
        return None


# ---------------------------------------------------------------------------
# The scenarios are the nvidia-smi fixtures, value for value
# ---------------------------------------------------------------------------


def _type_letters(pid: int, compute: set[int], graphics: set[int], mps: set[int]) -> str:
    """nvidia-smi's process type from the lists a pid is on: C, G, C+G, M, M+C."""
    if pid in mps:
        return "M+C" if pid in compute else "M"
    return "+".join(letter for letter, on in (("C", pid in compute), ("G", pid in graphics)) if on)


def _memory_v2(handle) -> Memory:
    m = optional(pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
    if m is None:
        return Memory()
    return Memory(total_bytes=m.total, used_bytes=m.used, free_bytes=m.free, reserved_bytes=m.reserved)


def _health_as_nvidia_smi_reads_it(index: int) -> tuple[object, ...]:
    """Memory temperature, enforced power limit (W), performance state, PCIe replays, the card's volatile
    uncorrectable ECC counts (sram, dram) and its MIG devices' own, through pynvml alone."""
    h = handles(index)
    temp, replays = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP,
                                                        pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER])
    limit = optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
    counts = [optional(pynvml.nvmlDeviceGetMemoryErrorCounter, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                       pynvml.NVML_VOLATILE_ECC, location)
              for location in (pynvml.NVML_MEMORY_LOCATION_SRAM, pynvml.NVML_MEMORY_LOCATION_DRAM)]
    own = [optional(pynvml.nvmlDeviceGetMemoryErrorCounter, m, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_VOLATILE_ECC, pynvml.NVML_MEMORY_LOCATION_SRAM) for m in mig_handles(h).values()]
    return (
        float(temp.value.uiVal) if temp.nvmlReturn == pynvml.NVML_SUCCESS else None,
        None if limit is None else limit / 1000,
        pynvml.nvmlDeviceGetPerformanceState(h),
        replays.value.uiVal if replays.nvmlReturn == pynvml.NVML_SUCCESS else None,
        [c for c in counts if c is not None],
        [c for c in own if c is not None],
    )


def _card_as_nvidia_smi_reads_it(index: int) -> CardReading:
    """What nvidia-smi -q -x and -L would say about card ``index``, read only through pynvml."""
    h = handles(index)
    name = pynvml.nvmlDeviceGetName(h)
    mode = optional(pynvml.nvmlDeviceGetMigMode, h)
    power_mw = optional(pynvml.nvmlDeviceGetPowerUsage, h)
    util = optional(pynvml.nvmlDeviceGetUtilizationRates, h)
    serial = optional(pynvml.nvmlDeviceGetSerial, h)  # nvidia-smi's <serial>; NOT_SUPPORTED on GeForce
    instances = []
    for slot, m in mig_handles(h).items():
        instances.append(MigInstance(
            mig_index=slot,
            gpu_instance_id=pynvml.nvmlDeviceGetGpuInstanceId(m),
            compute_instance_id=pynvml.nvmlDeviceGetComputeInstanceId(m),
            memory=_memory_v2(m),
            profile=pynvml.nvmlDeviceGetName(m).removeprefix(f"{name} MIG "),
            uuid=pynvml.nvmlDeviceGetUUID(m),
        ))
    lists = {
        "C": pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h),
        "G": pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2(h),
        "M": pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v2(h),
    }
    on = {k: {p.pid for p in v} for k, v in lists.items()}
    entries = {p.pid: p for v in lists.values() for p in v}
    processes = [
        ProcessReading(
            pid=pid,
            type=_type_letters(pid, on["C"], on["G"], on["M"]),
            name=pynvml.nvmlSystemGetProcessName(pid),
            used_bytes=p.usedGpuMemory,
            gpu_instance_id=None if p.gpuInstanceId == NO_INSTANCE_ID else p.gpuInstanceId,
            compute_instance_id=None if p.computeInstanceId == NO_INSTANCE_ID else p.computeInstanceId,
        )
        for pid, p in entries.items()
    ]
    return CardReading(
        index=index,
        uuid=pynvml.nvmlDeviceGetUUID(h),
        name=name,
        pci_bus_id=pynvml.nvmlDeviceGetPciInfo(h).busId,
        mig_current=None if mode is None else bool(mode[0]),
        mig_pending=None if mode is None else bool(mode[1]),
        temperature_celsius=optional(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
        power_draw_watts=None if power_mw is None else power_mw / 1000,
        utilization_ratio=None if util is None else util.gpu / 100,
        memory=_memory_v2(h),
        instances=tuple(instances),
        processes=tuple(sorted(processes, key=lambda p: p.pid)),
        serial=None if serial is None else serial.strip() or None,
    )


@pytest.mark.parametrize("name", sorted(FIXTURE_FILES))
def test_scenario_matches_its_nvidia_smi_fixture(nvml, name):
    xml_path, listing_path = FIXTURE_FILES[name]
    report = parse_query_xml(xml_path.read_bytes())
    cards, problems = apply_listing(report.cards, parse_list(listing_path.read_bytes()).gpus)
    assert problems == ()
    fake = nvml(name)

    assert pynvml.nvmlSystemGetDriverVersion() == report.driver_version
    cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    assert f"{cuda // 1000}.{cuda % 1000 // 10}" == report.cuda_version
    assert pynvml.nvmlDeviceGetCount() == len(cards)
    for card in cards:
        # Health is compared whole by test_source_nvml's parity tests, through sources/nvml_health.py;
        # here, a few of its values through pynvml alone (_health_as_nvidia_smi_reads_it).
        expected = dataclasses.replace(
            card,
            instances=tuple(sorted((i._replace(ecc_errors=()) for i in card.instances),
                                   key=lambda i: i.mig_index)),
            processes=tuple(sorted(card.processes, key=lambda p: p.pid)),
            health=NO_HEALTH,
        )
        assert _card_as_nvidia_smi_reads_it(card.index) == expected
        assert _health_as_nvidia_smi_reads_it(card.index) == (
            card.health.memory_temperature_celsius, dict(card.health.power_limits_watts).get("current"),
            card.health.performance_state, card.health.pcie_replays,
            [e.errors for e in card.health.ecc_errors if e.scope == "volatile" and e.type == "uncorrectable"],
            [e.errors for i in sorted(card.instances, key=lambda i: i.mig_index) for e in i.ecc_errors])
    # nvidia-smi's utilization/memory_util, which our parser does not keep.
    gpus = etree.parse(str(xml_path)).getroot().findall("gpu")
    for index, gpu in enumerate(gpus):
        text = gpu.findtext("utilization/memory_util").removesuffix(" %")
        util = optional(pynvml.nvmlDeviceGetUtilizationRates, handles(index))
        assert (None if util is None else util.memory) == (None if text == "N/A" else int(text))
    assert fake.exceptions == []


def test_every_fixture_and_the_extra_scenario_are_registered():
    assert set(SCENARIOS) == set(FIXTURE_FILES) | {"one-lost-one-no-permission"}
    for make in SCENARIOS.values():
        assert isinstance(make(), FakeNvmlScenario)


# ---------------------------------------------------------------------------
# Values through pynvml, scenario by scenario
# ---------------------------------------------------------------------------


def test_h100_card_and_its_mig_devices(nvml):
    fake = nvml("h100-mig-processes")
    assert pynvml.nvmlDeviceGetCount() == 1
    h = handles(0)
    assert pynvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetIndex(h) == 0
    assert pynvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    # pynvml's structs hand char arrays back as str.
    assert (pci.busId, pci.busIdLegacy, pci.domain, pci.bus, pci.device) == ("00000000:19:00.0", "0000:19:00.0",
                                                                            0, 0x19, 0)
    assert pci.pciDeviceId == 0x233010DE
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 52
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 432170  # milliwatts

    # v2 splits reserved out of used; v1 counts it in used (total = free + used).
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert (v2.total, v2.reserved, v2.used, v2.free) == (85520809984, 479 * MIB, 11665408000, 69955 * MIB)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    assert (v1.total, v1.used, v1.free) == (85520809984, (11125 + 479) * MIB, 69955 * MIB)

    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    migs = mig_handles(h)
    assert sorted(migs) == [0, 1, 2, 3]
    m0 = migs[0]
    assert pynvml.nvmlDeviceGetName(m0) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert pynvml.nvmlDeviceGetUUID(m0) == "MIG-12b47fa4-2f93-5cea-b2ff-bf3e0b6e9aba"
    assert (pynvml.nvmlDeviceGetGpuInstanceId(migs[2]), pynvml.nvmlDeviceGetComputeInstanceId(migs[2])) == (9, 0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(m0, version=pynvml.nvmlMemory_v2)
    assert (mem.total, mem.reserved, mem.used, mem.free) == (42412802048, 0, 3768582144, 36854 * MIB)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(m0).value == 1  # pynvml returns the c_uint itself
    assert pynvml.nvmlDeviceIsMigDeviceHandle(h).value == 0
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m0)
    assert pynvml.nvmlDeviceGetUUID(parent) == "GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2"

    # A MIG handle lists its own processes with its GI/CI; the card lists them all.
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(m0)) == [
        (21180, 2407530496, 2, 0), (21181, 1333788672, 2, 0)]
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(migs[1])) == []
    assert [p[0] for p in pids(pynvml.nvmlDeviceGetComputeRunningProcesses(h))] == [21180, 21181, 21198]
    assert pynvml.nvmlSystemGetProcessName(21198) == "./gpu_burn"
    assert fake.exceptions == []


@pytest.mark.parametrize("slot", [4, 5, 6])
def test_an_empty_mig_slot_is_not_found(nvml, slot):
    nvml("h100-mig-processes")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handles(0), slot)


def test_a_slot_past_the_maximum_is_an_invalid_argument(nvml):
    nvml("h100-mig-processes")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handles(0), 7)


def test_mig_handles_and_mig_parents_do_not_measure_card_readings(nvml):
    nvml("h100-mig-processes")
    h = handles(0)
    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(h)  # the parent of MIG devices
    for function, args in [
        (pynvml.nvmlDeviceGetUtilizationRates, ()),
        (pynvml.nvmlDeviceGetTemperature, (pynvml.NVML_TEMPERATURE_GPU,)),
        (pynvml.nvmlDeviceGetPowerUsage, ()),
        (pynvml.nvmlDeviceGetMigMode, ()),
    ]:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            function(m, *args)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(h)  # a whole card has no GPU instance


def test_h200_compute_instances_of_one_gpu_instance_split_processes_by_ci(nvml):
    nvml("h200-shared-gpu-instance")
    h = handles(0)
    migs = mig_handles(h)
    assert sorted(migs) == [0, 1, 2, 3, 4]
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(migs[0])) == [(7001, 20480 * MIB, 1, 0)]
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(migs[1])) == [(7002, 9600 * MIB, 1, 1)]
    # Both compute instances report the whole GPU instance's memory.
    for slot in (0, 1):
        assert pynvml.nvmlDeviceGetMemoryInfo(migs[slot], version=pynvml.nvmlMemory_v2).used == 30210 * MIB
    # 7003 is "M+C" in nvidia-smi: on the compute list and the MPS list.
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(migs[2])) == [(7003, 4294967296, 5, 0)]
    assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(migs[2])) == [(7003, 4294967296, 5, 0)]
    assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(migs[0])) == []
    assert pids(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)) == []


def test_a100_mig_enabled_with_nothing_carved_has_only_empty_slots(nvml):
    nvml("a100-mig-nothing-carved")
    card0, card1 = handles(0), handles(1)
    assert pynvml.nvmlDeviceGetMigMode(card0) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(card0) == 7
    assert mig_handles(card0) == {}
    m = mig_handles(card1)[0]
    assert pynvml.nvmlDeviceGetGpuInstanceId(m) == 0  # a real id
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(card1)) == [(3301, 4290772992, 0, 0)]


def test_a100_mig_pending_is_a_whole_card_until_reset(nvml):
    nvml("a100-mig-pending")
    h = handles(0)
    assert pynvml.nvmlDeviceGetMigMode(h) == [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0  # "zero if MIG is not supported or enabled"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (12, 3)
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(h)) == [
        (900, 5347737600, NO_INSTANCE_ID, NO_INSTANCE_ID)]


def test_na_memory_answers_not_supported_and_unknown_process_memory(nvml):
    nvml("na-memory")
    a10g, t4 = handles(0), handles(1)
    for function, args in [
        (pynvml.nvmlDeviceGetMemoryInfo, ()),
        (pynvml.nvmlDeviceGetMemoryInfo, (pynvml.nvmlMemory_v2,)),
        (pynvml.nvmlDeviceGetTemperature, (pynvml.NVML_TEMPERATURE_GPU,)),
        (pynvml.nvmlDeviceGetPowerUsage, ()),
        (pynvml.nvmlDeviceGetUtilizationRates, ()),
        (pynvml.nvmlDeviceGetMigMode, ()),
    ]:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            function(a10g, *args)
    # 0xFFFFFFFFFFFFFFFF "not available" becomes None in pynvml; GI/CI are NVML's "none".
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(a10g)) == [(4242, None, NO_INSTANCE_ID, NO_INSTANCE_ID)]
    assert pids(pynvml.nvmlDeviceGetGraphicsRunningProcesses(a10g)) == [(4243, None, NO_INSTANCE_ID, NO_INSTANCE_ID)]
    assert pynvml.nvmlSystemGetProcessName(4243) == "/usr/lib/xorg/Xorg"

    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(t4)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(t4) == 0
    util = pynvml.nvmlDeviceGetUtilizationRates(t4)
    assert (util.gpu, util.memory) == (0, 0)  # real zeros
    assert pynvml.nvmlDeviceGetPowerUsage(t4) == 9780
    assert pynvml.nvmlSystemGetDriverVersion() == "535.154.05"
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12020


def test_a_lost_card_a_refusing_card_and_a_healthy_one(nvml):
    fake = nvml("one-lost-one-no-permission")
    assert pynvml.nvmlDeviceGetCount() == 3
    lost, refusing, healthy = handles(0), handles(1), handles(2)  # handles are still given out
    for function in (pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetUUID, pynvml.nvmlDeviceGetMemoryInfo,
                     pynvml.nvmlDeviceGetMigMode, pynvml.nvmlDeviceGetComputeRunningProcesses_v2,
                     pynvml.nvmlDeviceGetMaxMigDeviceCount):
        with pytest.raises(pynvml.NVMLError_GpuIsLost) as caught:
            function(lost)
        assert str(caught.value) == "GPU is lost"

    assert pynvml.nvmlDeviceGetMigMode(refusing) == [1, 1]
    assert pynvml.nvmlDeviceGetName(refusing) == "NVIDIA H100 80GB HBM3"
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetMaxMigDeviceCount(refusing)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(refusing, 0)

    assert pynvml.nvmlDeviceGetUUID(healthy) == "GPU-c41f7e93-5a2b-4c6d-8e1f-3b7a9d0c2e33"
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(healthy)) == [
        (61001, 8192 * MIB, NO_INSTANCE_ID, NO_INSTANCE_ID)]
    assert fake.called("nvmlDeviceGetName", device="card0") == 1
    assert fake.exceptions == []


def test_errors_can_be_injected_on_one_mig_device(nvml):
    base = h100_mig_processes()
    card = base.cards[0]
    broken = dataclasses.replace(card.mig_devices[2], errors={"nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_UNKNOWN})
    nvml(dataclasses.replace(base, cards=(dataclasses.replace(card, mig_devices=(
        *card.mig_devices[:2], broken, *card.mig_devices[3:])),)))
    migs = mig_handles(handles(0))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetMemoryInfo(migs[2], version=pynvml.nvmlMemory_v2)
    assert pynvml.nvmlDeviceGetMemoryInfo(migs[2]).total == 9984 * MIB  # v1 still answers
    assert pynvml.nvmlDeviceGetMemoryInfo(migs[1], version=pynvml.nvmlMemory_v2).used == 17 * MIB


# ---------------------------------------------------------------------------
# Library-level behaviour: init, versions, missing symbols, struct mismatch
# ---------------------------------------------------------------------------


def test_calls_before_init_and_after_shutdown_are_uninitialized(fake_nvml_lib):
    fake = fake_nvml_lib("demo")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    pynvml.nvmlInit()  # NVML counts inits
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 2
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()
    assert fake.init_count == 0


def test_init_error_is_raised_by_nvml_init(fake_nvml_lib):
    fake_nvml_lib(dataclasses.replace(demo(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded) as caught:
        pynvml.nvmlInit()
    assert str(caught.value) == "Driver Not Loaded"
    assert pynvml._nvmlLib_refcount == 0


def test_memory_info_v2_checks_the_struct_version(nvml):
    nvml("demo")
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch) as caught:
        pynvml.nvmlDeviceGetMemoryInfo(handles(1), version=0x01000028)
    # pynvml's own table lacks this code, so str() asks the library's nvmlErrorString.
    assert str(caught.value) == "Argument version mismatch"


def test_an_older_driver_lacks_symbols(nvml):
    fake = nvml(dataclasses.replace(demo(), missing_functions=OLD_DRIVER_MISSING))
    h = handles(1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    # pynvml's unversioned wrapper calls _v3 and turns the miss into a non-NVMLError exception.
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    # The older symbols still answer.
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)) == [
        (50318, 1620 * MIB, NO_INSTANCE_ID, NO_INSTANCE_ID)]
    assert pynvml.nvmlDeviceGetMemoryInfo(h).total == 81920 * MIB
    # pynvml caches found symbols, not missing ones: every call looks the symbol up again.
    assert fake.missing_lookups == ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMemoryInfo_v2",
                                    "nvmlDeviceGetComputeRunningProcesses_v3"]


def test_r535_struct_mismatch_garbles_v3_and_not_v2(nvml):
    nvml(dataclasses.replace(h100_mig_processes(), r535_struct_mismatch=True))
    h = handles(0)
    v3 = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)
    assert [p.pid for p in v3] == [21180, 0, 4294967295, 4294967295, 21181, 0, 4294967295, 4294967295,
                                   21198, 0, 4294967295, 4294967295]
    assert {p.usedGpuMemory for p in v3} == {R535_GARBAGE_BYTES}
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)) == [
        (21180, 2407530496, 2, 0), (21181, 1333788672, 2, 0), (21198, 7847542784, 9, 0)]
    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
    assert 0 in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(m)}  # the default wrapper is _v3
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(m)) == [(21198, 7847542784, 9, 0)]


def test_an_exception_inside_a_callback_becomes_nvml_error_unknown(nvml):
    card = demo().cards[1]
    broken = dataclasses.replace(card, temperature_c="hot")  # a c_uint cannot hold it
    fake = nvml(dataclasses.replace(demo(), cards=(demo().cards[0], broken)))
    h = handles(1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    assert [(name, type(e)) for name, e in fake.exceptions] == [("nvmlDeviceGetTemperature", TypeError)]
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 312450  # the library still works


def test_the_c_calls_follow_nvml_buffer_and_size_query_rules(nvml):
    """Straight at the fake's symbols, as C would call them: what pynvml's generous buffers never hit."""
    fake = nvml("demo")
    h = handles(1)
    small = ctypes.create_string_buffer(8)
    assert fake.lib.nvmlDeviceGetName(h, small, 8) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert fake.lib.nvmlDeviceGetName(h, small, 8) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    exact = ctypes.create_string_buffer(len("NVIDIA A100-SXM4-80GB") + 1)
    assert fake.lib.nvmlDeviceGetName(h, exact, len(exact)) == pynvml.NVML_SUCCESS
    assert exact.value == b"NVIDIA A100-SXM4-80GB"

    count = ctypes.c_uint(0)
    query = fake.lib.nvmlDeviceGetComputeRunningProcesses_v2
    assert query(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 1
    count.value = 0
    array = (pynvml.c_nvmlProcessInfo_v2_t * 4)()
    assert query(h, ctypes.byref(count), array) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    count.value = 4
    assert query(h, ctypes.byref(count), array) == pynvml.NVML_SUCCESS
    assert (count.value, array[0].pid, array[0].usedGpuMemory) == (1, 50318, 1620 * MIB)

    # The unversioned (v1) symbol fills the 16-byte nvmlProcessInfo_v1_t: pid and memory only.
    v1 = (ctypes.c_ulonglong * 4)()
    count.value = 2
    assert fake.lib.nvmlDeviceGetGraphicsRunningProcesses(h, ctypes.byref(count), v1) == pynvml.NVML_SUCCESS
    assert (count.value, v1[0] & 0xFFFFFFFF, v1[1], v1[2]) == (1, 50102, 20480 * MIB, 0)

    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetName(pynvml.c_nvmlDevice_t())  # a NULL handle
    assert fake.exceptions == []


def test_calls_are_recorded_with_the_device_they_named(nvml):
    fake = nvml("demo")
    h = handles(0)
    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
    pynvml.nvmlDeviceGetUUID(m)
    pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    assert [(c.function, c.device, c.args) for c in fake.calls] == [
        ("nvmlInitWithFlags", None, (0,)),
        ("nvmlDeviceGetHandleByIndex_v2", None, (0,)),
        ("nvmlDeviceGetMigDeviceHandleByIndex", "card0", (1,)),
        ("nvmlDeviceGetUUID", "card0/mig1", (pynvml.NVML_DEVICE_UUID_V2_BUFFER_SIZE,)),
        ("nvmlDeviceGetTemperature", "card0", (pynvml.NVML_TEMPERATURE_GPU,)),
    ]


def test_set_scenario_changes_the_answers_under_live_handles(nvml):
    fake = nvml("a100-mig-pending")
    h = handles(0)
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 98540
    lost = dataclasses.replace(a100_mig_pending().cards[0], errors={"*": pynvml.NVML_ERROR_GPU_IS_LOST})
    fake.set_scenario(dataclasses.replace(a100_mig_pending(), cards=(lost,)))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetPowerUsage(h)


# ---------------------------------------------------------------------------
# Installing and uninstalling
# ---------------------------------------------------------------------------


def test_uninstall_leaves_pynvml_as_it_was():
    assert pynvml.nvmlLib is None
    strings = dict(pynvml.NVMLError._errcode_to_string)
    with fake_nvml(h200_shared_gpu_instance()) as fake:
        assert pynvml.nvmlLib is fake.lib
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 1
        assert pynvml._nvmlGetFunctionPointer_cache  # pynvml cached our callbacks
        assert pynvml._nvmlLib_refcount == 1
        assert str(pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)) == "Argument version mismatch"
    assert pynvml.nvmlLib is None
    assert pynvml._nvmlGetFunctionPointer_cache == {}
    assert pynvml._nvmlLib_refcount == 0
    assert pynvml.NVMLError._errcode_to_string == strings  # str() had cached the fake's text there
    assert not fake.installed
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_uninstall_happens_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"), fake_nvml("demo"):
        pynvml.nvmlInit()
        raise RuntimeError("boom")
    assert pynvml.nvmlLib is None
    assert pynvml._nvmlGetFunctionPointer_cache == {}


def test_the_fixture_replaces_one_scenario_with_the_next(fake_nvml_lib):
    first = fake_nvml_lib("demo")
    second = fake_nvml_lib(a100_mig_pending())
    assert not first.installed and second.installed
    assert pynvml.nvmlLib is second.lib
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetName(handles(0)) == "NVIDIA A100-SXM4-80GB"
    assert pynvml.nvmlDeviceGetMigMode(handles(0)) == [0, 1]


def test_two_fakes_cannot_be_installed_at_once():
    with fake_nvml("demo"), pytest.raises(RuntimeError, match="another fake"):
        fake_nvml(demo()).__enter__()
    assert pynvml.nvmlLib is None


def test_a_scenario_refuses_half_a_utilisation_reading():
    with pytest.raises(ValueError, match="utilisation"):
        dataclasses.replace(demo().cards[1], memory_util_percent=None)
    with pytest.raises(ValueError, match="MIG slots"):
        dataclasses.replace(demo().cards[0], max_mig_devices=2)
    assert isinstance(one_lost_one_no_permission().cards[2], FakeCard)


# ---------------------------------------------------------------------------
# Health readings, and readings only other exporters take (benchmarks/ runs nvitop-exporter here)
# ---------------------------------------------------------------------------


def test_other_readings_answer_on_a_card_and_not_on_a_mig_device(nvml):
    fake = nvml("demo")
    card = handles(1)  # the whole A100
    assert pynvml.nvmlDeviceGetTemperatureV(card, pynvml.NVML_TEMPERATURE_GPU) == 51
    assert [pynvml.nvmlDeviceGetClockInfo(card, c) for c in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM,
                                                             pynvml.NVML_CLOCK_MEM, pynvml.NVML_CLOCK_VIDEO)] \
        == [1410, 1410, 1593, 1275]  # demo.xml's clocks, from the scenario's health
    assert pynvml.nvmlDeviceGetPowerManagementLimit(card) == 400_000
    assert pynvml.nvmlDeviceGetEncoderUtilization(card) == [0, 167_000]
    assert pynvml.nvmlDeviceGetDecoderUtilization(card) == [0, 167_000]
    assert pynvml.nvmlDeviceGetPcieThroughput(card, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 412
    assert pynvml.nvmlDeviceGetPcieThroughput(card, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 538
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetFanSpeed(card)
    with pytest.raises(pynvml.NVMLError_NotFound):  # no sample since the timestamp
        pynvml.nvmlDeviceGetProcessUtilization(card, SAMPLED_AT_US + 166_667)
    fields = pynvml.nvmlDeviceGetFieldValues(card, [pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                                    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX])
    assert [f.nvmlReturn for f in fields] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 2

    mig = mig_handles(handles(0))[0]
    for call in (lambda: pynvml.nvmlDeviceGetTemperatureV(mig, pynvml.NVML_TEMPERATURE_GPU),
                 lambda: pynvml.nvmlDeviceGetClockInfo(mig, pynvml.NVML_CLOCK_SM),
                 lambda: pynvml.nvmlDeviceGetPowerManagementLimit(mig),
                 lambda: pynvml.nvmlDeviceGetEncoderUtilization(mig),
                 lambda: pynvml.nvmlDeviceGetPcieThroughput(mig, pynvml.NVML_PCIE_UTIL_TX_BYTES),
                 lambda: pynvml.nvmlDeviceGetProcessUtilization(handles(0), 0)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    # The driver-535 report: on a MIG handle the size query answers and the read is refused.
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetProcessUtilization(mig, 0)
    assert fake.exceptions == []


def test_other_readings_honour_injected_errors_and_a_card_without_a_sensor(nvml):
    fake = nvml(dataclasses.replace(demo(), cards=(
        dataclasses.replace(demo().cards[1], temperature_c=None,
                            errors={"nvmlDeviceGetClockInfo": pynvml.NVML_ERROR_GPU_IS_LOST}),
    )))
    card = handles(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperatureV(card, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetClockInfo(card, pynvml.NVML_CLOCK_SM)
    assert fake.called("nvmlDeviceGetClockInfo", "card0") == 1
    assert fake.exceptions == []


def test_health_readings_answer_from_the_scenario_through_pynvml(nvml):
    fake = nvml(h100_r570_sram_split())
    card = handles(0)
    assert pynvml.nvmlDeviceGetTemperatureThreshold(card, pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_CURR) == 83
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a threshold the scenario does not hold
        pynvml.nvmlDeviceGetTemperatureThreshold(card, pynvml.NVML_TEMPERATURE_THRESHOLD_GPS_CURR)
    assert pynvml.nvmlDeviceGetMarginTemperature(card) == 3
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(card) == pynvml.nvmlClocksEventReasonSwPowerCap
    assert pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(card) == 0x1FF
    assert pynvml.nvmlDeviceGetPerformanceState(card) == 0
    assert pynvml.nvmlDeviceGetMaxClockInfo(card, pynvml.NVML_CLOCK_VIDEO) == 1545
    assert pynvml.nvmlDeviceGetPowerManagementLimitConstraints(card) == [200_000, 700_000]
    assert (pynvml.nvmlDeviceGetEnforcedPowerLimit(card), pynvml.nvmlDeviceGetPowerManagementDefaultLimit(card)) \
        == (650_000, 700_000)
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(card) == 4_200_000_123
    assert pynvml.nvmlDeviceGetPcieReplayCounter(card) == 2
    assert pynvml.nvmlDeviceGetEccMode(card) == [1, 1]
    status = pynvml.c_nvmlEccSramErrorStatus_v1_t()
    pynvml.nvmlDeviceGetSramEccErrorStatus(card, ctypes.byref(status))
    assert (status.volatileUncParity, status.volatileUncSecDed, status.bThresholdExceeded) == (2, 1, 1)
    assert pynvml.nvmlDeviceGetRemappedRows(card) == (2, 0, 0, 0)
    histogram = pynvml.nvmlDeviceGetRowRemapperHistogram(card)
    assert (histogram.max, histogram.high, histogram.none) == (638, 2, 0)
    assert pynvml.nvmlDeviceGetRepairStatus(card) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # an H100 retires rows, not pages
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(card)
    # The scenario's driver is 575.57.08, whose nvml.h has NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN
    # at 251 (sources/nvml_header.py); pynvml from 13.590 on says 269 for that name: the mismatch
    # between binding and driver issue 37 is about, so the id is the driver's, not pynvml's constant.
    values = pynvml.nvmlDeviceGetFieldValues(card, [pynvml.NVML_FI_DEV_MEMORY_TEMP, 251,
                                                    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX])
    assert [v.nvmlReturn for v in values] == [pynvml.NVML_SUCCESS, pynvml.NVML_SUCCESS,
                                              pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert (values[0].valueType, values[0].value.uiVal) == (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 71)
    assert (values[1].valueType, values[1].value.ullVal) == (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 250_000_000)
    assert fake.exceptions == []


def test_health_structs_are_checked_for_their_version(nvml):
    fake = nvml(h100_r570_sram_split())
    card = handles(0)
    fn = pynvml._nvmlGetFunctionPointer
    margin = pynvml.c_nvmlMarginTemperature_v1_t()  # version 0: no version set
    assert fn("nvmlDeviceGetMarginTemperature")(card, ctypes.byref(margin)) == \
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    repair = pynvml.c_nvmlRepairStatus_t()
    repair.version = 0
    assert fn("nvmlDeviceGetRepairStatus")(card, ctypes.byref(repair)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert fake.exceptions == []


# -- activity: GPM and process utilisation -------------------------------------------------------------


def _metrics_get(first, second, metrics=(1, 2, 3, 5, 10)):
    """nvmlGpmMetricsGet through pynvml's wrapper and struct: (nvmlReturn, value) per metric."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(metrics)
    request.sample1, request.sample2 = first, second
    for i, metric in enumerate(metrics):
        request.metrics[i].metricId = metric
    pynvml.nvmlGpmMetricsGet(request)
    return [(request.metrics[i].nvmlReturn, request.metrics[i].value) for i in range(len(metrics))]


def _mig_sample(card, gpu_instance):
    sample = pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmMigSampleGet(card, gpu_instance, sample)
    return sample


def test_gpm_support_is_hoppers_and_not_an_a100s(nvml):
    fake = nvml("h100-mig-processes")
    assert pynvml.nvmlGpmQueryDeviceSupport(handles(0)).isSupportedDevice == 1
    nvml("demo")
    assert [pynvml.nvmlGpmQueryDeviceSupport(handles(i)).isSupportedDevice for i in (0, 1)] == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(handles(1), pynvml.nvmlGpmSampleAlloc())
    assert fake.exceptions == []


def test_a_window_at_a_scripted_activity_reads_that_activity(nvml):
    fake = nvml("h100-mig-processes")
    fake.set_clock(1000.0)
    card = handles(0)
    first = _mig_sample(card, 9)
    fake.advance(30)
    second = _mig_sample(card, 9)
    got = _metrics_get(first, second)
    assert [code for code, _ in got] == [pynvml.NVML_SUCCESS] * 5
    assert [value for _, value in got] == pytest.approx([99.0, 97.0, 48.0, 0.0, 10.0])
    # An idle GPU instance reads 0 over the same time: a measured zero.
    idle = _mig_sample(card, 2)
    fake.advance(10)
    assert [v for _, v in _metrics_get(idle, _mig_sample(card, 2))] == [0.0] * 5
    assert fake.gpm_samples_held == 4
    assert fake.exceptions == []


def test_a_script_changed_halfway_reads_the_average_over_time(nvml):
    fake = nvml("h100-mig-processes")
    fake.set_clock(0.0)
    card = handles(0)
    first = _mig_sample(card, 9)
    fake.advance(20)  # 20 s of gpu_burn
    base = fake.scenario
    slower = dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], mig_devices=tuple(
        dataclasses.replace(m, activity=gpm(graphics=39.0)) if m.gpu_instance_id == 9 else m
        for m in base.cards[0].mig_devices)),))
    fake.set_scenario(slower)
    fake.advance(40)  # then 40 s at 39%
    graphics = _metrics_get(first, _mig_sample(card, 9), metrics=(1,))[0][1]
    assert graphics == pytest.approx((99.0 * 20 + 39.0 * 40) / 60)


def test_gpm_metric_codes_nan_and_unknown_ids_are_per_metric(nvml):
    base = h100_mig_processes()
    card0 = base.cards[0]
    odd = dataclasses.replace(card0, gpm_metric_errors={3: pynvml.NVML_ERROR_NOT_SUPPORTED},
                              mig_devices=tuple(dataclasses.replace(m, activity={**GPU_BURN, 2: float("nan")})
                                                if m.gpu_instance_id == 9 else m for m in card0.mig_devices))
    fake = nvml(dataclasses.replace(base, cards=(odd,)))
    fake.set_clock(0.0)
    first = _mig_sample(handles(0), 9)
    fake.advance(5)
    got = _metrics_get(first, _mig_sample(handles(0), 9), metrics=(1, 2, 3, 477))
    assert got[0] == (pynvml.NVML_SUCCESS, pytest.approx(99.0))
    assert got[1][0] == pynvml.NVML_SUCCESS and got[1][1] != got[1][1]  # NaN, as scripted
    assert got[2][0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert got[3][0] == pynvml.NVML_ERROR_NOT_SUPPORTED  # an id the fake does not measure
    assert fake.exceptions == []


def test_gpm_metrics_get_touches_only_num_metrics_and_checks_its_arguments(nvml):
    """The fake reads and writes metrics[0:numMetrics] at nvml.h's offsets and never the struct's
    size: a struct with room for two metrics only (nvml.h's layout, not pynvml's) is answered."""
    fake = nvml("h100-mig-processes")
    fake.set_clock(0.0)
    first = _mig_sample(handles(0), 9)
    fake.advance(2)
    second = _mig_sample(handles(0), 9)

    class Small(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint), ("sample1", ctypes.c_void_p),
                    ("sample2", ctypes.c_void_p), ("metrics", pynvml.c_nvmlGpmMetric_t * 2),
                    ("guard", ctypes.c_ulonglong)]
    small = Small(1, 2, ctypes.cast(first, ctypes.c_void_p).value, ctypes.cast(second, ctypes.c_void_p).value)
    small.metrics[0].metricId, small.metrics[1].metricId, small.guard = 1, 10, 0xFEEDFACE
    fn = pynvml._nvmlGetFunctionPointer("nvmlGpmMetricsGet")
    assert fn(ctypes.byref(small)) == pynvml.NVML_SUCCESS
    assert (small.metrics[0].value, small.metrics[1].value, small.guard) == (pytest.approx(99.0), pytest.approx(10.0),
                                                                              0xFEEDFACE)
    small.version = 2
    assert fn(ctypes.byref(small)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    small.version, small.numMetrics = 1, 99  # past the smallest NVML_GPM_METRIC_MAX of any header
    assert fn(ctypes.byref(small)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    small.numMetrics = 2
    pynvml.nvmlGpmSampleFree(second)
    assert fn(ctypes.byref(small)) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # a freed sample
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmSampleFree(second)  # freed twice
    assert fake.gpm_samples_held == 1
    assert fake.exceptions == []


def test_samples_closer_than_100ms_read_zero(nvml):
    fake = nvml("h100-mig-processes")
    fake.set_clock(0.0)
    first = _mig_sample(handles(0), 9)
    fake.advance(0.05)
    assert [v for _, v in _metrics_get(first, _mig_sample(handles(0), 9))] == [0.0] * 5


def test_an_unknown_or_destroyed_gpu_instance_fails_and_a_recreated_one_counts_afresh(nvml):
    fake = nvml("h100-mig-processes")
    fake.set_clock(0.0)
    card = handles(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        _mig_sample(card, 5)  # no such GPU instance
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _mig_sample(mig_handles(card)[0], 2)  # it takes the parent
    _mig_sample(card, 9)  # its counters start
    fake.advance(50)
    old = _mig_sample(card, 9)
    fake.advance(50)
    base = fake.scenario
    gone = dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], mig_devices=tuple(
        m for m in base.cards[0].mig_devices if m.gpu_instance_id != 9)),))
    fake.set_scenario(gone)
    with pytest.raises(pynvml.NVMLError_NotFound):
        _mig_sample(card, 9)
    # Made again under the same id (new MIG UUID), as idle: its counters start from zero, so a
    # window across the change reads garbage, as restarted counters would.
    again = dataclasses.replace(base.cards[0].mig_devices[2], uuid="MIG-00000000-0000-0000-0000-000000000009",
                                activity={})
    fake.set_scenario(dataclasses.replace(gone, cards=(dataclasses.replace(
        gone.cards[0], mig_devices=(*gone.cards[0].mig_devices, again)),)))
    fake.advance(10)
    fresh = _mig_sample(card, 9)
    assert _metrics_get(old, fresh, metrics=(1,))[0][1] < 0  # not the idle truth
    fake.advance(10)
    assert _metrics_get(fresh, _mig_sample(card, 9), metrics=(1,))[0][1] == 0.0


def test_a_gpu_instance_without_a_compute_instance_has_no_mig_device_and_no_data(nvml):
    base = h100_mig_processes()
    fake = nvml(dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], empty_gpu_instances=(1,)),)))
    card = handles(0)
    assert sorted(mig_handles(card)) == [0, 1, 2, 3]  # no MIG device for GPU instance 1
    fake.set_clock(0.0)
    first = _mig_sample(card, 1)
    fake.advance(5)
    # It samples, but each metric answers NO_DATA, never a measured 0 (DCGM answers blank values).
    assert [code for code, _ in _metrics_get(first, _mig_sample(card, 1))] == [pynvml.NVML_ERROR_NO_DATA] * 5


def test_a_whole_card_is_sampled_by_its_handle(nvml):
    base = h100_r570_sram_split()
    fake = nvml(dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], activity=gpm(graphics=70.0)),)))
    fake.set_clock(0.0)
    first = pynvml.nvmlGpmSampleGet(handles(0), pynvml.nvmlGpmSampleAlloc())
    fake.advance(15)
    second = pynvml.nvmlGpmSampleGet(handles(0), pynvml.nvmlGpmSampleAlloc())
    assert _metrics_get(first, second, metrics=(1, 2)) == [(0, pytest.approx(70.0)), (0, 0.0)]
    with pytest.raises(pynvml.NVMLError_NotSupported):  # no GPU instance outside MIG mode
        pynvml.nvmlGpmMigSampleGet(handles(0), 9, first)
    assert fake.exceptions == []


def test_process_utilisation_follows_the_size_query_protocol_and_the_timestamp(nvml):
    base = a100_mig_pending()
    samples = (FakeUtilSample(900, SAMPLED_AT_US, 12, 3), FakeUtilSample(900, SAMPLED_AT_US + 500_000, 20, 5),
               FakeUtilSample(901, SAMPLED_AT_US + 500_000, 7, 1))
    fake = nvml(dataclasses.replace(base, cards=(dataclasses.replace(base.cards[0], process_samples=samples),)))
    card = handles(0)
    got = pynvml.nvmlDeviceGetProcessUtilization(card, 0)
    assert [(s.pid, s.timeStamp, s.smUtil, s.memUtil) for s in got] == [
        (900, SAMPLED_AT_US, 12, 3), (900, SAMPLED_AT_US + 500_000, 20, 5), (901, SAMPLED_AT_US + 500_000, 7, 1)]
    assert [s.pid for s in pynvml.nvmlDeviceGetProcessUtilization(card, SAMPLED_AT_US)] == [900, 901]
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(card, SAMPLED_AT_US + 500_000)
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    count = ctypes.c_uint(0)
    assert fn(card, None, ctypes.byref(count), ctypes.c_ulonglong(0)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    small = (pynvml.c_nvmlProcessUtilizationSample_t * 2)()
    count.value = 2
    assert fn(card, small, ctypes.byref(count), ctypes.c_ulonglong(0)) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    assert fake.exceptions == []
