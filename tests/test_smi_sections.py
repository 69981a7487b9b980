"""``<processes>`` read apart (the plain sections of a plain report) read as lxml reads them.

The oracle is the same report parsed whole: a comment after the root element changes nothing
in the document's meaning but makes it not plain, so the parser reads every ``<process_info>``
through lxml's elements. Rows are generated with any text XML allows in a value, escaped where
XML needs it, in nvidia-smi's two layouts and in others.
"""

from __future__ import annotations

import random
import re
from xml.sax.saxutils import escape

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import fixture_bytes
from mig_exporter.core.errors import ParseError
from mig_exporter.nvidia_smi import query_xml
from mig_exporter.nvidia_smi.build import snapshot_from_smi
from mig_exporter.nvidia_smi.query_xml import parse_query_xml

BASES = {name: fixture_bytes(f"{name}.xml") for name in ("h100-mig-processes", "h200-shared-gpu-instance")}
_SECTION = re.compile(rb"<processes>.*?</processes>", re.S)
NOT_PLAIN = b"<!-- read whole -->"

# Text a driver prints, numbers at the edges of what the short ways take, and any XML character.
ODD = ["", " ", "N/A", "[N/A]", "Not Supported", "0", "7", " 7 ", "007", "4194303", "4194304", "12345678901",
       "1.5 MiB", "12 MiB", " 12 MiB", "12 MiB ", "12 GiB", "12MiB", "-3 MiB", "99999999999999999999 MiB",
       "1" * 400 + " MiB", "C", "G", "C+G", "M+C", "\u0663", "\uff17", "\u0663 MiB", "\xe9\u4e2d", "a > b", "]]",
       "\t", "x\ny", "a & b", "<b>"]
# Any character XML allows in text but CR (which it reads as LF: such a report is parsed whole anyway).
XML_CHARS = "\t\n" + "".join(map(chr, range(0x20, 0x250))) + "\u4e2d\ufffd\U0001f600"
IDS_LAYOUT = ("gpu_instance_id", "compute_instance_id", "pid", "type", "process_name", "used_memory")
OLD_LAYOUT = ("pid", "type", "process_name", "used_memory")


def _value(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(ODD)
    if rng.random() < 0.5:
        return str(rng.randrange(10 ** rng.randrange(1, 12)))
    return "".join(rng.choice(XML_CHARS) for _ in range(rng.randrange(12)))


USUAL = {
    "gpu_instance_id": lambda rng: str(rng.randrange(15)),
    "compute_instance_id": lambda rng: str(rng.randrange(8)),
    "pid": lambda rng: str(rng.randrange(1, 4_194_304)).zfill(rng.choice([0, 0, 0, 10, 11])),  # 11 digits: skipped
    "type": lambda rng: rng.choice(["C", "G", "C+G", "M+C"]),
    "process_name": lambda rng: rng.choice(["/usr/bin/python3", " llama-server ", "[not found]", "\xe9\u4e2d"]),
    "used_memory": lambda rng: f"{rng.randrange(10 ** rng.randrange(1, 8))} MiB",
}


def _row(rng: random.Random, odd: float) -> bytes:
    layout = list(rng.choice([IDS_LAYOUT, OLD_LAYOUT]))
    if rng.random() < odd / 5:  # not as nvidia-smi writes it: parsed whole
        layout.append(rng.choice(layout))
        rng.shuffle(layout)
    sep = rng.choice(["", "\n", "\n\t\t\t\t", " \t"])
    fields = "".join(f"{sep}<{tag}>{escape(_value(rng) if rng.random() < odd else USUAL[tag](rng))}</{tag}>"
                     for tag in layout)
    return f"<process_info>{fields}{sep}</process_info>".encode()


def report(rng: random.Random) -> bytes:
    """One of our fixtures with its <processes> sections' rows made up."""
    data = BASES[rng.choice(sorted(BASES))]
    parts = _SECTION.split(data)
    # How often a value or a row's layout is not as nvidia-smi writes it.
    odd = rng.choice([0.0, 0.02, 0.1, 0.5])
    sections = [b"<processes>" + b"\n".join(_row(rng, odd) for _ in range(rng.randrange(7))) + b"\n</processes>"
                for _ in parts[1:]]
    return b"".join(p + s for p, s in zip(parts, [*sections, b""], strict=True))


def _read(data: bytes) -> object:
    try:
        return parse_query_xml(data), snapshot_from_smi(data, None)
    except ParseError as e:
        return str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=2**64))
def test_sections_read_apart_read_as_the_whole_parse_reads_them(seed):
    # A seed, not hypothesis's randoms: theirs lean to the first choice, and rows would rarely vary.
    data = report(random.Random(seed))
    assert _read(data) == _read(data + NOT_PLAIN)


def test_the_generated_reports_mostly_take_the_fast_way():
    # Else the comparison above would compare the whole parse with itself.
    rng = random.Random(17)
    reports = [report(rng) for _ in range(100)]
    assert sum(query_xml._parse_fast(data) is not None for data in reports) > 30
    assert all(query_xml._parse_fast(data + NOT_PLAIN) is None for data in reports)
    assert sum(len(parse_query_xml(data).cards[0].processes) for data in reports) > 150


@pytest.mark.parametrize("bent, why", [
    (b"<!-- x -->", "a comment"),
    (b"<?pi x?>", "a processing instruction"),
    (b"<![CDATA[x]]>", "a CDATA section"),
])
def test_a_report_with_other_markup_is_parsed_whole(bent, why):
    data = BASES["h100-mig-processes"]
    at = data.index(b"<driver_version>")
    assert query_xml._parse_fast(data) is not None
    assert query_xml._parse_fast(data[:at] + bent + data[at:]) is None, why


@pytest.mark.parametrize("row, why", [
    (b"<process_info><pid>5</pid><type>C</type><process_name>a&amp;b</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "a reference"),
    (b"<process_info><pid>5</pid><type>C</type><process_name>a\rb</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "a CR, which XML reads as LF"),
    (b"<process_info><pid>5</pid><type>C</type><process_name>a\x01b</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "a character XML forbids"),
    (b"<process_info><pid>5</pid><type>C</type><process_name>a\xffb</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "bytes that are not UTF-8"),
    (b"<process_info><pid>5</pid><type>C</type><process_name>a]]>b</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "]]>, which XML forbids in text"),
    (b"<process_info><type>C</type><pid>5</pid><process_name>a</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>", "another order"),
    (b"<process_info><pid>5</pid><type>C</type><process_name>a</process_name>"
     b"<used_memory>1 MiB</used_memory></process_info>junk", "text between rows"),
])
def test_a_section_not_as_nvidia_smi_writes_it_is_parsed_whole(row, why):
    data = BASES["h100-mig-processes"]
    bent = _SECTION.sub(lambda _: b"<processes>" + row + b"</processes>", data, count=1)
    assert query_xml._parse_fast(bent) is None, why
    assert _read(bent) == _read(bent + NOT_PLAIN)


def test_a_broken_card_keeps_its_error_and_its_neighbours_read_the_fast_way():
    data = BASES["h100-mig-processes"]
    card = data[data.index(b"<gpu "):data.index(b"</gpu>") + len(b"</gpu>")]
    # A used_memory too large for a float makes the first card's reading fail.
    at = card.index(b"<used_memory>")
    broken = card[:at] + b"<used_memory>" + b"9" * 400 + b".5 MiB" + card[card.index(b"</used_memory>", at):]
    bent = data.replace(card, broken + b"\n" + card + b"\n" + card)
    assert query_xml._parse_fast(bent) is not None
    report = parse_query_xml(bent)
    assert report == parse_query_xml(bent + NOT_PLAIN)
    assert report.cards[0].error is not None and "unreadable" in report.cards[0].error
    assert [c.error for c in report.cards[1:]] == [None, None]
    assert report.cards[1].processes and report.cards[1].processes == report.cards[2].processes


def test_a_name_longer_than_libxml2_takes_fails_as_the_whole_parse_fails():
    data = BASES["h100-mig-processes"]
    bent = data.replace(b"/root/tools/memhog", b"x" * 10_000_001, 1)
    assert query_xml._parse_fast(bent) is None
    with pytest.raises(ParseError):
        parse_query_xml(bent)


# <mig_devices> and <supported_clocks>: read apart (or left out) where plain, else left to lxml.
_MIG_SECTION = re.compile(rb"<mig_devices>.*?</mig_devices>", re.S)
_CLOCKS_SECTION = re.compile(rb"<supported_clocks>.*?</supported_clocks>", re.S)
MIG_USUAL = {"index": lambda rng: str(rng.randrange(8)), "gpu_instance_id": lambda rng: str(rng.randrange(15)),
             "compute_instance_id": lambda rng: str(rng.randrange(4)),
             "total": lambda rng: f"{rng.randrange(99999)} MiB", "reserved": lambda rng: "0 MiB",
             "used": lambda rng: f"{rng.randrange(99999)} MiB", "free": lambda rng: f"{rng.randrange(99999)} MiB"}
MIG_BLOCKS = ["<device_attributes><shared><multiprocessor_count>16</multiprocessor_count><ofa_count>0</ofa_count>"
              "</shared></device_attributes>",
              "<ecc_error_count><volatile_count><sram_uncorrectable>0</sram_uncorrectable></volatile_count>"
              "</ecc_error_count>",
              "<bar1_memory_usage><total>12369 MiB</total><used>0 MiB</used></bar1_memory_usage>"]


def _mig_device(rng: random.Random, odd: float) -> str:
    def value(tag: str) -> str:
        return escape(_value(rng) if rng.random() < odd else MIG_USUAL[tag](rng))

    sep = rng.choice(["", "\n", "\n\t\t\t\t", " \t"])
    memory_tags = ["total", "reserved", "used", "free"] if rng.random() < 0.7 else ["total", "used", "free"]
    if rng.random() < odd / 3:
        rng.shuffle(memory_tags)
    memory = "".join(f"{sep}<{tag}>{value(tag)}</{tag}>" for tag in memory_tags)
    ids = [f"{sep}<{tag}>{value(tag)}</{tag}>" for tag in ("index", "gpu_instance_id", "compute_instance_id")]
    blocks = [sep + b for b in MIG_BLOCKS if rng.random() < 0.8]
    parts = [*ids, *blocks[:2], f"{sep}<fb_memory_usage>{memory}{sep}</fb_memory_usage>", *blocks[2:]]
    if rng.random() < odd / 3:  # not as nvidia-smi lays it out: left to lxml
        rng.shuffle(parts)
    return f"<mig_device>{''.join(parts)}{sep}</mig_device>"


def mig_report(rng: random.Random) -> bytes:
    """A fixture with its <mig_devices> sections made up, and its clocks at times bent."""
    data = BASES[rng.choice(sorted(BASES))]
    odd = rng.choice([0.0, 0.02, 0.1, 0.5])
    parts = _MIG_SECTION.split(data)
    sections = []
    for _ in parts[1:]:
        devices = [_mig_device(rng, odd) for _ in range(rng.randrange(5))]
        # nvidia-smi writes "None" in a section without devices.
        end = rng.choice(["\n", ""]) if devices else rng.choice(["\n\t\t\tNone\n\t\t", "", "\n"])
        sections.append(("<mig_devices>" + "\n".join(devices) + end + "</mig_devices>").encode())
    data = b"".join(p + s for p, s in zip(parts, [*sections, b""], strict=True))
    if rng.random() < 0.3:
        bent = rng.choice([b"N/A", b"<supported_mem_clock><value>1 MHz</value></supported_mem_clock>junk",
                           b"<supported_mem_clock><value>1\r MHz</value></supported_mem_clock>",
                           b"<supported_mem_clock a='1'><value>1 MHz</value></supported_mem_clock>"])
        data = _CLOCKS_SECTION.sub(lambda _: b"<supported_clocks>" + bent + b"</supported_clocks>", data)
    return data


@pytest.mark.parametrize("seed", range(300))
def test_mig_sections_read_apart_read_as_the_whole_parse_reads_them(seed):
    data = mig_report(random.Random(seed))
    assert _read(data) == _read(data + NOT_PLAIN)


def test_the_generated_mig_sections_are_mostly_read_apart():
    # Else the comparison above would compare the whole parse with itself.
    reports = [mig_report(random.Random(seed)) for seed in range(300)]
    fast = [query_xml._parse_fast(data) for data in reports]
    assert sum(f is not None and any(f[1].mig_devices) for f in fast) > 50
    assert sum(len(parse_query_xml(data).cards[0].instances) for data in reports) > 200


def test_plain_clocks_are_left_out_and_the_rest_reads_the_same():
    data = BASES["h100-mig-processes"]
    fast = query_xml._parse_fast(data)
    assert fast is not None
    clocks = fast[0].find("gpu/supported_clocks")
    assert clocks is not None and len(clocks) == 0
    assert query_xml.etree.fromstring(data).find("gpu/supported_clocks") is not None
    assert _read(data) == _read(data + NOT_PLAIN)


def test_a_section_mark_the_report_itself_carries_reads_as_any_element():
    # The whole parse ignores the marks: such a report reads its own rows, as before marks existed.
    data = BASES["h100-mig-processes"]
    bent = data.replace(b"<processes>", b'<processes mig-exporter-section="0">', 1)
    plain = parse_query_xml(data)
    assert parse_query_xml(bent) == plain and parse_query_xml(bent + NOT_PLAIN) == plain
    bent = data.replace(b"<mig_devices>", b'<mig_devices mig-exporter-section="0">', 1)
    assert parse_query_xml(bent) == plain and plain.cards[0].instances



_LONG = "a" * 50_001  # libxml2 refuses a longer name than 50,000 characters (without huge_tree)


@pytest.mark.parametrize("block, inserted", [
    ("<shared>", f"<{_LONG}>1</{_LONG}>"),
    ("<volatile_count>", f"<{_LONG}>0</{_LONG}>"),
    ("<ecc_error_count>", f"<{_LONG}><sram_uncorrectable>0</sram_uncorrectable></{_LONG}>"),
    ("<bar1_memory_usage>", f"<{_LONG}>1 MiB</{_LONG}>"),
])
def test_a_mig_tag_name_longer_than_libxml2_takes_fails_as_the_whole_parse_fails(block, inserted):
    # A MIG device's leaf or counter block so named must not be read apart from a report lxml refuses.
    data = BASES["h100-mig-processes"]
    assert block.encode() in data
    bent = data.replace(block.encode(), (block + inserted).encode(), 1)
    with pytest.raises(ParseError):
        parse_query_xml(bent)
    assert _read(bent) == _read(bent + NOT_PLAIN)


@pytest.mark.parametrize("tag", ["mig_devices", "processes"])
def test_a_foreign_mark_on_a_card_with_the_real_section_elsewhere_reads_as_the_whole_parse(tag):
    # The report's own <tag mig-exporter-section="0"/> on the card, and its real section inside
    # <pci> (where nothing reads it): the placeholder lands under <pci>, the card's marks look right.
    data = BASES["h100-mig-processes"]
    section = re.search(f"<{tag}>.*?</{tag}>".encode(), data, re.S).group()
    bent = data.replace(section, f'<{tag} {query_xml._MARK}="0"/>'.encode(), 1)
    bent = bent.replace(b"<pci>", b"<pci>" + section, 1)
    assert _read(bent) == _read(bent + NOT_PLAIN)


def test_clocks_nested_as_deep_as_libxml2_refuses_fail_as_the_whole_parse_fails():
    # libxml2 refuses a document deeper than 256 (without huge_tree): clocks left out must not
    # make such a report shallow enough to read.
    data = BASES["h100-mig-processes"]
    clocks = b"<supported_clocks><supported_mem_clock><value>1 MHz</value></supported_mem_clock></supported_clocks>"
    bent = data.replace(b"<pci>", b"<pci>" + b"<a>" * 252 + clocks + b"</a>" * 252, 1)
    with pytest.raises(ParseError):
        parse_query_xml(bent + NOT_PLAIN)
    assert _read(bent) == _read(bent + NOT_PLAIN)


@pytest.mark.parametrize("tag", ["mig_devices", "supported_clocks"])
def test_many_opening_tags_after_the_last_process_list_are_looked_at_once(monkeypatch, tag):
    """Review (issue 17): sections looked for from each opening tag of a run of them with one close
    far away cost a search (and, for MIG devices, a read of the whole rest) per tag: minutes of CPU
    for a few MB of garbage. A tag inside the section before it is passed over, as before."""
    looked: list[int] = []
    real_mig, real_clocks = query_xml._plain_mig_rows, query_xml._CLOCKS

    class Clocks:
        def fullmatch(self, *args):
            looked.append(1)
            return real_clocks.fullmatch(*args)

    monkeypatch.setattr(query_xml, "_plain_mig_rows", lambda section: looked.append(1) or real_mig(section))
    monkeypatch.setattr(query_xml, "_CLOCKS", Clocks())
    opening = f"<{tag}>".encode()
    data = (b'<?xml version="1.0" ?>\n<nvidia_smi_log><gpu id="0"><processes></processes>'
            + opening * 500 + b" " * 1000 + f"</{tag}>".encode() + b"</gpu></nvidia_smi_log>\n")
    assert query_xml._parse_fast(data) is None
    assert looked == [1]
    with pytest.raises(ParseError):
        query_xml.parse_query_xml(data)
