"""Parse ``nvidia-smi -q -x``: bytes in, one ``CardReading`` per ``<gpu>`` out.

Pure: no I/O. The layout is recognised by which elements are present, not by
the DTD version in the DOCTYPE (a 525 driver says v12 and writes v11 names).
Read from every driver from 352 (DTD v7) to 595 (v13), Linux and Windows,
vGPU guests, and MIG on and off. A card's health (heat, clocks, power limits,
memory wear) and a MIG device's own ECC counts are read by ``health_xml``.

The parser is hardened: no DTD is loaded (nvidia-smi names
``nvsmi_device_vNN.dtd``), nothing is fetched and no entity is expanded. On
top of that, an ASCII/UTF-8 document that declares entities is refused before
parsing (nvidia-smi never does, even with ``--dtd``), and so is a document in
another encoding (UTF-16), which nvidia-smi never writes either.

``<processes>`` is most of a busy report, and building its elements most of
the parse. Where the report is plain (no comments, CDATA, processing
instructions, internal DTD subset; UTF-8) and each ``<processes>`` holds
``<process_info>`` rows exactly as nvidia-smi writes them, each such section is
read by one regular expression and lxml parses the rest with a placeholder in
its place. The rows' grammar admits only well-formed XML whose text lxml would
give unchanged (no markup, reference or CR in a value), so the report reads the
same; anything else is parsed whole, as before (tests/test_parse_expectations.py).

A ``SectionMemo`` keeps what the last report's sections read apart were read as,
by their bytes: a card's processes, MIG devices and clock table rarely change
from one read to the next (an engine holds its memory for its whole life), and
the same bytes always read the same. A memo changes no result, only how often a
section is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar, cast

from lxml import etree

from mig_exporter.core.errors import ParseError
from mig_exporter.core.visible import bounded_name
from mig_exporter.model.snapshot import (
    MIB,
    NO_PID,
    CardReading,
    Memory,
    MigInstance,
    ProcessReading,
    is_process_id,
    not_a_process_id,
)
from mig_exporter.nvidia_smi.health_xml import instance_ecc, instance_ecc_blocks, read_health

_T = TypeVar("_T")

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

# The unknown markers as nvidia-smi writes them (all in UNKNOWN_TEXTS): a set lookup before the
# general check, for the health values, many of them N/A on most cards.
_MARKERS = frozenset({"N/A", "Not Supported", "Requested functionality has been deprecated", "Unknown Error"})
_UNITS_TO_BYTES = {"b": 1, "kib": 1024, "mib": MIB, "gib": 1024 * MIB}
_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z%/()]*)\s*$")
_PROCESS_NAME = re.compile(rb"(<process_name>)(.*?)(</process_name>)", re.S)
# Characters XML 1.0 forbids, which a process name may still carry.
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")

# The fast reading of <processes> (see the module's docstring).
_SECTION_OPEN, _SECTION_CLOSE = b"<processes>", b"</processes>"
# Marks where a section was taken out (a report that already holds it is parsed whole).
_MARK = "mig-exporter-section"
_MARK_BYTES = _MARK.encode()
_DECLARATION = re.compile(rb"(?:\xef\xbb\xbf)?<\?xml[^<>?]*\?>")
_DECLARED_ENCODING = re.compile(rb"encoding[ \t\r\n]*=[ \t\r\n]*([\"'])([^\"'<>]*)\1")
_PLAIN_DOCTYPE = re.compile(rb"<!DOCTYPE[^\[\]<>]*>")
_BLANK = "[ \t\r\n]*"
# A value: no markup, no reference, no CR (which lxml would turn into LF). The characters
# XML forbids are looked for in the whole section first (a shorter class is a faster match).
_VALUE = "([^<&\r]*)"
_TEXT_BYTES = bytes([0x09, 0x0A, 0x0D, *range(0x20, 0x100)])
_NONCHARACTERS = (b"\xef\xbf\xbe", b"\xef\xbf\xbf")  # U+FFFE, U+FFFF in UTF-8
# libxml2 refuses a longer text node without huge_tree; a section under it holds none.
_MOST_TEXT = 10_000_000


def _element(tag: str) -> str:
    return f"<{tag}>{_VALUE}</{tag}>{_BLANK}"


# One <process_info> as nvidia-smi writes it, with or without the instance ids
# (drivers before R450 have none), each value captured; or any other character,
# captured last, which makes the section not plain.
_ROW = re.compile(
    f"{_BLANK}(?:<process_info>{_BLANK}"
    f"(?:{_element('gpu_instance_id')}{_element('compute_instance_id')})?"
    f"{_element('pid')}{_element('type')}{_element('process_name')}{_element('used_memory')}"
    "</process_info>|(.))",
    re.S,
)
_Row = tuple[str, str, str, str, str, str, str]

# <supported_clocks>, some 110 clocks a card and half its elements, is never read: where it
# holds only clocks as nvidia-smi writes them ("<n> MHz", ASCII: no check of the characters
# needed), it is left out, as an empty element in its place, marked and checked as the sections are.
_CLOCKS_OPEN, _CLOCKS_CLOSE = b"<supported_clocks>", b"</supported_clocks>"
_CLOCK_BLANK = rb"[ \t\n]*"
_CLOCKS = re.compile(
    _CLOCK_BLANK + rb"(?:<supported_mem_clock>" + _CLOCK_BLANK + rb"<value>[0-9]{1,9} MHz</value>" + _CLOCK_BLANK
    + rb"(?:<supported_graphics_clock>[0-9]{1,9} MHz</supported_graphics_clock>" + _CLOCK_BLANK
    + rb")*</supported_mem_clock>" + _CLOCK_BLANK + rb")*"
)

# <mig_devices> read apart likewise, where each <mig_device> is laid out as nvidia-smi writes
# it (R450 to R550 at least): the ids, then the blocks below with tags without attributes,
# and values of printable ASCII without markup (no "&", "<" or ">": no reference, no "]]>"),
# so the bytes are the text lxml reads, with no check of their characters. Anything else
# in a section (captured last) leaves it to lxml.
_MIG_OPEN, _MIG_CLOSE = b"<mig_devices>", b"</mig_devices>"
_MIG_BLANK = "[ \t\n]*"
_MIG_TEXT = "[ -%'-;=?-~]*"
_MIG_PLAIN = re.compile("[ -%'-;=?-~\t\n]*")  # a section of text alone ("None": no MIG)
# A tag the grammar takes by any name: a short one (libxml2 refuses a name over 50,000 characters).
_MIG_NAME = "[a-z_]{1,200}"


def _mig_element(tag: str) -> str:
    return f"<{tag}>({_MIG_TEXT})</{tag}>{_MIG_BLANK}"


def _mig_leaf(group: str) -> str:
    return f"<(?P<{group}>{_MIG_NAME})>{_MIG_TEXT}</(?P={group})>{_MIG_BLANK}"


def _mig_block(tag: str, inner: str) -> str:
    return f"(?:<{tag}>{_MIG_BLANK}{inner}</{tag}>{_MIG_BLANK})?"


_MIG_ROW = re.compile(
    f"{_MIG_BLANK}(?:<mig_device>{_MIG_BLANK}"
    f"{_mig_element('index')}{_mig_element('gpu_instance_id')}{_mig_element('compute_instance_id')}"
    + _mig_block("device_attributes", _mig_block("shared", f"(?:{_mig_leaf('shared')})*"))
    + _mig_block("ecc_error_count",
                 f"(?P<ecc>(?:<(?P<count>{_MIG_NAME})>{_MIG_BLANK}(?:{_mig_leaf('error')})*</(?P=count)>{_MIG_BLANK})*)")
    + f"<fb_memory_usage>{_MIG_BLANK}{_mig_element('total')}(?:{_mig_element('reserved')})?"
    f"{_mig_element('used')}{_mig_element('free')}</fb_memory_usage>{_MIG_BLANK}"
    + _mig_block("bar1_memory_usage", f"(?:{_mig_leaf('bar1')})*")
    + "</mig_device>|(.))",
    re.S,
)
# index, gpu_instance_id, compute_instance_id; total, used, free, reserved (Memory's order); the
# ECC counts' blocks.
_mig_values = itemgetter(0, 1, 2, 7, 9, 10, 8, 4)
_mig_junk = itemgetter(12)
_MigRow = tuple[str, str, str, str, str, str, str, str]
# Inside an <ecc_error_count> the row's grammar admitted: its blocks, and their leaves.
_MIG_COUNT = re.compile(f"<({_MIG_NAME})>{_MIG_BLANK}((?:<{_MIG_NAME}>{_MIG_TEXT}</{_MIG_NAME}>{_MIG_BLANK})*)</")
_MIG_LEAF = re.compile(f"<({_MIG_NAME})>({_MIG_TEXT})</")


class _Read(NamedTuple):
    """A section read apart: its rows read, the problem lines reading them gave, and why
    reading them failed (what makes its card unreadable, as the card's own read would)."""

    rows: tuple[ProcessReading, ...] | tuple[MigInstance, ...]
    problems: tuple[str, ...]
    error: str | None = None


class _SectionUnreadable(Exception):
    """A section read apart that failed: its card is unreadable, for the reason given."""


class _Sections(NamedTuple):
    """The sections read apart, by the number their placeholder carries."""

    processes: list[_Read]
    mig_devices: list[_Read]


class SectionMemo:
    """What the last report's sections read apart were read as, by their bytes; at most
    that report's sections are kept. For one source's reads, one after the other: a read
    made meanwhile on another thread only finds less in it (the memo is swapped whole)."""

    __slots__ = ("clocks", "mig_devices", "processes")

    def __init__(self) -> None:
        self.processes: dict[bytes, _Read] = {}
        self.mig_devices: dict[bytes, _Read] = {}
        self.clocks: frozenset[bytes] = frozenset()


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


def parse_query_xml(data: bytes, memo: SectionMemo | None = None) -> QueryReport:
    """Parse the whole report. Raises ``ParseError`` for anything that is not one.
    ``memo``: what the last report's sections were read as, updated with this one's."""
    if not isinstance(data, bytes | bytearray):
        raise ParseError("nvidia-smi -q -x output must be bytes")
    if b"\x00" in data[:4096]:
        # UTF-16/32: nvidia-smi writes ASCII; such input would also slip past
        # the byte-level entity check below.
        raise ParseError("nvidia-smi -q -x output is not UTF-8 (NUL bytes)")
    if _declares_entities(data):
        raise ParseError("nvidia-smi -q -x output declares XML entities; refused (nvidia-smi never does)")
    data = bytes(data)
    fast = _parse_fast(data, memo)
    if fast is not None:
        root, read_apart = fast
        return _report(root, read_apart, [])
    sections = None  # a mark the report itself carries means nothing
    problems: list[str] = []
    try:
        root = _parse(data)
    except etree.XMLSyntaxError as e:
        # nvidia-smi has been seen writing raw bytes of a process's name that
        # are not UTF-8, or control characters; one such name must not cost
        # the whole read. Repair process names only, then try once more.
        repaired, count = _repair_process_names(data)
        if not count:
            raise ParseError(f"nvidia-smi -q -x output is not well-formed XML: {_one_line(str(e))}") from None
        try:
            root = _parse(repaired)
        except etree.XMLSyntaxError:
            raise ParseError(f"nvidia-smi -q -x output is not well-formed XML: {_one_line(str(e))}") from None
        problems.append(f"{count} process name(s) held bytes that are not UTF-8 text; read with replacements")
    return _report(root, sections, problems)


def _report(root: etree._Element | None, sections: _Sections | None, problems: list[str]) -> QueryReport:
    if root is None or root.tag != "nvidia_smi_log":
        tag = getattr(root, "tag", None)
        raise ParseError(f"nvidia-smi -q -x output has root <{tag}>, expected <nvidia_smi_log>")

    cards: list[CardReading] = []
    for index, gpu in enumerate(root.iterfind("gpu")):
        card_problems: list[str] = []
        try:
            cards.append(_read_card(index, gpu, sections, card_problems))
        except Exception as e:  # one unreadable card never blanks the others
            cards.append(CardReading(index=index, uuid=_text(gpu, "uuid"), name=_text(gpu, "product_name"),
                                     error=f"section unreadable: {_why(e)}"))
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


_Cut = tuple[int, int, bytes]  # a section's start and end in the report, and its placeholder


def _parse_fast(data: bytes, memo: SectionMemo | None = None) -> tuple[etree._Element, _Sections] | None:
    """The report parsed with each plain ``<processes>`` section read apart and each plain
    ``<supported_clocks>`` left out, or ``None`` where the report or a ``<processes>``
    section is not plain: the caller then parses it whole. Each ``<mig_devices>`` of rows
    as ``_MIG_ROW`` reads them is read apart as well (any other is left to lxml).

    Why this reads the same: with no comment, CDATA section, processing instruction or
    internal subset, every ``<processes>`` in the bytes is a start tag; a section of
    ``_ROW`` rows is well-formed XML that lxml would build as elements whose text is the
    captured value; and the placeholders are found where the sections were, each once, as
    ``<processes>`` children of a ``<gpu>`` of the root (where the whole parse reads them),
    so the rest parsing well-formed means the whole report does. A ``<supported_clocks>``
    matching ``_CLOCKS`` is well-formed likewise, and left as an empty element in its
    place: only what is inside it differs, and nothing read is (its tag is on no path read)."""
    if not _is_plain(data):
        return None
    known = memo or SectionMemo()
    seen = SectionMemo()  # what this report's sections read as: the memo's next content
    cut = _cut_processes(data, known, seen)
    if cut is None:
        return None
    cuts, sections = cut
    clock_starts, mig_starts = _section_starts(data, cuts)
    clocks = _cut_clocks(data, clock_starts, known, seen, cuts)
    migs = _cut_mig_devices(data, mig_starts, known, seen, cuts)
    if not cuts:
        return None  # nothing to gain
    spliced = _splice(data, cuts)
    if spliced is None:
        return None
    try:
        root = etree.fromstring(spliced, _parser())
    except (etree.LxmlError, ValueError):
        return None  # the whole parse says why
    if not _marks_in_place(root, (("processes", len(sections)), ("mig_devices", len(migs)),
                                  ("supported_clocks", clocks))):
        return None
    if memo is not None:
        memo.processes, memo.mig_devices, memo.clocks = seen.processes, seen.mig_devices, seen.clocks
    return root, _Sections(sections, migs)


def _cut_processes(data: bytes, known: SectionMemo, seen: SectionMemo) -> tuple[list[_Cut], list[_Read]] | None:
    """Each ``<processes>`` section read (or found in ``known``) and its cut, or ``None``
    where one is not plain (the report is then parsed whole)."""
    cuts: list[_Cut] = []
    sections: list[_Read] = []
    start = end = 0
    while (start := data.find(_SECTION_OPEN, end)) >= 0:
        close = data.find(_SECTION_CLOSE, start)
        if close < 0:
            return None
        section = data[start + len(_SECTION_OPEN):close]
        read = known.processes.get(section)
        if read is None:
            rows = _plain_rows(section)
            if rows is None:
                return None
            read = _processes_read(rows)
        seen.processes[section] = read
        end = close + len(_SECTION_CLOSE)
        cuts.append((start, end, b'<processes %s="%d"/>' % (_MARK_BYTES, len(sections))))
        sections.append(read)
    return cuts, sections


def _section_starts(data: bytes, cuts: list[_Cut]) -> tuple[list[int], list[int]]:
    """Where ``<supported_clocks>`` and ``<mig_devices>`` sections start. A card's MIG devices
    come early in it and its clocks just before its processes, so each is looked for between
    one card's processes and the next's (the clocks backwards from the processes): a pass over
    the whole report for each was a third of the memo's read. What follows the last
    ``<processes>`` is looked through whole (a report without any, all of it). A section not
    found so is parsed by lxml, as any other."""
    clock_starts: list[int] = []
    mig_starts: list[int] = []
    lo = 0
    for start, end, _ in cuts:
        at = data.rfind(_CLOCKS_OPEN, lo, start)
        if (mig := data.find(_MIG_OPEN, lo, at if at >= 0 else start)) >= 0:
            mig_starts.append(mig)
        if at >= 0:
            clock_starts.append(at)
        lo = end
    clock_starts += _starts(data, _CLOCKS_OPEN, lo)
    mig_starts += _starts(data, _MIG_OPEN, lo)
    return clock_starts, mig_starts


def _cut_clocks(data: bytes, starts: list[int], known: SectionMemo, seen: SectionMemo, cuts: list[_Cut]) -> int:
    """Each plain ``<supported_clocks>`` cut out (added to ``cuts``); how many."""
    clocks = last_end = 0
    clock_tables: set[bytes] = set()
    for start in starts:
        if start < last_end:
            continue  # inside the one before (not plain): a find from each would cost O(n) apiece
        close = data.find(_CLOCKS_CLOSE, start)
        if close < 0:
            break  # the parse says why
        last_end = close + len(_CLOCKS_CLOSE)
        if close - start < _MOST_TEXT:
            table = data[start + len(_CLOCKS_OPEN):close]
            if table in known.clocks or _CLOCKS.fullmatch(table):
                clock_tables.add(table)
                cuts.append((start, close + len(_CLOCKS_CLOSE),
                             b'<supported_clocks %s="%d"/>' % (_MARK_BYTES, clocks)))
                clocks += 1
    seen.clocks = frozenset(clock_tables)
    return clocks


def _cut_mig_devices(data: bytes, starts: list[int], known: SectionMemo, seen: SectionMemo,
                     cuts: list[_Cut]) -> list[_Read]:
    """Each plain ``<mig_devices>`` read (or found in ``known``) and cut out (added to ``cuts``)."""
    migs: list[_Read] = []
    last_end = 0
    for start in starts:
        if start < last_end:
            continue
        close = data.find(_MIG_CLOSE, start)
        if close < 0:
            break  # the parse says why
        last_end = close + len(_MIG_CLOSE)
        section = data[start + len(_MIG_OPEN):close]
        read = known.mig_devices.get(section)
        if read is None:
            devices = _plain_mig_rows(section)
            if devices is None:
                continue
            read = _instances_read(devices)
        seen.mig_devices[section] = read
        cuts.append((start, close + len(_MIG_CLOSE), b'<mig_devices %s="%d"/>' % (_MARK_BYTES, len(migs))))
        migs.append(read)
    return migs


def _splice(data: bytes, cuts: list[_Cut]) -> bytes | None:
    """The report with each cut section's placeholder in its place; ``None`` where one
    section lies inside another."""
    cuts.sort()
    parts: list[bytes] = []
    end = 0
    for start, close, placeholder in cuts:
        if start < end:
            return None  # one inside another
        parts += (data[end:start], placeholder)
        end = close
    parts.append(data[end:])
    return b"".join(parts)


def _marks_in_place(root: etree._Element, counts: tuple[tuple[str, int], ...]) -> bool:
    """Each placeholder once, in order, each where a card's section is read, and no other
    element with a mark anywhere (a foreign one on a card could stand for a placeholder
    that landed where nothing reads it). Clocks too: one left out deep down could make a
    report libxml2 refuses (depth) shallow enough."""
    if root.tag != "nvidia_smi_log":
        return False
    for tag, count in counts:
        found = []
        for marked in root.iter(tag):
            if (mark := marked.get(_MARK)) is not None:
                gpu = marked.getparent()
                if gpu is None or gpu.tag != "gpu" or gpu.getparent() is not root:
                    return False
                found.append(mark)
        if found != [str(i) for i in range(count)]:
            return False
    return True


def _starts(data: bytes, tag: bytes, start: int) -> list[int]:
    """Where ``tag`` occurs in ``data`` from ``start`` on, each past the one before."""
    found = []
    while (start := data.find(tag, start)) >= 0:
        found.append(start)
        start += len(tag)
    return found


def _processes_read(rows: list[_Row]) -> _Read:
    return _read_apart(lambda out, values: _add_rows(out, values, rows))


def _instances_read(rows: list[_MigRow]) -> _Read:
    def add(out: list[MigInstance], values: _Values) -> None:
        for row in rows:
            _add_instance(out, values, row[0], row[1], row[2], row[3:7], _mig_ecc(row[7]))

    return _read_apart(add)


def _mig_ecc(blocks: str) -> dict[str, dict[str, str | None]]:
    """An ``<ecc_error_count>``'s content the row's grammar admitted, as ``instance_ecc_blocks``
    reads the element: the first block of each tag, and in it the first leaf of each tag."""
    counts: dict[str, dict[str, str | None]] = {}
    for tag, leaves in _MIG_COUNT.findall(blocks):
        if tag not in counts:
            texts: dict[str, str | None] = {}
            for leaf, text in _MIG_LEAF.findall(leaves):
                texts.setdefault(leaf, text)
            counts[tag] = texts
    return counts


def _read_apart(add: Callable[[list[Any], _Values], None]) -> _Read:
    """A section's rows, as ``add`` reads them into a list, with the problem lines it gave."""
    problems: list[str] = []
    rows: list[Any] = []
    try:
        add(rows, _Values(problems))
    except Exception as e:  # a value no number holds (an infinite size): the card's read fails on it
        return _Read((), tuple(problems), _why(e))
    return _Read(tuple(rows), tuple(problems))


def _why(error: Exception) -> str:
    """Why a card's section is unreadable, as its problem line says it."""
    return _one_line(str(error)) or type(error).__name__


def _take(read: _Read, problems: list[str]) -> None:
    """A section read apart, into its card's read: its problem lines, then its failure."""
    problems.extend(read.problems)
    if read.error is not None:
        raise _SectionUnreadable(read.error)


def _is_plain(data: bytes) -> bool:
    """No comment, CDATA, processing instruction (but the declaration) or internal subset;
    UTF-8 (lxml's default, and what the rows are decoded as)."""
    declaration = _DECLARATION.match(data)
    if declaration is not None:
        encoding = _DECLARED_ENCODING.search(declaration.group())
        if b"encoding" in declaration.group() and (encoding is None or encoding.group(2).lower() != b"utf-8"):
            return False
    questions = _markup_starts(data, b"?")
    if questions != ([declaration.group().index(b"<?")] if declaration is not None else []):
        return False
    bangs = _markup_starts(data, b"!")
    return not bangs or (len(bangs) == 1 and _PLAIN_DOCTYPE.match(data, bangs[0]) is not None)


def _declares_entities(data: bytes) -> bool:
    """Whether ``<!ENTITY`` occurs, in any case: looked for from the rare ``!`` (a
    case-blind search of the whole report costs more than the rest of its checks)."""
    return any(data[at + 2:at + 8].lower() == b"entity" for at in _markup_starts(data, b"!"))


def _markup_starts(data: bytes, char: bytes) -> list[int]:
    """Where ``<`` + ``char`` occurs. By the rare second character: ``find`` of
    ``<?`` stops at every ``<`` of the report."""
    found = []
    at = data.find(char, 1)
    while at >= 0:
        if data[at - 1] == 0x3C:  # "<"
            found.append(at - 1)
        at = data.find(char, at + 1)
    return found


def _plain_text(section: bytes) -> str | None:
    """A section's content as text, or ``None`` where it is not UTF-8, has a character or
    sequence XML forbids in text, or is as long as a text node libxml2 refuses."""
    if len(section) >= _MOST_TEXT or section.translate(None, _TEXT_BYTES) or (
            b"\xef" in section and any(c in section for c in _NONCHARACTERS)):
        return None
    try:
        text = section.decode("utf-8").rstrip(" \t\r\n")
    except UnicodeDecodeError:
        return None
    return None if "]]>" in text else text


def _plain_rows(section: bytes) -> list[_Row] | None:
    """The rows of a section's content, or ``None`` where it holds anything else or is
    not plain text (``_plain_text``)."""
    text = _plain_text(section)
    if text is None:
        return None
    rows: list[_Row] = _ROW.findall(text)
    if any(map(_junk, rows)):
        return None
    return rows


_junk = itemgetter(6)


def _plain_mig_rows(section: bytes) -> list[_MigRow] | None:
    """The MIG devices of a section's content (none where it is text alone, as nvidia-smi
    writes "None" on a card without MIG), or ``None`` where it holds anything else. The
    grammar admits ASCII alone, so Latin-1 reads it as UTF-8 would."""
    if len(section) >= _MOST_TEXT:
        return None
    text = section.decode("latin-1").rstrip(" \t\n")
    if "<" not in text:
        return [] if _MIG_PLAIN.fullmatch(text) else None
    rows = _MIG_ROW.findall(text)
    if any(map(_mig_junk, rows)):
        return None
    return list(map(_mig_values, rows))


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


def _read_card(index: int, gpu: etree._Element, sections: _Sections | None, problems: list[str]) -> CardReading:
    values = _Values(problems)
    card = _Children(gpu)
    mig_current = values.flag(card, "mig_mode/current_mig")
    mig_pending = values.flag(card, "mig_mode/pending_mig")
    instances = _read_instances(gpu, sections, values)
    processes = _read_processes(gpu, sections, values)
    return CardReading(
        index=index,
        uuid=_text(card, "uuid"),
        name=_text(card, "product_name"),
        pci_bus_id=_text(card, "pci/pci_bus_id") or _attr(gpu, "id"),
        serial=_serial(card),
        mig_current=mig_current,
        mig_pending=mig_pending,
        temperature_celsius=values.number(card, "temperature/gpu_temp", "c"),
        power_draw_watts=values.first_number(card, _POWER_DRAW_PATHS, "w"),
        utilization_ratio=_percent_to_ratio(values.number(card, "utilization/gpu_util", "%")),
        memory=values.memory(card, "fb_memory_usage"),
        instances=tuple(instances),
        processes=tuple(processes or ()),
        processes_known=processes is not None,
        health=read_health(card, values),
        aggregate_denied=_denied(card, "fb_memory_usage"),
    )


# A board serial is 13 digits; anything longer is cut here, before it becomes a label.
_MOST_SERIAL_CHARS = 64


def _serial(card: _Lookup) -> str | None:
    """``<serial>``, the board's serial number (nvmlDeviceGetSerial); N/A on most GeForce cards."""
    serial = _text(card, "serial")
    return None if serial is None else serial[:_MOST_SERIAL_CHARS]


def _read_instances(gpu: etree._Element, sections: _Sections | None, values: _Values) -> list[MigInstance]:
    """The card's ``<mig_device>``s: of a section read apart, its rows; else by lxml."""
    instances: list[MigInstance] = []
    for devices in gpu.iterfind("mig_devices"):
        if sections is not None and (mark := devices.get(_MARK)) is not None:
            read = sections.mig_devices[int(mark)]
            _take(read, values.problems)
            instances.extend(cast(tuple[MigInstance, ...], read.rows))
            continue
        for el in devices.iterfind("mig_device"):
            # One pass: each child's text by tag (the first of a repeated tag, as find gives)
            # and the first memory and ECC blocks; a MIG device has few children, all but two read here.
            fields: dict[object, str | None] = {}
            block = ecc = None
            for child in el:
                tag = child.tag
                if tag not in fields:
                    fields[tag] = child.text
                    if tag == "fb_memory_usage":
                        block = child
                    elif tag == "ecc_error_count":
                        ecc = child
            sizes = None if block is None else list(map(_child_texts(block).get, _MEMORY_FIELDS))
            _add_instance(instances, values, fields.get("index"), fields.get("gpu_instance_id"),
                          fields.get("compute_instance_id"), sizes, instance_ecc_blocks(ecc))
    return instances


def _read_processes(gpu: etree._Element, sections: _Sections | None, values: _Values) -> list[ProcessReading] | None:
    """The card's ``<process_info>``s: of a section read apart, its rows; else by lxml.
    ``None`` when the driver does not list them: no ``<processes>``, or one that says ``N/A``
    (an empty list would read as an idle, free device)."""
    processes: list[ProcessReading] = []
    listed = False
    for section in gpu.iterfind("processes"):
        if section.get(_MARK) is None and len(section) == 0 and (section.text or "").strip():
            continue  # N/A, Not Supported: this section lists nothing known
        listed = True
        if sections is not None and (mark := section.get(_MARK)) is not None:
            read = sections.processes[int(mark)]
            _take(read, values.problems)
            processes.extend(cast(tuple[ProcessReading, ...], read.rows))
            continue
        for el in section.iterfind("process_info"):
            texts = _child_texts(el)
            _add_process(processes, values, texts.get("pid"), texts.get("type"), texts.get("process_name"),
                         texts.get("used_memory"), texts.get("gpu_instance_id"), texts.get("compute_instance_id"))
    return processes if listed else None


def _add_instance(instances: list[MigInstance], values: _Values, index: str | None, gi: str | None,
                  ci: str | None, sizes: Sequence[str | None] | None,
                  ecc: Mapping[str, Mapping[str, str | None]]) -> None:
    """A ``<mig_device>``'s untrimmed texts read into an instance, or a problem line;
    ``sizes``: its fb_memory_usage's in Memory's order (``None`` without the block); ``ecc``:
    its ecc_error_count's blocks, as ``instance_ecc`` takes them."""
    mig_index = values.integer_field(index, "index")
    if mig_index is None:
        values.problems.append("a MIG device without a readable index; skipped")
        return
    instances.append(MigInstance(
        mig_index,
        values.integer_field(gi, "gpu_instance_id"),
        values.integer_field(ci, "compute_instance_id"),
        Memory() if sizes is None else Memory(*[
            values.size_in(raw, "fb_memory_usage", name) for raw, name in zip(sizes, _MEMORY_FIELDS, strict=True)]),
        ecc_errors=instance_ecc(ecc, values),
    ))


def _add_process(processes: list[ProcessReading], values: _Values, pid_raw: str | None, kind: str | None,
                 name: str | None, used: str | None, gi: str | None, ci: str | None) -> None:
    """A ``<process_info>``'s untrimmed texts read into a row, or a problem line."""
    pid_text = _raw(pid_raw)
    # A pid past Linux's range is kept (a vGPU VM's: model/snapshot.py); only what no id can be
    # is skipped, saying why: empty, not an ASCII whole number (N/A, other scripts' digits),
    # negative, 0, 2^32-1 and past it.
    if not pid_text:
        why = "empty"
    elif not (pid_text.isascii() and pid_text.lstrip("-").isdigit()) or pid_text.count("-") > 1:
        why = "not a whole number"
    elif pid_text[0] == "-":
        why = "negative"
    elif len(pid_text) > 10:
        why = "longer than the 10 digits of a 32-bit process id"
    elif not is_process_id(pid := int(pid_text)):
        why = not_a_process_id(pid)
    else:
        why = ""
    if why:
        values.problems.append(f"a process with pid {pid_text[:60]!r}: {why}; skipped")
        return
    processes.append(ProcessReading(
        pid,
        _known(kind) or "",
        bounded_name(_raw(name)),  # a process names itself: 1 MiB of name is not 1 MiB in each output
        values.size_field(used, "used_memory"),
        values.integer_field(gi, "gpu_instance_id"),
        values.integer_field(ci, "compute_instance_id"),
    ))


def _add_rows(processes: list[ProcessReading], values: _Values, rows: list[_Row]) -> None:
    """A plain section's rows: ``_add_process`` for each, with the values nvidia-smi
    writes (decimal pid, "<n> MiB", decimal ids) read inline to the same result."""
    kinds: dict[str, str] = {}
    new = tuple.__new__  # a named tuple's own constructor is a Python function around it
    for gi, ci, pid_raw, kind, name, used, _ in rows:
        if not (pid_raw.isascii() and pid_raw.isdigit() and len(pid_raw) <= 10
                and 0 < (pid := int(pid_raw)) < NO_PID):
            _add_process(processes, values, pid_raw, kind, name, used, gi, ci)
            continue
        known = kinds.get(kind)
        if known is None:
            known = kinds[kind] = _known(kind) or ""
        processes.append(new(ProcessReading, (
            pid,
            known,
            bounded_name(name.strip()),  # as _add_process bounds it
            int(float(used[:-4]) * MIB) if used.endswith(" MiB") and used[:-4].isdecimal()
            else values.size_field(used, "used_memory"),
            int(gi) if gi.isdecimal() else values.integer_field(gi, "gpu_instance_id"),
            int(ci) if ci.isdecimal() else values.integer_field(ci, "compute_instance_id"),
        )))


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


_MEMORY_FIELDS = ("total", "used", "free", "reserved")  # Memory's own order


class _Children:
    """An element's children by tag, gathered in one pass; ``find`` as the element's own
    for the paths read here (``tag`` or ``tag/child``). The element's ``find`` walks the
    children again at each call, and a ``<gpu>`` has some sixty."""

    __slots__ = ("element", "first")

    def __init__(self, element: etree._Element) -> None:
        self.element = element
        # The first child of each tag; None where the tag repeats (then the path's own lookup).
        first: dict[object, etree._Element | None] = {}
        for child in element:
            tag = child.tag
            first[tag] = None if tag in first else child
        self.first = first

    def find(self, path: str) -> etree._Element | None:
        head, _, rest = path.partition("/")
        if head not in self.first:
            return None
        found = self.first[head]
        if found is None:
            return self.element.find(path)
        return found.find(rest) if rest else found

    def text(self, tag: str) -> str | None:
        """The first ``tag`` child's untrimmed text."""
        found = self.find(tag)
        return None if found is None else found.text


_Lookup = etree._Element | _Children


class _Values:
    """Reads typed values; an unreadable one becomes ``None`` and a problem line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def number(self, el: _Lookup, path: str, unit: str) -> float | None:
        found = el.find(path)
        return None if found is None else self.number_of(found.text, path, unit)

    def number_of(self, raw: str | None, path: str, unit: str) -> float | None:
        """An element's untrimmed text as a number, bare or in ``unit`` (lower case)."""
        if raw is None or raw in _MARKERS:
            return None
        # The short way for "<n> <unit>" and "<n>.<n> <unit>", as nvidia-smi writes them: the
        # value _NUMBER reads (ASCII digits, a point inside them, a finite float).
        number, space, rest = raw.partition(" ")
        if (space and rest.lower() == unit and number.isascii() and len(number) < 300
                and number.replace(".", "", 1).isdigit() and number[0] != "." and number[-1] != "."):
            return float(number)
        text = _known(raw)
        if text is None:
            return None
        m = _NUMBER.match(text)
        # 309 digits and more make an infinite float: no reading.
        if not m or m.group(2).lower() not in ("", unit) or not math.isfinite(value := float(m.group(1))):
            self.problems.append(f"{path}: unreadable value {text[:60]!r}")
            return None
        return value

    def count_of(self, raw: str | None, path: str, unit: str = "") -> int | None:
        """An element's untrimmed text as a count: a whole number of at most 20 digits (a
        64-bit counter), bare or followed by ``unit`` ("512 bank(s)")."""
        if raw is None or raw in _MARKERS:
            return None
        if not unit and raw.isascii() and raw.isdigit() and len(raw) <= 20:
            return int(raw)
        text = _known(raw)
        if text is None:
            return None
        digits = text[:-len(unit)].rstrip() if unit and text.endswith(unit) else text
        if digits.isascii() and digits.isdigit() and len(digits) <= 20:
            return int(digits)
        self.problems.append(f"{path}: unreadable count {text[:60]!r}")
        return None

    def choice(self, raw: str | None, path: str, table: Mapping[str, _T]) -> _T | None:
        """An element's untrimmed text as one of ``table``'s words (in lower case)."""
        if raw is None:
            return None
        value = table.get(raw.lower())  # the short way: no table word is an unknown marker
        if value is not None:
            return value
        text = _known(raw)
        if text is None:
            return None
        value = table.get(text.lower())
        if value is None:
            self.problems.append(f"{path}: unreadable value {text[:60]!r}")
        return value

    def known_text(self, raw: str | None) -> str | None:
        """An element's trimmed text, or ``None`` for an unknown marker (N/A, Not Supported, ...)."""
        return _known(raw)

    def first_number(self, el: _Lookup, paths: tuple[str, ...], unit: str) -> float | None:
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

    def memory(self, el: _Lookup, path: str) -> Memory:
        block = el.find(path)
        if block is None:
            return Memory()
        fields = _child_texts(block)
        return Memory(*[self.size_in(fields.get(name), path, name) for name in _MEMORY_FIELDS])

    def size_in(self, raw: str | None, block: str, name: str) -> int | None:
        """``size_field`` of a block's field; its path is only spelled out for a problem line."""
        if raw is not None and raw.endswith(" MiB") and raw[:-4].isdecimal():
            return int(float(raw[:-4]) * MIB)
        return self.size_of(_known(raw), f"{block}/{name}")

    def flag(self, el: _Lookup, path: str) -> bool | None:
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


def _raw_text(el: _Lookup, path: str) -> str:
    found = el.find(path)
    return (found.text or "").strip() if found is not None else ""


def _text(el: _Lookup, path: str) -> str | None:
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


# What nvidia-smi writes for a value the driver refused to this caller (NVML_ERROR_NO_PERMISSION).
_DENIED_TEXTS = frozenset({"insufficient permissions", "[insufficient permissions]"})


def _denied(el: _Lookup, path: str) -> bool:
    """Whether the driver refused a block's values: nvidia-smi writes "Insufficient Permissions"
    in them (a card's ``fb_memory_usage`` in a container without the MIG monitor capability)."""
    block = el.find(path)
    return block is not None and any(_raw(text).lower() in _DENIED_TEXTS for text in _child_texts(block).values())


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
