"""A read remembers what the last report's process lists, MIG devices and clock tables were read
as, by their bytes, and the last ``-L`` listing (nvidia_smi/build.py's ReadMemo): unchanged parts
are not read again, changed ones are, and the snapshot is the one a read without memory makes.
tests/test_parse_expectations.py checks that over every fixture, corpus file and variant."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from mig_exporter.core.errors import ParseError
from mig_exporter.model.snapshot import MIB
from mig_exporter.nvidia_smi.build import ReadMemo, snapshot_from_smi
from mig_exporter.nvidia_smi.query_xml import SectionMemo, parse_query_xml

XML = (FIXTURES / "h100-mig-processes.xml").read_bytes()
LISTING = (FIXTURES / "h100-mig-processes.L.txt").read_bytes()


def test_an_unchanged_report_reads_the_same_from_what_was_kept():
    memo = ReadMemo()
    first = snapshot_from_smi(XML, LISTING, None, memo)
    again = snapshot_from_smi(XML, LISTING, None, memo)
    assert again == first == snapshot_from_smi(XML, LISTING)
    assert [p.pid for p in again.processes] == [21180, 21181, 21198]
    # What was kept is what is given: the rows were not read again.
    sections = SectionMemo()
    before = parse_query_xml(XML, sections).cards[0]
    after = parse_query_xml(XML, sections).cards[0]
    assert after.processes[0] is before.processes[0]
    assert after.instances[0] is before.instances[0]


def test_a_changed_process_list_is_read_again_and_the_rest_is_kept():
    sections = SectionMemo()
    before = parse_query_xml(XML, sections).cards[0]
    changed = XML.replace(b"<used_memory>2296 MiB</used_memory>", b"<used_memory>2297 MiB</used_memory>")
    assert changed != XML
    after = parse_query_xml(changed, sections).cards[0]
    assert {p.pid: p.used_bytes for p in after.processes}[21180] == 2297 * MIB
    assert after == parse_query_xml(changed).cards[0]
    assert after.instances[0] is before.instances[0]  # the MIG devices did not change


def test_a_changed_instance_ecc_count_is_read_again_and_the_processes_are_kept():
    sections = SectionMemo()
    before = parse_query_xml(XML, sections).cards[0]
    # The fixture's first <mig_device> is MIG device 1.
    changed = XML.replace(b"<sram_uncorrectable>0</sram_uncorrectable>", b"<sram_uncorrectable>2</sram_uncorrectable>",
                          1)
    assert changed != XML
    after = parse_query_xml(changed, sections).cards[0]
    assert {i.mig_index: [e.errors for e in i.ecc_errors] for i in after.instances} == {1: [2], 0: [0], 2: [0], 3: [0]}
    assert after == parse_query_xml(changed).cards[0] == parse_query_xml(changed + b"<!-- read whole -->").cards[0]
    assert after.processes[0] is before.processes[0]  # the processes did not change


def test_only_the_last_reports_sections_are_kept():
    sections = SectionMemo()
    parse_query_xml(XML, sections)
    assert len(sections.processes) == 1 and len(sections.mig_devices) == 1
    changed = XML.replace(b"<pid>21180</pid>", b"<pid>21190</pid>")
    parse_query_xml(changed, sections)
    (kept,) = sections.processes
    assert b"<pid>21190</pid>" in kept and b"<pid>21180</pid>" not in kept


def test_a_kept_section_gives_its_problem_lines_again():
    bad_pid = XML.replace(b"<pid>21198</pid>", b"<pid>0</pid>")
    memo = ReadMemo()
    for _ in range(2):
        snapshot = snapshot_from_smi(bad_pid, LISTING, None, memo)
        assert "card 0: a process with pid '0': no process has id 0; skipped" in snapshot.problems
        assert [p.pid for p in snapshot.processes] == [21180, 21181]
        assert snapshot == snapshot_from_smi(bad_pid, LISTING)


def test_a_section_no_number_can_hold_fails_its_card_at_every_read():
    # 400 digits: float() makes it infinite, and int() of that raises, as in the card's own read.
    huge = XML.replace(b"<used_memory>2296 MiB</used_memory>", b"<used_memory>" + b"9" * 400 + b" MiB</used_memory>")
    memo = ReadMemo()
    for _ in range(2):
        snapshot = snapshot_from_smi(huge, LISTING, None, memo)
        assert snapshot == snapshot_from_smi(huge, LISTING)
        assert snapshot.cards[0].error == "section unreadable: cannot convert float infinity to integer"
        assert snapshot.devices == () and snapshot.processes == ()


def test_the_listing_is_kept_while_its_bytes_stay_the_same():
    memo = ReadMemo()
    snapshot_from_smi(XML, LISTING, None, memo)
    kept = memo.listing
    assert kept is not None and kept[0] == LISTING
    snapshot_from_smi(XML, LISTING, None, memo)
    assert memo.listing is kept
    profiles = [d.profile for d in snapshot_from_smi(XML, LISTING.replace(b"1g.10gb", b"1g.12gb"), None, memo).devices]
    assert "1g.12gb" in profiles


def test_a_listing_that_cannot_be_read_is_not_kept():
    memo = ReadMemo()
    snapshot_from_smi(XML, LISTING, None, memo)
    garbage = b"Failed to initialize NVML: Driver/library version mismatch\n"
    with pytest.raises(ParseError):
        memo.parse_list(garbage)
    snapshot = snapshot_from_smi(XML, garbage, None, memo)
    assert "nvidia-smi -L line 1 is not a GPU or MIG line" in snapshot.problems[0]
    assert memo.listing is not None and memo.listing[0] == LISTING
