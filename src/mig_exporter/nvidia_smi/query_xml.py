"""Parse ``nvidia-smi -q -x``: bytes in, one ``CardReading`` per ``<gpu>`` out.

Pure: no I/O. The layout is recognised by which elements are present, not by
the DTD version in the DOCTYPE (a 525 driver says v12 and writes v11 names).
Read from every driver from 352 (DTD v7) to 595 (v13), Linux and Windows,
vGPU guests, and MIG on and off.

The parser is hardened: no DTD is loaded (nvidia-smi names
``nvsmi_device_vNN.dtd``), nothing is fetched and no entity is expanded. On
top of that, an ASCII/UTF-8 document that declares entities is refused before
parsing (nvidia-smi never does, even with ``--dtd``), and so is a document in
another encoding (UTF-16), which nvidia-smi never writes either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from lxml import etree

from mig_exporter.core.errors import ParseError
from mig_exporter.model.snapshot import MIB, CardReading, Memory, MigInstance, ProcessReading, is_plausible_pid

# Texts that mean "no value". Checked in lower case; anything in [brackets]
# (the CSV forms: [N/A], [Not Supported], [Unknown Error]) counts too.
UNKNOWN_TEXTS = frozenset({
    "",
    "n/a",
    "not supported",
    "requested functionality has been deprecated",
    "unknown error",
    "not found",
    "unknown",
    "insufficient permissions",
    "no permission",
    "gpu is lost",
})

_UNITS_TO_BYTES = {"b": 1, "kib": 1024, "mib": MIB, "gib": 1024 * MIB}
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z%/()]*)\s*$")
_ENTITY_DECLARATION = re.compile(rb"<!ENTITY", re.IGNORECASE)
_DIGITS = re.compile(r"^[0-9]{1,10}$")
_PROCESS_NAME = re.compile(rb"(<process_name>)(.*?)(</process_name>)", re.S)
# Characters XML 1.0 forbids, which a process name may still carry.
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


@dataclass(frozen=True, slots=True)
class QueryReport:
    """What ``nvidia-smi -q -x`` says, card by card."""

    driver_version: str | None
    cuda_version: str | None
    cards: tuple[CardReading, ...]
    problems: tuple[str, ...] = ()


def _parser() -> etree.XMLParser:
    return etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        remove_comments=True,
        remove_pis=True,
        # The indentation is about half the nodes libxml2 would build; nothing reads it.
        remove_blank_text=True,
    )


def parse_query_xml(data: bytes) -> QueryReport:
    """Parse the whole report. Raises ``ParseError`` for anything that is not one."""
    if not isinstance(data, bytes | bytearray):
        raise ParseError("nvidia-smi -q -x output must be bytes")
    if b"\x00" in data[:4096]:
        # UTF-16/32: nvidia-smi writes ASCII; such input would also slip past
        # the byte-level entity check below.
        raise ParseError("nvidia-smi -q -x output is not UTF-8 (NUL bytes)")
    if _ENTITY_DECLARATION.search(data):
        raise ParseError("nvidia-smi -q -x output declares XML entities; refused (nvidia-smi never does)")
    problems: list[str] = []
    try:
        root = _parse(bytes(data))
    except etree.XMLSyntaxError as e:
        # nvidia-smi has been seen writing raw bytes of a process's name that
        # are not UTF-8, or control characters; one such name must not cost
        # the whole read. Repair process names only, then try once more.
        repaired, count = _repair_process_names(bytes(data))
        if not count:
            raise ParseError(f"nvidia-smi -q -x output is not well-formed XML: {_one_line(str(e))}") from None
        try:
            root = _parse(repaired)
        except etree.XMLSyntaxError:
            raise ParseError(f"nvidia-smi -q -x output is not well-formed XML: {_one_line(str(e))}") from None
        problems.append(f"{count} process name(s) held bytes that are not UTF-8 text; read with replacements")
    if root is None or root.tag != "nvidia_smi_log":
        tag = getattr(root, "tag", None)
        raise ParseError(f"nvidia-smi -q -x output has root <{tag}>, expected <nvidia_smi_log>")

    cards: list[CardReading] = []
    for index, gpu in enumerate(root.iterfind("gpu")):
        card_problems: list[str] = []
        try:
            cards.append(_read_card(index, gpu, card_problems))
        except Exception as e:  # one unreadable card never blanks the others
            cards.append(CardReading(index=index, uuid=_text(gpu, "uuid"), name=_text(gpu, "product_name"),
                                     error=f"section unreadable: {_one_line(str(e)) or type(e).__name__}"))
        problems.extend(f"card {index}: {p}" for p in card_problems)
    return QueryReport(
        driver_version=_text(root, "driver_version"),
        cuda_version=_text(root, "cuda_version"),
        cards=tuple(cards),
        problems=tuple(problems),
    )


def _parse(data: bytes) -> etree._Element:
    try:
        return etree.fromstring(data, _parser())
    except ValueError as e:  # e.g. an encoding declaration lxml cannot honour
        raise ParseError(f"nvidia-smi -q -x output could not be read: {_one_line(str(e))}") from None


def _repair_process_names(data: bytes) -> tuple[bytes, int]:
    """Process names decoded leniently, stripped of characters XML forbids and
    escaped again; returns the document and how many names changed."""
    changed = 0

    def repair(m: re.Match[bytes]) -> bytes:
        nonlocal changed
        raw = m.group(2)
        text = _XML_ILLEGAL.sub("\ufffd", raw.decode("utf-8", errors="replace"))
        fixed = text.encode("utf-8")
        if fixed != raw:
            changed += 1
        return m.group(1) + fixed + m.group(3)

    return _PROCESS_NAME.sub(repair, data), changed


def _read_card(index: int, gpu: etree._Element, problems: list[str]) -> CardReading:
    values = _Values(problems)
    mig_current = values.flag(gpu, "mig_mode/current_mig")
    mig_pending = values.flag(gpu, "mig_mode/pending_mig")
    instances: list[MigInstance] = []
    # A MIG device or process is read in one pass over its children: a path
    # lookup per value was most of the parse on a node with many processes.
    for el in gpu.iterfind("mig_devices/mig_device"):
        fields = _child_texts(el)
        mig_index = values.integer_field(fields.get("index"), "index")
        if mig_index is None:
            problems.append("a MIG device without a readable index; skipped")
            continue
        instances.append(MigInstance(
            mig_index=mig_index,
            gpu_instance_id=values.integer_field(fields.get("gpu_instance_id"), "gpu_instance_id"),
            compute_instance_id=values.integer_field(fields.get("compute_instance_id"), "compute_instance_id"),
            memory=values.memory(el, "fb_memory_usage"),
        ))
    processes: list[ProcessReading] = []
    for el in gpu.iterfind("processes/process_info"):
        fields = _child_texts(el)
        pid_text = _raw(fields.get("pid"))
        pid = int(pid_text) if _DIGITS.match(pid_text) else 0
        if not is_plausible_pid(pid):
            problems.append(f"a process with pid {pid_text[:60]!r}; skipped")
            continue
        processes.append(ProcessReading(
            pid,
            _known(fields.get("type")) or "",
            _raw(fields.get("process_name")),
            values.size_field(fields.get("used_memory"), "used_memory"),
            values.integer_field(fields.get("gpu_instance_id"), "gpu_instance_id"),
            values.integer_field(fields.get("compute_instance_id"), "compute_instance_id"),
        ))
    return CardReading(
        index=index,
        uuid=_text(gpu, "uuid"),
        name=_text(gpu, "product_name"),
        pci_bus_id=_text(gpu, "pci/pci_bus_id") or _attr(gpu, "id"),
        mig_current=mig_current,
        mig_pending=mig_pending,
        temperature_celsius=values.number(gpu, "temperature/gpu_temp", "c"),
        power_draw_watts=values.first_number(gpu, _POWER_DRAW_PATHS, "w"),
        utilization_ratio=_percent_to_ratio(values.number(gpu, "utilization/gpu_util", "%")),
        memory=values.memory(gpu, "fb_memory_usage"),
        instances=tuple(instances),
        processes=tuple(processes),
    )


# Power draw moved between drivers: power_readings (<=525), gpu_power_readings
# (535+), and average/instant draws replacing power_draw (570+).
_POWER_DRAW_PATHS = (
    "gpu_power_readings/power_draw",
    "gpu_power_readings/average_power_draw",
    "gpu_power_readings/instant_power_draw",
    "power_readings/power_draw",
    "power_readings/average_power_draw",
    "power_readings/instant_power_draw",
)


class _Values:
    """Reads typed values; an unreadable one becomes ``None`` and a problem line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def number(self, el: etree._Element, path: str, unit: str) -> float | None:
        text = _text(el, path)
        if text is None:
            return None
        m = _NUMBER.match(text)
        if not m or m.group(2).lower() not in ("", unit):
            self.problems.append(f"{path}: unreadable value {text[:60]!r}")
            return None
        return float(m.group(1))

    def first_number(self, el: etree._Element, paths: tuple[str, ...], unit: str) -> float | None:
        for path in paths:
            value = self.number(el, path, unit)
            if value is not None:
                return value
        return None

    def integer_field(self, raw: str | None, path: str) -> int | None:
        """An element's untrimmed text as an integer; digits alone take the short way."""
        if raw is not None and raw.isdecimal():
            return int(raw)
        return self.integer_of(_known(raw), path)

    def integer_of(self, text: str | None, path: str) -> int | None:
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            self.problems.append(f"{path}: unreadable integer {text[:60]!r}")
            return None

    def size_field(self, raw: str | None, path: str) -> int | None:
        """An element's untrimmed text as bytes; "<digits> MiB", as nvidia-smi writes
        sizes, takes the short way to the same value."""
        if raw is not None and raw.endswith(" MiB") and raw[:-4].isdecimal():
            return int(float(raw[:-4]) * MIB)
        return self.size_of(_known(raw), path)

    def size_of(self, text: str | None, path: str) -> int | None:
        if text is None:
            return None
        m = _NUMBER.match(text)
        factor = _UNITS_TO_BYTES.get(m.group(2).lower()) if m else None
        if m is None or factor is None or m.group(1).startswith("-"):
            self.problems.append(f"{path}: unreadable size {text[:60]!r}")
            return None
        return int(float(m.group(1)) * factor)

    def memory(self, el: etree._Element, path: str) -> Memory:
        block = el.find(path)
        fields = _child_texts(block) if block is not None else {}
        return Memory(
            total_bytes=self.size_field(fields.get("total"), f"{path}/total"),
            used_bytes=self.size_field(fields.get("used"), f"{path}/used"),
            free_bytes=self.size_field(fields.get("free"), f"{path}/free"),
            reserved_bytes=self.size_field(fields.get("reserved"), f"{path}/reserved"),
        )

    def flag(self, el: etree._Element, path: str) -> bool | None:
        text = _text(el, path)
        if text is None:
            return None
        lowered = text.lower()
        if lowered == "enabled":
            return True
        if lowered == "disabled":
            return False
        self.problems.append(f"{path}: unreadable mode {text[:60]!r}")
        return None


def _raw_text(el: etree._Element, path: str) -> str:
    found = el.find(path)
    return (found.text or "").strip() if found is not None else ""


def _text(el: etree._Element, path: str) -> str | None:
    """The element's trimmed text, or ``None`` when absent or an unknown marker."""
    return _known(_raw_text(el, path))


def _child_texts(el: etree._Element) -> dict[str, str | None]:
    """Each child's untrimmed text by tag; the first of a repeated tag, as ``find`` gives."""
    texts: dict[str, str | None] = {}
    for child in el:
        # lxml builds a new string at each access. A str: a parsed tree's tags are, and
        # comments are removed (the stubs allow bytes or a QName, for a tag set by hand).
        tag = cast(str, child.tag)
        if tag not in texts:
            texts[tag] = child.text
    return texts


def _raw(text: str | None) -> str:
    return (text or "").strip()


def _known(text: str | None) -> str | None:
    """Trimmed ``text``, or ``None`` when absent or an unknown marker."""
    text = (text or "").strip()
    if text.lower() in UNKNOWN_TEXTS or (text.startswith("[") and text.endswith("]")):
        return None
    return text


def _attr(el: etree._Element, name: str) -> str | None:
    value = (el.get(name) or "").strip()
    return value or None


def _percent_to_ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
