"""Generated scenarios: the same machine as ``nvidia-smi -q -x`` and ``-L``
output and as a fake-NVML scenario (tests/fake_nvml.py).

The XML is built from the ``<gpu>`` section of
``tests/fixtures/nvidia-smi/h100-mig-processes.xml`` (hand-written in the real
driver 550 layout, DTD v12; see that directory's README), so the parser walks
a document of honest size and shape, not a skeleton: each card keeps its PCI,
ECC, clocks, power, temperature and BAR1 blocks, and its ``supported_clocks``
is a whole list (one memory clock, 110 graphics clocks) where the fixture
shortens it. Per card only identity, mode, MIG devices, memory, readings and
processes change.

Both forms describe one machine: ``NvmlSource().read()`` on the fake equals
``snapshot_from_smi()`` on the XML and listing (checked by
tests/test_benchmarks.py).
"""

from __future__ import annotations

import copy
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "fixtures" / "nvidia-smi" / "h100-mig-processes.xml"
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from fake_nvml import H100, FakeCard, FakeMemory, FakeMig, FakeNvmlScenario, FakeProcess, h100_fixture_health  # noqa: E402 - needs tests/ on sys.path

MIB = 1024 * 1024
DRIVER_VERSION = "550.90.07"
CUDA_VERSION = "12.4"
CARD_TOTAL_MIB, CARD_RESERVED_MIB = 81559, 479
# H100 80GB, seven 1g.10gb instances: GPU instance ids 7-13 (as the driver
# hands them out for this layout), one compute instance each.
MIG_PROFILE, MIG_TOTAL_MIB, MIG_OVERHEAD_MIB = "1g.10gb", 9984, 9
MIG_GPU_INSTANCE_IDS = (7, 8, 9, 10, 11, 12, 13)
# The PCI bus numbers of an 8-way HGX H100 board.
PCI_BUSES = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
PROCESS_NAMES = (
    "/usr/bin/python3",
    "/opt/conda/envs/vllm/bin/python3.11",
    "/usr/local/bin/llama-server",
    "/opt/tritonserver/bin/tritonserver",
    "/usr/local/bin/ollama",
    "/usr/lib/jvm/java-17-openjdk-amd64/bin/java",
)
# The fixture shortens supported_clocks to 8; a whole list is 1980 down to 345 MHz, 110 clocks (the
# real A100 report in the corpus lists 81).
SUPPORTED_GRAPHICS_CLOCKS_MHZ = tuple(range(1980, 344, -15))


@dataclass(frozen=True)
class Shape:
    """``cards`` H100s; each in MIG mode with ``instances`` 1g.10gb instances,
    or whole (``instances == 0``), with ``processes_per_device`` processes on
    each instance or whole card."""

    name: str
    cards: int
    instances: int
    processes_per_device: int

    @property
    def devices(self) -> int:
        return self.cards * (self.instances or 1)

    @property
    def processes(self) -> int:
        return self.devices * self.processes_per_device

    def describe(self) -> str:
        per = f"{self.instances} MIG" if self.instances else "whole"
        return f"{self.cards} card(s) x {per} x {self.processes_per_device} proc"


BIG_MIG = Shape("big-mig", 8, 7, 16)  # 56 devices, 896 processes
BIG_WHOLE = Shape("big-whole", 8, 0, 64)  # 8 devices, 512 processes
SINGLE = Shape("single", 1, 7, 1)  # one H100 in MIG mode, one process per instance
MAIN_SHAPES = (BIG_MIG, BIG_WHOLE, SINGLE)


@dataclass(frozen=True)
class _Process:
    pid: int
    name: str
    type: str
    used_mib: int


@dataclass(frozen=True)
class _Device:
    mig_index: int | None
    gpu_instance_id: int | None
    uuid: str
    total_mib: int
    used_mib: int
    processes: tuple[_Process, ...]


@dataclass(frozen=True)
class _Card:
    index: int
    uuid: str
    pci_bus_id: str
    mig: bool
    used_mib: int
    temperature_c: int
    power_mw: int
    gpu_util_percent: int | None
    memory_util_percent: int | None
    devices: tuple[_Device, ...]


def _uuid(kind: str, *numbers: int) -> str:
    # Distinct, well-formed and stable across runs: GPU-/MIG- and a UUID.
    return f"{kind}-{uuid.uuid5(uuid.NAMESPACE_OID, '/'.join(map(str, (kind, *numbers))))}"


def _machine(shape: Shape) -> list[_Card]:
    cards = []
    pid = 100_000
    for c in range(shape.cards):
        devices = []
        slots = range(shape.instances) if shape.instances else [None]
        for slot in slots:
            processes = []
            for p in range(shape.processes_per_device):
                pid += 7
                # MIG allows compute processes only; on a whole card every 8th is a
                # graphics process (a Vulkan llama.cpp).
                kind = "G" if slot is None and p % 8 == 7 else "C"
                used = (200 + (pid * 37) % 360) if slot is not None else (400 + (pid * 53) % 800)
                processes.append(_Process(pid, PROCESS_NAMES[pid % len(PROCESS_NAMES)], kind, used))
            used = sum(p.used_mib for p in processes)
            if slot is None:
                devices.append(_Device(None, None, _uuid("GPU", c), CARD_TOTAL_MIB, used, tuple(processes)))
            else:
                devices.append(_Device(slot, MIG_GPU_INSTANCE_IDS[slot % 7], _uuid("MIG", c, slot),
                                       MIG_TOTAL_MIB, used + MIG_OVERHEAD_MIB, tuple(processes)))
        mig = shape.instances > 0
        cards.append(_Card(
            index=c,
            uuid=_uuid("GPU", c),
            pci_bus_id=f"00000000:{PCI_BUSES[c % len(PCI_BUSES)]}:00.0",
            mig=mig,
            used_mib=sum(d.used_mib for d in devices),
            temperature_c=40 + c,
            power_mw=300_000 + 12_340 * c,
            gpu_util_percent=None if mig else 60 + c,
            memory_util_percent=None if mig else 30 + c,
            devices=tuple(devices),
        ))
    return cards


# -- nvidia-smi ----------------------------------------------------------------


def _set(parent: etree._Element, path: str, text: str) -> None:
    found = parent.find(path)
    if found is None:
        raise ValueError(f"template has no {path}")
    found.text = text


def _set_memory(block: etree._Element, total: int, reserved: int, used: int) -> None:
    _set(block, "total", f"{total} MiB")
    _set(block, "reserved", f"{reserved} MiB")
    _set(block, "used", f"{used} MiB")
    _set(block, "free", f"{total - reserved - used} MiB")


def _template() -> tuple[etree._Element, etree._Element]:
    root = etree.parse(str(TEMPLATE), etree.XMLParser(remove_blank_text=True)).getroot()
    gpu = root.find("gpu")
    return root, gpu


def _serial(card: _Card) -> str:
    """The card's board serial, 13 digits as NVIDIA's: ``<serial>`` in the XML, nvmlDeviceGetSerial in NVML."""
    return f"16541230{card.index:05d}"


def query_xml(shape: Shape) -> bytes:
    """``nvidia-smi -q -x`` for the shape, tab-indented as nvidia-smi writes it."""
    root, template = _template()
    mig_template = template.find("mig_devices/mig_device")
    process_template = template.find("processes/process_info")
    for gpu in root.findall("gpu"):
        root.remove(gpu)
    _set(root, "attached_gpus", str(shape.cards))
    clocks = template.find("supported_clocks/supported_mem_clock")
    for old in clocks.findall("supported_graphics_clock"):
        clocks.remove(old)
    for mhz in SUPPORTED_GRAPHICS_CLOCKS_MHZ:
        etree.SubElement(clocks, "supported_graphics_clock").text = f"{mhz} MHz"

    for card in _machine(shape):
        gpu = copy.deepcopy(template)
        gpu.set("id", card.pci_bus_id)
        bus = card.pci_bus_id.split(":")[1]
        _set(gpu, "mig_mode/current_mig", "Enabled" if card.mig else "Disabled")
        _set(gpu, "mig_mode/pending_mig", "Enabled" if card.mig else "Disabled")
        _set(gpu, "serial", _serial(card))
        _set(gpu, "uuid", card.uuid)
        _set(gpu, "minor_number", str(card.index))
        _set(gpu, "board_id", f"0x{bus}00")
        _set(gpu, "gpu_module_id", str(card.index + 1))
        _set(gpu, "pci/pci_bus", bus)
        _set(gpu, "pci/pci_bus_id", card.pci_bus_id)
        _set_memory(gpu.find("fb_memory_usage"), CARD_TOTAL_MIB, CARD_RESERVED_MIB, card.used_mib)
        for field, value in (("gpu_util", card.gpu_util_percent), ("memory_util", card.memory_util_percent)):
            _set(gpu, f"utilization/{field}", "N/A" if value is None else f"{value} %")
        if not card.mig:
            for field in ("encoder_util", "decoder_util", "jpeg_util", "ofa_util"):
                _set(gpu, f"utilization/{field}", "0 %")
        _set(gpu, "temperature/gpu_temp", f"{card.temperature_c} C")
        _set(gpu, "gpu_power_readings/power_draw", f"{card.power_mw / 1000:.2f} W")

        migs = gpu.find("mig_devices")
        for old in list(migs):
            migs.remove(old)
        if card.mig:
            for d in card.devices:
                el = copy.deepcopy(mig_template)
                _set(el, "index", str(d.mig_index))
                _set(el, "gpu_instance_id", str(d.gpu_instance_id))
                _set(el, "compute_instance_id", "0")
                for field, value in (("multiprocessor_count", "16"), ("copy_engine_count", "1"),
                                     ("decoder_count", "1"), ("jpg_count", "1")):
                    _set(el, f"device_attributes/shared/{field}", value)
                _set_memory(el.find("fb_memory_usage"), d.total_mib, 0, d.used_mib)
                migs.append(el)
        else:
            migs.text = "None"

        processes = gpu.find("processes")
        for old in list(processes):
            processes.remove(old)
        for d in card.devices:
            for p in d.processes:
                el = copy.deepcopy(process_template)
                _set(el, "gpu_instance_id", "N/A" if d.gpu_instance_id is None else str(d.gpu_instance_id))
                _set(el, "compute_instance_id", "N/A" if d.gpu_instance_id is None else "0")
                _set(el, "pid", str(p.pid))
                _set(el, "type", p.type)
                _set(el, "process_name", p.name)
                _set(el, "used_memory", f"{p.used_mib} MiB")
                processes.append(el)
        root.append(gpu)

    etree.indent(root, space="\t")
    for gpu in root.findall("gpu"):
        gpu.tail = "\n\n\t" if gpu.getnext() is not None else "\n\n"
        processes = gpu.find("processes")
        if len(processes) == 0:  # nvidia-smi writes an empty list open and closed, never <processes/>
            processes.text = "\n\t\t"
    header = b'<?xml version="1.0" ?>\n<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n'
    return header + etree.tostring(root) + b"\n"


def listing(shape: Shape) -> bytes:
    """``nvidia-smi -L`` for the shape."""
    lines = []
    for card in _machine(shape):
        lines.append(f"GPU {card.index}: {H100['name']} (UUID: {card.uuid})")
        if card.mig:
            for d in card.devices:
                lines.append(f"  MIG {MIG_PROFILE:<12}Device {d.mig_index:>2}: (UUID: {d.uuid})")
    return ("\n".join(lines) + "\n").encode()


def pmon(shape: Shape) -> bytes:
    """``nvidia-smi pmon -c 1 -s u`` for the shape, in driver 590's 10-column layout
    (tests/fixtures/nvidia-smi-pmon/): every process of a whole card, one in four idle (``-``, as
    the driver prints a process it has no sample of); a card in MIG mode, every column ``-``."""
    lines = ["# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command ",
             "# Idx           #    C/G      %      %      %      %      %      %    name "]
    for card in _machine(shape):
        for d in card.devices:
            for p in d.processes:
                busy = not card.mig and p.pid % 4 != 0
                sm, mem = (f"{p.pid % 97:>2}", f"{p.pid % 41:>2}") if busy else (" -", " -")
                lines.append(f"  {card.index:>3} {p.pid:>11}  {p.type:>5}     {sm}     {mem}      -      -      -"
                             f"      -    {p.name[:15]:<15}")
    return ("\n".join(lines) + "\n").encode()


# -- NVML ----------------------------------------------------------------------


def _memory(total: int, reserved: int, used: int) -> FakeMemory:
    return FakeMemory(total * MIB, reserved * MIB, used * MIB, (total - reserved - used) * MIB)


def nvml_scenario(shape: Shape) -> FakeNvmlScenario:
    """The same machine for tests/fake_nvml.py."""
    cards = []
    names: dict[int, str] = {}
    for card in _machine(shape):
        for d in card.devices:
            names.update((p.pid, p.name) for p in d.processes)
        migs = tuple(
            FakeMig(
                d.mig_index, d.gpu_instance_id, 0, MIG_PROFILE, d.uuid, _memory(d.total_mib, 0, d.used_mib),
                compute_processes=tuple(FakeProcess(p.pid, p.used_mib * MIB) for p in d.processes),
                sram_uncorrectable_volatile=0,  # the template's mig_device ecc_error_count
            )
            for d in card.devices if card.mig
        )
        whole = () if card.mig else card.devices[0].processes
        cards.append(FakeCard(
            **H100,
            uuid=card.uuid,
            pci_bus_id=card.pci_bus_id,
            serial=_serial(card),
            memory=_memory(CARD_TOTAL_MIB, CARD_RESERVED_MIB, card.used_mib),
            mig_mode=(card.mig, card.mig),
            temperature_c=card.temperature_c,
            power_mw=card.power_mw,
            gpu_util_percent=card.gpu_util_percent,
            memory_util_percent=card.memory_util_percent,
            compute_processes=tuple(FakeProcess(p.pid, p.used_mib * MIB) for p in whole if p.type == "C"),
            graphics_processes=tuple(FakeProcess(p.pid, p.used_mib * MIB) for p in whole if p.type == "G"),
            mig_devices=migs,
            health=h100_fixture_health(),  # the template's card: what our read and nvitop's ask of it
        ))
    major, minor = CUDA_VERSION.split(".")
    return FakeNvmlScenario(
        driver_version=DRIVER_VERSION,
        cuda_version=int(major) * 1000 + int(minor) * 10,
        cards=tuple(cards),
        process_names=names,
    )
